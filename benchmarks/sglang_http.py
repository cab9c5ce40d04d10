"""HTTP refit throughput and per-request overhead against the SGLang test server.

One process drives a real ``aiosync.engines.sglang.test_server`` process on
127.0.0.1 (the embedded transformers engine behind SGLang's HTTP API) and
measures:

* **refit**: ``HTTPWeightSynchronizer.sync_weights()`` of a ~1 GB bf16 manifest
  (``--quick``: ~30 MB): packing into shared-memory buckets, one
  ``/update_weights_from_tensor`` per bucket, the server's ``load_weights``
  copy, ``/flush_cache``. GB/s of payload;
* **baseline**: a memcpy of the same bytes in this process (every tensor copied
  into one preallocated buffer), GB/s; the ratio refit/memcpy says what the
  HTTP path costs on top of the copies it cannot avoid (it makes two: pack on
  the trainer side, load on the server side);
* **per-request overhead**: the same refit cut into ~1, 10 and 100 buckets;
  the extra time per extra request, ms, next to one ``/get_weight_version``
  round trip (mean of 50).

Refit and memcpy times are the best of ``--repeats`` (at least 3; 2 when
``--quick``), after one warm-up; the 1-minute load average at start and end is
recorded (``_machine``).

Usage: ``python benchmarks/sglang_http.py [--quick] [--json] [--repeats N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch
from _machine import Machine, repeats_for
from rich.console import Console
from rich.table import Table

from aiosync import SGLangHTTPBackend
from aiosync.interfaces import RefitManifest, RefitSource
from aiosync.transports.http import HTTPWeightSynchronizer
from aiosync.transports.http._wire import plan_flat_buckets

REPO = Path(__file__).resolve().parent.parent
GB = 1e9

#: ~1.08 GB of bf16 checkpoint tensors (30 layers, 333 tensors).
FULL = {
    "model_type": "qwen3",
    "vocab_size": 32768,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "tie_word_embeddings": False,
}
#: ~31 MB, still >= 100 tensors so 100 buckets exist.
QUICK = {
    **FULL,
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 10,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


class _Source(RefitSource):
    """Fixed tensors in the server's manifest (content is irrelevant to throughput)."""

    def __init__(self, manifest: RefitManifest) -> None:
        self.manifest = manifest
        gen = torch.Generator().manual_seed(0)
        self.tensors = {
            name: torch.rand(shape, generator=gen).to(dtype)
            for name, (shape, dtype) in manifest.items()
        }

    def prepare_refit_info(self) -> RefitManifest:
        return dict(self.manifest)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()


