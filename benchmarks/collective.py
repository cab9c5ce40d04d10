"""Benchmark of the collective transport's data path: gloo on CPU, 2 processes.

In one run, for each manifest, the same bytes go from rank 0 to rank 1 three ways:

(a) aiosync   packed, pipelined buckets (``aiosync.transports.collective._loops``: header,
              buckets with two in flight, vote), the receiver copying every tensor
              out of the bucket into its own storage (what ``load_weights`` does)
(b) floor     raw broadcast of the same bytes, no packing and no copy: one flat
              buffer when it fits ``--flat-limit-mb``, else chunks of the bucket
              size from one preallocated buffer, two in flight
(c) per-tensor one blocking broadcast per tensor, the pattern of common RLHF
              examples (OpenRLHF's vLLM worker): the trainer sends each parameter as
              is, the worker receives into a fresh tensor and loads (copies) it

and, for the dense manifest, how long generation would pause: in-place (the whole
receive) versus staged (receive into a staging copy, then only the final copy).

Manifests use real dimensions (``aiosync._model_shapes``, the published
config.json fields): Qwen3-0.6B, and a Qwen3-30B-A3B slice cut to the first
layers that give >= 10,000 tensors (26 of 48 layers, 33.6 GB). Tensors of one
shape share one random source tensor (and one target on the receiver) so memory
stays at a few GB; the bytes on the wire are the full manifest's.

Each time is the best of ``--repeat`` runs (at least 3; 1 when ``--quick``),
after one warm-up; the 1-minute load average at start and end is recorded
(``_machine``).

``(c)/(b)`` is the most ``(c)/(a)`` can be for any transport that is no faster
than (b), a raw broadcast of the same bytes over the same group: when tensors
are megabytes (the MoE slice's experts are 3 MiB each), per-tensor broadcasts
run near wire speed and that bound is well under 3 on two CPU cores.

``--trace`` adds one traced run of (a) and (c) per manifest: per-bucket
timestamps on both sides (the loops' ``trace`` hook: source gathered, packed,
broadcasting, sent; receiver posted, received, loaded), summed into where the time
goes (packing, the receiver waiting for bytes, loading), and, for (c), the
receiver's time in broadcasts versus copies, by tensor size (count, bytes,
microseconds per broadcast, GB/s); ``--json`` keeps every timestamp.

Usage: ``python benchmarks/collective.py [--quick] [--trace] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _machine import Machine, repeats_for

from aiosync._model_shapes import model_manifest
from aiosync.transports.collective._group import STATUS_OK, SyncGroup, create_sync_group, open_store
from aiosync.transports.collective._loops import RotatingBuffers, receive_buckets, send_buckets
from aiosync.transports.packing import Bucket, BucketPlan, dtype_from_name, plan_buckets, unpack

_ShapeKey = tuple[tuple[int, ...], torch.dtype]


def _manifests(quick: bool) -> list[tuple[str, dict[str, _ShapeKey]]]:
    out = []
    for label, name, layers in (
        ("qwen3-0.6b" + (" (4 layers)" if quick else ""), "qwen3-0.6b", 4 if quick else None),
        (
            f"qwen3-30b-a3b ({1 if quick else 26}/48 layers)",
            "qwen3-30b-a3b",
            1 if quick else 26,
        ),
    ):
        shapes = model_manifest(name, layers=layers)
        out.append((label, {n: (s, dtype_from_name(d)) for n, (s, d) in shapes.items()}))
    return out


def _per_shape(manifest: dict[str, _ShapeKey], random: bool) -> dict[_ShapeKey, torch.Tensor]:
    tensors: dict[_ShapeKey, torch.Tensor] = {}
    for key in manifest.values():
        if key not in tensors:
            shape, dtype = key
            numel = 1
            for d in shape:
                numel *= d
            raw = torch.empty(numel * dtype.itemsize, dtype=torch.uint8)
            if random:
                raw.random_()
            tensors[key] = raw.view(dtype).view(shape)
    return tensors


#: Tensor size classes of the per-tensor trace: (name, exclusive upper bound in bytes).
_SIZE_CLASSES = (("<64KiB", 64 << 10), ("64KiB-8MiB", 8 << 20), (">=8MiB", 1 << 62))


def _sync_point(group: SyncGroup) -> None:
    group.exchange(STATUS_OK)


def _timed(group: SyncGroup, fn: Callable[[], None]) -> float:
    _sync_point(group)
    start = time.perf_counter()
    fn()
    _sync_point(group)  # the receiver is done too
    return time.perf_counter() - start


class _Rank:
    """One side of the benchmark for one manifest."""

    def __init__(
        self, group: SyncGroup, manifest: dict[str, _ShapeKey], bucket_bytes: int, flat_limit: int
    ) -> None:
        self.group = group
        self.manifest = manifest
        self.plan: BucketPlan = plan_buckets(manifest, bucket_bytes)
        self.tensors = _per_shape(manifest, random=group.is_source)
        self.buffers = RotatingBuffers(self.plan, torch.device("cpu"))
        self.total = self.plan.total_bytes
        self.flat = self.total <= flat_limit
        chunk = self.total if self.flat else bucket_bytes
        self.floor_buffers = [
            torch.ones(chunk, dtype=torch.uint8) for _ in range(1 if self.flat else 2)
        ]
        self.version = 0

    def _source(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, key in self.manifest.items():
            yield name, self.tensors[key]

    def _load(self, bucket: Bucket, buf: torch.Tensor) -> None:
        for name, view in unpack(buf, bucket):
            self.tensors[self.manifest[name]].copy_(view)

    def aiosync(self, trace: Callable[[str, int], None] | None = None) -> None:
        """One aiosync sync; ``trace``: the loops' per-bucket hook."""
        self.version += 1
        if self.group.is_source:
            send_buckets(
                self.group,
                self.plan,
                self.buffers,
                self._source(),
                version=self.version,
                kv=[],
                verify=False,
                trace=trace,
            )
        else:
            receive_buckets(
                self.group,
                self.plan,
                self.buffers,
                version=self.version,
                n_kv=0,
                verify=False,
                on_bucket=self._load,
                trace=trace,
            )

    def traced(self) -> list[tuple[str, int, float]]:
        """One aiosync sync with the loops' trace hook: ``[(event, bucket, perf_counter)]``.

        ``perf_counter`` is ``CLOCK_MONOTONIC`` on Linux: one clock for both processes.
        """
        events: list[tuple[str, int, float]] = []

        def mark(event: str, index: int) -> None:
            events.append((event, index, time.perf_counter()))

        _sync_point(self.group)
        mark("start", -1)
        self.aiosync(trace=mark)
        mark("end", -1)
        return events

    def traced_per_tensor(self) -> dict[str, Any]:
        """One per-tensor run: the receiver's seconds in broadcasts vs copies, and
        ``{size class: [tensors, bytes, broadcast seconds]}`` (the source returns {})."""
        _sync_point(self.group)
        wire = copy = 0.0
        classes: dict[str, list[float]] = {name: [0, 0, 0.0] for name, _ in _SIZE_CLASSES}
        for key in self.manifest.values():
            source = self.group.is_source
            t = self.tensors[key] if source else torch.empty(key[0], dtype=key[1])
            raw = t.reshape(-1).view(torch.uint8)
            start = time.perf_counter()
            self.group.wait(self.group.broadcast(raw, what="tensor"), what="tensor")
            mid = time.perf_counter()
            if not source:
                self.tensors[key].copy_(t)
            wire += mid - start
            copy += time.perf_counter() - mid
            cls = next(name for name, limit in _SIZE_CLASSES if raw.numel() < limit)
            classes[cls][0] += 1
            classes[cls][1] += raw.numel()
            classes[cls][2] += mid - start
        if self.group.is_source:
            return {}
        return {"broadcast_s": wire, "copy_s": copy, "by_size": classes}

    def floor(self) -> None:
        if self.flat:
            self.group.wait(self.group.broadcast(self.floor_buffers[0], what="flat"), what="flat")
            return
        pending: list[Any] = []
        sent = 0
        i = 0
        while sent < self.total:
            n = min(self.floor_buffers[0].numel(), self.total - sent)
            if len(pending) == 2:
                self.group.wait(pending.pop(0), what="chunk")
            pending.append(self.group.broadcast(self.floor_buffers[i % 2][:n], what="chunk"))
            sent += n
            i += 1
        for work in pending:
            self.group.wait(work, what="chunk")

    def per_tensor(self) -> None:
        # OpenRLHF-style: the trainer broadcasts each parameter as is; the worker
        # receives into a fresh tensor and hands it to load_weights (one copy).
        for key in self.manifest.values():
            source = self.group.is_source
            t = self.tensors[key] if source else torch.empty(key[0], dtype=key[1])
            raw = t.reshape(-1).view(torch.uint8)
            self.group.wait(self.group.broadcast(raw, what="tensor"), what="tensor")
            if not self.group.is_source:
                self.tensors[key].copy_(t)

    def pause(self, staged: bool) -> tuple[float, float]:
        """Receiver: ``(seconds generation is paused, seconds of the whole receive)``."""
        self.version += 1
        if self.group.is_source:
            send_buckets(
                self.group,
                self.plan,
                self.buffers,
                self._source(),
                version=self.version,
                kv=[],
                verify=False,
            )
            return 0.0, 0.0
        start = time.perf_counter()
        if not staged:
            receive_buckets(
                self.group,
                self.plan,
                self.buffers,
                version=self.version,
                n_kv=0,
                verify=False,
                on_bucket=self._load,
            )
            total = time.perf_counter() - start
            return total, total
        staging = [torch.empty(b.nbytes, dtype=torch.uint8) for b in self.plan.buckets]
        receive_buckets(
            self.group,
            self.plan,
            lambda b: staging[b.index],
            version=self.version,
            n_kv=0,
            verify=False,
            on_bucket=None,
        )
        copy_start = time.perf_counter()
        for bucket, buf in zip(self.plan.buckets, staging, strict=True):
            self._load(bucket, buf)
        end = time.perf_counter()
        return end - copy_start, end - start


