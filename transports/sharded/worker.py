"""Engine side of the shard-aware transport: a worker-extension mixin.

vLLM's ``worker_extension_cls`` and the embedded engine mix :class:`ShardedWorkerMixin`
into their workers (``AiosyncWorkerExtension`` does); the trainer's
:class:`~aiosync.transports.sharded.ShardedWeightSynchronizer` calls its methods by
name through ``collective_rpc``. Every argument and result is JSON-safe.

The worker's model must report what it holds (``weight_layout() -> {hf_name: Part}``)
and write received boxes into it (``load_weight_boxes(iterable of (hf_name, box,
tensor))``): the embedded engine's runner does both. A worker whose model cannot is
refused at init, before any byte moves; the broadcast transport still serves it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from aiosync.delta import WeightPatch, finish_patches
from aiosync.errors import OwnershipError, RefitMismatchError, TransportError
from aiosync.layout import Layout, Part

from .. import validity
from .._identity import WorkerIdentityMixin
from ..collective._group import (
    STATUS_ERROR,
    STATUS_MISMATCH,
    STATUS_OK,
    SyncGroup,
    cancel_formation,
    create_sync_group,
    open_store,
)
from ..packing import dtype_from_name
from ._delta import ApplyFn, ShardBaseline, run_delta_plan
from ._p2p import LINK_FAILURES, P2PResult, SinkFn, SourceFn, run_plan
from ._plan import Box, Plan, make_plan

__all__ = [
    "LayoutModel",
    "ShardedWorkerMixin",
    "layouts_from_wire",
    "layouts_to_wire",
    "run_delta_and_vote",
    "run_plan_and_vote",
    "vote_or_abort",
]

#: A store key only checked for (never set): the check is a round trip to the owner.
_PROBE_KEY = "aiosync/owner-probe"

#: What moves a plan's buckets: the group's point-to-point sends, or Mooncake writes.
DataPlane = Literal["torch", "mooncake"]


@runtime_checkable
class LayoutModel(Protocol):
    """A worker's model that reports its layout and loads boxes of HF tensors."""

    def weight_layout(self) -> dict[str, Part]:
        """``{hf_name: part held}`` (full shapes; a name not held is absent)."""
        ...

    def load_weight_boxes(self, boxes: Any) -> int:
        """Write each ``(hf_name, box, tensor)`` (``tensor`` of ``box``'s shape) into
        the held part; returns the elements written."""
        ...


def layouts_to_wire(layouts: Any) -> list[dict[str, list[object]]]:
    """Layouts as JSON-safe lists (:meth:`Part.to_wire` per name)."""
    return [{name: part.to_wire() for name, part in layout.items()} for layout in layouts]


def layouts_from_wire(wire: Any) -> list[Layout]:
    """The inverse of :func:`layouts_to_wire`."""
    return [{name: Part.from_wire(f) for name, f in layout.items()} for layout in wire]


def plan_from_wire(spec: dict[str, Any]) -> Plan:
    """The plan every rank computes from the same layouts, dtypes and bucket size."""
    return make_plan(
        layouts_from_wire(spec["sources"]),
        layouts_from_wire(spec["destinations"]),
        {name: dtype_from_name(d) for name, d in spec["dtypes"].items()},
        int(spec["bucket_bytes"]),
    )


