"""What every benchmark's ``--quick --json`` run must print (``tests/benchmarks``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_quick(
    script: Path, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python script --quick --json`` from ``cwd`` (as users run it, from outside the
    repository), its output captured as text, at most 600 s."""
    return subprocess.run(
        [sys.executable, str(script), "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=env,
    )


def assert_table_then_json(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The run exited 0 and printed a table, then one JSON object last; returns it."""
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert isinstance(figures, dict) and figures
    table = (out.stdout + out.stderr).strip().splitlines()[:-1]
    assert len(table) >= 3, "no table printed before the JSON line"
    return figures
