"""The JAX layout is what the model computes with: an NNX Qwen3 loaded through the map
matches transformers' logits, and transformers on the refit weights matches it back."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

from aiosync.refit.nnx import NNXRefitSource, model_map_for  # noqa: E402
from aiosync.refit.nnx.table import flatten_params  # noqa: E402

IDS = [[3, 17, 99, 4, 64, 1, 127, 8, 42, 5], [0, 9, 9, 100, 31, 2, 77, 6, 15, 120]]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_nnx_qwen3_on_loaded_weights_matches_transformers_and_refits_back(
    models: ModuleType, nnx_qwen3: ModuleType, tied: bool
) -> None:
    config = models.qwen3_config(tie_word_embeddings=tied)
    hf_model = models.build(config, seed=1)
    state = models.checkpoint_state(hf_model)
    model_map = model_map_for(config)

    # The map's NNX layout is exactly the NNX model's parameter structure.
    jax_model = nnx_qwen3.NNXQwen3(config, nnx.Rngs(0))
    model_params = nnx.state(jax_model, nnx.Param)
    expected = {p: tuple(a.shape) for p, a in flatten_params(model_params).items()}
    assert expected == model_map.nnx_shapes()

    nnx.replace_by_pure_dict(model_params, model_map.to_jax(state))
    nnx.update(jax_model, model_params)

    ids = torch.tensor(IDS)
    with torch.no_grad():
        ref = hf_model(input_ids=ids).logits
    got = np.asarray(jax_model(jax.numpy.asarray(IDS)))
    scale = float(np.abs(ref.numpy()).max())
    assert scale > 0.1  # so the tolerance below is tight relative to the logits
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-4 * scale)

    # Control: the same weights with two query heads swapped do not match, so the
    # comparison above can tell a layout from a permutation of it.
    q = model_params["layers"][0]["attn"]["q_proj"]["w"]
    swapped = q[...][:, [1, 0, 2, 3], :]
    original = q[...]
    q[...] = swapped
    nnx.update(jax_model, model_params)
    wrong = np.asarray(jax_model(jax.numpy.asarray(IDS)))
    assert np.abs(wrong - ref.numpy()).max() > 100 * 1e-4 * scale
    q[...] = original
    nnx.update(jax_model, model_params)

    # Refit from the NNX model into a differently initialised transformers model.
    engine = models.build(config, seed=2)
    weights = dict(NNXRefitSource(jax_model, model_map).iter_weights())
    result = engine.load_state_dict(weights, strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == (["lm_head.weight"] if tied else [])
    with torch.no_grad():
        refit_logits = engine(input_ids=ids).logits
    assert torch.equal(refit_logits, ref)
    np.testing.assert_allclose(refit_logits.numpy(), got, rtol=1e-4, atol=1e-4)
