"""aiosync: async weight synchronization from RL trainers to inference engines.

Everything public is importable from here. The transports (and with them torch,
zmq and httpx) load on first use of their names, so ``import aiosync`` is cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._config import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_EVENT_BACKLOG,
    DEFAULT_RPC_TIMEOUT_S,
    DEFAULT_SYNC_TIMEOUT_S,
    Timeouts,
)
from .capabilities import (
    IN_FLIGHT_POLICIES,
    DiscardNotifier,
    ElasticEngines,
    Engine,
    EngineKind,
    EngineSet,
    EngineWorkers,
    Generating,
    HealthReporting,
    InFlightPolicy,
    KindReporting,
    PausableEngine,
    PeerWaves,
    RollingEngines,
    SleepReporting,
    VersionedEngine,
    WorkerDescribing,
)
from .cluster import TrainCluster
from .errors import (
    OwnershipError,
    RefitMismatchError,
    RefitVerificationError,
    SyncError,
    SyncTimeoutError,
    TransportError,
    UnsupportedOptionError,
)
from .events import EventSubscription, VersionEventKind, WeightVersionEvent
from .factory import KNOWN_BACKENDS, create_weight_synchronizer
from .generation import Generation, SamplingParams
from .loop import refit_if_stale
from .lora import LoRAAdapter, LoRAAdapterSource, lora_adapter_name
from .options import (
    CollectiveOptions,
    HTTPOptions,
    IPCOptions,
    LoRAOptions,
    OnFailure,
    SGLangCollectiveOptions,
    ShardedOptions,
    SyncOptions,
    TransportCapabilities,
    TransportOptions,
)
from .replay import ReplaySample, StalenessStats, VersionedReplayBuffer
from .sources import GathersInto, Preflight, RefitManifest, RefitSource
from .synchronizer import (
    GenerationBackend,
    KVScales,
    Transferred,
    WeightSynchronizer,
)
from .transport import Transport

if TYPE_CHECKING:
    from aiosync.engines.embedded.engine import EmbeddedEngine
    from aiosync.engines.fleet import CatchUp, EngineFleet, FleetRefit, JoinSource
    from aiosync.engines.sglang.backend import SGLangHTTPBackend
    from aiosync.engines.vllm.backend import VLLMGenerationBackend
    from aiosync.engines.vllm.server import VLLMServerBackend
    from aiosync.refit.fp8 import FP8RefitSource
    from aiosync.refit.shared import SharedParameters, share_parameters
    from aiosync.transports.collective import (
        CollectiveWeightSynchronizer,
        SGLangCollectiveWeightSynchronizer,
    )
    from aiosync.transports.http import HTTPWeightSynchronizer
    from aiosync.transports.ipc import IPCWeightSynchronizer
    from aiosync.transports.lora import LoRAAdapterSynchronizer
    from aiosync.transports.sharded import ShardedWeightSynchronizer

__version__ = "0.1.0.dev0"

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_EVENT_BACKLOG",
    "DEFAULT_RPC_TIMEOUT_S",
    "DEFAULT_SYNC_TIMEOUT_S",
    "IN_FLIGHT_POLICIES",
    "KNOWN_BACKENDS",
    "CatchUp",
    "CollectiveOptions",
    "CollectiveWeightSynchronizer",
    "DiscardNotifier",
    "ElasticEngines",
    "EmbeddedEngine",
    "Engine",
    "EngineFleet",
    "EngineKind",
    "EngineSet",
    "EngineWorkers",
    "EventSubscription",
    "FP8RefitSource",
    "FleetRefit",
    "GathersInto",
    "Generating",
    "Generation",
    "GenerationBackend",
    "HTTPOptions",
    "HTTPWeightSynchronizer",
    "HealthReporting",
    "IPCOptions",
    "IPCWeightSynchronizer",
    "InFlightPolicy",
    "JoinSource",
    "KVScales",
    "KindReporting",
    "LoRAAdapter",
    "LoRAAdapterSource",
    "LoRAAdapterSynchronizer",
    "LoRAOptions",
    "OnFailure",
    "OwnershipError",
    "PausableEngine",
    "PeerWaves",
    "Preflight",
    "RefitManifest",
    "RefitMismatchError",
    "RefitSource",
    "RefitVerificationError",
    "ReplaySample",
    "RollingEngines",
    "SGLangCollectiveOptions",
    "SGLangCollectiveWeightSynchronizer",
    "SGLangHTTPBackend",
    "SamplingParams",
    "ShardedOptions",
    "ShardedWeightSynchronizer",
    "SharedParameters",
    "SleepReporting",
    "StalenessStats",
    "SyncError",
    "SyncOptions",
    "SyncTimeoutError",
    "Timeouts",
    "TrainCluster",
    "Transferred",
    "Transport",
    "TransportCapabilities",
    "TransportError",
    "TransportOptions",
    "UnsupportedOptionError",
    "VLLMGenerationBackend",
    "VLLMServerBackend",
    "VersionEventKind",
    "VersionedEngine",
    "VersionedReplayBuffer",
    "WeightSynchronizer",
    "WeightVersionEvent",
    "WorkerDescribing",
    "__version__",
    "create_weight_synchronizer",
    "lora_adapter_name",
    "refit_if_stale",
    "share_parameters",
]

# Transports and engines load on first use: they import torch, zmq or httpx.
_LAZY: dict[str, str] = {
    "CollectiveWeightSynchronizer": "aiosync.transports.collective",
    "ShardedWeightSynchronizer": "aiosync.transports.sharded",
    "EmbeddedEngine": "aiosync.engines.embedded.engine",
    "EngineFleet": "aiosync.engines.fleet",
    "CatchUp": "aiosync.engines.fleet",
    "FleetRefit": "aiosync.engines.fleet",
    "JoinSource": "aiosync.engines.fleet",
    "FP8RefitSource": "aiosync.refit.fp8",
    "HTTPWeightSynchronizer": "aiosync.transports.http",
    "IPCWeightSynchronizer": "aiosync.transports.ipc",
    "LoRAAdapterSynchronizer": "aiosync.transports.lora",
    "SGLangCollectiveWeightSynchronizer": "aiosync.transports.collective",
    "SGLangHTTPBackend": "aiosync.engines.sglang.backend",
    "SharedParameters": "aiosync.refit.shared",
    "share_parameters": "aiosync.refit.shared",
    "VLLMGenerationBackend": "aiosync.engines.vllm.backend",
    "VLLMServerBackend": "aiosync.engines.vllm.server",
}


#: Subpackages reachable as attributes without an explicit import (``aiosync.refit.X``).
_SUBPACKAGES = ("engines", "refit", "transports")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"aiosync.{name}")
    raise AttributeError(f"module 'aiosync' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names too, so that dir() and tab completion show the transports.
    return sorted({*globals(), *__all__, *_SUBPACKAGES})
