"""``import aiosync`` loads none of the heavy stacks: transports and engines load torch,
zmq and httpx on first use, ``aiosync.ray`` loads Ray (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "zmq", "httpx", "ray", "vllm", "jax")


def test_import_aiosync_loads_no_heavy_dependency() -> None:
    code = f"import sys, aiosync; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"
