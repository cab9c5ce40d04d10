"""Two FSDP2 trainer ranks refit an embedded engine with delta syncs over the collective:
the delta's bytes are the patches', both ranks' events say so, a rank's failed read fails
the sync on every rank before any patch moves, and the next sync is a full one, bit-exact."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("_delta_ranks.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Any) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("delta-ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        store = int(s.getsockname()[1])
    spawn_ranks(SCRIPT, 2, lambda r: [str(store), str(out / f"{r}.json")])
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def test_a_sharded_trainer_sends_only_the_patches(ranks: list[dict[str, Any]]) -> None:
    zero, one = ranks
    full = zero["manifest_nbytes"]
    assert zero["full"] == one["full"] == [False, full]
    want = zero["expected_delta"]
    assert 0 < want < full / 4
    assert zero["delta"] == one["delta"] == [True, want]
    assert zero["delta_holds"] is True


def test_a_failed_read_on_one_rank_makes_the_next_sync_full(
    ranks: list[dict[str, Any]],
) -> None:
    zero, one = ranks
    assert zero["failure"] == [
        "TransportError",
        "trainer rank 1 raised InjectedFault: after: the source failed after its last tensor",
    ]
    assert one["failure"] == ["InjectedFault", "after: the source failed after its last tensor"]
    for seen in (zero, one):
        assert seen["after_failure"] == [3, 2, True]
        assert seen["healed"] == [False, zero["manifest_nbytes"]]  # no delta after a failure
        assert seen["after_heal"] == [4, 4, False]
    assert zero["healed_holds"] is True