def _run(rank: int, args: argparse.Namespace, conn: Any) -> dict[str, Any]:
    # One intra-op thread: gloo's own threads need the other cores, and OpenMP
    # workers spinning against them slow every copy several-fold on a small box.
    torch.set_num_threads(args.threads)
    store = open_store("127.0.0.1", args.port, is_master=rank == 0, timeout_s=600)
    group = create_sync_group(
        store=store,
        rank=rank,
        world_size=2,
        train_world_size=1,
        backend="gloo",
        device=torch.device("cpu"),
        timeout_s=600,
        session="bench",
    )
    results: dict[str, Any] = {"manifests": []}
    bucket_bytes = args.bucket_mb << 20
    for label, manifest in _manifests(args.quick):
        side = _Rank(group, manifest, bucket_bytes, args.flat_limit_mb << 20)
        times: dict[str, list[float]] = {"aiosync": [], "floor": [], "per_tensor": []}
        side.aiosync()  # warm-up: first-touch of buffers and targets
        for _ in range(args.repeat):
            times["aiosync"].append(_timed(group, side.aiosync))
            times["floor"].append(_timed(group, side.floor))
            times["per_tensor"].append(_timed(group, side.per_tensor))
        row: dict[str, Any] = {
            "manifest": label,
            "tensors": len(manifest),
            "bytes": side.total,
            "buckets": len(side.plan.buckets),
            "floor_kind": "flat" if side.flat else f"chunks of {args.bucket_mb} MiB",
        }
        for key, values in times.items():
            row[f"{key}_s"] = min(values)  # the run least disturbed by other tenants
        row["aiosync_over_floor"] = row["aiosync_s"] / row["floor_s"]
        row["per_tensor_over_aiosync"] = row["per_tensor_s"] / row["aiosync_s"]
        # The most (c)/(a) can be for a transport no faster than (b), a raw broadcast
        # of the same bytes over the same group.
        row["per_tensor_over_floor"] = row["per_tensor_s"] / row["floor_s"]
        row["aiosync_GBps"] = side.total / row["aiosync_s"] / 1e9
        if label.startswith("qwen3-0.6b"):
            inplace = side.pause(staged=False)
            staged = side.pause(staged=True)
            if rank == 1:
                conn.send((inplace, staged))
            else:
                (inplace, staged) = conn.recv()
                row["inplace_pause_s"] = inplace[0]
                row["staged_pause_s"] = staged[0]
                row["staged_receive_s"] = staged[1]
        if args.trace:
            mine, per_tensor = side.traced(), side.traced_per_tensor()
            if rank == 1:
                conn.send((mine, per_tensor))
            else:
                theirs, per_tensor = conn.recv()
                row["trace"] = {"source": mine, "receiver": theirs}
                row["trace_summary"] = _summarize(mine, theirs, len(side.plan.buckets))
                row["per_tensor_trace"] = per_tensor
        results["manifests"].append(row)
        del side
    group.destroy()
    return results


