"""A :class:`~._plan.Plan` over Mooncake's transfer engine: bucket bytes by one-sided writes.

The optional RDMA-class data plane of the shard-aware transport (the
``mooncake-transfer-engine-non-cuda`` wheel, its ``tcp`` protocol on CPU; it needs
the ``libibverbs1`` system package). Same plan, same callbacks, same result and
errors as :func:`~._p2p.run_plan`; only the buckets' bytes move differently. The
``torch.distributed`` group still carries the control messages (gloo on CPU: the
sync group's ``ctrl``). Between every sender and every receiver, in this order::

    handshake  int64[9] both ways      as run_plan's (plan digest, counts)
    endpoint   int64[12] receiver->    magic, rpc port, slot 0 address, slot bytes,
               sender                  hostname (64 bytes)
    bucket k   Mooncake write          sender's staging slot -> receiver's slot k % 2
    ready k    int64[4] sender->       magic, k, status (the write is complete), 0
    free k     int64[4] receiver->     magic, k, 0, 0 (slot k % 2 handed to the sink)
    finish     int64[4] both ways      as run_plan's (status, payload bytes)

Each receiver registers one buffer with two slots per sender (each the pair's
largest bucket) and publishes it in its endpoint message; each sender registers
one staging buffer with two slots per receiver. A sender packs bucket ``k`` into
its slot ``k % 2``, writes it into the receiver's slot ``k % 2`` once the
receiver freed bucket ``k - 2`` there, and says ``ready k`` when the write is
complete; it packs step ``k + 1`` while step ``k``'s writes are on the wire, so
two buckets are in flight per pair. A sender whose ``source`` raised writes
nothing more but still says ``ready`` (with an error status), so no receiver
waits for a bucket that never comes. Every wait, of a message or of a write, is
bounded by ``timeout_s``. Mooncake's failures are translated in one place
(:func:`_translate_mooncake`) into the executor's own :class:`~._p2p.LinkLost` and
:class:`~._p2p.LinkTimeout`. The shard-aware transport: ``docs/topology.md``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aiosync._config import PACK_ALIGNMENT_BYTES
from aiosync.errors import SyncError, TransportError

from ._p2p import (
    _ERROR,
    _OK,
    LinkLost,
    LinkTimeout,
    P2PResult,
    SinkFn,
    SourceFn,
    _describe,
    _handshake,
    _Link,
    _packing_failure,
    _Receiver,
    _Sender,
    check_call,
    conclude_receiver,
    conclude_sender,
)
from ._plan import Plan, TransferBucket

__all__ = ["mooncake_available", "run_plan_mooncake"]

#: Where a process is reached by its peers' transfer engines unless told otherwise.
DEFAULT_HOSTNAME = "127.0.0.1"

_MAGIC = 0x6169_6F73_6D63_0001  # "aiosmc" + wire format 1
_HOST_BYTES = 64
_ENDPOINT_LEN = 4 + _HOST_BYTES // 8

#: Bounds of the sleep between two polls of a write's status, seconds.
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 1e-3

_engines: dict[str, Any] = {}
_engines_lock = threading.Lock()
#: Buffers a peer's engine may still read or write after a failed call: kept for
#: the process's life rather than freed under an in-flight transfer.
_abandoned: list[torch.Tensor] = []


def mooncake_available() -> str | None:
    """None when Mooncake's transfer engine can be imported here, else the reason (a sentence)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as exc:
        text = str(exc)
        if "libibverbs" in text:
            return f"Mooncake's engine needs the libibverbs1 system package: {text}"
        return f"pip install mooncake-transfer-engine-non-cuda (import failed: {text})"
    return None


def _engine(hostname: str) -> Any:
    """This process's transfer engine listening on ``hostname`` (made once, kept)."""
    with _engines_lock:
        engine = _engines.get(hostname)
        if engine is not None:
            return engine
        reason = mooncake_available()
        if reason is not None:
            raise TransportError(reason)
        from mooncake.engine import TransferEngine

        engine = TransferEngine()
        # P2P handshake: no metadata server; peers fetch segments from the rpc port.
        rc = engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransportError(f"Mooncake's engine did not start on {hostname} (code {rc})")
        _engines[hostname] = engine
        return engine


