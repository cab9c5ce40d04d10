"""``NNXRefitSource`` honours the ``RefitSource`` contract: ordered manifest, streamed tensors."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
nnx = pytest.importorskip("flax.nnx")

from aiosync.refit.nnx import NNXRefitSource, model_map_for  # noqa: E402
from aiosync.refit.nnx.convert import jax_to_torch, torch_to_numpy  # noqa: E402
from aiosync.sources import RefitSource  # noqa: E402


def test_source_is_a_refit_source_with_manifest_in_stream_order(
    moe: tuple[Any, dict[str, torch.Tensor]], models: ModuleType
) -> None:
    config, state = moe
    model_map = model_map_for(config)
    source = NNXRefitSource(model_map.to_jax(state), model_map)
    assert isinstance(source, RefitSource)
    manifest = source.prepare_refit_info()
    streamed = list(source.iter_weights())
    assert [n for n, _ in streamed] == list(manifest)
    # embed, norm, lm_head; per layer 6 attention + 2 norms; 3 sparse layers with a
    # router and 3 x 4 per-expert weights, 1 dense layer (mlp_only_layers=[1]).
    assert len(manifest) == len(state) == 3 + 3 * (8 + 1 + 3 * 4) + (8 + 3)
    for name, tensor in streamed:
        assert manifest[name] == (tuple(tensor.shape), tensor.dtype)
        assert models.bytes_of(tensor) == models.bytes_of(state[name])
    source.offload_before_refit()
    source.offload_after_refit()


def test_fp32_master_weights_stream_as_the_engine_dtype(
    moe: tuple[Any, dict[str, torch.Tensor]],
) -> None:
    # Case C8: fp32 trainer, bf16 engine: the cast happens in the source, per tensor.
    config, state = moe
    model_map = model_map_for(config)
    source = NNXRefitSource(model_map.to_jax(state), model_map, dtype=torch.bfloat16)
    manifest = source.prepare_refit_info()
    assert {dtype for _, dtype in manifest.values()} == {torch.bfloat16}
    for name, tensor in source.iter_weights():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name


def test_tied_embeddings_send_no_lm_head(models: ModuleType) -> None:
    # Case C9: lm_head.weight is neither sent twice nor expected by a tied engine.
    config = models.qwen3_config(tie_word_embeddings=True)
    state = models.checkpoint_state(models.build(config))
    model_map = model_map_for(config)
    manifest = NNXRefitSource(model_map.to_jax(state), model_map).prepare_refit_info()
    assert "lm_head.weight" not in manifest
    assert list(manifest).count("model.embed_tokens.weight") == 1


def test_module_source_sees_in_place_updates_and_dict_source_takes_new_state(
    models: ModuleType, nnx_qwen3: ModuleType
) -> None:
    config = models.qwen3_config()
    model_map = model_map_for(config)
    module = nnx_qwen3.NNXQwen3(config, nnx.Rngs(0))
    source = NNXRefitSource(module, model_map)
    before = dict(source.iter_weights())["model.norm.weight"].clone()
    module.final_norm.w[...] = module.final_norm.w[...] + 1.0  # an optimizer step, in place
    after = dict(source.iter_weights())["model.norm.weight"]
    assert torch.equal(after, before + 1.0)

    params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    dict_source = NNXRefitSource(params, model_map)
    new = jax.tree_util.tree_map(lambda a: a * 2, params)
    dict_source.update_state(new)
    got = dict(dict_source.iter_weights())["model.norm.weight"]
    assert torch.equal(got, after * 2)


def test_untransformed_cpu_tensors_are_zero_copy_views_of_the_jax_buffers(
    moe_params: tuple[Any, Any],
) -> None:
    model_map, params = moe_params
    weights = dict(model_map.to_hf(params))
    norm = params["final_norm"]["w"]
    assert weights["model.norm.weight"].data_ptr() == np.asarray(norm).ctypes.data
    # A transposed kernel is materialised into its own contiguous tensor.
    kernel = params["layers"][0]["mlp"]["router"]["kernel"]
    assert weights["model.layers.0.mlp.gate.weight"].data_ptr() != np.asarray(kernel).ctypes.data


def test_bf16_crosses_jax_numpy_torch_by_bit_view() -> None:
    # Every bf16 bit pattern, NaN payloads and -0.0 included, survives both directions.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    t = bits.view(torch.bfloat16)
    arr = jnp.asarray(torch_to_numpy(t))
    assert str(arr.dtype) == "bfloat16"
    back = jax_to_torch(arr)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.view(torch.int16), bits)


def test_loader_accepts_numpy_checkpoints_including_ml_dtypes_bf16(
    moe: tuple[Any, dict[str, torch.Tensor]], models: ModuleType
) -> None:
    config, state = moe
    as_numpy = {k: torch_to_numpy(v.to(torch.bfloat16)) for k, v in state.items()}
    model_map = model_map_for(config)
    out = dict(model_map.to_hf(model_map.to_jax(as_numpy)))
    for name, tensor in out.items():
        assert models.bytes_of(tensor) == models.bytes_of(state[name].to(torch.bfloat16)), name


def test_sharded_jax_arrays_are_gathered_per_tensor() -> None:
    # One CPU device here: a single-device sharding still goes through the same path.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    arr = jax.device_put(jnp.arange(8, dtype=jnp.float32).reshape(4, 2), spec)
    assert torch.equal(jax_to_torch(arr), torch.arange(8, dtype=torch.float32).reshape(4, 2))


def test_strided_view_stream_has_the_same_values_without_the_copies(
    moe: tuple[Any, dict[str, torch.Tensor]],
) -> None:
    config, state = moe
    model_map = model_map_for(config)
    params = model_map.to_jax(state)
    views = NNXRefitSource(params, model_map, contiguous=False)
    assert views.prepare_refit_info() == NNXRefitSource(params, model_map).prepare_refit_info()
    strided = 0
    for name, tensor in views.iter_weights():
        assert torch.equal(tensor, state[name]), name
        strided += not tensor.is_contiguous()
    # Every transposed kernel and unstacked expert comes as a view of the JAX buffer.
    assert strided >= 3 * 3 * 4


def test_engine_dtype_casts_floating_point_only() -> None:
    from aiosync.refit.nnx.table import ModelMap, copy

    model_map = ModelMap("toy", [copy("a.weight", ("a",), (3,)), copy("steps", ("steps",), (2,))])
    params = {"a": jnp.ones(3, jnp.float32), "steps": jnp.arange(2, dtype=jnp.int32)}
    source = NNXRefitSource(params, model_map, dtype=torch.bfloat16)
    assert source.prepare_refit_info() == {
        "a.weight": ((3,), torch.bfloat16),
        "steps": ((2,), torch.int32),
    }
    out = dict(source.iter_weights())
    assert out["a.weight"].dtype == torch.bfloat16
    assert torch.equal(out["steps"], torch.arange(2, dtype=torch.int32))
