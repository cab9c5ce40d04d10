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

import logging
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from aiosync.errors import (
    OwnershipError,
    SyncTimeoutError,
    TransportError,
)

from .._wire import error_fields
from ..packing import (
    BucketPlan,
    compare_unordered,
)
from ..previous import whole_receive
from ..validity import mark_invalid
from ._link import TRAINER_GONE
from ._receive import BucketReceiver
from ._receiver_state import ReceiverState

__all__ = ["TRAINER_GONE", "IPCWorkerMixin"]

_log = logging.getLogger(__name__)

#: How long ``aiosync_ipc_release`` waits for a receive in progress to end, seconds.
_RELEASE_WAIT_S = 1.0


@runtime_checkable
class _ManifestModel(Protocol):
    """A worker's model that says which checkpoint its ``load_weights`` takes
    (the embedded engine's; vLLM's models do not)."""

    def expected_manifest(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{hf_name: (shape, dtype)}``."""
        ...


class IPCWorkerMixin(BucketReceiver):
    """Receives refits from ``IPCWeightSynchronizer`` into ``model_runner.model.load_weights``.

    Expects on the worker: ``self.model_runner.model.load_weights(iterable)``
    taking HF checkpoint names, and optionally ``self.rank`` and
    ``self.model_runner.model.expected_manifest()``.
    """

    aiosync_weights_valid: bool = True  # written only through aiosync.transports.validity
    _aiosync_ipc: ReceiverState | None = None

    # -- state (created lazily: mixins get no __init__ call in vLLM) ----------

    def _aiosync_ipc_state(self) -> ReceiverState:
        state = self._aiosync_ipc
        if state is None:
            state = ReceiverState()
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
                compare_unordered(bucket_plan.manifest(), model.expected_manifest())
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

    @whole_receive
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