def _translate_mooncake(code: int | Exception, what: str) -> SyncError:
    """A Mooncake failure code or exception as aiosync's (the one place this is decided).

    ``transfer_check_status`` says -2 for a transfer its engine timed out, -1 for
    one that failed (the peer is gone, or refused the address); a submit that
    returns no batch (0 or negative) could not reach the peer at all; the binding
    raises for a call it cannot even make.
    """
    if isinstance(code, Exception):
        return LinkLost(f"{what}: {code}")
    if code == -2:
        return LinkTimeout(f"{what}: Mooncake timed the transfer out")
    return LinkLost(f"{what}: Mooncake transfer failed (code {code})")


def _submit_write(
    engine: Any, segment: str, local: int, remote: int, nbytes: int, what: str
) -> int:
    """Start writing ``nbytes`` from ``local`` to ``remote`` in ``segment``; the batch id.

    Raises:
        LinkLost: the peer cannot be reached (no batch).
    """
    try:
        batch = engine.transfer_submit_write(segment, local, remote, nbytes)
    except Exception as exc:
        raise _translate_mooncake(exc, what) from exc
    if batch is None or batch <= 0:
        raise _translate_mooncake(batch or 0, what)
    return int(batch)


def _wait_write(engine: Any, batch: int, timeout_s: float, what: str) -> None:
    """Poll a write of :func:`_submit_write` until it is complete, at most ``timeout_s``.

    Raises:
        LinkLost: the write failed (the peer is gone, or refused the address).
        LinkTimeout: Mooncake timed it out, or it ran past ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    pause = _POLL_MIN_S
    while True:
        try:
            status = engine.transfer_check_status(batch)
        except Exception as exc:
            raise _translate_mooncake(exc, what) from exc
        if status == 1:
            return
        if status < 0:
            raise _translate_mooncake(status, what)
        if time.monotonic() > deadline:
            raise LinkTimeout(f"{what}: not complete after {timeout_s} s")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_S)


class _Region:
    """One registered uint8 CPU buffer cut into slots: 2 per peer, each its largest bucket."""

    def __init__(self, engine: Any, largest: dict[int, int]) -> None:
        self.engine = engine
        # Slots start on the plan's alignment, as a bucket's transfers do in it.
        align = PACK_ALIGNMENT_BYTES
        self.slot_bytes = {peer: -(-n // align) * align for peer, n in largest.items()}
        self.offsets: dict[int, int] = {}
        total = 0
        for peer in sorted(self.slot_bytes):
            self.offsets[peer] = total
            total += 2 * self.slot_bytes[peer]
        self.tensor = torch.empty(total, dtype=torch.uint8)
        self.registered = False
        if total:
            rc = engine.register_memory(self.tensor.data_ptr(), total)
            if rc != 0:
                raise TransportError(f"Mooncake refused to register {total} bytes (code {rc})")
            self.registered = True

    def slot(self, peer: int, slot: int) -> torch.Tensor:
        start = self.offsets[peer] + slot * self.slot_bytes[peer]
        return self.tensor[start : start + self.slot_bytes[peer]]

    def address(self, peer: int) -> int:
        """Address of ``peer``'s slot 0 (slot 1 follows it)."""
        return int(self.tensor.data_ptr()) + self.offsets[peer]

    def close(self, clean: bool) -> None:
        """Unregister; unless ``clean`` (no transfer can still touch it), keep the memory."""
        if self.registered:
            self.engine.unregister_memory(self.tensor.data_ptr())
            self.registered = False
        if not clean:
            _abandoned.append(self.tensor)


