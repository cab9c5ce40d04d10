"""Faults during an IPC refit: each gives a typed error in time, keeps the version, and heals.

Rogue peers speak the wire protocol from this process with raw ZMQ sockets, so
the side under test (a real engine worker, or the real trainer) meets exactly
the bad input the case describes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import anyio
import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.errors import RefitMismatchError, SyncError, SyncTimeoutError, TransportError
from aiosync.loop import refit_if_stale
from aiosync.transports.ipc import IPCWeightSynchronizer
from aiosync.transports.ipc._sender import _BucketSender
from aiosync.transports.ipc._shm import SharedBuffer
from aiosync.transports.ipc.worker import TRAINER_GONE
from aiosync.transports.packing import BucketPlan, group_by_bucket, pack, plan_buckets
from tests._support.steps import first_sync, sync_catching

pytestmark = pytest.mark.asyncio(loop_scope="session")

BUCKET_BYTES = 16384


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


async def _synced(engine: EmbeddedEngine, h: SimpleNamespace, seed: int) -> IPCWeightSynchronizer:
    """A synchronizer with one successful sync behind it (version 1)."""
    trainer = h.trainer_model(h.DENSE_TIED, seed=seed)
    sync = h.ipc_sync(trainer, engine, bucket_bytes=BUCKET_BYTES, rpc_timeout_s=30)
    sync.trainer = trainer  # type: ignore[attr-defined]
    await first_sync(sync)
    return sync


async def _heals(sync: IPCWeightSynchronizer, engine: EmbeddedEngine, h: SimpleNamespace) -> None:
    """The next sync after a fault succeeds and lands every tensor."""
    assert sync.is_stale
    await sync.sync_weights()
    assert not sync.is_stale
    await h.assert_engine_equals(engine, sync.trainer)  # type: ignore[attr-defined]
    assert all(s["weights_valid"] for s in await engine.status())


class RogueTrainer:
    """A trainer-side ROUTER in this process that drives a real worker's receive loop."""

    def __init__(self, engine: EmbeddedEngine, plan: BucketPlan, timeout_s: float = 5.0) -> None:
        self.engine = engine
        self.plan = plan
        self.timeout_s = timeout_s
        self.dir = tempfile.mkdtemp(prefix="aiosync-rogue-")
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(f"ipc://{self.dir}/s.sock")
        self.count = 0
        self.sync_id = ""
        self.ident = b""

    def start(
        self, digest: str | None = None, devices: list[str] | None = None
    ) -> asyncio.Task[list[Any]]:
        """Start the worker's receive loop for a new session of this rogue trainer
        (as a sharded trainer whose ranks sit on ``devices``, when given)."""
        self.count += 1
        self.sync_id = f"rogue-{self.count}"
        self.ident = f"{self.sync_id}/0".encode()
        session = {
            "endpoint": f"ipc://{self.dir}/s.sock",
            "sync_id": self.sync_id,
            "digest": digest or self.plan.digest,
            "timeout_s": self.timeout_s,
        }
        if devices is not None:
            session["endpoints"] = {d: f"ipc://{self.dir}/s.sock" for d in devices}
        return asyncio.create_task(
            self.engine.collective_rpc("aiosync_ipc_receive", (session,), timeout_s=30)
        )

    async def recv(self) -> dict[str, Any]:
        _, payload = await asyncio.wait_for(self.sock.recv_multipart(), 30)
        return msgpack.unpackb(payload)  # type: ignore[no-any-return]

    async def send(self, payload: bytes | dict[str, Any]) -> None:
        raw = payload if isinstance(payload, bytes) else _pack({"sync_id": self.sync_id, **payload})
        await self.sock.send_multipart([self.ident, raw])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)  # the socket file is left by zmq


