"""ShardedWeightSynchronizer against the embedded engine's real worker processes.

One trainer process (a plain module: every tensor whole on rank 0) refits a
tensor-parallel engine (2 replicas x TP=2) and a TP=1 engine: each worker receives
only its own slices, bit-exact, and greedy output equals the trainer's. The 2-rank
FSDP2 trainer is in ``test_sharded_ranks.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import pytest
import pytest_asyncio
import torch

from aiosync import TrainCluster
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.layout import Layout
from aiosync.refit import DTensorRefitSource
from aiosync.transports.sharded import ShardedWeightSynchronizer
from tests._support.builders import factory_pick, non_colocated
from tests._support.net import free_port

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(
        TINY_QWEN3, num_workers=2, tensor_parallel_size=2, seed=5, rpc_timeout_s=120
    ) as engine:
        yield engine


def _sync(
    trainer: HFModelRunner, engine: EmbeddedEngine, **options: object
) -> ShardedWeightSynchronizer:
    return non_colocated(ShardedWeightSynchronizer, trainer.model, engine, **options)


def _slice_bytes(layout: Layout, full: Mapping[str, torch.Tensor]) -> int:
    return sum(part.numel * full[name].element_size() for name, part in layout.items())


async def _assert_slices_equal(engine: EmbeddedEngine, full: Mapping[str, torch.Tensor]) -> None:
    layouts = await engine.weight_layouts()
    for rank, (layout, state) in enumerate(
        zip(layouts, await engine.hf_state_dicts(), strict=True)
    ):
        for name, tensor in full.items():
            part = layout[name]
            want = tensor.narrow(part.dim, part.start, part.length) if part.shape else tensor
            assert torch.equal(state[name], want), f"worker {rank}: {name} differs"


async def test_each_worker_receives_only_its_slices_bit_exact(engine: EmbeddedEngine) -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=21)
    full = trainer.hf_state_dict()
    async with _sync(trainer, engine) as sync:
        await sync.mark_stale()
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale, engine.weight_version) == (1, False, 1)
        layouts = await engine.weight_layouts()
        want = [_slice_bytes(layout, full) for layout in layouts]
        # Sharded tensors: manifest bytes / TP on each worker; replicated ones whole.
        manifest = sum(t.numel() * t.element_size() for t in full.values())
        assert all(n < manifest for n in want)
        assert list(sync.transfer_plan.receiver_nbytes) == want
        assert [r["nbytes"] for r in sync.last_worker_results] == want
        assert [r["by_sender"] for r in sync.last_worker_results] == [{"0": n} for n in want]
    await engine.prepare_for_generation()
    await _assert_slices_equal(engine, full)
    expected = trainer.generate(PROMPTS, max_new_tokens=5, ignore_eos=True)
    assert await engine.generate(PROMPTS, max_new_tokens=5, ignore_eos=True) == expected


async def test_the_second_sync_replays_the_plan(engine: EmbeddedEngine) -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=22)
    async with _sync(trainer, engine) as sync:
        digest = None
        for step in range(2):
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.mul_(1.0 + 0.125 * (step + 1))
            await sync.mark_stale()
            await sync.sync_weights()
            digest = digest or sync.transfer_plan.digest
            assert sync.transfer_plan.digest == digest
            await _assert_slices_equal(engine, trainer.hf_state_dict())
        assert sync.weight_version == 2


async def test_the_factory_picks_it_when_the_engine_reports_a_layout(
    engine: EmbeddedEngine,
) -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=23)
    sync = factory_pick(
        DTensorRefitSource(trainer.model),
        engine,
        sharded=True,
    )
    assert type(sync) is ShardedWeightSynchronizer


async def test_a_wrong_inference_world_size_is_named_before_any_group_forms(
    engine: EmbeddedEngine,
) -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=24)
    sync = ShardedWeightSynchronizer(
        DTensorRefitSource(trainer.model),
        engine,
        train_cluster=TrainCluster(master_port=free_port()),
        inference_world_size=3,
        collective_timeout_s=600.0,  # a rendezvous would hang this long
    )
    with pytest.raises(ValueError, match=r"inference_world_size=3, but the engine has 4"):
        await sync.init_communicator()
    await sync.shutdown()


async def test_a_tensor_no_trainer_rank_holds_is_named_before_any_byte_moves(
    engine: EmbeddedEngine,
) -> None:
    from aiosync.errors import RefitMismatchError
    from aiosync.testing import StateDictSource

    state = HFModelRunner.from_config(TINY_QWEN3, seed=26).hf_state_dict()
    renamed = {("model.norm.scale" if n == "model.norm.weight" else n): t for n, t in state.items()}
    [before] = (await engine.hf_state_dicts())[:1]
    sync = ShardedWeightSynchronizer(
        StateDictSource(renamed),
        engine,
        train_cluster=TrainCluster(master_port=free_port()),
        inference_world_size=engine.world_size,
        collective_timeout_s=600.0,  # a worker left waiting in a rendezvous would hang this long
    )
    with pytest.raises(RefitMismatchError, match=r"model\.norm\.weight"):
        await sync.init_communicator()
    await sync.shutdown()
    [after] = (await engine.hf_state_dicts())[:1]
    assert all(torch.equal(before[n], after[n]) for n in before)


async def test_moe_experts_reach_each_worker_as_their_slices() -> None:
    from aiosync.engines.embedded.configs import TINY_QWEN3_MOE

    trainer = HFModelRunner.from_config(TINY_QWEN3_MOE, seed=27)
    async with EmbeddedEngine(
        TINY_QWEN3_MOE, num_workers=1, tensor_parallel_size=2, seed=5, rpc_timeout_s=120
    ) as moe:
        async with _sync(trainer, moe) as sync:
            await sync.mark_stale()
            await sync.sync_weights()
            full = trainer.hf_state_dict()
            manifest = sum(t.numel() * t.element_size() for t in full.values())
            assert all(n < manifest for n in sync.transfer_plan.receiver_nbytes)
        await _assert_slices_equal(moe, full)
        expected = trainer.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
        assert await moe.generate(PROMPTS, max_new_tokens=4, ignore_eos=True) == expected


@pytest.mark.parametrize(
    ("change", "match"),
    [
        # A tensor no worker holds would be dropped by the plan: refused instead.
        ("extra", r"1 name\(s\) unknown to the engine, first: \['model\.extra\.weight'\]"),
        # The engine loads float32: a bf16 trainer is refused, naming both dtypes.
        ("bf16", r"model\.embed_tokens\.weight: trainer \(128, 64\) bfloat16 vs engine .*float32"),
    ],
)
async def test_a_manifest_the_engine_does_not_load_is_refused_at_init(
    engine: EmbeddedEngine, change: str, match: str
) -> None:
    from aiosync.errors import RefitMismatchError
    from aiosync.testing import StateDictSource

    state = HFModelRunner.from_config(TINY_QWEN3, seed=28).hf_state_dict()
    if change == "extra":
        state = {**state, "model.extra.weight": torch.zeros(3)}
    else:
        state = {n: t.to(torch.bfloat16) for n, t in state.items()}
    before = await engine.hf_state_dicts()
    sync = ShardedWeightSynchronizer(
        StateDictSource(state),
        engine,
        train_cluster=TrainCluster(master_port=free_port()),
        inference_world_size=engine.world_size,
        collective_timeout_s=600.0,
    )
    with pytest.raises(RefitMismatchError, match=match):
        await sync.init_communicator()
    await sync.shutdown()
    after = await engine.hf_state_dicts()
    assert all(torch.equal(b[n], a[n]) for b, a in zip(before, after, strict=True) for n in b)
    await engine.generate(PROMPTS, max_new_tokens=2, ignore_eos=True)  # still serving
