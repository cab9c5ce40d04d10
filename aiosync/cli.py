"""The ``aiosync`` command: ``aiosync info``, ``aiosync plan`` and ``aiosync bench``.

``aiosync plan --model qwen3-8b --trainer-ranks 8 --tp 8 --engines 4 --nic-gbps 400``
predicts a refit before the cluster exists: for the rank-0 broadcast, the shard-aware
path (its plan computed by the transport's own ``make_plan``), a delta and an FP8
refit, the busiest upload and download, the bottleneck link, the time and the lower
bound no schedule beats (:mod:`aiosync.transports.sharded.estimate`).

``aiosync bench --transport ipc collective --model qwen3-0.6b --sizes 1 2 --plot out.png``
refits a manifest shaped like a real model (dimensions stored in
:mod:`aiosync._model_shapes`; ``--sizes`` are decoder-layer counts) through each
transport into a real engine (the embedded engine's worker processes, or the
SGLang test server for ``http``), and prints bytes, tensors, milliseconds per
refit, GB/s and the ratio to a ``copy_`` of the same bytes measured in the same
run. Below :data:`LATENCY_BOUND_BYTES` the GB/s and ratio cells read "—": a
refit that small measures fixed costs, not bandwidth (``--json`` keeps them).

torch, the transports and matplotlib are imported inside the commands, so
``aiosync --help`` stays instant.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ._bench import (
    LATENCY_BOUND_BYTES,
    TRANSPORTS,
    BenchRow,
    bench_one,
    bench_table,
    plot,
)
from ._model_shapes import MODEL_CONFIGS, model_manifest

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["LATENCY_BOUND_BYTES", "BenchRow", "main"]

#: Packages ``aiosync info`` reports.
_PACKAGES = ("aiosync", "torch", "transformers", "vllm", "sglang", "jax", "flax", "numpy")
#: The layout width, in columns, off a terminal: wider than anything printed here, so
#: no line is wrapped and a table takes its natural width.
_UNWRAPPED_COLUMNS = 10_000


def _stdout_console() -> Console:
    """stdout's console: a terminal's own width; off a terminal (a pipe, a file, a CI log)
    rich would lay out at ``$COLUMNS`` or 80 columns and break lines, so nothing wraps."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console.soft_wrap = True
        console.width = _UNWRAPPED_COLUMNS
    return console


# -- info ----------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_info() -> dict[str, Any]:
    """Versions found, devices, and which transports can run on this machine."""
    import torch
    import torch.distributed as dist

    versions = {p: _version(p) for p in _PACKAGES}
    cuda = torch.cuda.is_available()
    devices = ["cpu"] + [
        f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())
    ]
    if versions["jax"] is not None:
        with contextlib.suppress(Exception):
            import jax

            devices += [f"jax:{d}" for d in jax.devices() if d.platform != "cpu"]
    has_zmq = importlib.util.find_spec("zmq") is not None
    has_httpx = importlib.util.find_spec("httpx") is not None
    dist_ok = dist.is_available()
    transports = {
        "ipc": {
            "runs": has_zmq,
            "why": ("CUDA IPC handles" if cuda else "POSIX shared memory (CPU)")
            if has_zmq
            else "pyzmq missing",
        },
        "collective": {
            "runs": dist_ok and (dist.is_gloo_available() or dist.is_nccl_available()),
            "why": ", ".join(
                b
                for b, ok in (
                    ("nccl", dist_ok and cuda and dist.is_nccl_available()),
                    ("gloo", dist_ok and dist.is_gloo_available()),
                )
                if ok
            )
            or "torch.distributed unavailable",
        },
        "http": {
            "runs": has_httpx,
            "why": ("SGLang server" if versions["sglang"] else "aiosync's SGLang test server only")
            if has_httpx
            else "httpx missing",
        },
    }
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "cuda": cuda,
        "devices": devices,
        "transports": transports,
        "engines": {
            "embedded": True,
            "vllm": versions["vllm"] is not None,
            "sglang": versions["sglang"] is not None,
        },
    }


def _cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info))
        return 0
    from rich.table import Table

    console = _stdout_console()
    console.print(f"python {info['python']} on {info['platform']}")
    versions = Table("package", "version", title="packages")
    for name, version in info["versions"].items():
        versions.add_row(name, version or "[dim]not installed")
    console.print(versions)
    console.print("devices: " + ", ".join(info["devices"]))
    transports = Table("transport", "runs here", "how", title="transports")
    for name, t in info["transports"].items():
        transports.add_row(name, "yes" if t["runs"] else "no", t["why"])
    console.print(transports)
    return 0


# -- bench ---------------------------------------------------------------------


def _cmd_bench(args: argparse.Namespace) -> int:
    import anyio

    sizes = args.sizes or [args.layers]
    rows: list[BenchRow] = []

    async def bench_all() -> None:
        for transport in args.transport:
            for layers in sizes:
                rows.append(await bench_one(transport, args.model, layers, args))

    anyio.run(bench_all)
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "plot": args.plot}))
        return 0
    title = f"aiosync bench: {args.model}-shaped manifests (median of {args.repeats})"
    _stdout_console().print(bench_table(rows, title))
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


