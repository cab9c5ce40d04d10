"""The engine side of the IPC transport: a worker mixin driven by ``collective_rpc``.

:class:`IPCWorkerMixin` is mixed into an engine's worker class (vLLM's
``worker_extension_cls``, the embedded engine's workers). The trainer calls,
by name:

* ``aiosync_ipc_init(plan)`` once: the worker rebuilds the
  :class:`~aiosync.transports.packing.BucketPlan` from its JSON form (re-deriving the
  digest) and, where the model offers ``expected_manifest()``, compares the
  manifests (names, shapes, dtypes; order is the trainer's) →
  :class:`~aiosync.errors.RefitMismatchError` naming the first differences.
* ``aiosync_ipc_receive(session)`` per sync: the worker connects a ZMQ DEALER to
  the trainer's ``ipc://`` socket, says hello with the digest it holds (so a
  mismatch stops the trainer before any data moves), then for each ``data``
  message maps the buffer handle, unpacks zero-copy views and calls
  ``self.model_runner.model.load_weights(views)``, and acknowledges the bucket
  only after the copies finished (the trainer reuses a buffer only after every
  worker's ack) and, when the message carries a ``digest`` (the trainer's
  ``verify``), the same digest of the bytes it copied matched
  (:class:`~aiosync.errors.RefitVerificationError` otherwise, naming the bucket
  and its first tensor). On ``end`` it checks that every bucket arrived exactly once.
  The worker keeps its mappings of the trainer's shared-memory (CPU) ping-pong
  buffers from one successful receive to the next of the same synchronizer: a
  fresh mapping pays a page fault per 4 KiB page on its first read, about as
  much as the copy itself. Likewise it keeps its DEALER (and the socket's
  monitor) connected to the same synchronizer's ROUTER, saving a socket set-up
  and connect per sync; messages of earlier syncs still queued on it are
  dropped by their ``sync_id``, and a monitor event of a closed connection seen
  between syncs makes the next receive connect afresh. Any other owner's
  receive, a failed receive, or ``aiosync_ipc_release`` drops both.
* ``aiosync_ipc_held_version(owner)`` before a delta sync: the version this
  worker holds whole from that synchronizer's last successful receive (None
  after a failed or refused one, a discard, a respawn), and whether its model
  applies delta patches (:class:`~aiosync.delta.PatchModel`). A session with
  ``"delta"`` naming this worker's rank carries patches against that version
  (:mod:`aiosync.delta`): the buckets then follow the patches' wire plan, and a
  worker that does not hold the base refuses before it says hello, so nothing
  is written anywhere.
* ``aiosync_ipc_release(owner)`` once, when the synchronizer shuts down: drop
  the mappings and the connection kept for it (an unlinked segment's memory
  lives while mapped).

Both return ``{"ok": True, ...}`` or ``{"ok": False, "type", "message"}`` rather
than raising, so the trainer gets the typed error back from any engine's RPC.

Protocol messages are msgpack maps (see ``transports/ipc.py``); one that does
not decode is a :class:`~aiosync.errors.TransportError`. Every receive has a
timeout (:class:`~aiosync.errors.SyncTimeoutError`), but a trainer that dies
(even by SIGKILL) is noticed at once: a monitor on the worker's socket reports
the ``ipc://`` connection closing (or the trainer's socket file missing), and
the receive ends with ``TransportError("the trainer went away during the
refit")`` instead of waiting the whole timeout.

``self.aiosync_weights_valid`` turns False when the first bucket lands and True
only when the whole manifest did; engines refuse to generate while it is False.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from aiosync._digest import BlockDigest
from aiosync.delta import PatchModel, WeightPatch, finish_patches, patch_from_wire, wire_manifest
from aiosync.errors import (
    OwnershipError,
    RefitMismatchError,
    RefitVerificationError,
    SyncError,
    SyncTimeoutError,
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
from .._wire import decode, encode, error_fields
from ..packing import Bucket, BucketPlan, compare_manifests, pack, plan_buckets, unpack
from ..validity import mark_invalid, mark_valid
from ._direct import direct_views
from ._shm import MappedBuffer, open_handle

__all__ = ["IPCWorkerMixin"]

_log = logging.getLogger(__name__)

#: Writes one bucket into the weights (its tensors, or a delta's patches) and returns
#: the tensors written; may add each tensor's bytes to the ``verify=True`` digest given.
_Loader = Callable[[Bucket, torch.Tensor, BlockDigest | None], int]

#: Plans a worker remembers (one per trainer configuration it was initialised with).
_MAX_PLANS = 4
#: How long a closed receiver socket keeps trying to deliver its last message, ms.
_LINGER_MS = 2000
#: Slice of a receive wait after which the worker checks whether it was superseded, ms.
_POLL_SLICE_MS = 100
#: Socket events that may mean the trainer is gone (see :meth:`_TrainerLink._trainer_gone`).
_MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
#: How long ``aiosync_ipc_release`` waits for a receive in progress to end, seconds.
_RELEASE_WAIT_S = 1.0
#: What a worker's receive reports when the trainer's end of the connection vanished.
TRAINER_GONE = "the trainer went away during the refit"


@runtime_checkable
class _ManifestModel(Protocol):
    """A worker's model that says which checkpoint its ``load_weights`` takes
    (the embedded engine's; vLLM's models do not)."""

    def expected_manifest(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{hf_name: (shape, dtype)}``."""
        ...


