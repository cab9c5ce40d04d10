"""HTTP refit throughput and per-request overhead against the SGLang test server.

One process drives a real ``aiosync.testing.sglang_server`` process on
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
* **bounds**: what the machine allows any refit that copies each byte twice
  (``bound: two copies at once``: the pack and the load copy run concurrently
  in two threads; memcpy over that time is the ratio no such refit beats, 0.5
  where concurrent copies share the memory bandwidth) and what the server's
  side alone costs (``bound: load from a fresh mapping``: the load out of a
  newly mapped read-only segment, unmap included, as SGLang maps every
  request's payload anew: a page fault per 4 KiB page, at most 16 mapped per
  fault, and the page tables torn down after), and both at once (``bound: pack
  ∥ load from a fresh mapping``: a pipelined refit without any request);
* **per-request overhead**: the same refit cut into ~1, 10 and 100 buckets;
  the extra time per extra request, ms, next to one ``/model_info``
  round trip (mean of 50).

Refit and memcpy times are the best of ``--repeats`` (at least 3; 1 when
``--quick``), after one warm-up; the 1-minute load average at start and end is
recorded (``_machine``).

``--trace``: after the timed runs, one more sync of the main refit with the
transport's trace on (``HTTPWeightSynchronizer(trace=True)``; the timed runs
never trace) and a timeline table: for each bucket, in ms since the sync
started, the trainer's pack (reading the source included), request posted and
answer received, and the server's stamps from its request log (``times``:
headers read, payload decoded and mapped, ``load_weights`` done, answer
written), then the sync's phases (weights woken, last bucket answered, cache
flushed, version set). Both processes stamp ``time.monotonic()``
(``CLOCK_MONOTONIC`` on Linux, one clock for the host), so the columns compare.
The last column, ``pack k+1 ∥ load k``, is how long the trainer packed bucket
``k+1`` while the server decoded and loaded bucket ``k``, ms (0: no
pipelining). The JSON then carries the raw ``trace``.

Usage: ``python benchmarks/sglang_http.py [--quick] [--json] [--repeats N]
[--bucket-mb MB] [--server-threads N] [--trace]``.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from _machine import Machine, repeats_for
from rich.console import Console
from rich.table import Table

from aiosync import SGLangHTTPBackend
from aiosync._config import DEFAULT_BUCKET_BYTES
from aiosync.sources import RefitManifest
from aiosync.testing import StateDictSource
from aiosync.transports.http import HTTPWeightSynchronizer
from aiosync.transports.http._segment import Segment
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


def _start_server(
    config: dict[str, Any], workdir: Path, *extra: str
) -> tuple[subprocess.Popen[bytes], str]:
    (workdir / "config.json").write_text(json.dumps(config))
    port_file = workdir / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aiosync.testing.sglang_server",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--model-config",
            str(workdir / "config.json"),
            "--dtype",
            "bfloat16",
            *extra,
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


def _random_source(url: str) -> tuple[StateDictSource, int]:
    """A source of random tensors of the test server's manifest (``/_aiosync/manifest``)
    at ``url``, and its bytes: content does not change the bytes' path."""
    raw = httpx.get(f"{url}/_aiosync/manifest", timeout=60).json()
    manifest: RefitManifest = {
        name: (tuple(shape), getattr(torch, dtype)) for name, shape, dtype in raw
    }
    source = StateDictSource.random(manifest)
    return source, sum(t.numel() * t.element_size() for t in source.state_dict.values())


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
    source: StateDictSource, url: str, bucket_bytes: int, repeats: int, trace: bool = False
) -> tuple[float, int, dict[str, Any] | None]:
    """Best seconds of ``repeats`` syncs (after one warm-up), the bucket count, and
    (``trace``) the trainer's and the server's stamps of one more sync, else None."""
    async with SGLangHTTPBackend(url) as backend:
        sync = HTTPWeightSynchronizer(source, backend, bucket_bytes=bucket_bytes)
        await sync.init_communicator()
        times = []
        for _ in range(repeats + 1):  # the first one warms the connection and caches
            await sync.mark_stale()
            start = time.perf_counter()
            await sync.sync_weights()
            times.append(time.perf_counter() - start)
        traced = None
        if trace:
            sync.trace = True
            async with httpx.AsyncClient(base_url=url, timeout=60) as admin:
                (await admin.post("/_aiosync/reset")).raise_for_status()
                await sync.mark_stale()
                await sync.sync_weights()
                log = (await admin.get("/_aiosync/log")).json()
            traced = {"trainer": sync.last_trace, "server": log}
        await sync.shutdown()
        return min(times[1:]), len(sync.plan), traced


