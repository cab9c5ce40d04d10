"""Checkpoint manifests shaped like real models, without torch or a download.

The dimensions are the published ``config.json`` fields of each checkpoint
(copied from the project's ``shared/models/*.json``); the tensor names and
shapes follow the HF safetensors checkpoint layouts (transformers 5.24
``models/qwen3*``; vLLM's loaders take the same names): Qwen3 dense, Qwen3-MoE
with one 2-D weight per expert, Qwen3-Next with hybrid linear/full attention.
``aiosync bench`` and the benchmarks refit these manifests with random bytes.

A manifest here is ``{hf_name: (shape, dtype_name)}`` (dtype as a string such
as ``"bfloat16"``) so that this module stays free of torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["MODEL_CONFIGS", "ShapeManifest", "manifest_bytes", "model_manifest"]

#: ``{hf_name: (shape, dtype_name)}``, in checkpoint order.
ShapeManifest = dict[str, tuple[tuple[int, ...], str]]

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}

#: Real model dimensions (config.json fields), by the name ``aiosync bench --model`` takes;
#: ``qwen3-tiny`` is a test-sized Qwen3 (not a real checkpoint).
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-tiny": {
        "model_type": "qwen3",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "decoder_sparse_step": 1,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}


def model_manifest(
    name_or_config: str | Mapping[str, Any],
    *,
    layers: int | None = None,
    dtype: str | None = None,
) -> ShapeManifest:
    """The HF checkpoint manifest of a model: ``{hf_name: (shape, dtype_name)}``.

    Args:
        name_or_config: a key of :data:`MODEL_CONFIGS` or a config dict with
            ``model_type`` ``qwen3``, ``qwen3_moe`` or ``qwen3_next``.
        layers: keep only the first ``layers`` decoder layers (embeddings,
            final norm and head stay).
        dtype: every tensor's dtype name; default the config's ``torch_dtype``
            (``"bfloat16"`` when absent).

    Raises:
        KeyError: an unknown model name (the message lists the known ones).
        ValueError: an unsupported ``model_type``, or ``layers < 1``.
    """
    if isinstance(name_or_config, str):
        if name_or_config not in MODEL_CONFIGS:
            raise KeyError(f"unknown model {name_or_config!r}; known: {', '.join(MODEL_CONFIGS)}")
        config: Mapping[str, Any] = MODEL_CONFIGS[name_or_config]
    else:
        config = name_or_config
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    model_type = config.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe", "qwen3_next"):
        raise ValueError(f"unsupported model_type {model_type!r} (qwen3, qwen3_moe, qwen3_next)")
    dt = dtype or str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    n_layers = int(config["num_hidden_layers"])
    if layers is not None:
        n_layers = min(n_layers, layers)
    manifest: ShapeManifest = {}
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    manifest["model.embed_tokens.weight"] = ((vocab, hidden), dt)
    for i in range(n_layers):
        for name, shape in _layer_shapes(config, i):
            manifest[f"model.layers.{i}.{name}"] = (shape, dt)
    manifest["model.norm.weight"] = ((hidden,), dt)
    if not config.get("tie_word_embeddings", False):
        manifest["lm_head.weight"] = ((vocab, hidden), dt)
    return manifest


def manifest_bytes(manifest: Mapping[str, tuple[tuple[int, ...], str]]) -> int:
    """Payload bytes of a manifest (no padding).

    Raises:
        KeyError: a dtype name this module has no size for.
    """
    total = 0
    for shape, dt in manifest.values():
        numel = 1
        for d in shape:
            numel *= d
        total += numel * _ITEMSIZE[dt]
    return total


def _layer_shapes(config: Mapping[str, Any], i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Checkpoint names (after ``model.layers.{i}.``) and shapes of one decoder layer."""
    h = int(config["hidden_size"])
    n, k = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    d = int(config.get("head_dim") or h // n)
    model_type = config["model_type"]
    if model_type == "qwen3_next" and (i + 1) % int(config.get("full_attention_interval", 4)):
        yield from _gated_delta_net_shapes(config)
    else:
        # Qwen3-Next's full attention projects a per-head output gate with q.
        q_rows = 2 * n * d if model_type == "qwen3_next" else n * d
        yield "self_attn.q_proj.weight", (q_rows, h)
        yield "self_attn.k_proj.weight", (k * d, h)
        yield "self_attn.v_proj.weight", (k * d, h)
        yield "self_attn.o_proj.weight", (h, n * d)
        yield "self_attn.q_norm.weight", (d,)
        yield "self_attn.k_norm.weight", (d,)
    if _is_moe_layer(config, i):
        e, im = int(config["num_experts"]), int(config["moe_intermediate_size"])
        yield "mlp.gate.weight", (e, h)
        for proj, shape in (("gate_proj", (im, h)), ("up_proj", (im, h)), ("down_proj", (h, im))):
            for j in range(e):
                yield f"mlp.experts.{j}.{proj}.weight", shape
        if model_type == "qwen3_next":
            s = int(config["shared_expert_intermediate_size"])
            yield "mlp.shared_expert.gate_proj.weight", (s, h)
            yield "mlp.shared_expert.up_proj.weight", (s, h)
            yield "mlp.shared_expert.down_proj.weight", (h, s)
            yield "mlp.shared_expert_gate.weight", (1, h)
    else:
        inter = int(config["intermediate_size"])
        yield "mlp.gate_proj.weight", (inter, h)
        yield "mlp.up_proj.weight", (inter, h)
        yield "mlp.down_proj.weight", (h, inter)
    yield "input_layernorm.weight", (h,)
    yield "post_attention_layernorm.weight", (h,)


def _gated_delta_net_shapes(config: Mapping[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    h = int(config["hidden_size"])
    nk, nv = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    dk, dv = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    key_dim, value_dim = nk * dk, nv * dv
    kernel = int(config["linear_conv_kernel_dim"])
    yield "linear_attn.conv1d.weight", (2 * key_dim + value_dim, 1, kernel)
    yield "linear_attn.in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, h)
    yield "linear_attn.in_proj_ba.weight", (2 * nv, h)
    yield "linear_attn.dt_bias", (nv,)
    yield "linear_attn.A_log", (nv,)
    yield "linear_attn.norm.weight", (dv,)
    yield "linear_attn.out_proj.weight", (h, value_dim)


def _is_moe_layer(config: Mapping[str, Any], i: int) -> bool:
    experts = int(config.get("num_experts", 0) or 0)
    if config["model_type"] == "qwen3" or experts == 0:
        return False
    step = int(config.get("decoder_sparse_step", 1) or 1)
    return i not in (config.get("mlp_only_layers") or []) and (i + 1) % step == 0
