"""Colocated IPC refit throughput against a plain single-process ``copy_`` of the same bytes.

For each manifest size (0.25, 1 and 4 GB by default) the trainer holds bf16
tensors of ``--tensor-mb`` MiB each; one embedded-engine worker process holds
a preallocated copy. Measured in the same run:

* ``copy``: ``dst.copy_(src)`` for every tensor, in this process (the floor a
  refit cannot beat: every byte is read and written once).
* ``ipc``: ``IPCWeightSynchronizer.sync_weights()`` into the worker (pack into
  the shared ping-pong buffers, handles over ZMQ, ``load_weights`` copies out).
* ``ipc direct``: the same sync with the trainer's tensors in named shared memory
  (:func:`aiosync.refit.share_parameters`): no packing, the worker copies from the
  trainer's own memory (direct mode); its bound is one ``copy_``, 1.00 of ``copy``.
* ``bound: 2 copies ∥``: copy_ time over that of two ``copy_`` passes run at
  once in two threads, as the refit's pack and load run at once in two
  processes: no refit that copies every byte twice beats it where concurrent
  copies share the memory bandwidth.

Throughput is manifest bytes / seconds (best of ``--repeats``, at least 3; 2
when ``--quick``), GB = 1e9 bytes. The 1-minute load average at start and end
is printed and recorded (``_machine``): take the figures on an idle machine.
A size is skipped when the machine's available memory is below about 3.5x it.
The staging buffer is the synchronizer's default for each manifest (a share of
free memory, cut so that a refit spans at least 8 buckets: packing and loading
overlap) unless ``--bucket-mb`` sets it; the table gives it per size.

``--trace``: after the timed runs, one more sync per size with the transport's
trace on (``IPCWeightSynchronizer(trace=True)``, off by default; the timed runs
never trace) and a timeline table per size: for each bucket, in ms since the
first bucket's pack started, the trainer's pack start/end (reading the source
included), data sent and last ack received, and the worker's data received,
load start/end and ack sent. Both sides stamp ``time.monotonic()``: on Linux
that is ``CLOCK_MONOTONIC``, one clock for every process of the host, so the
columns compare directly. The last column, ``pack k+1 ∥ load k``, is how long
the trainer packed bucket ``k+1`` while the worker loaded bucket ``k``, ms (0:
no pipelining). The JSON rows then carry the raw ``trace``.

Usage::

    python benchmarks/ipc.py            # 0.25, 1, 4 GB
    python benchmarks/ipc.py --quick    # 64 MB, < 1 minute
    python benchmarks/ipc.py --json     # last stdout line: one JSON object
    python benchmarks/ipc.py --trace    # plus a per-bucket timeline of one sync
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from _machine import Machine, repeats_for

from aiosync.sources import RefitManifest, RefitSource

GB = 1e9
MiB = 1024**2


class FlatModel:
    """Engine-side weights-only model: preallocated tensors, ``load_weights`` copies in."""

    def __init__(self, spec: Mapping[str, Any], *, seed: int = 0, dtype: str = "bfloat16") -> None:
        shape = (int(spec["numel"]),)
        self.weights = {
            name: torch.empty(shape, dtype=getattr(torch, dtype)) for name in _names(spec)
        }
        for tensor in self.weights.values():
            tensor.zero_()  # fault the pages in now, not during the first refit
        self.device = torch.device("cpu")

    def load_weights(self, weights: Any) -> int:
        count = 0
        for name, tensor in weights:
            self.weights[name].copy_(tensor)
            count += 1
        return count


class FlatSource(RefitSource):
    """Trainer-side weights: the same names and shapes as :class:`FlatModel`."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.tensors = {
            name: torch.randn(int(spec["numel"])).to(torch.bfloat16) for name in _names(spec)
        }

    def prepare_refit_info(self) -> RefitManifest:
        return {name: (tuple(t.shape), t.dtype) for name, t in self.tensors.items()}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()


def _names(spec: Mapping[str, Any]) -> list[str]:
    return [f"model.layers.{i}.weight" for i in range(int(spec["count"]))]


