"""Round trip and save order over random small configs of every family."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")

from aiosync.refit.nnx import model_map_for  # noqa: E402
from aiosync.refit.nnx.table import flatten_params  # noqa: E402

SETTINGS = settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
S, F = "sliding_attention", "full_attention"
L, FA = "linear_attention", "full_attention"


def _round_trip(models: ModuleType, config: Any, dtype: torch.dtype) -> None:
    from transformers.core_model_loading import revert_weight_conversion

    model = models.build(config, dtype=dtype)
    state = models.checkpoint_state(model)
    model_map = model_map_for(config)
    params = model_map.to_jax(state)
    assert {p: tuple(a.shape) for p, a in flatten_params(params).items()} == model_map.nnx_shapes()
    out = list(model_map.to_hf(params))
    expected_order = [
        k for k in revert_weight_conversion(model, dict(model.state_dict())) if k in state
    ]
    assert [n for n, _ in out] == expected_order
    assert len(out) == len(state)
    for name, tensor in out:
        assert tensor.dtype == state[name].dtype == dtype
        assert models.bytes_of(tensor) == models.bytes_of(state[name]), name


@st.composite
def _attention(draw: st.DrawFn) -> dict[str, int]:
    kv = draw(st.sampled_from([1, 2]))
    return dict(
        num_key_value_heads=kv,
        num_attention_heads=kv * draw(st.sampled_from([1, 2])),
        head_dim=draw(st.sampled_from([8, 16])),
        hidden_size=draw(st.sampled_from([16, 32])),
    )


@SETTINGS
@given(
    attn=_attention(),
    layers=st.integers(1, 3),
    tied=st.booleans(),
    bias=st.booleans(),
    dtype=DTYPES,
)
def test_qwen3_random_configs_round_trip(
    models: ModuleType,
    attn: dict[str, int],
    layers: int,
    tied: bool,
    bias: bool,
    dtype: torch.dtype,
) -> None:
    config = models.qwen3_config(
        vocab_size=32,
        intermediate_size=24,
        num_hidden_layers=layers,
        tie_word_embeddings=tied,
        attention_bias=bias,
        **attn,
    )
    _round_trip(models, config, dtype)


@SETTINGS
@given(
    attn=_attention(),
    layers=st.integers(1, 4),
    experts=st.integers(1, 4),
    step=st.integers(1, 3),
    dense=st.sets(st.integers(0, 3), max_size=2),
    tied=st.booleans(),
    dtype=DTYPES,
)
def test_qwen3_moe_random_configs_round_trip(
    models: ModuleType,
    attn: dict[str, int],
    layers: int,
    experts: int,
    step: int,
    dense: set[int],
    tied: bool,
    dtype: torch.dtype,
) -> None:
    config = models.qwen3_moe_config(
        vocab_size=32,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_experts=experts,
        num_experts_per_tok=1,
        num_hidden_layers=layers,
        decoder_sparse_step=step,
        mlp_only_layers=sorted(d for d in dense if d < layers),
        tie_word_embeddings=tied,
        **attn,
    )
    _round_trip(models, config, dtype)


@SETTINGS
@given(
    attn=_attention(),
    types=st.lists(st.sampled_from([L, FA]), min_size=1, max_size=4),
    nk=st.sampled_from([1, 2]),
    ratio=st.sampled_from([1, 2]),
    dk=st.sampled_from([4, 8]),
    dv=st.sampled_from([4, 6]),
    kernel=st.sampled_from([2, 4]),
    experts=st.integers(1, 3),
    dense=st.sets(st.integers(0, 3), max_size=1),
    dtype=DTYPES,
)
def test_qwen3_next_random_configs_round_trip(
    models: ModuleType,
    attn: dict[str, int],
    types: list[str],
    nk: int,
    ratio: int,
    dk: int,
    dv: int,
    kernel: int,
    experts: int,
    dense: set[int],
    dtype: torch.dtype,
) -> None:
    config = models.qwen3_next_config(
        vocab_size=32,
        intermediate_size=24,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=12,
        num_experts=experts,
        num_experts_per_tok=1,
        num_hidden_layers=len(types),
        layer_types=types,
        mlp_only_layers=sorted(d for d in dense if d < len(types)),
        linear_num_key_heads=nk,
        linear_num_value_heads=nk * ratio,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=kernel,
        **attn,
    )
    _round_trip(models, config, dtype)


@SETTINGS
@given(
    attn=_attention(),
    types=st.lists(st.sampled_from([S, F]), min_size=1, max_size=4),
    shared=st.integers(0, 2),
    k_eq_v=st.booleans(),
    moe=st.booleans(),
    ple=st.sampled_from([0, 4]),
    double_wide=st.booleans(),
    tied=st.booleans(),
    dtype=DTYPES,
)
def test_gemma4_random_configs_round_trip(
    models: ModuleType,
    attn: dict[str, int],
    types: list[str],
    shared: int,
    k_eq_v: bool,
    moe: bool,
    ple: int,
    double_wide: bool,
    tied: bool,
    dtype: torch.dtype,
) -> None:
    types = [*types, F]  # transformers forces the last layer to full attention
    # transformers requires the non-shared layers to contain every layer type.
    assume(shared < len(types) and set(types[: len(types) - shared]) == set(types))
    config = models.gemma4_text_config(
        vocab_size=32,
        intermediate_size=24,
        num_hidden_layers=len(types),
        layer_types=types,
        global_head_dim=2 * attn["head_dim"],
        num_global_key_value_heads=1,
        attention_k_eq_v=k_eq_v,
        enable_moe_block=moe,
        num_experts=3 if moe else None,
        top_k_experts=1 if moe else None,
        moe_intermediate_size=8 if moe else None,
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=32,
        num_kv_shared_layers=shared,
        use_double_wide_mlp=double_wide,
        tie_word_embeddings=tied,
        **attn,
    )
    _round_trip(models, config, dtype)
