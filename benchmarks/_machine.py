"""What every benchmark records about the machine it ran on: load, repeats, CPUs.

A figure taken on a loaded machine measures the other tenants as much as the
code, so each script records ``os.getloadavg()[0]`` (the 1-minute load average,
runnable processes) when it starts and when it ends, the number of repeats
behind each figure, and the CPU count, prints them with its table, and warns
when the load was above 1 per core. Scripts import it as a sibling module
(``from _machine import Machine``): the script's folder is first on ``sys.path``.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

#: Repeats of a full run (the best is kept): one slow outlier cannot win a minimum of 3.
FULL_REPEATS = 3
#: Repeats of a ``--quick`` run: a smoke test (the suite runs every benchmark's),
#: seconds, whose figures are not evidence.
QUICK_REPEATS = 1


def repeats_for(quick: bool, requested: int | None = None) -> int:
    """Repeats to run: ``QUICK_REPEATS`` when quick, else ``requested`` but at least 3."""
    if quick:
        return QUICK_REPEATS
    return max(FULL_REPEATS, requested or FULL_REPEATS)


def load_average() -> float:
    """The 1-minute load average (runnable processes, not a percentage), 2 decimals."""
    return round(os.getloadavg()[0], 2)


class Machine:
    """The load around one benchmark run; create it first, call :meth:`finish` after timing."""

    def __init__(self, repeats: int) -> None:
        self.repeats = repeats
        self.cpus = os.cpu_count() or 1
        self.load_start = load_average()
        self.load_end: float | None = None

    def finish(self) -> None:
        """Record the load at the end (idempotent: the first call wins)."""
        if self.load_end is None:
            self.load_end = load_average()

    @property
    def load(self) -> list[float]:
        """``[start, end]`` 1-minute load averages (the end is read now if not finished)."""
        self.finish()
        assert self.load_end is not None
        return [self.load_start, self.load_end]

    @property
    def overloaded(self) -> bool:
        """Whether the load exceeded 1 runnable process per core at either end."""
        return max(self.load) > self.cpus

    def fields(self) -> dict[str, Any]:
        """The JSON fields every benchmark reports: ``load_average``, ``repeats``, ``cpus``."""
        return {"load_average": self.load, "repeats": self.repeats, "cpus": self.cpus}

    def caption(self, statistic: str = "best") -> str:
        """One line for under (or in) the table, e.g. ``best of 3; load 0.4 -> 0.6; 2 CPUs``."""
        start, end = self.load
        return f"{statistic} of {self.repeats}; load {start} -> {end}; {self.cpus} CPUs"

    def warning(self) -> str | None:
        """The warning line when the machine was overloaded, else ``None``."""
        if not self.overloaded:
            return None
        return (
            f"warning: load average {max(self.load)} above 1 per core ({self.cpus} CPUs): "
            "the figures are not evidence"
        )

    def report(self, file: TextIO | None = None, statistic: str = "best") -> None:
        """Print :meth:`caption` and, if any, :meth:`warning` (to stdout by default)."""
        out = file if file is not None else sys.stdout
        print(self.caption(statistic), file=out)
        warning = self.warning()
        if warning is not None:
            print(warning, file=out)
