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
import warnings
from dataclasses import fields, replace
from typing import Any

from ._config import Timeouts
from .capabilities import KindReporting, LayoutReporting, engines_of
from .errors import UnsupportedOptionError
from .options import (
    CollectiveOptions,
    HTTPOptions,
    IPCOptions,
    LoRAOptions,
    SGLangCollectiveOptions,
    ShardedOptions,
    SyncOptions,
    TransportCapabilities,
    TransportOptions,
)
from .sources import RefitSource, apply_draft_option
from .synchronizer import WeightSynchronizer

__all__ = ["DIST_BACKENDS", "KNOWN_BACKENDS", "create_weight_synchronizer"]

#: Backends the factory accepts.
KNOWN_BACKENDS: tuple[str, ...] = ("vllm", "sglang", "embedded")

#: torch.distributed backends of the non-colocated collective transport (``dist_backend=``).
DIST_BACKENDS: tuple[str, ...] = ("nccl", "gloo")


def create_weight_synchronizer(
    policy: RefitSource,
    generation: Any,
    *,
    colocated: bool,
    backend: str | None = None,
    train_cluster: Any = None,
    inference_world_size: int | None = None,
    transport: TransportOptions | None = None,
    sync: SyncOptions | None = None,
    timeouts: Timeouts | None = None,
    **deprecated: Any,
) -> WeightSynchronizer:
    """Build the synchronizer for a topology and an engine.

    The transport is chosen by the source (an adapter source: LoRA), else by
    ``transport`` when given (its options class names it), else by the topology and
    the engine kind (the table above; non-colocated vLLM/embedded engines that report
    their layout and hold tensor-parallel slices get the shard-aware transfer). The
    shared options never change that choice: one the chosen transport cannot honour
    is refused.

    Args:
        policy: the trainer's refit source (HF names and shapes), or a
            :class:`~aiosync.LoRAAdapterSource` (an adapter-only refit, whatever
            the backend and topology).
        generation: the engine, or a list of them (wrapped in an
            :class:`~aiosync.EngineFleet`); None on a trainer rank other than 0.
        colocated: True when trainer and engine share devices.
        backend: the engine kind, ``"vllm"``, ``"sglang"`` or ``"embedded"``; None:
            read from the engine (:class:`~aiosync.capabilities.KindReporting`).
        train_cluster: non-colocated only: a :class:`~aiosync.TrainCluster`
            saying where the trainer ranks are and where the sync group meets.
        inference_world_size: non-colocated only: number of inference ranks.
        transport: the transport and its options (:class:`~aiosync.IPCOptions`,
            :class:`~aiosync.CollectiveOptions`, :class:`~aiosync.ShardedOptions`,
            :class:`~aiosync.HTTPOptions`, :class:`~aiosync.SGLangCollectiveOptions`,
            :class:`~aiosync.LoRAOptions`); None: chosen as above, its defaults.
        sync: what every transport shares (:class:`~aiosync.SyncOptions`: verify,
            delta, in-flight policy, initial version, event backlog, trace).
        timeouts: every limit (:class:`~aiosync.Timeouts`).
        **deprecated: the keywords of aiosync <= 0.x (``sync_timeout_s=``,
            ``verify=``, ``bucket_bytes=``, ``sharded=``, ...), mapped onto the
            objects above with a ``DeprecationWarning``; as before, ``verify`` or
            ``overlap`` among them keeps the rank-0 broadcast.

    Raises:
        TypeError: ``colocated`` is not a bool, or an unknown keyword.
        UnsupportedOptionError: an option the chosen transport does not honour (a
            ``TypeError``), naming both.
        ValueError: unknown or unreadable engine kind (the message lists the known
            ones), a ``backend`` that differs from the engine's own kind, a
            ``transport`` for another topology or engine kind, a non-colocated
            setup without ``train_cluster``/``inference_world_size``, no engine
            and no ``transport`` on a non-colocated trainer rank, or an empty list
            of engines; all before anything is built.
        RefitMismatchError: non-colocated SGLang: ``inference_world_size`` differs
            from the servers' TP sizes (at ``init_communicator()``, before any rendezvous).
    """
    if not isinstance(colocated, bool):
        raise TypeError(f"colocated must be a bool, got {colocated!r}")
    kind = _engine_kind(generation, backend)
    specific: dict[str, Any] = {}
    sharded: bool | None = None
    broadcast_only = False
    if deprecated:
        sync, timeouts, specific, sharded = _from_deprecated(
            deprecated, sync, timeouts, colocated=colocated, kind=kind
        )
        # As the old factory did: a broadcast-only keyword keeps the broadcast.
        broadcast_only = any(deprecated.get(name) is not None for name in ("verify", "overlap"))
    sync = sync or SyncOptions()
    fleet = _fleet_of(generation)
    if callable(getattr(policy, "lora_adapter_config", None)):
        # Duck-typed (LoRAAdapterSource's own method), so that the factory stays free of torch.
        if transport is not None and not isinstance(transport, LoRAOptions):
            raise ValueError(
                f"a LoRAAdapterSource refits through LoRAAdapterSynchronizer; "
                f"{type(transport).__name__} does not apply (pass LoRAOptions or nothing)"
            )
        return _build(
            _with(transport or LoRAOptions(), specific), policy, fleet, sync, timeouts, {}
        )
    topology: dict[str, Any] = {}
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
        topology = {"train_cluster": train_cluster, "inference_world_size": inference_world_size}
    if transport is not None:
        _check_fits(transport, colocated, kind)
    elif sharded:
        transport = ShardedOptions()
    elif sharded is False and not colocated and kind != "sglang":
        transport = CollectiveOptions()
    else:
        transport = _choose(policy, generation, colocated, kind, broadcast_only=broadcast_only)
    return _build(_with(transport, specific), policy, fleet, sync, timeouts, topology)


