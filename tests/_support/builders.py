"""The builders of a non-colocated synchronizer for the tests (collective, shard-aware):
:func:`non_colocated` names the class, :func:`factory_pick` lets the factory choose."""

from __future__ import annotations

from typing import Any

import torch

from aiosync import TrainCluster, create_weight_synchronizer
from aiosync.refit import DTensorRefitSource
from tests._support.net import free_port

__all__ = ["factory_pick", "non_colocated"]


def non_colocated(
    cls: Any, model: torch.nn.Module, engine: Any, *, world_size: int | None = None, **options: Any
) -> Any:
    """``cls(DTensorRefitSource(model), engine, ...)``: the sync group meets at a free
    loopback port, ``inference_world_size`` is ``world_size`` (default: the engine's),
    16 KiB buckets and 30 s collectives unless ``options`` say otherwise."""
    return cls(
        DTensorRefitSource(model),
        engine,
        train_cluster=TrainCluster(master_port=free_port()),
        inference_world_size=engine.world_size if world_size is None else world_size,
        **{"bucket_bytes": 16 * 1024, "collective_timeout_s": 30.0, **options},
    )


def factory_pick(source: Any, engine: Any, *, world_size: int | None = None, **options: Any) -> Any:
    """``create_weight_synchronizer(source, engine, colocated=False, backend="embedded",
    **options)``: the factory's pick for an embedded engine (or fleet) in other processes.
    The sync group meets at a free loopback port; ``inference_world_size`` is
    ``world_size`` (default: the engine's)."""
    return create_weight_synchronizer(
        source,
        engine,
        colocated=False,
        backend="embedded",
        train_cluster=TrainCluster(master_port=free_port()),
        inference_world_size=engine.world_size if world_size is None else world_size,
        **options,
    )
