"""Case C39: an FSDP2 Qwen3-MoE trainer (fused experts, 3 ranks, uneven chunks) into a
TP=2 embedded engine: the factory picks the shard-aware path and it refits bit-exactly,
each rank sending the experts it holds under their per-expert checkpoint names; experts
cut along another dim keep the broadcast, and ``sharded=True`` is refused naming them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._support.launch import rank_results

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("_sharded_moe_ranks.py")
WORLD = 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Any) -> list[dict[str, Any]]:
    return rank_results(spawn_ranks, tmp_path_factory.mktemp("sharded-moe"), SCRIPT, WORLD)


def test_the_factorys_shard_aware_pick_refits_an_fsdp2_moe_trainer_bit_exactly(
    ranks: list[dict[str, Any]],
) -> None:
    zero = ranks[0]
    assert [r.get("init_error") for r in ranks] == [None] * WORLD
    assert [r["transport"] for r in ranks] == ["ShardedWeightSynchronizer"] * WORLD
    for seen in ranks:
        assert (seen["after_0"], seen["after_1"]) == ([1, 1, False], [2, 2, False])
    assert (zero["bit_exact_0"], zero["bit_exact_1"]) == ([True, True], [True, True])
    assert zero["tokens_agree_0"] is zero["tokens_agree_1"] is True
    # Every rank sends its own shards: the experts are not gathered onto one sender.
    assert len(zero["sender_nbytes"]) == WORLD and all(n > 0 for n in zero["sender_nbytes"])


def test_experts_cut_along_another_dim_keep_the_broadcast_and_refuse_sharded_true(
    ranks: list[dict[str, Any]],
) -> None:
    assert ranks[0]["picked_for_dim_1"] == "CollectiveWeightSynchronizer"
    for seen in ranks:
        message = seen["sharded_dim_1"]
        assert message is not None
        assert message.startswith(
            "the shard-aware transport cannot send model.layers.0.mlp.experts.down_proj: "
            "sharded along dim(s) [1]"
        )
        assert "model.layers.0.mlp.experts.0.down_proj.weight" in message
        assert "use the broadcast (sharded=False)" in message
