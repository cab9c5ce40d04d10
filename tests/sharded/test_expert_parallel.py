"""Expert parallelism, tested for real: the embedded engine serves the tiny Qwen3-MoE with
each worker holding whole experts of its EP rank (optionally cut over TP within the EP
group), reports that layout, and the shard-aware plan sends every expert only to the
workers that hold it, from the trainer ranks that hold it.

The trainer is one process (every tensor whole); its FSDP2 and expert-parallel ranks
are exercised on the plan itself (``make_plan``, the function every rank runs), and the
FSDP2 trainer into a TP engine in ``test_sharded_moe.py``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping

import pytest
import pytest_asyncio
import torch

from aiosync.engines.embedded._tp import tp_layout
from aiosync.engines.embedded._worker import tensor_to_wire
from aiosync.engines.embedded.configs import TINY_QWEN3, TINY_QWEN3_MOE
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner, resolve_hf_config
from aiosync.errors import RefitVerificationError
from aiosync.layout import Layout
from aiosync.transports.collective import CollectiveWeightSynchronizer
from aiosync.transports.sharded import ShardedWeightSynchronizer, make_plan
from aiosync.transports.sharded.estimate import ep_layouts, fsdp_layouts, tp_layouts
from tests._support.builders import non_colocated
from tests._support.delta import bits, box_patch_bytes

pytestmark = pytest.mark.slow
IN_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")

# The tiny Qwen3-MoE (float32): H=64, V=128, I=96 (layer 1 dense), Im=32, E=4, 4 layers,
# 4 query heads and 2 key/value heads of D=32. One worker of a TP=2 replica holds half
# of the embedding and lm_head rows (2 * 64*64*4), the norm (64*4), per layer half of
# q/k/v/o (64*64 + 32*64 + 32*64 + 64*64 floats) plus q/k norms and two layer norms
# (32+32+64+64 floats): 49920 bytes; per MoE layer (0, 2, 3) the router (4*64 floats)
# and, under EP=2, its two whole experts (2 * 3 * 32*64 floats): 50176 bytes; the dense
# layer 1 half its MLP (3 * 48*64 floats): 36864 bytes.
EP2_WORKER_BYTES = 2 * 16384 + 256 + 4 * 49920 + 3 * 50176 + 36864
# EP=2 x TP=2 within each EP group (4 workers, TP=4 for the rest): a quarter of the
# embedding and lm_head rows, of q and o; one of the 2 key/value heads (replicated over
# 2 ranks, 32*64 floats each for k and v); per MoE layer the router and the group's two
# experts cut in half (2 * 3 * 16*64 floats); a quarter of the dense MLP (3 * 24*64).
EP2_TP2_WORKER_BYTES = 2 * 8192 + 256 + 4 * (4 * 8192 + 768) + 3 * (1024 + 24576) + 18432


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EmbeddedEngine]:
    """One replica of two workers, EP=2: worker 0 holds experts 0-1, worker 1 experts 2-3."""
    async with EmbeddedEngine(
        TINY_QWEN3_MOE,
        num_workers=1,
        tensor_parallel_size=2,
        expert_parallel_size=2,
        seed=5,
        rpc_timeout_s=120,
    ) as engine:
        yield engine


def _experts_held(layout: Layout) -> dict[int, list[int]]:
    """``{layer: sorted expert indices}`` whose checkpoint names ``layout`` holds."""
    held: dict[int, set[int]] = {}
    for name in layout:
        match = EXPERT.match(name)
        if match:
            held.setdefault(int(match[1]), set()).add(int(match[2]))
    return {layer: sorted(experts) for layer, experts in sorted(held.items())}


async def _holds_exactly(engine: EmbeddedEngine, full: Mapping[str, torch.Tensor]) -> None:
    """Every worker's state is exactly the trainer's tensors cut to its layout, bit for bit:
    the same names (no expert of another EP rank) and the same bits."""
    layouts = await engine.weight_layouts()
    for rank, (layout, state) in enumerate(
        zip(layouts, await engine.hf_state_dicts(), strict=True)
    ):
        assert list(state) == list(layout), f"worker {rank} holds other names than its layout"
        for name, part in layout.items():
            want = full[name].narrow(part.dim, part.start, part.length)
            assert torch.equal(bits(state[name].contiguous()), bits(want.contiguous())), (
                f"worker {rank}: {name} differs"
            )


@IN_MODULE_LOOP
async def test_each_worker_reports_and_holds_only_its_experts(engine: EmbeddedEngine) -> None:
    layouts = await engine.weight_layouts()
    assert [_experts_held(layout) for layout in layouts] == [
        {0: [0, 1], 2: [0, 1], 3: [0, 1]},
        {0: [2, 3], 2: [2, 3], 3: [2, 3]},
    ]
    # Whole experts (no TP within EP); attention still Megatron-cut, the router whole.
    part = layouts[1]["model.layers.0.mlp.experts.3.down_proj.weight"]
    assert (part.shape, part.is_whole) == ((64, 32), True)
    assert layouts[1]["model.layers.0.self_attn.q_proj.weight"].length == 64
    assert layouts[1]["model.layers.0.mlp.gate.weight"].is_whole
    # The manifest (what a trainer sends) is still the whole checkpoint.
    manifest = await engine.expected_manifest()
    assert {n for n in manifest if EXPERT.match(n)} == {
        n for layout in layouts for n in layout if EXPERT.match(n)
    }


@IN_MODULE_LOOP
async def test_each_worker_receives_exactly_the_bytes_of_its_experts_bit_exact(
    engine: EmbeddedEngine,
) -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3_MOE, seed=31)
    full = trainer.hf_state_dict()
    async with non_colocated(ShardedWeightSynchronizer, trainer.model, engine) as sync:
        await sync.mark_stale()
        await sync.sync_weights()
        plan = sync.transfer_plan
        assert list(plan.receiver_nbytes) == [EP2_WORKER_BYTES, EP2_WORKER_BYTES]
        assert [r["nbytes"] for r in sync.last_worker_results] == [EP2_WORKER_BYTES] * 2
        # Each expert travels once, to the one worker that holds it.
        sent = {(int(m[2]), t.dst) for t in plan.transfers() if (m := EXPERT.match(t.name))}
        assert sent == {(0, 0), (1, 0), (2, 1), (3, 1)}
        model_bytes = sum(t.numel() * t.element_size() for t in full.values())
        expert_bytes = 3 * 4 * 3 * 32 * 64 * 4  # MoE layers * experts * projections
        assert plan.total_nbytes == 2 * EP2_WORKER_BYTES
        assert plan.total_nbytes - expert_bytes < 2 * (model_bytes - expert_bytes)
    await engine.prepare_for_generation()
    await _holds_exactly(engine, full)
    expected = trainer.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
    assert await engine.generate(PROMPTS, max_new_tokens=4, ignore_eos=True) == expected


@IN_MODULE_LOOP
async def test_a_delta_of_one_expert_reaches_only_the_worker_that_holds_it(
    engine: EmbeddedEngine,
) -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3_MOE, seed=32)
    async with non_colocated(ShardedWeightSynchronizer, trainer.model, engine, delta=True) as sync:
        await sync.mark_stale()
        await sync.sync_weights()
        old = trainer.hf_state_dict()
        with torch.no_grad():
            # Five elements of expert 3's gate rows (layer 2), held by worker 1 only.
            trainer.model.model.layers[2].mlp.experts.gate_up_proj[3, 0, :5] += 1.0
        new = trainer.hf_state_dict()
        changed = [n for n in new if not torch.equal(old[n], new[n])]
        assert changed == ["model.layers.2.mlp.experts.3.gate_proj.weight"]
        await sync.mark_stale()
        await sync.sync_weights()
        # 5 changed float32 elements: int32 index + value each, 40 bytes, to worker 1.
        assert box_patch_bytes(sync.transfer_plan, old, new) == 40
        assert [(r["delta"], r["nbytes"]) for r in sync.last_worker_results] == [
            (True, 0),
            (True, 40),
        ]
        await _holds_exactly(engine, new)


@IN_MODULE_LOOP
async def test_verify_engine_checks_each_worker_against_its_own_experts(
    engine: EmbeddedEngine,
) -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3_MOE, seed=33)
    full = trainer.hf_state_dict()
    layouts = await engine.weight_layouts()
    async with non_colocated(ShardedWeightSynchronizer, trainer.model, engine) as sync:
        await sync.mark_stale()
        await sync.sync_weights()
        report = await sync.verify_engine()
        assert report["workers"] == 2
        assert report["tensors"] == sum(len(layout) for layout in layouts)
        # Corrupt expert 3 on the worker that holds it: a full tensor sent to every
        # worker is dropped by worker 0 (not its expert) and loaded by worker 1.
        name = "model.layers.3.mlp.experts.3.down_proj.weight"
        wrong = (full[name] + 1.0).contiguous()
        assert await engine.collective_rpc(
            "embedded_load_state_dict", ({name: tensor_to_wire(wrong)},)
        ) == [1, 1]
        with pytest.raises(RefitVerificationError, match=rf"worker 1.*{re.escape(name)} differs"):
            await sync.verify_engine()
        assert sync.is_stale
        await sync.sync_weights()
        assert (await sync.verify_engine())["workers"] == 2
    await _holds_exactly(engine, full)


@IN_MODULE_LOOP
async def test_the_verified_broadcast_lands_too_each_worker_keeping_only_its_experts(
    engine: EmbeddedEngine,
) -> None:
    """The rank-0 broadcast sends every expert to every worker (``verify=True``: each
    bucket digested on arrival); a worker keeps its own experts and drops the others'."""
    trainer = HFModelRunner.from_config(TINY_QWEN3_MOE, seed=36)
    full = trainer.hf_state_dict()
    async with non_colocated(
        CollectiveWeightSynchronizer, trainer.model, engine, verify=True
    ) as sync:
        await sync.mark_stale()
        await sync.sync_weights()
        assert sync.weight_version == 1
    await engine.prepare_for_generation()
    await _holds_exactly(engine, full)
    expected = trainer.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
    assert await engine.generate(PROMPTS, max_new_tokens=4, ignore_eos=True) == expected


