"""``aiosync bench``'s harness: refit a manifest shaped like a real model through a
transport into a real engine, beside a ``copy_`` of the same bytes (:mod:`aiosync.cli`)."""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._model_shapes import MODEL_CONFIGS

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.table import Table

__all__ = [
    "LATENCY_BOUND_BYTES",
    "TRANSPORTS",
    "BenchRow",
    "bench_figure",
    "bench_one",
    "bench_table",
    "plot",
]

#: Transports ``aiosync bench`` runs, with the factory arguments that select them.
TRANSPORTS: dict[str, tuple[str, bool]] = {
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


async def bench_one(transport: str, model: str, layers: int, args: argparse.Namespace) -> BenchRow:
    from aiosync import (
        CollectiveOptions,
        HTTPOptions,
        IPCOptions,
        TrainCluster,
        create_weight_synchronizer,
    )
    from aiosync.testing import StateDictSource

    backend, colocated = TRANSPORTS[transport]
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


def bench_figure(rows: Sequence[BenchRow]) -> Figure:
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


def plot(rows: Sequence[BenchRow], path: str) -> None:
    bench_figure(rows).savefig(path, dpi=100)


def bench_table(rows: Sequence[BenchRow], title: str) -> Table:
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