def _summarize(
    source: list[tuple[str, int, float]], receiver: list[tuple[str, int, float]], buckets: int
) -> dict[str, float]:
    """Where one traced sync's time went, seconds (both sides on one clock).

    ``wall``: the source's start to the receiver's end. Source: ``pack`` (gathered
    to packed, per bucket), ``wait_send`` (blocked on an earlier bucket's
    broadcast before reusing its buffer, and on the last ones). Receiver:
    ``wait_bytes`` (blocked until a bucket landed), ``load`` (``on_bucket``).
    """
    src = {(e, i): t for e, i, t in source}
    dst = {(e, i): t for e, i, t in receiver}
    pack = sum(src[("packed", k)] - src[("gathered", k)] for k in range(buckets))
    load = sum(dst[("loaded", k)] - dst[("received", k)] for k in range(buckets))
    wait_bytes = 0.0
    prev = dst[("start", -1)]
    for k in range(buckets):
        # After the previous bucket's load (and posting this one's receive).
        wait_bytes += dst[("received", k)] - max(prev, dst[("posted", k)])
        prev = dst[("loaded", k)]
    wait_send = 0.0
    prev = src[("start", -1)]
    order = sorted(source, key=lambda e: e[2])
    for event, _, t in order:
        if event == "sent":
            wait_send += t - prev
        prev = t
    return {
        "wall": dst[("end", -1)] - src[("start", -1)],
        "source_pack": pack,
        "source_wait_send": wait_send,
        "receiver_wait_bytes": wait_bytes,
        "receiver_load": load,
    }


