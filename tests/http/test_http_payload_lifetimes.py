"""What an HTTP refit leaves behind: nothing.

C15: hundreds of syncs fail (the server answers 500 before decoding) or are
cancelled after their payload was serialized (before the request left, or while
the server holds it undecoded); afterwards this process has the same shared-
memory segments and file descriptors as before, the server the same
descriptors, and RSS stayed within a memory bound.

A process that used the transport starts no helper process (torch's
``torch_shm_manager`` daemon used to outlive it holding its stdout/stderr, so
``python script.py | tail`` hung) and keeps torch's sharing strategy.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from aiosync import SGLangHTTPBackend, TransportError
from aiosync.transports.http import HTTPWeightSynchronizer

pytestmark = pytest.mark.slow

FAILURES = 200
CANCELLATIONS = 200
#: RSS growth allowed over all failures, bytes: a memory bound, not a timing one.
RSS_BOUND = 50 * 1024 * 1024
# Two buckets per sync, so a failure also leaves one packed but never posted.
BUCKET_BYTES = 128 * 1024


def _segments(pid: int) -> list[str]:
    # Ours (aiosync-http-<pid>-...) and torch's file_system ones (torch_<pid>_...).
    return sorted(
        f for f in os.listdir("/dev/shm") if f.startswith((f"aiosync-http-{pid}-", f"torch_{pid}_"))
    )


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class _CancelOnUpdate(httpx.AsyncHTTPTransport):
    """A real transport that cancels ``scope`` when a serialized bucket is about to leave."""

    def __init__(self) -> None:
        super().__init__()
        self.scope: anyio.CancelScope | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.scope is not None and request.url.path == "/update_weights_from_tensor":
            self.scope.cancel()
        return await super().handle_async_request(request)


@pytest.fixture
def server(tp2_server: Any) -> Any:
    tp2_server.reset()
    yield tp2_server
    tp2_server.reset()


async def test_hundreds_of_failed_and_cancelled_syncs_leave_no_segment_fd_or_memory(
    server: Any, make_trainer: Any, state_equal: Any
) -> None:
    trainer = make_trainer(seed=60)
    server_pid = server.proc.pid
    tap = _CancelOnUpdate()
    async with SGLangHTTPBackend(server.url, transport=tap) as backend:
        sync = HTTPWeightSynchronizer(trainer, backend, bucket_bytes=BUCKET_BYTES)
        await sync.init_communicator()
        assert len(sync.plan) >= 2
        # A first sync (and failure) sets up what lives for good: connections,
        # worker threads, allocator arenas.
        await sync.mark_stale()
        await sync.sync_weights()
        server.fault("/update_weights_from_tensor", "error", count=1)
        await sync.mark_stale()
        with pytest.raises(TransportError, match="HTTP 500"):
            await sync.sync_weights()
        gc.collect()
        segments, fds, server_fds = _segments(os.getpid()), _fds(os.getpid()), _fds(server_pid)
        rss = _rss_bytes()
        assert segments == []

        server.fault("/update_weights_from_tensor", "error", count=None)
        for _ in range(FAILURES):
            with pytest.raises(TransportError, match="HTTP 500: injected fault"):
                await sync.sync_weights()
        server.reset()

        async def cancel_once_the_server_holds_it(scope: anyio.CancelScope) -> None:
            while not any(e.get("status") == "hung" for e in server.log()):
                await anyio.sleep(0.005)
            scope.cancel()

        for i in range(CANCELLATIONS):
            scope = anyio.CancelScope()
            if i % 2 == 0:
                # Serialized, then cancelled before the request left this process.
                tap.scope = scope
                with scope:
                    await sync.sync_weights()
                tap.scope = None
            else:
                # Received by the server, which holds it and never decodes it.
                server.fault("/update_weights_from_tensor", "hang", count=1)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_once_the_server_holds_it, scope)
                    with scope:
                        await sync.sync_weights()
                server.reset()  # the hung handler gives up without decoding
            assert scope.cancelled_caught
            assert sync.is_stale and sync.weight_version == 1

        gc.collect()
        assert _segments(os.getpid()) == segments
        assert _segments(server_pid) == []
        assert _fds(os.getpid()) <= fds + 1  # at most a fresh keep-alive connection
        assert _rss_bytes() - rss < RSS_BOUND
        assert _fds(server_pid) <= server_fds + 1

        # And the transport still works.
        await sync.sync_weights()
        assert sync.weight_version == sync.policy_version and not sync.is_stale
        state_equal(server.state_dict(), trainer.expected())


_ONE_SYNC = textwrap.dedent(
    """
    import os, sys
    import anyio, torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from aiosync import SGLangHTTPBackend
    from aiosync.engines.embedded.configs import TINY_QWEN3
    from aiosync.refit import DTensorRefitSource
    from aiosync.transports.http import HTTPWeightSynchronizer

    def children():
        out = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = open(f"/proc/{pid}/stat").read()
            except OSError:
                continue
            comm, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
            if int(rest.split()[1]) == os.getpid():
                out.append(comm)
        return sorted(out)

    def segments():
        return sorted(f for f in os.listdir("/dev/shm") if f"-{os.getpid()}-" in f)

    async def main(url, ending):
        items = dict(TINY_QWEN3)
        config = AutoConfig.for_model(items.pop("model_type"), **items)
        source = DTensorRefitSource(AutoModelForCausalLM.from_config(config), dtype=torch.bfloat16)
        async with SGLangHTTPBackend(url) as backend:
            sync = HTTPWeightSynchronizer(source, backend, bucket_bytes=64 * 1024)
            await sync.init_communicator()
            await sync.mark_stale()
            await sync.sync_weights()
        print("pid", os.getpid())
        print("weight_version", sync.weight_version)
        print("sharing_strategy", torch.multiprocessing.get_sharing_strategy())
        print("children", children())
        print("kept", "1 or 2" if len(segments()) in (1, 2) else len(segments()))
        if ending == "shutdown":
            await sync.shutdown()
            print("segments", segments())
        print("done", file=sys.stderr)

    anyio.run(main, *sys.argv[1:])
    """
)


@pytest.mark.parametrize("ending", ["shutdown", "exit"])
def test_a_script_that_synced_exits_with_its_pipes_closed_no_helper_and_no_segment(
    server: Any, ending: str
) -> None:
    repo = Path(__file__).resolve().parents[2]
    # Both pipes are read to EOF: a helper process still holding either one would
    # keep communicate() waiting (the timeout is a failure detector only).
    proc = subprocess.run(
        [sys.executable, "-c", _ONE_SYNC, server.url, ending],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    pid = int(lines.pop(0).removeprefix("pid "))
    # The synchronizer keeps its bucket segments between syncs (two when a bucket
    # was packed while another was in flight); shutdown() unlinks them, and so
    # does the interpreter's exit when nobody called it.
    assert lines == [
        "weight_version 1",
        "sharing_strategy file_descriptor",
        "children []",
        "kept 1 or 2",
        *(["segments []"] if ending == "shutdown" else []),
    ]
    assert _segments(pid) == []
    assert proc.stderr.splitlines()[-1] == "done"
