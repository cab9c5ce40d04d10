"""A sharded trainer's engine taken over by another synchronizer, on IPC and the collective.

Both ranks of a 2-rank FSDP2 trainer run ``tests/_sharded_owners.py``; rank 0 holds the
engine, and a second synchronizer in rank 0's process commits into it. Only rank 0 can
see that, so the ranks must agree on it before any of them starts the source's gathers
(else rank 1 waits in a gather rank 0 never joins), and they must agree on ``is_stale``
after a take-over (else the ranks that think they are current skip the sync).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._support.launch import per_transport_ranks_fixture

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "_sharded_owners.py"


ranks = per_transport_ranks_fixture(SCRIPT, "owners", ["ipc", "collective"])


def test_the_take_over_is_refused_alike_on_every_rank(
    ranks: tuple[str, list[dict[str, Any]]],
) -> None:
    transport, (zero, one) = ranks
    if transport == "collective":
        # The workers' sync group is A's while A lives: B is refused, A keeps the engine.
        kind, message = zero["b_error"]
        assert kind == "OwnershipError"
        assert "in the sync group of another synchronizer, which is still alive" in message
        assert zero["b_owns"] == [False]
        assert zero["refused"] is None and one["refused"] is None
        assert zero["a_refused"] == one["a_refused"] == [2, 2, False]
        return
    assert zero["b_error"] is None and zero["b_owns"] == [True, True]
    name = "IPCWeightSynchronizer" if transport == "ipc" else "CollectiveWeightSynchronizer"
    # Before its next sync neither rank knows (is_stale stays equal on both ranks).
    assert zero["a_after_takeover"] == one["a_after_takeover"] == [1, 1, False]
    kind, message = zero["refused"]
    assert kind == "OwnershipError"
    assert message.startswith(f"{name} no longer owns its engine: {name} (owner ")
    assert "committed its version 1 into EmbeddedEngine" in message
    kind, message = one["refused"]
    assert kind == "OwnershipError"
    assert message.startswith(f"trainer rank 0: {name} no longer owns its engine")
    assert zero["a_refused"] == one["a_refused"] == [2, 1, True]


def test_re_initialising_takes_the_engine_back_on_every_rank(
    ranks: tuple[str, list[dict[str, Any]]],
) -> None:
    transport, (zero, one) = ranks
    taken = transport == "ipc"  # the collective refused the take-over
    for seen in (zero, one):
        assert seen["a_reinit_stale"] is taken
        assert seen["a_refit"] is taken
        assert seen["a_healed"] == [2, 2, False]
    assert zero["a_bit_exact"] == ([True, True] if taken else [True])


def test_a_restarted_sharded_trainer_starts_stale_and_continues_its_versions(
    ranks: tuple[str, list[dict[str, Any]]],
) -> None:
    _transport, (zero, one) = ranks
    for seen in (zero, one):
        # The engine serves the previous synchronizer's weights: stale on every rank.
        assert seen["resumed_start"] == [7, 7, True]
        assert seen["resumed_refit"] is True
        assert seen["resumed"] == [7, 7, False]  # the checkpoint's weights, labelled 7
        assert seen["resumed_stepped"] == [8, 8, False]
    assert zero["engine_version"] == 8
