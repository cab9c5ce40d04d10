"""benchmarks/delta.py: per transport and learning rate, delta and full refits of one manifest.

One ``--quick --json`` run; the tests check what it measured and that its ratios and
goal columns follow from its own figures. No test asserts a time.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import pytest

from aiosync import IPCWeightSynchronizer
from tests._support.bench import assert_table_then_json, run_quick

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "delta.py"
LEARNING_RATES = [1e-6, 1e-5, 1e-4]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return assert_table_then_json(run_quick(SCRIPT, tmp_path_factory.mktemp("delta")))


def test_a_row_per_transport_and_learning_rate_ipc_once_it_takes_delta(
    figures: dict[str, Any],
) -> None:
    ipc = "delta" in inspect.signature(IPCWeightSynchronizer).parameters
    transports = ["collective", *(["ipc"] if ipc else [])]
    assert figures["config"]["transports"] == transports
    assert figures["config"]["ipc_delta"] is ipc
    assert figures["config"]["learning_rates"] == LEARNING_RATES
    # Loopback rows for every transport, then the collective's again over the shaped
    # link, unless the machine cannot shape one (the reason is recorded).
    skipped = figures["config"]["shaped_link_skipped"]
    shaped = [] if skipped else [f"tbf {figures['config']['rate_mbit']} Mbit/s"]
    assert skipped is None or (isinstance(skipped, str) and skipped)
    assert [(r["link"], r["transport"], r["lr"]) for r in figures["rows"]] == [
        ("loopback", t, lr) for t in transports for lr in LEARNING_RATES
    ] + [(link, "collective", lr) for link in shaped for lr in LEARNING_RATES]
    assert figures["config"]["dtype"] == "bfloat16"
    assert figures["config"]["model"]["model_type"] == "qwen3"
    assert {"load_average", "repeats", "cpus"} <= figures.keys()


def test_the_baseline_moves_the_whole_manifest_and_every_timed_delta_refit_is_a_delta(
    figures: dict[str, Any],
) -> None:
    total = figures["config"]["manifest_bytes"]
    for row in figures["rows"]:
        assert row["full_bytes"] == total
        assert row["full_nbytes"] == [total] * figures["repeats"]
        assert row["delta_flags"] == [True] * figures["repeats"] and row["all_delta"]
        assert all(0 < n < total for n in row["delta_nbytes"])
        # The patches landed bit-exact on every worker.
        assert row["verified"] is True


def test_a_larger_learning_rate_changes_more_bf16_bits(figures: dict[str, Any]) -> None:
    for link, transport in {(r["link"], r["transport"]) for r in figures["rows"]}:
        rows = [r for r in figures["rows"] if (r["link"], r["transport"]) == (link, transport)]
        fractions = [r["bytes_fraction"] for r in rows]
        assert fractions == sorted(fractions) and len(set(fractions)) == len(fractions)


def test_figures_and_goal_columns_follow_from_the_measurements(figures: dict[str, Any]) -> None:
    goals = figures["goals"]
    assert goals == {
        "lr": 1e-6,
        "bytes_fraction_max": 0.05,
        "time_ratio_max": 0.2,
        "time_transport": "collective",
    }
    for row in figures["rows"]:
        for key in ("full_times", "delta_times"):
            assert len(row[key]) == figures["repeats"]
            assert all(math.isfinite(t) and t > 0 for t in row[key])
        assert row["full_s"] == min(row["full_times"])
        assert row["delta_s"] == min(row["delta_times"])
        assert row["time_ratio"] == pytest.approx(row["delta_s"] / row["full_s"])
        shares = [n / row["full_bytes"] for n in row["delta_nbytes"]]
        assert row["bytes_fraction"] == pytest.approx(sum(shares) / len(shares))
        assert row["bytes_fraction_max"] == pytest.approx(max(shares))
        if row["lr"] != goals["lr"]:
            assert (row["bytes_goal"], row["time_goal"]) == (None, None)
            continue
        met = row["bytes_fraction_max"] <= goals["bytes_fraction_max"]
        assert row["bytes_goal"] == ("PASS" if met else "MISS")
        if row["transport"] == "collective":
            met = row["time_ratio"] <= goals["time_ratio_max"]
            assert row["time_goal"] == ("PASS" if met else "MISS")
        else:
            assert row["time_goal"] is None
