"""Engine side of the collective transport: a worker-extension mixin.

vLLM (``worker_extension_cls``) and the embedded engine mix
:class:`CollectiveWorkerMixin` into their workers; the trainer's
:class:`~aiosync.transports.collective.CollectiveWeightSynchronizer` calls its methods by
name through ``collective_rpc``. Every argument and result is JSON-safe.

The worker needs ``self.model_runner.model.load_weights(iterable)`` taking HF
checkpoint names (vLLM's loader contract), and its rank among the engine's
workers in ``self.rank`` (vLLM's ``Worker.rank``; 0 when there is one worker).
If the model has ``expected_manifest()`` the trainer's manifest is compared to
it when the group forms (:class:`~aiosync.errors.RefitMismatchError` on every
rank, before any data moves).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict, Unpack, runtime_checkable

import torch

from aiosync.delta import PatchModel, WeightPatch, finish_patches, patch_from_wire, wire_manifest
from aiosync.errors import OwnershipError, RefitMismatchError, SyncTimeoutError, TransportError
from aiosync.options import check_keywords

from .. import validity
from .._identity import WorkerIdentityMixin
from .._verify import Verify
from ..packing import Bucket, BucketPlan, compare_manifests, plan_buckets, unpack
from ..previous import begin_refit, whole_receive
from ._group import SyncGroup
from ._loops import RotatingBuffers, receive_buckets
from ._member import GroupMeeting, delta_refusal, held_version, join_group, may_leave


@runtime_checkable
class ManifestModel(Protocol):
    """A worker's model that knows what it loads: ``{hf_name: (shape, dtype)}``,
    compared with the trainer's plan before the group forms."""

    def expected_manifest(self) -> Mapping[str, tuple[tuple[int, ...], Any]]:
        """The HF names, shapes and dtypes the model's loader takes."""
        ...


__all__ = ["CollectiveWorkerMixin"]


class ReceiveOptions(TypedDict, total=False):
    """The options of a receive, in place or staged, besides its version and KV names."""

    #: The source's mode (``True``, ``"sample"`` or ``False``,
    #: :mod:`aiosync.transports._verify`; checked against the header): digest each
    #: bucket received and compare with the source's digests before the vote.
    #: Default False.
    verify: Verify
    #: The token the group was formed with (default ``""``).
    owner: str
    #: A delta sync: ``{"base": version the patches were computed against, "patches":
    #: [[name, base, shape, encoding, k], ...], "digest": the wire plan's}``
    #: (:mod:`aiosync.delta`); the buckets then carry the patches' wire tensors,
    #: written in place through the model's ``apply_weight_patches``. A worker that
    #: does not hold ``base`` whole (``aiosync_collective_held_version``), or whose
    #: model cannot apply patches, writes nothing and votes the refusal. Default
    #: None: the full weights.
    delta: dict[str, Any] | None


@dataclass(eq=False)
class _Staged:
    """A staged receive running in a background thread."""

    version: int
    kv_names: list[str]
    thread: threading.Thread
    started: float
    #: The plan received (a delta's wire plan, or the full one) and its buffers.
    plan: BucketPlan
    buffers: list[torch.Tensor]
    #: A delta's bucket loader (its patches); None: the full weights.
    load: Callable[[Bucket, torch.Tensor], None] | None = None
    result: tuple[torch.Tensor, list[int]] | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class _ReceiverState:
    group: SyncGroup
    plan: BucketPlan
    rotating: RotatingBuffers
    #: The owner token of the synchronizer that formed the group.
    owner: str = ""
    staging: list[torch.Tensor] = field(default_factory=list)
    staged: _Staged | None = None
    #: ``(version, discard epoch)`` this worker holds whole through this group, from
    #: its last successful receive: the only base a delta patch may be applied to.
    held: tuple[int, int] | None = None


