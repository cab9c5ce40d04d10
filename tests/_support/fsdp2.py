"""The FSDP2 trainer of the sharded rank scripts: one tiny Qwen3 per rank, sharded over gloo.

Each rank of ``tests/ipc/_sharded_trainer.py``, ``tests/ipc/_sharded_faults.py`` and
``tests/collective/_sharded_collective.py`` (one process per rank, run as
``python SCRIPT RANK WORLD_SIZE ...``) joins the trainer's process group
(:func:`init_process_group`), builds the same model from
:data:`~aiosync.engines.embedded.configs.TINY_QWEN3` and shards it with ``fully_shard``
(:func:`build_sharded_model`), reads it through a :class:`FaultySource` that fails,
SIGKILLs itself or calls a hook at a chosen tensor, and writes what it saw as one
JSON object (:func:`write_result`). ``benchmarks/faults.py`` runs the same scripts for
its sharded cells (``docs/reliability.md``).

A script's ``sys.path[0]`` is its own folder (pytest's ``pythonpath`` does not reach a
subprocess): each script puts the repository root on ``sys.path`` itself before
``import tests._support.fsdp2``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3Config, Qwen3ForCausalLM

from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.refit import DTensorRefitSource
from aiosync.sources import RefitManifest, RefitSource

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
    "full_state",
    "init_process_group",
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
