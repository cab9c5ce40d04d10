"""The point-to-point executor over gloo and over Mooncake's data plane: real processes,
every sender sending at once.

Each test starts ``tests/sharded/_p2p_rank.py`` once per rank (senders ``0..T-1``,
receivers ``T..``), meeting at 127.0.0.1, and reads what each rank saw. The contracts
both data planes keep run on each (``plane``): Mooncake's are skipped where its wheel
(``mooncake-transfer-engine-non-cuda``) or its ``libibverbs1`` is not installed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aiosync.transports.sharded._mooncake import mooncake_available

pytestmark = pytest.mark.slow

_MOONCAKE = mooncake_available()
#: The data planes: gloo's ``run_plan`` and ``run_plan_mooncake``.
PLANES = [
    "gloo",
    pytest.param(
        "mooncake", marks=pytest.mark.skipif(_MOONCAKE is not None, reason=_MOONCAKE or "")
    ),
]

_SCRIPT = Path(__file__).with_name("_p2p_rank.py")
_FSDP_SCRIPT = Path(__file__).with_name("_fsdp_rank.py")
_REPO = Path(__file__).resolve().parents[2]


def run_ranks(
    scenario: str, world: int, tmp_path: Path, script: Path = _SCRIPT, plane: str = "gloo"
) -> list[dict[str, Any] | None]:
    """Run every rank of ``scenario``; each rank's result (None: it wrote none, it died)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(r),
                str(world),
                str(port),
                *([scenario] if scenario else []),
                str(tmp_path),
                *([plane] if scenario else []),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results: list[dict[str, Any] | None] = []
    for r in range(world):
        out = tmp_path / f"rank{r}.json"
        results.append(json.loads(out.read_text()) if out.exists() else None)
        if results[-1] is not None and not results[-1]["ok"]:
            print(f"--- rank {r} log:\n{logs[r][-3000:]}")
    return results


def assert_moved_exactly_the_plan(
    results: list[dict[str, Any] | None], senders: int, rounds: int = 1
) -> None:
    assert all(r is not None and r["ok"] for r in results), results
    assert len({r["digest"] for r in results if r is not None}) == 1
    for rank, r in enumerate(results):
        assert r is not None and len(r["rounds"]) == rounds, rank
        for one in r["rounds"]:
            assert one["by_peer"] == one["expected"], rank
            if rank >= senders:
                assert one["wrong"] == [] and one["not_once"] == [], (rank, one)
                assert one["nbytes"] == one["plan_received"]


@pytest.mark.parametrize("plane", PLANES)
def test_two_senders_to_two_tp_receivers_twice_each_receiver_ends_with_its_exact_slices(
    tmp_path: Path, plane: str
) -> None:
    results = run_ranks("2x2", 4, tmp_path, plane=plane)
    # The second sync sends other values (Mooncake re-registers and rewrites every slot).
    assert_moved_exactly_the_plan(results, senders=2, rounds=2)
    # Every rank sent or received (no funnel through rank 0): both senders to both
    # receivers, each receiver from both senders.
    for rank, result in enumerate(results):
        assert result is not None
        for one in result["rounds"]:
            assert all(n > 0 for n in one["by_peer"].values()), rank


def test_one_sender_to_two_receivers_over_a_bare_gloo_backend(tmp_path: Path) -> None:
    assert_moved_exactly_the_plan(run_ranks("1x2", 3, tmp_path), senders=1)


def test_two_senders_to_one_receiver_holding_everything(tmp_path: Path) -> None:
    assert_moved_exactly_the_plan(run_ranks("2x1", 3, tmp_path), senders=2)


@pytest.mark.parametrize("plane", PLANES)
def test_receiver_killed_mid_transfer_makes_every_sender_raise_a_transport_error(
    tmp_path: Path, plane: str
) -> None:
    results = run_ranks("kill", 4, tmp_path, plane=plane)
    assert results[3] is None  # it died at its 3rd box, writing nothing
    messages = []
    for rank in (0, 1):
        result = results[rank]
        assert result is not None and not result["ok"]
        # A lost link is the cause (a closed connection, a failed write), not the 30 s
        # timeout.
        assert result["error"] == "TransportError", result
        messages.append(result["message"])
    # The first sender to notice names the dead worker; the other may instead see
    # the survivor go (it fails, and exits, once the first sender has exited).
    assert any("inference worker 1" in m for m in messages), messages
    survivor = results[2]
    assert survivor is not None and not survivor["ok"]
    assert survivor["error"] in ("TransportError", "SyncTimeoutError"), survivor


@pytest.mark.parametrize("plane", PLANES)
def test_a_failed_source_and_a_failed_sink_make_every_rank_raise_naming_the_culprit(
    tmp_path: Path, plane: str
) -> None:
    r0, r1, w0, w1 = run_ranks("fail", 4, tmp_path, plane=plane)
    assert r1 is not None and (r1["error"], "injected source failure" in r1["message"]) == (
        "TransportError",
        True,
    )
    assert w0 is not None and (w0["error"], w0["message"]) == (
        "RuntimeError",
        "injected sink failure",
    )
    # The others learn it from the finish message of the pair, after the last bucket.
    assert r0 is not None and r0["error"] == "TransportError"
    assert r0["message"] == "inference worker 0 failed to store what trainer rank 0 sent"
    assert w1 is not None and w1["error"] == "TransportError"
    assert w1["message"].startswith("trainer rank 1 failed mid-transfer")


def test_plans_that_differ_raise_refit_mismatch_on_both_ends_before_any_bucket(
    tmp_path: Path,
) -> None:
    results = run_ranks("mismatch", 2, tmp_path)
    for result in results:
        assert result is not None and not result["ok"]
        assert result["error"] == "RefitMismatchError", result
        assert "planned differently" in result["message"]


def test_fsdp2_trainer_sends_its_own_shards_into_tp2_parts(tmp_path: Path) -> None:
    import torch

    from aiosync.layout import Part, box_of
    from aiosync.transports.sharded import box_within

    results = run_ranks("", 4, tmp_path, script=_FSDP_SCRIPT)
    assert all(r is not None and r["ok"] for r in results), results
    for rank in range(2):
        assert json.loads((tmp_path / f"layouts.rank{rank}.json").read_text()) == []
    full = torch.load(tmp_path / "full.pt")
    assert "lm_head.weight" not in full  # tied: sent once, as the checkpoint stores it
    total = sum(t.numel() * t.element_size() for t in full.values())
    for w in range(2):
        saved = torch.load(tmp_path / f"worker{w}.pt")
        parts = {n: Part.from_wire(p) for n, p in saved["parts"].items()}
        assert set(saved["received"]) == set(full)
        for name, part in parts.items():
            want = full[name][box_within(box_of(part), Part.whole(part.shape))]
            assert torch.equal(saved["received"][name], want), (w, name)
        held = sum(p.numel * full[n].element_size() for n, p in parts.items())
        assert results[2 + w]["plan_received"] == held  # type: ignore[index]
        assert results[2 + w]["nbytes"] == held  # type: ignore[index]
    # Every byte of the checkpoint left a trainer rank; both sent (no rank-0 funnel).
    sender_nbytes = results[0]["sender_nbytes"]  # type: ignore[index]
    assert all(n > 0 for n in sender_nbytes)
    assert sum(sender_nbytes) >= total
