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
from typing import Any, Literal, Protocol, Unpack, runtime_checkable

import torch

from aiosync.delta import WeightPatch, finish_patches
from aiosync.errors import OwnershipError, RefitMismatchError, TransportError
from aiosync.layout import Layout, Part
from aiosync.options import check_keywords

from .. import validity
from .._identity import WorkerIdentityMixin
from ..collective._group import STATUS_ERROR, STATUS_MISMATCH, STATUS_OK, SyncGroup
from ..collective._member import (
    GroupMeeting,
    delta_refusal,
    held_version,
    join_group,
    may_leave,
)
from ..packing import dtype_from_name
from ._delta import run_delta_plan
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


@dataclass(eq=False)
class _State:
    group: SyncGroup
    plan: Plan
    owner: str
    data_plane: DataPlane = "torch"
    #: ``(version, discard epoch)`` this worker holds whole through this group, from
    #: its last successful receive: the only base a delta may be applied to.
    held: tuple[int, int] | None = None


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
        plan: dict[str, Any],
        owner: str = "",
        data_plane: DataPlane = "torch",
        delta: bool = False,
        **meeting: Unpack[GroupMeeting],
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
            owner: the forming synchronizer's token; later calls must carry it.
            data_plane: what moves the buckets: ``"torch"`` (the group's
                point-to-point sends) or ``"mooncake"`` (Mooncake writes, the
                control messages on the group; :mod:`._mooncake`).
            delta: the synchronizer sends delta patches: keep what applying them
                needs (:attr:`aiosync_keep_delta_base`).
            **meeting: where and how the group meets
                (:class:`~..collective._member.GroupMeeting`; ``timeout_s`` also limits
                every later wait).

        Returns:
            ``{"rank": session rank, "digest": plan digest, "nbytes": bytes this
            worker receives per sync}``.

        Raises:
            OwnershipError: the worker is in a live group of another synchronizer.
            RefitMismatchError: a rank's plan differs, or the plan's destination for
                this worker is not what its model holds (raised on every rank).
            SyncTimeoutError, TransportError: the rendezvous failed or timed out.
        """
        check_keywords(GroupMeeting, meeting, "aiosync_sharded_init")
        worker = self.aiosync_worker_rank()

        def prepare() -> int:
            self.aiosync_sharded_destroy(owner=owner)
            trainers = meeting["train_world_size"]
            inference_world = meeting["world_size"] - trainers
            if not 0 <= worker < inference_world:
                raise TransportError(f"worker rank {worker} outside 0..{inference_world - 1}")
            self._aiosync_layout_model()  # refused before the rendezvous
            return trainers + worker

        def parse() -> Plan:
            parsed = plan_from_wire(plan)
            _check_destination(parsed, worker, self._aiosync_layout_model().weight_layout())
            return parsed

        group, parsed = join_group(
            meeting,
            who=f"engine worker {worker}",
            prepare=prepare,
            parse=parse,
            every_rank_sends=True,
        )
        self._aiosync_sharded = _State(group, parsed, owner, data_plane)
        self.aiosync_keep_delta_base = delta
        return {
            "rank": group.rank,
            "digest": parsed.digest,
            "nbytes": parsed.receiver_nbytes[worker],
        }

    def aiosync_sharded_destroy(self, owner: str = "") -> None:
        """Leave and destroy the sync group (idempotent): refused with
        :class:`~aiosync.errors.OwnershipError` while another synchronizer that owns it
        is alive; one whose owner is gone is destroyed."""
        state = self._aiosync_sharded
        if state is None:
            return
        if not may_leave(state.group, state.owner, owner):
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
        return held_version(self._aiosync_sharded_state(owner).held, self)

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
        model: Any = self._aiosync_patch_model()
        refusal = delta_refusal(self, held, base, model)

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
    check: Callable[[], str | None] | None = None,
    **delta: Any,
) -> P2PResult:
    """:func:`run_plan_and_vote` for a delta sync: :func:`~._delta.run_delta_plan` over
    ``group.data`` (the torch data plane), with its keywords ``delta`` (``base``,
    ``version``, ``source``, ``baseline``, ``apply``, ``finish``, ``refusal``,
    ``device``, ``timeout_s``); every rank raises the same error if any failed.
    """
    return _vote_after(group, lambda: run_delta_plan(plan, group.data, group.rank, **delta), check)


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