def _timeline(trace: dict[str, Any]) -> dict[str, Any]:
    """Per bucket, the trainer's and the server's stamps in ms since the sync started,
    and ``overlap_ms``: how long packing bucket ``k+1`` ran while the server decoded
    and loaded bucket ``k`` (None for the last bucket); then the sync's phases."""
    trainer = trace["trainer"]
    updates = [e for e in trace["server"] if e["path"] == "/update_weights_from_tensor"]
    flushes = [e for e in trace["server"] if e["path"] == "/flush_cache"]
    t0 = trainer["phases"]["start"]

    def ms(value: float | None) -> float | None:
        return None if value is None else round(1e3 * (value - t0), 2)

    rows = []
    buckets = trainer["buckets"]
    for k, row in enumerate(buckets):
        server = updates[k]["times"] if k < len(updates) else {}
        overlap = None
        if k + 1 < len(buckets) and server:
            after = buckets[k + 1]
            start = max(after["pack_start"], server["start"])
            end = min(after["pack_end"], server["loaded"])
            overlap = round(1e3 * max(0.0, end - start), 2)
        rows.append(
            {
                "seq": row["seq"],
                "mib": round(row["bytes"] / 2**20, 2),
                "pack_start": ms(row["pack_start"]),
                "packed": ms(row["packed"]),
                "pack_end": ms(row["pack_end"]),
                "posted": ms(row["posted"]),
                "server_start": ms(server.get("start")),
                "server_decoded": ms(server.get("decoded")),
                "server_loaded": ms(server.get("loaded")),
                "server_answered": ms(server.get("answered")),
                "answered": ms(row["answered"]),
                "overlap_ms": overlap,
            }
        )
    phases = {name: ms(t) for name, t in trainer["phases"].items()}
    if flushes:
        phases["server_flush_start"] = ms(flushes[-1]["times"]["start"])
    return {"buckets": rows, "phases": phases}


def _print_timeline(timeline: dict[str, Any], nbytes: int) -> None:
    table = Table(
        title=f"one traced sync of {nbytes / GB:.3f} GB: ms since the sync started",
        caption="trainer: pack (source read–copied), posted, answered; server: headers read, "
        "decoded, loaded, answer written (time.monotonic)",
    )
    columns = ("bucket", "MiB", "pack", "posted", "srv start", "decoded", "loaded", "srv ans")
    for column in (*columns, "answered", "pack k+1 ∥ load k"):
        table.add_column(column, justify="right", no_wrap=True)

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for line in timeline["buckets"]:
        table.add_row(
            str(line["seq"]),
            f"{line['mib']:g}",
            f"{fmt(line['pack_start'])}–{fmt(line['pack_end'])}",
            fmt(line["posted"]),
            fmt(line["server_start"]),
            fmt(line["server_decoded"]),
            fmt(line["server_loaded"]),
            fmt(line["server_answered"]),
            fmt(line["answered"]),
            fmt(line["overlap_ms"]),
        )
    Console(width=140).print(table)  # wider than a pipe's default 80 columns
    print("phases (ms):", ", ".join(f"{k} {fmt(v)}" for k, v in timeline["phases"].items()))


async def _round_trip_ms(url: str, repeats: int = 50) -> float:
    async with SGLangHTTPBackend(url) as backend:
        await backend.get_weight_version()
        start = time.perf_counter()
        for _ in range(repeats):
            await backend.get_weight_version()
        return (time.perf_counter() - start) / repeats * 1e3