class IPCWorkerMixin(WorkerIdentityMixin):
    """Receives refits from ``IPCWeightSynchronizer`` into ``model_runner.model.load_weights``.

    Expects on the worker: ``self.model_runner.model.load_weights(iterable)``
    taking HF checkpoint names, and optionally ``self.rank`` and
    ``self.model_runner.model.expected_manifest()``.
    """

    aiosync_weights_valid: bool = True  # written only through aiosync.transports.validity
    _aiosync_ipc: _ReceiverState | None = None

    # -- state (created lazily: mixins get no __init__ call in vLLM) ----------

    def _aiosync_ipc_state(self) -> _ReceiverState:
        state = self._aiosync_ipc
        if state is None:
            state = _ReceiverState()
            self._aiosync_ipc = state
        return state

    # -- RPCs -----------------------------------------------------------------

    def aiosync_ipc_init(self, plan: Mapping[str, Any], delta: bool = False) -> dict[str, Any]:
        """Register the trainer's bucket plan (``BucketPlan.to_json()``); ``delta``:
        the synchronizer sends delta patches (keep what applying them needs,
        :attr:`aiosync_keep_delta_base`).

        Returns:
            ``{"ok": True, "rank", "device", "digest", "num_tensors"}`` (``device``:
            see ``aiosync_device_identity``), or ``{"ok": False,
            "type": "RefitMismatchError", "message"}`` when the plan is malformed
            or its manifest differs from ``expected_manifest()`` (first
            differing names on both sides).
        """
        try:
            bucket_plan = BucketPlan.from_json(plan)
            model = self.model_runner.model  # type: ignore[attr-defined]
            if isinstance(model, _ManifestModel):
                _compare_unordered(bucket_plan.manifest(), model.expected_manifest())
            self._aiosync_ipc_state().remember(bucket_plan)
            self.aiosync_keep_delta_base = delta
        except Exception as exc:
            return {"ok": False, **error_fields(exc)}
        return {
            "ok": True,
            "rank": self.aiosync_worker_rank(),
            "device": self.aiosync_device_identity(),
            "digest": bucket_plan.digest,
            "num_tensors": bucket_plan.num_tensors,
        }

    def aiosync_ipc_receive(self, session: Mapping[str, Any]) -> dict[str, Any]:
        """Receive one refit from the trainer (blocks until done, failed or timed out).

        Args:
            session: ``{"endpoint": "ipc://...", "sync_id": str, "digest": str,
                "timeout_s": float, "owner": str}`` from the trainer (``owner``: the
                synchronizer's token; a newer session of the same owner supersedes
                one still running, another owner's is refused); from a sharded trainer also
                ``"endpoints": {device identity: "ipc://..."}``, one per trainer
                rank: the worker connects to its own device's rank and refuses
                buffers of any other device. ``"version"``: the weight version
                sent (held once the receive succeeded, see
                :meth:`aiosync_ipc_held_version`). ``"delta"``: ``{"base": the
                version the patches were computed against, "patches": [[name,
                base, shape, encoding, k], ...], "digest": their wire plan's,
                "ranks": [the workers that get the patches]}``; the other
                workers get every tensor. ``"inline"``: the refit's messages
                (``data``…, ``end``) themselves, loaded without a connection.

        Returns:
            ``{"ok": True, "rank", "tensors", "bytes", "delta"}`` (``bytes``: the
            payload this worker loaded; ``delta``: it applied patches) or
            ``{"ok": False, "type", "message"}`` (``OwnershipError``: a refit of
            another synchronizer is running on this worker; ``RefitMismatchError``:
            unknown digest, missing or duplicate buckets, a delta whose base is not
            the version this worker holds (both named; refused before anything is
            written); ``RefitVerificationError``: a bucket's digest differs from
            the one its data message carried (the bucket, its first tensor, both
            digests and the mode named; the weights stay invalid);
            ``TransportError``: a delta to a model without
            ``apply_weight_patches``, malformed message, trainer abort, the
            trainer went away (its process died: noticed at once);
            ``SyncTimeoutError``: nothing from the trainer in ``timeout_s`` seconds).
            When the session has ``"trace": True`` the reply also carries
            ``"trace"``: per bucket ``{"seq", "received", "load_start", "load_end",
            "ack_sent"}``, ``time.monotonic()`` seconds (one clock system-wide on
            Linux, so comparable with the trainer's on the same host).
        """
        state = self._aiosync_ipc_state()
        try:
            endpoint = str(session["endpoint"])
            sync_id = str(session["sync_id"])
            digest = str(session["digest"])
            timeout_s = float(session["timeout_s"])
            owner = str(session.get("owner", ""))
            version = None if session.get("version") is None else int(session["version"])
            delta = session.get("delta")
            if delta is not None and not isinstance(delta, Mapping):
                raise TypeError(f"delta is a {type(delta).__name__}, not a map")
            trace: list[dict[str, Any]] | None = [] if session.get("trace") else None
            inline = session.get("inline")
            if inline is not None and not isinstance(inline, list):
                raise TypeError(f"inline is a {type(inline).__name__}, not a list")
            endpoints = session.get("endpoints")
            device = None
            if endpoints is not None:
                device = self.aiosync_device_identity()
                if device not in endpoints:
                    raise TransportError(
                        f"engine worker {self.aiosync_worker_rank()} is on device {device}, "
                        f"where no trainer rank runs (trainer devices: {sorted(endpoints)})"
                    )
                endpoint = str(endpoints[device])
        except (KeyError, TypeError, ValueError) as exc:
            return {"ok": False, **error_fields(TransportError(f"malformed session: {exc!r}"))}
        except TransportError as exc:
            return {"ok": False, **error_fields(exc)}
        # A newer session of the same synchronizer supersedes one still waiting (a
        # trainer that failed and retried); another synchronizer's is refused, so
        # that it never cuts a refit it does not own short. Only one receiver
        # writes into the model at a time.
        if not state.claim(owner, sync_id):
            foreign = OwnershipError(
                f"engine worker {self.aiosync_worker_rank()} is receiving a refit of another "
                "synchronizer; one engine takes one trainer's refits at a time"
            )
            return {"ok": False, **error_fields(foreign)}
        try:
            if not state.lock.acquire(timeout=timeout_s):
                error = SyncTimeoutError(f"a previous refit did not end within {timeout_s} s")
                return {"ok": False, **error_fields(error)}
            try:
                reply = self._aiosync_receive(
                    state,
                    endpoint,
                    sync_id,
                    digest,
                    timeout_s,
                    device,
                    trace,
                    owner,
                    version=version,
                    delta=delta,
                    inline=inline,
                )
                if trace is not None:
                    reply["trace"] = trace
                return reply
            finally:
                state.lock.release()
        finally:
            state.release(sync_id)

    def aiosync_ipc_held_version(self, owner: str) -> dict[str, Any]:
        """What a delta sync of synchronizer ``owner`` (its token) may build on.

        Returns:
            ``{"ok": True, "rank", "held", "patches"}``: ``held`` is the version
            this worker holds whole from ``owner``'s last successful receive, None
            when it cannot vouch for one (none yet, a failed, refused or running
            receive, its weights discarded since, another owner's receive);
            ``patches``: its model applies delta patches
            (:class:`~aiosync.delta.PatchModel`).
        """
        state = self._aiosync_ipc_state()
        return {
            "ok": True,
            "rank": self.aiosync_worker_rank(),
            "held": state.held_version(str(owner), self.aiosync_discard_epoch),
            "patches": self._aiosync_patch_model() is not None,
        }

    def aiosync_ipc_release(self, owner: str) -> dict[str, Any]:
        """Drop the buffer mappings kept for synchronizer ``owner`` (its token),
        which is shutting down. Waits up to 1 s for a receive in progress (it
        drops them itself when it fails). Returns ``{"ok": True, "rank",
        "released"}`` (``released``: mappings closed)."""
        state = self._aiosync_ipc_state()
        released = 0
        if state.lock.acquire(timeout=_RELEASE_WAIT_S):
            try:
                if state.mapped_owner == str(owner):
                    released = state.drop_mappings()
                    state.mapped_owner = None
                    state.drop_link()
            finally:
                state.lock.release()
        return {"ok": True, "rank": self.aiosync_worker_rank(), "released": released}

    def aiosync_ipc_invalidate(self, sync_id: str, force: bool = False) -> dict[str, Any]:
        """After refit ``sync_id`` failed on the trainer (on any of its ranks).

        Marks the weights invalid (generation refuses until a sync succeeds) when
        ``force`` or when this worker loaded any bucket of ``sync_id``; waits up
        to 1 s for a receive still running here to end, so that its commit cannot
        come after. Returns ``{"ok": True, "rank", "touched"}`` (``touched``: this
        worker loaded a bucket of ``sync_id``).
        """
        state = self._aiosync_ipc_state()
        locked = state.lock.acquire(timeout=_RELEASE_WAIT_S)
        try:
            touched = state.touched == str(sync_id)
            if force or touched:
                mark_invalid(self)
                state.held = None
        finally:
            if locked:
                state.lock.release()
        return {"ok": True, "rank": self.aiosync_worker_rank(), "touched": touched}

    def aiosync_ipc_last_receive(self) -> dict[str, Any]:
        """Statistics of this worker's last successful receive: ``{"ok", "rank",
        "tensors", "bytes", "sync_id", "senders"}`` (``senders``: the device
        identities of the trainer ranks its buffers came from); ``{}`` before one."""
        return dict(self._aiosync_ipc_state().last)

    # -- the receive loop -----------------------------------------------------

    def _aiosync_receive(
        self,
        state: _ReceiverState,
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
        link: _TrainerLink | _InlineLink | None = None
        try:
            # Inline: the whole refit came with the session (no connection, one round trip).
            link = _InlineLink(inline) if inline is not None else state.reusable_link(endpoint)
            if link is None:
                link = _TrainerLink.connect(endpoint, f"{sync_id}/{rank}")
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
                state, link, plan, mapped, sync_id, timeout_s, device, senders, trace, keep, load
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
            if isinstance(link, _InlineLink):
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
        state: _ReceiverState,
        link: _TrainerLink | _InlineLink,
        plan: BucketPlan,
        mapped: dict[str, MappedBuffer],
        sync_id: str,
        timeout_s: float,
        device: str | None,
        senders: set[str],
        trace: list[dict[str, Any]] | None = None,
        keep: set[str] | None = None,
        load: _Loader | None = None,
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
                mark_invalid(self)
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
                if trace is not None:
                    trace.append(
                        {
                            "seq": seq,
                            "received": received,
                            "load_start": load_start,
                            "load_end": load_end,
                            "ack_sent": time.monotonic(),
                            "direct": True,
                        }
                    )
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
                mark_invalid(self)
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
                if trace is not None:
                    trace.append(
                        {
                            "seq": seq,
                            "received": received,
                            "load_start": load_start,
                            "load_end": load_end,
                            "ack_sent": time.monotonic(),  # handed to the socket next
                        }
                    )
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


def _digesting(
    views: list[tuple[str, torch.Tensor]], bucket: Bucket, digest: BlockDigest
) -> Iterator[tuple[str, torch.Tensor]]:
    """``views`` (a direct bucket's tensors, in slot order), each added to ``digest`` at
    its slot's offset once the loader asks for the next: after its copy, in cache."""
    for slot, (name, tensor) in zip(bucket.slots, views, strict=True):
        yield name, tensor
        digest.add(slot.offset, tensor.detach().reshape(-1).view(torch.uint8))


class _ReceiverState:
    def __init__(self) -> None:
        self.plans: OrderedDict[str, BucketPlan] = OrderedDict()
        self.lock = threading.Lock()
        #: The refit that may write now, and the synchronizer that owns it (None: idle).
        self.current: str | None = None
        self.owner: str | None = None
        self._claims = threading.Lock()
        #: The reply of the last successful receive, with the devices it came from.
        self.last: dict[str, Any] = {}
        #: Buffer mappings by handle key, kept between receives of ``mapped_owner``.
        self.mapped: dict[str, MappedBuffer] = {}
        self.mapped_owner: str | None = None
        #: The last refit of which this worker loaded a bucket (its weights changed).
        self.touched: str | None = None
        #: ``(owner, version, discard epoch)`` this worker holds whole, from its last
        #: successful receive: the only base a delta patch may be applied to.
        self.held: tuple[str, int, int] | None = None

        #: The DEALER kept connected to ``mapped_owner``'s ROUTER, and its endpoint.
        self.link: _TrainerLink | None = None
        self.link_endpoint = ""

    def held_version(self, owner: str, epoch: int) -> int | None:
        """The version held from ``owner``'s last successful receive, if the
        weights were not discarded since (the worker's discard ``epoch``)."""
        if self.held is None or self.held[0] != owner or self.held[2] != epoch:
            return None
        return self.held[1]

    def keep_link(self, link: _TrainerLink, endpoint: str) -> None:
        """Keep ``link`` (to ``endpoint``) for the next receive of the same owner."""
        if self.link is not None and self.link is not link:
            self.link.close()
        self.link, self.link_endpoint = link, endpoint

    def reusable_link(self, endpoint: str) -> _TrainerLink | None:
        """The kept link if it goes to ``endpoint`` and its monitor reported no
        closed connection since; otherwise close it (if any) and return None."""
        link = self.link
        if link is None:
            return None
        if self.link_endpoint == endpoint and not link.disconnected():
            return link
        self.drop_link()
        return None

    def drop_link(self) -> None:
        """Close the kept link, if any."""
        if self.link is not None:
            self.link.close()
        self.link, self.link_endpoint = None, ""

    def drop_mappings(self, keep: set[str] | frozenset[str] = frozenset()) -> int:
        """Close every kept mapping whose key is not in ``keep``; returns how many."""
        dropped = [key for key in self.mapped if key not in keep]
        for key in dropped:
            self.mapped.pop(key).close()
        return len(dropped)

    def claim(self, owner: str, sync_id: str) -> bool:
        """Make ``sync_id`` the current refit unless another owner's is running."""
        with self._claims:
            if self.owner is not None and self.owner != owner:
                return False
            self.owner, self.current = owner, sync_id
            return True

    def release(self, sync_id: str) -> None:
        """``sync_id`` ended; free the worker unless a newer refit took over."""
        with self._claims:
            if self.current == sync_id:
                self.owner = None

    def remember(self, plan: BucketPlan) -> None:
        self.plans[plan.digest] = plan
        self.plans.move_to_end(plan.digest)
        while len(self.plans) > _MAX_PLANS:
            self.plans.popitem(last=False)


def _compare_unordered(
    trainer: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    engine: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
) -> None:
    # The engine's loader takes names in any order; compare names, shapes and
    # dtypes in the trainer's order so only real differences are reported.
    reordered = {name: engine[name] for name in trainer if name in engine}
    reordered.update((name, spec) for name, spec in engine.items() if name not in trainer)
    compare_manifests(trainer, reordered)


class _Discard:
    """The socket of an :class:`_InlineLink`: what the worker sends goes nowhere (the
    trainer reads the outcome from the receive's reply)."""

    def send(self, data: bytes, flags: int = 0) -> None:
        del data, flags


class _InlineLink:
    """The messages of a refit the trainer sent inside the session (``inline``), in
    the order the worker would have received them over its connection."""

    def __init__(self, messages: list[Any]) -> None:
        self.messages = list(messages)
        self.sock = _Discard()

    def recv(self, state: _ReceiverState, sync_id: str, timeout_s: float) -> dict[str, Any]:
        """The next message.

        Raises:
            TransportError: the session's messages ended before ``end``, or one is
                not a map.
        """
        del state, timeout_s
        if not self.messages:
            raise TransportError(f"refit {sync_id}: the session's messages ended before 'end'")
        msg = self.messages.pop(0)
        if not isinstance(msg, dict):
            raise TransportError(f"malformed inline message {msg!r:.80}")
        return msg


class _TrainerLink:
    """A worker's DEALER to the trainer, with a monitor that tells when the trainer is gone."""

    def __init__(self, sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes], endpoint: str) -> None:
        self.sock = sock
        self.monitor = monitor
        self.path = endpoint.removeprefix("ipc://")
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)

    @classmethod
    def connect(cls, endpoint: str, identity: str) -> _TrainerLink:
        """A new DEALER named ``identity``, monitored, connecting to ``endpoint``."""
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        # Linger so a final error or done message still reaches the trainer after close.
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        # Before connect, so no event of this connection is missed: the kernel closes
        # a dead trainer's end of the ipc:// connection, which the monitor reports.
        monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        link = cls(sock, monitor, endpoint)
        try:
            sock.connect(endpoint)
        except BaseException:
            link.close()
            raise
        return link

    def close(self) -> None:
        """Close the socket (lingering, see ``_LINGER_MS``) and its monitor."""
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close()

    def disconnected(self) -> bool:
        """Drain the monitor; True if it reported the connection closed (or the
        trainer's socket file gone) since it was last drained."""
        gone = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            closed = event == zmq.EVENT_DISCONNECTED
            missing = event == zmq.EVENT_CONNECT_RETRIED and not os.path.exists(self.path)
            gone = gone or closed or missing
        return gone

    def recv(self, state: _ReceiverState, sync_id: str, timeout_s: float) -> dict[str, Any]:
        """The next message of refit ``sync_id``.

        Raises:
            TransportError: superseded by a newer refit, or the trainer went away
                (its connection closed, or its socket file is gone).
            SyncTimeoutError: nothing arrived within ``timeout_s`` seconds.

        A message of another refit (one still queued on a kept connection,
        such as the abort of a sync that had already ended here) is dropped.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if state.current != sync_id:
                raise TransportError("superseded by a newer refit")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SyncTimeoutError(f"no message from the trainer within {timeout_s} s")
            # Blocks in zmq_poll; the slice only bounds how late a supersede is seen.
            ready = dict(self.poller.poll(min(_POLL_SLICE_MS, max(1, int(remaining * 1000)))))
            if self.sock in ready:
                msg = decode(self.sock.recv())
                if msg.get("sync_id") != sync_id:
                    _log.debug("dropping a message of refit %r", msg.get("sync_id"))
                    continue
                return msg
            if self.monitor in ready and self._trainer_gone():
                raise TransportError(TRAINER_GONE)

    def _trainer_gone(self) -> bool:
        """Drain the monitor; True if an event says the trainer cannot come back.

        A closed connection is final: the trainer's ROUTER stays bound for the
        whole refit, so only its process dying (or its socket closing) ends it.
        A failed connect is final only when the socket file does not exist (the
        trainer binds before it sends the session); one refused while the file
        exists may be a full listen backlog, so the timeout stays the judge.
        """
        # A message the trainer sent before it died is still delivered first.
        return self.disconnected() and not self.sock.poll(0)


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
