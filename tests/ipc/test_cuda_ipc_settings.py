"""C20: with ``expandable_segments:True`` the staging buffers are allocated with it off.

The allocator-settings switch is torch's own (``_accelerator_{get,set}AllocatorSettings``)
and works on the CPU build too, so the switching is checked here, in a process
started with the setting as a user would start it; the CUDA-IPC refit under the
setting is in ``tests/gpu/`` (``test_shared_buffers_are_ipc_shareable_with_expandable_segments``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_PROBE = """
import torch
from aiosync._cuda_ipc import ipc_shareable_allocations
get = torch._C._accelerator_getAllocatorSettings
seen = [get()]
with ipc_shareable_allocations():
    seen.append(get())
try:
    with ipc_shareable_allocations():
        seen.append(get())
        raise KeyError("inside")
except KeyError:
    pass
seen.append(get())
print("|".join(seen))
"""


@pytest.mark.parametrize("variable", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_expandable_segments_are_off_inside_the_block_and_restored_after(variable: str) -> None:
    env = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    env[variable] = "expandable_segments:True"
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().split("|") == [
        "expandable_segments:True",
        "expandable_segments:False",
        "expandable_segments:False",
        "expandable_segments:True",
    ]


def test_without_expandable_segments_nothing_is_switched() -> None:
    env = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().split("|") == ["", "", "", ""]