def _memcpy_s(source: StateDictSource, repeats: int) -> float:
    total = sum(t.numel() * t.element_size() for t in source.state_dict.values())
    out = torch.empty(total, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        offset = 0
        for tensor in source.state_dict.values():
            raw = tensor.reshape(-1).view(torch.uint8)
            out[offset : offset + raw.numel()].copy_(raw)
            offset += raw.numel()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def _bounds_s(source: StateDictSource, repeats: int) -> tuple[float, float, float]:
    """What bounds an HTTP refit on this machine, seconds (best of ``repeats`` after one
    warm-up): ``(two, fresh, both)``.

    ``two``: the pack and the load copy at once (two threads, each copying every
    byte once, as the pipelined refit does in two processes): where concurrent
    copies share the memory bandwidth it is twice the memcpy, and no refit that
    copies each byte twice beats memcpy / ``two``. ``fresh``: the server's load
    of every byte out of a fresh read-only mapping of one bucket segment, unmap
    included, as SGLang maps each request's payload anew (page faults and
    page-table teardown for every 4 KiB page): memcpy / ``fresh`` bounds the
    refit even when the trainer's side were free. ``both``: the pack copy and
    that load at once, what a pipelined refit does without any request.
    """
    flats = [t.reshape(-1).view(torch.uint8) for t in source.state_dict.values()]
    total = sum(f.numel() for f in flats)
    outs = [torch.zeros(total, dtype=torch.uint8) for _ in range(2)]

    def copy_all(out: torch.Tensor) -> None:
        offset = 0
        for raw in flats:
            out[offset : offset + raw.numel()].copy_(raw)
            offset += raw.numel()

    def best(pool: ThreadPoolExecutor, *jobs: Callable[[], None]) -> float:
        seconds = float("inf")
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for future in [pool.submit(job) for job in jobs]:
                future.result()
            seconds = min(seconds, time.perf_counter() - start)
        return seconds

    segment = Segment.create(total)
    try:
        packed = segment.view(total, torch.uint8)
        copy_all(packed)

        def load_fresh() -> None:
            mapped = torch.from_file(segment.path, False, total, dtype=torch.uint8)
            outs[1].copy_(mapped)

        with ThreadPoolExecutor(2) as pool:
            two = best(pool, lambda: copy_all(outs[0]), lambda: copy_all(outs[1]))
            fresh = best(pool, load_fresh)
            both = best(pool, lambda: copy_all(outs[0]), load_fresh)
    finally:
        segment.close()
    return two, fresh, both


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~31 MB manifest, < 1 minute")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (best; >= 3)")
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=DEFAULT_BUCKET_BYTES / 2**20,
        help="bucket size of the main refit, MiB (default: the synchronizer's)",
    )
    parser.add_argument(
        "--trace", action="store_true", help="one more traced sync: a per-bucket timeline"
    )
    parser.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="the test server's torch threads (its --threads; default 1)",
    )
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
        proc, url = _start_server(config, Path(tmp), "--threads", str(args.server_threads))
        try:
            raw = httpx.get(f"{url}/_aiosync/manifest", timeout=60).json()
            manifest: RefitManifest = {
                name: (tuple(shape), getattr(torch, dtype)) for name, shape, dtype in raw
            }
            # Content is irrelevant to throughput: random tensors of the server's manifest.
            source = StateDictSource.random(manifest)
            nbytes = sum(t.numel() * t.element_size() for t in source.state_dict.values())
            memcpy_s = _memcpy_s(source, args.repeats)
            two_s, fresh_s, both_s = _bounds_s(source, args.repeats)
            bucket_bytes = int(args.bucket_mb * 2**20)
            refit_s, refit_buckets, trace = asyncio.run(
                _time_sync(source, url, bucket_bytes, args.repeats, args.trace)
            )
            rtt_ms = asyncio.run(_round_trip_ms(url))
            per_count: dict[int, tuple[int, float]] = {}
            for n in (1, 10, 100):
                t, actual, _ = asyncio.run(
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
        "bound: two copies at once (pack ∥ load)",
        f"{2 * nbytes / two_s / GB:.2f} GB/s",
        f"{memcpy_s / two_s:.2f}",
    )
    table.add_row(
        "bound: load from a fresh mapping",
        f"{nbytes / fresh_s / GB:.2f} GB/s",
        f"{memcpy_s / fresh_s:.2f}",
    )
    table.add_row(
        "bound: pack ∥ load from a fresh mapping",
        f"{nbytes / both_s / GB:.2f} GB/s",
        f"{memcpy_s / both_s:.2f}",
    )
    table.add_row(
        f"HTTP refit ({refit_buckets} bucket(s) of <= {args.bucket_mb:g} MiB)",
        f"{refit_gbps:.2f} GB/s",
        f"{refit_gbps / memcpy_gbps:.2f}",
    )
    table.add_row("GET round trip", f"{rtt_ms:.2f} ms", "")
    for n, (actual, t) in per_count.items():
        extra = f"{overhead[n]:.2f} ms/extra request" if actual > base_n else "-"
        table.add_row(f"refit in {actual} buckets", f"{t * 1e3:.1f} ms", extra)
    Console().print(table)
    timeline = None if trace is None else _timeline(trace)
    if timeline is not None:
        _print_timeline(timeline, nbytes)
    if (warning := machine.warning()) is not None:
        print(warning)
    result = {
        "bytes": nbytes,
        "tensors": len(manifest),
        "memcpy_gbps": memcpy_gbps,
        "bound_two_copies": memcpy_s / two_s,
        "bound_fresh_mapping": memcpy_s / fresh_s,
        "bound_pack_and_fresh_load": memcpy_s / both_s,
        "http_refit_gbps": refit_gbps,
        "http_vs_memcpy": refit_gbps / memcpy_gbps,
        "http_refit_buckets": refit_buckets,
        "server_threads": args.server_threads,
        "bucket_bytes": bucket_bytes,
        "round_trip_ms": rtt_ms,
        "buckets": {
            str(n): {"actual": a, "seconds": t, "overhead_ms_per_extra_request": overhead[n]}
            for n, (a, t) in per_count.items()
        },
        "quick": args.quick,
        **machine.fields(),
    }
    if trace is not None:
        result["timeline"] = timeline
        result["trace"] = trace
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
