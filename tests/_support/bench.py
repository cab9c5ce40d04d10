"""What every benchmark's ``--quick --json`` run must print (``tests/benchmarks``)."""

from __future__ import annotations

import json
import subprocess
from typing import Any


def assert_table_then_json(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The run exited 0 and printed a table, then one JSON object last; returns it."""
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert isinstance(figures, dict) and figures
    table = (out.stdout + out.stderr).strip().splitlines()[:-1]
    assert len(table) >= 3, "no table printed before the JSON line"
    return figures
