"""DTensorRefitSource on plain modules: checkpoint names, dtypes, ties, wrappers, edge tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from aiosync import RefitMismatchError, RefitSource
from aiosync.refit import DTensorRefitSource
from aiosync.transports.packing import group_by_bucket, pack, plan_buckets, unpack

BuildModel = Callable[..., nn.Module]
Checkpoint = Callable[[str], dict[str, torch.Tensor]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: compares any dtype (fp8 included) bit for bit."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_stream_matches(source: DTensorRefitSource, expected: dict[str, torch.Tensor]) -> None:
    manifest = source.prepare_refit_info()
    streamed = list(source.iter_weights())
    assert [n for n, _ in streamed] == list(manifest)
    assert sorted(manifest) == sorted(expected)
    for name, tensor in streamed:
        shape, dtype = manifest[name]
        assert tuple(tensor.shape) == shape == tuple(expected[name].shape), name
        assert tensor.dtype == dtype == expected[name].dtype, name
        assert torch.equal(_bits(tensor), _bits(expected[name])), name


def _through_buckets(
    source: DTensorRefitSource, bucket_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pack the stream into buckets and unpack it again, as every transport does."""
    plan = plan_buckets(source.prepare_refit_info(), bucket_bytes)
    for bucket, group in group_by_bucket(source.iter_weights(), plan):
        buffer = pack(bucket, group).clone()
        yield from ((n, t.clone()) for n, t in unpack(buffer, bucket))


@pytest.mark.parametrize(
    "kind", ["qwen3", "qwen3_tied", "qwen3_moe", "qwen3_next", "gemma4_moe", "gemma4_multimodal"]
)
def test_plain_model_streams_exactly_what_save_pretrained_writes(
    build_model: BuildModel, saved_checkpoint: Checkpoint, kind: str
) -> None:
    source = DTensorRefitSource(build_model(kind))
    assert isinstance(source, RefitSource)
    _assert_stream_matches(source, saved_checkpoint(kind))


def test_manifest_matches_embedded_engine_expected_manifest(build_model: BuildModel) -> None:
    from aiosync.engines.embedded.model import HFModelRunner
    from aiosync.transports.packing import compare_manifests

    for kind in ("qwen3_tied", "qwen3_moe"):
        model = build_model(kind)
        trainer = DTensorRefitSource(model).prepare_refit_info()
        compare_manifests(trainer, HFModelRunner(model).expected_manifest())
        assert list(trainer) == list(HFModelRunner(model).expected_manifest())


def test_gemma4_experts_stay_fused_as_on_disk(build_model: BuildModel) -> None:
    """Gemma 4 checkpoints store experts fused (no conversion): so does the stream."""
    manifest = DTensorRefitSource(build_model("gemma4_multimodal")).prepare_refit_info()
    layer = "model.language_model.layers.0"
    assert manifest[f"{layer}.experts.gate_up_proj"] == ((4, 48, 64), torch.float32)
    assert manifest[f"{layer}.experts.down_proj"] == ((4, 64, 24), torch.float32)
    assert not any(".experts.0." in n for n in manifest)
    assert "lm_head.weight" not in manifest


def test_moe_manifest_has_per_expert_checkpoint_shapes(build_model: BuildModel) -> None:
    manifest = DTensorRefitSource(build_model("qwen3_moe")).prepare_refit_info()
    layer = "model.layers.0.mlp"
    assert manifest[f"{layer}.gate.weight"] == ((4, 64), torch.float32)
    for e in range(4):
        assert manifest[f"{layer}.experts.{e}.gate_proj.weight"] == ((32, 64), torch.float32)
        assert manifest[f"{layer}.experts.{e}.up_proj.weight"] == ((32, 64), torch.float32)
        assert manifest[f"{layer}.experts.{e}.down_proj.weight"] == ((64, 32), torch.float32)
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in manifest)


