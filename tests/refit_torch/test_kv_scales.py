"""FP8 KV-cache scales become vLLM's 0-d float32 ``self_attn.{k,v}_scale`` tensors."""

from __future__ import annotations

import pytest
import torch

from aiosync.refit import kv_scales_to_tensors


def test_layer_indices_set_both_scales_as_0d_float32() -> None:
    out = kv_scales_to_tensors({1: 0.5, 0: 2.0})
    assert [n for n, _ in out] == [
        "model.layers.0.self_attn.k_scale",
        "model.layers.0.self_attn.v_scale",
        "model.layers.1.self_attn.k_scale",
        "model.layers.1.self_attn.v_scale",
    ]
    for _, t in out:
        assert t.shape == ()
        assert t.dtype == torch.float32
    assert [t.item() for _, t in out] == [2.0, 2.0, 0.5, 0.5]


def test_full_names_set_one_scale_each() -> None:
    out = kv_scales_to_tensors(
        {"model.layers.3.self_attn.v_scale": 0.25, "model.layers.3.self_attn.k_scale": 0.125},
        num_layers=4,
    )
    assert [(n, t.item()) for n, t in out] == [
        ("model.layers.3.self_attn.k_scale", 0.125),
        ("model.layers.3.self_attn.v_scale", 0.25),
    ]


def test_empty_scales_give_no_tensors() -> None:
    assert kv_scales_to_tensors({}) == []


@pytest.mark.parametrize(
    ("scales", "message"),
    [
        ({"layers.0.k_scale": 1.0}, "neither a layer index"),
        ({"model.layers.0.self_attn.q_scale": 1.0}, "neither a layer index"),
        ({"0": 1.0}, "neither a layer index"),
        ({-1: 1.0}, ">= 0"),
        ({4: 1.0}, "out of range"),
        ({"model.layers.9.self_attn.k_scale": 1.0}, "out of range"),
        ({0: 1.0, "model.layers.0.self_attn.v_scale": 2.0}, "twice"),
        ({0: 0.0}, "finite and > 0"),
        ({0: float("nan")}, "finite and > 0"),
    ],
)
def test_bad_keys_and_values_raise_value_error(scales: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        kv_scales_to_tensors(scales, num_layers=4)


def test_non_numeric_or_bool_raise_type_error() -> None:
    with pytest.raises(TypeError):
        kv_scales_to_tensors({True: 1.0})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        kv_scales_to_tensors({0: "1.0"})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        kv_scales_to_tensors({(0,): 1.0})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="must be a mapping, got list"):
        kv_scales_to_tensors([1.0])  # type: ignore[arg-type]
