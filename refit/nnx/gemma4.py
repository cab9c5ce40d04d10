"""Gemma 4 text stack: HF checkpoint ↔ tunix-style NNX layout (experts kept fused).

Names are those of ``Gemma4ForCausalLM`` (prefix ``model.``) or, for the
released ``Gemma4ForConditionalGeneration`` checkpoints (``model_type
"gemma4"``), ``model.language_model.``; the vision/audio towers are not part
of the text refit and the loader skips them. Per layer ``l`` (``p`` = prefix +
``layers.{l}.``; Dl/Kl are the layer's head dim and kv heads: ``head_dim`` /
``num_key_value_heads`` on sliding layers, ``global_head_dim`` and, with
``attention_k_eq_v``, ``num_global_key_value_heads`` on full layers)::

    p self_attn.q_proj.weight   [N*Dl, H]   layers/l/attn/q_einsum/w        (N, H, Dl)
    p self_attn.q_norm.weight   [Dl]        layers/l/attn/query_norm/scale
    p self_attn.k_norm.weight   [Dl]        layers/l/attn/key_norm/scale     (not KV-shared)
    p self_attn.{k,v}_proj.weight [Kl*Dl, H] layers/l/attn/kv_einsum/w       (2, Kl, H, Dl)
      … k_eq_v full layer: no v_proj,       layers/l/attn/k_einsum/w         (Kl, H, Dl)
    p self_attn.o_proj.weight   [H, N*Dl]   layers/l/attn/attn_vec_einsum/w  (N, Dl, H)
    p mlp.{gate,up}_proj.weight [Il, H]     layers/l/mlp/gating_einsum       (2, Il, H)
    p mlp.down_proj.weight      [H, Il]     layers/l/mlp/linear              (Il, H)
    p {input,post_attention}_layernorm.weight  layers/l/{pre,post}_attention_norm/scale
    p {pre,post}_feedforward_layernorm.weight  layers/l/{pre,post}_ffw_norm/scale
    p layer_scalar              [1]         layers/l/skip_scale
    MoE (enable_moe_block), E experts, Im = moe_intermediate_size:
    p router.proj.weight        [E, H]      layers/l/moe/router_logits       (H, E)
    p router.scale              [H]         layers/l/moe/router_scale
    p router.per_expert_scale   [E]         layers/l/moe/per_expert_scale
    p experts.gate_up_proj      [E, 2Im, H] layers/l/moe/gating_einsum       (E, 2, Im, H)
    p experts.down_proj         [E, H, Im]  layers/l/moe/linear              (E, Im, H)
    p pre_feedforward_layernorm_2 / post_feedforward_layernorm_{1,2}
                                            layers/l/{pre_ffw_norm_2,post_ffw_norm_1,post_ffw_norm_2}/scale
    PLE (hidden_size_per_layer_input P > 0):
    p per_layer_input_gate.weight [P, H]    layers/l/per_layer_input_gate/kernel (H, P)
    p per_layer_projection.weight [H, P]    layers/l/per_layer_projection/kernel (P, H)
    p post_per_layer_input_norm.weight [H]  layers/l/post_per_layer_input_norm/scale

Model level: ``embed_tokens.weight [V, H]`` → ``embedder/input_embedding``;
PLE ``embed_tokens_per_layer.weight [Vp, L*P]`` → ``embedder/per_layer_input_embedding
(Vp, L, P)``, ``per_layer_model_projection.weight [L*P, H]`` →
``embedder/per_layer_model_projection (H, L, P)``, ``per_layer_projection_norm.weight
[P]`` → ``embedder/per_layer_projection_norm/scale``; ``norm.weight`` →
``final_norm/scale``; ``lm_head.weight`` only when untied (→ ``lm_head/w (H, V)``).

KV-shared layers (the last ``num_kv_shared_layers``) have no k/v/k_norm; with
``use_double_wide_mlp`` their MLP is ``2 * intermediate_size`` wide. The
experts stay fused: that is the checkpoint's layout and vLLM's Gemma 4 loader
splits them itself (``../shared/LAYOUTS.md`` §4). Norms are plain ``w * x``
and copied unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._config import ConfigView
from .table import ModelMap, NNXPath, Rule, copy, heads_in_nhd, heads_out, linear
from .transforms import Reshape, Stack, Transpose

__all__ = ["attention_dims", "gemma4_map"]

_VISION_AUDIO = (
    "model.vision_tower.",
    "model.embed_vision.",
    "model.audio_tower.",
    "model.embed_audio.",
)


def _layer_types(cfg: ConfigView) -> list[str]:
    n = cfg.int("num_hidden_layers")
    types = cfg.get("layer_types", default=None)
    if types is None:
        # transformers' default: 5 sliding : 1 full.
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    types = list(types)
    if len(types) != n:
        raise ValueError(f"gemma4: layer_types has {len(types)} entries for {n} layers")
    types[-1] = "full_attention"  # transformers forces it
    return types


def attention_dims(cfg: ConfigView, layer: int, full: bool) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` of layer ``layer``.

    Reads transformers 5.24's ``per_layer_config`` (object or dict) when there,
    else the original ``config.json`` fields ``global_head_dim`` (default 512)
    and ``num_global_key_value_heads`` (used with ``attention_k_eq_v``).
    """
    per_layer = cfg.get("per_layer_config", default=None)
    if per_layer is not None and not isinstance(per_layer, Mapping):
        # A 5.24 config object: the global fields raise on access, read the layer's view.
        view = per_layer[layer]
        return int(view.num_key_value_heads), int(view.head_dim)
    base_k, base_d = cfg.int("num_key_value_heads"), cfg.int("head_dim")
    if per_layer is not None:
        over = per_layer.get(str(layer)) or per_layer.get(layer) or {}
        return int(over.get("num_key_value_heads", base_k)), int(over.get("head_dim", base_d))
    if not full:
        return base_k, base_d
    k = base_k
    if cfg.get("attention_k_eq_v", default=False):
        k = cfg.int("num_global_key_value_heads", default=base_k)
    return k, cfg.int("global_head_dim", default=512)