def _spec(total_bytes: int, tensor_mb: float) -> dict[str, int]:
    numel = max(1, int(tensor_mb * MiB) // 2)
    return {"count": max(1, total_bytes // (numel * 2)), "numel": numel}


def _available_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _bench_copy(source: FlatSource, repeats: int) -> float:
    dst = {name: torch.empty_like(t).zero_() for name, t in source.tensors.items()}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for name, tensor in source.tensors.items():
            dst[name].copy_(tensor)
        best = min(best, time.perf_counter() - start)
    return best


def _bench_two_copies(source: FlatSource, repeats: int) -> float:
    """Best seconds of two ``copy_`` passes over every tensor at once, in two threads:
    what a pipelined refit does (pack on the trainer, load on the worker, each byte
    copied twice, concurrently). Where concurrent copies share the memory
    bandwidth this is up to twice :func:`_bench_copy`, and copy_ / this bounds
    the IPC ratio."""
    dsts = [{name: torch.empty_like(t).zero_() for name, t in source.tensors.items()} for _ in "ab"]

    def copy_all(dst: dict[str, torch.Tensor]) -> None:
        for name, tensor in source.tensors.items():
            dst[name].copy_(tensor)

    best = float("inf")
    with ThreadPoolExecutor(2) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            for future in [pool.submit(copy_all, dst) for dst in dsts]:
                future.result()
            best = min(best, time.perf_counter() - start)
    return best


def _share(source: FlatSource) -> Any:
    """Re-home ``source``'s tensors into a shared-memory arena (direct mode); returns
    the arena (:class:`aiosync.SharedParameters`), to be closed."""
    from torch import nn

    from aiosync.refit import share_parameters

    holder = nn.Module()
    for i, tensor in enumerate(source.tensors.values()):
        holder.register_parameter(f"p{i}", nn.Parameter(tensor, requires_grad=False))
    shared = share_parameters(holder)
    source.tensors = {
        name: p.detach() for name, p in zip(source.tensors, holder.parameters(), strict=True)
    }
    return shared


async def _bench_ipc(
    source: FlatSource,
    spec: dict[str, int],
    bucket_bytes: int | None,
    repeats: int,
    trace: bool = False,
    direct: bool = False,
) -> tuple[float, int, dict[str, Any] | None]:
    """Best seconds of ``repeats`` IPC syncs, the staging buffer's bytes (None:
    the synchronizer's default for the manifest), and (``trace``) the timeline of
    one more sync (``IPCWeightSynchronizer.last_trace``), else None. ``direct``: the
    source's tensors are in an arena (:func:`_share`) and direct mode is on."""
    from aiosync.engines.embedded.engine import EmbeddedEngine
    from aiosync.transports.ipc import IPCWeightSynchronizer

    engine = EmbeddedEngine(
        spec,
        num_workers=1,
        dtype="bfloat16",
        runner_factory=f"{__name__}.FlatModel",
        threads_per_worker=torch.get_num_threads(),
    )
    sync_cm = IPCWeightSynchronizer(source, engine, bucket_bytes=bucket_bytes, direct=direct)
    async with engine, sync_cm as sync:
        await sync.init_communicator()
        assert sync.plan is not None
        used_bucket_bytes = sync.plan.bucket_bytes
        await sync.mark_stale()
        await sync.sync_weights()  # warm-up: maps the shared buffers, faults their pages
        best = float("inf")
        for _ in range(repeats):
            await sync.mark_stale()
            start = time.perf_counter()
            await sync.sync_weights()
            best = min(best, time.perf_counter() - start)
        timeline = None
        if trace:
            sync.trace = True
            await sync.mark_stale()
            await sync.sync_weights()
            timeline = sync.last_trace
    return best, used_bucket_bytes, timeline


def _timeline(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Per bucket: the trainer's and worker 0's timestamps, ms since the first
    pack started, and ``overlap_ms``: how long packing bucket ``k+1`` ran while
    the worker loaded bucket ``k`` (None for the last bucket)."""
    trainer = trace["trainer"]
    workers = trace["workers"]
    worker = {row["seq"]: row for row in workers[min(workers)]} if workers else {}
    if not trainer:
        return []
    t0 = min(row["pack_start"] for row in trainer)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(1e3 * (value - t0), 3)

    rows = []
    for k, row in enumerate(trainer):
        load = worker.get(row["seq"], {})
        overlap = None
        if k + 1 < len(trainer) and load:
            after = trainer[k + 1]
            start = max(after["pack_start"], load["load_start"])
            end = min(after["pack_end"], load["load_end"])
            overlap = round(1e3 * max(0.0, end - start), 3)
        rows.append(
            {
                "seq": row["seq"],
                "mib": round(row["bytes"] / MiB, 2),
                "pack_start": ms(row.get("pack_start")),
                "pack_end": ms(row.get("pack_end")),
                "sent": ms(row.get("sent")),
                "received": ms(load.get("received")),
                "load_start": ms(load.get("load_start")),
                "load_end": ms(load.get("load_end")),
                "ack_sent": ms(load.get("ack_sent")),
                "acked": ms(row.get("acked")),
                "overlap_ms": overlap,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.25, 1.0, 4.0])
    parser.add_argument("--quick", action="store_true", help="one 64 MB manifest of 4 MiB tensors")
    parser.add_argument("--tensor-mb", type=float, default=16.0, help="size of each tensor")
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="staging buffer size (default: the synchronizer's default for each manifest)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (best; at least 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument(
        "--trace", action="store_true", help="one more traced sync per size: a bucket timeline"
    )
    args = parser.parse_args()
    sizes = [0.064] if args.quick else args.sizes_gb
    if args.quick:
        args.tensor_mb = min(args.tensor_mb, 4.0)
    repeats = repeats_for(args.quick, args.repeats)
    machine = Machine(repeats)
    bucket_bytes = None if args.bucket_mb is None else int(args.bucket_mb * MiB)
    rows: list[dict[str, Any]] = []
    for size_gb in sizes:
        total = int(size_gb * GB)
        spec = _spec(total, args.tensor_mb)
        nbytes = spec["count"] * spec["numel"] * 2
        if _available_bytes() < 4.5 * nbytes + 2 * (bucket_bytes or nbytes // 8):
            rows.append({"size_gb": size_gb, "skipped": "not enough available memory"})
            continue
        source = FlatSource(spec)
        copy_s = _bench_copy(source, repeats)
        two_s = _bench_two_copies(source, repeats)
        ipc_s, used_bucket_bytes, trace = asyncio.run(
            _bench_ipc(source, spec, bucket_bytes, repeats, args.trace)
        )
        shared = _share(source)
        try:
            direct_s, _, _ = asyncio.run(
                _bench_ipc(source, spec, bucket_bytes, repeats, direct=True)
            )
        finally:
            shared.close()
        del source
        copy_gbps, ipc_gbps = nbytes / copy_s / GB, nbytes / ipc_s / GB
        direct_gbps = nbytes / direct_s / GB
        row: dict[str, Any] = {
            "size_gb": size_gb,
            "bytes": nbytes,
            "tensors": spec["count"],
            "bucket_bytes": used_bucket_bytes,
            "copy_gbps": round(copy_gbps, 3),
            "ipc_gbps": round(ipc_gbps, 3),
            "ratio": round(ipc_gbps / copy_gbps, 3),
            "ipc_direct_gbps": round(direct_gbps, 3),
            "ratio_direct": round(direct_gbps / copy_gbps, 3),
            "bound_two_copies": round(copy_s / two_s, 3),
        }
        if trace is not None:
            row["timeline"] = _timeline(trace)
            row["trace"] = trace
        rows.append(row)
    machine.finish()
    _print_table(rows, machine)
    for row in rows:
        if "timeline" in row:
            _print_timeline(row)
    if args.json:
        print(
            json.dumps(
                {
                    "benchmark": "ipc",
                    "bucket_mb_option": args.bucket_mb,
                    "tensor_mb": args.tensor_mb,
                    "threads": torch.get_num_threads(),
                    **machine.fields(),
                    "rows": rows,
                }
            )
        )


def _print_table(rows: list[dict[str, Any]], machine: Machine) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="IPC refit vs copy_ (GB = 1e9 B)",
        caption=machine.caption(),
    )
    columns = (
        "manifest GB",
        "tensors",
        "bucket MiB",
        "copy_ GB/s",
        "IPC GB/s",
        "IPC / copy_",
        "bound: 2 copies ∥",
        "direct GB/s",
        "direct / copy_",
        "bound: 1 copy",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        if "skipped" in row:
            table.add_row(f"{row['size_gb']:g}", *["-"] * 8, row["skipped"])
            continue
        table.add_row(
            f"{row['bytes'] / GB:.3f}",
            str(row["tensors"]),
            f"{row['bucket_bytes'] / MiB:g}",
            f"{row['copy_gbps']:.2f}",
            f"{row['ipc_gbps']:.2f}",
            f"{row['ratio']:.2f}x",
            f"{row['bound_two_copies']:.2f}x",
            f"{row['ipc_direct_gbps']:.2f}",
            f"{row['ratio_direct']:.2f}x",
            "1.00x",
        )
    Console().print(table)
    if (warning := machine.warning()) is not None:
        print(warning)


def _print_timeline(row: dict[str, Any]) -> None:
    """The per-bucket timeline of one traced sync (see the module docs), ms."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"one traced sync of {row['bytes'] / GB:.3f} GB: ms since the first pack started",
        caption="trainer: pack, sent, acked; worker 0: received, load, ack sent (time.monotonic)",
    )
    columns = ("bucket", "MiB", "pack", "sent", "recv", "load", "ack sent", "acked")
    for column in (*columns, "pack k+1 ∥ load k"):
        table.add_column(column, justify="right", no_wrap=True)

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for line in row["timeline"]:
        table.add_row(
            str(line["seq"]),
            f"{line['mib']:g}",
            f"{fmt(line['pack_start'])}–{fmt(line['pack_end'])}",
            fmt(line["sent"]),
            fmt(line["received"]),
            f"{fmt(line['load_start'])}–{fmt(line['load_end'])}",
            fmt(line["ack_sent"]),
            fmt(line["acked"]),
            fmt(line["overlap_ms"]),
        )
    Console(width=120).print(table)  # wider than a pipe's default 80 columns


if __name__ == "__main__":
    main()