class CollectiveWorkerMixin(WorkerIdentityMixin):
    """Receiver of :class:`~aiosync.transports.collective.CollectiveWeightSynchronizer`.

    Attributes:
        aiosync_weights_valid: False from the start of an in-place receive (or of
            a staged commit) until the whole manifest has landed; engines refuse
            to generate while it is False.
    """

    aiosync_weights_valid: bool = True
    _aiosync_collective: _ReceiverState | None = None

    # -- lifecycle -------------------------------------------------------------

    def aiosync_collective_init(
        self,
        *,
        plan: dict[str, Any],
        owner: str = "",
        delta: bool = False,
        **meeting: Unpack[GroupMeeting],
    ) -> dict[str, Any]:
        """Join the sync group as inference rank ``train_world_size + aiosync_worker_rank()``.

        Blocks until every rank has joined and compared the bucket-plan digest
        (and, when the model has ``expected_manifest()``, the manifest itself).
        If this worker fails before or while joining, it cancels the formation,
        so the source and the other workers give up at once; if any of them
        failed first, this call gives up at once too (within ~50 ms).
        A previous group of the same ``owner`` (or of an owner that is gone) is
        destroyed first; one of another live owner is left alone and the call
        refused.

        Args:
            plan: the trainer's :meth:`BucketPlan.to_json`.
            owner: the forming synchronizer's token; every later call on the
                group must carry it.
            delta: the synchronizer sends delta patches: keep what applying them
                needs (:attr:`aiosync_keep_delta_base`).
            **meeting: where and how the group meets (:class:`~._member.GroupMeeting`:
                ``master_addr``, ``master_port``, ``world_size``, ``train_world_size``,
                ``backend``, ``timeout_s``: the limit of the rendezvous and of every
                later collective, ``session``: the group's key namespace in the store).

        Returns:
            ``{"rank": session rank, "digest": plan digest}``.

        Raises:
            OwnershipError: the worker is in a live group of another synchronizer.
            RefitMismatchError: some rank's manifest or plan differs (raised on every rank).
            SyncTimeoutError: a rank did not join within ``timeout_s``.
            TransportError: the rendezvous failed, or another rank (or the
                trainer) failed to form the group: the error quotes its reason.
        """
        check_keywords(GroupMeeting, meeting, "aiosync_collective_init")

        def prepare() -> int:
            self.aiosync_collective_destroy(owner=owner)
            trainers = meeting["train_world_size"]
            return trainers + self._aiosync_coll_rank(meeting["world_size"] - trainers)

        def parse() -> BucketPlan:
            parsed = BucketPlan.from_json(plan)
            model = self.model_runner.model  # type: ignore[attr-defined]
            if isinstance(model, ManifestModel):
                compare_manifests(parsed.manifest(), model.expected_manifest())
            return parsed

        group, parsed = join_group(
            meeting,
            who=f"engine worker {self.aiosync_worker_rank()}",
            prepare=prepare,
            parse=parse,
        )
        self._aiosync_collective = _ReceiverState(
            group, parsed, RotatingBuffers(parsed, group.device), owner
        )
        self.aiosync_keep_delta_base = delta
        return {"rank": group.rank, "digest": parsed.digest}

    def aiosync_collective_destroy(self, owner: str = "") -> None:
        """Leave and destroy the sync group (idempotent; waits for a staged receive).

        Raises:
            OwnershipError: the group belongs to another synchronizer that is
                still alive (a group whose owner is gone is destroyed).
        """
        state = self._aiosync_collective
        if state is None:
            return
        if not may_leave(state.group, state.owner, owner):
            raise OwnershipError(self._aiosync_coll_foreign("destroy"))
        self._aiosync_collective = None
        if state.staged is not None:
            state.staged.thread.join(state.group.timeout_s)
        state.group.destroy()

    # -- receiving -------------------------------------------------------------

    def aiosync_collective_held_version(self, owner: str = "") -> int | None:
        """The version this worker holds whole through this synchronizer's group
        (None: none it can vouch for: a failed or partial receive, discarded weights,
        a new group, a model that cannot apply patches): the base a delta sync needs."""
        return held_version(self._aiosync_collective_state(owner).held, self)

    @whole_receive
    def aiosync_collective_receive(
        self, *, version: int, kv_names: list[str], **options: Unpack[ReceiveOptions]
    ) -> dict[str, Any]:
        """Receive version ``version`` in place: each bucket is loaded as it lands.

        Sets :attr:`aiosync_weights_valid` False at the start and True only when
        every bucket and the KV scales are loaded and every rank voted success:
        a bucket that arrived otherwise than the source sent it (``verify``) fails
        the vote, so the weights stay invalid and the engine refuses to generate.

        Args:
            version: the weight version being sent (checked against the header).
            kv_names: engine names of the FP8 KV-cache scales sent at the end.
            **options: ``verify``, ``owner``, ``delta`` (:class:`ReceiveOptions`).

        Returns:
            ``{"version", "nbytes", "checksums", "pause_s", "kv_scales"}``:
            payload bytes received, this rank's per-bucket digests (empty with
            ``verify=False``), seconds generation was blocked, ``{name: value}``.

        Raises:
            OwnershipError: the group belongs to another synchronizer.
            RefitVerificationError: a bucket arrived otherwise than the source sent
                it, on this worker or another (every rank raises).
            TransportError: a collective failed (the group is then destroyed),
                bad header, or another rank failed.
            RefitMismatchError: the engine rejected a tensor (every rank raises).
            SyncTimeoutError: a collective ran past the group's timeout.
        """
        check_keywords(ReceiveOptions, options, "aiosync_collective_receive")
        owner, delta = options.get("owner", ""), options.get("delta")
        verify = options.get("verify", False)
        state = self._aiosync_collective_state(owner)
        start = time.perf_counter()
        held = self.aiosync_collective_held_version(owner)
        discards = self.aiosync_discard_epoch
        model = self.model_runner.model  # type: ignore[attr-defined]
        plan, refusal = state.plan, None
        load: Any

        def load_full(bucket: Bucket, buf: torch.Tensor) -> None:
            model.load_weights(unpack(buf, bucket))

        load = load_full
        if delta is not None:
            plan, load, refusal = self._aiosync_coll_delta(
                state, delta, held, self._aiosync_patch_model()
            )
        state.held = None
        begin_refit(self, version)
        try:
            kv, checksums = receive_buckets(
                state.group,
                plan,
                state.rotating.for_plan(plan),
                version=version,
                n_kv=len(kv_names),
                verify=verify,
                on_bucket=load,
                refuse=refusal,
            )
            scales = self._aiosync_coll_load_kv(kv_names, kv, state.group.device)
        except BaseException:
            self._aiosync_coll_drop_if_broken()
            raise
        self._aiosync_coll_check_discards(discards)
        validity.mark_valid(self)
        state.held = (version, discards)
        return self._aiosync_coll_result(
            version, kv_names, checksums, scales, start, nbytes=plan.total_bytes
        )

    def _aiosync_coll_delta(
        self,
        state: _ReceiverState,
        delta: dict[str, Any],
        held: int | None,
        model: PatchModel | None,
    ) -> tuple[BucketPlan, Any, BaseException | None]:
        """The wire plan of a delta sync, the bucket loader that applies its patches,
        and the reason to refuse it (voted after the stream; nothing is written)."""
        metas = {str(m[0]): list(m) for m in delta["patches"]}
        try:
            plan = plan_buckets(
                wire_manifest(metas.values(), state.plan.manifest()), state.plan.bucket_bytes
            )
        except (KeyError, RefitMismatchError) as exc:
            # The stream cannot be interpreted without its plan.
            state.group.broken = True
            raise RefitMismatchError(f"malformed delta: {exc!r}") from exc
        if plan.digest != delta["digest"]:
            state.group.broken = True
            raise RefitMismatchError("delta plan digest differs from the trainer's")
        refusal = delta_refusal(self, held, int(delta["base"]), model)
        # A sparse patch is two wire tensors (where, values), maybe in two buckets.
        partial: dict[str, dict[str, torch.Tensor]] = {}
        last = len(plan.buckets) - 1

        def load(bucket: Bucket, buf: torch.Tensor) -> None:
            assert model is not None  # else refused: nothing is loaded
            ready: list[WeightPatch] = []
            waiting: dict[str, dict[str, torch.Tensor]] = {}
            for wire, tensor in unpack(buf, bucket):
                name = wire if wire in metas else wire.rsplit("@", 1)[0]
                meta = metas[name]
                if meta[3] == "dense":
                    ready.append(patch_from_wire(meta, {wire: tensor}))
                    continue
                half = partial.pop(name, None) or waiting.pop(name, None)
                if half is None:
                    waiting[name] = {wire: tensor}
                else:
                    ready.append(patch_from_wire(meta, {**half, wire: tensor}))
            model.apply_weight_patches(ready)
            # The other half lands in a later bucket, maybe in this same buffer.
            for name, half in waiting.items():
                partial[name] = {w: t.clone() for w, t in half.items()}
            if bucket.index == last:  # before the vote: a failure fails every rank
                finish_patches(model)

        return plan, load, refusal

    def aiosync_collective_stage(
        self, *, version: int, kv_names: list[str], **options: Unpack[ReceiveOptions]
    ) -> dict[str, Any]:
        """Start receiving ``version`` into a staging area; returns at once.

        The engine keeps generating with its live weights meanwhile; the
        staging area holds one full copy of the packed weights (on the GPU with
        NCCL), or a delta's wire buckets (``delta``: as for
        :meth:`aiosync_collective_receive`; a worker that does not hold its base
        refuses it, every rank failing at the vote, and nothing is written).
        ``verify`` as for :meth:`aiosync_collective_receive`: the staged buckets
        are checked before the vote, so a bucket that arrived otherwise than it
        was sent fails the sync before the commit, the live weights untouched.
        :meth:`aiosync_collective_commit` then writes it in. Raises
        :class:`~aiosync.errors.OwnershipError` for a group of another owner.
        """
        check_keywords(ReceiveOptions, options, "aiosync_collective_stage")
        owner, delta = options.get("owner", ""), options.get("delta")
        verify = options.get("verify", False)
        state = self._aiosync_collective_state(owner)
        if state.staged is not None:
            raise TransportError("a staged receive is already running on this worker")
        plan, refusal, load = state.plan, None, None
        if delta is not None:
            held = self.aiosync_collective_held_version(owner)
            plan, load, refusal = self._aiosync_coll_delta(
                state, delta, held, self._aiosync_patch_model()
            )
            # A delta's buckets are few and small: a staging area of their own.
            buffers = [
                torch.empty(b.nbytes, dtype=torch.uint8, device=state.group.device)
                for b in plan.buckets
            ]
        else:
            if not state.staging:
                state.staging = [
                    torch.empty(b.nbytes, dtype=torch.uint8, device=state.group.device)
                    for b in state.plan.buckets
                ]
            buffers = state.staging
        staged = _Staged(
            version, list(kv_names), threading.Thread(), time.perf_counter(), plan, buffers, load
        )
        device = state.group.device

        def run() -> None:
            stream = None
            if device.type == "cuda":
                torch.cuda.set_device(device)
                stream = torch.cuda.Stream(device=device)
            try:
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    staged.result = receive_buckets(
                        state.group,
                        plan,
                        lambda b: buffers[b.index],
                        version=version,
                        n_kv=len(kv_names),
                        verify=verify,
                        on_bucket=None,
                        refuse=refusal,
                    )
                if stream is not None:
                    stream.synchronize()
            except BaseException as exc:
                staged.error = exc

        staged.thread = threading.Thread(target=run, name="aiosync-stage", daemon=True)
        state.staged = staged
        staged.thread.start()
        return {"version": version, "staging_bytes": sum(t.numel() for t in buffers)}

    @whole_receive
    def aiosync_collective_commit(self, *, version: int, owner: str = "") -> dict[str, Any]:
        """Wait for the staged receive of ``version``, then copy it into the live weights.

        Generation pauses only here: :attr:`aiosync_weights_valid` is False
        during the copy. Returns what :meth:`aiosync_collective_receive` returns.

        Raises:
            OwnershipError: the group belongs to another synchronizer.
            TransportError: no staged receive, a different version, or it failed.
            RefitVerificationError: the staged receive found a bucket that arrived
                otherwise than it was sent (nothing is written).
            SyncTimeoutError: it did not finish within the group's timeout.
        """
        state = self._aiosync_collective_state(owner)
        staged = state.staged
        if staged is None or staged.version != version:
            raise TransportError(f"no staged receive of version {version} on this worker")
        staged.thread.join(state.group.timeout_s)
        if staged.thread.is_alive():
            raise SyncTimeoutError(
                f"staged receive of version {version} still running after {state.group.timeout_s} s"
            )
        state.staged = None
        if staged.error is not None:
            self._aiosync_coll_drop_if_broken()
            raise staged.error
        assert staged.result is not None
        kv, checksums = staged.result
        start = time.perf_counter()
        discards = self.aiosync_discard_epoch
        state.held = None
        begin_refit(self, version)
        if staged.load is not None:  # a delta: its patches, bucket by bucket
            for bucket, buf in zip(staged.plan.buckets, staged.buffers, strict=True):
                staged.load(bucket, buf)
        else:
            model = self.model_runner.model  # type: ignore[attr-defined]
            model.load_weights(self._aiosync_coll_iter_staged(state))
        scales = self._aiosync_coll_load_kv(staged.kv_names, kv, state.group.device)
        self._aiosync_coll_check_discards(discards)
        validity.mark_valid(self)
        state.held = (version, discards)
        return self._aiosync_coll_result(
            version, staged.kv_names, checksums, scales, start, nbytes=staged.plan.total_bytes
        )

    # -- helpers ---------------------------------------------------------------

    def _aiosync_coll_check_discards(self, discards: int) -> None:
        if self.aiosync_discard_epoch != discards:
            raise TransportError("the engine discarded this worker's weights during the refit")

    def _aiosync_collective_state(self, owner: str | None = None) -> _ReceiverState:
        """The group; with ``owner``, only if that synchronizer formed it."""
        state = self._aiosync_collective
        if state is None:
            raise TransportError(
                "no sync group on this worker: the trainer must init_communicator() first"
            )
        if owner is not None and owner != state.owner:
            raise OwnershipError(self._aiosync_coll_foreign("drive"))
        return state

    def _aiosync_coll_foreign(self, what: str) -> str:
        return (
            f"engine worker {self.aiosync_worker_rank()} is in the sync group of another "
            f"synchronizer, which is still alive: a synchronizer may not {what} it; one "
            "engine takes one trainer's refits at a time"
        )

    def _aiosync_coll_drop_if_broken(self) -> None:
        state = self._aiosync_collective
        if state is not None and state.group.broken:
            self.aiosync_collective_destroy(owner=state.owner)

    def _aiosync_coll_rank(self, inference_world: int) -> int:
        if getattr(self, "rank", None) is None and inference_world != 1:
            raise TransportError(
                "the worker has no `rank` attribute; it is needed with several workers"
            )
        rank = self.aiosync_worker_rank()
        if not 0 <= rank < inference_world:
            raise TransportError(f"worker rank {rank} outside 0..{inference_world - 1}")
        return rank

    @staticmethod
    def _aiosync_coll_iter_staged(state: _ReceiverState) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket, buf in zip(state.plan.buckets, state.staging, strict=True):
            yield from unpack(buf, bucket)

    def _aiosync_coll_load_kv(
        self, names: list[str], values: torch.Tensor, device: torch.device
    ) -> dict[str, float]:
        if not names:
            return {}
        tensors = [(n, values[i].to(device)) for i, n in enumerate(names)]
        self.model_runner.model.load_weights(iter(tensors))  # type: ignore[attr-defined]
        return {n: float(values[i]) for i, n in enumerate(names)}

    def _aiosync_coll_result(
        self,
        version: int,
        kv_names: list[str],
        checksums: list[int],
        scales: dict[str, float],
        start: float,
        nbytes: int | None = None,
    ) -> dict[str, Any]:
        state = self._aiosync_collective_state()
        payload = state.plan.total_bytes if nbytes is None else nbytes
        return {
            "version": version,
            "nbytes": payload + 4 * len(kv_names),
            "checksums": checksums,
            "pause_s": time.perf_counter() - start,
            "kv_scales": scales,
        }
