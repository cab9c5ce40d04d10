"""Two FSDP2 trainer ranks refit a TP=2 embedded engine with delta syncs on the shard-aware
plan: both ranks send patches, the workers end bit-exact, both ranks' COMMITTED events say
the same delta bytes, and a rank's failed read fails every rank and makes the next sync
full."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("_sharded_delta_ranks.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Any) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharded-delta-ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        store = int(s.getsockname()[1])
    spawn_ranks(SCRIPT, 2, lambda r: [str(store), str(out / f"{r}.json")])
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def test_both_ranks_send_patches_and_agree_on_the_committed_bytes(
    ranks: list[dict[str, Any]],
) -> None:
    zero, one = ranks
    full = zero["total_nbytes"]
    assert zero["full"] == one["full"] == [False, full]
    want = zero["expected_delta"]
    assert want == one["expected_delta"] and 0 < want < full / 4
    assert zero["delta"] == one["delta"] == [True, want]
    assert zero["delta_bit_exact"] == [True, True]
    # Each worker got patches from both trainer ranks (each changed its own shard).
    for by_sender in zero["delta_by_sender"]:
        assert set(by_sender) == {"0", "1"} and all(n > 0 for n in by_sender.values())
    assert sum(n for by in zero["delta_by_sender"] for n in by.values()) == want


def test_a_failed_read_on_one_rank_fails_every_rank_and_the_next_sync_is_full(
    ranks: list[dict[str, Any]],
) -> None:
    zero, one = ranks
    for seen in (zero, one):
        kind, message = seen["failure"]
        assert kind == "TransportError"
        assert "trainer rank 1" in message and "could not read its shard" in message
        assert seen["after_failure"] == [3, 2, True]
        assert seen["healed"] == [False, zero["total_nbytes"]]  # no delta after a failure
        assert seen["after_heal"] == [4, 4, False]
    assert zero["healed_bit_exact"] == [True, True]