def test_moe_expert_tensors_are_slices_of_the_fused_parameter(build_model: BuildModel) -> None:
    model = build_model("qwen3_moe")
    experts = model.model.layers[2].mlp.experts
    streamed = dict(DTensorRefitSource(model).iter_weights())
    fused = experts.gate_up_proj.untyped_storage().data_ptr()
    for e in range(4):
        prefix = f"model.layers.2.mlp.experts.{e}"
        # Zero copy: same dtype, so the stream yields views into the fused parameter.
        assert streamed[f"{prefix}.up_proj.weight"].untyped_storage().data_ptr() == fused
        assert torch.equal(streamed[f"{prefix}.gate_proj.weight"], experts.gate_up_proj[e, :32])
        assert torch.equal(streamed[f"{prefix}.up_proj.weight"], experts.gate_up_proj[e, 32:])
        assert torch.equal(streamed[f"{prefix}.down_proj.weight"], experts.down_proj[e])


def test_fp32_master_weights_stream_as_bf16(
    build_model: BuildModel, saved_checkpoint: Checkpoint
) -> None:
    """C8: the cast happens at the source; the bytes are the engine's dtype."""
    source = DTensorRefitSource(build_model("qwen3_moe"), dtype=torch.bfloat16)
    expected = {n: t.to(torch.bfloat16) for n, t in saved_checkpoint("qwen3_moe").items()}
    assert {d for _, d in source.prepare_refit_info().values()} == {torch.bfloat16}
    _assert_stream_matches(source, expected)
    streamed = dict(_through_buckets(source, 64 * 1024))
    assert all(torch.equal(streamed[n], expected[n]) for n in expected)


def test_dtype_mapping_casts_only_the_named_tensors(build_model: BuildModel) -> None:
    source = DTensorRefitSource(build_model("qwen3"), dtype={"model.norm.weight": torch.float16})
    manifest = source.prepare_refit_info()
    assert manifest["model.norm.weight"] == ((64,), torch.float16)
    assert manifest["lm_head.weight"] == ((128, 64), torch.float32)
    streamed = dict(source.iter_weights())
    assert streamed["model.norm.weight"].dtype == torch.float16


def test_tied_lm_head_is_streamed_once_and_untied_is_streamed(build_model: BuildModel) -> None:
    """C9: tied → only ``model.embed_tokens.weight``; untied → both."""
    tied = DTensorRefitSource(build_model("qwen3_tied")).prepare_refit_info()
    untied = DTensorRefitSource(build_model("qwen3")).prepare_refit_info()
    assert "lm_head.weight" not in tied
    assert "model.embed_tokens.weight" in tied
    assert "lm_head.weight" in untied
    assert set(untied) - set(tied) == {"lm_head.weight"}


def _untie_and_perturb(model: Any) -> torch.Tensor:
    """Replace a tied ``lm_head.weight`` by a tensor of its own whose values drifted (C19)."""
    assert model.config.tie_word_embeddings
    head = nn.Parameter(model.model.embed_tokens.weight.detach() + 0.25)
    model.lm_head.weight = head
    return head


