"""Two FSDP2 trainer ranks refit an embedded engine with delta syncs, over the collective
and colocated over IPC (each rank feeding the worker on its device): the delta's bytes
are the patches', both ranks' events say so, a rank's failed read fails the sync on
every rank, and the next sync is a full one, bit-exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._support.launch import per_transport_ranks_fixture

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("_delta_ranks.py")
#: Per transport: the engine's workers (collective: one, fed by rank 0; IPC: one per rank).
WORKERS = {"collective": 1, "ipc": 2}


ranks = per_transport_ranks_fixture(SCRIPT, "delta-ranks", list(WORKERS))


def test_a_sharded_trainer_sends_only_the_patches(
    ranks: tuple[str, list[dict[str, Any]]],
) -> None:
    transport, (zero, one) = ranks
    full = zero["manifest_nbytes"]
    assert zero["full"] == one["full"] == [False, full]  # IPC: each rank, its one worker
    want = zero["expected_delta"]
    assert 0 < want < full / 4
    assert zero["delta"] == one["delta"] == [True, want]
    assert zero["delta_holds"] == [True] * WORKERS[transport]
    if transport == "ipc":
        assert zero["took_patches"] == [True, True]


def test_a_failed_read_on_one_rank_makes_the_next_sync_full(
    ranks: tuple[str, list[dict[str, Any]]],
) -> None:
    transport, (zero, one) = ranks
    assert one["failure"] == ["InjectedFault", "after: the source failed after its last tensor"]
    if transport == "collective":
        assert zero["failure"] == [
            "TransportError",
            "trainer rank 1 raised InjectedFault: after: the source failed after its last tensor",
        ]
    else:
        assert zero["failure"] is not None
    for seen in (zero, one):
        assert seen["after_failure"] == [3, 2, True]
        assert seen["healed"] == [False, zero["manifest_nbytes"]]  # no delta after a failure
        assert seen["after_heal"] == [4, 4, False]
    assert zero["healed_holds"] == [True] * WORKERS[transport]
