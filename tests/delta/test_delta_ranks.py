"""Two FSDP2 trainer ranks refit an embedded engine with delta syncs, over the collective
and colocated over IPC (each rank feeding the worker on its device): the delta's bytes
are the patches', both ranks' events say so, a rank's failed read fails the sync on
every rank, and the next sync is a full one, bit-exact."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("_delta_ranks.py")
IPC_SCRIPT = Path(__file__).with_name("_ipc_delta_ranks.py")


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


@pytest.fixture(scope="module")
def ipc_ranks(tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Any) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ipc-delta-ranks")
    spawn_ranks(IPC_SCRIPT, 2, lambda r: [str(out / f"{r}.json")])
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def test_each_colocated_rank_sends_its_worker_only_the_patches(
    ipc_ranks: list[dict[str, Any]],
) -> None:
    zero, one = ipc_ranks
    full = zero["manifest_nbytes"]
    assert zero["full"] == one["full"] == [False, full]  # each rank: its one worker
    want = zero["expected_delta"]
    assert 0 < want < full / 4
    assert zero["delta"] == one["delta"] == [True, want]
    assert zero["took_patches"] == [True, True]
    assert zero["delta_holds"] == [True, True]


def test_a_failed_colocated_read_makes_the_next_sync_full_on_every_rank(
    ipc_ranks: list[dict[str, Any]],
) -> None:
    zero, one = ipc_ranks
    assert zero["failure"] is not None and one["failure"] == "InjectedFault"
    for seen in (zero, one):
        assert seen["after_failure"] == [3, 2, True]
        assert seen["healed"] == [False, zero["manifest_nbytes"]]
        assert seen["after_heal"] == [4, 4, False]
    assert zero["healed_holds"] == [True, True]
