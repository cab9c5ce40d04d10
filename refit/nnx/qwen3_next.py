"""Qwen3-Next: hybrid gated-DeltaNet / gated full attention, MoE with a shared expert.

Schedule: ``layer_types`` (5.24 saves it), else ``"full_attention"`` when
``(l + 1) % full_attention_interval == 0`` (default 4), ``"linear_attention"``
otherwise. MoE layers are those of :func:`aiosync.refit.nnx.qwen3_moe.is_sparse_layer`.

Full-attention layer (N heads, K kv heads, D head_dim). The HF ``q_proj`` is
**per-head interleaved**: for each head, D query rows then D gate rows
(``view(N, 2D).chunk(2)``); the JAX side splits it::

    …self_attn.q_proj.weight   [2*N*D, H]  layers/l/attn/q_proj/w (H, N, D)
                                           + layers/l/attn/q_gate/w (H, N, D)
    …self_attn.{k,v}_proj.weight [K*D, H]  layers/l/attn/{k,v}_proj/w (H, K, D)
    …self_attn.o_proj.weight   [H, N*D]    layers/l/attn/o_proj/w (N, D, H)
    …self_attn.{q,k}_norm.weight [D]       layers/l/attn/{q,k}_norm/w

Linear-attention layer (nk/nv key/value heads, dk/dv head dims, kernel k;
C = 2*nk*dk + nv*dv; fused projections kept fused, as maxtext does)::

    …linear_attn.conv1d.weight       [C, 1, k]              …/linear_attn/conv1d/kernel (k, 1, C)
    …linear_attn.in_proj_qkvz.weight [2*nk*dk + 2*nv*dv, H] …/in_proj_qkvz/kernel (H, ·)
    …linear_attn.in_proj_ba.weight   [2*nv, H]              …/in_proj_ba/kernel (H, 2*nv)
    …linear_attn.dt_bias / A_log     [nv]                   …/dt_bias, …/A_log
    …linear_attn.norm.weight         [dv]                   …/norm/w
    …linear_attn.out_proj.weight     [H, nv*dv]             …/out_proj/kernel (nv*dv, H)

MoE layer: router and stacked experts as Qwen3-MoE, plus
``mlp.shared_expert.{gate,up,down}_proj.weight`` (S = shared_expert_intermediate_size)
→ ``mlp/shared_expert/*/kernel`` and ``mlp.shared_expert_gate.weight [1, H]``
→ ``mlp/shared_expert_gate/kernel (H, 1)``.

Norm weights are copied unchanged: HF stores them zero-centred (the forward
uses ``1 + w``) and so does this layout. The checkpoint's ``mtp.*`` tensors
(multi-token prediction) are ignored by the loader and never refit; vLLM
skips them too.
"""

from __future__ import annotations

from typing import Any

from ._config import ConfigView
from .qwen3 import dense_mlp_rules, embedding_rules, head_rules, layer_norm_rules
from .qwen3_moe import is_sparse_layer, moe_rules
from .table import ModelMap, NNXPath, Rule, copy, heads_in, heads_out, linear
from .transforms import Reshape, Transpose, Unstack

__all__ = ["layer_types", "qwen3_next_map"]

_LAYER_TYPES = ("linear_attention", "full_attention")


def layer_types(cfg: ConfigView) -> list[str]:
    """Each layer's attention kind (``"linear_attention"`` / ``"full_attention"``).

    Raises:
        ValueError: ``layer_types`` has the wrong length or an unknown kind.
    """
    n_layers = cfg.int("num_hidden_layers")
    types = cfg.get("layer_types", default=None)
    if types is None:
        interval = cfg.int("full_attention_interval", default=4)
        return [_LAYER_TYPES[(i + 1) % interval == 0] for i in range(n_layers)]
    types = list(types)
    if len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(
            f"qwen3_next: layer_types must be {n_layers} of {_LAYER_TYPES}, got {types}"
        )
    return types


