"""aiosync on Ray: engines and trainers as Ray actors, synchronized by the usual transports.

* :class:`RayEngine` — an engine living in a Ray actor (:data:`EngineActor`,
  built there from an :class:`EngineSpec`), driven from any process of the
  cluster: every call is an awaited actor call, and it claims exactly the
  capabilities of its engine, so ``IPCWeightSynchronizer`` (colocated: the
  actor on the trainer's node), ``CollectiveWeightSynchronizer`` and an
  :class:`~aiosync.EngineFleet` of several work unchanged.
* :func:`launch_engine` — start an engine actor with the resources of its
  topology (colocated: the scheduler's share of one GPU, on the trainer's node
  or in a placement-group bundle; dedicated: whole GPUs).
* :func:`sync_group_address` — trainer rank 0's node IP and a port it chose,
  passed to the other ranks through Ray (:class:`SyncGroupAddress`).

Needs Ray (``pip install 'aiosync[ray]'``); ``import aiosync`` never imports it.
Guide: ``docs/ray.md``.
"""

from __future__ import annotations

try:
    import ray as _ray

    _ray.remote  # noqa: B018  (a folder named ray, such as Ray's /tmp/ray, has no remote)
except (ImportError, AttributeError) as exc:  # pragma: no cover - depends on the environment
    raise ImportError("aiosync.ray needs Ray: pip install 'aiosync[ray]' (or 'ray>=2.60')") from exc

from ._cluster import SyncGroupAddress, sync_group_address
from ._engine import (
    DEFAULT_CALL_GRACE_S,
    DEFAULT_START_TIMEOUT_S,
    EngineActorInfo,
    RayEngine,
)
from ._host import EngineHost
from ._launch import ActorPlacement, EngineActor, engine_actor_options, launch_engine
from ._spec import EngineSpec

del _ray

__all__ = [
    "DEFAULT_CALL_GRACE_S",
    "DEFAULT_START_TIMEOUT_S",
    "ActorPlacement",
    "EngineActor",
    "EngineActorInfo",
    "EngineHost",
    "EngineSpec",
    "RayEngine",
    "SyncGroupAddress",
    "engine_actor_options",
    "launch_engine",
    "sync_group_address",
]
