"""The constructor checks the shipped transports share, each with its one message.

A transport refuses a bad option in its ``__init__``, before the base class registers
anything on the engine; these say what a size, a limit or a fraction must be, in the
same words for every transport (``ValueError``, naming the option and the value).
"""

from __future__ import annotations

import math

__all__ = ["check_fraction", "check_positive", "check_seconds"]


def check_positive(name: str, value: float | None) -> None:
    """Refuse a size or limit that is not > 0 (None: the transport's default).

    Raises:
        ValueError: ``"<name> must be > 0, got <value>"``.
    """
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def check_seconds(name: str, value: float | None) -> None:
    """Refuse a limit in seconds that is not a finite number > 0 (None: the default).

    Raises:
        ValueError: ``"<name> must be a finite number > 0, got <value>"``.
    """
    if value is not None and not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_fraction(name: str, value: float) -> None:
    """Refuse a fraction outside ``(0, 1]``.

    Raises:
        ValueError: ``"<name> must be in (0, 1], got <value>"``.
    """
    if not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value}")
