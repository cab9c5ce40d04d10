"""The FSDP2 trainer of the sharded rank scripts: one tiny Qwen3 per rank, sharded over gloo.

Each rank of the sharded rank scripts (``tests/ipc/_sharded_trainer.py``,
``tests/ipc/_sharded_faults.py``, ``tests/collective/_sharded_collective.py``,
``tests/delta/_delta_ranks.py``, ``tests/sharded/_sharded_*ranks.py``,
``tests/_sharded_owners.py``; one process per rank, run as ``python SCRIPT RANK
WORLD_SIZE ...``, most through :func:`rank_main`) joins the trainer's process group
(:func:`init_process_group`), builds the same model from
:data:`~aiosync.engines.embedded.configs.TINY_QWEN3` and shards it with ``fully_shard``
(:func:`build_sharded_model`), reads it through a :class:`FaultySource` that fails,
SIGKILLs itself or calls a hook at a chosen tensor, syncs it through
:func:`make_synchronizer` into :func:`make_engine`'s engine on rank 0, and writes what
it saw as one JSON object (:func:`write_result`). ``benchmarks/faults.py`` runs the same scripts for
its sharded cells (``docs/reliability.md``).

A script's ``sys.path[0]`` is its own folder (pytest's ``pythonpath`` does not reach a
subprocess): each script puts the repository root on ``sys.path`` itself before
``import tests._support.fsdp2``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import anyio
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3Config, Qwen3ForCausalLM

from aiosync.cluster import TrainCluster
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.refit import DTensorRefitSource
from aiosync.sources import RefitManifest, RefitSource
from aiosync.synchronizer import WeightSynchronizer
from aiosync.transports.collective import CollectiveWeightSynchronizer
from aiosync.transports.ipc import IPCWeightSynchronizer
from aiosync.transports.sharded import ShardedWeightSynchronizer

__all__ = [
    "ADVANCE",
    "ENGINE_SEED",
    "FAULTS",
    "MODEL_SEED",
    "FaultySource",
    "InjectedFault",
    "advance_weights",
    "build_sharded_model",
    "colocated_engine",
    "engine_matches",
    "engine_state",
    "factory_rank_sync",
    "failed_sync",
    "failed_sync_seen",
    "failing_shard_read",
    "full_state",
    "init_process_group",
    "make_engine",
    "make_synchronizer",
    "nudge",
    "rank_main",
    "rank_sync",
    "slices_match",
    "stepped_sync",
    "versions",
    "write_result",
]

#: The seed of every rank's model init (the ranks must build the same model).
MODEL_SEED = 0
#: The embedded engine's own init: a seed no trainer uses, so a sync changes every tensor.
ENGINE_SEED = 9
#: What one "optimizer step" of the scripts does to every parameter: multiply it by this.
ADVANCE = 1.25
#: The faults a :class:`FaultySource` can be armed with.
FAULTS = ("before", "between", "after", "offload", "kill")


class _Versioned(Protocol):
    """What :func:`versions` reads of a synchronizer."""

    @property
    def policy_version(self) -> int: ...

    @property
    def weight_version(self) -> int: ...

    @property
    def is_stale(self) -> bool: ...


class InjectedFault(RuntimeError):
    """The failure a test injects into one rank's source."""


def init_process_group(rank: int, world: int, port: int, timeout_s: float | None = None) -> None:
    """Join the trainer's gloo group at ``tcp://127.0.0.1:PORT`` as ``rank`` of ``world``.

    Args:
        timeout_s: the group's limit for one collective, seconds; None: torch's
            default (30 min for gloo).
    """
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        **kwargs,
    )


def build_sharded_model(world: int, seed: int = MODEL_SEED) -> Qwen3ForCausalLM:
    """The tiny Qwen3 (float32, initialised with ``seed``), each decoder layer and then
    the whole model ``fully_shard``-ed over a CPU mesh of ``world`` ranks.

    Every rank of the group must call it (building the mesh is a collective); its
    parameters are DTensors holding this rank's shard.
    """
    torch.manual_seed(seed)
    config = Qwen3Config(**{k: v for k, v in TINY_QWEN3.items() if k != "model_type"})
    model = Qwen3ForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def advance_weights(model: torch.nn.Module, factor: float = ADVANCE) -> None:
    """The scripts' optimizer step: every parameter (this rank's shard) times ``factor``.

    Deterministic and the same on every rank, so that a later gather gives every rank
    the same new full weights.
    """
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)


