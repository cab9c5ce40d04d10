"""FP8RefitSource: the block-wise FP8 checkpoint, bit for bit transformers' quantizer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import (
    Fp8Dequantize,
    FP8Experts,
    FP8Linear,
    Fp8Quantize,
    _dequantize_fp8_weight,
    replace_with_fp8_linear,
)
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

from aiosync.engines.embedded.configs import TINY_QWEN3, TINY_QWEN3_MOE, TINY_QWEN3_NEXT
from aiosync.errors import RefitMismatchError
from aiosync.refit import DTensorRefitSource, FP8RefitSource
from aiosync.refit.fp8 import (
    DEFAULT_MODULES_TO_NOT_CONVERT,
    dequantize_fp8_blocks,
    fp8_manifest,
    quantize_fp8_blocks,
)
from aiosync.sources import RefitManifest, RefitSource

FP8 = torch.float8_e4m3fn


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor`` (``torch.equal`` has no float8 kernel)."""
    return tensor.contiguous().view(torch.uint8)


def reference_quantize(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers 5.24's own FP8 quantizer (``Fp8Quantize``, what ``save_pretrained``
    of a ``FineGrainedFP8Config`` model writes)."""
    config = FineGrainedFP8Config(weight_block_size=list(block))
    out = Fp8Quantize(FineGrainedFP8HfQuantizer(config))._quantize_one("m.weight", weight)
    assert set(out) == {"m.weight", "m.weight_scale_inv"}, "transformers left it unquantized"
    return out["m.weight"], out["m.weight_scale_inv"]


def weight_with_hard_blocks(
    shape: tuple[int, int], dtype: torch.dtype, seed: int, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """Random weights whose first block is all zeros, with huge and tiny corners."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=generator) * 0.02
    weight[: block[0], : block[1]] = 0.0
    weight[-8:, -8:] *= 1e4
    weight[:8, -8:] *= 1e-6
    return weight.to(dtype)


def hf_model(config: dict[str, Any], *, device: str = "cpu") -> torch.nn.Module:
    items = dict(config)
    hf_config = AutoConfig.for_model(items.pop("model_type"), **items)
    with torch.device(device):
        model: torch.nn.Module = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    return model


# -- the quantizer --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("shape", "block"), [((256, 384), (128, 128)), ((64, 96), (32, 32)), ((128, 128), (128, 128))]
)
def test_quantizer_is_transformers_fp8_quantize_bit_for_bit(
    shape: tuple[int, int], block: tuple[int, int], dtype: torch.dtype
) -> None:
    weight = weight_with_hard_blocks(shape, dtype, seed=shape[0], block=block)
    quantized, scale_inv = quantize_fp8_blocks(weight, block)
    ref_quantized, ref_scale_inv = reference_quantize(weight, block)
    assert quantized.dtype == FP8 and tuple(quantized.shape) == shape
    assert scale_inv.dtype == torch.float32
    assert tuple(scale_inv.shape) == (shape[0] // block[0], shape[1] // block[1])
    assert torch.equal(bits(quantized), bits(ref_quantized))
    assert torch.equal(scale_inv, ref_scale_inv)
    # The all-zero block keeps scale 1 (transformers' "keep zeros stable").
    assert scale_inv[0, 0].item() == 1.0 and not bits(quantized[: block[0], : block[1]]).any()


@pytest.mark.parametrize(
    ("shape", "grid"), [((300, 200), (3, 2)), ((64, 32), (1, 1)), ((1, 129), (1, 2))]
)
def test_edge_blocks_are_transformers_quantizer_on_the_zero_padded_weight(
    shape: tuple[int, int], grid: tuple[int, int]
) -> None:
    # transformers' quantizer leaves a weight that is not a multiple of the block
    # unquantized; the checkpoints (DeepSeek-V3) and FP8Linear use the ceil grid.
    weight = weight_with_hard_blocks(shape, torch.bfloat16, seed=7)
    assert set(
        Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config()))._quantize_one(
            "m.weight", weight
        )
    ) == {"m.weight"}
    quantized, scale_inv = quantize_fp8_blocks(weight)
    assert (
        tuple(scale_inv.shape)
        == grid
        == tuple(FP8Linear(shape[1], shape[0], (128, 128)).weight_scale_inv.shape)
    )
    padded = torch.zeros(grid[0] * 128, grid[1] * 128, dtype=weight.dtype)
    padded[: shape[0], : shape[1]] = weight
    ref_quantized, ref_scale_inv = reference_quantize(padded, (128, 128))
    assert torch.equal(bits(quantized), bits(ref_quantized[: shape[0], : shape[1]]))
    assert torch.equal(scale_inv, ref_scale_inv)