def _engine_kind(generation: Any, backend: str | None) -> str | None:
    """The engine kind: ``backend`` if given (checked against the engines' own), else
    what every engine reports; None: no engine and no ``backend``."""
    if backend is not None and backend not in KNOWN_BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}; known backends: {', '.join(KNOWN_BACKENDS)}"
        )
    if generation is None:
        return backend
    reported = {e.engine_kind for e in engines_of(generation) if isinstance(e, KindReporting)}
    if backend is not None:
        # "embedded" speaks vLLM's worker protocol: either name drives it.
        if reported - {backend} and not reported | {backend} <= {"vllm", "embedded"}:
            raise ValueError(
                f"backend={backend!r}, but the engine says it is {', '.join(sorted(reported))}"
            )
        return backend
    if len(reported) == 1 and all(isinstance(e, KindReporting) for e in engines_of(generation)):
        return reported.pop()
    raise ValueError(
        "the engine does not say which kind it is (no engine_kind, or a fleet of mixed "
        f"kinds); pass backend=, one of the known backends: {', '.join(KNOWN_BACKENDS)}"
    )


def _choose(
    policy: RefitSource, generation: Any, colocated: bool, kind: str | None, *, broadcast_only: bool
) -> TransportOptions:
    """The transport for a topology and engine kind, with its defaults."""
    if kind is None:
        raise ValueError(
            f"no engine and no backend=: pass backend=, one of the known backends: "
            f"{', '.join(KNOWN_BACKENDS)}"
        )
    if colocated:
        return HTTPOptions() if kind == "sglang" else IPCOptions()
    if kind == "sglang":
        return SGLangCollectiveOptions()
    if generation is None:
        # Rank r > 0 of a sharded trainer has no engine to ask; guessing here could
        # build the broadcast on it and the shard-aware transport on rank 0.
        raise ValueError(
            "without the engine (a trainer rank other than 0) the factory cannot tell "
            "whether the engine reports its layout: pass transport=ShardedOptions() or "
            "transport=CollectiveOptions(), the same on every rank (formerly: pass "
            "sharded=True or False, the same on every rank)"
        )
    if not broadcast_only and _holds_slices(generation) and _shards_sendable(policy):
        return ShardedOptions()
    return CollectiveOptions()


def _check_fits(transport: TransportOptions, colocated: bool, kind: str | None) -> None:
    """Refuse ``transport`` for a topology or engine kind it does not serve."""
    name = type(transport).__name__
    if transport.colocated is not None and transport.colocated != colocated:
        where = "colocated" if transport.colocated else "non-colocated"
        raise ValueError(f"{name} is a {where} transport; this is colocated={colocated}")
    if kind is not None and kind not in transport.kinds:
        raise ValueError(
            f"{name} drives {' and '.join(transport.kinds)} engines; this engine is {kind!r}"
        )


def _build(
    transport: TransportOptions,
    policy: RefitSource,
    generation: Any,
    sync: SyncOptions,
    timeouts: Timeouts | None,
    topology: dict[str, Any],
) -> WeightSynchronizer:
    """Import the transport lazily, check ``sync`` against its capabilities and build it."""
    module_name, class_name = transport.transport
    cls = getattr(importlib.import_module(module_name), class_name)
    capabilities: TransportCapabilities = cls.capabilities
    for name, value in sync.given().items():
        why = capabilities.refusal(name, value)
        if why is not None:
            hint = ""
            if isinstance(transport, ShardedOptions):
                hint = " (transport=CollectiveOptions() is the rank-0 broadcast, which does)"
            raise UnsupportedOptionError(f"{class_name} does not honour {why}{hint}")
    takes = inspect.signature(cls).parameters
    # ``draft`` is the engines' and the source's business, not a transport keyword.
    policy = apply_draft_option(policy, generation, sync.draft)
    # An option turned off where the transport has no such option asks for nothing.
    shared = {
        n: v for n, v in sync.given().items() if n != "draft" and (n in takes or v is not False)
    }
    keywords: dict[str, Any] = {**topology, **transport.given(), **shared}
    if timeouts is not None:
        keywords["timeouts"] = timeouts
        if timeouts.collective_s is not None and "collective_timeout_s" in takes:
            keywords["collective_timeout_s"] = timeouts.collective_s
    built: WeightSynchronizer = cls(policy, generation, **keywords)
    return built


