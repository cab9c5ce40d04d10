"""Adapter-only against merged refits of a PEFT LoRA trainer: bytes and time, in one run.

A LoRA trainer (``peft.get_peft_model`` with ``r=16``, ``lora_alpha=32`` on the
attention and MLP projections ``q/k/v/o_proj`` and ``gate/up/down_proj``) refits
its engine in one of two ways (``aiosync/lora.py``):

* **merged**: ``DTensorRefitSource(peft_model)`` streams the base checkpoint with
  ``W + scale · B @ A`` merged on the fly, over the colocated IPC transport
  (``create_weight_synchronizer(..., colocated=True, backend="embedded")``);
* **adapter**: ``LoRAAdapterRefitSource(peft_model)`` sends the ``lora_A``
  ``[r, in]`` and ``lora_B`` ``[out, r]`` tensors alone, which the factory's
  ``LoRAAdapterSynchronizer`` hands to the engine's ``load_lora_adapter``.

Both send bf16 (the engine's dtype; the adapter's fp32 tensors are cast).

1. **Bytes, Qwen3-8B** (computed, exact): the published config.json fields
   (``aiosync/_model_shapes.py``, 36 layers). Adapter bytes are the sum over
   layers and target modules of ``r · (in_features + out_features) · 2``; merged
   bytes are the whole HF checkpoint (every tensor, embeddings and head included).
2. **Time, measured**: the same refits of a model of Qwen3-8B's width cut to
   ``--layers`` decoder layers (2) and a ``--vocab-size`` (8,192) vocabulary,
   built with transformers from the config (random weights, no download; the
   adapter with ``init_lora_weights=False``, so that ``B`` is not zero). Each
   refit is ``sync_weights()`` into its own one-worker bf16
   :class:`~aiosync.EmbeddedEngine` in this process (the two engines are of the
   same kind, built from the same config and seed), after one warm-up refit
   each; the adapter changes before every repeat (outside the timing) and the
   two paths alternate, so a change of load hits both alike. The bytes moved
   (the ``COMMITTED`` events' ``nbytes``) must equal the same formulas applied to
   the cut model's config, or the script fails. ``--quick`` measures a tiny
   Qwen3 (hidden size 256, 2 layers) instead.

Times are ms per refit, the best of ``--repeats`` (at least 3; 1 when
``--quick``); ratios are merged / adapter, for bytes and for time. The embedded
engine applies an adapter with PEFT (``get_peft_model`` on every load), so its
adapter time is the reference engine's, not vLLM's; the 1-minute load average
at start and end is recorded (``_machine``): take the figures on an idle machine.

The file is not called ``peft.py``: run as a script, its folder comes first on
``sys.path`` (also in the engine's spawned workers), where it would shadow the
``peft`` package.

Usage::

    python benchmarks/peft_refit.py            # Qwen3-8B width, 2 layers
    python benchmarks/peft_refit.py --quick    # tiny Qwen3, < 1 minute
    python benchmarks/peft_refit.py --json     # last stdout line: one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections.abc import Mapping
from typing import Any

import torch
from _machine import Machine, repeats_for

from aiosync._model_shapes import MODEL_CONFIGS, ShapeManifest, manifest_bytes, model_manifest

MiB = 1 << 20
#: The model whose real shape the byte figures describe.
MODEL = "qwen3-8b"
#: LoRA rank and alpha (scale = alpha / r = 2).
RANK = 16
LORA_ALPHA = 32
#: Attention and MLP projections: every linear layer of a Qwen3 decoder layer.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: What travels, both ways: the engine's dtype.
DTYPE = "bfloat16"
ITEMSIZE = 2
#: A tiny Qwen3 for ``--quick`` (not a real checkpoint).
QUICK_CONFIG: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "tie_word_embeddings": False,
}
_TARGET = re.compile(
    rf"model\.layers\.\d+\.(?:self_attn|mlp)\.(?:{'|'.join(TARGET_MODULES)})\.weight"
)


def adapter_bytes(manifest: ShapeManifest, rank: int, itemsize: int) -> int:
    """Bytes of a rank-``rank`` adapter on every target module of ``manifest``.

    Each targeted weight ``[out_features, in_features]`` gets ``lora_A``
    ``[rank, in_features]`` and ``lora_B`` ``[out_features, rank]``:
    ``rank · (in_features + out_features) · itemsize`` bytes.
    """
    total = 0
    for name, (shape, _) in manifest.items():
        if _TARGET.fullmatch(name):
            out_features, in_features = shape
            total += rank * (in_features + out_features) * itemsize
    return total


def byte_figures(config: Mapping[str, Any]) -> dict[str, int | float]:
    """``{layers, adapter_bytes, merged_bytes, ratio_bytes}`` of ``config`` in bf16."""
    manifest = model_manifest(dict(config), dtype=DTYPE)
    adapter = adapter_bytes(manifest, RANK, ITEMSIZE)
    merged = manifest_bytes(manifest)
    return {
        "layers": int(config["num_hidden_layers"]),
        "adapter_bytes": adapter,
        "merged_bytes": merged,
        "ratio_bytes": round(merged / adapter, 3),
    }


def measured_config(quick: bool, layers: int, vocab_size: int) -> dict[str, Any]:
    """The config of the timed model: Qwen3-8B's width, cut; or the tiny one."""
    if quick:
        return dict(QUICK_CONFIG)
    config = {k: v for k, v in MODEL_CONFIGS[MODEL].items() if k != "torch_dtype"}
    config.update(num_hidden_layers=layers, vocab_size=vocab_size)
    return config


