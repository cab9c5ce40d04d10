"""The plan over Mooncake's data plane: real processes, buckets by Mooncake writes on 127.0.0.1.

Each test starts ``tests/sharded/_mooncake_rank.py`` once per rank (senders 0..1,
receivers 2..3) and reads what each rank saw. Skipped where Mooncake's wheel
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

_REASON = mooncake_available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

_SCRIPT = Path(__file__).with_name("_mooncake_rank.py")
_REPO = Path(__file__).resolve().parents[2]
_WORLD = 4


def run_ranks(scenario: str, tmp_path: Path) -> list[dict[str, Any] | None]:
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
            [sys.executable, str(_SCRIPT), str(r), str(_WORLD), str(port), scenario, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(_WORLD)
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
    for r in range(_WORLD):
        out = tmp_path / f"rank{r}.json"
        results.append(json.loads(out.read_text()) if out.exists() else None)
        if results[-1] is not None and not results[-1]["ok"]:
            print(f"--- rank {r} log:\n{logs[r][-3000:]}")
    return results


def test_two_senders_to_two_receivers_twice_every_box_bit_exact_and_bytes_as_planned(
    tmp_path: Path,
) -> None:
    results = run_ranks("2x2", tmp_path)
    assert all(r is not None and r["ok"] for r in results), results
    assert len({r["digest"] for r in results if r is not None}) == 1
    for rank, r in enumerate(results):
        assert r is not None and len(r["rounds"]) == 2, rank
        for one in r["rounds"]:  # the second sync re-registers and rewrites every slot
            assert one["by_peer"] == one["expected"], rank
            assert all(n > 0 for n in one["by_peer"].values()), rank  # no funnel
            if rank >= 2:
                assert one["wrong"] == [] and one["not_once"] == [], (rank, one)
                assert one["nbytes"] == one["plan_received"]


def test_receiver_killed_mid_transfer_makes_every_sender_raise_a_transport_error(
    tmp_path: Path,
) -> None:
    results = run_ranks("kill", tmp_path)
    assert results[3] is None  # it died at its 3rd box, writing nothing
    messages = []
    for rank in (0, 1):
        result = results[rank]
        assert result is not None and not result["ok"]
        # A lost link is the cause (a closed connection, a failed write), not the 30 s timeout.
        assert result["error"] == "TransportError", result
        messages.append(result["message"])
    # The first sender to notice names the dead worker; the other may instead see
    # the survivor go (it fails, and exits, once the first sender has exited).
    assert any("inference worker 1" in m for m in messages), messages
    survivor = results[2]
    assert survivor is not None and not survivor["ok"]
    assert survivor["error"] in ("TransportError", "SyncTimeoutError"), survivor


def test_a_failed_source_and_a_failed_sink_make_every_rank_raise_naming_the_culprit(
    tmp_path: Path,
) -> None:
    r0, r1, w0, w1 = run_ranks("fail", tmp_path)
    assert r1 is not None and r1["error"] == "TransportError", r1
    assert "injected source failure" in r1["message"]
    assert w0 is not None and (w0["error"], w0["message"]) == (
        "RuntimeError",
        "injected sink failure",
    )
    # The others learn it from the finish message of the pair, after the last bucket.
    assert r0 is not None and r0["error"] == "TransportError"
    assert r0["message"] == "inference worker 0 failed to store what trainer rank 0 sent"
    assert w1 is not None and w1["error"] == "TransportError"
    assert w1["message"].startswith("trainer rank 1 failed mid-transfer")


def test_a_write_to_an_address_the_peer_never_registered_is_a_lost_link() -> None:
    import torch

    from aiosync.transports.sharded._mooncake import _engine, _submit_write, _wait_write
    from aiosync.transports.sharded._p2p import LinkLost

    engine = _engine("127.0.0.1")
    segment = f"127.0.0.1:{engine.get_rpc_port()}"  # its own: the server checks every address
    data, elsewhere = torch.ones(512, dtype=torch.uint8), torch.zeros(512, dtype=torch.uint8)
    batch = _submit_write(engine, segment, data.data_ptr(), elsewhere.data_ptr(), 512, "probe")
    with pytest.raises(LinkLost, match="probe: Mooncake transfer failed"):
        _wait_write(engine, batch, 30.0, "probe")
    assert int(elsewhere.sum()) == 0


def test_a_write_to_a_segment_nobody_listens_on_is_a_lost_link() -> None:
    import torch

    from aiosync.transports.sharded._mooncake import _engine, _submit_write
    from aiosync.transports.sharded._p2p import LinkLost

    with socket.socket() as s:  # a port that was free a moment ago: connection refused
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    data = torch.ones(512, dtype=torch.uint8)
    with pytest.raises(LinkLost, match="probe: Mooncake transfer failed"):
        _submit_write(_engine("127.0.0.1"), f"127.0.0.1:{port}", data.data_ptr(), 0, 512, "probe")
