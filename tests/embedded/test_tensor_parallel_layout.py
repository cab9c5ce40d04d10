"""Tensor-parallel slicing in one process: the Megatron layout, loads of full tensors
and of parts, and a lockstep forward pass over a gloo group whose ranks are threads."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import pytest
import torch
import torch.distributed as dist
import zmq

from aiosync.engines.embedded._tp import TensorParallel, TPGroup, TPSpec, check_tensor_parallel
from aiosync.engines.embedded.configs import TINY_QWEN3, TINY_QWEN3_MOE, TINY_QWEN3_TIED
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.errors import RefitMismatchError
from aiosync.layout import Part

SEED = 6
T = TypeVar("T")


def _on_every_rank(size: int, fn: Callable[[int], T]) -> list[T]:
    """``fn(rank)`` for every rank at once, one thread each (collectives pair up)."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return results


def _groups(size: int) -> list[TPGroup]:
    """A gloo group of ``size`` ranks in this process (over an in-memory store)."""
    store = dist.HashStore()

    def join(rank: int) -> TPGroup:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = datetime.timedelta(seconds=60)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return TPGroup(dist.ProcessGroupGloo(store, rank, size, opts), rank, size, 0)

    return _on_every_rank(size, join)


def _ranks(config: Mapping[str, Any], size: int, seed: int = SEED) -> list[HFModelRunner]:
    """One sharded runner per rank of a ``size``-rank replica (no step channel)."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    return [
        HFModelRunner.from_config(
            config,
            seed=seed,
            tensor_parallel=TensorParallel(TPSpec(rank, size, 0, 0, "", (), 60.0), group, ctx),
        )
        for rank, group in enumerate(_groups(size))
    ]


@pytest.fixture(scope="module")
def dense() -> list[HFModelRunner]:
    return _ranks(TINY_QWEN3, 2)


@pytest.fixture(scope="module")
def reference() -> HFModelRunner:
    return HFModelRunner.from_config(TINY_QWEN3, seed=SEED)


def _slice(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    return tensor.narrow(part.dim, part.start, part.length)


def test_dense_qwen3_is_cut_as_megatron_cuts_it(dense: list[HFModelRunner]) -> None:
    for rank, runner in enumerate(dense):
        layout = runner.weight_layout()
        attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
        assert layout[f"{attn}.q_proj.weight"] == Part((128, 64), 0, 64 * rank, 64)
        assert layout[f"{attn}.k_proj.weight"] == Part((64, 64), 0, 32 * rank, 32)
        assert layout[f"{attn}.v_proj.weight"] == Part((64, 64), 0, 32 * rank, 32)
        assert layout[f"{attn}.o_proj.weight"] == Part((64, 128), 1, 64 * rank, 64)
        assert layout[f"{mlp}.gate_proj.weight"] == Part((128, 64), 0, 64 * rank, 64)
        assert layout[f"{mlp}.up_proj.weight"] == Part((128, 64), 0, 64 * rank, 64)
        assert layout[f"{mlp}.down_proj.weight"] == Part((64, 128), 1, 64 * rank, 64)
        assert layout["model.embed_tokens.weight"] == Part((128, 64), 0, 64 * rank, 64)
        assert layout["lm_head.weight"] == Part((128, 64), 0, 64 * rank, 64)
        replicated = [
            "model.norm.weight",
            f"{attn}.q_norm.weight",
            f"{attn}.k_norm.weight",
            "model.layers.1.input_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight",
        ]
        assert all(layout[name].is_whole for name in replicated)
        # Every checkpoint tensor has a part, in checkpoint order, of its FULL shape.
        manifest = runner.expected_manifest()
        assert list(layout) == list(manifest)
        assert all(layout[name].shape == shape for name, (shape, _) in manifest.items())


def test_fewer_key_value_heads_than_ranks_are_replicated_as_vllm_does() -> None:
    ranks = _ranks(TINY_QWEN3, 4)  # 4 query heads, 2 key/value heads
    k_parts = [r.weight_layout()["model.layers.0.self_attn.k_proj.weight"] for r in ranks]
    # Rank r keeps head r * K // N: heads 0, 0, 1, 1.
    assert [(p.start, p.length) for p in k_parts] == [(0, 32), (0, 32), (32, 32), (32, 32)]
    q_parts = [r.weight_layout()["model.layers.0.self_attn.q_proj.weight"] for r in ranks]
    assert [(p.start, p.length) for p in q_parts] == [(0, 32), (32, 32), (64, 32), (96, 32)]
    attention: Any = ranks[0].model.model.layers[0].self_attn
    assert attention.num_key_value_groups == 1  # one query head per rank, on its own kv head


def test_moe_experts_are_tp_sliced_and_the_router_replicated() -> None:
    ranks = _ranks(TINY_QWEN3_MOE, 2)
    for rank, runner in enumerate(ranks):
        layout = runner.weight_layout()
        for e in range(4):
            experts = f"model.layers.0.mlp.experts.{e}"
            assert layout[f"{experts}.gate_proj.weight"] == Part((32, 64), 0, 16 * rank, 16)
            assert layout[f"{experts}.up_proj.weight"] == Part((32, 64), 0, 16 * rank, 16)
            assert layout[f"{experts}.down_proj.weight"] == Part((64, 32), 1, 16 * rank, 16)
        assert layout["model.layers.0.mlp.gate.weight"].is_whole  # the router
        # Layer 1 is dense (mlp_only_layers): a column/row-parallel MLP.
        assert layout["model.layers.1.mlp.gate_proj.weight"] == Part((96, 64), 0, 48 * rank, 48)
        assert layout["model.layers.1.mlp.down_proj.weight"] == Part((64, 96), 1, 48 * rank, 48)


@pytest.mark.parametrize(
    ("config", "size", "message"),
    [
        ({"model_type": "gemma4_text"}, 2, "supports model types .* got 'gemma4_text'"),
        ({**TINY_QWEN3, "num_attention_heads": 6, "head_dim": 16}, 4, "num_attention_heads=6"),
        ({**TINY_QWEN3, "num_key_value_heads": 3}, 2, "num_key_value_heads=3"),
        ({**TINY_QWEN3, "vocab_size": 127}, 2, "vocab_size=127"),
        ({**TINY_QWEN3_MOE, "moe_intermediate_size": 30}, 4, "moe_intermediate_size=30"),
    ],
)
def test_a_config_that_does_not_split_is_named(
    config: dict[str, Any], size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(config, size)


def test_each_rank_starts_with_its_slice_of_the_seeded_model_and_keeps_it_from_full_loads(
    reference: HFModelRunner,
) -> None:
    dense = _ranks(TINY_QWEN3, 2)
    for runner in dense:
        layout = runner.weight_layout()
        for name, tensor in runner.hf_state_dict().items():
            assert torch.equal(tensor, _slice(reference.hf_state_dict()[name], layout[name])), name
    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=SEED + 1).hf_state_dict()
    for runner in dense:
        # Full checkpoint tensors in, the rank's slice kept.
        assert runner.load_weights(trainer.items()) == len(trainer)
        layout = runner.weight_layout()
        for name, tensor in runner.hf_state_dict().items():
            assert torch.equal(tensor, _slice(trainer[name], layout[name])), name
    with pytest.raises(
        RefitMismatchError, match=r"model \(128, 64\) torch.float32, got \(64, 64\)"
    ):
        dense[0].load_weights([("model.embed_tokens.weight", torch.zeros(64, 64))])


def test_tied_head_shares_the_embedding_rows_and_accepts_a_sent_head() -> None:
    ranks = _ranks(TINY_QWEN3_TIED, 2)
    full = HFModelRunner.from_config(TINY_QWEN3_TIED, seed=SEED + 2).hf_state_dict()
    embed = full["model.embed_tokens.weight"]
    for rank, runner in enumerate(ranks):
        assert "lm_head.weight" not in runner.weight_layout()
        head: Any = runner.model.get_output_embeddings()
        assert head is not None and head.weight is runner.model.get_input_embeddings().weight
        # A source that does not know about the tie sends the head: it lands in the same rows.
        runner.load_weights([("lm_head.weight", embed)])
        rows = embed[64 * rank : 64 * (rank + 1)]
        assert torch.equal(runner.hf_state_dict()["model.embed_tokens.weight"], rows)


def _q_proj(runner: HFModelRunner) -> torch.Tensor:
    return runner.hf_state_dict()["model.layers.0.self_attn.q_proj.weight"]


def test_a_part_loads_what_overlaps_the_rank_s_slice_along_any_dim(
    dense: list[HFModelRunner],
) -> None:
    name, shape = "model.layers.0.self_attn.q_proj.weight", (128, 64)
    full = torch.arange(128 * 64, dtype=torch.float32).reshape(shape)
    rank0, rank1 = dense
    # The full extent: each rank keeps its rows.
    assert rank0.load_weight_parts([(name, Part.whole(shape), full)]) == 64 * 64
    assert rank1.load_weight_parts([(name, Part.whole(shape), full)]) == 64 * 64
    assert torch.equal(_q_proj(rank0), full[:64]) and torch.equal(_q_proj(rank1), full[64:])
    # A sub-range of rank 1's rows along the same dim.
    box = Part(shape, 0, 80, 16)
    assert rank1.load_weight_parts([(name, box, -full[80:96])]) == 16 * 64
    assert torch.equal(_q_proj(rank1)[16:32], -full[80:96])
    assert torch.equal(_q_proj(rank1)[:16], full[64:80])  # untouched around it
    # An FSDP-like chunk across both ranks' rows: each keeps the overlap.
    box = Part(shape, 0, 48, 48)
    assert rank0.load_weight_parts([(name, box, 2 * full[48:96])]) == 16 * 64
    assert rank1.load_weight_parts([(name, box, 2 * full[48:96])]) == 32 * 64
    assert torch.equal(_q_proj(rank0)[48:], 2 * full[48:64])
    assert torch.equal(_q_proj(rank1)[:32], 2 * full[64:96])
    # A box along the other dim (columns): every rank writes those columns of its rows.
    box = Part(shape, 1, 16, 8)
    assert rank0.load_weight_parts([(name, box, 3 * full[:, 16:24])]) == 64 * 8
    assert torch.equal(_q_proj(rank0)[:, 16:24], 3 * full[:64, 16:24])
    assert torch.equal(_q_proj(rank0)[:48, :16], full[:48, :16])
    # An empty chunk (FSDP's last ones can be) writes nothing.
    assert rank0.load_weight_parts([(name, Part(shape, 0, 128, 0), torch.empty(0, 64))]) == 0


@pytest.mark.parametrize(
    ("part", "tensor", "error", "message"),
    [
        (Part((128, 64), 0, 96, 16), torch.zeros(16, 64), ValueError, "do not overlap"),
        (Part((128, 64), 0, 0, 16), torch.zeros(8, 64), RefitMismatchError, r"local shape \(16"),
        (Part((128, 32), 0, 0, 16), torch.zeros(16, 32), RefitMismatchError, r"got a part of"),
        (Part((128, 64), 0, 0, 16), torch.zeros(16, 64).double(), RefitMismatchError, "float64"),
    ],
)
def test_a_part_that_does_not_fit_is_refused(
    dense: list[HFModelRunner], part: Part, tensor: torch.Tensor, error: type, message: str
) -> None:
    name = "model.layers.0.self_attn.q_proj.weight"
    before = _q_proj(dense[0])
    with pytest.raises(error, match=message):
        dense[0].load_weight_parts([(name, part, tensor)])
    assert torch.equal(_q_proj(dense[0]), before)
    with pytest.raises(RefitMismatchError, match="not a parameter"):
        dense[0].load_weight_parts([("model.nope.weight", Part.whole((2,)), torch.zeros(2))])


def test_an_unsharded_runner_reports_and_loads_whole_parts(reference: HFModelRunner) -> None:
    layout = reference.weight_layout()
    manifest = reference.expected_manifest()
    assert layout == {name: Part.whole(shape) for name, (shape, _) in manifest.items()}
    name = "model.norm.weight"
    value = torch.full((64,), 0.5)
    assert reference.load_weight_parts([(name, Part((64,), 0, 8, 8), value[:8])]) == 8
    assert torch.equal(reference.hf_state_dict()[name][8:16], value[:8])


def _lockstep_logits(ranks: Sequence[HFModelRunner], ids: torch.Tensor) -> list[torch.Tensor]:
    def forward(rank: int) -> torch.Tensor:
        with ranks[rank].lock:
            logits, _ = ranks[rank].forward_step(ids, None, None)
        return logits

    return _on_every_rank(len(ranks), forward)


@pytest.mark.parametrize(
    ("config", "size"),
    [(TINY_QWEN3, 2), (TINY_QWEN3_TIED, 2), (TINY_QWEN3, 4), (TINY_QWEN3_MOE, 2)],
    ids=["dense", "tied", "replicated-kv", "moe"],
)
def test_a_lockstep_forward_computes_the_unsharded_model_s_logits(
    config: dict[str, Any], size: int
) -> None:
    ranks = _ranks(config, size)
    full = HFModelRunner.from_config(config, seed=SEED)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with full.lock:
        want, _ = full.forward_step(ids, None, None)
    logits = _lockstep_logits(ranks, ids)
    # Partial sums round differently from the full matmul: equal to float32 noise.
    torch.testing.assert_close(logits[0], want, rtol=0, atol=1e-5)
    assert int(torch.argmax(logits[0])) == int(torch.argmax(want))
    # Every rank all-gathered the same logits.
    assert all(torch.equal(other, logits[0]) for other in logits[1:])


def test_a_lora_adapter_on_a_tensor_parallel_rank_is_not_implemented(
    dense: list[HFModelRunner],
) -> None:
    with pytest.raises(NotImplementedError, match="tensor_parallel_size > 1"):
        dense[0].load_lora_adapter("aiosync-v1", {}, {"r": 1, "target_modules": ["q_proj"]})


def test_a_follower_never_drives_generation(dense: list[HFModelRunner]) -> None:
    with pytest.raises(ValueError, match="tensor-parallel rank 1 follows"):
        dense[1].generate([[1, 2]], max_new_tokens=1)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"tensor_parallel_size": "2"}, TypeError, "tensor_parallel_size must be an int, got str"),
        ({"tensor_parallel_size": 0}, ValueError, "tensor_parallel_size must be >= 1, got 0"),
        (
            {"tensor_parallel_size": 2, "runner_factory": "x.y"},
            ValueError,
            "does not work with a runner_factory",
        ),
        ({"tensor_parallel_size": 3}, ValueError, "num_attention_heads=4 is not divisible"),
        (
            {"tensor_parallel_size": 2, "num_workers": 2, "device_labels": ["a", "b"]},
            ValueError,
            "device_labels must be 4 non-empty strings",
        ),
    ],
)
def test_bad_tensor_parallel_arguments_raise_before_any_process_starts(
    options: dict[str, Any], error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        EmbeddedEngine(TINY_QWEN3, **options)
