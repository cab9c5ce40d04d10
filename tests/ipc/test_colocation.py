"""The scheduler's GPU share of a colocated generation worker (not a memory fraction)."""

from __future__ import annotations

import pytest

from aiosync.engines import colocation
from aiosync.engines.colocation import COLOCATED_SCHEDULER_GPU_SHARE_CAP, scheduler_gpu_share


@pytest.mark.parametrize(
    ("groups", "expected"),
    [(1, 0.2), (2, 0.2), (5, 0.2), (8, 0.125), (10, 0.1)],
)
def test_colocated_share_is_capped_at_a_fifth_and_split_between_groups(
    groups: int, expected: float
) -> None:
    assert scheduler_gpu_share(groups) == expected
    assert COLOCATED_SCHEDULER_GPU_SHARE_CAP == 0.2


def test_dedicated_worker_claims_the_whole_device() -> None:
    assert scheduler_gpu_share(4, colocated=False) == 1.0


@pytest.mark.parametrize("groups", [0, -1, True])
def test_fewer_than_one_group_is_rejected(groups: int) -> None:
    with pytest.raises(ValueError, match="max_colocated_worker_groups"):
        scheduler_gpu_share(groups)


def test_the_share_is_documented_as_a_scheduler_figure_not_memory() -> None:
    doc = scheduler_gpu_share.__doc__ or ""
    assert "num_gpus" in doc and "gpu_memory_utilization" in doc
    assert "generation_gpu_fraction" not in colocation.__all__


def test_old_function_name_warns_that_it_is_not_a_memory_fraction() -> None:
    from aiosync.engines.colocation import generation_gpu_fraction  # still importable

    with pytest.warns(DeprecationWarning, match=r"scheduler_gpu_share.*not a memory fraction"):
        assert generation_gpu_fraction(8) == scheduler_gpu_share(8)


def test_old_cap_name_warns_and_keeps_its_value() -> None:
    with pytest.warns(DeprecationWarning, match="COLOCATED_SCHEDULER_GPU_SHARE_CAP"):
        assert colocation.COLOCATED_GPU_FRACTION_CAP == COLOCATED_SCHEDULER_GPU_SHARE_CAP


def test_unknown_attribute_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = colocation.no_such_name