@dataclass(frozen=True, slots=True)
class _Endpoint:
    """Where a sender writes a receiver's buckets: its segment and its slot 0."""

    segment: str
    address: int
    slot_bytes: int

    def to_tensor(self) -> torch.Tensor:
        host, port = self.segment.rsplit(":", 1)
        raw = host.encode()
        if len(raw) > _HOST_BYTES:
            raise ValueError(f"hostname {host!r} is longer than {_HOST_BYTES} bytes")
        name = torch.frombuffer(bytearray(raw.ljust(_HOST_BYTES, b"\0")), dtype=torch.int64)
        head = torch.tensor([_MAGIC, int(port), self.address, self.slot_bytes])
        return torch.cat([head, name])

    @classmethod
    def from_tensor(cls, t: torch.Tensor, who: str) -> _Endpoint:
        magic, port, address, slot_bytes = t[:4].tolist()
        if magic != _MAGIC:
            raise TransportError(f"bad endpoint message from {who}: not a Mooncake data plane")
        host = t[4:].numpy().tobytes().rstrip(b"\0").decode()
        return cls(f"{host}:{port}", address, slot_bytes)


def _message(step: int, status: int = _OK) -> torch.Tensor:
    return torch.tensor([_MAGIC, step, status, 0])


def _read_message(t: torch.Tensor, step: int, what: str) -> int:
    """The status of a ready/free message that must be for ``step``."""
    magic, got, status, _ = t.tolist()
    if magic != _MAGIC or got != step:
        raise TransportError(f"{what}: bad control message (step {got}, expected {step})")
    return int(status)


class _InRegion:
    """A side of :func:`run_plan_mooncake` whose buffers are slots of its registered
    :class:`_Region`, unregistered when the call ends (and its memory kept unless the
    call :meth:`_settle`-d: a peer's write may still land in it)."""

    region: _Region
    #: True once the finish is exchanged: no write of this call can touch the region.
    settled = False

    def _buffer(self, peer: int, slot: int, nbytes: int) -> torch.Tensor:
        return self.region.slot(peer, slot)[:nbytes]

    def _settle(self) -> None:
        self.settled = True

    def run(self) -> P2PResult:
        try:
            return self._run()
        finally:
            self.region.close(self.settled)

    def _run(self) -> P2PResult:
        raise NotImplementedError


