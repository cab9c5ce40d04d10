"""A tensor-parallel EmbeddedEngine in real processes: 2 replicas x 2 ranks (4 workers).

One engine serves the whole module (starting it costs seconds per process on a
loaded CPU); every test that asserts weights first syncs or loads them itself,
except the one that checks the initial weights, which runs before any load.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import pytest
import pytest_asyncio
import torch

from aiosync import TrainCluster, create_weight_synchronizer
from aiosync.engines.embedded._worker import tensor_to_wire
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.errors import SyncError, TransportError
from aiosync.layout import Layout, Part
from aiosync.lora import LoRAAdapter
from aiosync.refit import DTensorRefitSource
from aiosync.transports.collective import CollectiveWeightSynchronizer
from aiosync.transports.ipc import IPCWeightSynchronizer
from tests._support.steps import first_sync

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

DENSE = TINY_QWEN3
SEED = 4
REPLICAS, TP = 2, 2
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(
        DENSE, num_workers=REPLICAS, tensor_parallel_size=TP, seed=SEED, rpc_timeout_s=120
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference() -> HFModelRunner:
    return HFModelRunner.from_config(DENSE, seed=SEED)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _megatron(rank: int) -> dict[str, Part]:
    """What tensor-parallel rank ``rank`` of 2 holds of TINY_QWEN3, written out."""
    rows = Part((128, 64), 0, 64 * rank, 64)  # q, gate, up, embed_tokens, lm_head
    kv = Part((64, 64), 0, 32 * rank, 32)  # one of the 2 key/value heads
    columns = Part((64, 128), 1, 64 * rank, 64)  # o, down
    parts = {"model.embed_tokens.weight": rows}
    for i in range(2):
        layer = f"model.layers.{i}"
        parts |= {
            f"{layer}.self_attn.q_proj.weight": rows,
            f"{layer}.self_attn.k_proj.weight": kv,
            f"{layer}.self_attn.v_proj.weight": kv,
            f"{layer}.self_attn.o_proj.weight": columns,
            f"{layer}.self_attn.q_norm.weight": Part.whole((32,)),
            f"{layer}.self_attn.k_norm.weight": Part.whole((32,)),
            f"{layer}.mlp.gate_proj.weight": rows,
            f"{layer}.mlp.up_proj.weight": rows,
            f"{layer}.mlp.down_proj.weight": columns,
            f"{layer}.input_layernorm.weight": Part.whole((64,)),
            f"{layer}.post_attention_layernorm.weight": Part.whole((64,)),
        }
    return parts | {"model.norm.weight": Part.whole((64,)), "lm_head.weight": rows}


async def _assert_slices_equal(engine: EmbeddedEngine, full: Mapping[str, torch.Tensor]) -> None:
    """Every worker holds exactly its part of ``full`` (HF checkpoint tensors), bit for bit."""
    layouts: list[Layout] = await engine.weight_layouts()
    for rank, (layout, state) in enumerate(
        zip(layouts, await engine.hf_state_dicts(), strict=True)
    ):
        assert list(state) == list(full), f"worker {rank} names differ"
        for name, tensor in full.items():
            part = layout[name]
            want = tensor.narrow(part.dim, part.start, part.length)
            assert torch.equal(state[name], want), f"worker {rank}: {name} differs"


def _trainer(seed: int) -> HFModelRunner:
    return HFModelRunner.from_config(DENSE, seed=seed)


async def _serves(engine: EmbeddedEngine, trainer: Any, tokens: int) -> None:
    """Every rank holds its slices of the trainer's weights, and the engine generates the
    trainer's greedy tokens (``tokens`` each)."""
    await engine.prepare_for_generation()
    await _assert_slices_equal(engine, trainer.hf_state_dict())
    want = trainer.generate(PROMPTS, max_new_tokens=tokens, ignore_eos=True)
    assert await engine.generate(PROMPTS, max_new_tokens=tokens, ignore_eos=True) == want


async def test_four_workers_are_numbered_replica_times_tp_plus_rank(
    engine: EmbeddedEngine, reference: HFModelRunner
) -> None:
    assert (engine.num_workers, engine.tensor_parallel_size, engine.world_size) == (2, 2, 4)
    assert len(set(engine.pids)) == 4
    assert [s["rank"] for s in await engine.status()] == [0, 1, 2, 3]
    # As the transports number them (IPC socket identities, collective group ranks).
    assert await engine.collective_rpc("aiosync_worker_rank") == [0, 1, 2, 3]
    # The manifest is the FULL checkpoint's, whatever a worker holds.
    assert await engine.expected_manifest() == reference.expected_manifest()