def build_peft_model(config: Mapping[str, Any]) -> torch.nn.Module:
    """The trainer: a bf16 Qwen3 (the engine's initial weights: same builder, seed 0)
    wrapped with a rank-16 fp32 LoRA adapter whose ``B`` is random, not zero."""
    from peft import LoraConfig, get_peft_model

    from aiosync.engines.embedded.model import HFModelRunner

    base = HFModelRunner.from_config(dict(config), seed=0, dtype=DTYPE).model
    lora = LoraConfig(
        r=RANK,
        lora_alpha=LORA_ALPHA,
        target_modules=list(TARGET_MODULES),
        init_lora_weights=False,
    )
    return get_peft_model(base, lora)


async def _committed_nbytes(events: Any) -> int:
    """Bytes of the next ``COMMITTED`` event (already buffered when the sync returned)."""
    from aiosync import VersionEventKind

    async for event in events:
        if event.kind is VersionEventKind.COMMITTED:
            return int(event.nbytes)
        if event.kind is VersionEventKind.FAILED:
            raise RuntimeError(f"refit failed: {event.error}")
    raise RuntimeError("the event stream ended before a commit")


async def measure(
    config: Mapping[str, Any], repeats: int, bucket_bytes: int
) -> dict[str, int | float]:
    """``{adapter_bytes, merged_bytes, adapter_ms, merged_ms}``: bytes moved per refit
    and the best time of ``repeats`` interleaved refits of each path, ms."""
    from aiosync import EmbeddedEngine, IPCOptions, create_weight_synchronizer
    from aiosync.refit import DTensorRefitSource, LoRAAdapterRefitSource
    from aiosync.transports.ipc import IPCWeightSynchronizer
    from aiosync.transports.lora import LoRAAdapterSynchronizer

    model = build_peft_model(config)
    adapter_params = [p for p in model.parameters() if p.requires_grad]
    merged_source = DTensorRefitSource(model, dtype=torch.bfloat16)
    adapter_source = LoRAAdapterRefitSource(model, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    engines = [
        EmbeddedEngine(dict(config), num_workers=1, seed=0, dtype=DTYPE, threads_per_worker=threads)
        for _ in range(2)
    ]
    async with engines[0] as merged_engine, engines[1] as adapter_engine:
        merged = create_weight_synchronizer(
            merged_source,
            merged_engine,
            colocated=True,
            backend="embedded",
            transport=IPCOptions(bucket_bytes=bucket_bytes),
        )
        adapter = create_weight_synchronizer(
            adapter_source, adapter_engine, colocated=True, backend="embedded"
        )
        assert isinstance(merged, IPCWeightSynchronizer), type(merged).__name__
        assert isinstance(adapter, LoRAAdapterSynchronizer), type(adapter).__name__
        syncs = {"merged": merged, "adapter": adapter}
        best = {"merged": float("inf"), "adapter": float("inf")}
        nbytes: dict[str, set[int]] = {"merged": set(), "adapter": set()}
        async with merged, adapter, merged.subscribe() as m_events, adapter.subscribe() as a_events:
            events = {"merged": m_events, "adapter": a_events}
            for sync in syncs.values():
                await sync.init_communicator()
            for repeat in range(repeats + 1):  # the first is the warm-up, untimed
                with torch.no_grad():  # a new adapter: every refit carries new values
                    for p in adapter_params:
                        p.add_(1e-3)
                order = ("merged", "adapter") if repeat % 2 else ("adapter", "merged")
                for path in order:
                    await syncs[path].mark_stale()
                    start = time.perf_counter()
                    await syncs[path].sync_weights()
                    seconds = time.perf_counter() - start
                    nbytes[path].add(await _committed_nbytes(events[path]))
                    if repeat:
                        best[path] = min(best[path], seconds)
    for path, seen in nbytes.items():
        if len(seen) != 1:
            raise RuntimeError(f"{path} refits moved different byte counts: {sorted(seen)}")
    return {
        "adapter_bytes": nbytes["adapter"].pop(),
        "merged_bytes": nbytes["merged"].pop(),
        "adapter_ms": round(1e3 * best["adapter"], 3),
        "merged_ms": round(1e3 * best["merged"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny Qwen3, < 1 minute")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the timed model")
    parser.add_argument("--vocab-size", type=int, default=8192, help="its vocabulary")
    parser.add_argument("--bucket-mb", type=float, default=128.0, help="IPC staging buffer size")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (best; at least 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    if args.quick:
        args.bucket_mb = min(args.bucket_mb, 16.0)
    repeats = repeats_for(args.quick, args.repeats)
    machine = Machine(repeats)
    bucket_bytes = int(args.bucket_mb * MiB)
    real = byte_figures(MODEL_CONFIGS[MODEL])
    config = measured_config(args.quick, args.layers, args.vocab_size)
    expected = byte_figures(config)
    timed = asyncio.run(measure(config, repeats, bucket_bytes))
    machine.finish()
    for key in ("adapter_bytes", "merged_bytes"):
        if timed[key] != expected[key]:
            raise RuntimeError(f"{key}: the refit moved {timed[key]}, computed {expected[key]}")
    measured = {
        **expected,
        **timed,
        "ratio_time": round(float(timed["merged_ms"]) / float(timed["adapter_ms"]), 3),
        "hidden_size": int(config["hidden_size"]),
        "vocab_size": int(config["vocab_size"]),
    }
    _print_table(real, measured, machine)
    if args.json:
        print(
            json.dumps(
                {
                    "benchmark": "peft_refit",
                    "rank": RANK,
                    "lora_alpha": LORA_ALPHA,
                    "target_modules": list(TARGET_MODULES),
                    "dtype": DTYPE,
                    "bucket_bytes": bucket_bytes,
                    "threads": torch.get_num_threads(),
                    MODEL.replace("-", "_"): real,
                    "measured": measured,
                    **machine.fields(),
                }
            )
        )


def _print_table(
    real: Mapping[str, int | float], measured: Mapping[str, int | float], machine: Machine
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"LoRA r={RANK} on q/k/v/o/gate/up/down: adapter-only vs merged refit ({DTYPE})",
        caption=machine.caption(),
    )
    for column in (
        "model",
        "layers",
        "adapter MB",
        "merged MB",
        "bytes merged/adapter",
        "adapter ms",
        "merged ms",
        "time merged/adapter",
    ):
        table.add_column(column, justify="right")
    table.add_row(
        "Qwen3-8B (computed)",
        str(real["layers"]),
        f"{real['adapter_bytes'] / 1e6:.3f}",
        f"{real['merged_bytes'] / 1e6:.1f}",
        f"{real['ratio_bytes']:.1f}x",
        "-",
        "-",
        "-",
    )
    table.add_row(
        f"hidden {measured['hidden_size']}, vocab {measured['vocab_size']} (measured)",
        str(measured["layers"]),
        f"{measured['adapter_bytes'] / 1e6:.3f}",
        f"{measured['merged_bytes'] / 1e6:.1f}",
        f"{measured['ratio_bytes']:.1f}x",
        f"{measured['adapter_ms']:.1f}",
        f"{measured['merged_ms']:.1f}",
        f"{measured['ratio_time']:.1f}x",
    )
    Console(width=160).print(table)
    print(
        "MB = 1e6 bytes; bytes exact (the measured ones are the refits' own counts); "
        "ms per sync_weights() into a 1-worker embedded engine"
    )
    if (warning := machine.warning()) is not None:
        print(warning)


if __name__ == "__main__":
    main()
