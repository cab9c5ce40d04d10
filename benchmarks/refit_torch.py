"""Gather+pack throughput of the torch refit seam on real model shapes.

For a Qwen3-0.6B-shaped and a Qwen3-30B-A3B-shaped model (the published
config.json fields, kept in ``aiosync/_model_shapes.py``, cut to a few layers),
this measures, in one process:

* **refit**: ``DTensorRefitSource.iter_weights()`` (checkpoint names, per-expert
  split, fp32 master → bf16 cast) streamed into a reused bucket buffer with
  ``aiosync.transports.packing.pack``: GB/s of payload, and the peak extra memory above
  the model (must stay ≤ 2 buckets, whatever the model size);
* **baseline**: a plain ``torch.cat`` of the same (already cast) tensors into one
  buffer, i.e. a memcpy of the whole model, and its peak extra memory;
* **manifest scaling** (case C10): ``prepare_refit_info()`` + ``plan_buckets`` +
  a name-only ``iter_weights()`` pass on the *full* Qwen3-30B-A3B (48 layers,
  ~18,900 checkpoint tensors) built on the meta device, against a quarter of its
  layers: the cost per tensor must not grow with the tensor count.

Refit and baseline times are the best of ``--repeats`` (at least 3; 1 when
``--quick``); the 1-minute load average at start and end is recorded (``_machine``).

Usage: ``python benchmarks/refit_torch.py [--quick] [--json] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import Any

import torch
from _machine import Machine, repeats_for
from rich.console import Console
from rich.table import Table

from aiosync._model_shapes import MODEL_CONFIGS
from aiosync.refit import DTensorRefitSource
from aiosync.transports.packing import BucketPlan, pack, plan_buckets

GB = 1e9
MiB = 1 << 20
#: RSS sampling sees allocator bookkeeping and page granularity on top of the tensors.
PEAK_SLACK_BYTES = 32 * MiB


def _config(name: str, layers: int, experts: int | None) -> Any:
    from transformers import AutoConfig

    raw = dict(MODEL_CONFIGS[name])  # the published config.json fields
    model_type = raw.pop("model_type")
    raw.pop("torch_dtype", None)
    raw["num_hidden_layers"] = layers
    if experts is not None:
        raw["num_experts"] = experts
    return AutoConfig.for_model(model_type, **raw)


def _build(config: Any, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The model with real shapes; weights filled with a constant (content does not
    matter for copy throughput, and filling touches every page before timing)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    return model


class _PeakMemory:
    """Peak bytes above the level at entry: CUDA allocator stats, or sampled RSS on CPU."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> _PeakMemory:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            self._base = self._rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss() - self._base)
            time.sleep(0.0005)

    def __exit__(self, *exc: object) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self.peak = max(self.peak, self._rss() - self._base)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _refit_pass(source: DTensorRefitSource, plan: BucketPlan, staging: torch.Tensor) -> int:
    """Stream the source into the staging buffer bucket by bucket; returns checksum bytes.

    ``pack`` consumes the stream lazily, so one bucket's buffer plus the tensor
    being copied is all that is alive (a transport sends ``staging`` per bucket).
    """
    stream = source.iter_weights()
    touched = 0
    for bucket in plan.buckets:
        buffer = pack(bucket, islice(stream, len(bucket.slots)), out=staging)
        touched += int(buffer[:1].sum().item()) if buffer.numel() else 0
    if next(stream, None) is not None:
        raise RuntimeError("source yielded more tensors than the plan")
    return touched


@dataclass
class Result:
    model: str
    layers: int
    experts: int | None
    tensors: int
    payload_bytes: int
    bucket_bytes: int
    largest_buffer_bytes: int  # the plan's largest bucket (a lone oversized tensor's size)
    refit_s: float
    cat_s: float
    refit_peak_bytes: int  # staging buffer included
    cat_peak_bytes: int

    @property
    def refit_peak_buffers(self) -> float:
        return self.refit_peak_bytes / self.largest_buffer_bytes

    @property
    def refit_peak_ok(self) -> bool:
        """Within 2 largest buffers (staging + one cast tensor), plus allocator slack."""
        return self.refit_peak_bytes <= 2 * self.largest_buffer_bytes + PEAK_SLACK_BYTES

    @property
    def refit_gbps(self) -> float:
        return self.payload_bytes / self.refit_s / GB

    @property
    def cat_gbps(self) -> float:
        return self.payload_bytes / self.cat_s / GB


