"""A sharded trainer: 2 FSDP2 ranks (gloo) paired per device with a 2-worker embedded engine.

The ranks run ``_sharded_trainer.py`` (one process each); rank 0 holds the engine.
Each worker stands for one device and must be fed by the trainer rank on that
device only; a failure on one rank fails the sync on every rank alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._support.launch import rank_results

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Any) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("sharded")
    return rank_results(spawn_ranks, folder, HERE / "_sharded_trainer.py", 2, store_ports=0)


def test_each_rank_feeds_only_the_worker_on_its_device_bit_exact(
    ranks: list[dict[str, Any]],
) -> None:
    assert [r["peers"] for r in ranks] == [[0], [1]]
    assert ranks[0]["bit_exact"] == [True, True]
    receives = ranks[0]["receives"]
    assert [(x["rank"], x["senders"]) for x in receives] == [(0, ["cpu:0"]), (1, ["cpu:1"])]
    # Every worker got the whole checkpoint (25 tensors of the tiny Qwen3, fp32).
    assert [(x["tensors"], x["bytes"]) for x in receives] == [(25, 460544), (25, 460544)]


def test_each_rank_gathers_into_its_buckets_and_packing_copies_no_byte(
    ranks: list[dict[str, Any]],
) -> None:
    # FSDP2 shards every tensor of the tiny Qwen3 on dim 0 in equal halves: each rank's
    # all-gather writes into the bucket's slot, the only trainer-side copy (bit-exact:
    # the test above).
    for r in ranks:
        (traced, planned) = r["packed"]["buckets"]
        assert traced == planned > 1
        assert (r["packed"]["tensor_bytes"], r["packed"]["copied"]) == (460544, 0)


def test_versions_agree_on_every_rank_after_success_failure_and_heal(
    ranks: list[dict[str, Any]],
) -> None:
    for key, versions in (
        ("after_ok", [1, 1, False]),
        ("after_failure", [2, 1, True]),
        ("after_heal", [2, 2, False]),
    ):
        assert [r[key] for r in ranks] == [versions, versions], key


def test_a_worker_dying_on_one_device_fails_the_sync_on_every_rank_with_one_error(
    ranks: list[dict[str, Any]],
) -> None:
    (kind0, message0), (kind1, message1) = (r["failure"] for r in ranks)
    assert kind0 == kind1 == "TransportError"
    assert message0.startswith("engine worker 1 died: process ")
    assert message1 == f"trainer rank 0: {message0}"
    assert ranks[0]["respawned"] == [1]
    assert ranks[0]["healed_bit_exact"] == [True, True]
