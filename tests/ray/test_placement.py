"""Engine actors request what their topology needs, as Ray itself accounts for it: a
colocated one the scheduler's share of one GPU (``scheduler_gpu_share``), on the
trainer's node or in a placement-group bundle; a dedicated one whole devices. The
test cluster's 2 GPUs are a custom count on CPU: Ray's bookkeeping is what is checked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

from aiosync.engines.colocation import scheduler_gpu_share

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

BARE = "tests.ray._engines:BareEngine"


async def _until(read: Callable[[], Any], expected: Any) -> None:
    """Wait (bounded) until Ray's resource view shows ``expected``: it is updated
    asynchronously after an actor starts or dies. Asserts the last view read."""
    with anyio.move_on_after(60):
        while read() != expected:
            await anyio.sleep(0.05)
    assert read() == expected


async def test_a_colocated_engine_actor_runs_on_this_node_with_the_scheduler_share(
    engine: Any, ray_cluster: Any
) -> None:
    # The session's engine: colocated, two worker groups per device.
    assert scheduler_gpu_share(2) == 0.2
    assert engine.info.resources == {"GPU": 0.2}
    assert engine.info.node_id == ray_cluster.get_runtime_context().get_node_id()
    assert engine.info.node_ip == "127.0.0.1"


async def test_a_dedicated_engine_actor_requests_whole_devices(ray_cluster: Any) -> None:
    from aiosync.ray import EngineSpec, launch_engine

    ray = ray_cluster
    total = ray.cluster_resources()["GPU"]
    free = ray.available_resources().get("GPU", 0.0)
    dedicated = await launch_engine(EngineSpec(BARE), colocated=False, num_cpus=0)
    assert dedicated.info.resources == {"GPU": 1.0}
    await _until(lambda: ray.available_resources().get("GPU", 0.0), free - 1.0)
    await dedicated.shutdown()
    await _until(lambda: ray.available_resources().get("GPU", 0.0), free)
    with pytest.raises(ValueError) as refused:
        await launch_engine(EngineSpec(BARE), colocated=False, devices=3, num_cpus=0)
    assert str(refused.value) == (
        f"the engine actor requests num_gpus=3 but the Ray cluster has {total:g} GPU(s): "
        "pass num_gpus=0 to run the engine on CPU"
    )
    with pytest.raises(ValueError, match="shares one device with its trainer, got devices=2"):
        await launch_engine(EngineSpec(BARE), colocated=True, devices=2)


async def test_engine_actors_take_their_share_of_their_placement_group_bundle(
    ray_cluster: Any,
) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    from aiosync.ray import EngineSpec, launch_engine

    ray = ray_cluster
    # Half a device and a whole one: the session's colocated engine holds 0.2 of the 2.
    group = placement_group([{"GPU": 0.5}, {"GPU": 1.0}])
    with anyio.fail_after(60):
        await group.ready()
    bundle = [f"GPU_group_{i}_{group.id.hex()}" for i in range(2)]
    try:
        await _until(lambda: [ray.available_resources().get(b) for b in bundle], [0.5, 1.0])
        share = scheduler_gpu_share(8)  # e.g. policy, reference and six more groups
        assert share == 0.125
        colocated = await launch_engine(
            EngineSpec(BARE),
            colocated=True,
            max_colocated_worker_groups=8,
            num_cpus=0,
            placement_group=group,
            bundle_index=0,
        )
        dedicated = await launch_engine(
            EngineSpec(BARE), colocated=False, num_cpus=0, placement_group=group, bundle_index=1
        )
        assert colocated.info.resources == {"GPU": 0.125}
        assert dedicated.info.resources == {"GPU": 1.0}
        await _until(lambda: [ray.available_resources().get(b, 0.0) for b in bundle], [0.375, 0.0])
        await colocated.shutdown()
        await dedicated.shutdown()
        await _until(lambda: [ray.available_resources().get(b, 0.0) for b in bundle], [0.5, 1.0])
    finally:
        remove_placement_group(group)
    await _until(lambda: [b in ray.available_resources() for b in bundle], [False, False])
