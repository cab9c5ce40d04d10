"""Where the suite's time goes: the slowest tests and the time per folder.

Reads the JUnit XML that ``pytest --junitxml=FILE`` writes (with or without
xdist) and prints two tables: the ``--top`` slowest tests (set-up, call and
tear-down together, as pytest's ``--durations`` counts them) and the summed
test time per folder of ``tests/``. Under ``-n N`` the folders' sum exceeds the
wall time: N tests run at once.

Usage::

    make test-profile                       # runs the suite, then prints both tables
    python -m tests._support.timing report.xml [--top 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class TestTime:
    """One test case of the report: its pytest id and seconds."""

    nodeid: str
    seconds: float

    @property
    def folder(self) -> str:
        """``tests/<folder>`` (``tests`` for a module at the top)."""
        parts = self.nodeid.split("::", 1)[0].split("/")
        return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def read_report(path: str) -> list[TestTime]:
    """Every ``<testcase>`` of a JUnit XML report, as pytest ids.

    pytest writes ``classname="tests.ipc.test_x"`` (plus ``.Class``) and
    ``name="test_y[param]"``; the module part becomes a path again. A module
    skipped whole counts as one entry named by its path.
    """
    times = []
    for case in ET.parse(path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        name = case.get("name", "")
        if not classname:
            # A module skipped whole (a missing optional dependency): its dotted name.
            classname, name = name, ""
        parts = classname.split(".")
        # The module is the last part that names a file (``test_*`` or a ``_helper``);
        # a class may follow it.
        cut = max(
            (i for i, p in enumerate(parts) if p.startswith(("test_", "_"))),
            default=len(parts) - 1,
        )
        module = "/".join(parts[: cut + 1]) + ".py"
        nodeid = "::".join(p for p in (module, *parts[cut + 1 :], name) if p)
        times.append(TestTime(nodeid, float(case.get("time", 0.0))))
    return times


def by_folder(times: list[TestTime]) -> dict[str, tuple[int, float]]:
    """``folder -> (tests, seconds)``, slowest first."""
    folders: dict[str, list[float]] = defaultdict(list)
    for t in times:
        folders[t.folder].append(t.seconds)
    rows = {f: (len(s), sum(s)) for f, s in folders.items()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", help="pytest --junitxml output")
    parser.add_argument("--top", type=int, default=30, help="slowest tests to list (30)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    times = read_report(args.report)
    slowest = sorted(times, key=lambda t: -t.seconds)[: args.top]
    folders = by_folder(times)
    total = sum(t.seconds for t in times)
    if args.json:
        print(
            json.dumps(
                {
                    "tests": len(times),
                    "seconds": round(total, 2),
                    "slowest": [[t.nodeid, round(t.seconds, 2)] for t in slowest],
                    "folders": {f: [n, round(s, 2)] for f, (n, s) in folders.items()},
                }
            )
        )
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # Wide enough for whole test ids: the table is read in logs and notes.
    console = Console(width=max(200, Console().width))
    top = Table(title=f"{len(slowest)} slowest of {len(times)} tests ({total:.0f} s in all)")
    top.add_column("s", justify="right")
    top.add_column("test", overflow="fold")
    for t in slowest:
        top.add_row(f"{t.seconds:.1f}", escape(t.nodeid))  # "[param]" is not markup
    console.print(top)
    per = Table(title="time per folder (summed over its tests)")
    for column in ("folder", "tests", "s", "share"):
        per.add_column(column, justify="right" if column != "folder" else "left")
    for folder, (n, seconds) in folders.items():
        per.add_row(folder, str(n), f"{seconds:.0f}", f"{100 * seconds / max(total, 1e-9):.0f} %")
    console.print(per)


if __name__ == "__main__":
    sys.exit(main())
