"""Every transform is exactly invertible, and its shape functions agree with its data path."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from aiosync.refit.nnx.transforms import (
    Concat,
    Reshape,
    Stack,
    Transform,
    Transpose,
    Unstack,
    apply_forward,
    apply_inverse,
    forward_shapes,
)

# (transform, input shapes): one case per kind of step the tables use.
CASES: list[tuple[str, Transform, list[tuple[int, ...]]]] = [
    ("transpose_linear", Transpose((1, 0)), [(6, 4)]),
    ("transpose_conv", Transpose((2, 1, 0)), [(10, 1, 4)]),
    ("transpose_experts", Transpose((0, 2, 1)), [(3, 8, 5)]),
    ("reshape_heads", Reshape((8, 12), (8, 3, 4)), [(8, 12)]),
    ("reshape_interleave", Reshape((16, 4), (2, 2, 4, 4)), [(16, 4)]),
    ("stack_experts", Stack(0), [(5, 4)] * 3),
    ("stack_axis1", Stack(1), [(2, 3)] * 4),
    ("unstack", Unstack(1), [(2, 3, 4)]),
    ("concat_gate_up", Concat(0, (3, 5)), [(3, 4), (5, 4)]),
    ("elementwise_on_many", Transpose((1, 0)), [(2, 3), (2, 3)]),
]


@pytest.mark.parametrize(("transform", "shapes"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inverse_of_forward_is_identity(
    transform: Transform, shapes: list[tuple[int, ...]], dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    ys = transform.forward(xs)
    assert [tuple(y.shape) for y in ys] == transform.forward_shapes(shapes)
    back = transform.inverse(ys)
    assert len(back) == len(xs)
    for x, b in zip(xs, back, strict=True):
        assert b.dtype == x.dtype
        assert torch.equal(b, x)
    assert transform.inverse_shapes(transform.forward_shapes(shapes)) == [tuple(s) for s in shapes]


def test_chain_inverse_runs_steps_in_reverse_order() -> None:
    # Qwen3-Next gated q_proj: [2*N*D, H] -> q (H, N, D) and gate (H, N, D).
    n, d, h = 3, 4, 5
    chain = (Reshape((2 * n * d, h), (n, 2, d, h)), Unstack(1), Transpose((2, 0, 1)))
    w = torch.arange(2 * n * d * h, dtype=torch.float32).reshape(2 * n * d, h)
    q, gate = apply_forward(chain, [w])
    assert forward_shapes(chain, [(2 * n * d, h)]) == [(h, n, d), (h, n, d)]
    # Per head: D query rows, then D gate rows.
    assert torch.equal(q[:, 1, :], w[2 * d : 3 * d].T)
    assert torch.equal(gate[:, 1, :], w[3 * d : 4 * d].T)
    (back,) = apply_inverse(chain, [q, gate])
    assert torch.equal(back, w)


@pytest.mark.parametrize(
    ("transform", "shapes"),
    [
        (Transpose((1, 0)), [(2, 3, 4)]),
        (Reshape((8, 12), (8, 3, 4)), [(8, 13)]),
        (Stack(0), [(2, 3), (2, 4)]),
        (Concat(0, (3, 5)), [(3, 4), (4, 4)]),
    ],
    ids=["transpose_rank", "reshape_shape", "stack_unequal", "concat_sizes"],
)
def test_transform_rejects_shapes_it_cannot_invert(
    transform: Transform, shapes: list[tuple[int, ...]]
) -> None:
    with pytest.raises(ValueError):
        transform.forward_shapes(shapes)


def test_transform_definitions_that_cannot_be_inverted_are_rejected() -> None:
    with pytest.raises(ValueError, match="not a permutation"):
        Transpose((0, 0))
    with pytest.raises(ValueError, match="changes the size"):
        Reshape((4, 4), (4, 5))


@pytest.mark.parametrize(
    "builder",
    [
        "qwen3_config",
        "qwen3_moe_config",
        "qwen3_next_config",
        "gemma4_text_config",
        "gemma4_e2b_config",
    ],
)
def test_every_rule_of_every_table_inverts_exactly(models: ModuleType, builder: str) -> None:
    from aiosync.refit.nnx import model_map_for

    model_map = model_map_for(getattr(models, builder)(attention_bias=False).to_dict())
    gen = torch.Generator().manual_seed(0)
    for rule in model_map.rules:
        xs = [torch.randn(s, generator=gen) for s in rule.hf_shapes]
        ys = apply_forward(rule.chain, xs)
        assert [tuple(y.shape) for y in ys] == list(rule.nnx_shapes), rule.hf[0]
        back = apply_inverse(rule.chain, ys)
        assert all(torch.equal(b, x) for b, x in zip(back, xs, strict=True)), rule.hf[0]
