"""benchmarks/plan_check.py: aiosync plan's prediction beside a measured refit, per configuration.

The quick run needs root, ``ip`` and ``tc`` (network namespaces with shaped links);
where they are missing the benchmark says why and the figures tests skip with its
reason. The tests check that every configuration ran the plan the model predicts from
(the same digest on every host, each worker exactly the plan's bytes, checked byte for
byte) and that the ratios follow from the figures. No test asserts a time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests._support.bench import quick_figures, run_json

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_check.py"
#: (name, T, TP, EP, W, changed) of each configuration, in order.
CONFIGS = [
    ("TP2", 2, 2, 1, 2, None),
    ("EP2", 2, 2, 2, 2, None),
    ("TP4xEP2 (mixed)", 2, 4, 2, 4, None),
    ("DP4+EP4", 2, 1, 4, 4, None),
    ("uneven T=3", 3, 2, 2, 2, None),
    ("1 sender", 1, 2, 2, 2, None),
    ("4 senders", 4, 2, 2, 2, None),
    ("delta 5%", 2, 2, 2, 2, 0.05),
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return quick_figures(SCRIPT, tmp_path_factory.mktemp("plan_check"))


def test_without_ip_and_tc_it_skips_with_the_reason_and_exit_code_0(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=str(tmp_path))  # no ip, no tc
    out, figures = run_json(SCRIPT, tmp_path, env)
    reason = figures["skipped"]
    assert reason.startswith(("`ip` not found", "not root")), reason
    assert f"skipped: {reason}" in out.stdout.splitlines()


def test_a_row_per_configuration(figures: dict[str, Any]) -> None:
    rows = figures["rows"]
    assert [(r["name"], r["T"], r["tp"], r["ep"], r["W"], r["changed"]) for r in rows] == CONFIGS


def test_every_host_ran_the_predicted_plan_and_every_worker_holds_the_trainers_bytes(
    figures: dict[str, Any],
) -> None:
    for row in figures["rows"]:
        assert row["digests_agree"], row["name"]
        assert row["wrong"] == [], row["name"]
        assert len(row["receiver_bytes"]) == row["W"]
        assert len(row["sender_bytes"]) == row["T"]
        assert sum(row["sender_bytes"]) == sum(row["receiver_bytes"])
        if row["changed"] is None:
            # Each worker received exactly its parts' bytes: what the model's plan says.
            assert row["receiver_bytes"] == row["plan_receiver_bytes"]
            assert max(row["receiver_bytes"]) == row["predicted_download_bytes"]
            assert max(row["sender_bytes"]) == row["predicted_upload_bytes"]


def test_a_deltas_bytes_are_what_the_model_expects_of_its_changed_elements(
    figures: dict[str, Any],
) -> None:
    [delta] = [r for r in figures["rows"] if r["changed"] is not None]
    # 5% of the elements, each an int32 index and a bf16 value: 0.15 of the full bytes,
    # up to the spread of which elements the seeded change hit (~0.1% here).
    pairs = zip(delta["receiver_bytes"], delta["plan_receiver_bytes"], strict=True)
    assert all(n < full for n, full in pairs)
    for n in delta["receiver_bytes"]:
        assert abs(n / delta["predicted_download_bytes"] - 1) < 0.01


def test_the_ratios_follow_from_the_figures(figures: dict[str, Any]) -> None:
    calibration = figures["calibration"]
    assert calibration["sync_overhead_s"] > 0 and calibration["diff_bytes_per_s"] > 0
    for row in figures["rows"]:
        assert row["measured_s"] == min(row["times"])
        assert len(row["times"]) == figures["repeats"]
        assert row["ratio"] == pytest.approx(row["measured_s"] / row["predicted_s"])
        assert row["links_only_ratio"] == pytest.approx(row["measured_s"] / row["links_only_s"])
        assert row["within_tolerance"] == (abs(row["ratio"] - 1) <= 0.15)
        # Calibration only adds the costs that do not scale with the links.
        assert row["predicted_s"] > row["links_only_s"] >= row["lower_bound_s"]
