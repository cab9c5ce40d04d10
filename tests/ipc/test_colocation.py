"""The device share of a colocated generation worker."""

from __future__ import annotations

import pytest

from aiosync.engines.colocation import generation_gpu_fraction


@pytest.mark.parametrize(
    ("groups", "expected"),
    [(1, 0.2), (2, 0.2), (5, 0.2), (8, 0.125), (10, 0.1)],
)
def test_colocated_share_is_capped_at_a_fifth_and_split_between_groups(
    groups: int, expected: float
) -> None:
    assert generation_gpu_fraction(groups) == expected


def test_dedicated_worker_claims_the_whole_device() -> None:
    assert generation_gpu_fraction(4, colocated=False) == 1.0


@pytest.mark.parametrize("groups", [0, -1])
def test_fewer_than_one_group_is_rejected(groups: int) -> None:
    with pytest.raises(ValueError, match="max_colocated_worker_groups"):
        generation_gpu_fraction(groups)
