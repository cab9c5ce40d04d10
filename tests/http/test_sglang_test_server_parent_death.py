"""The SGLang test server started by ``serve_in_subprocess`` exits with its parent,
even one killed by SIGKILL (issue 15, C16); the parent's leftover folder is swept
by the next start."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import anyio
import pytest

from aiosync.transports._leftovers import sweep_leftovers

_PARENT = r"""
import json, os
import anyio
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.testing.sglang_server import serve_in_subprocess

async def main():
    async with serve_in_subprocess(TINY_QWEN3) as url:
        me = os.getpid()
        with open(f"/proc/{me}/task/{me}/children") as f:
            children = [int(pid) for pid in f.read().split()]
        print(json.dumps({"url": url, "children": children}), flush=True)
        await anyio.sleep_forever()

anyio.run(main)
"""


@pytest.mark.slow
async def test_server_exits_when_its_parent_is_sigkilled() -> None:
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _PARENT, stdout=asyncio.subprocess.PIPE
    )
    assert parent.stdout is not None
    info = json.loads(await asyncio.wait_for(parent.stdout.readline(), 300))
    [server] = info["children"]
    cmdline = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
    assert b"aiosync.testing.sglang_server" in cmdline
    # A pidfd turns readable when the process exits, even one that is not our child.
    pidfd = os.pidfd_open(server)
    try:
        folder = Path(tempfile.gettempdir()) / next(
            name
            for name in os.listdir(tempfile.gettempdir())
            if name.startswith(f"aiosync-sglang-{parent.pid}-")
        )
        assert (folder / "config.json").exists()
        os.kill(parent.pid, signal.SIGKILL)
        assert await parent.wait() == -signal.SIGKILL
        started = time.monotonic()
        with anyio.fail_after(30):  # a failure detector: the server would serve forever
            await anyio.wait_readable(pidfd)
        print(f"the server exited {time.monotonic() - started:.2f} s after its parent died")
    finally:
        os.close(pidfd)
    # The killed parent could not remove its folder; the next start's sweep does.
    assert folder.exists()
    assert str(folder) in sweep_leftovers()
    assert not folder.exists()
