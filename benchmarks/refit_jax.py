"""NNX → HF refit throughput of the JAX seam on a Qwen3-30B-A3B-shaped state.

The NNX state has the real dimensions of ``qwen3-30b-a3b`` (``aiosync/_model_shapes.py``)
(H=2048, 128 experts of Im=768, 32 heads of 128, V=151936) in bf16, cut to a
few layers (the output says how many). In one process it measures:

* **baseline**: a plain ``np.asarray`` of every JAX array (a zero-copy view on
  CPU) copied into a reused staging buffer, i.e. a memcpy of the whole state;
* **refit**: ``NNXRefitSource.iter_weights()`` (exact inverse: transposes back
  to ``[out, in]``, head merges, per-expert unstacking into ~3·E tensors per
  layer) copied into the same staging buffer;
* **refit, contiguous=False**: the same stream yielding strided views, so the
  transpose happens in the one copy into the staging buffer (what a packing
  transport does);
* **refit, no sink**: the stream alone (tensors materialised only where the
  inverse needs a copy);
* **manifest scaling** (case C10): building the map and ``prepare_refit_info()``
  for the full 48-layer model (~18,900 tensors, shapes only) against 12 layers,
  best of 3 after a warm-up: the cost per tensor must not grow with the tensor count.

Ratios are throughputs relative to the baseline (1.0 = as fast as a memcpy).
Each run is the best of ``--repeats`` (at least 3; 1 when ``--quick``); the
1-minute load average at start and end is recorded (``_machine``).

Usage: ``python benchmarks/refit_jax.py [--quick] [--json] [--layers N] [--experts E]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from _machine import Machine, repeats_for
from rich.console import Console
from rich.table import Table

from aiosync._model_shapes import MODEL_CONFIGS
from aiosync.refit.nnx import NNXRefitSource, model_map_for
from aiosync.refit.nnx.convert import numpy_to_torch
from aiosync.refit.nnx.table import ModelMap, flatten_params

GB = 1e9


def _config(layers: int, experts: int | None) -> dict[str, Any]:
    raw: dict[str, Any] = dict(MODEL_CONFIGS["qwen3-30b-a3b"])  # published config.json
    raw["num_hidden_layers"] = layers
    if experts is not None:
        raw["num_experts"] = experts
    return raw


def _state(model_map: ModelMap) -> dict[Any, Any]:
    """The NNX state with the map's shapes, bf16, every page written before timing."""
    tree: dict[Any, Any] = {}
    for path, shape in model_map.nnx_shapes().items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = jnp.full(shape, 0.5, dtype=jnp.bfloat16).block_until_ready()
    return tree


def _best(fn: Callable[[], tuple[int, int]], repeats: int) -> tuple[float, int, int]:
    best = float("inf")
    nbytes = count = 0
    for _ in range(repeats):
        start = time.perf_counter()
        nbytes, count = fn()
        best = min(best, time.perf_counter() - start)
    return best, nbytes, count


def _sink(
    stream: Iterator[tuple[str, torch.Tensor]], staging: torch.Tensor | None
) -> tuple[int, int]:
    nbytes = count = 0
    for _, t in stream:
        n = t.numel() * t.element_size()
        if staging is not None:
            # Any strides: a strided view is transposed straight into the staging buffer.
            staging[:n].view(t.dtype).view(t.shape).copy_(t)
        nbytes += n
        count += 1
    return nbytes, count


def _baseline(leaves: list[Any], staging: torch.Tensor) -> tuple[int, int]:
    nbytes = 0
    for leaf in leaves:
        a = np.asarray(leaf)
        n = a.nbytes
        staging[:n].copy_(numpy_to_torch(a.reshape(-1).view(np.uint8)))
        nbytes += n
    return nbytes, len(leaves)


