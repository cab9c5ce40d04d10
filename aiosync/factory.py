"""Pick the transport from topology and backend (and the kind of source).

=================  ==========  =======================  ================================
backend            colocated   policy                   synchronizer
=================  ==========  =======================  ================================
``"vllm"``         no          full model               ``CollectiveWeightSynchronizer``
``"vllm"``         yes         full model               ``IPCWeightSynchronizer``
``"sglang"``       yes         full model               ``HTTPWeightSynchronizer``
``"sglang"``       no          full model               ``NotImplementedError``
any                any         ``LoRAAdapterSource``    ``LoRAAdapterSynchronizer``
=================  ==========  =======================  ================================

A policy that is a :class:`~aiosync.LoRAAdapterSource` (it has
``lora_adapter_config()``, e.g. ``aiosync.refit.LoRAAdapterRefitSource``) is an
adapter-only refit: the adapter travels through the engine's own LoRA API
(``load_lora_adapter``) on every backend and topology, so ``train_cluster`` and
``inference_world_size`` are not needed (and ignored). ``"embedded"`` (the CPU
reference engine) behaves as ``"vllm"``: it speaks the same worker-extension
protocol. A list of engines is one fleet
(:class:`~aiosync.EngineFleet`): one sync updates them all. Transports are
imported here, lazily, so that ``import aiosync`` stays free of torch, zmq and
httpx.
"""

from __future__ import annotations

import importlib
from typing import Any

from .interfaces import RefitSource, WeightSynchronizer

__all__ = ["KNOWN_BACKENDS", "create_weight_synchronizer"]

#: Backends the factory accepts.
KNOWN_BACKENDS: tuple[str, ...] = ("vllm", "sglang", "embedded")

_TRANSPORTS: dict[tuple[str, bool], tuple[str, str]] = {
    ("vllm", False): ("aiosync.transports.collective", "CollectiveWeightSynchronizer"),
    ("vllm", True): ("aiosync.transports.ipc", "IPCWeightSynchronizer"),
    ("embedded", False): ("aiosync.transports.collective", "CollectiveWeightSynchronizer"),
    ("embedded", True): ("aiosync.transports.ipc", "IPCWeightSynchronizer"),
    ("sglang", True): ("aiosync.transports.http", "HTTPWeightSynchronizer"),
}
#: Adapter-only refits (a ``LoRAAdapterSource`` policy), on every backend and topology.
_LORA_TRANSPORT: tuple[str, str] = ("aiosync.transports.lora", "LoRAAdapterSynchronizer")


def create_weight_synchronizer(
    policy: RefitSource,
    generation: Any,
    *,
    colocated: bool,
    backend: str,
    train_cluster: Any = None,
    inference_world_size: int | None = None,
    **options: Any,
) -> WeightSynchronizer:
    """Build the synchronizer for a topology and an inference backend.

    Args:
        policy: the trainer's refit source (HF names and shapes), or a
            :class:`~aiosync.LoRAAdapterSource` (an adapter-only refit, whatever
            the backend and topology).
        generation: the engine's generation backend, or a list of them (wrapped
            in an :class:`~aiosync.EngineFleet`).
        colocated: True when trainer and engine share devices.
        backend: ``"vllm"``, ``"sglang"`` or ``"embedded"``.
        train_cluster: non-colocated only: a :class:`~aiosync.TrainCluster`
            saying where the trainer ranks are and where the sync group meets.
        inference_world_size: non-colocated only: number of inference ranks.
        **options: passed to the transport (``bucket_bytes``, timeouts, ...).

    Raises:
        TypeError: ``colocated`` is not a bool.
        ValueError: unknown backend (the message lists the known ones), a
            non-colocated setup without ``train_cluster``/``inference_world_size``,
            or an empty list of engines.
        NotImplementedError: non-colocated SGLang (full-model refits).
    """
    if not isinstance(colocated, bool):
        raise TypeError(f"colocated must be a bool, got {colocated!r}")
    if backend not in KNOWN_BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}; known backends: {', '.join(KNOWN_BACKENDS)}"
        )
    # Duck-typed (LoRAAdapterSource's own method), so that the factory stays free of torch.
    if callable(getattr(policy, "lora_adapter_config", None)):
        generation = _fleet_of(generation)
        module_name, class_name = _LORA_TRANSPORT
        cls = getattr(importlib.import_module(module_name), class_name)
        lora_sync: WeightSynchronizer = cls(policy, generation, **options)
        return lora_sync
    if backend == "sglang" and not colocated:
        raise NotImplementedError(
            "non-colocated SGLang is not supported yet; use colocated=True (HTTP transport) "
            "or backend='vllm' (NCCL collective)"
        )
    if not colocated:
        missing = [
            name
            for name, value in (
                ("train_cluster", train_cluster),
                ("inference_world_size", inference_world_size),
            )
            if value is None
        ]
        if missing:
            raise ValueError(f"non-colocated synchronization needs {' and '.join(missing)}")
        options = {
            **options,
            "train_cluster": train_cluster,
            "inference_world_size": inference_world_size,
        }
    generation = _fleet_of(generation)
    module_name, class_name = _TRANSPORTS[(backend, colocated)]
    cls = getattr(importlib.import_module(module_name), class_name)
    sync: WeightSynchronizer = cls(policy, generation, **options)
    return sync


def _fleet_of(generation: Any) -> Any:
    """A list of engines as one :class:`~aiosync.EngineFleet`; anything else as it is."""
    if isinstance(generation, list | tuple):
        from aiosync.engines.fleet import EngineFleet

        return EngineFleet(generation)
    return generation
