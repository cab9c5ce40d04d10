"""Who a worker is: its rank among every worker a synchronizer feeds, and its device.

**Rank.** One synchronizer may feed several engines at once (an
:class:`~aiosync.EngineFleet`, or vLLM's data-parallel replicas). Each worker
then needs a rank that is unique across all of them, for the IPC transport's
socket identities and the collective transport's group ranks. As vLLM's own
NCCL weight-transfer engine does, the rank is
``data_parallel_index * world_size + rank`` (``world_size`` = TP × PP of one
replica), plus an offset the fleet gives each engine (the worker counts of the
engines before it). An engine that stands for only some of vLLM's DP replicas
(an external-LB rank, a hybrid-LB node: ``data_parallel_index`` from ``base``
on) is numbered from its first replica, ``base``, which the fleet's offset
replaces.

**Device.** A sharded trainer pairs each of its ranks with the engine workers on
the same device (CUDA IPC handles do not cross devices): a CUDA device is
identified by its GPU UUID (as vLLM and NeMo-RL key their IPC sockets), a CPU
"device" by an explicit label (the embedded engine's ``device_labels``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import torch

from aiosync._digest import tensor_digest
from aiosync.delta import PatchModel

from . import peer
from ._verify import arm_transit_fault
from .previous import PreviousWeights, begin_refit, whole_receive

__all__ = ["CPU_LABEL", "WorkerIdentityMixin", "device_identity"]

#: The label of a CPU device when none is given.
CPU_LABEL = "cpu"


@runtime_checkable
class _ReadableModel(Protocol):
    def hf_state_dict(self) -> Mapping[str, torch.Tensor]: ...


def device_identity(device: torch.device, label: str | None = None) -> str:
    """``device``'s identity: ``label`` if given, else the GPU UUID on CUDA
    (``"GPU-<uuid>"``, as ``nvidia-smi -L`` prints it), else ``"cpu"``."""
    if label is not None:
        return label
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return f"GPU-{torch.cuda.get_device_properties(index).uuid}"
    return CPU_LABEL


class WorkerIdentityMixin:
    """Gives an engine worker its global rank and its device identity.

    Reads ``self.rank`` (vLLM's ``Worker.rank``, the embedded engine's; 0 when
    absent), on vLLM ``self.parallel_config`` (``rank``, ``world_size``,
    ``data_parallel_index``), and ``self.device_label`` (the embedded engine's
    label of a CPU worker's device; None elsewhere). Engines that can discard a
    worker's weights while a refit runs increment ``aiosync_discard_epoch``.
    """

    _aiosync_rank_offset: int = 0
    _aiosync_dp_base: int = 0
    #: The label of a CPU worker's device (the embedded engine sets it); None
    #: elsewhere: the device is found (a GPU's UUID, or ``"cpu"``).
    device_label: str | None = None
    #: Incremented by the engine whenever it discards this worker's weights (a
    #: level-2 sleep, a memory release): a refit that spans a discard must not
    #: mark the weights valid.
    aiosync_discard_epoch: int = 0
    #: Set by the init call of a synchronizer built with ``delta=True``: the engine
    #: keeps what it needs to apply delta patches (vLLM: a host copy of its weights).
    aiosync_keep_delta_base: bool = False

    #: Armed by ``aiosync_keep_previous(True)`` (``on_failure="serve_previous"``): the
    #: worker copies its live weights before a refit writes them (:mod:`.previous`).
    aiosync_previous: PreviousWeights | None = None

    def aiosync_keep_previous(self, enabled: bool) -> int:
        """Arm (``enabled``) or disarm this worker's copy of its last good version
        (:mod:`aiosync.transports.previous`). Returns the host bytes its copy will
        take: the worker's weights, parameters and buffers.

        Raises:
            NotImplementedError: the engine's live weights are not all in
                :meth:`_aiosync_weight_modules` (vLLM, whose layers repack theirs).
        """
        if not enabled:
            self.aiosync_previous = None
            return 0
        if self.aiosync_previous is None:
            self.aiosync_previous = PreviousWeights(self._aiosync_weight_modules())
        return self.aiosync_previous.nbytes

    def aiosync_restore_previous(self, version: int, timeout_s: float = 10.0) -> bool:
        """After the refit of ``version`` failed: once no receive is writing (waiting
        up to ``timeout_s`` seconds), put back the weights this worker held before that
        refit wrote them, valid again. Returns whether anything was written (False:
        the refit never wrote this worker, which kept its weights).

        Raises:
            TimeoutError: a receive still ran after ``timeout_s``.
            SyncError: this worker is not armed, or its weights are not one whole
                version and it holds no copy from before ``version`` (it discarded
                them, or it was respawned): its engine cannot serve the previous one.
        """
        from aiosync.errors import SyncError

        from . import validity

        previous = self.aiosync_previous
        if previous is not None and previous.restore(version, timeout_s):
            validity.mark_valid(cast(validity.HoldsWeights, self))
            return True
        if previous is not None and validity.is_valid(self):
            return False
        raise SyncError(
            f"engine worker {self.aiosync_worker_rank()} holds no whole version to serve "
            f"after the refit of version {version} failed"
            + ("" if previous is not None else " (not armed: aiosync_keep_previous)")
        )

    def _aiosync_weight_modules(self) -> list[torch.nn.Module]:
        """What holds the live weights (``state_dict``: every tensor the engine computes
        with). Default: ``model_runner.model`` when it is a module.

        Raises:
            NotImplementedError: it is not a module.
        """
        model = self.model_runner.model  # type: ignore[attr-defined]
        if not isinstance(model, torch.nn.Module):
            raise NotImplementedError(
                f"{type(model).__name__} is not a torch module: this worker cannot keep "
                "a copy of its weights"
            )
        return [model]

    def aiosync_set_rank_offset(self, offset: int, dp_base: int = 0) -> int:
        """Called by :class:`~aiosync.EngineFleet`: this engine's workers start at
        rank ``offset`` (>= 0). ``dp_base`` (passed by the vLLM backend) is the
        first vLLM data-parallel index the engine's client reaches: replicas
        count from it. Returns the worker's rank with the offset applied.

        Raises:
            ValueError: ``offset`` or ``dp_base`` is negative or not an int, or
                this worker's data-parallel index is below ``dp_base``.
        """
        for what, value in (("rank offset", offset), ("dp_base", dp_base)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{what} must be an int >= 0, got {value!r}")
        index = self._aiosync_dp_index()
        if index < dp_base:
            raise ValueError(
                f"this worker's data-parallel index {index} is below dp_base {dp_base}"
            )
        self._aiosync_rank_offset = offset
        self._aiosync_dp_base = dp_base
        return self.aiosync_worker_rank()

    def aiosync_worker_rank(self) -> int:
        """``offset + (data_parallel_index - dp_base) * world_size + rank`` (0-based)."""
        index = self._aiosync_dp_index() - self._aiosync_dp_base
        per_replica = self._aiosync_replica_world_size() if index else 1
        return self._aiosync_rank_offset + index * per_replica + self._aiosync_replica_rank()

    def aiosync_worker_identity(self) -> dict[str, int]:
        """Who this worker is among vLLM's data-parallel replicas, msgpack-safe.

        Returns:
            ``{"rank": aiosync_worker_rank(), "dp_index": int, "replica_rank": int,
            "replica_world_size": int}``: vLLM's ``data_parallel_index`` (0
            outside vLLM), the worker's rank within its replica and the
            replica's worker count (TP × PP). vLLM resets a dense model's
            ``data_parallel_size`` to 1 on the worker (its DP ranks run
            independently); ``data_parallel_index`` keeps the replica's rank.
        """
        return {
            "rank": self.aiosync_worker_rank(),
            "dp_index": self._aiosync_dp_index(),
            "replica_rank": self._aiosync_replica_rank(),
            "replica_world_size": self._aiosync_replica_world_size(),
        }

    def _aiosync_dp_index(self) -> int:
        # parallel_config: a vLLM worker's only (the embedded worker has none).
        config = getattr(self, "parallel_config", None)
        index = getattr(config, "data_parallel_index", None)
        if index is None:
            index = getattr(config, "data_parallel_rank", None) or 0  # older vLLM
        return int(index)

    def _aiosync_replica_rank(self) -> int:
        rank = getattr(getattr(self, "parallel_config", None), "rank", None)
        if rank is None:
            rank = getattr(self, "rank", None) or 0
        return int(rank)

    def _aiosync_replica_world_size(self) -> int:
        return int(getattr(getattr(self, "parallel_config", None), "world_size", 1))

    def aiosync_device_identity(self) -> str:
        """This worker's device: its ``device_label``, else the GPU UUID of the
        current CUDA device, else ``"cpu"``."""
        label = self.device_label
        if label is None and torch.cuda.is_available():
            return device_identity(torch.device("cuda"))
        return device_identity(torch.device("cpu"), label)

    def _aiosync_patch_model(self) -> PatchModel | None:
        """Where this worker writes delta patches: its model when it applies them in
        place (:class:`~aiosync.delta.PatchModel`), else None (every sync is full).
        Engines whose weights cannot be written in place override it (vLLM)."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        return model if isinstance(model, PatchModel) else None

    # -- verification: what is live ------------------------------------------------

    def aiosync_test_arm_transit_fault(self, bucket: int, byte: int, mask: int = 0xFF) -> None:
        """Test hook: XOR byte ``byte`` of bucket ``bucket`` with ``mask`` (default: flip
        all 8 bits) the next time this worker receives it, before its copy and its
        ``verify`` check (see :func:`aiosync.transports._verify.arm_transit_fault`).
        One-shot."""
        arm_transit_fault(bucket, byte, mask)

    def aiosync_weight_digests(self, names: Sequence[str] | None = None) -> dict[str, list[Any]]:
        """``{hf_name: [shape, dtype name, sha256 hex]}`` of the weights live on this
        worker (a tensor-parallel rank: the part it holds), for ``verify_engine()``.

        Args:
            names: the checkpoint names to hash; None: every one the worker holds.

        Raises:
            TransportError: the model cannot read its weights back.
            RefitMismatchError: a name the worker does not hold.
        """
        from aiosync.errors import RefitMismatchError

        live = self._aiosync_live_weights()
        wanted = list(live) if names is None else list(names)
        out: dict[str, list[Any]] = {}
        for name in wanted:
            tensor = live.get(name)
            if tensor is None:
                raise RefitMismatchError(
                    f"engine worker {self.aiosync_worker_rank()} holds no {name!r}"
                )
            out[name] = [
                list(tensor.shape),
                str(tensor.dtype).removeprefix("torch."),
                tensor_digest(tensor),
            ]
        return out

    # -- catch-up from a peer (aiosync.transports.peer) ------------------------------

    def _aiosync_peer_model(self) -> peer.PeerModel:
        """The model a catch-up reads and writes (``model_runner.model``).

        Raises:
            NotImplementedError: it cannot (no ``weight_layout``/``load_weight_parts``).
        """
        model = self.model_runner.model  # type: ignore[attr-defined]
        if not isinstance(model, peer.PeerModel):
            raise NotImplementedError(
                f"{type(model).__name__} cannot take part in a catch-up from a peer "
                "(hf_state_dict, weight_layout and load_weight_parts)"
            )
        return model

    def _aiosync_local_rank(self) -> int:
        """This worker's rank within its engine (the global rank less the fleet's offset)."""
        return self.aiosync_worker_rank() - self._aiosync_rank_offset

    def aiosync_peer_manifest(self) -> list[list[Any]]:
        """What this worker holds, for the fleet's layout check before a catch-up:
        ``[[hf_name, [full shape, dim, start, length], held dtype name], ...]``
        (:func:`aiosync.transports.peer.peer_manifest`).

        Raises:
            NotImplementedError: the model cannot take part in a catch-up.
        """
        return peer.peer_manifest(self._aiosync_peer_model())

    def aiosync_peer_send(self, session: list[Any]) -> int:
        """Send the weights this worker holds to the worker of the same local rank in
        the catching-up engine (``session``: :meth:`PeerSession.to_wire`); returns the
        bytes sent. The worker keeps serving meanwhile.

        Raises:
            TransportError, SyncTimeoutError: as :func:`aiosync.transports.peer.send`.
        """
        model = self._aiosync_peer_model()
        return peer.send(model, peer.PeerSession.from_wire(session), self._aiosync_local_rank())

    @whole_receive
    def aiosync_peer_receive(
        self, session: list[Any], manifests: list[list[list[Any]]], version: int = -1
    ) -> int:
        """Receive the peer worker's weights (of the same local rank) into this worker's
        live weights, which are invalid from the first byte on and stay so until
        :meth:`aiosync_peer_verify` passes. ``manifests``: the peer's
        :meth:`aiosync_peer_manifest` per local rank (checked equal to this engine's);
        ``version``: the one the peer serves (an armed worker keeps its weights first,
        :mod:`.previous`). Returns the bytes received.

        Raises:
            TransportError, SyncTimeoutError, RefitMismatchError: as
                :func:`aiosync.transports.peer.receive`.
        """
        from . import validity

        model = self._aiosync_peer_model()
        rank = self._aiosync_local_rank()
        begin_refit(cast(validity.HoldsWeights, self), version)
        return peer.receive(model, manifests[rank], peer.PeerSession.from_wire(session), rank)

    def aiosync_peer_verify(self, digests: list[dict[str, list[Any]]]) -> list[str]:
        """Compare this worker's live weights with the peer's ``digests`` (its
        :meth:`aiosync_weight_digests` per local rank); when every tensor matches, mark
        the weights valid. Returns the names that differ (empty: verified), in
        checkpoint order; the weights then stay invalid.

        Raises:
            TransportError: the model cannot read its weights back.
        """
        from . import validity

        want = digests[self._aiosync_local_rank()]
        have = self.aiosync_weight_digests()
        differ = [n for n in dict.fromkeys([*have, *want]) if have.get(n) != want.get(n)]
        if not differ:
            validity.mark_valid(cast(validity.HoldsWeights, self))
        return differ

    def _aiosync_live_weights(self) -> Mapping[str, torch.Tensor]:
        """The weights as the engine computes with them, under checkpoint names (the
        part held). Default: the model's ``hf_state_dict()`` (the embedded engine);
        engines whose layers repack their weights override it (vLLM)."""
        from aiosync.errors import TransportError

        model = self.model_runner.model  # type: ignore[attr-defined]
        if not isinstance(model, _ReadableModel):
            raise TransportError(
                f"{type(model).__name__} cannot read its weights back (hf_state_dict)"
            )
        return model.hf_state_dict()
