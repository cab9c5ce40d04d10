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
)
from .errors import RefitMismatchError, SyncError, SyncTimeoutError, TransportError
from .events import EventSubscription, VersionEventKind, WeightVersionEvent
from .factory import KNOWN_BACKENDS, create_weight_synchronizer
from .interfaces import (
    EngineWorkers,
    GenerationBackend,
    KVScales,
    RefitManifest,
    RefitSource,
    TrainCluster,
    WeightSynchronizer,
    refit_if_stale,
)
from .replay import ReplaySample, StalenessStats, VersionedReplayBuffer

if TYPE_CHECKING:
    from transports.collective import CollectiveWeightSynchronizer
    from transports.embedded.engine import EmbeddedEngine
    from transports.http import HTTPWeightSynchronizer
    from transports.ipc import IPCWeightSynchronizer
    from transports.sglang_backend import SGLangHTTPBackend
    from transports.vllm_backend import VLLMGenerationBackend

__version__ = "0.1.0.dev0"

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_EVENT_BACKLOG",
    "DEFAULT_RPC_TIMEOUT_S",
    "DEFAULT_SYNC_TIMEOUT_S",
    "KNOWN_BACKENDS",
    "CollectiveWeightSynchronizer",
    "EmbeddedEngine",
    "EngineWorkers",
    "EventSubscription",
    "GenerationBackend",
    "HTTPWeightSynchronizer",
    "IPCWeightSynchronizer",
    "KVScales",
    "RefitManifest",
    "RefitMismatchError",
    "RefitSource",
    "ReplaySample",
    "SGLangHTTPBackend",
    "StalenessStats",
    "SyncError",
    "SyncTimeoutError",
    "TrainCluster",
    "TransportError",
    "VLLMGenerationBackend",
    "VersionEventKind",
    "VersionedReplayBuffer",
    "WeightSynchronizer",
    "WeightVersionEvent",
    "__version__",
    "create_weight_synchronizer",
    "refit_if_stale",
]

# Transports and engines load on first use: they import torch, zmq or httpx.
_LAZY: dict[str, str] = {
    "CollectiveWeightSynchronizer": "transports.collective",
    "EmbeddedEngine": "transports.embedded.engine",
    "HTTPWeightSynchronizer": "transports.http",
    "IPCWeightSynchronizer": "transports.ipc",
    "SGLangHTTPBackend": "transports.sglang_backend",
    "VLLMGenerationBackend": "transports.vllm_backend",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'aiosync' has no attribute {name!r}")
