"""The scheduler's share of a device for a colocated generation worker (not its memory).

In NeMo-RL, ``min(0.2, 1 / max_colocated_worker_groups)`` is the fraction of a
GPU that a colocated SGLang generation worker *requests from Ray*
(``num_gpus``, ``nemo_rl/models/generation/sglang/sglang_generation.py``;
other worker groups request ``1 / max_colocated_worker_groups``,
``nemo_rl/distributed/worker_groups.py``). Ray uses it only to place several
actors on one GPU; it limits no memory. How much memory the engine takes is a
separate setting of the engine — vLLM's ``gpu_memory_utilization``, SGLang's
``mem_fraction_static`` — which NeMo-RL's colocated recipes set to 0.3–0.9
(mostly 0.5–0.8). Passing this share (0.2) as ``gpu_memory_utilization``
would leave vLLM a fifth of the device for weights, activations and KV cache.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["COLOCATED_SCHEDULER_GPU_SHARE_CAP", "scheduler_gpu_share"]

#: Largest share of one GPU a colocated generation worker requests from the
#: scheduler (Ray ``num_gpus``): small enough that the trainer's workers and other
#: groups fit on the same device in Ray's bookkeeping. A placement figure, not memory.
COLOCATED_SCHEDULER_GPU_SHARE_CAP: float = 0.2

#: Why the old names (``generation_gpu_fraction``, ``COLOCATED_GPU_FRACTION_CAP``)
#: were renamed: they read as memory fractions, which they never were.
_NOT_MEMORY = (
    "it is the scheduler's GPU share of a colocated worker (Ray num_gpus), not a memory "
    "fraction: do not pass it as vLLM's gpu_memory_utilization or SGLang's "
    "mem_fraction_static (set those from the engine's own memory needs, e.g. 0.5-0.8)"
)


def scheduler_gpu_share(max_colocated_worker_groups: int, *, colocated: bool = True) -> float:
    """Fraction of one GPU (0..1, a scheduler resource) a generation worker requests.

    This is what a colocated worker asks a scheduler such as Ray for
    (``num_gpus=``) so that it can be placed on a device the trainer also uses;
    it bounds no memory. Set the engine's memory fraction
    (``gpu_memory_utilization`` / ``mem_fraction_static``) separately.

    Colocated: ``min(0.2, 1 / max_colocated_worker_groups)`` — as NeMo-RL
    requests for its colocated SGLang workers: ``n`` worker groups sharing a
    device (e.g. a policy and a reference engine) split it evenly, at most a
    fifth each. Dedicated (``colocated=False``): the whole device, ``1.0``.

    Args:
        max_colocated_worker_groups: the most worker groups that share one
            device (>= 1); ignored when not colocated.
        colocated: whether the trainer shares the device.

    Returns:
        The share of one GPU, in (0, 1].

    Raises:
        ValueError: ``max_colocated_worker_groups < 1`` (or a bool).
    """
    if isinstance(max_colocated_worker_groups, bool) or max_colocated_worker_groups < 1:
        raise ValueError(
            f"max_colocated_worker_groups must be >= 1, got {max_colocated_worker_groups}"
        )
    if not colocated:
        return 1.0
    return min(COLOCATED_SCHEDULER_GPU_SHARE_CAP, 1.0 / max_colocated_worker_groups)


def _generation_gpu_fraction(max_colocated_worker_groups: int, *, colocated: bool = True) -> float:
    """Deprecated alias of :func:`scheduler_gpu_share` (warns; same value)."""
    warnings.warn(
        f"generation_gpu_fraction is deprecated, use scheduler_gpu_share: {_NOT_MEMORY}",
        DeprecationWarning,
        stacklevel=2,
    )
    return scheduler_gpu_share(max_colocated_worker_groups, colocated=colocated)


def __getattr__(name: str) -> Any:
    # Module-level getattr (PEP 562): the old names still import, with a warning
    # that says why they were renamed, instead of an ImportError without a reason.
    if name == "generation_gpu_fraction":
        return _generation_gpu_fraction
    if name == "COLOCATED_GPU_FRACTION_CAP":
        warnings.warn(
            f"COLOCATED_GPU_FRACTION_CAP is deprecated, use "
            f"COLOCATED_SCHEDULER_GPU_SHARE_CAP: {_NOT_MEMORY}",
            DeprecationWarning,
            stacklevel=2,
        )
        return COLOCATED_SCHEDULER_GPU_SHARE_CAP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