def test_dequantize_is_what_transformers_loads_bit_for_bit() -> None:
    weight = weight_with_hard_blocks((256, 384), torch.bfloat16, seed=3)
    quantized, scale_inv = quantize_fp8_blocks(weight)
    ours = dequantize_fp8_blocks(quantized, scale_inv)
    # from_pretrained(..., dequantize) of the checkpoint: Fp8Dequantize.
    loaded = Fp8Dequantize(None)._dequantize_one(quantized, scale_inv, output_dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, loaded)
    # Edge blocks: FP8Linear's own dequantization (float32 math, one cast).
    edge = weight_with_hard_blocks((300, 200), torch.bfloat16, seed=4)
    quantized, scale_inv = quantize_fp8_blocks(edge)
    ours = dequantize_fp8_blocks(quantized, scale_inv)
    reference = _dequantize_fp8_weight(quantized, scale_inv, [128, 128], torch.float32)
    assert torch.equal(ours, reference.to(torch.bfloat16))


def test_quantizer_refuses_what_it_cannot_quantize() -> None:
    with pytest.raises(ValueError, match="2-D float"):
        quantize_fp8_blocks(torch.ones(8))
    with pytest.raises(ValueError, match="2-D float"):
        quantize_fp8_blocks(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_fp8_blocks(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="block_size"):
        quantize_fp8_blocks(torch.ones(2, 2), (0, 128))
    quantized, scale_inv = quantize_fp8_blocks(torch.ones(130, 2))
    with pytest.raises(ValueError, match=r"is \(2, 1\), got \(1, 1\)"):
        dequantize_fp8_blocks(quantized, scale_inv[:1])


# -- the source -------------------------------------------------------------------


def test_source_streams_transformers_quantized_tensors_in_manifest_order() -> None:
    torch.manual_seed(0)
    model = hf_model(TINY_QWEN3)
    inner = dict(DTensorRefitSource(model).iter_weights())
    source = FP8RefitSource(DTensorRefitSource(model), block_size=(32, 32))
    manifest = source.prepare_refit_info()
    streamed = list(source.iter_weights())
    assert [(n, (tuple(t.shape), t.dtype)) for n, t in streamed] == list(manifest.items())
    got = dict(streamed)
    quantized = [n for n, (_, dtype) in manifest.items() if dtype == FP8]
    assert quantized == [
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    for name in quantized:
        ref_quantized, ref_scale_inv = reference_quantize(inner[name], (32, 32))
        assert torch.equal(bits(got[name]), bits(ref_quantized)), name
        scale = name.removesuffix(".weight") + ".weight_scale_inv"
        assert list(manifest).index(scale) == list(manifest).index(name) + 1
        assert torch.equal(got[scale], ref_scale_inv), scale
    for name in inner.keys() - set(quantized):
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], inner[name]), name


def test_manifest_is_transformers_fp8_model_state_dict_for_dense_qwen3() -> None:
    source = FP8RefitSource(DTensorRefitSource(hf_model(TINY_QWEN3)), block_size=(32, 32))
    fp8_model = hf_model(TINY_QWEN3, device="meta")
    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=[32, 32]))
    skip = quantizer.get_modules_to_not_convert(fp8_model, None, fp8_model._keep_in_fp32_modules)
    replace_with_fp8_linear(fp8_model, skip, quantizer.quantization_config)
    expected = {n: (tuple(t.shape), t.dtype) for n, t in fp8_model.state_dict().items()}
    assert source.prepare_refit_info() == expected
    assert list(source.prepare_refit_info()) == list(expected)


