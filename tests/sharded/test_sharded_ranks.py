"""Two FSDP2 trainer ranks refit a TP=2 embedded engine through ShardedWeightSynchronizer:
both ranks send (no gathers), each worker receives only its own slices, a rank's failed
shard read fails the sync on every rank and the next sync heals."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("_sharded_ranks.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Any) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharded-ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        store = int(s.getsockname()[1])
    spawn_ranks(SCRIPT, 2, lambda r: [str(store), str(out / f"{r}.json")])
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def test_both_ranks_send_and_each_worker_receives_only_its_slices(
    ranks: list[dict[str, Any]],
) -> None:
    zero, one = ranks
    assert zero["after_ok"] == one["after_ok"] == [1, 1, False]
    assert zero["bit_exact"] == [True, True]
    # Every rank plans the same transfers; both send, about half each.
    assert zero["sender_nbytes"] == one["sender_nbytes"]
    assert all(n > 0 for n in zero["sender_nbytes"])
    assert sum(zero["sender_nbytes"]) == zero["total_nbytes"]
    # Each worker receives exactly the bytes of the slices it holds, from both ranks:
    # less than the manifest (the sharded tensors' half, the replicated ones whole).
    assert zero["receiver_nbytes"] == zero["slice_nbytes"]
    assert all(n < zero["manifest_nbytes"] for n in zero["slice_nbytes"])
    for worker, by_sender in enumerate(zero["by_sender"]):
        assert set(by_sender) == {"0", "1"} and all(v > 0 for v in by_sender.values())
        assert sum(by_sender.values()) == zero["receiver_nbytes"][worker]


def test_a_failed_shard_read_fails_every_rank_and_the_next_sync_heals(
    ranks: list[dict[str, Any]],
) -> None:
    zero, one = ranks
    for seen in (zero, one):
        kind, message = seen["failure"]
        assert kind == "TransportError"
        assert "trainer rank 1" in message and "could not read its shard" in message
        assert seen["after_failure"] == [2, 1, True]
        assert seen["after_heal"] == [2, 2, False]
    assert zero["generate_after_failure"] == "SyncError"
    assert zero["healed_bit_exact"] == [True, True]
