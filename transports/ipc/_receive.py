"""The IPC worker's receive loop: one refit's messages into the model's weights.

:class:`BucketReceiver` reads a refit's messages (over the worker's
:class:`~._link.TrainerLink`, or inline), maps each bucket's buffer (or the trainer's
own tensors, ``direct``), loads it through ``model_runner.model.load_weights`` (or
applies a delta's patches), checks its digest where the trainer sent one, and
acknowledges it only after the copies finished; on ``end`` it checks that every bucket
arrived exactly once. The RPCs that drive it, and the protocol, are
:mod:`aiosync.transports.ipc.worker`'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import zmq

from aiosync._digest import BlockDigest
from aiosync.delta import PatchModel, WeightPatch, finish_patches, patch_from_wire, wire_manifest
from aiosync.errors import (
    RefitMismatchError,
    RefitVerificationError,
    SyncError,
    TransportError,
)

from .._identity import WorkerIdentityMixin
from .._verify import (
    Verify,
    bucket_digest,
    check_verify,
    transit_fault,
    transit_fault_armed,
    views_digest,
)
from .._wire import encode, error_fields
from ..packing import (
    Bucket,
    BucketPlan,
    pack,
    plan_buckets,
    unpack,
)
from ..previous import begin_refit
from ..validity import mark_valid
from ._direct import direct_views
from ._link import InlineLink, TrainerLink
from ._receiver_state import ReceiverState
from ._shm import MappedBuffer, open_handle

__all__ = ["BucketReceiver"]

# The worker's logger, as before the split: users select it by name.
_log = logging.getLogger(__name__.rpartition(".")[0] + ".worker")

#: Writes one bucket into the weights (its tensors, or a delta's patches) and returns
#: the tensors written; may add each tensor's bytes to the ``verify=True`` digest given.
_Loader = Callable[[Bucket, torch.Tensor, BlockDigest | None], int]


class BucketReceiver(WorkerIdentityMixin):
    """The receive loop of :class:`~aiosync.transports.ipc.worker.IPCWorkerMixin`."""

    aiosync_weights_valid: bool = True  # written only through aiosync.transports.validity
    _aiosync_ipc: ReceiverState | None = None

    def _aiosync_receive(
        self,
        state: ReceiverState,
        endpoint: str,
        sync_id: str,
        digest: str,
        timeout_s: float,
        device: str | None,
        trace: list[dict[str, Any]] | None = None,
        owner: str = "",
        *,
        version: int | None = None,
        delta: Mapping[str, Any] | None = None,
        inline: list[Any] | None = None,
    ) -> dict[str, Any]:
        rank = self.aiosync_worker_rank()
        # The base a delta may be applied to; from here until this receive fully
        # succeeded this worker vouches for no version.
        discards = self.aiosync_discard_epoch
        held = state.held_version(owner, discards)
        state.held = None
        # Mappings and the connection kept from this owner's last receive (see
        # the module docs); ``keep`` collects the mappings this receive passes on.
        if state.mapped_owner != owner:
            state.drop_mappings()
            state.drop_link()
            state.mapped_owner = owner
        mapped = state.mapped
        keep: set[str] = set()
        succeeded = False
        link: TrainerLink | InlineLink | None = None
        try:
            # Inline: the whole refit came with the session (no connection, one round trip).
            link = InlineLink(inline) if inline is not None else state.reusable_link(endpoint)
            if link is None:
                link = TrainerLink.connect(endpoint, f"{sync_id}/{rank}")
            sock = link.sock
            plan = state.plans.get(digest)
            if plan is None:
                known = [d[:16] for d in state.plans]
                raise RefitMismatchError(
                    f"trainer's bucket plan {digest[:16]} is not the one this engine worker "
                    f"was initialised with ({known or 'none'}): re-run init_communicator()"
                )
            load = self._aiosync_full_loader()
            patched = delta is not None and rank in _delta_ranks(delta)
            patches = None
            if patched:
                assert delta is not None
                # Refused here, before the hello: the trainer sends no bucket to anyone.
                plan, load, patches = self._aiosync_patch_loader(plan, delta, held)
            sock.send(encode({"t": "hello", "sync_id": sync_id, "rank": rank, "digest": digest}))
            senders: set[str] = set()
            tensors, nbytes = self._aiosync_load_buckets(
                state,
                link,
                plan,
                mapped,
                sync_id,
                timeout_s,
                device,
                senders,
                trace,
                keep,
                load,
                version=version,
            )
            if patches is not None:
                finish_patches(patches)  # before "done": a failure here fails the sync
            sock.send(encode({"t": "done", "sync_id": sync_id, "rank": rank}))
            succeeded = True
            if version is not None and self.aiosync_discard_epoch == discards:
                state.held = (owner, version, discards)
            state.last = {
                "ok": True,
                "rank": rank,
                "tensors": tensors,
                "bytes": nbytes,
                "sync_id": sync_id,
                "senders": sorted(senders),
                "delta": patched,
            }
            return dict(state.last)
        except Exception as exc:
            if not isinstance(exc, SyncError):
                exc = TransportError(f"engine worker {rank}: {type(exc).__name__}: {exc}")
            fields = error_fields(exc)
            if link is not None:
                with contextlib.suppress(zmq.ZMQError):
                    link.sock.send(
                        encode({"t": "error", "sync_id": sync_id, "rank": rank, **fields}),
                        zmq.NOBLOCK,
                    )
            return {"ok": False, **fields}
        finally:
            state.drop_mappings(keep if succeeded else set())
            if isinstance(link, InlineLink):
                pass  # a kept connection stays as it was, for the next streamed sync
            elif link is not None and succeeded and owner:
                state.keep_link(link, endpoint)
            elif link is not None:
                if state.link is link:
                    state.link, state.link_endpoint = None, ""
                link.close()

    def _aiosync_full_loader(self) -> _Loader:
        """The bucket loader of a full sync: ``load_weights`` of every tensor, each
        added to the digest (when given) once ``load_weights`` took it; returns the
        tensors loaded."""
        load_weights = self.model_runner.model.load_weights  # type: ignore[attr-defined]

        def load(bucket: Bucket, buffer: torch.Tensor, digest: BlockDigest | None) -> int:
            loaded = load_weights(unpack(buffer, bucket, digest=digest))
            return int(loaded) if isinstance(loaded, int) else len(bucket.slots)

        return load

    def _aiosync_patch_loader(
        self, plan: BucketPlan, delta: Mapping[str, Any], held: int | None
    ) -> tuple[BucketPlan, _Loader, PatchModel]:
        """The wire plan of a delta sync against ``plan``, the bucket loader that
        applies its patches (returns the patches applied), and the model it writes.

        Raises:
            RefitMismatchError: a malformed delta, a wire plan whose digest is not
                the trainer's, or ``held`` is not the patches' base (both named).
            TransportError: the model has no ``apply_weight_patches``.
        """
        who = f"engine worker {self.aiosync_worker_rank()}"
        try:
            metas = {str(m[0]): list(m) for m in delta["patches"]}
            wire = plan_buckets(wire_manifest(metas.values(), plan.manifest()), plan.bucket_bytes)
            base = int(delta["base"])
            digest = str(delta["digest"])
        except (KeyError, TypeError, ValueError, RefitMismatchError) as exc:
            raise RefitMismatchError(f"{who}: malformed delta: {exc!r}") from exc
        if wire.digest != digest:
            raise RefitMismatchError(f"{who}: the delta's wire plan differs from the trainer's")
        if held != base:
            raise RefitMismatchError(
                f"{who} holds version {held}, the delta patches were computed against "
                f"version {base}: a full sync is needed"
            )
        model = self._aiosync_patch_model()
        if model is None:
            raise TransportError(
                f"{who}: {type(self.model_runner.model).__name__} cannot apply delta "  # type: ignore[attr-defined]
                "patches (apply_weight_patches)"
            )
        # A sparse patch is two wire tensors (where, values), maybe in two buckets.
        partial: dict[str, dict[str, torch.Tensor]] = {}

        def load(bucket: Bucket, buffer: torch.Tensor, digest: BlockDigest | None) -> int:
            # The digest is taken after the patches are written (few bytes: not fused).
            ready: list[WeightPatch] = []
            waiting: dict[str, dict[str, torch.Tensor]] = {}
            for name, tensor in unpack(buffer, bucket):
                patch = name if name in metas else name.rsplit("@", 1)[0]
                meta = metas[patch]
                if meta[3] == "dense":
                    ready.append(patch_from_wire(meta, {name: tensor}))
                    continue
                half = partial.pop(patch, None) or waiting.pop(patch, None)
                if half is None:
                    waiting[patch] = {name: tensor}
                else:
                    ready.append(patch_from_wire(meta, {**half, name: tensor}))
            model.apply_weight_patches(ready)
            # The other half comes in a later bucket, maybe in this same buffer.
            for patch, half in waiting.items():
                partial[patch] = {n: t.clone() for n, t in half.items()}
            return len(ready)

        return wire, load, model

    def _aiosync_load_buckets(
        self,
        state: ReceiverState,
        link: TrainerLink | InlineLink,
        plan: BucketPlan,
        mapped: dict[str, MappedBuffer],
        sync_id: str,
        timeout_s: float,
        device: str | None,
        senders: set[str],
        trace: list[dict[str, Any]] | None = None,
        keep: set[str] | None = None,
        load: _Loader | None = None,
        *,
        version: int | None = None,
    ) -> tuple[int, int]:
        """Load every bucket until ``end``; ``senders`` collects the devices the
        buffers came from, ``trace`` (when not None) one row of timestamps per
        bucket, ``keep`` the keys in ``mapped`` of the shared-memory ping-pong
        buffers worth keeping for the next receive, ``load(bucket, buffer)`` writes
        one bucket (default: ``load_weights`` of its tensors) and returns the
        tensors it wrote, adding each tensor's bytes to the ``verify=True`` digest it
        is given once loaded, if it can. Returns ``(tensors, bytes)`` loaded."""
        load_weights = self.model_runner.model.load_weights  # type: ignore[attr-defined]
        default_load = load
        if load is None:
            load = default_load = self._aiosync_full_loader()
        discards = self.aiosync_discard_epoch
        arrived = [0] * len(plan.buckets)
        tensors = nbytes = 0
        while True:
            msg = link.recv(state, sync_id, timeout_s)
            received = time.monotonic()
            kind = msg.get("t")
            if kind == "data" and "direct" in msg:
                seq, index = _direct_fields(msg, len(plan.buckets))
                if device is not None and msg.get("device") != device:
                    raise TransportError(
                        f"a direct bucket of device {msg.get('device')} reached a worker on "
                        f"device {device}: arenas are only mapped on their own device"
                    )
                if load is not default_load:
                    raise TransportError("a direct bucket reached a worker applying patches")
                senders.add(str(msg.get("device")))
                bucket = plan.buckets[index]

                def arena(handle: Mapping[str, Any]) -> torch.Tensor:
                    key = repr(sorted(handle.items()))
                    if key not in mapped:
                        mapped[key] = open_handle(handle)
                    if keep is not None:
                        keep.add(key)  # kept mapped while the trainer sends from it
                    return mapped[key].tensor

                views = direct_views(msg["direct"], bucket, arena)
                if transit_fault_armed(index):
                    # The test fault must not write into the trainer's own memory: it
                    # lands in a private copy, which is then what is loaded.
                    copy = torch.empty(bucket.nbytes, dtype=torch.uint8)
                    pack(bucket, views, out=copy)
                    transit_fault(copy, index)
                    views = list(unpack(copy, bucket))
                check = _check_fields(msg)
                blocks = BlockDigest() if check is not None and check[0] is True else None
                begin_refit(self, -1 if version is None else version)
                state.touched = sync_id
                load_start = time.monotonic()
                with torch.no_grad():
                    loaded = load_weights(
                        views if blocks is None else _digesting(views, bucket, blocks)
                    )
                cuda = next((t.device for _n, t in views if t.is_cuda), None)
                if cuda is not None:
                    # The copy out of the trainer's memory is done before the reply
                    # lets the trainer step again (nothing acks a direct bucket).
                    torch.cuda.current_stream(cuda).synchronize()
                if check is not None:
                    if blocks is not None and blocks.pieces == len(bucket.slots):
                        received_digest = blocks.value()
                    else:  # "sample", or a loader that did not take every tensor
                        raw = [t.reshape(-1).view(torch.uint8) for _name, t in views]
                        offsets = [slot.offset for slot in bucket.slots]
                        received_digest = views_digest(raw, check[0], key=check[1], offsets=offsets)
                    _verify_digest(bucket, received_digest, *check)
                load_end = time.monotonic()
                arrived[index] += 1
                tensors += int(loaded) if isinstance(loaded, int) else len(bucket.slots)
                nbytes += sum(slot.nbytes for slot in bucket.slots)
                _trace_row(trace, seq, received, load_start, load_end, direct=True)
                if msg.get("ack", True):
                    link.sock.send(encode({"t": "ack", "sync_id": sync_id, "seq": seq}))
            elif kind == "data":
                seq, index, handle = _data_fields(msg, len(plan.buckets))
                if device is not None and msg.get("device") != device:
                    raise TransportError(
                        f"a buffer of device {msg.get('device')} reached a worker on device "
                        f"{device}: buffers are only mapped on their own device"
                    )
                senders.add(str(msg.get("device")))
                bucket = plan.buckets[index]
                key = repr(sorted(handle.items()))
                buffer = mapped.get(key)
                if buffer is None:
                    buffer = mapped[key] = open_handle(handle)
                check = _check_fields(msg)
                # verify=True: each tensor is digested as soon as it is loaded (in cache).
                blocks = BlockDigest() if check is not None and check[0] is True else None
                # The test fault (unless armed, nothing: not even the slice) lands in
                # what the copy reads.
                if transit_fault_armed(index):
                    transit_fault(buffer.tensor[: bucket.nbytes], index)
                begin_refit(self, -1 if version is None else version)
                state.touched = sync_id
                load_start = time.monotonic()
                with torch.no_grad():
                    loaded = load(bucket, buffer.tensor, blocks)
                if buffer.tensor.is_cuda:
                    torch.cuda.current_stream(buffer.tensor.device).synchronize()
                if check is not None:
                    # After the copy: what the weights took is what is digested.
                    if blocks is not None and blocks.pieces == len(bucket.slots):
                        received_digest = blocks.value()
                    else:  # "sample", or a loader that digested nothing (patches)
                        slots = [(s.offset, s.nbytes) for s in bucket.slots]
                        received_digest = bucket_digest(
                            buffer.tensor[: bucket.nbytes], check[0], key=check[1], slots=slots
                        )
                    _verify_digest(bucket, received_digest, *check)
                load_end = time.monotonic()
                if handle.get("transient"):
                    mapped.pop(key).close()
                elif keep is not None and handle.get("kind") == "shm":
                    keep.add(key)
                arrived[index] += 1
                tensors += loaded
                nbytes += sum(slot.nbytes for slot in bucket.slots)
                _trace_row(trace, seq, received, load_start, load_end)
                link.sock.send(encode({"t": "ack", "sync_id": sync_id, "seq": seq}))
            elif kind == "end":
                _check_arrivals(plan, arrived)
                if self.aiosync_discard_epoch != discards:
                    raise TransportError(
                        "the engine discarded this worker's weights during the refit"
                    )
                kv = _kv_fields(msg)
                if kv:
                    with torch.no_grad():
                        load_weights(
                            (name, torch.tensor(value, dtype=torch.float32)) for name, value in kv
                        )
                mark_valid(self)
                return tensors, nbytes
            elif kind == "abort":
                raise TransportError(f"the trainer aborted the refit: {msg.get('reason', '')}")
            else:
                raise TransportError(f"unexpected message type {kind!r}")


def _trace_row(
    trace: list[dict[str, Any]] | None,
    seq: int,
    received: float,
    load_start: float,
    load_end: float,
    **extra: Any,
) -> None:
    """Bucket ``seq``'s row of ``trace`` (None: not tracing; ``time.monotonic()`` times),
    its ``ack_sent`` now: the ack, if any, is handed to the socket next."""
    if trace is not None:
        row = {"seq": seq, "received": received, "load_start": load_start, "load_end": load_end}
        trace.append({**row, "ack_sent": time.monotonic(), **extra})


def _digesting(
    views: list[tuple[str, torch.Tensor]], bucket: Bucket, digest: BlockDigest
) -> Iterator[tuple[str, torch.Tensor]]:
    """``views`` (a direct bucket's tensors, in slot order), each added to ``digest`` at
    its slot's offset once the loader asks for the next: after its copy, in cache."""
    for slot, (name, tensor) in zip(bucket.slots, views, strict=True):
        yield name, tensor
        digest.add(slot.offset, tensor.detach().reshape(-1).view(torch.uint8))


def _data_fields(msg: Mapping[str, Any], num_buckets: int) -> tuple[int, int, dict[str, Any]]:
    try:
        seq = int(msg["seq"])
        index = int(msg["bucket"])
        handle = msg["handle"]
    except (KeyError, TypeError, ValueError) as exc:
        raise TransportError(f"malformed data message: {exc!r}") from exc
    if not isinstance(handle, dict):
        raise TransportError("malformed data message: handle is not a map")
    if not 0 <= index < num_buckets:
        raise RefitMismatchError(f"bucket {index} is not in the plan ({num_buckets} buckets)")
    return seq, index, handle


def _check_fields(msg: Mapping[str, Any]) -> tuple[Verify, int, int] | None:
    """A ``data`` message's ``(verify, key, digest)`` (None: the trainer sent no
    digest, ``verify=False``).

    Raises:
        TransportError: a malformed mode, key or digest.
    """
    if msg.get("digest") is None:
        return None
    try:
        verify = check_verify(msg.get("verify"))
        key, digest = msg["key"], msg["digest"]
        if verify is False or not isinstance(key, int) or not isinstance(digest, int):
            raise ValueError(f"verify={verify!r}, key={key!r}, digest={digest!r}")
    except (KeyError, ValueError) as exc:
        raise TransportError(f"malformed data message: {exc}") from exc
    return verify, key, digest


def _direct_fields(msg: Mapping[str, Any], num_buckets: int) -> tuple[int, int]:
    try:
        seq, index = int(msg["seq"]), int(msg["bucket"])
    except (KeyError, TypeError, ValueError) as exc:
        raise TransportError(f"malformed data message: {exc!r}") from exc
    if not 0 <= index < num_buckets:
        raise RefitMismatchError(f"bucket {index} is not in the plan ({num_buckets} buckets)")
    return seq, index


def _verify_digest(bucket: Bucket, received: int, verify: Verify, key: int, sent: int) -> None:
    """Compare the digest of ``bucket`` as received with the trainer's ``sent``
    (``key``: the sample's seed, unused here: the digest is computed).

    Raises:
        RefitVerificationError: they differ (the bucket, its first tensor, both
            digests and the mode named; the trainer names the worker).
    """
    if received != sent:
        names = repr(bucket.slots[0].name) if bucket.slots else "no tensor"
        if len(bucket.slots) > 1:
            names += f" and {len(bucket.slots) - 1} more"
        raise RefitVerificationError(
            f"bucket {bucket.index} ({names}) arrived with digest {received}, "
            f"the trainer sent {sent} (verify={verify!r})"
        )


def _delta_ranks(delta: Mapping[str, Any]) -> set[int]:
    """The ranks of the workers that get a delta's patches."""
    try:
        return {int(r) for r in delta["ranks"]}
    except (KeyError, TypeError, ValueError) as exc:
        raise RefitMismatchError(f"malformed delta: {exc!r}") from exc


def _kv_fields(msg: Mapping[str, Any]) -> list[tuple[str, float]]:
    """The ``end`` message's KV-cache scales: ``[(engine name, float32 value), ...]``."""
    try:
        return [(str(name), float(value)) for name, value in msg.get("kv_scales") or ()]
    except (TypeError, ValueError) as exc:
        raise TransportError(f"malformed kv_scales in the end message: {exc!r}") from exc


def _check_arrivals(plan: BucketPlan, arrived: list[int]) -> None:
    missing = [plan.buckets[i] for i, n in enumerate(arrived) if n == 0]
    duplicate = [plan.buckets[i] for i, n in enumerate(arrived) if n > 1]
    problems = []
    if missing:
        names = [s.name for b in missing for s in b.slots]
        problems.append(f"{len(names)} tensor(s) never arrived, first: {names[:3]}")
    if duplicate:
        names = [s.name for b in duplicate for s in b.slots]
        problems.append(f"{len(names)} tensor(s) arrived more than once, first: {names[:3]}")
    if problems:
        raise RefitMismatchError("incomplete refit: " + "; ".join(problems))
