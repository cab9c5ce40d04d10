"""Pick the transport from topology and backend (and the kind of source).

=================  ==========  =======================  ======================================
backend            colocated   policy                   synchronizer
=================  ==========  =======================  ======================================
``"vllm"``         no          full model               ``CollectiveWeightSynchronizer``
``"vllm"``         yes         full model               ``IPCWeightSynchronizer``
``"sglang"``       yes         full model               ``HTTPWeightSynchronizer``
``"sglang"``       no          full model               ``SGLangCollectiveWeightSynchronizer``
any                any         ``LoRAAdapterSource``    ``LoRAAdapterSynchronizer``
=================  ==========  =======================  ======================================

A policy that is a :class:`~aiosync.LoRAAdapterSource` (it has
``lora_adapter_config()``, e.g. ``aiosync.refit.LoRAAdapterRefitSource``) is an
adapter-only refit: the adapter travels through the engine's own LoRA API
(``load_lora_adapter``) on every backend and topology, so ``train_cluster`` and
``inference_world_size`` are not needed (and ignored). ``"embedded"`` (the CPU
reference engine) behaves as ``"vllm"``: it speaks the same worker-extension
protocol. ``backend`` is the engine kind; the collective's own
torch.distributed backend is ``dist_backend`` (``"nccl"`` or ``"gloo"``). A list
of engines is one fleet
(:class:`~aiosync.EngineFleet`): one sync updates them all. Transports are
imported here, lazily, so that ``import aiosync`` stays free of torch, zmq and
httpx.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any, Literal

from ._config import Timeouts
from .capabilities import InFlightPolicy, LayoutReporting, engines_of
from .sources import RefitSource
from .synchronizer import WeightSynchronizer

if TYPE_CHECKING:
    import torch

__all__ = ["DIST_BACKENDS", "KNOWN_BACKENDS", "create_weight_synchronizer"]

#: Backends the factory accepts.
KNOWN_BACKENDS: tuple[str, ...] = ("vllm", "sglang", "embedded")

#: torch.distributed backends of the non-colocated collective transport (``dist_backend=``).
DIST_BACKENDS: tuple[str, ...] = ("nccl", "gloo")

_TRANSPORTS: dict[tuple[str, bool], tuple[str, str]] = {
    ("vllm", False): ("aiosync.transports.collective", "CollectiveWeightSynchronizer"),
    ("vllm", True): ("aiosync.transports.ipc", "IPCWeightSynchronizer"),
    ("embedded", False): ("aiosync.transports.collective", "CollectiveWeightSynchronizer"),
    ("embedded", True): ("aiosync.transports.ipc", "IPCWeightSynchronizer"),
    ("sglang", True): ("aiosync.transports.http", "HTTPWeightSynchronizer"),
    ("sglang", False): ("aiosync.transports.collective", "SGLangCollectiveWeightSynchronizer"),
}

#: Non-colocated, many senders: every trainer rank sends its shards to the workers
#: that hold them (engines that report their layout).
_SHARDED_TRANSPORT: tuple[str, str] = ("aiosync.transports.sharded", "ShardedWeightSynchronizer")

#: Keywords only the broadcast takes: given, the factory does not pick the sharded path.
_BROADCAST_ONLY = ("verify", "overlap")
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
    timeouts: Timeouts | None = None,
    sync_timeout_s: float | None = None,
    rpc_timeout_s: float | None = None,
    event_backlog: int | None = None,
    in_flight: InFlightPolicy | None = None,
    initial_version: int | None = None,
    bucket_bytes: int | None = None,
    device: str | torch.device | None = None,
    process_group: Any = None,
    trace: bool | None = None,
    dist_backend: Literal["nccl", "gloo"] | None = None,
    sharded: bool | None = None,
    verify: bool | Literal["sample"] | None = None,
    overlap: Literal["inplace", "staged"] | None = None,
    delta: bool | None = None,
    collective_timeout_s: float | None = None,
    buffer_memory_fraction: float | None = None,
    device_label: str | None = None,
    abort_all_requests: bool | None = None,
) -> WeightSynchronizer:
    """Build the synchronizer for a topology and an inference backend.

    Every keyword after ``inference_world_size`` is passed to the chosen
    transport when given (not None), and left to its default otherwise; one the
    chosen transport does not take is a TypeError naming both.

    Args:
        policy: the trainer's refit source (HF names and shapes), or a
            :class:`~aiosync.LoRAAdapterSource` (an adapter-only refit, whatever
            the backend and topology).
        generation: the engine's generation backend, or a list of them (wrapped
            in an :class:`~aiosync.EngineFleet`).
        colocated: True when trainer and engine share devices.
        backend: the engine kind, ``"vllm"``, ``"sglang"`` or ``"embedded"``.
        train_cluster: non-colocated only: a :class:`~aiosync.TrainCluster`
            saying where the trainer ranks are and where the sync group meets.
        inference_world_size: non-colocated only: number of inference ranks.
        timeouts: every limit (:class:`~aiosync.Timeouts`); every transport.
        sync_timeout_s: overrides ``timeouts.sync_s``, seconds; every transport.
        rpc_timeout_s: overrides ``timeouts.rpc_s``, seconds; IPC, collective.
        event_backlog: default ``max_backlog`` of ``subscribe``, events; every transport.
        in_flight: the default in-flight policy of ``sync_weights``; every transport.
        initial_version: where both versions start (a trainer resumed from its
            step-N checkpoint passes N); every transport.
        bucket_bytes: bucket size, bytes; IPC, HTTP, collective.
        device: where the trainer's tensors are packed; IPC, HTTP.
        process_group: a sharded trainer's ``torch.distributed`` group; IPC, LoRA.
        trace: record ``last_trace`` per sync; IPC, HTTP.
        dist_backend: non-colocated only: the collective's data group,
            ``"nccl"`` or ``"gloo"`` (default: nccl when CUDA is available).
        sharded: non-colocated vLLM/embedded only (ignored when colocated): True
            for the shard-aware transfer
            (:class:`~aiosync.transports.sharded.ShardedWeightSynchronizer`: every
            trainer rank sends its own shards, each worker receives only its
            slices), False for the rank-0 broadcast; None (default) picks the
            shard-aware one when the engine reports its layout (``weight_layouts()``)
            and some worker holds slices (``tensor_parallel_size > 1``; a fleet:
            every member reports, one holds slices), unless ``verify`` or
            ``overlap`` (broadcast options) are given or the shard-aware transport
            cannot send the source's shards as held
            (:func:`~aiosync.transports.sharded.shard_refusal`: a merged PEFT LoRA
            weight, a fused tensor cut along another dim than its experts'; an
            explicit ``sharded=True`` is refused then, ``RefitMismatchError``).
            Trainer ranks other than 0, which pass no engine, must say True or
            False (as rank 0 decides).
        verify: what each receiver checks of what arrived: ``True`` (every byte;
            the IPC and collective default), ``"sample"`` (a digest of a sample of
            every bucket; the HTTP and LoRA default), ``False``; IPC, collective,
            HTTP (a read-back through ``/get_weights_by_name``), LoRA.
        overlap: ``"inplace"`` or ``"staged"``; collective.
        delta: send only the elements whose bits changed since the last committed
            version (:mod:`aiosync.delta`); collective broadcast, IPC, shard-aware.
        collective_timeout_s: the rendezvous's and every collective's limit,
            seconds; collective.
        buffer_memory_fraction: share of device memory the buffers may take; IPC.
        device_label: the trainer device's label for the engine; IPC.
        abort_all_requests: abort in-flight requests around a refit; HTTP.

    Raises:
        TypeError: ``colocated`` is not a bool, or a keyword the chosen
            transport does not take.
        ValueError: unknown backend or ``dist_backend`` (the message lists the
            known ones), a non-colocated setup without
            ``train_cluster``/``inference_world_size``, ``sharded=True`` with
            ``colocated=True``, ``sharded=None`` without an engine, or an empty
            list of engines; all before anything is built.
        RefitMismatchError: non-colocated SGLang: ``inference_world_size`` differs
            from the servers' TP sizes (at ``init_communicator()``, before any rendezvous).
    """
    if not isinstance(colocated, bool):
        raise TypeError(f"colocated must be a bool, got {colocated!r}")
    if backend not in KNOWN_BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}; known backends: {', '.join(KNOWN_BACKENDS)}"
        )
    if dist_backend is not None and dist_backend not in DIST_BACKENDS:
        raise ValueError(
            f"unknown dist_backend {dist_backend!r}; known: {', '.join(DIST_BACKENDS)} "
            "(backend= is the engine kind)"
        )
    given = {
        name: value
        for name, value in (
            ("timeouts", timeouts),
            ("sync_timeout_s", sync_timeout_s),
            ("rpc_timeout_s", rpc_timeout_s),
            ("event_backlog", event_backlog),
            ("in_flight", in_flight),
            ("initial_version", initial_version),
            ("bucket_bytes", bucket_bytes),
            ("device", device),
            ("process_group", process_group),
            ("trace", trace),
            ("dist_backend", dist_backend),
            ("verify", verify),
            ("overlap", overlap),
            ("delta", delta),
            ("collective_timeout_s", collective_timeout_s),
            ("buffer_memory_fraction", buffer_memory_fraction),
            ("device_label", device_label),
            ("abort_all_requests", abort_all_requests),
        )
        if value is not None
    }
    # Duck-typed (LoRAAdapterSource's own method), so that the factory stays free of torch.
    if callable(getattr(policy, "lora_adapter_config", None)):
        return _build(_LORA_TRANSPORT, policy, _fleet_of(generation), given)
    if backend == "sglang" and sharded:
        raise ValueError(
            "sharded=True is the shard-aware transfer into vLLM/embedded workers; SGLang "
            "servers receive SGLang's own broadcast (sharded=False or None)"
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
        given |= {"train_cluster": train_cluster, "inference_world_size": inference_world_size}
        if sharded is None and generation is None:
            # Rank r > 0 of a sharded trainer has no engine to ask; guessing here could
            # build the broadcast on it and the shard-aware transport on rank 0.
            raise ValueError(
                "without the engine (a trainer rank other than 0) the factory cannot tell "
                "whether the engine reports its layout: pass sharded=True or False, the "
                "same on every rank"
            )
        if backend == "sglang":
            sharded = False
        if sharded is None:
            sharded = (
                _holds_slices(generation)
                and not any(name in given for name in _BROADCAST_ONLY)
                and _shards_sendable(policy)
            )
        if sharded:
            return _build(_SHARDED_TRANSPORT, policy, _fleet_of(generation), given)
    elif sharded:
        raise ValueError("sharded=True is a non-colocated transport; pass colocated=False")
    return _build(_TRANSPORTS[(backend, colocated)], policy, _fleet_of(generation), given)


def _build(
    where: tuple[str, str], policy: RefitSource, generation: Any, keywords: dict[str, Any]
) -> WeightSynchronizer:
    """Import the transport lazily and build it with ``keywords``; one it does not
    declare is a TypeError before it is called."""
    module_name, class_name = where
    cls = getattr(importlib.import_module(module_name), class_name)
    takes = inspect.signature(cls).parameters
    foreign = sorted(name for name in keywords if name not in takes)
    if foreign:
        raise TypeError(
            f"{class_name} (chosen for this backend and topology) takes no {', '.join(foreign)}"
        )
    sync: WeightSynchronizer = cls(policy, generation, **keywords)
    return sync


def _holds_slices(generation: Any) -> bool:
    """Whether every engine reports its layout (none refuses from its config: a
    quantized or LoRA-enabled vLLM engine keeps the broadcast) and some worker holds only slices
    (a fleet of TP=1 engines gains nothing over the broadcast's one copy per worker
    unless the trainer is sharded: ``sharded=True`` then)."""
    engines = engines_of(generation)
    reporting = all(isinstance(e, LayoutReporting) and e.layout_refusal is None for e in engines)
    return reporting and any(e.tensor_parallel_size > 1 for e in engines)


def _shards_sendable(policy: RefitSource) -> bool:
    """Whether the shard-aware transport can send ``policy``'s shards as they are held
    (:func:`aiosync.transports.sharded.shard_refusal`); decided before it is picked,
    so that a source it would refuse takes the broadcast. Imported only here, where
    the engine already reports its layout (the trainer has torch)."""
    module = importlib.import_module(_SHARDED_TRANSPORT[0])
    return module.shard_refusal(policy) is None


def _fleet_of(generation: Any) -> Any:
    """A list of engines as one :class:`~aiosync.EngineFleet`; anything else as it is."""
    if isinstance(generation, list | tuple):
        from aiosync.engines.fleet import EngineFleet

        return EngineFleet(generation)
    return generation