class FaultySource(RefitSource):
    """A rank's :class:`~aiosync.refit.DTensorRefitSource` that fails at one point of a
    sync while :attr:`fault` names one of :data:`FAULTS`:

    - ``"before"``: ``iter_weights`` raises before yielding tensor 0 (before any gather);
    - ``"between"``: it raises before tensor :attr:`between_at` (between its gathers);
    - ``"after"``: it raises after yielding its last tensor (every gather done);
    - ``"offload"``: ``offload_after_refit`` raises (after the sync's transfer);
    - ``"kill"``: the process SIGKILLs itself before tensor :attr:`between_at`.

    The exception is :meth:`error`'s (by default an :class:`InjectedFault`). With
    ``one_shot`` the fault is disarmed when ``iter_weights`` starts (one sync fails),
    else it stays until the caller sets :attr:`fault` to None. ``on_tensor(i)``, when
    set, runs before tensor ``i`` is yielded (in the transport's thread). When ``stamp``
    is given, the fault writes ``time.monotonic()`` there just before it strikes (a
    killed rank writes nothing else): the clock is the machine's, shared by the ranks.
    """

    #: The tensor index before which ``"between"`` and ``"kill"`` strike.
    between_at: int = 4

    def __init__(
        self,
        inner: DTensorRefitSource,
        rank: int,
        *,
        one_shot: bool = False,
        stamp: Path | None = None,
    ) -> None:
        self.inner = inner
        self.rank = rank
        self.one_shot = one_shot
        self.stamp = stamp
        #: The armed fault (one of :data:`FAULTS`), or None.
        self.fault: str | None = None
        #: Called with each tensor's index before it is yielded, or None.
        self.on_tensor: Callable[[int], None] | None = None

    def error(self, fault: str, index: int | None) -> Exception:
        """The exception ``fault`` raises before tensor ``index`` (None: after the last
        tensor, or in ``offload_after_refit``)."""
        if fault == "offload":
            return InjectedFault("offload: offload_after_refit failed")
        if index is None:
            return InjectedFault(f"{fault}: the source failed after its last tensor")
        return InjectedFault(f"{fault}: the source failed at tensor {index}")

    def _strike(self) -> None:
        if self.stamp is not None:
            self.stamp.write_text(repr(time.monotonic()))

    def prepare_refit_info(self) -> RefitManifest:
        return self.inner.prepare_refit_info()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._faulty(self.inner.iter_weights())

    def iter_weights_into(
        self, destination: Callable[[str], torch.Tensor | None]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The inner source's gathers into ``destination`` (``GathersInto``), faulted alike."""
        return self._faulty(self.inner.iter_weights_into(destination))

    def _faulty(
        self, weights: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        fault = self.fault
        if self.one_shot:
            self.fault = None
        for i, item in enumerate(weights):
            if self.on_tensor is not None:
                self.on_tensor(i)
            if fault is not None and (fault, i) in (("before", 0), ("between", self.between_at)):
                self._strike()
                raise self.error(fault, i)
            if fault == "kill" and i == self.between_at:
                self._strike()
                os.kill(os.getpid(), signal.SIGKILL)
            yield item
        if fault == "after":
            self._strike()
            raise self.error(fault, None)

    def offload_after_refit(self) -> None:
        if self.fault == "offload":
            self._strike()
            raise self.error("offload", None)


def full_state(source: FaultySource) -> dict[str, torch.Tensor]:
    """The trainer's full (gathered) HF state dict, cloned: every rank must call it
    (the gathers are collectives)."""
    return {n: t.clone() for n, t in source.inner.iter_weights()}


def versions(sync: _Versioned) -> list[Any]:
    """``[policy_version, weight_version, is_stale]`` (what the scripts record)."""
    return [sync.policy_version, sync.weight_version, sync.is_stale]


def colocated_engine(world: int) -> EmbeddedEngine:
    """A ``world``-worker embedded engine (not started), worker ``r`` standing for
    device ``cpu:r`` (the device of trainer rank ``r``)."""
    return EmbeddedEngine(
        TINY_QWEN3,
        num_workers=world,
        seed=ENGINE_SEED,
        device_labels=[f"cpu:{r}" for r in range(world)],
    )


async def engine_matches(engine: EmbeddedEngine, expected: dict[str, torch.Tensor]) -> list[bool]:
    """Per worker: whether it holds exactly ``expected`` (same names, same order, every
    tensor ``torch.equal``)."""
    return [
        list(state) == list(expected) and all(torch.equal(state[n], expected[n]) for n in state)
        for state in await engine.hf_state_dicts()
    ]


async def engine_state(
    engine: EmbeddedEngine, prompts: Sequence[Sequence[int]], steps: int
) -> dict[str, Any]:
    """What the engine does now: ``{"generated": tokens}`` (greedy, ``steps`` tokens per
    prompt) or ``{"generate_error": [type name, message]}``, and ``"weights_valid"``,
    every worker's status."""
    seen: dict[str, Any] = {}
    try:
        seen["generated"] = await engine.generate(
            [list(p) for p in prompts], max_new_tokens=steps, ignore_eos=True
        )
    except Exception as exc:
        seen["generate_error"] = [type(exc).__name__, str(exc)]
    status = await engine.status()
    seen["weights_valid"] = [w["weights_valid"] for w in status]
    return seen


def write_result(path: Path, seen: dict[str, Any]) -> None:
    """Write what a rank saw as one JSON object (the test or benchmark reads it)."""
    path.write_text(json.dumps(seen))


def nudge(model: Any) -> None:
    """What a small optimizer step changes: three elements of every rank's shard of each
    layer's ``q_proj``, and all of ``model.norm`` (the delta scripts' step)."""
    with torch.no_grad():
        for layer in model.model.layers:
            local = layer.self_attn.q_proj.weight.to_local()
            if local.numel():
                local.view(-1)[:3] += 0.5
        model.model.norm.weight.to_local().mul_(1.5)


def make_engine(transport: str, world: int) -> EmbeddedEngine:
    """Rank 0's engine (not started) for ``transport``: ``"ipc"``, :func:`colocated_engine`
    (``world`` workers); ``"collective"``, one worker; ``"sharded"``, one replica of two
    tensor-parallel workers."""
    if transport == "ipc":
        return colocated_engine(world)
    tp = 2 if transport == "sharded" else 1
    return EmbeddedEngine(TINY_QWEN3, num_workers=1, tensor_parallel_size=tp, seed=ENGINE_SEED)


def make_synchronizer(
    transport: str,
    source: RefitSource,
    engine: Any,
    rank: int,
    world: int,
    store_port: int,
    **options: Any,
) -> WeightSynchronizer:
    """Rank ``rank``'s synchronizer into :func:`make_engine`'s engine (None off rank 0),
    with ``options``: ``"ipc"`` colocated over the trainer's WORLD group, rank ``r``
    paired with worker ``cpu:r``; ``"collective"`` (1 inference rank) and ``"sharded"``
    (2) meeting at the store on ``store_port``."""
    if transport == "ipc":
        return IPCWeightSynchronizer(
            source,
            engine,
            process_group=dist.group.WORLD,
            device_label=f"cpu:{rank}",
            **options,
        )
    cluster = TrainCluster(world_size=world, rank=rank, master_port=store_port)
    if transport == "collective":
        return CollectiveWeightSynchronizer(
            source, engine, train_cluster=cluster, inference_world_size=1, **options
        )
    return ShardedWeightSynchronizer(
        source, engine, train_cluster=cluster, inference_world_size=2, **options
    )


def factory_rank_sync(
    source: RefitSource, engine: Any, rank: int, world: int, store_port: int, **options: Any
) -> WeightSynchronizer:
    """The factory's pick for trainer rank ``rank`` of ``world`` (meeting at the store on
    ``store_port``) into an embedded ``engine`` or fleet in other processes (None off
    rank 0), with ``options``."""
    from aiosync import create_weight_synchronizer

    cluster = TrainCluster(world_size=world, rank=rank, master_port=store_port)
    return create_weight_synchronizer(
        source, engine, colocated=False, backend="embedded", train_cluster=cluster, **options
    )


async def stepped_sync(model: torch.nn.Module, sync: Any, step: int) -> None:
    """Sync ``step`` of a loop: after an :func:`advance_weights` unless it is the first,
    ``mark_stale`` then ``sync_weights``."""
    if step:
        advance_weights(model)
    await sync.mark_stale()
    await sync.sync_weights()


async def rank_sync(
    stack: contextlib.AsyncExitStack,
    transport: str,
    source: RefitSource,
    rank: int,
    world: int,
    store_port: int,
    **options: Any,
) -> tuple[EmbeddedEngine | None, Any]:
    """Rank 0's :func:`make_engine` engine (None on the other ranks) and this rank's
    :func:`make_synchronizer` into it, both entered in ``stack``."""
    engine = await stack.enter_async_context(make_engine(transport, world)) if rank == 0 else None
    sync = make_synchronizer(transport, source, engine, rank, world, store_port, **options)
    await stack.enter_async_context(sync)
    return engine, sync


async def failed_sync_seen(sync: Any, seen: dict[str, Any]) -> None:
    """:func:`failed_sync` into ``seen``: ``failure`` (None, or the error's type name and
    message), ``failed_at`` (``time.monotonic()`` once it failed) and ``after_failure``
    (:func:`versions`)."""
    seen["failure"] = await failed_sync(sync)
    if seen["failure"] is not None:
        seen["failed_at"] = time.monotonic()
    seen["after_failure"] = versions(sync)


async def slices_match(engine: Any, full: dict[str, torch.Tensor]) -> list[bool]:
    """Per worker of ``engine`` (an engine or a fleet): whether it holds exactly its part
    of ``full`` (its slice of each sharded tensor, a replicated one whole), under the
    same names in the same order."""
    return [
        list(state) == list(full)
        and all(
            torch.equal(state[n], t.narrow(p.dim, p.start, p.length) if t.dim() else t)
            for n, t in full.items()
            for p in [layout[n]]
        )
        for layout, state in zip(
            await engine.weight_layouts(), await engine.hf_state_dicts(), strict=True
        )
    ]


@contextlib.contextmanager
def failing_shard_read(sync: Any, rank: int, fails: int, at: int) -> Iterator[None]:
    """While open, rank ``fails``'s shard-aware sender (``sync._sender_source``) raises
    ``RuntimeError("rank N could not read its shard")`` at its ``at``-th read."""
    real = sync._sender_source

    def failing() -> Any:
        local = real()
        calls = [0]

        def get(name: str) -> torch.Tensor:
            calls[0] += 1
            if rank == fails and calls[0] == at:
                raise RuntimeError(f"rank {fails} could not read its shard")
            return local(name)

        return get

    sync._sender_source = failing
    try:
        yield
    finally:
        sync._sender_source = real


async def failed_sync(sync: Any) -> list[str] | None:
    """Mark ``sync`` stale and sync: None, or the error's ``[type name, message]``."""
    await sync.mark_stale()
    try:
        await sync.sync_weights()
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return None


def rank_main(run: Callable[..., Awaitable[dict[str, Any]]], store_ports: int = 1) -> None:
    """A rank script's ``main``, for ``python SCRIPT RANK WORLD_SIZE PG_PORT
    STORE_PORT... OUT_JSON ARG...`` (``store_ports`` store ports, then strings): join
    the group, ``run(rank, world, *store_ports, *args)``, leave the group, and write
    what ``run`` returned to ``OUT_JSON``."""
    argv = sys.argv[1:]
    rank, world, port, *ports = (int(a) for a in argv[: 3 + store_ports])
    out, args = Path(argv[3 + store_ports]), argv[4 + store_ports :]
    init_process_group(rank, world, port)
    try:
        seen = anyio.run(run, rank, world, *(*ports, *args))
    finally:
        dist.destroy_process_group()
    write_result(out, seen)