async def test_every_worker_reports_its_megatron_layout(engine: EmbeddedEngine) -> None:
    layouts = await engine.weight_layouts()
    assert [dict(layout) for layout in layouts] == [_megatron(r % TP) for r in range(4)]


async def test_workers_start_with_their_slices_of_the_seeded_model(
    engine: EmbeddedEngine, reference: HFModelRunner
) -> None:
    # Before any load (the module's tests before this one only read).
    await _assert_slices_equal(engine, reference.hf_state_dict())


async def test_greedy_generation_equals_the_unsharded_model_token_for_token(
    engine: EmbeddedEngine, reference: HFModelRunner
) -> None:
    payload = {n: tensor_to_wire(t) for n, t in reference.hf_state_dict().items()}
    await engine.collective_rpc("embedded_load_state_dict", (payload,))
    want = reference.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    assert await engine.generate(PROMPTS, max_new_tokens=8, ignore_eos=True) == want
    # One prompt: replica 0 alone (its followers in lockstep, replica 1 idle).
    assert await engine.generate(PROMPTS[:1], max_new_tokens=8, ignore_eos=True) == want[:1]


async def test_seeded_sampling_equals_the_unsharded_model(
    engine: EmbeddedEngine, reference: HFModelRunner
) -> None:
    payload = {n: tensor_to_wire(t) for n, t in reference.hf_state_dict().items()}
    await engine.collective_rpc("embedded_load_state_dict", (payload,))
    got = await engine.generate(PROMPTS, max_new_tokens=6, temperature=0.9, seed=3, ignore_eos=True)
    # Each replica's driver seeds one generator for its chunk of the prompts.
    want = [
        out
        for chunk in (PROMPTS[:2], PROMPTS[2:])
        for out in reference.generate(
            chunk, max_new_tokens=6, temperature=0.9, seed=3, ignore_eos=True
        )
    ]
    assert got == want


async def test_ipc_sync_lands_each_worker_s_slice_bit_exact(engine: EmbeddedEngine) -> None:
    trainer = _trainer(seed=11)
    async with IPCWeightSynchronizer(
        DTensorRefitSource(trainer.model), engine, bucket_bytes=16384, rpc_timeout_s=60
    ) as sync:
        await sync.init_communicator()
        assert sync.num_workers == 4  # every worker receives FULL tensors
        await sync.mark_stale()
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (1, False)
    await _assert_slices_equal(engine, trainer.hf_state_dict())
    want = trainer.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
    assert await engine.generate(PROMPTS, max_new_tokens=6, ignore_eos=True) == want


@pytest.mark.parametrize("overlap", ["inplace", "staged"])
async def test_collective_sync_lands_each_worker_s_slice_bit_exact(
    engine: EmbeddedEngine, overlap: str
) -> None:
    trainer = _trainer(seed=12 if overlap == "inplace" else 13)
    sync = create_weight_synchronizer(
        DTensorRefitSource(trainer.model),
        engine,
        colocated=False,
        backend="embedded",
        train_cluster=TrainCluster(master_port=_port()),
        inference_world_size=engine.world_size,
        dist_backend="gloo",
        overlap=overlap,  # type: ignore[arg-type]
        verify=True,
        collective_timeout_s=60.0,
    )
    assert isinstance(sync, CollectiveWeightSynchronizer)
    async with sync:
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.weight_version == 1
    await _serves(engine, trainer, tokens=5)


async def test_the_collective_counts_every_worker_not_every_replica(
    engine: EmbeddedEngine,
) -> None:
    sync = create_weight_synchronizer(
        DTensorRefitSource(_trainer(seed=14).model),
        engine,
        colocated=False,
        backend="embedded",
        train_cluster=TrainCluster(),
        inference_world_size=engine.num_workers,  # the replicas: wrong
        dist_backend="gloo",
        collective_timeout_s=600.0,  # a rendezvous would hang this long: it must not start
    )
    with anyio.fail_after(120), pytest.raises(ValueError) as raised:
        async with sync:
            pass
    assert str(raised.value) == (
        "inference_world_size=2, but the engine has 4 worker(s): pass inference_world_size=4"
    )


