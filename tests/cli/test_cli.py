"""The ``aiosync`` console script: ``info`` and ``bench`` with a real transport and engine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def aiosync(
    *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("aiosync")
    cmd = [exe] if exe else [sys.executable, "-m", "aiosync.cli"]
    return subprocess.run(
        [*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def last_json(stdout: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return data


def test_info_reports_versions_devices_and_transports() -> None:
    import torch

    proc = aiosync("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = last_json(proc.stdout)
    assert info["versions"]["torch"] == torch.__version__
    assert info["devices"][0] == "cpu"
    assert set(info["transports"]) == {"ipc", "collective", "http"}
    assert info["transports"]["ipc"]["runs"] is True
    assert info["transports"]["collective"]["runs"] is True


def test_info_table_lists_transports() -> None:
    proc = aiosync("info")
    assert proc.returncode == 0, proc.stderr
    assert "collective" in proc.stdout and "POSIX shared memory" in proc.stdout


def test_info_off_a_terminal_wraps_no_line() -> None:
    # stdout is a pipe. Off a terminal rich lays out at $COLUMNS (else 80) columns;
    # COLUMNS=40 makes the platform line and the transports table wider than that.
    proc = aiosync("info", env={**os.environ, "COLUMNS": "40"})
    assert proc.returncode == 0, proc.stderr
    info = last_json(aiosync("info", "--json").stdout)
    lines = proc.stdout.splitlines()
    assert lines[0] == f"python {info['python']} on {info['platform']}"
    rows = [[c.strip() for c in line.strip("│").split("│")] for line in lines if "│" in line]
    want = [[n, "yes" if t["runs"] else "no", t["why"]] for n, t in info["transports"].items()]
    assert [r for r in rows if r[0] in info["transports"]] == want


@pytest.mark.slow
def test_bench_every_transport_writes_table_figures_and_a_valid_png(tmp_path: Path) -> None:
    from PIL import Image

    png = tmp_path / "bench.png"
    proc = aiosync(
        "bench", "--transport", "ipc", "collective", "http", "--model", "qwen3-tiny",
        "--sizes", "1", "2", "--repeats", "1", "--plot", str(png), "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = last_json(proc.stdout)["rows"]
    # qwen3-tiny in bf16: embeddings and head (2 x 128 x 64) + final norm (64), and
    # 11 tensors of 49,344 values per decoder layer.
    assert [(r["transport"], r["layers"], r["tensors"], r["nbytes"]) for r in rows] == [
        (t, n, 3 + 11 * n, 2 * (2 * 128 * 64 + 64 + n * 49_344))
        for t in ("ipc", "collective", "http")
        for n in (1, 2)
    ]
    for r in rows:
        assert r["seconds"] > 0 and r["gbps"] == pytest.approx(r["nbytes"] / r["seconds"] / 1e9)
        assert r["ratio"] == pytest.approx(r["gbps"] / r["memcpy_gbps"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1100, 450)


def test_bench_rejects_an_unknown_model() -> None:
    proc = aiosync("bench", "--transport", "ipc", "--model", "llama-7b")
    assert proc.returncode == 2
    assert "qwen3-0.6b" in proc.stderr


@pytest.mark.parametrize(
    "flag", [["--repeats", "0"], ["--repeats", "-1"], ["--bucket-mb", "0"], ["--sizes", "0"]]
)
def test_bench_rejects_non_positive_counts_before_running(flag: list[str]) -> None:
    proc = aiosync("bench", "--transport", "ipc", *flag)
    assert proc.returncode == 2
    assert f"argument {flag[0]}: expected an integer >= 1" in proc.stderr


def test_bench_help_gives_every_default_and_description() -> None:
    proc = aiosync("bench", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "real model dimensions the manifest is shaped like (default: qwen3-0.6b)" in text
    assert "dtype of every tensor in the manifest (default: bfloat16)" in text
    assert "timed refits per size, median reported, after one warm-up (default: 3)" in text
    assert "qwen3-tiny" in text
