"""Two FSDP2 trainer ranks refit fleets of embedded engines through the shard-aware
transport: two TP=1 engines (each worker holds every tensor whole), and DP=2 x TP=2
(two TP=2 engines, four workers). Each worker gets exactly its part, from both ranks,
bit for bit, and every engine's greedy output equals the trainer's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._support.launch import rank_results

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("_sharded_fleet_ranks.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Any) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("sharded-fleet")
    return rank_results(spawn_ranks, folder, SCRIPT, 2, store_ports=2)  # a store per fleet


@pytest.mark.parametrize(
    ("fleet", "workers", "factory_pick"),
    [
        # Whole copies everywhere: the broadcast is the factory's pick, sharded=True forces.
        ("tp1", 2, "CollectiveWeightSynchronizer"),
        ("dp2xtp2", 4, "ShardedWeightSynchronizer"),
    ],
)
def test_each_worker_of_the_fleet_gets_its_part_from_both_ranks(
    ranks: list[dict[str, Any]], fleet: str, workers: int, factory_pick: str
) -> None:
    zero, one = ranks[0][fleet], ranks[1][fleet]
    assert zero["class"] == one["class"] == "ShardedWeightSynchronizer"
    assert zero["factory_pick"] == factory_pick
    assert zero["versions"] == one["versions"] == [2, 2, False]
    # Every rank planned the same transfers, and both send.
    assert zero["sender_nbytes"] == one["sender_nbytes"]
    assert all(n > 0 for n in zero["sender_nbytes"])
    assert zero["receiver_nbytes"] == zero["slice_nbytes"] and len(zero["slice_nbytes"]) == workers
    for step in range(2):
        assert zero[f"holds_{step}"] == [True] * workers
        for worker, by_sender in enumerate(zero[f"by_sender_{step}"]):
            assert set(by_sender) == {"0", "1"} and all(v > 0 for v in by_sender.values())
            assert sum(by_sender.values()) == zero["receiver_nbytes"][worker]
        trainer = zero[f"trainer_greedy_{step}"]
        assert zero[f"greedy_{step}"] == [trainer, trainer]
    # A whole-copy worker receives the manifest; a TP=2 worker less than it.
    manifest = zero["manifest_nbytes"]
    if fleet == "tp1":
        assert zero["slice_nbytes"] == [manifest, manifest]
    else:
        assert all(n < manifest for n in zero["slice_nbytes"])
        assert zero["slice_nbytes"][0] == zero["slice_nbytes"][2]  # replica 1 = replica 0