@pytest.mark.parametrize(
    "config",
    [TINY_QWEN3, TINY_QWEN3_MOE, TINY_QWEN3_NEXT],
    ids=["qwen3", "qwen3_moe", "qwen3_next"],
)
def test_quantized_weights_are_those_transformers_converts(config: dict[str, Any]) -> None:
    # 32 x 32 blocks: most weights are whole blocks, some (Qwen3-Next's 48-row shared
    # expert, the 1-row shared_expert_gate) are not.
    block = (32, 32)
    manifest = FP8RefitSource(
        DTensorRefitSource(hf_model(config)), block_size=block
    ).prepare_refit_info()
    fp8_model = hf_model(config, device="meta")
    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config(weight_block_size=list(block)))
    skip = quantizer.get_modules_to_not_convert(fp8_model, None, fp8_model._keep_in_fp32_modules)
    replace_with_fp8_linear(fp8_model, skip, quantizer.quantization_config)
    modules = dict(fp8_model.named_modules())

    def converted(name: str) -> bool:
        module = name.removesuffix(".weight")
        if ".experts." in module:  # per-expert on disk, one FP8Experts in memory
            return isinstance(modules[module.split(".experts.")[0] + ".experts"], FP8Experts)
        return isinstance(modules.get(module), FP8Linear)

    def quantized_by_transformers(name: str) -> bool:
        """transformers' Fp8Quantize (on load) quantizes it, rather than passing it through."""
        shape = manifest[name][0]
        out = Fp8Quantize(quantizer)._quantize_one(name, torch.ones(shape, dtype=torch.bfloat16))
        return out[name].dtype == FP8

    weights = [n for n in manifest if n.endswith(".weight")]
    ours = {n for n in weights if manifest[n][1] == FP8}
    assert ours == {n for n in weights if converted(n) and quantized_by_transformers(n)}
    assert ours and all(manifest[n][1] == torch.bfloat16 for n in set(weights) - ours)
    for name in ours:
        rows, cols = manifest[name][0]
        assert manifest[name.removesuffix("weight") + "weight_scale_inv"] == (
            (rows // block[0], cols // block[1]),
            torch.float32,
        )
    scales = {n.removesuffix("_scale_inv") for n in manifest if n.endswith("weight_scale_inv")}
    assert scales == ours


class ManifestOnly(RefitSource):
    """A source of zero tensors of a given manifest (optionally lying about it)."""

    def __init__(self, manifest: RefitManifest, *, stream: RefitManifest | None = None) -> None:
        self.manifest = manifest
        self.stream = manifest if stream is None else stream
        self.calls: list[str] = []

    def prepare_refit_info(self) -> RefitManifest:
        return dict(self.manifest)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, (shape, dtype) in self.stream.items():
            yield name, torch.zeros(shape, dtype=dtype)

    def offload_before_refit(self) -> None:
        self.calls.append("before")

    def offload_after_refit(self) -> None:
        self.calls.append("after")


def test_modules_to_not_convert_are_transformers_patterns() -> None:
    f32 = torch.float32
    manifest: RefitManifest = {
        "model.layers.1.mlp.up_proj.weight": ((8, 8), f32),
        "model.layers.11.mlp.up_proj.weight": ((8, 8), f32),
        "model.layers.2.mlp.gate.weight": ((4, 8), f32),
        "model.layers.2.mlp.gate_proj.weight": ((8, 8), f32),
        "model.layers.2.mlp.shared_expert_gate.weight": ((1, 8), f32),
        "model.language_model.embed_tokens_per_layer.weight": ((8, 8), f32),
        "model.layers.2.linear_attn.conv1d.weight": ((8, 1, 4), f32),
        "model.layers.2.q_proj.bias": ((8,), f32),
        "model.layers.2.step": ((8, 8), torch.int64),
    }
    out = fp8_manifest(
        manifest,
        block_size=(1, 8),
        modules_to_not_convert=[*DEFAULT_MODULES_TO_NOT_CONVERT, "model.layers.1"],
    )
    assert [n for n, (_, d) in out.items() if d == FP8] == [
        "model.layers.11.mlp.up_proj.weight",
        "model.layers.2.mlp.gate_proj.weight",
        "model.layers.2.mlp.shared_expert_gate.weight",
    ]
    assert out["model.layers.2.mlp.gate.weight"] == ((4, 8), torch.bfloat16)
    assert out["model.layers.2.step"] == ((8, 8), torch.int64)
    kept = fp8_manifest(manifest, dtype=None)
    assert kept["model.layers.2.q_proj.bias"] == ((8,), f32)


def test_source_forwards_the_hooks_and_names_its_quantization_config() -> None:
    inner = ManifestOnly({"a.weight": ((4, 4), torch.float32)})
    source = FP8RefitSource(inner, block_size=(2, 2))
    source.offload_before_refit()
    source.offload_after_refit()
    assert inner.calls == ["before", "after"]
    assert source.hf_config() is None
    assert source.quantization_config() == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [2, 2],
        "modules_to_not_convert": list(DEFAULT_MODULES_TO_NOT_CONVERT),
    }
    model = hf_model(TINY_QWEN3)
    assert FP8RefitSource(DTensorRefitSource(model)).hf_config() is model.config


