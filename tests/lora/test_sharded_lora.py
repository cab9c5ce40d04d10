"""A sharded LoRA trainer: 2 gloo ranks, one ``LoRAAdapterSynchronizer`` each, rank 0 holding
an SGLang-contract server's backend (``_sharded_lora_trainer.py`` runs each rank).

A sync commits on every rank or fails on every rank with the same typed error;
a rank that fails to read the adapter keeps rank 0 from loading it at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lora_harness import ADAPTER_NBYTES, lora_server

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from lora_server(tmp_path_factory.mktemp("sharded-lora-server"), "--enable-lora")


@pytest.fixture(scope="module")
def ranks(
    server: Any, tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Any
) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharded-lora")
    script = HERE / "_sharded_lora_trainer.py"
    spawn_ranks(script, 2, lambda r: [server.url, str(out / f"{r}.json")])
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def test_versions_and_events_agree_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for key, versions in (
        ("after_ok", [1, 1, False]),
        ("after_failure", [2, 1, True]),
        ("after_heal", [2, 2, False]),
    ):
        assert [r[key] for r in ranks] == [versions, versions], key
    expected = [
        ["stale", 1, 0],
        ["sync_started", 1, 0],
        ["committed", 1, ADAPTER_NBYTES],
        ["stale", 2, 0],
        ["sync_started", 2, 0],
        ["failed", 2, 0],
        ["sync_started", 2, 0],
        ["committed", 2, ADAPTER_NBYTES],
    ]
    assert [r["events"] for r in ranks] == [expected, expected]
    assert ranks[0]["ok_matches_merged"] is True
    assert ranks[0]["heal_matches_merged"] is True


def test_one_ranks_failure_fails_every_rank_alike_and_nothing_is_loaded(
    ranks: list[dict[str, Any]], server: Any
) -> None:
    assert ranks[1]["failure"] == ["RefitMismatchError", "rank 1's source broke mid-read"]
    assert ranks[0]["failure"] == [
        "RefitMismatchError",
        "trainer rank 1: rank 1's source broke mid-read",
    ]
    # Rank 0 read the whole adapter, but loaded nothing: the ranks agreed first.
    assert ranks[0]["adapter_after_failure"] == "aiosync-v1"
    loads = [
        (e["path"], e.get("lora_name"), e["status"])
        for e in server.log()
        if e["path"] in ("/load_lora_adapter", "/unload_lora_adapter")
    ]
    assert loads == [
        ("/load_lora_adapter", "aiosync-v1", 200),
        ("/load_lora_adapter", "aiosync-v2", 200),
        ("/unload_lora_adapter", "aiosync-v1", 200),
    ]