def _gated_attention_rules(cfg: ConfigView, hf: str, nnx: NNXPath) -> list[Rule]:
    h = cfg.int("hidden_size")
    n = cfg.int("num_attention_heads")
    k = cfg.int("num_key_value_heads", default=n)
    d = cfg.int("head_dim", default=h // n)
    q_and_gate = Rule(
        (f"{hf}q_proj.weight",),
        ((*nnx, "q_proj", "w"), (*nnx, "q_gate", "w")),
        ((2 * n * d, h),),
        (Reshape((2 * n * d, h), (n, 2, d, h)), Unstack(1), Transpose((2, 0, 1))),
    )
    return [
        q_and_gate,
        heads_in(f"{hf}k_proj.weight", (*nnx, "k_proj", "w"), k, d, h),
        heads_in(f"{hf}v_proj.weight", (*nnx, "v_proj", "w"), k, d, h),
        heads_out(f"{hf}o_proj.weight", (*nnx, "o_proj", "w"), n, d, h),
        copy(f"{hf}q_norm.weight", (*nnx, "q_norm", "w"), (d,)),
        copy(f"{hf}k_norm.weight", (*nnx, "k_norm", "w"), (d,)),
    ]


def _linear_attention_rules(cfg: ConfigView, hf: str, nnx: NNXPath) -> list[Rule]:
    h = cfg.int("hidden_size")
    nk, nv = cfg.int("linear_num_key_heads"), cfg.int("linear_num_value_heads")
    dk, dv = cfg.int("linear_key_head_dim"), cfg.int("linear_value_head_dim")
    kernel = cfg.int("linear_conv_kernel_dim")
    key_dim, value_dim = nk * dk, nv * dv
    conv_dim = 2 * key_dim + value_dim
    return [
        Rule(
            (f"{hf}conv1d.weight",),
            ((*nnx, "conv1d", "kernel"),),
            ((conv_dim, 1, kernel),),
            (Transpose((2, 1, 0)),),
        ),
        linear(
            f"{hf}in_proj_qkvz.weight",
            (*nnx, "in_proj_qkvz", "kernel"),
            2 * key_dim + 2 * value_dim,
            h,
        ),
        linear(f"{hf}in_proj_ba.weight", (*nnx, "in_proj_ba", "kernel"), 2 * nv, h),
        copy(f"{hf}dt_bias", (*nnx, "dt_bias"), (nv,)),
        copy(f"{hf}A_log", (*nnx, "A_log"), (nv,)),
        copy(f"{hf}norm.weight", (*nnx, "norm", "w"), (dv,)),
        linear(f"{hf}out_proj.weight", (*nnx, "out_proj", "kernel"), h, value_dim),
    ]


def _shared_expert_rules(cfg: ConfigView, hf: str, nnx: NNXPath) -> list[Rule]:
    h, s = cfg.int("hidden_size"), cfg.int("shared_expert_intermediate_size")
    return [
        *dense_mlp_rules(f"{hf}shared_expert.", (*nnx, "shared_expert"), h, s),
        linear(f"{hf}shared_expert_gate.weight", (*nnx, "shared_expert_gate", "kernel"), 1, h),
    ]


def qwen3_next_map(config: Any) -> ModelMap:
    """The Qwen3-Next map for ``config`` (``Qwen3NextConfig`` or ``config.json`` dict).

    Raises:
        ValueError: ``attention_bias=True`` (no Qwen3-Next checkpoint has it),
            or a malformed ``layer_types``.
    """
    cfg = ConfigView(config)
    if cfg.get("attention_bias", default=False):
        raise ValueError("qwen3_next: attention_bias=True is not supported")
    h, i = cfg.int("hidden_size"), cfg.int("intermediate_size")
    rules = embedding_rules(cfg)
    for layer, kind in enumerate(layer_types(cfg)):
        hf, nnx = f"model.layers.{layer}.", ("layers", layer)
        if kind == "full_attention":
            rules += _gated_attention_rules(cfg, f"{hf}self_attn.", (*nnx, "attn"))
        else:
            rules += _linear_attention_rules(cfg, f"{hf}linear_attn.", (*nnx, "linear_attn"))
        if is_sparse_layer(cfg, layer):
            rules += moe_rules(cfg, f"{hf}mlp.", (*nnx, "mlp"))
            rules += _shared_expert_rules(cfg, f"{hf}mlp.", (*nnx, "mlp"))
        else:
            rules += dense_mlp_rules(f"{hf}mlp.", (*nnx, "mlp"), h, i)
        rules += layer_norm_rules(hf, nnx, h)
    rules += head_rules(cfg)
    return ModelMap("qwen3_next", rules, order="natural", ignore_prefixes=("mtp.",))