def test_broken_tie_streams_the_drifted_head_under_its_own_name(
    build_model: BuildModel, caplog: pytest.LogCaptureFixture
) -> None:
    """C19: the config ties lm_head, the model does not: the head is sent, never dropped."""
    model: Any = build_model("qwen3_tied")
    head = _untie_and_perturb(model)
    source = DTensorRefitSource(model)
    with caplog.at_level("WARNING", logger="aiosync.refit.torch_source"):
        manifest = source.prepare_refit_info()
    assert source.broken_ties == {"lm_head.weight": "model.embed_tokens.weight"}
    assert list(manifest)[-1] == "lm_head.weight"
    assert manifest["lm_head.weight"] == ((128, 64), torch.float32)
    assert [r.getMessage()[:60] for r in caplog.records] == [
        "the config ties lm_head.weight to model.embed_tokens.weight "
    ]
    streamed = dict(source.iter_weights())
    assert list(streamed) == list(manifest)
    assert torch.equal(streamed["lm_head.weight"], head)
    assert torch.equal(streamed["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert not torch.equal(streamed["lm_head.weight"], streamed["model.embed_tokens.weight"])


def test_broken_tie_into_a_tied_engine_is_a_mismatch_that_names_the_tie(
    build_model: BuildModel,
) -> None:
    from aiosync.engines.embedded.model import HFModelRunner
    from aiosync.transports.packing import compare_manifests

    model = build_model("qwen3_tied")
    tied_model: Any = build_model("qwen3_tied", seed=1)
    untied_model: Any = build_model("qwen3", seed=1)
    engine = HFModelRunner(tied_model).expected_manifest()
    untied_engine = HFModelRunner(untied_model).expected_manifest()
    _untie_and_perturb(model)
    trainer = DTensorRefitSource(model).prepare_refit_info()
    with pytest.raises(RefitMismatchError) as info:
        compare_manifests(trainer, engine)
    message = str(info.value)
    assert "unknown to the engine, first: ['lm_head.weight']" in message
    assert "the tie is broken" in message
    assert "model.tie_weights()" in message and "tie_word_embeddings=False" in message
    compare_manifests(trainer, untied_engine)  # an engine with its own head takes it


def test_real_ties_are_dropped_by_identity_zero_size_included(build_model: BuildModel) -> None:
    tied = DTensorRefitSource(build_model("qwen3_tied"))
    assert "lm_head.weight" not in tied.prepare_refit_info()
    assert tied.broken_ties == {}
    # A zero-size embedding has no storage to compare: only the object tells the tie.
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from aiosync.engines.embedded.configs import TINY_QWEN3_TIED

    config = {k: v for k, v in TINY_QWEN3_TIED.items() if k != "model_type"}
    empty = Qwen3ForCausalLM(Qwen3Config(**{**config, "vocab_size": 0}))
    assert empty.lm_head.weight is empty.model.embed_tokens.weight
    source = DTensorRefitSource(empty)
    manifest = source.prepare_refit_info()
    assert "lm_head.weight" not in manifest
    assert manifest["model.embed_tokens.weight"] == ((0, 64), torch.float32)
    assert source.broken_ties == {}


class _DDPLike(nn.Module):
    """Holds the model under ``module`` (as DDP does): keys gain ``module.``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


class _FSDP1Like(nn.Module):
    """Holds the model under ``_fsdp_wrapped_module`` (as FSDP1 does)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._fsdp_wrapped_module = module


def test_wrapper_prefixes_are_stripped(
    build_model: BuildModel, saved_checkpoint: Checkpoint
) -> None:
    wrapped = torch.compile(_DDPLike(_FSDP1Like(build_model("qwen3_moe"))))
    keys = list(wrapped.state_dict())
    assert keys[0].startswith("_orig_mod.module._fsdp_wrapped_module.")
    _assert_stream_matches(DTensorRefitSource(wrapped), saved_checkpoint("qwen3_moe"))


def test_oversized_embedding_travels_alone_bit_exact() -> None:
    """C1: an embedding larger than the bucket gets its own buffer; the refit is exact."""
    model = nn.Module()
    model.embed = nn.Embedding(1000, 64)  # 256,000 bytes
    model.norm = nn.LayerNorm(64)
    model.head = nn.Linear(64, 8)
    source = DTensorRefitSource(model)
    bucket_bytes = 64 * 1024
    plan = plan_buckets(source.prepare_refit_info(), bucket_bytes)
    oversized = [b for b in plan.buckets if b.nbytes > bucket_bytes]
    assert [[s.name for s in b.slots] for b in oversized] == [["embed.weight"]]
    assert oversized[0].nbytes == 1000 * 64 * 4
    streamed = dict(_through_buckets(source, bucket_bytes))
    assert list(streamed) == list(source.prepare_refit_info())
    for name, tensor in model.state_dict().items():
        assert torch.equal(streamed[name], tensor), name


def test_model_without_weights_has_an_empty_manifest() -> None:
    source = DTensorRefitSource(nn.Sequential(nn.ReLU(), nn.Dropout()))
    assert source.prepare_refit_info() == {}
    assert list(source.iter_weights()) == []
    plan = plan_buckets({}, 1024)
    assert plan.buckets == ()
    assert plan.max_bucket_nbytes == 0


class _EdgeTensors(nn.Module):
    """A 0-d parameter, a 0-d buffer, a non-contiguous parameter, an empty one, and
    one parameter or buffer per weight dtype."""

    DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8)

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.scalar = nn.Parameter(torch.tensor(2.5))
        self.register_buffer("step", torch.tensor(7, dtype=torch.int64))
        self.transposed = nn.Parameter(torch.randn(6, 10, generator=g).t())  # non-contiguous
        self.empty = nn.Parameter(torch.empty(0, 4))
        for dtype in self.DTYPES:
            name = f"w_{str(dtype).removeprefix('torch.')}"
            if dtype.is_floating_point:
                data = torch.randn(3, 5, generator=g).to(dtype)
                self.register_parameter(name, nn.Parameter(data, requires_grad=False))
            else:
                self.register_buffer(name, torch.randint(-128, 128, (3, 5), generator=g).to(dtype))


def test_edge_tensors_stream_bit_exact_through_buckets() -> None:
    model = _EdgeTensors()
    assert not model.transposed.is_contiguous()
    source = DTensorRefitSource(model)
    manifest = source.prepare_refit_info()
    assert manifest["scalar"] == ((), torch.float32)
    assert manifest["step"] == ((), torch.int64)
    assert manifest["transposed"] == ((10, 6), torch.float32)
    assert manifest["empty"] == ((0, 4), torch.float32)
    for dtype in _EdgeTensors.DTYPES:
        assert manifest[f"w_{str(dtype).removeprefix('torch.')}"] == ((3, 5), dtype)
    expected = model.state_dict()
    _assert_stream_matches(source, dict(expected))
    for bucket_bytes in (1, 100, 1 << 20):
        streamed = dict(_through_buckets(source, bucket_bytes))
        assert list(streamed) == list(manifest)
        for name, tensor in expected.items():
            assert streamed[name].dtype == tensor.dtype, name
            assert torch.equal(_bits(streamed[name]), _bits(tensor)), name


def test_bf16_cast_leaves_integer_tensors_alone() -> None:
    manifest = DTensorRefitSource(_EdgeTensors(), dtype=torch.bfloat16).prepare_refit_info()
    assert manifest["step"] == ((), torch.int64)
    assert manifest["w_int8"] == ((3, 5), torch.int8)
    assert manifest["w_float8_e4m3fn"] == ((3, 5), torch.bfloat16)
    assert manifest["scalar"] == ((), torch.bfloat16)


class _RenamingAdapter:
    """A torchtitan-style adapter: ``to_hf`` renames ``layers.N`` → ``model.layers.N``."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.calls.append(list(state_dict))
        return {f"model.{k}": v for k, v in state_dict.items()}


def test_state_dict_adapter_is_applied_one_tensor_at_a_time() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(4, 4, bias=False) for _ in range(2)])
    adapter = _RenamingAdapter()
    source = DTensorRefitSource(model, state_dict_adapter=adapter)
    assert list(source.prepare_refit_info()) == ["model.layers.0.weight", "model.layers.1.weight"]
    adapter.calls.clear()
    streamed = dict(source.iter_weights())
    assert torch.equal(streamed["model.layers.1.weight"], model.layers[1].weight)
    assert adapter.calls == [["layers.0.weight"], ["layers.1.weight"]]


def test_bad_arguments_raise_type_errors() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        DTensorRefitSource({"a": torch.zeros(1)})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        DTensorRefitSource(nn.Linear(2, 2), dtype="bfloat16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="to_hf"):
        DTensorRefitSource(nn.Linear(2, 2), state_dict_adapter=object())


def test_model_changed_after_manifest_raises_mismatch() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    source = DTensorRefitSource(model)
    source.prepare_refit_info()
    del model[1]
    with pytest.raises(RefitMismatchError, match=r"1\.weight"):
        list(source.iter_weights())


def test_manifest_cost_per_tensor_does_not_grow_with_the_model(
    build_model: BuildModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """C10: the conversion mapping (a walk over every submodule) is derived a fixed
    number of times per plan, not once per tensor."""
    import transformers.conversion_mapping as conversion_mapping

    real = conversion_mapping.get_model_conversion_mapping
    calls: list[int] = []

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", counting)
    source = DTensorRefitSource(build_model("qwen3_moe"))
    manifest = source.prepare_refit_info()
    # embed + 3 MoE layers x (8 attention/norm + router + 4 experts x 3) + 1 dense layer x 11
    # + final norm + lm_head
    assert len(manifest) == 1 + 3 * 21 + 11 + 1 + 1
    streamed = sum(1 for _ in source.iter_weights())
    assert streamed == len(manifest)
    assert len(calls) <= 2
