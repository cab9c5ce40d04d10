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
import socket
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ._model_shapes import MODEL_CONFIGS, model_manifest

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.console import Console
    from rich.table import Table

__all__ = ["LATENCY_BOUND_BYTES", "BenchRow", "main"]

#: Transports ``aiosync bench`` runs, with the factory arguments that select them.
_TRANSPORTS: dict[str, tuple[str, bool]] = {
    "ipc": ("embedded", True),
    "collective": ("embedded", False),
    "http": ("sglang", True),
}
#: Time allowed for the SGLang test server to build its model and bind, seconds.
_SERVER_START_TIMEOUT_S = 300.0
#: Refits smaller than this (bytes) are reported by latency, not GB/s. A refit has
#: fixed costs whatever its size (engine RPC round trips, handle exchange, the
#: cache flush): about 5 ms on a CPU, as a 130 KB refit shows. A memcpy-class
#: 10 GB/s moves 64 MiB in about 7 ms, so below this size those fixed costs are
#: half the time or more and GB/s (and its ratio to memcpy) would describe them.
LATENCY_BOUND_BYTES = 64 * 1024 * 1024
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


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One measurement of ``aiosync bench``.

    Attributes:
        transport: ``ipc``, ``collective`` or ``http``.
        model: model name (dimensions from :data:`aiosync._model_shapes.MODEL_CONFIGS`).
        layers: decoder layers kept.
        nbytes: payload bytes per refit.
        tensors: tensors per refit.
        seconds: median seconds of one ``sync_weights``.
        gbps: ``nbytes / seconds / 1e9``.
        memcpy_gbps: one ``copy_`` of ``nbytes`` bytes (fastest of >= 10), same run, GB/s.
        ratio: ``gbps / memcpy_gbps``.
        latency_ms: ``seconds`` in milliseconds.
        memcpy_latency_ms: that ``copy_``, milliseconds.
        latency_bound: ``nbytes < LATENCY_BOUND_BYTES``: fixed costs dominate, so
            the table shows ``latency_ms`` and leaves GB/s and the ratio out.
    """

    transport: str
    model: str
    layers: int
    nbytes: int
    tensors: int
    seconds: float
    gbps: float
    memcpy_gbps: float
    ratio: float
    latency_ms: float
    memcpy_latency_ms: float
    latency_bound: bool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model_config(model: str, layers: int, dtype: str) -> dict[str, Any]:
    config = dict(MODEL_CONFIGS[model])
    config["num_hidden_layers"] = min(layers, int(config["num_hidden_layers"]))
    config.pop("torch_dtype", None)
    config["dtype"] = dtype
    return config


def _checkpoint_manifest(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """The engine's expected manifest (names, order, shapes), computed on meta tensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    items = {k: v for k, v in config.items() if k != "dtype"}
    hf_config = AutoConfig.for_model(items.pop("model_type"), **items)
    dtype = getattr(torch, config["dtype"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return {k: (tuple(v.shape), v.dtype) for k, v in revert_weight_conversion(model, state).items()}


@contextlib.asynccontextmanager
async def _sglang_server(config: dict[str, Any]) -> AsyncIterator[Any]:
    """aiosync's SGLang test server in its own process, as an ``SGLangHTTPBackend``."""
    from aiosync.engines.sglang.backend import SGLangHTTPBackend
    from aiosync.testing.sglang_server import serve_in_subprocess

    model_config = {k: v for k, v in config.items() if k != "dtype"}
    async with (
        serve_in_subprocess(
            model_config, dtype=config["dtype"], start_timeout_s=_SERVER_START_TIMEOUT_S
        ) as url,
        SGLangHTTPBackend(url) as backend,
    ):
        yield backend


@contextlib.asynccontextmanager
async def _engine(transport: str, config: dict[str, Any]) -> AsyncIterator[Any]:
    if transport == "http":
        async with _sglang_server(config) as server:
            yield server
        return
    from aiosync.engines.embedded.engine import EmbeddedEngine

    async with EmbeddedEngine(config, dtype=config["dtype"]) as engine:
        yield engine


def _memcpy_seconds(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not copy time
    times = []
    for _ in range(max(repeats, 10)):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    # The floor: on a shared machine a small copy's median mostly measures preemption.
    return min(times)


async def _bench_one(transport: str, model: str, layers: int, args: argparse.Namespace) -> BenchRow:
    from aiosync import (
        CollectiveOptions,
        HTTPOptions,
        IPCOptions,
        TrainCluster,
        create_weight_synchronizer,
    )
    from aiosync.testing import StateDictSource

    backend, colocated = _TRANSPORTS[transport]
    config = _model_config(model, layers, args.dtype)
    manifest = _checkpoint_manifest(config)
    source = StateDictSource.random(manifest)
    nbytes = sum(t.numel() * t.element_size() for t in source.state_dict.values())
    bucket_bytes = None if args.bucket_mb is None else args.bucket_mb * 1024 * 1024
    chosen: IPCOptions | CollectiveOptions | HTTPOptions
    if transport == "ipc":
        chosen = IPCOptions(bucket_bytes=bucket_bytes)
    elif transport == "collective":  # one worker, no tensor-parallel slices: the broadcast
        chosen = CollectiveOptions(bucket_bytes=bucket_bytes)
    else:
        chosen = HTTPOptions(bucket_bytes=bucket_bytes)
    options: dict[str, Any] = {}
    if not colocated:
        options["train_cluster"] = TrainCluster(master_port=_free_port())
        options["inference_world_size"] = 1
    async with _engine(transport, config) as engine:
        sync = create_weight_synchronizer(
            source,
            engine,
            colocated=colocated,
            backend=backend,
            transport=chosen,
            **options,
        )
        async with sync:  # initializes the communicator
            times = []
            for _ in range(args.repeats + 1):  # the first refit warms up
                await sync.mark_stale()
                start = time.perf_counter()
                await sync.sync_weights()
                times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    memcpy_s = _memcpy_seconds(nbytes, args.repeats)
    memcpy = nbytes / memcpy_s / 1e9
    gbps = nbytes / seconds / 1e9
    return BenchRow(
        transport, model, config["num_hidden_layers"], nbytes, len(manifest),
        seconds, gbps, memcpy, gbps / memcpy, seconds * 1e3, memcpy_s * 1e3,
        nbytes < LATENCY_BOUND_BYTES,
    )  # fmt: skip


def _bench_figure(rows: Sequence[BenchRow]) -> Figure:
    """Milliseconds per refit and GB/s against refit size (bytes), log-log, one colour per
    transport; dashed in the same colour: the memcpy measured in that transport's run."""
    from matplotlib import ticker
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    class LogLabels(ticker.LogFormatter):
        # matplotlib picks which log ticks get a label (every decade, or the minor
        # ticks of a short span); this writes them as 0.02 or 230 kB, not 2x10^-2.
        def __init__(self, fmt: Callable[[float], str], *, minor: bool) -> None:
            super().__init__(labelOnlyBase=not minor)
            self.fmt = fmt

        def __call__(self, x: float, pos: int | None = None) -> str:
            return self.fmt(x) if super().__call__(x, pos) else ""

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    lat_ax, bw_ax = fig.subplots(1, 2)
    transports = list(dict.fromkeys(r.transport for r in rows))
    for i, transport in enumerate(transports):
        mine = sorted((r for r in rows if r.transport == transport), key=lambda r: r.nbytes)
        sizes = [r.nbytes for r in mine]
        colour = f"C{i}"
        lat_ax.plot(sizes, [r.latency_ms for r in mine], "o-", color=colour, label=transport)
        lat_ax.plot(sizes, [r.memcpy_latency_ms for r in mine], "--", color=colour)
        bw_ax.plot(sizes, [r.gbps for r in mine], "o-", color=colour)
        bw_ax.plot(sizes, [r.memcpy_gbps for r in mine], "--", color=colour)
    all_sizes = sorted({r.nbytes for r in rows})
    eng = ticker.EngFormatter(unit="B")
    # Three significant figures: "132 kB", "1.15 GB" (EngFormatter alone prints 131.584 kB).
    size_labels = ticker.FuncFormatter(lambda x, _pos: eng(float(f"{x:.3g}")))
    for ax, ylabel in ((lat_ax, "ms per refit"), (bw_ax, "GB/s")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        # Ticks at the measured sizes (at most 8) name each point; a log locator
        # would leave a span shorter than a decade with one label or none.
        ax.xaxis.set_major_locator(ticker.FixedLocator(all_sizes, nbins=7))
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.xaxis.set_major_formatter(size_labels)
        ax.tick_params(axis="x", labelrotation=30)
        ax.yaxis.set_major_formatter(LogLabels("{:g}".format, minor=False))
        ax.yaxis.set_minor_formatter(LogLabels("{:g}".format, minor=True))
        ax.set_xlabel("refit size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    lat_ax.set_title("latency")
    bw_ax.set_title("throughput")
    memcpy = Line2D([], [], color="0.3", linestyle="--", label="memcpy, same bytes, same run")
    lat_ax.legend(handles=[*lat_ax.get_legend_handles_labels()[0], memcpy], fontsize="small")
    if any(r.latency_bound for r in rows):
        left, right = bw_ax.get_xlim()
        shade = bw_ax.axvspan(left, min(right, LATENCY_BOUND_BYTES), color="0.5", alpha=0.12, lw=0)
        bw_ax.set_xlim(left, right)
        shade.set_label(f"< {LATENCY_BOUND_BYTES >> 20} MiB: fixed costs dominate, read latency")
        bw_ax.legend(handles=[shade], fontsize="small")
    fig.suptitle(f"aiosync refit, {rows[0].model}-shaped manifests")
    return fig


def _plot(rows: Sequence[BenchRow], path: str) -> None:
    _bench_figure(rows).savefig(path, dpi=100)


def _bench_table(rows: Sequence[BenchRow], title: str) -> Table:
    """The text table: GB/s and the memcpy ratio only where a refit is not latency-bound."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("transport")
    for name in ("layers", "bytes", "tensors", "ms / refit", "GB/s", "memcpy GB/s", "vs memcpy"):
        table.add_column(name, justify="right")
    for r in rows:
        throughput = (
            ("—", "—", "—")
            if r.latency_bound
            else (f"{r.gbps:.3f}", f"{r.memcpy_gbps:.3f}", f"{r.ratio:.2f}x")
        )
        table.add_row(
            r.transport, str(r.layers), f"{r.nbytes:,}", str(r.tensors), f"{r.latency_ms:,.2f}",
            *throughput,
        )  # fmt: skip
    if any(r.latency_bound for r in rows):
        table.caption = (
            f"—: under {LATENCY_BOUND_BYTES >> 20} MiB a refit's time is mostly fixed costs, "
            "so GB/s would not measure bandwidth; --json keeps every figure"
        )
    return table


def _cmd_bench(args: argparse.Namespace) -> int:
    import anyio

    sizes = args.sizes or [args.layers]
    rows: list[BenchRow] = []

    async def bench_all() -> None:
        for transport in args.transport:
            for layers in sizes:
                rows.append(await _bench_one(transport, args.model, layers, args))

    anyio.run(bench_all)
    if args.plot:
        _plot(rows, args.plot)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "plot": args.plot}))
        return 0
    title = f"aiosync bench: {args.model}-shaped manifests (median of {args.repeats})"
    _stdout_console().print(_bench_table(rows, title))
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
        "--transport", nargs="+", choices=list(_TRANSPORTS), required=True, help="one or more"
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