#: The keywords of aiosync <= 0.x, by where they went.
_DEPRECATED_SYNC = ("verify", "delta", "in_flight", "initial_version", "event_backlog", "trace")
_DEPRECATED_TIMEOUTS = ("sync_timeout_s", "rpc_timeout_s", "collective_timeout_s")
_DEPRECATED_TRANSPORT = (
    "bucket_bytes",
    "device",
    "process_group",
    "dist_backend",
    "overlap",
    "buffer_memory_fraction",
    "device_label",
    "abort_all_requests",
)


def _from_deprecated(
    given: dict[str, Any],
    sync: SyncOptions | None,
    timeouts: Timeouts | None,
    *,
    colocated: bool,
    kind: str | None,
) -> tuple[SyncOptions | None, Timeouts | None, dict[str, Any], bool | None]:
    """Map the old keywords onto the options objects: ``(sync, timeouts,
    transport-specific keywords, sharded)``. Values left None are dropped, as the
    old factory did."""
    known = {*_DEPRECATED_SYNC, *_DEPRECATED_TIMEOUTS, *_DEPRECATED_TRANSPORT, "sharded"}
    unknown = sorted(set(given) - known)
    if unknown:
        raise TypeError(
            f"create_weight_synchronizer() got an unexpected keyword argument {unknown[0]!r}"
        )
    given = {name: value for name, value in given.items() if value is not None}
    if not given:
        return sync, timeouts, {}, None
    warnings.warn(
        f"create_weight_synchronizer({', '.join(f'{n}=' for n in sorted(given))}) is "
        "deprecated: pass sync=SyncOptions(...), transport=<Transport>Options(...) and "
        "timeouts=Timeouts(...)",
        DeprecationWarning,
        stacklevel=3,
    )
    dist_backend = given.get("dist_backend")
    if dist_backend is not None and dist_backend not in DIST_BACKENDS:
        raise ValueError(
            f"unknown dist_backend {dist_backend!r}; known: {', '.join(DIST_BACKENDS)} "
            "(backend= is the engine kind)"
        )
    shared = {name: given[name] for name in _DEPRECATED_SYNC if name in given}
    if shared:
        sync = replace(sync, **shared) if sync is not None else SyncOptions(**shared)
    if any(name in given for name in _DEPRECATED_TIMEOUTS):
        timeouts = (timeouts or Timeouts()).with_keywords(
            sync_timeout_s=given.get("sync_timeout_s"),
            rpc_timeout_s=given.get("rpc_timeout_s"),
        )
        if "collective_timeout_s" in given:
            timeouts = replace(timeouts, collective_s=given["collective_timeout_s"])
    sharded: bool | None = given.get("sharded")
    if sharded and kind == "sglang":
        raise ValueError(
            "sharded=True is the shard-aware transfer into vLLM/embedded workers; SGLang "
            "servers receive SGLang's own broadcast (sharded=False or None)"
        )
    if sharded and colocated:
        raise ValueError("sharded=True is a non-colocated transport; pass colocated=False")
    specific = {name: given[name] for name in _DEPRECATED_TRANSPORT if name in given}
    return sync, timeouts, specific, sharded


def _with(transport: TransportOptions, specific: dict[str, Any]) -> TransportOptions:
    """``transport`` with the old transport-specific keywords; one it lacks is refused."""
    if not specific:
        return transport
    foreign = sorted(set(specific) - {f.name for f in fields(transport)})
    if foreign:
        raise UnsupportedOptionError(
            f"{transport.transport[1]} (chosen for this backend and topology) takes no "
            f"{', '.join(foreign)}"
        )
    return replace(transport, **specific)


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
    module = importlib.import_module(ShardedOptions.transport[0])
    return module.shard_refusal(policy) is None


def _fleet_of(generation: Any) -> Any:
    """A list of engines as one :class:`~aiosync.EngineFleet`; anything else as it is."""
    if isinstance(generation, list | tuple):
        from aiosync.engines.fleet import EngineFleet

        return EngineFleet(generation)
    return generation