@pytest.mark.parametrize(
    ("model", "tp", "ep", "match"),
    [
        (TINY_QWEN3_MOE, 2, 3, "expert_parallel_size=3 must divide tensor_parallel_size=2"),
        # Each expert is cut over an EP group's 2 ranks, not over the replica's 4.
        (
            {**TINY_QWEN3_MOE, "moe_intermediate_size": 33},
            4,
            2,
            r"moe_intermediate_size=33 is not divisible by tensor_parallel_size // ep=2",
        ),
        ({**TINY_QWEN3_MOE, "num_experts": 6}, 4, 4, "num_experts=6 is not divisible by"),
        (TINY_QWEN3, 2, 2, "needs a Qwen3-MoE model with experts, got model type 'qwen3'"),
    ],
)
def test_an_expert_parallel_size_that_does_not_fit_is_refused_before_any_process_starts(
    model: dict[str, object], tp: int, ep: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        EmbeddedEngine(model, tensor_parallel_size=tp, expert_parallel_size=ep)


@IN_MODULE_LOOP
async def test_tp_within_ep_cuts_each_expert_over_its_group() -> None:
    trainer = HFModelRunner.from_config(TINY_QWEN3_MOE, seed=34)
    full = trainer.hf_state_dict()
    async with (
        EmbeddedEngine(
            TINY_QWEN3_MOE,
            num_workers=1,
            tensor_parallel_size=4,
            expert_parallel_size=2,
            seed=5,
            rpc_timeout_s=120,
        ) as engine,
        non_colocated(ShardedWeightSynchronizer, trainer.model, engine) as sync,
    ):
        layouts = await engine.weight_layouts()
        assert [_experts_held(lay)[0] for lay in layouts] == [[0, 1], [0, 1], [2, 3], [2, 3]]
        gate = [lay["model.layers.0.mlp.experts.2.gate_proj.weight"] for lay in layouts[2:]]
        assert [(p.dim, p.start, p.length) for p in gate] == [(0, 0, 16), (0, 16, 16)]
        await sync.mark_stale()
        await sync.sync_weights()
        assert list(sync.transfer_plan.receiver_nbytes) == [EP2_TP2_WORKER_BYTES] * 4
        await engine.prepare_for_generation()
        await _holds_exactly(engine, full)
        expected = trainer.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
        assert await engine.generate(PROMPTS, max_new_tokens=4, ignore_eos=True) == expected


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (4, 1), (2, 2), (4, 2), (4, 4)])
def test_the_estimates_layouts_are_the_engines_own(tp: int, ep: int) -> None:
    """``aiosync plan`` predicts from the layouts the embedded engine's workers report
    (``_tp.tp_layout``), GQA heads replicated at TP4 and experts placed by EP rank."""
    manifest = HFModelRunner.from_config(TINY_QWEN3_MOE, seed=0).expected_manifest()
    config = resolve_hf_config(dict(TINY_QWEN3_MOE))
    engine = [tp_layout(manifest, config, rank, tp, ep) for rank in range(tp)]
    assert engine == (ep_layouts(manifest, tp=tp, ep=ep) if ep > 1 else tp_layouts(manifest, tp))


