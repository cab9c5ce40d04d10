"""A worker's weights validity: whether its engine may generate with what it holds.

Every engine worker carries ``aiosync_weights_valid`` (True until a refit starts). A
receiver turns it False before the first byte of a refit reaches the live weights and
True once the whole version landed (its KV-cache scales included); an engine turns it
False when it discards the worker's weights or a reload fails half-way. Engines
refuse to generate while it is False (the embedded engine's workers), and report it
(``aiosync_worker_info()["weights_valid"]``). Every write goes through here.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["HoldsWeights", "is_valid", "mark_invalid", "mark_valid"]


class HoldsWeights(Protocol):
    """An engine worker (a receiver mixin, the embedded engine's worker)."""

    aiosync_weights_valid: bool


def mark_invalid(worker: HoldsWeights) -> None:
    """``worker``'s live weights are no longer one whole version: a refit began writing
    them, or the engine discarded them."""
    worker.aiosync_weights_valid = False


def mark_valid(worker: HoldsWeights) -> None:
    """``worker``'s live weights are one whole version again: a refit landed whole."""
    worker.aiosync_weights_valid = True


def is_valid(worker: object) -> bool:
    """Whether ``worker`` may generate: True for a worker no refit has touched."""
    return bool(getattr(worker, "aiosync_weights_valid", True))
