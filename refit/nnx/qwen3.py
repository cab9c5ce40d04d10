"""Qwen3 dense: HF checkpoint ↔ tunix-style NNX layout.

HF (``models/qwen3/modeling_qwen3.py``), N heads, K kv heads, D head_dim::

    model.embed_tokens.weight                 [V, H]     embedder/input_embedding        (V, H)
    model.layers.{l}.self_attn.q_proj.weight  [N*D, H]   layers/l/attn/q_proj/w          (H, N, D)
    …k_proj.weight / v_proj.weight            [K*D, H]   layers/l/attn/{k,v}_proj/w      (H, K, D)
    …o_proj.weight                            [H, N*D]   layers/l/attn/o_proj/w          (N, D, H)
    …{q,k,v}_proj.bias (attention_bias only)  [heads*D]  layers/l/attn/{q,k,v}_proj/b    (heads, D)
    …q_norm.weight / k_norm.weight            [D]        layers/l/attn/{q,k}_norm/w      (D,)
    model.layers.{l}.mlp.{gate,up}_proj.weight [I, H]    layers/l/mlp/{gate,up}_proj/kernel (H, I)
    model.layers.{l}.mlp.down_proj.weight     [H, I]     layers/l/mlp/down_proj/kernel   (I, H)
    …input_layernorm / post_attention_layernorm [H]      layers/l/{…}/w                  (H,)
    model.norm.weight                         [H]        final_norm/w                    (H,)
    lm_head.weight (untied only)              [V, H]     lm_head/w                       (H, V)

Tied embeddings (``tie_word_embeddings``): the checkpoint has no
``lm_head.weight`` and the NNX state no ``lm_head``; the engine ties it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._config import ConfigView
from .table import ModelMap, NNXPath, Rule, copy, heads_in, heads_out, linear
from .transforms import Reshape

#: A layer's MoE rules, ``(layer, hf_prefix, nnx_path) -> rules`` (empty: a dense layer).
MLPRules = Callable[[int, str, NNXPath], list[Rule]]

__all__ = ["attention_rules", "decoder_rules", "dense_mlp_rules", "qwen3_map"]


def attention_rules(cfg: ConfigView, hf: str, nnx: NNXPath) -> list[Rule]:
    """Qwen3 self-attention (q/k/v/o, optional biases, q_norm/k_norm) of one layer.

    ``hf`` is the module prefix (``model.layers.3.self_attn.``), ``nnx`` the path.
    """
    h = cfg.int("hidden_size")
    n = cfg.int("num_attention_heads")
    k = cfg.int("num_key_value_heads", default=n)
    d = cfg.int("head_dim", default=h // n)
    bias = bool(cfg.get("attention_bias", default=False))
    rules = [heads_in(f"{hf}q_proj.weight", (*nnx, "q_proj", "w"), n, d, h)]
    if bias:
        rules.append(_bias(f"{hf}q_proj.bias", (*nnx, "q_proj", "b"), n, d))
    rules.append(heads_in(f"{hf}k_proj.weight", (*nnx, "k_proj", "w"), k, d, h))
    if bias:
        rules.append(_bias(f"{hf}k_proj.bias", (*nnx, "k_proj", "b"), k, d))
    rules.append(heads_in(f"{hf}v_proj.weight", (*nnx, "v_proj", "w"), k, d, h))
    if bias:
        rules.append(_bias(f"{hf}v_proj.bias", (*nnx, "v_proj", "b"), k, d))
    rules.append(heads_out(f"{hf}o_proj.weight", (*nnx, "o_proj", "w"), n, d, h))
    if bias:
        rules.append(copy(f"{hf}o_proj.bias", (*nnx, "o_proj", "b"), (h,)))
    rules += [
        copy(f"{hf}q_norm.weight", (*nnx, "q_norm", "w"), (d,)),
        copy(f"{hf}k_norm.weight", (*nnx, "k_norm", "w"), (d,)),
    ]
    return rules


def _bias(hf: str, path: NNXPath, heads: int, head_dim: int) -> Rule:
    return Rule(
        (hf,), (path,), ((heads * head_dim,),), (Reshape((heads * head_dim,), (heads, head_dim)),)
    )


def dense_mlp_rules(hf: str, nnx: NNXPath, hidden: int, intermediate: int) -> list[Rule]:
    """SwiGLU MLP ``gate_proj``/``up_proj`` ``[I, H]``, ``down_proj`` ``[H, I]`` → kernels."""
    return [
        linear(f"{hf}gate_proj.weight", (*nnx, "gate_proj", "kernel"), intermediate, hidden),
        linear(f"{hf}up_proj.weight", (*nnx, "up_proj", "kernel"), intermediate, hidden),
        linear(f"{hf}down_proj.weight", (*nnx, "down_proj", "kernel"), hidden, intermediate),
    ]


def embedding_rules(cfg: ConfigView) -> list[Rule]:
    """``model.embed_tokens.weight`` → ``embedder/input_embedding`` ``(V, H)``."""
    v, h = cfg.int("vocab_size"), cfg.int("hidden_size")
    return [copy("model.embed_tokens.weight", ("embedder", "input_embedding"), (v, h))]


def head_rules(cfg: ConfigView) -> list[Rule]:
    """Final norm, and ``lm_head`` unless tied."""
    v, h = cfg.int("vocab_size"), cfg.int("hidden_size")
    rules = [copy("model.norm.weight", ("final_norm", "w"), (h,))]
    if not cfg.get("tie_word_embeddings", default=False):
        rules.append(linear("lm_head.weight", ("lm_head", "w"), v, h))
    return rules


def layer_norm_rules(hf: str, nnx: NNXPath, hidden: int) -> list[Rule]:
    """``input_layernorm`` and ``post_attention_layernorm`` ``[H]``."""
    return [
        copy(f"{hf}input_layernorm.weight", (*nnx, "input_layernorm", "w"), (hidden,)),
        copy(
            f"{hf}post_attention_layernorm.weight",
            (*nnx, "post_attention_layernorm", "w"),
            (hidden,),
        ),
    ]


def decoder_rules(cfg: ConfigView, sparse_mlp: MLPRules | None = None) -> list[Rule]:
    """Every rule of a Qwen3-style decoder: embeddings, per layer attention, MLP and
    norms, then the head; a layer's MLP is ``sparse_mlp(layer, hf, nnx)``'s rules where
    that returns any (a MoE block), else the dense MLP's."""
    h, i = cfg.int("hidden_size"), cfg.int("intermediate_size")
    rules = embedding_rules(cfg)
    for layer in range(cfg.int("num_hidden_layers")):
        hf, nnx = f"model.layers.{layer}.", ("layers", layer)
        rules += attention_rules(cfg, f"{hf}self_attn.", (*nnx, "attn"))
        mlp = sparse_mlp(layer, f"{hf}mlp.", (*nnx, "mlp")) if sparse_mlp else []
        rules += mlp or dense_mlp_rules(f"{hf}mlp.", (*nnx, "mlp"), h, i)
        rules += layer_norm_rules(hf, nnx, h)
    return rules + head_rules(cfg)


def qwen3_map(config: Any) -> ModelMap:
    """The Qwen3 dense map for ``config`` (a ``Qwen3Config`` or its ``config.json`` dict)."""
    return ModelMap("qwen3", decoder_rules(ConfigView(config)))