def _kv_rules(hf: str, nnx: NNXPath, k: int, d: int, h: int, k_eq_v: bool) -> list[Rule]:
    if k_eq_v:
        return [heads_in_nhd(f"{hf}k_proj.weight", (*nnx, "k_einsum", "w"), k, d, h)]
    return [
        Rule(
            (f"{hf}k_proj.weight", f"{hf}v_proj.weight"),
            ((*nnx, "kv_einsum", "w"),),
            ((k * d, h), (k * d, h)),
            (Reshape((k * d, h), (k, d, h)), Transpose((0, 2, 1)), Stack(0)),
        )
    ]


def _norm(hf: str, path: NNXPath, h: int) -> Rule:
    return copy(hf, (*path, "scale"), (h,))


def _layer_rules(cfg: ConfigView, prefix: str, layer: int, kind: str) -> list[Rule]:
    h, n = cfg.int("hidden_size"), cfg.int("num_attention_heads")
    n_layers = cfg.int("num_hidden_layers")
    full = kind == "full_attention"
    shared = layer >= n_layers - cfg.int("num_kv_shared_layers", default=0)
    k, d = attention_dims(cfg, layer, full)
    hf, nnx = f"{prefix}layers.{layer}.", ("layers", layer)
    a_hf, a_nnx = f"{hf}self_attn.", (*nnx, "attn")

    rules = [
        # The layer's own buffer comes first in its state_dict, before any submodule.
        copy(f"{hf}layer_scalar", (*nnx, "skip_scale"), (1,)),
        heads_in_nhd(f"{a_hf}q_proj.weight", (*a_nnx, "q_einsum", "w"), n, d, h),
        _norm(f"{a_hf}q_norm.weight", (*a_nnx, "query_norm"), d),
    ]
    if not shared:
        rules.append(_norm(f"{a_hf}k_norm.weight", (*a_nnx, "key_norm"), d))
        k_eq_v = bool(cfg.get("attention_k_eq_v", default=False)) and full
        rules += _kv_rules(a_hf, a_nnx, k, d, h, k_eq_v)
    rules.append(heads_out(f"{a_hf}o_proj.weight", (*a_nnx, "attn_vec_einsum", "w"), n, d, h))

    inter = cfg.int("intermediate_size")
    if shared and cfg.get("use_double_wide_mlp", default=False):
        inter *= 2
    rules += [
        Rule(
            (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"),
            ((*nnx, "mlp", "gating_einsum"),),
            ((inter, h), (inter, h)),
            (Stack(0),),
        ),
        linear(f"{hf}mlp.down_proj.weight", (*nnx, "mlp", "linear"), h, inter),
        _norm(f"{hf}input_layernorm.weight", (*nnx, "pre_attention_norm"), h),
        _norm(f"{hf}post_attention_layernorm.weight", (*nnx, "post_attention_norm"), h),
        _norm(f"{hf}pre_feedforward_layernorm.weight", (*nnx, "pre_ffw_norm"), h),
        _norm(f"{hf}post_feedforward_layernorm.weight", (*nnx, "post_ffw_norm"), h),
    ]

    p = cfg.int("hidden_size_per_layer_input", default=0)
    if p:
        rules += [
            linear(
                f"{hf}per_layer_input_gate.weight", (*nnx, "per_layer_input_gate", "kernel"), p, h
            ),
            linear(
                f"{hf}per_layer_projection.weight", (*nnx, "per_layer_projection", "kernel"), h, p
            ),
            _norm(f"{hf}post_per_layer_input_norm.weight", (*nnx, "post_per_layer_input_norm"), h),
        ]

    if cfg.get("enable_moe_block", default=False):
        e, im = cfg.int("num_experts"), cfg.int("moe_intermediate_size")
        moe = (*nnx, "moe")
        rules += [
            copy(f"{hf}router.scale", (*moe, "router_scale"), (h,)),
            copy(f"{hf}router.per_expert_scale", (*moe, "per_expert_scale"), (e,)),
            linear(f"{hf}router.proj.weight", (*moe, "router_logits"), e, h),
            Rule(
                (f"{hf}experts.gate_up_proj",),
                ((*moe, "gating_einsum"),),
                ((e, 2 * im, h),),
                (Reshape((e, 2 * im, h), (e, 2, im, h)),),
            ),
            Rule(
                (f"{hf}experts.down_proj",),
                ((*moe, "linear"),),
                ((e, h, im),),
                (Transpose((0, 2, 1)),),
            ),
            _norm(f"{hf}post_feedforward_layernorm_1.weight", (*nnx, "post_ffw_norm_1"), h),
            _norm(f"{hf}post_feedforward_layernorm_2.weight", (*nnx, "post_ffw_norm_2"), h),
            _norm(f"{hf}pre_feedforward_layernorm_2.weight", (*nnx, "pre_ffw_norm_2"), h),
        ]
    return rules


def _text_map(
    cfg: ConfigView, model_type: str, prefix: str, tied: bool, ignore: tuple[str, ...]
) -> ModelMap:
    if cfg.get("attention_bias", default=False):
        raise ValueError(f"{model_type}: attention_bias=True is not supported")
    h, v = cfg.int("hidden_size"), cfg.int("vocab_size")
    n_layers = cfg.int("num_hidden_layers")
    rules = [copy(f"{prefix}embed_tokens.weight", ("embedder", "input_embedding"), (v, h))]
    for layer, kind in enumerate(_layer_types(cfg)):
        rules += _layer_rules(cfg, prefix, layer, kind)
    rules.append(_norm(f"{prefix}norm.weight", ("final_norm",), h))
    # The PLE modules are registered after `norm`, so they follow it in the state_dict.
    p = cfg.int("hidden_size_per_layer_input", default=0)
    if p:
        vp = cfg.int("vocab_size_per_layer_input")
        rules += [
            Rule(
                (f"{prefix}embed_tokens_per_layer.weight",),
                (("embedder", "per_layer_input_embedding"),),
                ((vp, n_layers * p),),
                (Reshape((vp, n_layers * p), (vp, n_layers, p)),),
            ),
            Rule(
                (f"{prefix}per_layer_model_projection.weight",),
                (("embedder", "per_layer_model_projection"),),
                ((n_layers * p, h),),
                (Transpose((1, 0)), Reshape((h, n_layers * p), (h, n_layers, p))),
            ),
            _norm(
                f"{prefix}per_layer_projection_norm.weight",
                ("embedder", "per_layer_projection_norm"),
                p,
            ),
        ]
    if not tied:
        rules.append(linear("lm_head.weight", ("lm_head", "w"), v, h))
    return ModelMap(model_type, rules, ignore_prefixes=ignore)


def gemma4_map(config: Any) -> ModelMap:
    """The Gemma 4 text map for ``config``.

    ``model_type "gemma4_text"`` (``Gemma4TextConfig``, ``Gemma4ForCausalLM``):
    names under ``model.``. ``"gemma4"`` (``Gemma4Config`` with a
    ``text_config``, the released checkpoints): names under
    ``model.language_model.``; vision/audio tensors are skipped by the loader.
    Prefer the original ``config.json`` dict: 5.24 re-serialisation moves
    ``global_head_dim`` into ``per_layer_config`` (both are read).

    Raises:
        ValueError: ``attention_bias=True``, or malformed ``layer_types``.
    """
    cfg = ConfigView(config)
    if cfg.get("model_type", default="gemma4_text") == "gemma4":
        text = cfg.sub("text_config")
        tied = bool(
            cfg.get("tie_word_embeddings", default=text.get("tie_word_embeddings", default=True))
        )
        return _text_map(text, "gemma4", "model.language_model.", tied, _VISION_AUDIO)
    tied = bool(cfg.get("tie_word_embeddings", default=True))
    return _text_map(cfg, "gemma4_text", "model.", tied, ())
