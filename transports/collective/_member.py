"""An engine worker's side of a sync group, as both group-based workers hold it.

The broadcast worker (:class:`~aiosync.transports.collective.CollectiveWorkerMixin`)
and the shard-aware one (:class:`~aiosync.transports.sharded.ShardedWorkerMixin`)
join a group the same way (:func:`join_group`: a local failure cancels the
formation, a local mismatch is voted), vouch for the version they hold whole the
same way (:func:`held_version`), leave it only when theirs or their owner is gone
(:func:`may_leave`), and refuse a delta they cannot apply with the same
words (:func:`delta_refusal`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypedDict, TypeVar

import torch

from aiosync.delta import PatchModel
from aiosync.errors import RefitMismatchError, TransportError

from .._identity import WorkerIdentityMixin
from ._group import (
    STATUS_MISMATCH,
    STATUS_OK,
    SyncGroup,
    cancel_formation,
    create_sync_group,
    open_store,
)

__all__ = [
    "GroupMeeting",
    "delta_refusal",
    "device_for",
    "held_version",
    "join_group",
    "may_leave",
    "owner_alive",
]


class _Digested(Protocol):
    @property
    def digest(self) -> str: ...


_P = TypeVar("_P", bound=_Digested)

#: A store key only checked for (never set): the check is a round trip to the owner.
_PROBE_KEY = "aiosync/owner-probe"


class GroupMeeting(TypedDict):
    """Where and how a sync group meets: the keywords a worker's init RPC takes from
    the synchronizer for it (the rest of that RPC's are its own)."""

    #: The address and port of the store trainer rank 0 serves.
    master_addr: str
    master_port: int
    #: Every rank of the session, and the trainer ranks among them (``0..T-1``).
    world_size: int
    train_world_size: int
    #: The data group's backend, ``"nccl"`` or ``"gloo"``.
    backend: str
    #: Limit of the rendezvous and of every later wait, seconds.
    timeout_s: float
    #: The key namespace of this group in the store.
    session: str


def device_for(backend: str) -> torch.device:
    """Where a worker's buffers of a ``backend`` group live: its CUDA device for nccl."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def owner_alive(group: SyncGroup) -> bool:
    """Whether the trainer that formed ``group`` can still drive it: the group is not
    broken and the store its rank 0 serves still answers (a dead trainer's store
    connection fails at once)."""
    store = group.store
    if group.broken or store is None:
        return False
    try:
        store.check([_PROBE_KEY])
    except Exception:  # DistNetworkError/DistStoreError: the owner's store is gone
        return False
    return True


def may_leave(group: SyncGroup, formed_by: str, owner: str) -> bool:
    """Whether the synchronizer of token ``owner`` may destroy ``group``, which the one
    of token ``formed_by`` formed: its own, or one whose owner is gone."""
    return owner == formed_by or not owner_alive(group)


def join_group(
    meeting: GroupMeeting,
    *,
    who: str,
    prepare: Callable[[], int],
    parse: Callable[[], _P],
    every_rank_sends: bool = False,
) -> tuple[SyncGroup, _P]:
    """Join the sync group that meets as ``meeting`` says as an engine worker (blocking).

    ``prepare()`` leaves this worker's previous group and returns its session rank;
    ``parse()`` reads the trainer's plan, checks it against the model and returns it
    (its ``digest`` is compared on every rank). A
    :class:`~aiosync.errors.RefitMismatchError` of ``parse`` is voted, so every rank
    raises it; any other failure before the rendezvous cancels the formation (the
    source and the other workers give up at once, quoting ``who``) and is raised.

    Returns:
        The group and the parsed plan.
    """
    session, timeout_s = meeting["session"], meeting["timeout_s"]
    store = open_store(
        meeting["master_addr"], meeting["master_port"], is_master=False, timeout_s=timeout_s
    )
    status, message, digest = STATUS_OK, "", ""
    parsed: _P | None = None
    try:
        rank = prepare()
        try:
            parsed = parse()
            digest = parsed.digest
        except RefitMismatchError as exc:
            status, message = STATUS_MISMATCH, f"{who}: {exc}"
    except Exception as exc:
        # The source and the other workers may already wait in the rendezvous
        # for this rank: release them now rather than after the whole timeout.
        cancel_formation(store, session, f"{who} failed: {type(exc).__name__}: {exc}")
        raise
    # Join even after a local mismatch, so that the vote tells every rank
    # (create_sync_group cancels the formation itself if it fails here).
    backend = meeting["backend"]
    group = create_sync_group(
        store=store,
        rank=rank,
        world_size=meeting["world_size"],
        train_world_size=meeting["train_world_size"],
        backend=backend,
        device=device_for(backend),
        timeout_s=timeout_s,
        session=session,
        every_rank_sends=every_rank_sends,
        verdict=(status, message, digest),
    )
    assert parsed is not None  # a mismatch failed the vote above
    return group, parsed


def held_version(held: tuple[int, int] | None, worker: WorkerIdentityMixin) -> int | None:
    """The version ``worker`` holds whole, from ``held`` (``(version, discard epoch)``
    of its last successful receive): None when it cannot vouch for one (a failed
    receive, weights discarded since, a model that cannot apply patches)."""
    if held is None or held[1] != worker.aiosync_discard_epoch:
        return None
    if worker._aiosync_patch_model() is None:
        return None  # it could not apply a delta: every sync is a full one
    return held[0]


def delta_refusal(
    worker: WorkerIdentityMixin, held: int | None, base: int, model: PatchModel | None
) -> BaseException | None:
    """Why ``worker`` (holding ``held`` whole, writing patches through ``model``) must
    refuse a delta against ``base``; None: it can apply it."""
    who = f"engine worker {worker.aiosync_worker_rank()}"
    if held != base:
        return RefitMismatchError(
            f"{who} holds version {held}, the delta patches were computed against "
            f"version {base}: a full sync is needed"
        )
    if model is None:
        return TransportError(
            f"{who}: {type(worker.model_runner.model).__name__} cannot apply delta "  # type: ignore[attr-defined]
            "patches (apply_weight_patches)"
        )
    return None