def _best(fn: Callable[[], object], repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_model(
    name: str,
    layers: int,
    experts: int | None,
    *,
    master: torch.dtype,
    engine: torch.dtype,
    bucket_bytes: int,
    repeats: int,
    device: str,
) -> Result:
    model = _build(_config(name, layers, experts), master, device)
    source = DTensorRefitSource(model, dtype=engine)
    manifest = source.prepare_refit_info()
    plan = plan_buckets(manifest, bucket_bytes)
    warmup = torch.empty(plan.max_bucket_nbytes, dtype=torch.uint8, device=device)
    _refit_pass(source, plan, warmup)  # first-touch of the weights' pages, caches
    del warmup
    with _PeakMemory(device) as refit_mem:  # the staging buffer counts as extra memory
        staging = torch.zeros(plan.max_bucket_nbytes, dtype=torch.uint8, device=device)
        refit_s = _best(partial(_refit_pass, source, plan, staging), repeats, device)
        del staging
    # Baseline: the same tensors, already cast, concatenated in one call.
    tensors = [t.reshape(-1).view(torch.uint8) for _, t in source.iter_weights()]
    torch.cat(tensors)  # warm-up
    gc.collect()
    with _PeakMemory(device) as cat_mem:
        cat_s = _best(partial(torch.cat, tensors), repeats, device)
    result = Result(
        model=name,
        layers=layers,
        experts=experts,
        tensors=len(manifest),
        payload_bytes=plan.total_bytes,
        bucket_bytes=bucket_bytes,
        largest_buffer_bytes=plan.max_bucket_nbytes,
        refit_s=refit_s,
        cat_s=cat_s,
        refit_peak_bytes=refit_mem.peak,
        cat_peak_bytes=cat_mem.peak,
    )
    del tensors, source, model
    gc.collect()
    return result


def _name_pass(source: DTensorRefitSource) -> tuple[int, float, float]:
    """(tensors, manifest+plan seconds, name-only iter seconds) on a meta model."""
    t0 = time.perf_counter()
    manifest = source.prepare_refit_info()
    plan_buckets(manifest, 512 * MiB)
    t1 = time.perf_counter()
    count = sum(1 for _ in source.iter_weights())  # meta tensors: names and views only
    t2 = time.perf_counter()
    assert count == len(manifest)
    return count, t1 - t0, t2 - t1


def bench_manifest_scaling(layers_small: int, layers_full: int) -> dict[str, float]:
    """C10: per-tensor cost of names/manifest at two model depths (meta device, no data)."""
    from transformers import AutoModelForCausalLM

    out: dict[str, float] = {}
    for tag, layers in (("small", layers_small), ("full", layers_full)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                _config("qwen3-30b-a3b", layers, None), dtype=torch.bfloat16
            )
        count, prep_s, iter_s = _name_pass(DTensorRefitSource(model))
        out[f"{tag}_layers"] = layers
        out[f"{tag}_tensors"] = count
        out[f"{tag}_manifest_s"] = prep_s
        out[f"{tag}_iter_s"] = iter_s
        out[f"{tag}_us_per_tensor"] = (prep_s + iter_s) / count * 1e6
        del model
    out["per_tensor_cost_ratio_full_vs_small"] = (
        out["full_us_per_tensor"] / out["small_us_per_tensor"]
    )
    return out


def _plans(quick: bool) -> Iterator[tuple[str, int, int | None]]:
    if quick:
        yield "qwen3-0.6b", 1, None
        yield "qwen3-30b-a3b", 1, 8
    else:  # needs ~12 GB of host memory (fp32 master weights + the cat baseline)
        yield "qwen3-0.6b", 4, None
        yield "qwen3-30b-a3b", 1, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, < 1 minute")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bucket-mib", type=int, default=None, help="bucket size, MiB")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (best; >= 3)")
    args = parser.parse_args(argv)
    bucket_bytes = (args.bucket_mib or (64 if args.quick else 256)) * MiB
    repeats = repeats_for(args.quick, args.repeats)
    machine = Machine(repeats)
    console = Console(file=sys.stderr if args.json else sys.stdout, width=160)

    results = [
        bench_model(
            name,
            layers,
            experts,
            master=torch.float32,
            engine=torch.bfloat16,
            bucket_bytes=bucket_bytes,
            repeats=repeats,
            device=args.device,
        )
        for name, layers, experts in _plans(args.quick)
    ]
    scaling = bench_manifest_scaling(*((6, 24) if args.quick else (12, 48)))
    machine.finish()

    table = Table(
        title=f"refit gather+pack vs torch.cat ({args.device}, fp32 master → bf16)",
        caption=machine.caption(),
    )
    for col in (
        "model",
        "layers",
        "experts",
        "tensors",
        "payload MB",
        "refit GB/s",
        "cat GB/s",
        "ratio",
        "largest buffer MB",
        "refit peak / buffer",
        "cat peak / buffer",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r.model,
            str(r.layers),
            "all" if r.experts is None else str(r.experts),
            str(r.tensors),
            f"{r.payload_bytes / 1e6:.0f}",
            f"{r.refit_gbps:.2f}",
            f"{r.cat_gbps:.2f}",
            f"{r.refit_gbps / r.cat_gbps:.2f}",
            f"{r.largest_buffer_bytes / 1e6:.0f}",
            f"{r.refit_peak_buffers:.2f}" + (" ok" if r.refit_peak_ok else " >2!"),
            f"{r.cat_peak_bytes / r.largest_buffer_bytes:.2f}",
        )
    console.print(table)
    console.print(
        f"bucket {bucket_bytes // MiB} MiB (an embedding larger than that travels alone: the "
        "largest buffer is its size). ratio = refit GB/s / torch.cat GB/s; the cat is a bare "
        "memcpy of tensors already cast, the refit also casts, renames and splits experts. "
        "Peaks are extra memory above the model, staging buffer included (must be <= 2 "
        "largest buffers); layers cut from the real configs as shown."
    )
    console.print(
        f"C10 manifest scaling (qwen3-30b-a3b on meta): {scaling['small_tensors']:.0f} tensors "
        f"{scaling['small_us_per_tensor']:.1f} µs/tensor, {scaling['full_tensors']:.0f} tensors "
        f"{scaling['full_us_per_tensor']:.1f} µs/tensor; ratio "
        f"{scaling['per_tensor_cost_ratio_full_vs_small']:.2f} (1.0 = linear)"
    )
    if (warning := machine.warning()) is not None:
        console.print(warning)
    if args.json:
        print(
            json.dumps(
                {
                    "device": args.device,
                    "bucket_bytes": bucket_bytes,
                    **machine.fields(),
                    "models": [
                        {
                            "model": r.model,
                            "layers": r.layers,
                            "experts": r.experts,
                            "tensors": r.tensors,
                            "payload_bytes": r.payload_bytes,
                            "refit_s": r.refit_s,
                            "cat_s": r.cat_s,
                            "refit_gbps": r.refit_gbps,
                            "cat_gbps": r.cat_gbps,
                            "ratio_refit_vs_cat": r.refit_gbps / r.cat_gbps,
                            "refit_peak_extra_bytes": r.refit_peak_bytes,
                            "cat_peak_extra_bytes": r.cat_peak_bytes,
                            "largest_buffer_bytes": r.largest_buffer_bytes,
                            "refit_peak_in_buffers": r.refit_peak_buffers,
                            "refit_peak_within_2_buffers": r.refit_peak_ok,
                            "cat_peak_in_buffers": r.cat_peak_bytes / r.largest_buffer_bytes,
                        }
                        for r in results
                    ],
                    "manifest_scaling": scaling,
                }
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
