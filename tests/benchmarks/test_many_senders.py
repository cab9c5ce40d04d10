"""benchmarks/many_senders.py: both methods move the whole manifest, the sharded one as planned.

The quick run needs root, ``ip`` and ``tc`` (network namespaces with shaped links);
where they are missing the benchmark says why and the figures tests skip with
its reason. No test here asserts a time: speed is the benchmark's own report.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

from tests._support.bench import quick_figures, run_json

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "many_senders.py"
QUICK_CONFIGS = {(1, 1), (1, 2), (2, 1), (2, 2)}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return quick_figures(SCRIPT, tmp_path_factory.mktemp("many_senders"))


def test_without_ip_and_tc_it_skips_with_the_reason_and_exit_code_0(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no ip, no tc
    out, figures = run_json(SCRIPT, tmp_path, env)
    reason = figures["skipped"]
    assert reason.startswith(("`ip` not found", "not root")), reason
    assert f"skipped: {reason}" in out.stdout.splitlines()


def test_quick_run_has_a_row_for_every_configuration(figures):
    assert {(r["T"], r["TP"]) for r in figures["rows"]} == QUICK_CONFIGS
    assert figures["config"]["trainers"] == [1, 2]
    assert figures["config"]["tp"] == [1, 2]


def test_every_rank_planned_the_same_and_moved_exactly_the_plans_bytes(figures):
    for row in figures["rows"]:
        assert row["digests_agree"], row["T"]
        # Each worker receives what its TP parts hold, the plan's count, measured on the worker.
        assert row["receiver_bytes"] == row["plan_receiver_bytes"] == row["part_bytes"]
        assert row["sender_bytes"] == row["plan_sender_bytes"]
        assert sum(row["plan_sender_bytes"]) == sum(row["plan_receiver_bytes"])
        assert len(row["sender_bytes"]) == row["T"]
        assert len(row["receiver_bytes"]) == row["TP"]


def test_both_methods_move_the_same_manifest_and_every_worker_holds_the_trainers_bytes(figures):
    total = figures["config"]["manifest_bytes"]
    for row in figures["rows"]:
        assert row["manifest_bytes"] == total
        assert row["broadcast_sent_bytes"] == total
        assert row["broadcast_receiver_bytes"] == [total] * row["TP"]
        if row["TP"] == 1:  # one worker holds the whole manifest
            assert row["plan_receiver_bytes"] == [total]
        # Checked byte for byte on every worker after the warm-up run, for both methods.
        assert row["sharded_wrong"] == []
        assert row["broadcast_wrong"] == []
        assert row["verified"] is True


def test_figures_are_measured_and_the_ratios_follow_from_them(figures):
    rate = figures["config"]["rate_bytes_per_s"]
    for row in figures["rows"]:
        for key in ("sharded_times", "broadcast_times"):
            assert len(row[key]) == figures["repeats"]
            assert all(math.isfinite(t) and t > 0 for t in row[key])
        assert row["sharded_s"] == min(row["sharded_times"])
        assert row["broadcast_s"] == min(row["broadcast_times"])
        busiest = max(max(row["plan_receiver_bytes"]), max(row["plan_sender_bytes"]))
        assert row["link_limit_s"] == pytest.approx(busiest / rate)
        assert row["sharded_over_limit"] == pytest.approx(row["sharded_s"] / row["link_limit_s"])
        assert row["speedup"] == pytest.approx(row["broadcast_s"] / row["sharded_s"])
        assert row["goal_speedup"] == pytest.approx(0.8 * row["T"] * row["TP"])
        assert row["limit_goal_met"] == (row["sharded_over_limit"] <= 1.2)
        assert row["speedup_goal_met"] == (row["speedup"] >= row["goal_speedup"])
