"""Starting engine actors with the resources their topology needs: :func:`launch_engine`.

A colocated engine shares a device with the trainer: its actor requests the
scheduler's share of one GPU (:func:`aiosync.engines.colocation.scheduler_gpu_share`,
``min(0.2, 1 / groups)``: placement bookkeeping, not memory) and is placed on
the trainer's node, or in a placement-group bundle the trainer's actors share.
A dedicated engine requests whole devices. See ``docs/ray.md``.
"""

from __future__ import annotations

from typing import Any, Required, TypedDict, Unpack

import ray
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from aiosync.engines.colocation import scheduler_gpu_share
from aiosync.options import check_keywords

from ._engine import DEFAULT_CALL_GRACE_S, DEFAULT_START_TIMEOUT_S, RayEngine
from ._host import EngineHost
from ._spec import EngineSpec

__all__ = ["ActorPlacement", "EngineActor", "engine_actor_options", "launch_engine"]

#: The Ray actor class of every engine actor: ``EngineActor.options(**opts).remote(spec)``.
EngineActor: Any = ray.remote(EngineHost)


class ActorPlacement(TypedDict, total=False):
    """Where an engine actor runs and what it requests: :func:`engine_actor_options`'s
    keywords, which :func:`launch_engine` takes too."""

    colocated: Required[bool]
    max_colocated_worker_groups: int
    devices: int
    num_gpus: float | None
    num_cpus: float
    placement_group: Any
    bundle_index: int
    node_id: str | None
    max_restarts: int
    name: str | None
    namespace: str | None
    runtime_env: dict[str, Any] | None


def engine_actor_options(**placement: Unpack[ActorPlacement]) -> dict[str, Any]:
    """The ``EngineActor.options(...)`` of an engine actor for a topology.

    Args:
        colocated: the engine shares the trainer's device: it requests
            ``scheduler_gpu_share(max_colocated_worker_groups)`` of one GPU and
            runs where the trainer runs (``placement_group``'s bundle, else
            ``node_id``, else the calling process's node). Not colocated: it
            requests ``devices`` whole GPUs and Ray places it anywhere (or in
            ``placement_group``).
        max_colocated_worker_groups: worker groups sharing one device (>= 1).
        devices: GPUs of a dedicated engine (its workers: TP x PP); colocated: 1.
        num_gpus: overrides the share above (``0``: an engine on CPU, on a
            cluster without GPU resources).
        num_cpus: CPUs the actor requests (its engine's worker processes run on them).
        placement_group: a ``ray.util.placement_group`` to place the actor in;
            the caller owns (and removes) it.
        bundle_index: the bundle (-1: any).
        node_id: the node of a colocated engine without a placement group (hex);
            default: the caller's node.
        max_restarts: how often Ray restarts the actor after its process died
            (:meth:`RayEngine.respawn_dead_workers` then starts its engine).
        name, namespace: a named actor (``ray.get_actor(name)``).
        runtime_env: the actor's Ray runtime environment.

    Returns:
        Keyword arguments for ``EngineActor.options``.

    Raises:
        TypeError: a keyword not listed here, or no ``colocated``.
        ValueError: ``devices < 1``, a colocated engine over several devices, a
            negative ``num_gpus``, or ``max_colocated_worker_groups < 1``.
    """
    check_keywords(ActorPlacement, placement, "engine_actor_options")
    colocated = placement["colocated"]
    devices = placement.get("devices", 1)
    num_gpus = placement.get("num_gpus")
    placement_group = placement.get("placement_group")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an int >= 1, got {devices!r}")
    if colocated and devices != 1:
        raise ValueError(
            f"a colocated engine actor shares one device with its trainer, got devices={devices}: "
            "launch one engine actor per device (each in its device's bundle)"
        )
    groups = placement.get("max_colocated_worker_groups", 1)
    share = scheduler_gpu_share(groups, colocated=colocated)
    gpus = share * devices if num_gpus is None else num_gpus
    if gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {gpus}")
    options: dict[str, Any] = {
        "num_cpus": placement.get("num_cpus", 1.0),
        "num_gpus": gpus,
        "max_restarts": placement.get("max_restarts", 0),
    }
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=placement.get("bundle_index", -1),
        )
    elif colocated:
        node = placement.get("node_id") or ray.get_runtime_context().get_node_id()
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    for key in ("name", "namespace", "runtime_env"):
        if placement.get(key) is not None:
            options[key] = placement[key]
    return options


async def launch_engine(
    spec: EngineSpec,
    *,
    call_grace_s: float = DEFAULT_CALL_GRACE_S,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    **placement: Unpack[ActorPlacement],
) -> RayEngine:
    """Start an engine actor for ``spec`` and its engine; returns the started :class:`RayEngine`.

    The RayEngine owns the actor: its ``shutdown()`` stops the engine and kills
    the actor, and its ``respawn_dead_workers()`` launches a replacement with the
    same options if the actor died for good. Resources and placement: see
    :func:`engine_actor_options` (same arguments). Call ``ray.init()`` first.

    Raises:
        TypeError: as :func:`engine_actor_options`.
        ValueError: as :func:`engine_actor_options`; or GPUs requested outside a
            placement group on a cluster that has fewer (``num_gpus=0`` runs the
            engine on CPU), before any actor is created.
        SyncTimeoutError: the actor was not scheduled, or its engine did not
            start, within ``start_timeout_s`` (the actor is killed).
        Whatever building the engine raises (the actor is killed).
    """
    options = engine_actor_options(**placement)
    if placement.get("placement_group") is None and options["num_gpus"] > 0:
        have = float(ray.cluster_resources().get("GPU", 0.0))
        if have < options["num_gpus"]:
            raise ValueError(
                f"the engine actor requests num_gpus={options['num_gpus']:g} but the Ray "
                f"cluster has {have:g} GPU(s): pass num_gpus=0 to run the engine on CPU"
            )

    def create() -> Any:
        return EngineActor.options(**options).remote(spec)

    engine = RayEngine(
        create(),
        owns_actor=True,
        relaunch=create,
        call_grace_s=call_grace_s,
        start_timeout_s=start_timeout_s,
    )
    try:
        await engine.start()
    except BaseException:
        await engine.shutdown()
        raise
    return engine
