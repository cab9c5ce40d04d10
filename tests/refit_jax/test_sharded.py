"""A state sharded over several JAX devices refits to the same bytes as an unsharded one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")

# Runs in a fresh interpreter: the host-device count must be set before jax starts.
_PROBE = """
import jax, jax.numpy as jnp, numpy as np, torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from aiosync.refit.nnx import NNXRefitSource, model_map_for

assert len(jax.devices()) == 2, jax.devices()
config = {"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 16,
          "intermediate_size": 24, "moe_intermediate_size": 8, "num_experts": 4,
          "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "mlp_only_layers": [1]}
mm = model_map_for(config)
rng = np.random.default_rng(0)
mesh = Mesh(np.array(jax.devices()), ("x",))
plain, sharded, n_sharded = {}, {}, 0
for path, shape in mm.nnx_shapes().items():
    a = jnp.asarray(rng.standard_normal(shape), dtype=jnp.bfloat16)
    spec = P("x") if shape[0] % 2 == 0 else P()
    n_sharded += spec == P("x")
    s = jax.device_put(a, NamedSharding(mesh, spec))
    for tree, v in ((plain, a), (sharded, s)):
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
assert n_sharded > 10
ref = list(NNXRefitSource(plain, mm).iter_weights())
got = list(NNXRefitSource(sharded, mm).iter_weights())
assert [n for n, _ in got] == [n for n, _ in ref]
for (name, a), (_, b) in zip(got, ref):
    assert a.dtype == b.dtype == torch.bfloat16, name
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
print("ok", len(got))
"""


def test_state_sharded_over_two_devices_refits_bit_exact() -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "ok"