class _MooncakeSender(_InRegion, _Sender):
    """One sender's side of :func:`run_plan_mooncake` (see the module docstring)."""

    def __init__(self, link: _Link, engine: Any, plan: Plan, me: int, source: SourceFn) -> None:
        super().__init__(link, plan, me, source)
        self.engine = engine
        self.region = _Region(
            engine,
            {
                w: max((b.nbytes for b in plan.buckets_between(me, w)), default=0)
                for w in range(plan.num_receivers)
            },
        )

    def _stage(self, bucket: TransferBucket, slot: int) -> torch.Tensor:
        """The bucket's bytes in this sender's registered slot (a lone box is copied in)."""
        buf = self._pack(bucket, slot)
        staged = self._buffer(bucket.dst, slot, bucket.nbytes)
        if buf.data_ptr() != staged.data_ptr():
            staged.copy_(buf)
        return staged

    def _endpoints(self, peers: Sequence[int]) -> dict[int, _Endpoint]:
        senders = self.plan.num_senders
        ins = {p: torch.zeros(_ENDPOINT_LEN, dtype=torch.int64) for p in peers}
        ops = [("recv", ins[p], p) for p in peers]
        works = self.link.post(ops, "posting the endpoint receives")
        out: dict[int, _Endpoint] = {}
        for work, p in zip(works, peers, strict=True):
            who = _describe(p, senders)
            self.link.wait(work, f"endpoint from {who}")
            out[p - senders] = _Endpoint.from_tensor(ins[p], who)
        return out

    def _run(self) -> P2PResult:
        plan, me, senders = self.plan, self.me, self.plan.num_senders
        receivers = plan.num_receivers
        link = self.link
        order = [(me + k) % receivers for k in range(receivers)]
        peers = [senders + w for w in order]
        _handshake(link, plan, me, peers)
        ends = self._endpoints(peers)
        lists = {w: plan.buckets_between(me, w) for w in order}
        steps = max((len(b) for b in lists.values()), default=0)
        # Posted receives of each (receiver, step)'s free message.
        frees: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        # Ready sends not yet waited for (the tensors must outlive them).
        readies: list[tuple[Any, torch.Tensor, int]] = []
        sent = dict.fromkeys(range(receivers), 0)
        failure: SyncError | None = None
        count = 0

        def wait_free(w: int, step: int) -> None:
            work, t = frees.pop((w, step))
            what = f"free of bucket {step} from inference worker {w}"
            link.wait(work, what)
            _read_message(t, step, what)

        def complete(step: int, writes: list[tuple[int, int | None]]) -> None:
            """Wait for step's writes, then say ready and post the frees' receives."""
            ops: list[tuple[str, torch.Tensor, int]] = []
            for w, batch in writes:
                if batch is not None:
                    what = f"write of bucket {step} to inference worker {w}"
                    _wait_write(self.engine, batch, link.timeout_s, what)
                ok = batch is not None
                ops.append(("send", _message(step, _OK if ok else _ERROR), senders + w))
                ops.append(("recv", torch.zeros(4, dtype=torch.int64), senders + w))
            works = link.post(ops, f"posting the ready messages of step {step}")
            for work, (kind, t, peer) in zip(works, ops, strict=True):
                if kind == "send":
                    readies.append((work, t, peer))
                else:
                    frees[(peer - senders, step)] = (work, t)

        previous: list[tuple[int, int | None]] = []
        for step in range(steps):
            slot = step % 2
            writes: list[tuple[int, int | None]] = []
            for w in order:
                if step >= len(lists[w]):
                    continue
                bucket = lists[w][step]
                if step >= 2:  # the receiver's slot holds bucket k-2 until it frees it
                    wait_free(w, step - 2)
                batch: int | None = None
                if failure is None:
                    try:
                        buf = self._stage(bucket, slot)
                    except Exception as exc:
                        failure = _packing_failure(exc, me, senders, step, w)
                    else:
                        end = ends[w]
                        what = f"write of bucket {step} to inference worker {w}"
                        remote = end.address + slot * end.slot_bytes
                        batch = _submit_write(
                            self.engine, end.segment, buf.data_ptr(), remote, bucket.nbytes, what
                        )
                writes.append((w, batch))
                sent[w] += bucket.payload_bytes
                count += 1
            # Step k-1's writes were on the wire while step k was packed.
            complete(step - 1, previous)
            previous = writes
        complete(steps - 1, previous)
        for w, step in sorted(frees):
            wait_free(w, step)
        for work, _, peer in readies:
            link.wait(work, f"ready message to {_describe(peer, senders)}")
        readies.clear()
        # Once the finish is exchanged every write is complete: the staging buffer is free.
        return conclude_sender(link, plan, me, peers, failure, sent, count, self._settle)


