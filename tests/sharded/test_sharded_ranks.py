"""Two FSDP2 trainer ranks refit a TP=2 embedded engine through ShardedWeightSynchronizer:
both ranks send (no gathers), each worker receives only its own slices, a rank's failed
shard read fails the sync on every rank and the next sync heals. With delta syncs on the
same plan: both ranks send patches, the workers end bit-exact, both ranks' COMMITTED
events say the same delta bytes, and a rank's failed read makes the next sync full."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._support.launch import rank_results

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("_sharded_ranks.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Any) -> list[dict[str, Any]]:
    return rank_results(spawn_ranks, tmp_path_factory.mktemp("sharded-ranks"), SCRIPT, 2, "plain")


@pytest.fixture(scope="module")
def delta_ranks(tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Any) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("sharded-delta-ranks")
    return rank_results(spawn_ranks, folder, SCRIPT, 2, "delta")


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


def test_both_ranks_send_patches_and_agree_on_the_committed_bytes(
    delta_ranks: list[dict[str, Any]],
) -> None:
    zero, one = delta_ranks
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


@pytest.mark.parametrize("mode", ["plain", "delta"])
def test_a_failed_shard_read_fails_every_rank_and_the_next_sync_heals(
    request: pytest.FixtureRequest, mode: str
) -> None:
    """Plain: the next sync heals in place. Delta: the next sync is a full one."""
    zero, one = request.getfixturevalue("delta_ranks" if mode == "delta" else "ranks")
    failed, healed = (
        ([2, 1, True], [2, 2, False]) if mode == "plain" else ([3, 2, True], [4, 4, False])
    )
    for seen in (zero, one):
        kind, message = seen["failure"]
        assert kind == "TransportError"
        assert "trainer rank 1" in message and "could not read its shard" in message
        assert seen["after_failure"] == failed
        assert seen["after_heal"] == healed
        if mode == "delta":
            assert seen["healed"] == [False, zero["total_nbytes"]]  # no delta after a failure
    if mode == "plain":
        assert zero["generate_after_failure"] == "SyncError"
    assert zero["healed_bit_exact"] == [True, True]
