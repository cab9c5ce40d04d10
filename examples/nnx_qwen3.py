"""A JAX trainer's refit: a small flax NNX Qwen3 streamed into an engine through aiosync.

``NNXQwen3`` is a dense Qwen3 in the parameter layout that
``aiosync.refit.model_map_for(Qwen3Config(...))`` expects (``aiosync.refit.nnx.qwen3``):

    embedder.input_embedding        [vocab, hidden]
    layers[i].attn.q_proj.w         [hidden, heads, head_dim]      (k/v: kv_heads)
    layers[i].attn.o_proj.w         [heads, head_dim, hidden]
    layers[i].attn.{q,k}_norm.w     [head_dim]
    layers[i].mlp.{gate,up}_proj    nnx.Linear kernel [hidden, intermediate]
    layers[i].mlp.down_proj         nnx.Linear kernel [intermediate, hidden]
    layers[i].{input,post_attention}_layernorm.w, final_norm.w   [hidden]
    lm_head.w                       [hidden, vocab]   (absent when tied)

It is written from the Qwen3 architecture (RMSNorm, q/k norm on the head dim,
RoPE with rotate-half, GQA, SwiGLU), not from the refit table: the tests load
transformers' weights into it through the map and compare logits, so the
layout is what the model computes with. Your own NNX model needs the same
parameter tree, or a map of its own.

Run (needs ``pip install -e '.[jax,embedded]'``)::

    python examples/nnx_qwen3.py --steps 2

Each step takes one SGD step in JAX, then refits the embedded engine over IPC;
the engine's weights then equal the NNX model's, bit for bit, and its greedy
output equals a greedy decode of the NNX model.
"""

from __future__ import annotations

import argparse
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


# -- the demo: SGD in JAX, refit into the embedded engine ---------------------


def _greedy(model: NNXQwen3, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new_tokens):  # no KV cache: recompute, it is a demo
        logits = model(jnp.asarray([ids]))
        ids.append(int(jnp.argmax(logits[0, -1])))
    return ids[len(prompt) :]


def _sgd_step(model: NNXQwen3, ids: jax.Array, lr: float = 1e-2) -> None:
    def loss_fn(m: NNXQwen3) -> jax.Array:
        logp = jax.nn.log_softmax(m(ids[:, :-1]), axis=-1)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()

    grads = nnx.grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, params, grads))


async def main(steps: int) -> None:
    import torch
    from transformers import Qwen3Config

    import aiosync
    from aiosync.refit import NNXRefitSource, model_map_for

    config = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    )  # fmt: skip
    model = NNXQwen3(config, nnx.Rngs(0))
    source = NNXRefitSource(model, model_map_for(config))  # fp32, as the engine below
    prompt = [1, 2, 3, 4]
    async with (
        aiosync.EmbeddedEngine(config, dtype="float32") as engine,
        aiosync.create_weight_synchronizer(
            source, engine, colocated=True, backend="embedded"
        ) as sync,  # initializes the communicator
    ):
        # The engine booted with its own random weights; each step below marks stale
        # before it generates, so the first refit also serves as the initial sync.
        for _ in range(steps):
            batch = jax.random.randint(jax.random.key(sync.policy_version), (4, 9), 0, 128)
            _sgd_step(model, batch)
            await sync.mark_stale()
            await aiosync.refit_if_stale(sync, engine)

            [engine_state] = await engine.hf_state_dicts()
            sent = dict(source.iter_weights())
            exact = list(engine_state) == list(sent) and all(
                torch.equal(engine_state[n], t) for n, t in sent.items()
            )
            (engine_out,) = await engine.generate([prompt], max_new_tokens=6)
            nnx_out = _greedy(model, prompt, 6)
            print(
                f"weight_version {sync.weight_version}: {len(sent)} tensors "
                f"{'bit-exact' if exact else 'DIFFERENT'}; "
                f"greedy engine {engine_out} nnx {nnx_out} "
                f"{'equal' if engine_out == nnx_out else 'DIFFERENT'}"
            )
            if not exact or engine_out != nnx_out:
                raise SystemExit("the engine disagrees with the NNX model after a refit")


if __name__ == "__main__":
    import anyio

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    anyio.run(main, parser.parse_args().steps)