async def test_load_weight_parts_writes_what_each_rank_holds_of_a_box(
    engine: EmbeddedEngine, reference: HFModelRunner
) -> None:
    payload = {n: tensor_to_wire(t) for n, t in reference.hf_state_dict().items()}
    await engine.collective_rpc("embedded_load_state_dict", (payload,))
    name = "model.layers.1.mlp.down_proj.weight"  # row-parallel: ranks hold columns
    full = reference.hf_state_dict()[name]
    rows = Part((64, 128), 0, 8, 16)  # a box along the other dim: 16 rows, every column
    new = -full[8:24]
    item = [name, rows.to_wire(), tensor_to_wire(new)]
    assert await engine.collective_rpc("embedded_load_weight_parts", ([item],)) == [16 * 64] * 4
    expected = dict(reference.hf_state_dict())
    expected[name] = full.clone()
    expected[name][8:24] = new
    await _assert_slices_equal(engine, expected)


async def test_a_follower_that_cannot_serve_stops_its_replica_s_generation(
    engine: EmbeddedEngine, reference: HFModelRunner
) -> None:
    payload = {n: tensor_to_wire(t) for n, t in reference.hf_state_dict().items()}
    await engine.collective_rpc("embedded_load_state_dict", (payload,))
    # Only worker 3 (rank 1 of replica 1) discards its weights.
    await engine._pool.call("embedded_sleep", [(3, [2], {})], None)
    try:
        with pytest.raises(SyncError, match=r"worker 3 \(tensor-parallel rank 1 of replica 1\)"):
            await engine.generate(PROMPTS, max_new_tokens=3)
        # Replica 0 still serves.
        want = reference.generate(PROMPTS[:1], max_new_tokens=3)
        assert await engine.generate(PROMPTS[:1], max_new_tokens=3) == want
    finally:
        await engine.prepare_for_generation()
        await engine.collective_rpc("embedded_load_state_dict", (payload,))
    want = reference.generate(PROMPTS, max_new_tokens=3)
    assert await engine.generate(PROMPTS, max_new_tokens=3) == want


async def test_a_lora_adapter_is_refused_before_any_worker_is_touched(
    engine: EmbeddedEngine, reference: HFModelRunner
) -> None:
    payload = {n: tensor_to_wire(t) for n, t in reference.hf_state_dict().items()}
    await engine.collective_rpc("embedded_load_state_dict", (payload,))
    with pytest.raises(NotImplementedError, match="tensor_parallel_size > 1"):
        await engine.load_lora_adapter(LoRAAdapter("aiosync-v1", 1, {}, {"r": 1}))
    # The base model still serves.
    want = reference.generate(PROMPTS, max_new_tokens=3)
    assert await engine.generate(PROMPTS, max_new_tokens=3) == want


async def test_a_level_1_sleep_gives_every_rank_its_slice_back(
    engine: EmbeddedEngine,
) -> None:
    trainer = _trainer(seed=15)
    payload = {n: tensor_to_wire(t) for n, t in trainer.hf_state_dict().items()}
    await engine.collective_rpc("embedded_load_state_dict", (payload,))
    assert engine.sleep_level == 1
    await engine.finish_generation()
    await _serves(engine, trainer, tokens=4)


async def test_a_dead_follower_is_respawned_with_its_whole_replica(
    engine: EmbeddedEngine,
) -> None:
    before = engine.pids
    os.kill(before[3], signal.SIGKILL)
    with pytest.raises(TransportError, match="worker 3"):
        await engine.collective_rpc("embedded_status", timeout_s=60)
    assert await engine.respawn_dead_workers() == [2, 3]
    assert engine.pids[:2] == before[:2]
    assert not set(engine.pids[2:]) & set(before)
    # The new replica holds initial weights: it refuses until a sync lands.
    assert [s["weights_valid"] for s in await engine.status()] == [True, True, False, False]
    with pytest.raises(SyncError, match="worker 2: weights are not valid"):
        await engine.generate(PROMPTS, max_new_tokens=3)
    trainer = _trainer(seed=16)
    async with IPCWeightSynchronizer(
        DTensorRefitSource(trainer.model), engine, rpc_timeout_s=60
    ) as sync:
        await first_sync(sync)
    await _assert_slices_equal(engine, trainer.hf_state_dict())
    with anyio.fail_after(120):
        want = trainer.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
        assert await engine.generate(PROMPTS, max_new_tokens=4, ignore_eos=True) == want
