"""The JAX seam and the torch seam give the engine the same manifest and the same bytes."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

jax = pytest.importorskip("jax")

from aiosync.refit import DTensorRefitSource  # noqa: E402
from aiosync.refit.nnx import NNXRefitSource, model_map_for  # noqa: E402

BUILDERS = [
    "qwen3_config",
    "qwen3_moe_config",
    "qwen3_next_config",
    "gemma4_text_config",
    "gemma4_e2b_config",
    "gemma4_config",
]


@pytest.mark.parametrize("builder", BUILDERS)
def test_nnx_source_matches_torch_source_name_for_name_in_order(
    models: ModuleType, builder: str
) -> None:
    config = getattr(models, builder)()
    hf_model = models.build(config)
    torch_source = DTensorRefitSource(hf_model, dtype=torch.bfloat16)
    model_map = model_map_for(config)
    nnx_source = NNXRefitSource(
        model_map.to_jax(models.checkpoint_state(hf_model)), model_map, dtype=torch.bfloat16
    )
    manifest = nnx_source.prepare_refit_info()
    assert manifest == torch_source.prepare_refit_info()
    assert list(manifest) == list(torch_source.prepare_refit_info())
    for (name, ours), (their_name, theirs) in zip(
        nnx_source.iter_weights(), torch_source.iter_weights(), strict=True
    ):
        assert name == their_name
        assert models.bytes_of(ours) == models.bytes_of(theirs), name