def test_the_plan_sends_each_expert_from_the_trainer_ranks_that_hold_it() -> None:
    """A 2-rank trainer whose experts are FSDP2-sharded as fused tensors (whole experts,
    rank 0 experts 0-1, rank 1 experts 2-3) into the engine's EP=2 layouts: every expert
    moves between one pair only; the layouts are the engine's own (``tp_layout``)."""
    runner = HFModelRunner.from_config(TINY_QWEN3_MOE, seed=35)
    manifest = runner.expected_manifest()
    config = resolve_hf_config(dict(TINY_QWEN3_MOE))
    engine = [tp_layout(manifest, config, rank, 2, 2) for rank in range(2)]
    assert engine == ep_layouts(manifest, tp=2, ep=2)  # the estimate's model of it
    dtypes = {n: d for n, (_, d) in manifest.items()}
    plan = make_plan(fsdp_layouts(manifest, 2), engine, dtypes, 1 << 20)
    pairs = {(int(m[2]), t.src, t.dst) for t in plan.transfers() if (m := EXPERT.match(t.name))}
    assert pairs == {(0, 0, 0), (1, 0, 0), (2, 1, 1), (3, 1, 1)}
    expert_bytes = 3 * 2 * 3 * 32 * 64 * 4  # MoE layers, 2 experts, 3 projections
    for src, dst in ((0, 1), (1, 0)):
        crossing = sum(
            t.nbytes for b in plan.buckets_between(src, dst) for t in b.transfers
            if EXPERT.match(t.name)
        )  # fmt: skip
        assert crossing == 0
    assert [
        sum(t.nbytes for t in plan.transfers() if t.dst == w and EXPERT.match(t.name))
        for w in range(2)
    ] == [expert_bytes, expert_bytes]
