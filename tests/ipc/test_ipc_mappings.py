"""The worker keeps its buffer mappings and its connection between syncs, and drops them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch

from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.transports.ipc.worker import TRAINER_GONE
from tests._support.proxy import EngineProxy
from tests._support.steps import first_sync

pytestmark = pytest.mark.asyncio(loop_scope="session")


class RpcLog(EngineProxy):
    """Forwards to an :class:`EmbeddedEngine`, recording each ``collective_rpc``'s replies."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        super().__init__(engine)
        self.replies: list[tuple[str, list[Any]]] = []

    async def replied(self, method: str, replies: list[Any]) -> list[Any]:
        self.replies.append((method, replies))
        return replies


@contextlib.asynccontextmanager
async def _logged(
    h: SimpleNamespace, dense_engine: EmbeddedEngine, seed: int
) -> AsyncIterator[tuple[Any, RpcLog, Any]]:
    """A trainer (``seed``) and its IPC synchronizer (12 KiB buckets) into
    ``dense_engine`` behind an :class:`RpcLog`."""
    trainer = h.trainer_model(h.DENSE_TIED, seed=seed)
    engine = RpcLog(dense_engine)
    async with h.ipc_sync(trainer, engine, bucket_bytes=12288) as sync:
        yield trainer, engine, sync


async def test_kept_mappings_carry_each_new_version_and_are_released_at_shutdown(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    # 12 KiB buckets: many buckets through the two ping-pong buffers.
    async with _logged(h, dense_engine, seed=60) as (trainer, engine, sync):
        await sync.init_communicator()
        for step in range(3):
            await sync.mark_stale()
            await sync.sync_weights()
            # Every sync lands bit-exact through the mappings the worker kept.
            await h.assert_engine_equals(dense_engine, trainer)
            with torch.no_grad():
                for parameter in trainer.model.parameters():
                    parameter.add_(step + 1.0)
        assert sync.weight_version == 3
    released = [replies for method, replies in engine.replies if method == "aiosync_ipc_release"]
    assert released == [[{"ok": True, "rank": 0, "released": 2}]]


async def test_a_release_of_another_owner_drops_nothing(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    async with _logged(h, dense_engine, seed=61) as (trainer, engine, sync):
        await first_sync(sync)
        assert await dense_engine.collective_rpc("aiosync_ipc_release", ("not-the-owner",)) == [
            {"ok": True, "rank": 0, "released": 0}
        ]
        await sync.mark_stale()
        await sync.sync_weights()
        await h.assert_engine_equals(dense_engine, trainer)
    released = [replies for method, replies in engine.replies if method == "aiosync_ipc_release"]
    assert released == [[{"ok": True, "rank": 0, "released": 2}]]


# A trainer in a child process: one whole sync ("child-1"), then it is SIGKILLed
# in the middle of the next ("child-2"), after printing the socket identities the
# worker said hello from in both.
_TWO_SYNC_CHILD = r"""
import asyncio, json, os, signal, sys
from aiosync.refit import DTensorRefitSource
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.transports.ipc._sender import _BucketSender
from aiosync.transports.packing import plan_buckets
config, seed, bucket_bytes, die_at = json.loads(sys.argv[1])
trainer = HFModelRunner.from_config(config, seed=seed)
source = DTensorRefitSource(trainer.model)
plan = plan_buckets(source.prepare_refit_info(), bucket_bytes)
sender = None
idents = []
def dying():
    for i, item in enumerate(source.iter_weights()):
        if i == die_at:
            idents.append(sender._idents[1][0].decode())
            print(json.dumps({"idents": idents}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        yield item
async def main():
    global sender
    sender = await _BucketSender.open(plan, __import__("torch").device("cpu"), 60.0)
    print(json.dumps({"endpoint": sender.endpoint, "digest": plan.digest}), flush=True)
    await sender.send("child-1", [0], source.iter_weights())
    idents.append(sender._idents[1][0].decode())
    await sender.send("child-2", [0], dying())
asyncio.run(main())
"""


async def test_a_kept_connection_still_notices_a_trainer_killed_in_a_later_sync(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    bucket_bytes = 16384
    trainer = h.trainer_model(h.DENSE_TIED, seed=62)
    # Registers the plan of this bucket size on the worker (the child's has the same digest).
    sync = h.ipc_sync(trainer, dense_engine, bucket_bytes=bucket_bytes)
    await sync.init_communicator()
    arg = json.dumps([h.DENSE_TIED, 63, bucket_bytes, 8])
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _TWO_SYNC_CHILD, arg, stdout=asyncio.subprocess.PIPE
    )
    assert child.stdout is not None
    info = json.loads(await asyncio.wait_for(child.stdout.readline(), 300))
    session = {"endpoint": info["endpoint"], "digest": info["digest"], "owner": "child"}
    [first] = await dense_engine.collective_rpc(
        "aiosync_ipc_receive", ({**session, "sync_id": "child-1", "timeout_s": 60.0},)
    )
    assert first["ok"] is True
    started = time.monotonic()
    with anyio.fail_after(30):  # a failure detector: the worker would wait 120 s
        [reply] = await dense_engine.collective_rpc(
            "aiosync_ipc_receive",
            ({**session, "sync_id": "child-2", "timeout_s": 120.0},),
            timeout_s=150,
        )
    print(f"the worker noticed the dead trainer after {time.monotonic() - started:.2f} s")
    # The second sync came over the connection the first one opened.
    assert json.loads(await child.stdout.readline()) == {"idents": ["child-1/0", "child-1/0"]}
    assert await child.wait() == -signal.SIGKILL
    assert reply == {"ok": False, "type": "TransportError", "message": TRAINER_GONE}
    # The worker stays usable: this process's synchronizer heals it.
    await sync.mark_stale()
    await sync.sync_weights()
    await h.assert_engine_equals(dense_engine, trainer)
    await sync.shutdown()