# -- plan --------------------------------------------------------------------------


def _cmd_plan(args: argparse.Namespace) -> int:
    """Predict a refit's bytes per link and time for each path (``aiosync plan``)."""
    from .transports.packing import dtype_from_name
    from .transports.sharded.estimate import Links, estimate_refit

    if args.model.endswith(".json"):
        with open(args.model, encoding="utf-8") as f:
            config: Any = json.load(f)
    else:
        config = args.model
    shapes = model_manifest(config, layers=args.layers)
    manifest = {name: (shape, dtype_from_name(dt)) for name, (shape, dt) in shapes.items()}
    links = Links(nic_gbps=args.nic_gbps, latency_us=args.latency_us, efficiency=args.efficiency)
    rows = estimate_refit(
        manifest,
        trainer_ranks=args.trainer_ranks,
        tp=args.tp,
        engines=args.engines,
        links=links,
        ep=args.ep,
        changed=args.changed,
        sync_overhead_s=args.overhead_ms / 1e3,
    )
    if args.json:
        print(json.dumps({"model": args.model, "rows": [asdict(r) for r in rows]}))
        return 0
    from rich.table import Table

    parallel = f"TP{args.tp}" + (f"xEP{args.ep}" if args.ep > 1 else "")
    title = (
        f"{args.model}: {args.trainer_ranks} trainer ranks (FSDP2) -> {args.engines} x "
        f"{parallel}, {args.nic_gbps:g} Gbit/s NICs, delta at {args.changed:.0%} changed"
    )
    table = Table(
        "path", "busiest upload", "busiest download", "bottleneck", "predicted", "lower bound",
        title=title,
    )  # fmt: skip
    for r in rows:
        table.add_row(
            r.path,
            f"{r.upload_bytes / 1e9:.3f} GB",
            f"{r.download_bytes / 1e9:.3f} GB",
            r.bottleneck,
            f"{r.predicted_s:.3f} s",
            f"{r.lower_bound_s:.3f} s",
        )
    _stdout_console().print(table)
    return 0


#: ``aiosync plan``'s numeric options: flag, type, default, help.
_PLAN_NUMBERS: tuple[tuple[str, type, float | None, str], ...] = (
    ("--layers", int, None, "keep only this many layers"),
    ("--trainer-ranks", int, 8, "FSDP2 ranks"),
    ("--tp", int, 8, "workers per engine"),
    ("--ep", int, 1, "expert-parallel size of an engine (MoE; max(tp, ep) workers)"),
    ("--engines", int, 1, "engine replicas"),
    ("--nic-gbps", float, 400.0, "NIC rate each way, Gbit/s"),
    ("--latency-us", float, 10.0, "per message, us"),
    ("--efficiency", float, 1.0, "payload share of the NIC rate (TCP over 1500-byte MTU: 0.956)"),
    ("--overhead-ms", float, 0.0, "fixed cost of one sync, ms"),
    ("--changed", float, 0.05, "delta: fraction changed"),
)


# -- entry point -----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``aiosync`` argument parser (subcommands ``info``, ``plan`` and ``bench``)."""
    parser = argparse.ArgumentParser(
        prog="aiosync", description="Async weight synchronization from RL trainers to engines."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, devices, transports that run here")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=_cmd_info)
    plan = sub.add_parser(
        "plan",
        help="predict a refit's bytes per link and time (broadcast, sharded, delta, FP8)",
    )
    plan.add_argument(
        "--model",
        default="qwen3-8b",
        help=f"a preset ({', '.join(MODEL_CONFIGS)}) or an HF config.json (default: %(default)s)",
    )
    for flag, kind, default, what in _PLAN_NUMBERS:
        plan.add_argument(flag, type=kind, default=default, help=f"{what} (default: %(default)s)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=_cmd_plan)
    bench = sub.add_parser(
        "bench",
        help="refit throughput of a transport vs. memcpy",
    )
    bench.add_argument(
        "--transport", nargs="+", choices=list(TRANSPORTS), required=True, help="one or more"
    )
    bench.add_argument(
        "--model",
        choices=list(MODEL_CONFIGS),
        default="qwen3-0.6b",
        help="real model dimensions the manifest is shaped like (default: %(default)s)",
    )
    bench.add_argument(
        "--layers",
        type=_positive_int,
        default=1,
        help="decoder layers (without --sizes; default: %(default)s)",
    )
    bench.add_argument(
        "--sizes", type=_positive_int, nargs="+", default=None, help="decoder-layer counts"
    )
    bench.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="dtype of every tensor in the manifest (default: %(default)s)",
    )
    bench.add_argument("--bucket-mb", type=_positive_int, default=None, help="bucket size, MiB")
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        help="timed refits per size, median reported, after one warm-up (default: %(default)s)",
    )
    bench.add_argument(
        "--plot",
        default=None,
        help="write a PNG of ms per refit and GB/s against size (log-log), memcpy dashed",
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(func=_cmd_bench)
    return parser


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``aiosync`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