def _manifest_cost(layers: int) -> tuple[float, int]:
    """Seconds to build the map and its manifest from shapes only; tensor count."""
    start = time.perf_counter()
    model_map = model_map_for(_config(layers, None))
    shapes = {
        path: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        for path, shape in model_map.nnx_shapes().items()
    }
    tree: dict[Any, Any] = {}
    for path, leaf in shapes.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf
    manifest = model_map.manifest(tree)
    return time.perf_counter() - start, len(manifest)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 layer, 32 experts, 1 repeat")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 2)")
    parser.add_argument("--experts", type=int, default=None, help="experts (default 128)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs, best kept (>= 3)")
    args = parser.parse_args(argv)
    layers = args.layers or (1 if args.quick else 2)
    experts = args.experts or (32 if args.quick else 128)
    repeats = repeats_for(args.quick, args.repeats)
    machine = Machine(repeats)

    config = _config(layers, experts)
    model_map = model_map_for(config)
    state = _state(model_map)
    leaves = list(flatten_params(state).values())
    total = sum(int(np.prod(leaf.shape)) * 2 for leaf in leaves)
    source = NNXRefitSource(state, model_map)
    views = NNXRefitSource(state, model_map, contiguous=False)
    manifest = source.prepare_refit_info()
    largest = max(int(np.prod(s)) * 2 for s, _ in manifest.values())
    staging = torch.empty(largest, dtype=torch.uint8)
    staging.fill_(0)

    runs = {
        "baseline": _best(lambda: _baseline(leaves, staging), repeats),
        "refit": _best(lambda: _sink(source.iter_weights(), staging), repeats),
        "refit_views": _best(lambda: _sink(views.iter_weights(), staging), repeats),
        "refit_no_sink": _best(lambda: _sink(source.iter_weights(), None), repeats),
    }
    for name, (_, nbytes, _) in runs.items():
        assert nbytes == total, (name, nbytes, total)

    _manifest_cost(2)  # warm-up: first-call costs are not per-tensor costs
    full_s, full_n = min(_manifest_cost(48) for _ in range(3))
    quarter_s, quarter_n = min(_manifest_cost(12) for _ in range(3))
    machine.finish()

    base_s = runs["baseline"][0]
    result: dict[str, Any] = {
        "benchmark": "refit_jax",
        "model": "qwen3-30b-a3b",
        "layers": layers,
        "experts": experts,
        "dtype": "bfloat16",
        "jax_backend": jax.default_backend(),
        "state_bytes": total,
        "jax_arrays": len(leaves),
        "hf_tensors": len(manifest),
        **machine.fields(),
    }
    for name, (secs, nbytes, count) in runs.items():
        result[f"{name}_s"] = secs
        result[f"{name}_gbps"] = nbytes / secs / GB
        result[f"{name}_tensors"] = count
        result[f"{name}_ratio"] = base_s / secs
    result.update(
        manifest_full_tensors=full_n,
        manifest_full_s=full_s,
        manifest_full_us_per_tensor=full_s / full_n * 1e6,
        manifest_quarter_tensors=quarter_n,
        manifest_quarter_s=quarter_s,
        manifest_quarter_us_per_tensor=quarter_s / quarter_n * 1e6,
        manifest_per_tensor_ratio=(full_s / full_n) / (quarter_s / quarter_n),
    )

    console = Console()
    console.print(
        f"Qwen3-30B-A3B dims, [bold]{layers} of 48 layers, {experts} of 128 experts[/], bf16, "
        f"jax backend {result['jax_backend']}: {total / GB:.2f} GB in {len(leaves)} JAX arrays "
        f"→ {len(manifest)} HF tensors"
    )
    table = Table(
        "run", "seconds", "GB/s", "tensors", "ratio vs baseline", caption=machine.caption()
    )
    labels = {
        "baseline": "baseline: np.asarray + staging copy",
        "refit": "refit: iter_weights + staging copy",
        "refit_views": "refit, contiguous=False: strided views → staging",
        "refit_no_sink": "refit: iter_weights only",
    }
    for name, label in labels.items():
        table.add_row(
            label,
            f"{result[f'{name}_s']:.3f}",
            f"{result[f'{name}_gbps']:.2f}",
            str(result[f"{name}_tensors"]),
            f"{result[f'{name}_ratio']:.2f}",
        )
    console.print(table)
    scale = Table("manifest (shapes only, map build included)", "tensors", "seconds", "µs/tensor")
    scale.add_row(
        "48 layers (full model)", str(full_n), f"{full_s:.3f}", f"{full_s / full_n * 1e6:.1f}"
    )
    scale.add_row(
        "12 layers", str(quarter_n), f"{quarter_s:.3f}", f"{quarter_s / quarter_n * 1e6:.1f}"
    )
    console.print(scale)
    console.print(f"per-tensor cost, 48 vs 12 layers: {result['manifest_per_tensor_ratio']:.2f}x")
    if (warning := machine.warning()) is not None:
        console.print(warning, soft_wrap=True)  # one line, for grep
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
