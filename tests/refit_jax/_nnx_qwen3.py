"""A small flax NNX Qwen3 (dense) in the layout of ``aiosync.refit.nnx.qwen3``.

Written from the Qwen3 architecture (RMSNorm, q/k norm on the head dim, RoPE
with rotate-half, GQA, SwiGLU), not from the refit table: if the table's
layout were a self-consistent permutation instead of what the model computes
with, its logits would not match transformers'.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


class _Norm(nnx.Module):
    def __init__(self, dim: int, eps: float) -> None:
        self.w = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        var = jnp.mean(x * x, axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + self.eps) * self.w[...]


class _Einsum(nnx.Module):
    def __init__(self, shape: tuple[int, ...], rngs: nnx.Rngs) -> None:
        self.w = nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32))


class _Embedder(nnx.Module):
    def __init__(self, vocab: int, hidden: int, rngs: nnx.Rngs) -> None:
        self.input_embedding = nnx.Param(jax.random.normal(rngs.params(), (vocab, hidden)))


class _LMHead(nnx.Module):
    def __init__(self, hidden: int, vocab: int, rngs: nnx.Rngs) -> None:
        self.w = nnx.Param(jax.random.normal(rngs.params(), (hidden, vocab)))


class _Attention(nnx.Module):
    def __init__(self, cfg: Any, rngs: nnx.Rngs) -> None:
        h, n, k, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n, self.k, self.d = n, k, d
        self.q_proj = _Einsum((h, n, d), rngs)
        self.k_proj = _Einsum((h, k, d), rngs)
        self.v_proj = _Einsum((h, k, d), rngs)
        self.o_proj = _Einsum((n, d, h), rngs)
        self.q_norm = _Norm(d, cfg.rms_norm_eps)
        self.k_norm = _Norm(d, cfg.rms_norm_eps)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        q = self.q_norm(jnp.einsum("bth,hnd->btnd", x, self.q_proj.w[...]))
        k = self.k_norm(jnp.einsum("bth,hkd->btkd", x, self.k_proj.w[...]))
        v = jnp.einsum("bth,hkd->btkd", x, self.v_proj.w[...])
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = self.n // self.k
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("btnd,bsnd->bnts", q, k) / jnp.sqrt(jnp.float32(self.d))
        t = x.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        out = jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(scores, axis=-1), v)
        return jnp.einsum("btnd,ndh->bth", out, self.o_proj.w[...])


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


class _MLP(nnx.Module):
    def __init__(self, hidden: int, inter: int, rngs: nnx.Rngs) -> None:
        self.gate_proj = nnx.Linear(hidden, inter, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(hidden, inter, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(inter, hidden, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nnx.Module):
    def __init__(self, cfg: Any, rngs: nnx.Rngs) -> None:
        self.attn = _Attention(cfg, rngs)
        self.mlp = _MLP(cfg.hidden_size, cfg.intermediate_size, rngs)
        self.input_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class NNXQwen3(nnx.Module):
    """Qwen3 for causal LM; ``cfg`` is a transformers ``Qwen3Config``. fp32 throughout."""

    def __init__(self, cfg: Any, rngs: nnx.Rngs) -> None:
        self.tied = bool(cfg.tie_word_embeddings)
        self.head_dim = cfg.head_dim
        self.theta = float(cfg.rope_parameters["rope_theta"])
        self.embedder = _Embedder(cfg.vocab_size, cfg.hidden_size, rngs)
        self.layers = nnx.List([_Layer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
        self.final_norm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        if not self.tied:
            self.lm_head = _LMHead(cfg.hidden_size, cfg.vocab_size, rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """``ids [B, T]`` int → logits ``[B, T, V]`` float32."""
        emb = self.embedder.input_embedding[...]
        x = emb[ids]
        inv_freq = 1.0 / (
            self.theta ** (jnp.arange(0, self.head_dim, 2, jnp.float32) / self.head_dim)
        )
        freqs = jnp.arange(ids.shape[1], dtype=jnp.float32)[:, None] * inv_freq[None, :]
        angles = jnp.concatenate([freqs, freqs], axis=-1)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.final_norm(x)
        head = emb.T if self.tied else self.lm_head.w[...]
        return x @ head