def _start_server(config: dict[str, Any], workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    (workdir / "config.json").write_text(json.dumps(config))
    port_file = workdir / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aiosync.engines.sglang.test_server",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--model-config",
            str(workdir / "config.json"),
            "--dtype",
            "bfloat16",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    deadline = time.monotonic() + 900
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the test server did not start")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}"


def _bucket_bytes_for(manifest: RefitManifest, buckets: int) -> int:
    """The bucket size whose plan has the bucket count closest to ``buckets``."""
    total = sum(torch.Size(s).numel() * d.itemsize for s, d in manifest.values())
    best, best_gap = total, None
    size = float(total) * 2
    while size >= 512:  # geometric sweep; planning is cheap
        gap = abs(len(plan_flat_buckets(manifest, int(size))) - buckets)
        if best_gap is None or gap < best_gap:
            best, best_gap = int(size), gap
        size /= 1.15
    return best


async def _time_sync(
    source: _Source, url: str, bucket_bytes: int, repeats: int
) -> tuple[float, int]:
    async with SGLangHTTPBackend(url) as backend:
        sync = HTTPWeightSynchronizer(source, backend, bucket_bytes=bucket_bytes)
        await sync.init_communicator()
        times = []
        for _ in range(repeats + 1):  # the first one warms the connection and caches
            await sync.mark_stale()
            start = time.perf_counter()
            await sync.sync_weights()
            times.append(time.perf_counter() - start)
        return min(times[1:]), len(sync.plan)


async def _round_trip_ms(url: str, repeats: int = 50) -> float:
    async with SGLangHTTPBackend(url) as backend:
        await backend.get_weight_version()
        start = time.perf_counter()
        for _ in range(repeats):
            await backend.get_weight_version()
        return (time.perf_counter() - start) / repeats * 1e3


def _memcpy_s(source: _Source, repeats: int) -> float:
    total = sum(t.numel() * t.element_size() for t in source.tensors.values())
    out = torch.empty(total, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        offset = 0
        for tensor in source.tensors.values():
            raw = tensor.reshape(-1).view(torch.uint8)
            out[offset : offset + raw.numel()].copy_(raw)
            offset += raw.numel()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~31 MB manifest, < 1 minute")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (best; >= 3)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads here (the server uses 1); more than the free cores makes "
        "OpenMP spin and every copy crawl on a shared machine",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = Machine(repeats_for(args.quick, args.repeats))
    args.repeats = machine.repeats
    config = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start_server(config, Path(tmp))
        try:
            raw = httpx.get(f"{url}/_aiosync/manifest", timeout=60).json()
            manifest: RefitManifest = {
                name: (tuple(shape), getattr(torch, dtype)) for name, shape, dtype in raw
            }
            source = _Source(manifest)
            nbytes = sum(t.numel() * t.element_size() for t in source.tensors.values())
            memcpy_s = _memcpy_s(source, args.repeats)
            refit_s, refit_buckets = asyncio.run(
                _time_sync(source, url, 512 * 1024 * 1024, args.repeats)
            )
            rtt_ms = asyncio.run(_round_trip_ms(url))
            per_count: dict[int, tuple[int, float]] = {}
            for n in (1, 10, 100):
                t, actual = asyncio.run(
                    _time_sync(source, url, _bucket_bytes_for(manifest, n), args.repeats)
                )
                per_count[n] = (actual, t)
        finally:
            proc.terminate()
            proc.wait(60)
    machine.finish()

    refit_gbps = nbytes / refit_s / GB
    memcpy_gbps = nbytes / memcpy_s / GB
    base_n, base_t = per_count[1]
    overhead = {
        n: ((t - base_t) / (actual - base_n) * 1e3 if actual > base_n else 0.0)
        for n, (actual, t) in per_count.items()
    }
    table = Table(
        title=f"HTTP refit, {nbytes / GB:.3f} GB bf16, {len(manifest)} tensors",
        caption=machine.caption(),
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("ratio", justify="right")
    table.add_row("memcpy (baseline)", f"{memcpy_gbps:.2f} GB/s", "1.00")
    table.add_row(
        f"HTTP refit ({refit_buckets} bucket(s) of <= 512 MiB)",
        f"{refit_gbps:.2f} GB/s",
        f"{refit_gbps / memcpy_gbps:.2f}",
    )
    table.add_row("GET round trip", f"{rtt_ms:.2f} ms", "")
    for n, (actual, t) in per_count.items():
        extra = f"{overhead[n]:.2f} ms/extra request" if actual > base_n else "-"
        table.add_row(f"refit in {actual} buckets", f"{t * 1e3:.1f} ms", extra)
    Console().print(table)
    if (warning := machine.warning()) is not None:
        print(warning)
    result = {
        "bytes": nbytes,
        "tensors": len(manifest),
        "memcpy_gbps": memcpy_gbps,
        "http_refit_gbps": refit_gbps,
        "http_vs_memcpy": refit_gbps / memcpy_gbps,
        "http_refit_buckets": refit_buckets,
        "round_trip_ms": rtt_ms,
        "buckets": {
            str(n): {"actual": a, "seconds": t, "overhead_ms_per_extra_request": overhead[n]}
            for n, (a, t) in per_count.items()
        },
        "quick": args.quick,
        **machine.fields(),
    }
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