class _MooncakeReceiver(_InRegion, _Receiver):
    """One receiver's side of :func:`run_plan_mooncake` (see the module docstring)."""

    def __init__(
        self, link: _Link, engine: Any, hostname: str, plan: Plan, me: int, sink: SinkFn
    ) -> None:
        super().__init__(link, plan, me, sink)
        self.engine = engine
        self.segment = f"{hostname}:{engine.get_rpc_port()}"
        self.region = _Region(
            engine,
            {
                s: max((b.nbytes for b in plan.buckets_between(s, self.worker)), default=0)
                for s in range(plan.num_senders)
            },
        )

    def _run(self) -> P2PResult:
        plan, senders, link = self.plan, self.plan.num_senders, self.link
        peers = list(range(senders))
        _handshake(link, plan, self.me, peers)
        ends = [
            ("send", _Endpoint(self.segment, self.region.address(s), slot).to_tensor(), s)
            for s, slot in sorted(self.region.slot_bytes.items())
        ]
        lists = {src: plan.buckets_between(src, self.worker) for src in peers}
        steps = max((len(b) for b in lists.values()), default=0)

        def post_readies(step: int) -> list[tuple[int, Any, torch.Tensor]]:
            ops = [
                ("recv", torch.zeros(4, dtype=torch.int64), src)
                for src in peers
                if step < len(lists[src])
            ]
            works = link.post(ops, f"posting the ready receives of step {step}")
            return [(peer, work, t) for work, (_, t, peer) in zip(works, ops, strict=True)]

        posted = {0: post_readies(0)} if steps else {}
        for work, (_, _, peer) in zip(link.post(ends, "posting the endpoints"), ends, strict=True):
            link.wait(work, f"endpoint to {_describe(peer, senders)}")
        received = dict.fromkeys(peers, 0)
        failure: BaseException | None = None
        count = 0
        frees: list[tuple[Any, torch.Tensor, int]] = []
        for step in range(steps):
            if step + 1 < steps:
                posted[step + 1] = post_readies(step + 1)
            for src, work, t in posted.pop(step):
                what = f"ready of bucket {step} from trainer rank {src}"
                link.wait(work, what)
                written = _read_message(t, step, what) == _OK
                bucket = lists[src][step]
                received[src] += bucket.payload_bytes
                count += 1
                if failure is None and written:
                    try:
                        self._deliver(bucket, self._buffer(src, step % 2, bucket.nbytes))
                    except Exception as exc:  # keep draining: the senders are mid-stream
                        failure = exc
                free = _message(step)
                (handle,) = link.post([("send", free, src)], f"posting the free of step {step}")
                frees.append((handle, free, src))
        for handle, _, src in frees:
            link.wait(handle, f"free message to trainer rank {src}")
        # Once the finish is exchanged every sender's writes are complete: nobody writes here.
        return conclude_receiver(link, plan, self.me, failure, received, count, self._settle)


def run_plan_mooncake(
    plan: Plan,
    group: Any,
    rank: int,
    *,
    source: SourceFn | None = None,
    sink: SinkFn | None = None,
    timeout_s: float,
    hostname: str = DEFAULT_HOSTNAME,
) -> P2PResult:
    """Move this rank's share of ``plan``, buckets over Mooncake (blocking; every rank calls it).

    What :func:`~._p2p.run_plan` does, with the same roles, callbacks, result and
    errors; the buckets' bytes go by Mooncake writes (``tcp`` protocol, host
    memory) and only the small control messages over ``group`` (see the module
    docstring). ``source`` tensors may live on any device (each box is copied
    into host staging); ``sink`` gets CPU views.

    Args:
        plan: the plan, from :func:`~._plan.make_plan` on every rank.
        group: a gloo group of ``T + W`` ranks for the control messages: a
            ``torch.distributed`` process group or a bare ``ProcessGroupGloo``
            (the sync group's ``ctrl``).
        rank: this process's rank in ``group``.
        source: on a sender, ``hf_name -> local tensor`` (see :data:`~._p2p.SourceFn`).
        sink: on a receiver, stores one received box (see :data:`~._p2p.SinkFn`).
        timeout_s: limit of each wait (a control message, a bucket's write), seconds.
        hostname: the address this process's transfer engine listens on and
            its peers reach it at (its engine is made on first use and kept).

    Returns:
        What this rank moved (bytes per peer equal ``plan.pair_bytes``).

    Raises:
        ValueError: ``rank`` or ``group`` do not fit the plan, the role's
            callable is missing, or ``timeout_s`` is not positive.
        TransportError: Mooncake is not usable here (:func:`mooncake_available`),
            or a peer died or failed (as :func:`~._p2p.run_plan`; a lost link is
            a :class:`~._p2p.LinkLost`).
        RefitMismatchError, SyncTimeoutError, Exception: as :func:`~._p2p.run_plan`.
    """
    check_call(plan, group, rank, timeout_s)
    is_sender = rank < plan.num_senders
    if is_sender and source is None:
        raise ValueError(f"{_describe(rank, plan.num_senders)} needs a source")
    if not is_sender and sink is None:
        raise ValueError(f"{_describe(rank, plan.num_senders)} needs a sink")
    engine = _engine(hostname)
    link = _Link(group, timeout_s, torch.device("cpu"))
    if is_sender:
        assert source is not None
        return _MooncakeSender(link, engine, plan, rank, source).run()
    assert sink is not None
    return _MooncakeReceiver(link, engine, hostname, plan, rank, sink).run()
