"""EmbeddedEngine(quantization="fp8"): serves the FP8 checkpoint an FP8RefitSource streams."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from aiosync import RefitMismatchError, create_weight_synchronizer
from aiosync.delta import DeltaBaseline
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource, FP8RefitSource

FP8 = torch.float8_e4m3fn
#: Every linear weight is whole 128x128 blocks (2x2, 1x2, 3x2, 2x3 of them), so
#: transformers' CPU loader (which derives the block from the grid) reads it right.
BLOCKS = {
    **TINY_QWEN3,
    "hidden_size": 256,
    "intermediate_size": 384,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
TRAINER_SEED, ENGINE_SEED = 1, 2
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [9]]
NEW_TOKENS = 8


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor`` (``torch.equal`` has no float8 kernel)."""
    return tensor.contiguous().view(torch.uint8)


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        a[n].dtype == b[n].dtype and torch.equal(bits(a[n]), bits(b[n])) for n in a
    )


def trainer_source(config: dict[str, object]) -> FP8RefitSource:
    trainer = HFModelRunner.from_config(config, seed=TRAINER_SEED, dtype="bfloat16")
    return FP8RefitSource(DTensorRefitSource(trainer.model))


def write_fp8_checkpoint(
    folder: Path, config: dict[str, object], source: FP8RefitSource
) -> dict[str, torch.Tensor]:
    """The source's tensors as an FP8 checkpoint folder (safetensors + config.json)."""
    tensors = {n: t.contiguous() for n, t in source.iter_weights()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    built = HFModelRunner.from_config(config).model.config.to_dict()
    built.update(architectures=["Qwen3ForCausalLM"], dtype="bfloat16")
    built["quantization_config"] = source.quantization_config()
    (folder / "config.json").write_text(json.dumps(built))
    return tensors


def transformers_greedy(folder: Path) -> list[list[int]]:
    """Greedy tokens of transformers' own load of the FP8 checkpoint (on a CPU it
    dequantizes to bf16: ``FineGrainedFP8HfQuantizer``, ``Fp8Dequantize``)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        generated = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
        out.append(generated[0, len(prompt) :].tolist())
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(
        BLOCKS, seed=ENGINE_SEED, dtype="bfloat16", quantization="fp8", rpc_timeout_s=120
    ) as engine:
        yield engine


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_an_ipc_refit_serves_what_transformers_loads_from_the_fp8_checkpoint(
    engine: EmbeddedEngine, tmp_path: Path
) -> None:
    source = trainer_source(BLOCKS)
    assert await engine.expected_manifest() == source.prepare_refit_info()
    tensors = write_fp8_checkpoint(tmp_path, BLOCKS, source)
    before = await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    async with create_weight_synchronizer(
        source, engine, colocated=True, backend="embedded", device="cpu"
    ) as sync:
        await sync.mark_stale()
        await sync.sync_weights()
    (state,) = await engine.hf_state_dicts()
    assert same_tensors(state, tensors)  # the engine holds the FP8 checkpoint's bytes
    after = await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert after == transformers_greedy(tmp_path)
    assert after != before  # the refit changed what the engine computes
    # The same checkpoint from disk, read by the runner as stored.
    from_disk = HFModelRunner.from_config(tmp_path, dtype="bfloat16", quantization="fp8")
    assert same_tensors(from_disk.hf_state_dict(), tensors)
    assert from_disk.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True) == after
    # A level-1 sleep offloads the FP8 tensors and the wake reloads them.
    await engine.finish_generation()
    await engine.prepare_for_generation()
    assert await engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True) == after


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_an_unquantized_trainer_is_refused_at_init_naming_a_tensor(
    engine: EmbeddedEngine,
) -> None:
    trainer = HFModelRunner.from_config(BLOCKS, seed=TRAINER_SEED, dtype="bfloat16")
    (before,) = await engine.hf_state_dicts()
    with pytest.raises(RefitMismatchError) as info:
        async with create_weight_synchronizer(
            DTensorRefitSource(trainer.model),
            engine,
            colocated=True,
            backend="embedded",
            device="cpu",
        ):
            pytest.fail("init must refuse a bf16 manifest")
    message = str(info.value)
    assert "model.layers.0.self_attn.q_proj.weight: trainer (256, 256) bfloat16 vs engine " in (
        message
    )
    assert "(256, 256) float8_e4m3fn" in message
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in message  # missing from trainer
    (after,) = await engine.hf_state_dicts()
    assert same_tensors(before, after)


def test_pairs_load_in_any_order_and_bucket_and_match_transformers(tmp_path: Path) -> None:
    source = trainer_source(BLOCKS)
    tensors = write_fp8_checkpoint(tmp_path, BLOCKS, source)
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)
    runner = HFModelRunner.from_config(
        BLOCKS, seed=ENGINE_SEED, dtype="bfloat16", quantization="fp8"
    )
    items = list(tensors.items())
    scales = [(n, t) for n, t in items if n.endswith("_scale_inv")]
    rest = [(n, t) for n, t in items if not n.endswith("_scale_inv")]
    # Every scale first, one bucket each, then the weights in reverse: halves apart.
    for item in scales:
        assert runner.load_weights([item]) == 1
    assert runner.load_weights(list(reversed(rest))) == len(rest)
    assert same_tensors(runner.hf_state_dict(), tensors)
    tokens = runner.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert tokens == transformers_greedy(tmp_path)
    # A half-done refit (new scales only) followed by a whole one serves the whole one.
    other = dict(trainer_source(BLOCKS).iter_weights())
    runner.load_weights([(n, torch.ones_like(t)) for n, t in scales])
    runner.generate([[1]], max_new_tokens=1)
    runner.load_weights(other.items())
    assert runner.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True) == tokens


def test_a_delta_of_the_fp8_bytes_lands_as_a_full_load_of_them() -> None:
    trainer = HFModelRunner.from_config(BLOCKS, seed=TRAINER_SEED, dtype="bfloat16")
    source = FP8RefitSource(DTensorRefitSource(trainer.model))
    baseline = DeltaBaseline()
    runner = HFModelRunner.from_config(BLOCKS, dtype="bfloat16", quantization="fp8")
    runner.load_weights(baseline.stage_full(1, source.iter_weights()))
    baseline.commit()
    with torch.no_grad():  # an optimizer step that moves a few weights
        trainer.model.model.layers[1].mlp.up_proj.weight[:3] *= 1.5
        trainer.model.model.layers[0].self_attn.k_proj.weight[5, 7] = 9.0  # a new amax
    new = dict(source.iter_weights())
    patches = list(baseline.diff(new.items()))
    patched = {p.name for p in patches}
    assert "model.layers.1.mlp.up_proj.weight" in patched
    assert "model.layers.0.self_attn.k_proj.weight_scale_inv" in patched
    assert "model.layers.0.mlp.up_proj.weight" not in patched
    runner.apply_weight_patches(patches)
    assert same_tensors(runner.hf_state_dict(), new)
    full = HFModelRunner.from_config(BLOCKS, dtype="bfloat16", quantization="fp8")
    full.load_weights(new.items())
    tokens = full.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert runner.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True) == tokens
    assert same_tensors(dict(runner.model.state_dict()), dict(full.model.state_dict()))


def test_a_load_of_the_wrong_dtype_names_the_tensor() -> None:
    runner = HFModelRunner.from_config(BLOCKS, dtype="bfloat16", quantization="fp8")
    name = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(RefitMismatchError, match=rf"{name}: model \(384, 256\) torch.float8"):
        runner.load_weights([(name, torch.zeros(384, 256, dtype=torch.bfloat16))])


def test_fp8_is_refused_where_it_is_not_supported() -> None:
    with pytest.raises(ValueError, match="quantization must be None or 'fp8'"):
        EmbeddedEngine(TINY_QWEN3, quantization="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        EmbeddedEngine(TINY_QWEN3, quantization="fp8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="runner_factory"):
        EmbeddedEngine(TINY_QWEN3, quantization="fp8", runner_factory="x.y")
