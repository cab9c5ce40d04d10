"""``import aiosync.refit`` stays free of jax; the JAX seam loads on first use."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
import aiosync.refit
assert "jax" not in sys.modules and "flax" not in sys.modules, "import refit imported jax"
assert {"NNXRefitSource", "model_map_for"} <= set(dir(aiosync.refit)), dir(aiosync.refit)
assert "jax" not in sys.modules, "dir(aiosync.refit) imported jax"
from aiosync.refit.nnx import NNXRefitSource, model_map_for
assert aiosync.refit.NNXRefitSource is NNXRefitSource
assert aiosync.refit.model_map_for is model_map_for
mm = model_map_for({"model_type": "qwen3", "vocab_size": 8, "hidden_size": 4,
                    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "head_dim": 2, "tie_word_embeddings": True})
assert len(mm.hf_shapes()) == 13, mm.hf_shapes()
assert "jax" not in sys.modules, "building a map imported jax"
print("ok")
"""


def test_import_refit_and_building_a_map_do_not_import_jax() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
