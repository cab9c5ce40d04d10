"""The fault matrix: every fault on every transport, run for real; what the loop sees, what is left.

Each cell runs one fault against real processes — an ``EmbeddedEngine``
worker process for IPC and the collective (gloo), the SGLang-contract test server
(``python -m aiosync.testing.sglang_server``) for HTTP — on a tiny Qwen3,
after one healthy sync (version 1), during the sync of version 2:

* ``mismatch``: the trainer's manifest renames one tensor (at ``init_communicator``);
* ``engine killed``: SIGKILL of the engine worker (the HTTP server) mid-sync;
* ``engine hangs``: SIGSTOP of it mid-sync (``sync_timeout_s`` = 5 s), SIGCONT after;
* ``engine error``: HTTP only: the server answers 500 to ``/update_weights_from_tensor``;
* ``cancelled``: the loop cancels ``sync_weights`` mid-sync;
* ``weights discarded``: the engine discards its weights mid-sync (a level-2 sleep; SGLang:
  ``/release_memory_occupation``, the server started with ``--enable-memory-saver``);
* ``second synchronizer``: another synchronizer tries the same engine (IPC: during a refit,
  collective: while the first owns the sync group).

Columns: the exception the training loop gets (``Cancelled``: the cancellation
itself), seconds from the fault to it, whether ``weight_version`` stayed 1 with
``is_stale`` true (or, for a second synchronizer, the first one's sync landed
untouched), what ``generate`` does next (the error it raises: it must not
generate), whether the same synchronizer's next sync lands every tensor
bit-exact, and the aiosync entries (``/dev/shm`` segments, temp-dir folders)
created since the cell began that remain after its synchronizers shut down.

Usage::

    python benchmarks/faults.py                 # every cell (a few minutes)
    python benchmarks/faults.py --quick         # the IPC column only (< 1 minute)
    python benchmarks/faults.py --json          # last stdout line: one JSON object
    python benchmarks/faults.py --write docs/reliability.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import httpx
import torch
from _machine import Machine
from safetensors.torch import load as safetensors_load

from aiosync import (
    EmbeddedEngine,
    HTTPWeightSynchronizer,
    IPCWeightSynchronizer,
    SGLangHTTPBackend,
    TrainCluster,
    WeightSynchronizer,
    create_weight_synchronizer,
)
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.interfaces import RefitManifest, RefitSource
from aiosync.refit import DTensorRefitSource
from aiosync.transports._leftovers import SHM_DIR

# The table reports each failure; the transports' own logging of it is noise here.
logging.getLogger("aiosync").setLevel(logging.CRITICAL)

#: The fault strikes before this tensor of version 2 is read (of 24).
FAULT_AT = 6
#: ``sync_timeout_s`` of the "engine hangs" cells, seconds.
HANG_TIMEOUT_S = 5.0
BUCKET_BYTES = 16384
PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]
TRANSPORTS = ("ipc", "collective", "http")
FAULTS = (
    "mismatch",
    "engine killed",
    "engine hangs",
    "engine error",
    "cancelled",
    "weights discarded",
    "second synchronizer",
)
#: Cells that do not apply (no such fault on that transport), with the reason.
NOT_APPLICABLE = {
    ("ipc", "engine error"): "workers answer typed errors, covered by the others",
    ("collective", "engine error"): "workers answer typed errors, covered by the others",
}
#: What a cell's outcome means, where the table alone would not say.
EXPLAINED = {
    ("http", "second synchronizer"): (
        "SGLang keeps no session: two trainers posting to one server interleave their buckets "
        "and both report success; give each server exactly one trainer"
    ),
}


@dataclass
class Cell:
    """One fault on one transport, as observed."""

    transport: str
    fault: str
    error: str = "—"
    seconds: float | None = None
    version_kept: bool | None = None
    generate: str = "—"
    heals: bool | None = None
    left_behind: int | None = None
    note: str = ""


class FaultySource(RefitSource):
    """A trainer's real source; ``hook()`` runs (in the transport's thread) before
    tensor :data:`FAULT_AT` while ``armed``; ``rename`` renames one manifest entry."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner = DTensorRefitSource(model)
        self.hook: Callable[[], None] | None = None
        self.rename: tuple[str, str] | None = None

    def prepare_refit_info(self) -> RefitManifest:
        manifest = self.inner.prepare_refit_info()
        if self.rename is None:
            return manifest
        old, new = self.rename
        return {new if n == old else n: spec for n, spec in manifest.items()}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner.iter_weights()):
            if i == FAULT_AT and self.hook is not None:
                hook, self.hook = self.hook, None
                hook()
            yield item


