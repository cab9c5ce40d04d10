"""Qwen3-MoE: HF per-expert checkpoint ↔ tunix-style stacked experts.

Attention, norms and embeddings are those of :mod:`aiosync.refit.nnx.qwen3`. A layer
is sparse iff ``l not in mlp_only_layers and num_experts > 0 and
(l + 1) % decoder_sparse_step == 0`` (``modeling_qwen3_moe.py``); other layers
keep the dense MLP with ``intermediate_size``. On a sparse layer (E experts,
Im = ``moe_intermediate_size``)::

    model.layers.{l}.mlp.gate.weight                    [E, H]   layers/l/mlp/router/kernel (H, E)
    model.layers.{l}.mlp.experts.{e}.gate_proj.weight   [Im, H]  layers/l/mlp/gate_proj (E, H, Im)
    model.layers.{l}.mlp.experts.{e}.up_proj.weight     [Im, H]  layers/l/mlp/up_proj   (E, H, Im)
    model.layers.{l}.mlp.experts.{e}.down_proj.weight   [H, Im]  layers/l/mlp/down_proj (E, Im, H)

The refit writes the **per-expert** names: vLLM's fused-MoE loader
(``make_expert_params_mapping``) needs them and rejects a fused
``experts.gate_up_proj`` (see ``../shared/LAYOUTS.md`` §4).
"""

from __future__ import annotations

from typing import Any

from ._config import ConfigView
from .qwen3 import decoder_rules
from .table import ModelMap, NNXPath, Rule, linear, stacked_experts

__all__ = ["is_sparse_layer", "moe_rules", "qwen3_moe_map"]


def num_experts(cfg: ConfigView) -> int:
    """E; 5.24 re-serialises ``num_experts`` as ``num_local_experts``."""
    return cfg.int("num_experts", "num_local_experts", default=0)


def is_sparse_layer(cfg: ConfigView, layer: int) -> bool:
    """Whether layer ``layer`` has the MoE block (transformers' rule, verbatim)."""
    mlp_only = set(cfg.get("mlp_only_layers", default=[]) or [])
    step = cfg.int("decoder_sparse_step", default=1)
    return layer not in mlp_only and num_experts(cfg) > 0 and (layer + 1) % step == 0


def moe_rules(cfg: ConfigView, hf: str, nnx: NNXPath) -> list[Rule]:
    """Router and stacked experts of one sparse layer (``hf`` = ``…mlp.``)."""
    h, e = cfg.int("hidden_size"), num_experts(cfg)
    im = cfg.int("moe_intermediate_size")
    per_expert = [f"{hf}experts.{x}." for x in range(e)]
    # transformers holds gate and up fused as `experts.gate_up_proj` (gate rows first).
    fused_gu = f"{hf}experts.gate_up_proj"
    return [
        linear(f"{hf}gate.weight", (*nnx, "router", "kernel"), e, h),
        stacked_experts(
            [f"{p}gate_proj.weight" for p in per_expert],
            (*nnx, "gate_proj"),
            im,
            h,
            sort_as=fused_gu,
        ),
        stacked_experts(
            [f"{p}up_proj.weight" for p in per_expert], (*nnx, "up_proj"), im, h, sort_as=fused_gu
        ),
        stacked_experts(
            [f"{p}down_proj.weight" for p in per_expert],
            (*nnx, "down_proj"),
            h,
            im,
            sort_as=f"{hf}experts.down_proj",
        ),
    ]


def qwen3_moe_map(config: Any) -> ModelMap:
    """The Qwen3-MoE map for ``config`` (``Qwen3MoeConfig`` or ``config.json`` dict).

    Pass ``head_dim`` explicitly when building a config: 5.24's
    ``Qwen3MoeConfig`` has no such field and the default ``H // N`` is not the
    real models' 128.
    """
    cfg = ConfigView(config)

    def sparse(layer: int, hf: str, nnx: NNXPath) -> list[Rule]:
        return moe_rules(cfg, hf, nnx) if is_sparse_layer(cfg, layer) else []

    return ModelMap("qwen3_moe", decoder_rules(cfg, sparse), order="natural")