def test_source_refuses_what_it_cannot_wrap_or_stream() -> None:
    f32 = torch.float32
    inner = ManifestOnly({"a.weight": ((4, 4), f32)})
    with pytest.raises(TypeError, match="already yields FP8"):
        FP8RefitSource(FP8RefitSource(inner))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="RefitSource"):
        FP8RefitSource(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        FP8RefitSource(inner, block_size=(128,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        FP8RefitSource(inner, dtype=FP8)
    with pytest.raises(RefitMismatchError, match=r"a\.weight is already torch\.float8_e4m3fn"):
        FP8RefitSource(ManifestOnly({"a.weight": ((4, 4), FP8)})).prepare_refit_info()
    clash = ManifestOnly({"a.weight": ((4, 4), f32), "a.weight_scale_inv": ((1, 1), f32)})
    with pytest.raises(RefitMismatchError, match=r"a\.weight_scale_inv is already"):
        FP8RefitSource(clash, block_size=(2, 2)).prepare_refit_info()
    liar = ManifestOnly({"a.weight": ((4, 4), f32)}, stream={"a.weight": ((4, 5), f32)})
    with pytest.raises(RefitMismatchError, match=r"yielded a\.weight \(4, 5\)"):
        list(FP8RefitSource(liar).iter_weights())
    short = ManifestOnly(
        {"a.weight": ((4, 4), f32), "b.weight": ((4, 4), f32)}, stream={"a.weight": ((4, 4), f32)}
    )
    with pytest.raises(RefitMismatchError, match=r"stopped before b\.weight"):
        list(FP8RefitSource(short).iter_weights())


def test_a_non_finite_weight_is_refused_by_name() -> None:
    class Broken(ManifestOnly):
        def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield "a.weight", torch.full((4, 4), float("nan"))

    with pytest.raises(ValueError, match=r"a\.weight: FP8 quantization of a weight holding inf"):
        broken = Broken({"a.weight": ((4, 4), torch.float32)})
        list(FP8RefitSource(broken, block_size=(2, 2)).iter_weights())


# -- case C45: dims that are not multiples of the block -----------------------------

#: q_proj/o_proj ``[128, 128]`` tile in 128 x 128 blocks; k_proj/v_proj ``[64, 128]``,
#: gate/up ``[192, 128]`` and down ``[128, 192]`` do not.
ODD: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 128,
    "hidden_size": 128,
    "intermediate_size": 192,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
UNTILED = ("self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def transformers_fp8_checkpoint(
    model: torch.nn.Module, folder: Any, monkeypatch: pytest.MonkeyPatch
) -> dict[str, torch.Tensor]:
    """What transformers writes for ``model`` quantized with ``FineGrainedFP8Config()``:
    ``save_pretrained`` (bf16), ``from_pretrained(..., quantization_config=...)`` (its
    ``Fp8Quantize`` on load), ``save_pretrained`` again; the tensors read back.

    transformers quantizes on the fly only with a GPU: its environment check is
    skipped here (the quantizer itself is transformers' own, pure torch on a CPU).
    """
    from safetensors.torch import load_file

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda *a, **k: None)
    model.save_pretrained(folder / "bf16")
    quantized = AutoModelForCausalLM.from_pretrained(
        folder / "bf16", quantization_config=FineGrainedFP8Config(), dtype=torch.bfloat16
    )
    quantized.save_pretrained(folder / "fp8")
    return load_file(str(folder / "fp8" / "model.safetensors"))


def test_a_weight_that_does_not_tile_stays_bf16_as_in_transformers_fp8_checkpoint(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(5)
    model = hf_model(ODD)
    disk = transformers_fp8_checkpoint(model, tmp_path, monkeypatch)
    source = FP8RefitSource(DTensorRefitSource(model))
    manifest = source.prepare_refit_info()
    layer = "model.layers.0"
    assert manifest[f"{layer}.self_attn.q_proj.weight"] == ((128, 128), FP8)
    assert manifest[f"{layer}.self_attn.q_proj.weight_scale_inv"] == ((1, 1), torch.float32)
    for module in UNTILED:
        # transformers' Fp8Quantize leaves it bf16: no FP8 bytes, no scale of its own.
        assert manifest[f"{layer}.{module}.weight"][1] == torch.bfloat16, module
        assert disk[f"{layer}.{module}.weight"].dtype == torch.bfloat16, module
        assert f"{layer}.{module}.weight_scale_inv" not in manifest, module
    streamed = dict(source.iter_weights())
    assert list(streamed) == list(manifest)
    # Every tensor of the refit is the checkpoint's, bit for bit.
    for name, tensor in streamed.items():
        assert disk[name].dtype == tensor.dtype and torch.equal(bits(disk[name]), bits(tensor)), (
            name
        )
    # What the checkpoint holds besides: a weight_scale_inv next to each bf16 weight,
    # uninitialized memory transformers' FP8Linear never reads (its forward takes a
    # weight of more than one byte as it is).
    assert set(disk) - set(streamed) == {f"{layer}.{m}.weight_scale_inv" for m in UNTILED}


def test_the_engine_loads_transformers_fp8_checkpoint_as_the_refit_delivers_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiosync.engines.embedded.model import HFModelRunner

    torch.manual_seed(6)
    model = hf_model(ODD)
    transformers_fp8_checkpoint(model, tmp_path, monkeypatch)
    from_disk = HFModelRunner.from_config(tmp_path / "fp8", dtype="bfloat16", quantization="fp8")
    refit = HFModelRunner.from_config(ODD, seed=9, dtype="bfloat16", quantization="fp8")
    source = FP8RefitSource(DTensorRefitSource(model))
    assert refit.expected_manifest() == from_disk.expected_manifest() == source.prepare_refit_info()
    refit.load_weights(source.iter_weights())
    held, loaded = refit.hf_state_dict(), from_disk.hf_state_dict()
    assert list(held) == list(loaded)
    assert all(torch.equal(bits(held[n]), bits(loaded[n])) for n in held)
    prompts = [[1, 2, 3], [7, 8]]
    tokens = refit.generate(prompts, max_new_tokens=6, ignore_eos=True)
    assert from_disk.generate(prompts, max_new_tokens=6, ignore_eos=True) == tokens
    # The untiled weights compute as the bf16 checkpoint holds them.
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(refit.model.get_parameter(k_proj), model.get_parameter(k_proj))