@pytest.fixture
async def rogue_trainer(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> AsyncIterator[tuple[RogueTrainer, IPCWeightSynchronizer]]:
    sync = await _planned(dense_engine, h, seed=21)
    rogue = RogueTrainer(dense_engine, sync.plan)
    yield rogue, sync
    rogue.close()
    await sync.shutdown()


async def test_receiver_rejects_unknown_digest_before_any_data(
    rogue_trainer: tuple[RogueTrainer, IPCWeightSynchronizer],
    dense_engine: EmbeddedEngine,
    h: SimpleNamespace,
) -> None:
    rogue, sync = rogue_trainer
    task = rogue.start(digest="f" * 64)
    error = await rogue.recv()
    assert (error["t"], error["type"]) == ("error", "RefitMismatchError")
    [reply] = await task
    assert (reply["ok"], reply["type"]) == (False, "RefitMismatchError")
    assert "ffffffffffffffff" in reply["message"]
    # Nothing moved: the engine still serves version 1.
    assert all(s["weights_valid"] for s in await dense_engine.status())
    await h.assert_engine_equals(dense_engine, sync.trainer)  # type: ignore[attr-defined]


async def test_receiver_turns_a_malformed_message_into_transport_error(
    rogue_trainer: tuple[RogueTrainer, IPCWeightSynchronizer], dense_engine: EmbeddedEngine
) -> None:
    rogue, _ = rogue_trainer
    task = rogue.start()
    assert (await rogue.recv())["t"] == "hello"
    await rogue.send(b"\xc1 not msgpack")
    [reply] = await task
    assert (await rogue.recv())["type"] == "TransportError"
    assert (reply["ok"], reply["type"]) == (False, "TransportError")
    assert "undecodable" in reply["message"]
    task = rogue.start()
    assert (await rogue.recv())["t"] == "hello"
    await rogue.send(
        {
            "t": "data",
            "seq": 0,
            "bucket": 0,
            "handle": {"kind": "shm", "name": "/etc/passwd", "nbytes": 8},
        }
    )
    [reply] = await task
    assert (reply["ok"], reply["type"]) == (False, "TransportError")
    assert all(s["weights_valid"] for s in await dense_engine.status())


async def test_a_paired_worker_refuses_a_session_without_its_device_and_foreign_buffers(
    rogue_trainer: tuple[RogueTrainer, IPCWeightSynchronizer],
    dense_engine: EmbeddedEngine,
    h: SimpleNamespace,
) -> None:
    rogue, sync = rogue_trainer
    # No trainer rank on the worker's device ("cpu"): refused before it connects.
    [reply] = await rogue.start(devices=["cpu:0", "cpu:1"])
    assert (reply["ok"], reply["type"]) == (False, "TransportError")
    assert reply["message"] == (
        "engine worker 0 is on device cpu, where no trainer rank runs "
        "(trainer devices: ['cpu:0', 'cpu:1'])"
    )
    # A buffer announced as another device's is refused before it is mapped.
    task = rogue.start(devices=["cpu", "cpu:1"])
    assert (await rogue.recv())["t"] == "hello"
    handle = {"kind": "shm", "name": "/aiosync-none", "nbytes": 8}
    await rogue.send({"t": "data", "seq": 0, "bucket": 0, "handle": handle, "device": "cpu:1"})
    [reply] = await task
    assert (reply["ok"], reply["type"]) == (False, "TransportError")
    assert reply["message"] == (
        "a buffer of device cpu:1 reached a worker on device cpu: "
        "buffers are only mapped on their own device"
    )
    assert all(s["weights_valid"] for s in await dense_engine.status())
    await h.assert_engine_equals(dense_engine, sync.trainer)  # type: ignore[attr-defined]


@pytest.mark.parametrize("fault", ["duplicate", "missing"])
async def test_receiver_rejects_missing_or_duplicate_buckets_and_next_sync_heals(
    rogue_trainer: tuple[RogueTrainer, IPCWeightSynchronizer],
    dense_engine: EmbeddedEngine,
    h: SimpleNamespace,
    fault: str,
) -> None:
    rogue, sync = rogue_trainer
    plan = rogue.plan
    buckets = list(group_by_bucket(sync.policy.iter_weights(), plan))
    everything = list(range(len(buckets)))
    order = [0, *everything] if fault == "duplicate" else [i for i in everything if i != 1]
    task = rogue.start()
    assert (await rogue.recv())["t"] == "hello"
    for seq, index in enumerate(order):
        bucket, group = buckets[index]
        buffer = SharedBuffer.create(bucket.nbytes)
        try:
            pack(bucket, group, out=buffer.tensor)
            await rogue.send({"t": "data", "seq": seq, "bucket": index, "handle": buffer.handle()})
            assert (await rogue.recv()) == {"t": "ack", "sync_id": rogue.sync_id, "seq": seq}
        finally:
            buffer.close()
    await rogue.send({"t": "end", "buckets": len(order)})
    [reply] = await task
    assert (reply["ok"], reply["type"]) == (False, "RefitMismatchError")
    expected = "more than once" if fault == "duplicate" else "never arrived"
    assert expected in reply["message"]
    assert plan.buckets[0 if fault == "duplicate" else 1].slots[0].name in reply["message"]
    assert [s["weights_valid"] for s in await dense_engine.status()] == [False]
    with pytest.raises(Exception, match="not valid"):
        await dense_engine.generate(h.PROMPTS, max_new_tokens=2)
    await sync.mark_stale()
    await _heals(sync, dense_engine, h)


class RogueWorkers:
    """An engine whose only worker is a raw DEALER that says ``hello`` then misbehaves."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.ctx = zmq.asyncio.Context()

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        return None

    async def finish_generation(self) -> None:
        return None

    async def collective_rpc(self, method: str, args: tuple[Any, ...], *_: Any, **__: Any) -> Any:
        if method == "aiosync_ipc_init":
            return [{"ok": True, "rank": 0, "digest": args[0]["digest"]}]
        session = args[0]
        sock = self.ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.IDENTITY, f"{session['sync_id']}/0".encode())
            sock.connect(session["endpoint"])
            digest = "0" * 64 if self.behaviour == "wrong_digest" else session["digest"]
            hello = {"t": "hello", "sync_id": session["sync_id"], "rank": 0, "digest": digest}
            await sock.send(_pack(hello))
            if self.behaviour == "garbage":
                await sock.recv()  # the first data message
                await sock.send(b"\xc1 garbage")
            await asyncio.sleep(3600)  # never answers: the trainer must not wait for this
            return []
        finally:
            sock.close(linger=0)


@pytest.mark.parametrize(
    ("behaviour", "error"),
    [("wrong_digest", RefitMismatchError), ("garbage", TransportError)],
)
async def test_trainer_raises_typed_error_on_bad_worker_message(
    h: SimpleNamespace, behaviour: str, error: type[Exception]
) -> None:
    trainer = h.trainer_model(h.DENSE_TIED, seed=22)
    engine = RogueWorkers(behaviour)
    async with h.ipc_sync(trainer, engine, bucket_bytes=BUCKET_BYTES, rpc_timeout_s=20) as sync:
        await sync.init_communicator()
        await sync.mark_stale()
        with pytest.raises(error) as info:
            await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (0, True)
        if behaviour == "wrong_digest":
            assert "0000000000000000" in str(info.value)
    engine.ctx.term()


async def test_init_names_the_first_differing_parameters(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    # C3/C4: the trainer renamed a parameter; the engine is told before any data moves.
    sync = await _synced(dense_engine, h, seed=23)
    trainer = h.trainer_model(h.DENSE_TIED, seed=24)
    renamed = h.TrainerSource(
        trainer.model, [], rename={"model.norm.weight": "model.final_norm.weight"}
    )
    with pytest.raises(RefitMismatchError) as info:
        async with IPCWeightSynchronizer(renamed, dense_engine, bucket_bytes=BUCKET_BYTES):
            pytest.fail("the renamed manifest was accepted")
    assert "model.final_norm.weight" in str(info.value)
    assert "model.norm.weight" in str(info.value)
    await _holds_then_shuts_down(dense_engine, h, sync)


async def test_engine_that_stops_answering_times_out_and_next_sync_succeeds(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    # C2: the worker freezes mid-refit (SIGSTOP); the per-message timeout fires.
    sync = await _synced(dense_engine, h, seed=25)
    sync.timeouts = dataclasses.replace(sync.timeouts, rpc_s=3.0)
    assert sync.rpc_timeout_s == 3.0
    assert sync._sender is not None
    sync._sender.timeout_s = 3.0
    pid = dense_engine.pids[0]
    stopped = []

    def freeze(i: int) -> None:
        if i == 6 and not stopped:
            stopped.append(pid)
            os.kill(pid, signal.SIGSTOP)

    sync.policy.on_tensor = freeze  # type: ignore[attr-defined]
    await sync.mark_stale()
    try:
        with pytest.raises(SyncTimeoutError, match=r"waited 3\.0 s"):
            await sync.sync_weights()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert stopped == [pid]
    assert (sync.weight_version, sync.is_stale) == (1, True)
    with pytest.raises(Exception, match="not valid"):
        await dense_engine.generate(h.PROMPTS, max_new_tokens=2)
    sync.policy.on_tensor = None  # type: ignore[attr-defined]
    await _heals(sync, dense_engine, h)
    assert sync.weight_version == 2
    await sync.shutdown()


_TRAINER_CHILD = r"""
import asyncio, json, os, signal, sys
from aiosync.refit import DTensorRefitSource
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.transports.ipc._sender import _BucketSender
from aiosync.transports.packing import plan_buckets
config, seed, bucket_bytes, die_at, *how = json.loads(sys.argv[1])
trainer = HFModelRunner.from_config(config, seed=seed)
source = DTensorRefitSource(trainer.model)
plan = plan_buckets(source.prepare_refit_info(), bucket_bytes)
def weights():
    for i, item in enumerate(source.iter_weights()):
        if i == die_at and how == ["sigkill"]:
            os.kill(os.getpid(), signal.SIGKILL)  # killed mid-refit: no handler runs
        if i == die_at:
            os._exit(17)  # the trainer dies mid-refit, without any cleanup
        yield item
async def main():
    sender = await _BucketSender.open(plan, __import__("torch").device("cpu"), 60.0)
    print(json.dumps({"endpoint": sender.endpoint, "digest": plan.digest}), flush=True)
    await sender.send("child-1", [0], weights())
asyncio.run(main())
"""


async def _holds_then_shuts_down(engine: EmbeddedEngine, h: SimpleNamespace, sync: Any) -> None:
    """Every worker holds ``sync``'s trainer's weights; then ``sync`` shuts down."""
    await h.assert_engine_equals(engine, sync.trainer)
    await sync.shutdown()


async def _planned(engine: EmbeddedEngine, h: SimpleNamespace, seed: int) -> Any:
    """:func:`_synced`, its plan made (the digest a receive session names)."""
    sync = await _synced(engine, h, seed=seed)
    assert sync.plan is not None
    return sync


async def _child_trainer(
    h: SimpleNamespace, seed: int, *how: str, timeout_s: float
) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    """:data:`_TRAINER_CHILD` (``seed``; it dies at its 8th tensor, ``how``) started, and
    the receive session a worker is given for it (``timeout_s`` of silence allowed)."""
    arg = json.dumps([h.DENSE_TIED, seed, BUCKET_BYTES, 8, *how])
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _TRAINER_CHILD, arg, stdout=asyncio.subprocess.PIPE
    )
    assert child.stdout is not None
    info = json.loads(await asyncio.wait_for(child.stdout.readline(), 300))
    session = {"endpoint": info["endpoint"], "sync_id": "child-1", "digest": info["digest"]}
    return child, {**session, "timeout_s": timeout_s}


async def _receive_within_30_s(engine: EmbeddedEngine, session: dict[str, Any]) -> Any:
    """The worker's reply to a receive of ``session`` (which allows 120 s of silence),
    bounded by a failure detector: it must end within 30 s."""
    with anyio.fail_after(30):
        [reply] = await engine.collective_rpc("aiosync_ipc_receive", (session,), timeout_s=150)
    return reply


async def _heals_what_another_wrote(sync: Any, engine: EmbeddedEngine, h: SimpleNamespace) -> None:
    """The engine was written to by someone else: ``sync`` told so, its next sync heals
    every worker; then it shuts down."""
    sync._invalidate_engine_weights()
    await _heals(sync, engine, h)
    await sync.shutdown()


async def _refused_after_the_trainer_went(
    engine: EmbeddedEngine, h: SimpleNamespace, reply: Any
) -> None:
    """The worker's receive ended naming the gone trainer; its weights are invalid and
    the engine refuses to generate."""
    assert reply == {"ok": False, "type": "TransportError", "message": TRAINER_GONE}
    assert [s["weights_valid"] for s in await engine.status()] == [False]
    with pytest.raises(Exception, match="not valid"):
        await engine.generate(h.PROMPTS, max_new_tokens=2)


async def test_trainer_killed_mid_sync_fails_the_engine_receive_and_next_sync_succeeds(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    sync = await _planned(dense_engine, h, seed=26)
    child, session = await _child_trainer(h, 27, timeout_s=3.0)
    assert session["digest"] == sync.plan.digest
    [reply] = await dense_engine.collective_rpc("aiosync_ipc_receive", (session,), timeout_s=60)
    assert await child.wait() == 17
    # The exit closed the trainer's connection: the worker noticed it at once.
    await _refused_after_the_trainer_went(dense_engine, h, reply)
    # This process's synchronizer is unaffected: still version 1; it heals the engine.
    assert sync.weight_version == 1
    await _heals_what_another_wrote(sync, dense_engine, h)


async def test_trainer_sigkilled_mid_sync_ends_the_engine_receive_long_before_its_timeout(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    # The session allows 120 s of silence; the worker must notice the dead trainer
    # from its socket's monitor (the kernel closes the connection), not the timeout.
    sync = await _planned(dense_engine, h, seed=30)
    child, session = await _child_trainer(h, 31, "sigkill", timeout_s=120.0)
    started = time.monotonic()
    reply = await _receive_within_30_s(dense_engine, session)
    print(f"the worker noticed the dead trainer after {time.monotonic() - started:.2f} s")
    assert await child.wait() == -signal.SIGKILL
    await _refused_after_the_trainer_went(dense_engine, h, reply)
    # The worker stays usable: the next sync heals it.
    await _heals_what_another_wrote(sync, dense_engine, h)


async def test_a_session_whose_trainer_socket_is_gone_fails_at_once(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    sync = await _planned(dense_engine, h, seed=32)
    with tempfile.TemporaryDirectory(prefix="aiosync-test-") as gone:
        session = {
            "endpoint": f"ipc://{gone}/refit.sock",  # nothing was ever bound here
            "sync_id": "gone-1",
            "digest": sync.plan.digest,
            "timeout_s": 120.0,
        }
        reply = await _receive_within_30_s(dense_engine, session)
    assert reply == {"ok": False, "type": "TransportError", "message": TRAINER_GONE}
    # Nothing was written: the engine still serves version 1.
    assert [s["weights_valid"] for s in await dense_engine.status()] == [True]
    await sync.shutdown()


async def test_engine_killed_mid_sync_raises_transport_error_and_respawned_engine_syncs(
    dense_engine: EmbeddedEngine, h: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    sync = await _synced(dense_engine, h, seed=28)
    pid = dense_engine.pids[0]

    def kill(i: int) -> None:
        if i == 6:
            os.kill(pid, signal.SIGKILL)

    sync.policy.on_tensor = kill  # type: ignore[attr-defined]
    await sync.mark_stale()
    with pytest.raises(TransportError, match="died"):
        await sync.sync_weights()
    assert (sync.weight_version, sync.is_stale) == (1, True)
    # Invalidating the dead worker fails too: a secondary failure, one line, no traceback.
    [record] = [r for r in caplog.records if "invalidating the workers" in r.getMessage()]
    assert record.getMessage().startswith(
        "IPC: invalidating the workers after a failed sync failed: TransportError: "
    ), record.getMessage()
    assert "\n" not in record.getMessage() and record.exc_info is None
    with pytest.raises(TransportError, match="dead"):
        await dense_engine.generate(h.PROMPTS, max_new_tokens=2)
    assert await dense_engine.respawn_dead_workers() == [0]
    assert dense_engine.pids[0] != pid
    sync.policy.on_tensor = None  # type: ignore[attr-defined]
    await sync.init_communicator()  # the new worker learns the plan
    await _heals(sync, dense_engine, h)
    assert sync.weight_version == 2
    await sync.shutdown()


async def test_worker_respawned_while_idle_makes_sync_stale_and_engine_refuse_until_refit(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    # The dead worker's replacement holds the engine's seed weights, not version 1.
    sync = await _synced(dense_engine, h, seed=29)
    assert (sync.weight_version, sync.is_stale) == (1, False)
    pid = dense_engine.pids[0]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(TransportError, match="worker 0"):
        await dense_engine.collective_rpc("embedded_status", timeout_s=60)
    assert await dense_engine.respawn_dead_workers() == [0]
    assert dense_engine.pids[0] != pid
    assert (sync.weight_version, sync.is_stale) == (1, True)
    assert [s["weights_valid"] for s in await dense_engine.status()] == [False]
    with pytest.raises(SyncError, match="worker 0: weights are not valid"):
        await dense_engine.generate(h.PROMPTS, max_new_tokens=2)
    await sync.init_communicator()  # the new worker learns the plan
    assert await refit_if_stale(sync, dense_engine) is True
    assert (sync.weight_version, sync.is_stale) == (1, False)
    await h.assert_engine_equals(dense_engine, sync.trainer)  # type: ignore[attr-defined]
    expected = sync.trainer.generate(h.PROMPTS, max_new_tokens=3)  # type: ignore[attr-defined]
    assert await dense_engine.generate(h.PROMPTS, max_new_tokens=3) == expected
    await sync.shutdown()


async def test_abort_to_unreachable_workers_leaves_no_unretrieved_error() -> None:
    # ROUTER_MANDATORY makes a send to an unknown peer fail (Host unreachable);
    # that error must be consumed, not left in a future nobody awaits.
    plan = plan_buckets({"w": ((4,), torch.float32)}, BUCKET_BYTES)
    sender = await _BucketSender.open(plan, torch.device("cpu"), 5.0)
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    try:
        sender.abort("nobody-1", [0, 1], "test")
        await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
        sender.close()
    assert unhandled == []


async def test_shutdown_during_a_sync_fails_it_naming_the_shutdown(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    sync = await _synced(dense_engine, h, seed=30)
    midway = threading.Event()

    def slow(i: int) -> None:
        if i >= 6:
            midway.set()
            time.sleep(0.05)

    sync.policy.on_tensor = slow  # type: ignore[attr-defined]
    await sync.mark_stale()
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(sync_catching, sync, errors)
        await anyio.to_thread.run_sync(midway.wait)
        await sync.shutdown()
    [error] = errors
    assert isinstance(error, TransportError)
    assert str(error) == "the IPC synchronizer was shut down during the sync"
    assert sync.weight_version == 1
    assert sync.socket_dir is None
    # The engine's receive was aborted; a new synchronizer heals it.
    healed = await _synced(dense_engine, h, seed=31)
    await _holds_then_shuts_down(dense_engine, h, healed)


async def test_weights_discarded_mid_sync_fail_it_and_the_engine_refuses_until_a_sync_lands(
    dense_engine: EmbeddedEngine, h: SimpleNamespace
) -> None:
    # Case C14: a level-2 sleep 0.1 s into the sync zeroes the weights under it.
    sync = await _synced(dense_engine, h, seed=31)
    with torch.no_grad():
        for p in sync.trainer.model.parameters():  # type: ignore[attr-defined]
            p.mul_(1.5)

    def discard(i: int) -> None:
        if i == 6:
            time.sleep(0.1)
            anyio.from_thread.run(dense_engine.finish_generation)

    sync.policy.on_tensor = discard  # type: ignore[attr-defined]
    dense_engine.sleep_level = 2
    try:
        await sync.mark_stale()
        # Whichever side sees it first: the worker (its discard epoch moved) or the
        # synchronizer (the engine's discard listener fired during the sync).
        with pytest.raises(SyncError, match=r"discarded (this worker's|its) weights"):
            await sync.sync_weights()
    finally:
        dense_engine.sleep_level = 1
        sync.policy.on_tensor = None  # type: ignore[attr-defined]
    assert (sync.weight_version, sync.is_stale) == (1, True)
    await dense_engine.prepare_for_generation()
    assert [s["weights_valid"] for s in await dense_engine.status()] == [False]
    with pytest.raises(SyncError, match="not valid"):
        await dense_engine.generate(h.PROMPTS, max_new_tokens=2)
    assert await refit_if_stale(sync, dense_engine) is True
    assert (sync.weight_version, sync.is_stale) == (2, False)
    await _holds_then_shuts_down(dense_engine, h, sync)