def _receiver(args: argparse.Namespace, conn: Any) -> None:
    _run(1, args, conn)


def _fmt(row: dict[str, Any]) -> str:
    return (
        f"{row['manifest']:<34} {row['tensors']:>7} {row['bytes'] / 1e9:>7.2f} "
        f"{row['aiosync_s']:>9.3f} {row['floor_s']:>9.3f} {row['per_tensor_s']:>10.3f} "
        f"{row['aiosync_over_floor']:>8.2f}x {row['per_tensor_over_aiosync']:>8.2f}x "
        f"{row['per_tensor_over_floor']:>8.2f}x"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small manifests, 1 repeat")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument(
        "--bucket-mb", type=int, default=512, help="bucket size, MiB (512: the CPU default)"
    )
    parser.add_argument(
        "--flat-limit-mb", type=int, default=2048, help="largest flat floor buffer, MiB"
    )
    parser.add_argument("--repeat", type=int, default=None, help="timed repeats (best; >= 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument(
        "--trace", action="store_true", help="one traced run of (a) and (c): where the time goes"
    )
    parser.add_argument("--port", type=int, default=0, help="TCPStore port (0: a free one)")
    args = parser.parse_args(argv)
    args.repeat = repeats_for(args.quick, args.repeat)
    machine = Machine(args.repeat)
    if args.port == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(args, child), daemon=True)
    proc.start()
    try:
        results = _run(0, args, parent)
    finally:
        proc.join(60)
    machine.finish()
    results["config"] = {
        "backend": "gloo",
        "processes": 2,
        "bucket_bytes": args.bucket_mb << 20,
        "repeat": args.repeat,
        "quick": args.quick,
    }
    results.update(machine.fields())
    print(
        "collective transport, gloo on CPU, 2 processes (rank 0 -> rank 1); "
        f"bucket {args.bucket_mb} MiB; {machine.caption()}"
    )
    print(
        "tensors of one shape share one source/target tensor; "
        "bytes on the wire are the full manifest's"
    )
    print(
        f"{'manifest':<34} {'tensors':>7} {'GB':>7} {'(a) s':>9} {'(b) s':>9} {'(c) s':>10} "
        f"{'(a)/(b)':>9} {'(c)/(a)':>9} {'(c)/(b)':>9}"
    )
    print("(c)/(b) bounds (c)/(a) for any transport that is no faster than a raw broadcast")
    for row in results["manifests"]:
        print(_fmt(row))
    for row in results["manifests"]:
        if "inplace_pause_s" in row:
            print(
                f"{row['manifest']}: generation paused {row['inplace_pause_s']:.3f} s in place vs "
                f"{row['staged_pause_s']:.3f} s staged (staged receive "
                f"{row['staged_receive_s']:.3f} s, during which the engine keeps generating)"
            )
    for row in results["manifests"]:
        if "trace_summary" in row:
            t, c = row["trace_summary"], row["per_tensor_trace"]
            print(
                f"{row['manifest']} trace (a): wall {t['wall']:.3f} s; source packs "
                f"{t['source_pack']:.3f} s, waits for broadcasts {t['source_wait_send']:.3f} s; "
                f"receiver waits for bytes {t['receiver_wait_bytes']:.3f} s, loads "
                f"{t['receiver_load']:.3f} s. (c): receiver in broadcasts "
                f"{c['broadcast_s']:.3f} s, copies {c['copy_s']:.3f} s"
            )
            for cls, (count, nbytes, seconds) in c["by_size"].items():
                if count:
                    print(
                        f"  (c) tensors {cls:>10}: {int(count):>6}, {nbytes / 1e9:7.3f} GB, "
                        f"{seconds:.3f} s in broadcasts ({seconds / count * 1e6:.0f} us each, "
                        f"{nbytes / seconds / 1e9:.2f} GB/s)"
                    )
    if (warning := machine.warning()) is not None:
        print(warning)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
