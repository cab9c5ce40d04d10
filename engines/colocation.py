"""How much of a device a colocated generation worker may claim."""

from __future__ import annotations

__all__ = ["COLOCATED_GPU_FRACTION_CAP", "generation_gpu_fraction"]

#: Most of a device a colocated generation worker claims: the trainer's
#: parameters, gradients and (reloaded) optimizer state need the rest.
COLOCATED_GPU_FRACTION_CAP: float = 0.2


def generation_gpu_fraction(max_colocated_worker_groups: int, *, colocated: bool = True) -> float:
    """Fraction of a device's memory a generation worker may claim (``gpu_memory_utilization``).

    Colocated: ``min(0.2, 1 / max_colocated_worker_groups)`` — the cap leaves
    room for the trainer sharing the device, and ``n`` worker groups sharing it
    (e.g. a policy and a reference engine) split it evenly. Dedicated
    (``colocated=False``): the whole device, ``1.0``.

    Args:
        max_colocated_worker_groups: the most worker groups that share one
            device (>= 1); ignored when not colocated.
        colocated: whether the trainer shares the device.

    Raises:
        ValueError: ``max_colocated_worker_groups < 1``.
    """
    if isinstance(max_colocated_worker_groups, bool) or max_colocated_worker_groups < 1:
        raise ValueError(
            f"max_colocated_worker_groups must be >= 1, got {max_colocated_worker_groups}"
        )
    if not colocated:
        return 1.0
    return min(COLOCATED_GPU_FRACTION_CAP, 1.0 / max_colocated_worker_groups)