def _device_for(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(eq=False)
class _State:
    group: SyncGroup
    plan: Plan
    owner: str
    data_plane: DataPlane = "torch"
    #: ``(version, discard epoch)`` this worker holds whole through this group, from
    #: its last successful receive: the only base a delta may be applied to.
    held: tuple[int, int] | None = None

    def owner_alive(self) -> bool:
        """Whether the trainer that formed the group can still drive it (its rank 0's
        store still answers; a dead trainer's connection fails at once)."""
        store = self.group.store
        if self.group.broken or store is None:
            return False
        try:
            store.check([_PROBE_KEY])
        except Exception:  # DistNetworkError/DistStoreError: the owner's store is gone
            return False
        return True


class ShardedWorkerMixin(WorkerIdentityMixin):
    """Receiver of :class:`~aiosync.transports.sharded.ShardedWeightSynchronizer`.

    Attributes:
        aiosync_weights_valid: False from the start of a receive until every box
            landed and every rank of the sync group voted success; engines refuse
            to generate while it is False.
    """

    aiosync_weights_valid: bool = True
    _aiosync_sharded: _State | None = None

    def aiosync_sharded_layout(self, owner: str = "") -> dict[str, list[object]]:
        """This worker's layout as :func:`layouts_to_wire` gives one.

        Raises:
            TransportError: the model cannot report one (no ``weight_layout`` and
                ``load_weight_boxes``): use the broadcast transport.
        """
        model = self._aiosync_layout_model()
        return {name: part.to_wire() for name, part in model.weight_layout().items()}

    def aiosync_sharded_init(
        self,
        *,
        master_addr: str,
        master_port: int,
        world_size: int,
        train_world_size: int,
        backend: str,
        plan: dict[str, Any],
        timeout_s: float,
        session: str,
        owner: str = "",
        data_plane: DataPlane = "torch",
        delta: bool = False,
    ) -> dict[str, Any]:
        """Join the sync group as rank ``train_world_size + aiosync_worker_rank()``.

        Every rank computes the plan from the same ``plan`` spec (the layouts, the
        manifest's dtypes, the bucket size) and compares digests; this worker also
        checks that the plan's destination for it is the layout its model reports.
        If this worker fails before joining, it cancels the formation so that the
        other ranks give up at once.

        Args:
            plan: ``{"sources", "destinations", "dtypes", "bucket_bytes"}``
                (:func:`layouts_to_wire`, dtype names, bytes).
            timeout_s: limit of the rendezvous and of every later wait, seconds.
            session: key namespace of this group in the store.
            owner: the forming synchronizer's token; later calls must carry it.
            data_plane: what moves the buckets: ``"torch"`` (the group's
                point-to-point sends) or ``"mooncake"`` (Mooncake writes, the
                control messages on the group; :mod:`._mooncake`).
            delta: the synchronizer sends delta patches: keep what applying them
                needs (:attr:`aiosync_keep_delta_base`).

        Returns:
            ``{"rank": session rank, "digest": plan digest, "nbytes": bytes this
            worker receives per sync}``.

        Raises:
            OwnershipError: the worker is in a live group of another synchronizer.
            RefitMismatchError: a rank's plan differs, or the plan's destination for
                this worker is not what its model holds (raised on every rank).
            SyncTimeoutError, TransportError: the rendezvous failed or timed out.
        """
        store = open_store(master_addr, master_port, is_master=False, timeout_s=timeout_s)
        status, message, digest = STATUS_OK, "", ""
        parsed: Plan | None = None
        worker = self.aiosync_worker_rank()
        try:
            self.aiosync_sharded_destroy(owner=owner)
            inference_world = world_size - train_world_size
            if not 0 <= worker < inference_world:
                raise TransportError(f"worker rank {worker} outside 0..{inference_world - 1}")
            model = self._aiosync_layout_model()
            try:
                parsed = plan_from_wire(plan)
                digest = parsed.digest
                _check_destination(parsed, worker, model.weight_layout())
            except RefitMismatchError as exc:
                status, message = STATUS_MISMATCH, f"engine worker {worker}: {exc}"
        except Exception as exc:
            cancel_formation(
                store, session, f"engine worker {worker} failed: {type(exc).__name__}: {exc}"
            )
            raise
        group = create_sync_group(
            store=store,
            rank=train_world_size + worker,
            world_size=world_size,
            train_world_size=train_world_size,
            backend=backend,
            device=_device_for(backend),
            timeout_s=timeout_s,
            session=session,
            every_rank_sends=True,
            verdict=(status, message, digest),
        )
        assert parsed is not None  # a parse failure voted a mismatch above
        self._aiosync_sharded = _State(group, parsed, owner, data_plane)
        self.aiosync_keep_delta_base = delta
        return {
            "rank": group.rank,
            "digest": digest,
            "nbytes": parsed.receiver_nbytes[worker],
        }

    def aiosync_sharded_destroy(self, owner: str = "") -> None:
        """Leave and destroy the sync group (idempotent).

        Raises:
            OwnershipError: the group belongs to another synchronizer that is
                still alive (a group whose owner is gone is destroyed).
        """
        state = self._aiosync_sharded
        if state is None:
            return
        if state.owner != owner and state.owner_alive():
            raise OwnershipError(
                f"engine worker {self.aiosync_worker_rank()} is in the sharded sync group "
                "of another synchronizer, which is still alive: one engine takes one "
                "trainer's refits at a time"
            )
        self._aiosync_sharded = None
        state.group.destroy()

    def aiosync_sharded_held_version(self, owner: str = "") -> int | None:
        """The version this worker holds whole through this synchronizer's group (None:
        none it can vouch for: a failed receive, discarded weights, a new group, a model
        that cannot apply patches): the base a delta sync needs.

        Raises:
            OwnershipError, TransportError: as :meth:`aiosync_sharded_receive`.
        """
        state = self._aiosync_sharded_state(owner)
        if state.held is None or state.held[1] != getattr(self, "aiosync_discard_epoch", 0):
            return None
        if self._aiosync_patch_model() is None:
            return None  # it could not apply a delta: every sync is a full one
        return state.held[0]

    def aiosync_sharded_receive(
        self, *, version: int, owner: str = "", delta: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Receive version ``version``: each box is written into the model as it lands.

        :attr:`aiosync_weights_valid` is False from the start until every box
        landed and every rank of the group voted success.

        Args:
            version: the version being sent.
            owner: the token the group was formed with.
            delta: a delta sync (:mod:`._delta`): ``{"base": version the patches were
                computed against}``; each sender's changed elements are written
                through the model's ``apply_weight_patches`` (dense boxes through
                ``load_weight_boxes``). A worker that does not hold ``base`` whole
                (:meth:`aiosync_sharded_held_version`), or whose model cannot apply
                patches, writes nothing and fails the sync on every rank
                (RefitMismatchError naming both versions).

        Returns:
            ``{"version", "nbytes", "by_sender", "buckets", "seconds", "delta"}``:
            payload bytes received (a delta's: indices, values and dense boxes), per
            sender (trainer rank), messages, the receive's duration, whether it was
            a delta.

        Raises:
            OwnershipError: the group belongs to another synchronizer.
            TransportError, SyncTimeoutError: a peer failed, died or timed out (the
                group is then destroyed); RefitMismatchError: a rank planned otherwise,
                or a refused delta.
        """
        state = self._aiosync_sharded_state(owner)
        start = time.perf_counter()
        held = self.aiosync_sharded_held_version(owner)
        discards = getattr(self, "aiosync_discard_epoch", 0)
        state.held = None
        validity.mark_invalid(self)
        model = self._aiosync_layout_model()
        group = state.group

        def discarded() -> str | None:
            if getattr(self, "aiosync_discard_epoch", 0) != discards:
                return "the engine discarded this worker's weights"
            return None

        try:
            if delta is None:

                def sink(name: str, box: Box, tensor: torch.Tensor) -> None:
                    model.load_weight_boxes([(name, box, tensor)])

                result = run_plan_and_vote(
                    state.plan,
                    group,
                    sink=sink,
                    device=group.device,
                    timeout_s=group.timeout_s,
                    check=discarded,
                    data_plane=state.data_plane,
                )
            else:
                result = self._aiosync_sharded_delta(state, int(delta["base"]), held, discarded)
        except BaseException:
            if group.broken:
                self._aiosync_sharded = None
                group.destroy()
            raise
        validity.mark_valid(self)
        state.held = (version, discards)
        return {
            "version": version,
            "nbytes": result.nbytes,
            "by_sender": {str(k): v for k, v in result.by_peer.items()},
            "buckets": result.buckets,
            "seconds": time.perf_counter() - start,
            "delta": delta is not None,
        }

    def _aiosync_sharded_delta(
        self, state: _State, base: int, held: int | None, check: Callable[[], str | None]
    ) -> P2PResult:
        """Receive a delta against ``base``; refused (nothing written) unless this
        worker holds ``base`` whole and its model applies patches."""
        who = f"engine worker {self.aiosync_worker_rank()}"
        model: Any = self._aiosync_patch_model()
        refusal: BaseException | None = None
        if held != base:
            refusal = RefitMismatchError(
                f"{who} holds version {held}, the delta patches were computed against "
                f"version {base}: a full sync is needed"
            )
        elif model is None:
            refusal = TransportError(
                f"{who}: {type(self.model_runner.model).__name__} cannot apply delta "  # type: ignore[attr-defined]
                "patches (apply_weight_patches)"
            )

        def apply(boxes: list[tuple[str, Box, torch.Tensor]], patches: list[WeightPatch]) -> None:
            if boxes:
                model.load_weight_boxes(boxes)
            if patches:
                model.apply_weight_patches(patches)

        group = state.group
        return run_delta_and_vote(
            state.plan,
            group,
            base=base,
            apply=apply,
            finish=lambda: finish_patches(model),
            refusal=refusal,
            device=group.device,
            timeout_s=group.timeout_s,
            check=check,
        )

    def _aiosync_sharded_state(self, owner: str) -> _State:
        state = self._aiosync_sharded
        if state is None:
            raise TransportError(
                "no sharded sync group on this worker: the trainer must init_communicator() first"
            )
        if owner != state.owner:
            raise OwnershipError(
                f"engine worker {self.aiosync_worker_rank()}'s sharded sync group belongs "
                "to another synchronizer"
            )
        return state

    def _aiosync_layout_model(self) -> LayoutModel:
        model = self.model_runner.model  # type: ignore[attr-defined]
        if not isinstance(model, LayoutModel):
            raise TransportError(
                f"{type(model).__name__} cannot report its weight layout or load boxes "
                "(weight_layout, load_weight_boxes): use the broadcast transport "
                "(CollectiveWeightSynchronizer)"
            )
        return model


def run_plan_and_vote(
    plan: Plan,
    group: SyncGroup,
    *,
    source: SourceFn | None = None,
    sink: SinkFn | None = None,
    device: torch.device,
    timeout_s: float,
    check: Callable[[], str | None] | None = None,
    data_plane: DataPlane = "torch",
) -> P2PResult:
    """This rank's share of ``plan`` over ``group.data``, then every rank's vote (trainers
    and workers alike): all of them raise the same error if any failed.

    Args:
        check: after a plan that moved everything, this rank's own reason to fail
            (None: none), voted like a failure of the plan.
        data_plane: ``"torch"`` (:func:`~._p2p.run_plan` over ``group.data``) or
            ``"mooncake"`` (:func:`~._mooncake.run_plan_mooncake`, control on
            ``group.ctrl``).

    Raises:
        What :func:`~._p2p.run_plan` raises (a lost peer aborts the group instead of
        voting, see :func:`vote_or_abort`), or the vote's error.
    """

    def run() -> P2PResult:
        if data_plane == "mooncake":
            from ._mooncake import run_plan_mooncake

            return run_plan_mooncake(
                plan, group.ctrl, group.rank, source=source, sink=sink, timeout_s=timeout_s
            )
        return run_plan(
            plan,
            group.data,
            group.rank,
            source=source,
            sink=sink,
            device=device,
            timeout_s=timeout_s,
        )

    return _vote_after(group, run, check)


def run_delta_and_vote(
    plan: Plan,
    group: SyncGroup,
    *,
    base: int,
    version: int = 0,
    source: SourceFn | None = None,
    baseline: ShardBaseline | None = None,
    apply: ApplyFn | None = None,
    finish: Callable[[], None] | None = None,
    refusal: BaseException | None = None,
    device: torch.device,
    timeout_s: float,
    check: Callable[[], str | None] | None = None,
) -> P2PResult:
    """:func:`run_plan_and_vote` for a delta sync (:func:`~._delta.run_delta_plan` over
    ``group.data``, the torch data plane): every rank raises the same error if any failed.
    """
    return _vote_after(
        group,
        lambda: run_delta_plan(
            plan,
            group.data,
            group.rank,
            base=base,
            version=version,
            source=source,
            baseline=baseline,
            apply=apply,
            finish=finish,
            refusal=refusal,
            device=device,
            timeout_s=timeout_s,
        ),
        check,
    )


def _vote_after(
    group: SyncGroup, run: Callable[[], P2PResult], check: Callable[[], str | None] | None
) -> P2PResult:
    try:
        result = run()
    except Exception as exc:
        vote_or_abort(group, exc)
        raise
    problem = check() if check is not None else None
    group.agree(STATUS_OK if problem is None else STATUS_ERROR, problem or "")
    return result


def vote_or_abort(group: SyncGroup, exc: BaseException) -> None:
    """After a failed plan: vote, or abort the group when a peer is gone.

    A failure every peer saw through (a source or sink that raised, a plan that
    differs) completes the plan on every rank, so the vote makes all of them raise
    the same error. A peer that died or stalled leaves others waiting for its
    bytes: destroying the group makes each of their waits fail at once
    (connection closed) instead of after its timeout, one wait after another.
    """
    if isinstance(exc, LINK_FAILURES):
        group.broken = True
        group.destroy()
        return
    group.agree(_status_of(exc), f"{type(exc).__name__}: {exc}")


def _status_of(exc: BaseException) -> int:
    return STATUS_MISMATCH if isinstance(exc, RefitMismatchError) else STATUS_ERROR


def _check_destination(plan: Plan, worker: int, held: Layout) -> None:
    """The plan's destination for ``worker`` must be what its model holds."""
    planned = plan.destinations[worker]
    if dict(planned) != dict(held):
        missing = sorted(set(held) - set(planned))
        extra = sorted(set(planned) - set(held))
        differ = sorted(n for n in set(held) & set(planned) if held[n] != planned[n])
        parts = []
        if missing:
            parts.append(f"held but not planned: {missing[:3]}")
        if extra:
            parts.append(f"planned but not held: {extra[:3]}")
        if differ:
            n = differ[0]
            parts.append(f"{n}: planned {planned[n]}, held {held[n]}")
        raise RefitMismatchError("the plan's layout for this worker differs: " + "; ".join(parts))
