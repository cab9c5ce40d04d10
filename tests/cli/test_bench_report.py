"""``aiosync bench``'s report: latency for small refits, GB/s and the ratio only above
``LATENCY_BOUND_BYTES``; the plot's log axes, size labels and per-transport memcpy lines."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from aiosync._bench import LATENCY_BOUND_BYTES, BenchRow, bench_figure, bench_table

ROOT = Path(__file__).resolve().parents[2]


def aiosync(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("aiosync")
    cmd = [exe] if exe else [sys.executable, "-m", "aiosync.cli"]
    return subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def row(transport: str, nbytes: int, seconds: float, memcpy_seconds: float) -> BenchRow:
    """A row as ``_bench_one`` computes it from its two measured times."""
    gbps, memcpy = nbytes / seconds / 1e9, nbytes / memcpy_seconds / 1e9
    return BenchRow(
        transport, "qwen3-0.6b", 1, nbytes, 14, seconds, gbps, memcpy, gbps / memcpy,
        seconds * 1e3, memcpy_seconds * 1e3, nbytes < LATENCY_BOUND_BYTES,
    )  # fmt: skip


def rendered(rows: list[BenchRow]) -> list[list[str]]:
    """The table's body rows, cell by cell, as printed."""
    out = io.StringIO()
    Console(file=out, width=200).print(bench_table(rows, "t"))
    return [
        [cell.strip() for cell in line.strip("│").split("│")]
        for line in out.getvalue().splitlines()
        if line.startswith("│")
    ]


def test_table_shows_latency_below_the_bound_and_throughput_from_it_on() -> None:
    small = row("ipc", 230_272, 0.0081, 0.0000115)
    large = row("ipc", LATENCY_BOUND_BYTES, 0.02, 0.01)
    assert rendered([small, large]) == [
        ["ipc", "1", "230,272", "14", "8.10", "—", "—", "—"],
        ["ipc", "1", f"{LATENCY_BOUND_BYTES:,}", "14", "20.00", "3.355", "6.711", "0.50x"],
    ]


def test_table_explains_the_dash_only_when_a_row_has_one() -> None:
    small = row("ipc", 230_272, 0.0081, 0.0000115)
    large = row("ipc", LATENCY_BOUND_BYTES, 0.02, 0.01)
    assert bench_table([small], "t").caption is not None
    assert "64 MiB" in str(bench_table([small], "t").caption)
    assert bench_table([large], "t").caption is None


def test_figure_is_log_log_with_byte_labels_and_one_memcpy_line_per_transport() -> None:
    sizes = [2_000_000, 341_000_000, 8_000_000_000]
    speeds = {"ipc": 3e9, "collective": 1e9}
    memcpy = {"ipc": 8e9, "collective": 6e9}
    rows = [
        row(t, n, 0.005 + n / speeds[t], n / memcpy[t])
        for t in ("ipc", "collective")
        for n in sizes
    ]
    fig = bench_figure(rows)
    fig.draw_without_rendering()
    lat_ax, bw_ax = fig.axes
    for ax in (lat_ax, bw_ax):
        assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
        assert [t.get_text() for t in ax.get_xticklabels()] == ["2 MB", "341 MB", "8 GB"]
        # Plain numbers (0.3, 10, 1000), never mathtext powers such as 10^{-1}.
        assert all("$" not in t.get_text() for t in ax.get_yticklabels())
        for i, transport in enumerate(speeds):
            mine = [r for r in rows if r.transport == transport]
            solid = [
                ln
                for ln in ax.get_lines()
                if ln.get_color() == f"C{i}" and ln.get_linestyle() == "-"
            ]
            dashed = [
                ln
                for ln in ax.get_lines()
                if ln.get_color() == f"C{i}" and ln.get_linestyle() == "--"
            ]
            assert len(solid) == 1 and len(dashed) == 1
            # The baseline runs through this transport's own memcpy figures, left to right.
            assert list(dashed[0].get_xdata()) == sizes
            expected = [r.memcpy_latency_ms if ax is lat_ax else r.memcpy_gbps for r in mine]
            assert list(dashed[0].get_ydata()) == pytest.approx(expected)
    y_labels = [t.get_text() for t in bw_ax.get_yticklabels() if t.get_text()]
    assert "1" in y_labels
    # Only the 2 MB refits are latency-bound: the shade and its legend say so.
    legend = bw_ax.get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == [
        "< 64 MiB: fixed costs dominate, read latency"
    ]
    (shade,) = bw_ax.patches
    # From the left edge of the axes up to the bound, not past it.
    assert shade.get_x() + shade.get_width() == pytest.approx(LATENCY_BOUND_BYTES)


def test_figure_has_no_latency_shade_when_every_refit_is_large() -> None:
    rows = [
        row("ipc", n, n / 3e9, n / 8e9) for n in (LATENCY_BOUND_BYTES, 10 * LATENCY_BOUND_BYTES)
    ]
    fig = bench_figure(rows)
    assert fig.axes[1].get_legend() is None
    assert not fig.axes[1].patches


def last_json(stdout: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return data


@pytest.mark.slow
def test_tiny_bench_json_keeps_every_figure_with_latency(tmp_path: Path) -> None:
    png = tmp_path / "tiny.png"
    proc = aiosync(
        "bench", "--transport", "ipc", "--model", "qwen3-tiny", "--repeats", "1",
        "--plot", str(png), "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    (r,) = last_json(proc.stdout)["rows"]
    assert r["nbytes"] == 2 * (2 * 128 * 64 + 64 + 49_344) < LATENCY_BOUND_BYTES
    assert r["latency_bound"] is True
    assert r["latency_ms"] > 0 and r["latency_ms"] == pytest.approx(r["seconds"] * 1e3)
    assert r["memcpy_latency_ms"] == pytest.approx(r["nbytes"] / r["memcpy_gbps"] / 1e6)
    assert r["gbps"] > 0 and r["ratio"] == pytest.approx(r["gbps"] / r["memcpy_gbps"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_tiny_bench_table_shows_latency_not_a_ratio() -> None:
    proc = aiosync("bench", "--transport", "ipc", "--model", "qwen3-tiny", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if "transport" in line)
    assert "ms / refit" in header and "vs memcpy" in header
    (cells,) = [
        [c.strip() for c in line.strip("│").split("│")]
        for line in lines
        if line.startswith("│ ipc")
    ]
    assert cells[:4] == ["ipc", "1", "131,584", "14"]
    assert float(cells[4]) > 0
    assert cells[5:] == ["—", "—", "—"]
    assert "under 64 MiB" in proc.stdout