def _aiosync_entries() -> set[str]:
    """aiosync's names in /dev/shm and the temp dir (what a crash could leave)."""
    names = {f"shm:{n}" for n in os.listdir(SHM_DIR) if n.startswith("aiosync")}
    tmp = tempfile.gettempdir()
    return names | {f"tmp:{n}" for n in os.listdir(tmp) if n.startswith("aiosync-")}


def _trainer(seed: int) -> HFModelRunner:
    return HFModelRunner.from_config(dict(TINY_QWEN3), seed=seed)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the engines ---------------------------------------------------------------


class EngineUnderTest:
    """What a cell needs of an engine: build synchronizers, kill/stop it, read its weights."""

    transport: str
    engine: Any

    def synchronizer(self, source: RefitSource) -> WeightSynchronizer:
        raise NotImplementedError

    def pid(self) -> int:
        raise NotImplementedError

    async def weights(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    async def generate(self) -> str:
        """What ``generate`` does now: the error it raises, or "generated"."""
        try:
            await self.engine.generate(PROMPTS, max_new_tokens=2)
        except Exception as exc:
            return type(exc).__name__
        return "generated"

    async def revive(self) -> None:
        """Bring a killed engine back (same engine object)."""

    async def discard(self) -> None:
        await self.engine.finish_generation()

    async def wake(self) -> None:
        await self.engine.prepare_for_generation()


class Embedded(EngineUnderTest):
    def __init__(self, transport: str, engine: EmbeddedEngine) -> None:
        self.transport = transport
        self.engine = engine

    def synchronizer(self, source: RefitSource) -> WeightSynchronizer:
        if self.transport == "ipc":
            return IPCWeightSynchronizer(
                source, self.engine, bucket_bytes=BUCKET_BYTES, rpc_timeout_s=30
            )
        return create_weight_synchronizer(
            source,
            self.engine,
            colocated=False,
            backend="embedded",
            train_cluster=TrainCluster(master_port=_port()),
            inference_world_size=1,
            bucket_bytes=BUCKET_BYTES,
            collective_timeout_s=10.0,
            rpc_timeout_s=30.0,
        )

    def pid(self) -> int:
        return int(self.engine.pids[0])

    async def weights(self) -> dict[str, torch.Tensor]:
        (state,) = await self.engine.hf_state_dicts()
        return state

    async def revive(self) -> None:
        await self.engine.respawn_dead_workers()


class HTTPServer(EngineUnderTest):
    """The SGLang-contract test server in its own process (restartable)."""

    transport = "http"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.config = workdir / "config.json"
        self.config.write_text(json.dumps(TINY_QWEN3))
        self.proc: subprocess.Popen[bytes] | None = None
        self.engine: SGLangHTTPBackend | None = None
        self._start()

    def _start(self) -> None:
        port_file = self.workdir / f"port-{time.monotonic_ns()}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aiosync.testing.sglang_server",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--model-config",
                str(self.config),
                "--seed",
                "1",
                "--enable-memory-saver",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 300
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the SGLang test server did not start")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"
        self.engine = SGLangHTTPBackend(self.url, enable_memory_saver=True)

    def synchronizer(self, source: RefitSource) -> WeightSynchronizer:
        assert self.engine is not None
        return HTTPWeightSynchronizer(source, self.engine, bucket_bytes=BUCKET_BYTES)

    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def weights(self) -> dict[str, torch.Tensor]:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            response = await client.get("/_aiosync/state_dict")
            response.raise_for_status()
            return safetensors_load(response.content)

    async def fault(self, mode: str) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            body = {"path": "/update_weights_from_tensor", "mode": mode, "count": None}
            (await client.post("/_aiosync/faults", json=body)).raise_for_status()

    async def reset(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            (await client.post("/_aiosync/reset")).raise_for_status()

    async def revive(self) -> None:
        self.stop()
        self._start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


# -- one cell -----------------------------------------------------------------


async def _matches(engine: EngineUnderTest, model: torch.nn.Module) -> bool:
    """Whether the engine holds ``model``'s checkpoint tensors, bit for bit."""
    state = await engine.weights()
    expected = dict(DTensorRefitSource(model).iter_weights())
    return set(state) == set(expected) and all(
        torch.equal(state[n], t.to(state[n].dtype)) for n, t in expected.items()
    )


async def _timed(fault_time: list[float], call: Awaitable[Any]) -> tuple[str, float | None]:
    """Await ``call``; the error type it raised and seconds since ``fault_time[0]``."""
    try:
        await call
    except Exception as exc:
        return type(exc).__name__, time.monotonic() - fault_time[0] if fault_time else None
    return "none", None


async def run_cell(engine: EngineUnderTest, fault: str, seed: int) -> Cell:
    """Run ``fault`` against ``engine``'s transport; see the module docs for the columns."""
    cell = Cell(engine.transport, fault, note=EXPLAINED.get((engine.transport, fault), ""))
    before = _aiosync_entries()
    trainer = _trainer(seed)
    source = FaultySource(trainer.model)
    sync = engine.synchronizer(source)
    others: list[WeightSynchronizer] = []
    fault_time: list[float] = []
    try:
        if fault == "mismatch":
            untouched = await engine.weights()
            name = next(iter(source.prepare_refit_info()))
            source.rename = (name, name + "_renamed")
            fault_time.append(time.monotonic())
            cell.error, cell.seconds = await _timed(fault_time, sync.init_communicator())
            # Nothing moved: the engine holds what it held.
            now = await engine.weights()
            cell.version_kept = all(torch.equal(now[n], t) for n, t in untouched.items())
            return cell
        await sync.init_communicator()
        await sync.mark_stale()
        await sync.sync_weights()
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(1.25)
        await sync.mark_stale()
        await _inject(engine, fault, sync, source, fault_time, cell, others)
        if fault != "second synchronizer":
            cell.version_kept = sync.weight_version == 1 and sync.is_stale
        cell.generate = await engine.generate() if fault != "second synchronizer" else "—"
        if fault == "engine killed":
            await engine.revive()
            if isinstance(engine, HTTPServer):
                # A new server process: a new synchronizer (the old one named the dead one).
                await sync.shutdown()
                sync = engine.synchronizer(source)
                await sync.mark_stale()
            # A replacement worker knows no plan yet: the loop re-inits, as documented.
            await sync.init_communicator()
        if fault == "weights discarded":
            await engine.wake()
        if isinstance(engine, HTTPServer):
            await engine.reset()
        if fault == "second synchronizer":
            await sync.mark_stale()
        await sync.sync_weights()
        cell.heals = not sync.is_stale and await _matches(engine, trainer.model)
        return cell
    except Exception as exc:
        cell.note = f"{type(exc).__name__}: {exc}"[:200]
        return cell
    finally:
        for s in (sync, *others):
            with contextlib.suppress(Exception):
                await s.shutdown()
        left = sorted(_aiosync_entries() - before)
        cell.left_behind = len(left)
        if left:
            cell.note = (cell.note + "; " if cell.note else "") + "left: " + ", ".join(left)


async def _inject(
    engine: EngineUnderTest,
    fault: str,
    sync: WeightSynchronizer,
    source: FaultySource,
    fault_time: list[float],
    cell: Cell,
    others: list[WeightSynchronizer],
) -> None:
    """Run version 2's sync with ``fault`` striking mid-way; fill ``cell.error/seconds``."""

    def at(action: Callable[[], None]) -> None:
        def hook() -> None:
            fault_time.append(time.monotonic())
            action()

        source.hook = hook

    if fault == "engine killed":
        at(lambda: os.kill(engine.pid(), signal.SIGKILL))
    elif fault == "engine hangs":
        sync.sync_timeout_s = HANG_TIMEOUT_S
        at(lambda: os.kill(engine.pid(), signal.SIGSTOP))
    elif fault == "engine error":
        assert isinstance(engine, HTTPServer)
        await engine.fault("error")
        fault_time.append(time.monotonic())  # from the first bucket on
    elif fault == "weights discarded":
        at(lambda: anyio.from_thread.run(engine.discard))
    elif fault == "cancelled":
        with anyio.CancelScope() as scope:
            at(lambda: anyio.from_thread.run_sync(scope.cancel))
            await sync.sync_weights()
        cell.error = "Cancelled" if scope.cancelled_caught else "none"
        cell.seconds = time.monotonic() - fault_time[0] if fault_time else None
        return
    elif fault == "second synchronizer":
        await _second_synchronizer(engine, sync, source, fault_time, cell, others)
        return
    try:
        cell.error, cell.seconds = await _timed(fault_time, sync.sync_weights())
    finally:
        if fault == "engine hangs":
            os.kill(engine.pid(), signal.SIGCONT)
            sync.sync_timeout_s = 600.0


async def _second_synchronizer(
    engine: EngineUnderTest,
    sync: WeightSynchronizer,
    source: FaultySource,
    fault_time: list[float],
    cell: Cell,
    others: list[WeightSynchronizer],
) -> None:
    other = engine.synchronizer(FaultySource(_trainer(999).model))
    others.append(other)
    if engine.transport == "collective":
        # The first synchronizer owns the sync group formed by its syncs.
        fault_time.append(time.monotonic())
        cell.error, cell.seconds = await _timed(fault_time, other.init_communicator())
        await sync.sync_weights()
    else:
        await other.init_communicator()
        await other.mark_stale()
        streaming, answered = threading.Event(), threading.Event()

        def hold() -> None:
            streaming.set()
            answered.wait(60)

        source.hook = hold

        async def intrude() -> None:
            await anyio.to_thread.run_sync(streaming.wait, 60)
            fault_time.append(time.monotonic())
            try:
                cell.error, cell.seconds = await _timed(fault_time, other.sync_weights())
            finally:
                answered.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(intrude)
            await sync.sync_weights()
    # The first synchronizer's refit landed whole, undisturbed by the second.
    cell.version_kept = (
        sync.weight_version == 2
        and not sync.is_stale
        and await _matches(engine, source.inner.model)
    )


# -- the run ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _engines(transports: tuple[str, ...]) -> AsyncIterator[dict[str, EngineUnderTest]]:
    engines: dict[str, EngineUnderTest] = {}
    async with contextlib.AsyncExitStack() as stack:
        for transport in transports:
            if transport == "http":
                workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                server = HTTPServer(workdir)
                stack.callback(server.stop)
                engines[transport] = server
            else:
                engine = EmbeddedEngine(
                    dict(TINY_QWEN3), num_workers=1, seed=3, sleep_level=2, rpc_timeout_s=60
                )
                await stack.enter_async_context(engine)
                await engine.start()
                engines[transport] = Embedded(transport, engine)
        yield engines


async def run(transports: tuple[str, ...]) -> list[Cell]:
    cells: list[Cell] = []
    async with _engines(transports) as engines:
        for t_index, transport in enumerate(transports):
            for f_index, fault in enumerate(FAULTS):
                reason = NOT_APPLICABLE.get((transport, fault))
                if reason is not None:
                    cells.append(Cell(transport, fault, error="n/a", note=reason))
                    continue
                cell = await run_cell(engines[transport], fault, seed=100 + 10 * t_index + f_index)
                cells.append(cell)
    return cells


def _yes(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "**no**")


def table(cells: list[Cell]) -> list[str]:
    """The matrix as Markdown table lines."""
    lines = [
        "| transport | fault | error the loop gets | s to error | version kept, stale "
        "| `generate` then | next sync heals | left behind |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        seconds = "—" if c.seconds is None else f"{c.seconds:.2f}"
        left = "—" if c.left_behind is None else str(c.left_behind)
        error = c.error if not c.note else f"{c.error} ({c.note})"
        lines.append(
            f"| {c.transport} | {c.fault} | {error} | {seconds} | {_yes(c.version_kept)} "
            f"| {c.generate} | {_yes(c.heals)} | {left} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the IPC column only")
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument("--write", type=Path, help="write the Markdown report to this file")
    args = parser.parse_args()
    transports = ("ipc",) if args.quick else TRANSPORTS
    machine = Machine(repeats=1)
    start = time.monotonic()
    cells = asyncio.run(run(transports))
    machine.finish()
    lines = table(cells)
    print("\n".join(lines))
    print(f"\n{len(cells)} cells in {time.monotonic() - start:.0f} s")
    machine.report(statistic="one run")
    if args.write is not None:
        args.write.write_text(_report(lines, machine))
    if args.json:
        print(json.dumps({"cells": [asdict(c) for c in cells], **machine.fields()}))


def _report(lines: list[str], machine: Machine) -> str:
    doc = (__doc__ or "").split("Usage::")[0].strip().splitlines()
    return "\n".join(
        [
            "# Reliability: the fault matrix",
            "",
            "Generated by `python benchmarks/faults.py --write docs/reliability.md`; do not edit",
            "by hand. What each fault does, and what each column means:",
            "",
            *doc[2:],
            "",
            *lines,
            "",
            f"Last run: {machine.caption('one run')}; seconds to error are indicative.",
            "",
            "Outside this matrix (they need a trainer in another process, or a GPU), each a test:",
            "a SIGKILLed trainer ends the engine workers' receive within ~0.1 s",
            "(`tests/ipc/test_ipc_faults.py`), the SGLang test server it started exits with it",
            "(`tests/http/test_sglang_test_server_parent_death.py`), and the next aiosync process",
            "sweeps the dead trainer's `/dev/shm` segments and socket folders",
            "(`tests/ipc/test_leftovers.py`); `expandable_segments` (C20) waits for a GPU run.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
