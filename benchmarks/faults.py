"""The fault matrix: every fault on every transport, run for real; what the loop sees, what is left.

Each cell runs one fault against real processes — an ``EmbeddedEngine``
worker process for IPC and the collective (gloo), the SGLang-contract test server
(``python -m aiosync.testing.sglang_server``) for HTTP — on a tiny Qwen3,
after one healthy sync (version 1), during the sync of version 2:

* ``mismatch``: the trainer's manifest renames one tensor (at ``init_communicator``);
* ``engine killed``: SIGKILL of the engine worker (the HTTP server) mid-sync;
* ``engine hangs``: SIGSTOP of it mid-sync (``sync_timeout_s`` = 5 s), SIGCONT after;
* ``engine error``: HTTP only: the server answers 500 to ``/update_weights_from_tensor``;
* ``corrupted in transit``: one byte of bucket 0 (its first tensor's first byte) flipped on the
  receive path (the test hook ``aiosync_test_arm_transit_fault``; HTTP: the test server's
  ``/_aiosync/arm_transit_fault``), under each transport's default ``verify`` (IPC and the
  collective: ``True``, HTTP: ``"sample"``);
* ``one bit flipped in transit``: the same, but one bit: the exponent's top bit of a middle
  element of bucket 0's tensor (``model.embed_tokens.weight``, its element 4097 becomes
  ~1e38), under the same default ``verify``;
* ``cancelled``: the loop cancels ``sync_weights`` mid-sync;
* ``weights discarded``: the engine discards its weights mid-sync (a level-2 sleep; SGLang:
  ``/release_memory_occupation``, the server started with ``--enable-memory-saver``);
* ``second synchronizer``: another synchronizer tries the same engine (IPC: during a refit,
  collective: while the first owns the sync group);
* ``sequential takeover``: trainer A syncs version 1, then trainer B (another synchronizer,
  in the same process) inits and syncs the same engine; A's next ``sync_weights`` and
  ``refit_if_stale``;
* ``restarted trainer``: A syncs versions 1–3 and shuts down (its process ending); a new
  synchronizer with ``initial_version=3`` on the same weights inits, refits if stale, then
  takes a training step (``policy_update``) and refits;
* ``live weight corrupted``: after version 1 committed, one element of a live engine weight
  (``model.layers.1.mlp.down_proj.weight``) gets 1.0 added behind the transport's back (the
  embedded workers' ``embedded_load_state_dict``; the test server's ``/_aiosync/corrupt``),
  then the loop calls ``verify_engine()``;
* ``server restarted``: HTTP only: after version 1 committed, the test server is restarted on
  the same port (its own seeded weights, SGLang's ``"default"`` label); the loop generates,
  then calls ``refit_if_stale``.

The two cells between syncs read the columns so: the error is what ``verify_engine()``
(``server restarted``: the first ``generate``) raises, seconds from the fault to it,
"version kept, stale" that the synchronizer reports version 1 with ``is_stale`` true
afterwards, and "next sync heals" that the next ``sync_weights()`` (``server restarted``:
``refit_if_stale``, which must re-sync) lands every tensor bit-exact (and a
``verify_engine()`` after it passes).

Columns: the exception the training loop gets (``Cancelled``: the cancellation
itself), seconds from the fault to it, whether ``weight_version`` stayed 1 with
``is_stale`` true (or, for a second synchronizer, the first one's sync landed
untouched), what ``generate`` does next (the error it raises: it must not
generate), whether the same synchronizer's next sync lands every tensor
bit-exact, and the aiosync entries (``/dev/shm`` segments, temp-dir folders)
created since the cell began that remain after its synchronizers shut down (those
whose name carries the pid of a process of this run: the machine may be shared).

The two second-owner cells read the columns for the first owner: for ``sequential
takeover`` the error is what A's next ``sync_weights`` raises (seconds from that call),
"version kept, stale" that A still reports version 1 with ``is_stale`` true (— where B
never committed), ``generate`` what the engine, now serving B's weights, does, and
"next sync heals" that A's ``init_communicator()`` (the explicit take-over) and sync land
A's weights bit-exact; the note says what B's attempt and A's ``refit_if_stale`` got. The
claim on an engine is kept per engine object, within one process (two trainer
processes on one engine are the ``second synchronizer`` cells). For ``restarted trainer``
the error is what the restarted loop's refits raise, and "version kept, stale" means
that the engine's label (``generate_with_meta``'s version; SGLang: ``/model_info``)
continues at 4 after the step. In one process the closed synchronizer's claim on the
engine remains, so the new one starts stale and its first refit re-syncs version 3; a
restarted process starts without that claim.

The sharded cells (transport ``ipc, 2 FSDP2 ranks`` and ``collective, 2 FSDP2 ranks``)
run a 2-rank FSDP2 trainer over gloo in two spawned processes — the rank scripts of
``tests/ipc/test_sharded_faults.py`` (rank 0 holds a colocated 2-worker engine, worker
*r* fed by rank *r*) and of ``tests/collective/test_sharded_failures.py`` (rank 0 holds
a 1-worker engine), the trainer of ``tests/_support/fsdp2.py`` — with the fault on rank 1
during the sync of version 2: its source raises before its first tensor, between its
gathers, or after its last tensor, or the rank SIGKILLs itself mid-sync. The error is
what every surviving rank raises (the note says whether all survivors raise the same
one and whether it names rank 1, and what rank 1 itself raised), seconds from the fault
to the last survivor's error, whether every rank kept version 1 with ``is_stale`` true,
what rank 0's engine does next, and whether the next sync lands bit-exact on every
worker: in the same processes where the trainer's own group survived, else ("after a
restart") in a restarted job of both ranks; left behind counts the whole job's entries.

The quarantine cells (transport ``ipc, fleet of 2`` and the like) run an
``EngineFleet(on_engine_failure="quarantine", min_engines=1, probe_timeout_s=2)`` of two
engines (two embedded engines; two test servers for HTTP) and strike engine 1 (its worker;
the server): SIGKILL mid-sync; SIGKILL between two syncs, while the fleet generates (an
embedded engine once engine 1 runs the request; the note says what that generate raised),
then the sync; SIGSTOP mid-sync (what waits on it gives up after 5 s: the RPCs, the
collective, an HTTP request), SIGCONT and SIGKILL once the sync returned. The error
column is what that ``sync_weights()`` raises ("none": it committed), "version kept,
stale" reads as "committed on the survivor" (version 2, not stale, the survivor
bit-exact), ``generate`` is the fleet's, and "next sync heals" that engine 1, respawned
and ``add_engine``-d, got the next sync whole and serves again (``ENGINE_JOINED``); the
note gives the reason engine 1 was set aside for. The Ray cell (transport ``ipc, fleet of 2
Ray engines``) is the SIGKILL cell with each embedded engine in a Ray actor
(``aiosync.ray.launch_engine``, a local cluster of 2 CPUs) and actor 1 ``ray.kill``-ed;
the note also gives the versions the survivor labels its tokens with, and the heal
launches a new actor.

The tied cells (their own table: the matrix's model is untied) run the tiny Qwen3 with
``tie_word_embeddings`` on its own engine per transport: after version 1 the trainer
unties ``lm_head`` by ``load_state_dict(..., assign=True)`` of its own cloned state dict
(a resume from a checkpoint that holds both names) and takes a step; the sync of version
2 must be refused naming ``lm_head.weight`` before any byte moves ("version kept, stale"
also requires the engine's weights untouched), and after ``model.tie_weights()`` the next
sync heals.

Usage::

    python benchmarks/faults.py                 # every cell (several minutes)
    python benchmarks/faults.py --quick         # the IPC column only, no sharded cells (< 1 minute)
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
import re
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
    CollectiveOptions,
    EmbeddedEngine,
    EngineFleet,
    HTTPWeightSynchronizer,
    IPCWeightSynchronizer,
    SGLangHTTPBackend,
    SyncOptions,
    Timeouts,
    TrainCluster,
    VersionEventKind,
    WeightSynchronizer,
    create_weight_synchronizer,
    refit_if_stale,
)
from aiosync.engines.embedded._worker import tensor_to_wire
from aiosync.engines.embedded.configs import TINY_QWEN3, TINY_QWEN3_TIED
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource, share_parameters
from aiosync.sources import RefitManifest, RefitSource
from aiosync.transports._leftovers import SHM_DIR

# The table reports each failure; the transports' own logging of it is noise here.
logging.getLogger("aiosync").setLevel(logging.CRITICAL)

#: The fault strikes before this tensor of version 2 is read (of 24).
FAULT_AT = 6
#: ``sync_timeout_s`` of the "engine hangs" cells, seconds.
HANG_TIMEOUT_S = 5.0
BUCKET_BYTES = 16384
PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]
TRANSPORTS = ("ipc", "ipc direct", "collective", "http")
FAULTS = (
    "mismatch",
    "engine killed",
    "engine hangs",
    "engine error",
    "corrupted in transit",
    "one bit flipped in transit",
    "cancelled",
    "weights discarded",
    "second synchronizer",
    "sequential takeover",
    "restarted trainer",
    "live weight corrupted",
    "server restarted",
)
#: The cells whose fault strikes between two syncs, after version 1 (no sync of version 2).
BETWEEN_SYNCS = ("live weight corrupted", "server restarted")
#: The live weight the ``live weight corrupted`` cells change, the element and what is added.
CORRUPTED = ("model.layers.1.mlp.down_proj.weight", 17, 1.0)
#: Bucket, byte and mask of the ``one bit flipped in transit`` cells: bucket 0 holds
#: ``model.embed_tokens.weight`` alone (128 x 64 float32, 32 KiB); byte 16391 is the high
#: byte of its element 4097 (little-endian, a middle row: not among the first rows HTTP's
#: ``"sample"`` reads back), 0x40 that byte's top exponent bit.
BIT_FLIP = (0, 16391, 0x40)
#: The cells about which synchronizer owns the engine (:func:`run_owner_cell`).
OWNER_FAULTS = ("sequential takeover", "restarted trainer")
#: The version the trainer of the ``restarted trainer`` cell had reached (its checkpoint).
RESTART_AT = 3
#: The repository (the sharded cells run the tests' rank scripts).
REPO = Path(__file__).resolve().parents[1]
#: The sharded cells' transports and their rank scripts (``tests/_support/fsdp2.py``'s trainer).
RANK_SCRIPTS = {
    "ipc": REPO / "tests" / "ipc" / "_sharded_faults.py",
    "collective": REPO / "tests" / "collective" / "_sharded_collective.py",
}
#: Ranks of the sharded trainer, and the one that fails.
RANKS = 2
FAILED_RANK = 1
#: The sharded cells' faults: the rank scripts' scenario for each.
SHARDED_FAULTS = {
    "rank 1 raises before": "before",
    "rank 1 raises between": "between",
    "rank 1 raises after": "after",
    "rank 1 SIGKILLed": "kill",
}
#: The longest one job of rank processes may run before its cell counts as hung, seconds.
JOB_LIMIT_S = 300.0
#: The bucket and byte the ``corrupted in transit`` cells flip (a slot's first byte: always
#: in the default ``"sample"`` check).
TRANSIT_FAULT = (0, 0)
#: The quarantine cells' faults, on engine 1 of a fleet of 2.
QUARANTINE_FAULTS = (
    "engine killed, quarantine",
    "engine dies between syncs, quarantine",
    "engine hangs (SIGSTOP) mid-sync, quarantine",
)
#: ``probe_timeout_s`` of the quarantine cells' fleets, seconds.
PROBE_TIMEOUT_S = 2.0
#: The Ray quarantine cell's transport and fault.
RAY_TRANSPORT = "ipc, fleet of 2 Ray engines"
RAY_FAULT = "Ray engine killed mid-sync, quarantine"
#: The tied cells' fault (their own table, on engines of the tied model).
TIE_FAULT = "tie broken"
#: Cells that do not apply (no such fault on that transport), with the reason.
NOT_APPLICABLE = {
    ("ipc", "engine error"): "workers answer typed errors, covered by the others",
    ("collective", "engine error"): "workers answer typed errors, covered by the others",
    **{
        ("ipc direct", fault): "the handshake and commit of ipc: only the data messages differ"
        for fault in ("mismatch", "engine error", "second synchronizer", *OWNER_FAULTS)
    },
    **{
        (transport, "server restarted"): (
            "an embedded engine's restart is a respawned worker (the `engine killed` cell's "
            "heal); weights lost between syncs: `weights discarded`"
        )
        for transport in ("ipc", "ipc direct", "collective")
    },
}
#: What a cell's outcome means, where the table alone would not say.
EXPLAINED = {
    ("http", "second synchronizer"): (
        "SGLang keeps no session: two trainers posting to one server interleave their buckets; "
        "in one process the one whose commit came second refuses it (OwnershipError: a mix) "
        "and the other turns stale; across processes nothing tells them: give each server "
        "exactly one trainer"
    ),
    ("http", "one bit flipped in transit"): (
        'HTTP\'s default verify="sample" reads back the first rows of at most 8 tensors per '
        "server and sync: one bit of a middle row commits unseen; verify=True reads every "
        "tensor back whole, verify_engine() (record_checksums=True: SGLang's own checksums) "
        "finds it after"
    ),
    **{
        (transport, "live weight corrupted"): (
            "a delta synchronizer's next sync is full (the worker no longer holds the "
            "baseline: tests/delta, C32)"
        )
        for transport in TRANSPORTS
    },
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

    def preflight(self) -> None:
        self.inner.preflight()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner.iter_weights()):
            if i == FAULT_AT and self.hook is not None:
                hook, self.hook = self.hook, None
                hook()
            yield item


#: The processes this run started (and itself): the creators whose entries count.
_OURS: set[int] = {os.getpid()}
#: The creator's pid in an aiosync entry's name (``transports/_leftovers.py``).
_CREATOR = re.compile(r"^aiosync-(?:[a-z]+(?:-[a-z]+)?-)?(?P<pid>[0-9]+)-")


def _ours(name: str) -> bool:
    """Whether this run's processes created entry ``name`` (one naming no creator counts):
    the machine is shared, and other tenants' aiosync processes are not this cell's."""
    match = _CREATOR.match(name)
    return match is None or int(match["pid"]) in _OURS


def _aiosync_entries() -> set[str]:
    """aiosync's names in /dev/shm and the temp dir that this run's processes created
    (what a crash could leave)."""
    names = {f"shm:{n}" for n in os.listdir(SHM_DIR) if n.startswith("aiosync") and _ours(n)}
    tmp = tempfile.gettempdir()
    return names | {f"tmp:{n}" for n in os.listdir(tmp) if n.startswith("aiosync-") and _ours(n)}


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

    def synchronizer(self, source: RefitSource, initial_version: int = 0) -> WeightSynchronizer:
        raise NotImplementedError

    def pid(self) -> int:
        raise NotImplementedError

    async def label(self) -> object:
        """The version the engine labels what it generates with now."""
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

    async def corrupt_in_transit(self, bucket: int, byte: int, mask: int = 0xFF) -> None:
        """Arm the receive path to XOR byte ``byte`` of bucket ``bucket`` with ``mask`` in
        the next sync."""
        await self.engine.collective_rpc(
            "aiosync_test_arm_transit_fault", args=(bucket, byte, mask)
        )

    async def corrupt_live(self) -> None:
        """Add :data:`CORRUPTED`'s value to its element of the live weight, behind the
        transport's back."""
        name, index, delta = CORRUPTED
        bad = (await self.weights())[name].clone()
        bad.view(-1)[index] += delta
        await self.engine.collective_rpc("embedded_load_state_dict", ({name: tensor_to_wire(bad)},))


class Embedded(EngineUnderTest):
    def __init__(self, transport: str, engine: EmbeddedEngine) -> None:
        self.transport = transport
        self.engine = engine

    def synchronizer(self, source: RefitSource, initial_version: int = 0) -> WeightSynchronizer:
        if self.transport in ("ipc", "ipc direct"):
            return IPCWeightSynchronizer(
                source,
                self.engine,
                bucket_bytes=BUCKET_BYTES,
                rpc_timeout_s=30,
                initial_version=initial_version,
            )
        return create_weight_synchronizer(
            source,
            self.engine,
            colocated=False,
            backend="embedded",
            train_cluster=TrainCluster(master_port=_port()),
            inference_world_size=1,
            transport=CollectiveOptions(bucket_bytes=BUCKET_BYTES),
            sync=SyncOptions(initial_version=initial_version),
            timeouts=Timeouts(rpc_s=30.0, collective_s=10.0),
        )

    def pid(self) -> int:
        return int(self.engine.pids[0])

    async def label(self) -> object:
        (generation,) = await self.engine.generate_with_meta(PROMPTS[:1], max_new_tokens=1)
        return generation.first_version

    async def weights(self) -> dict[str, torch.Tensor]:
        (state,) = await self.engine.hf_state_dicts()
        return state

    async def revive(self) -> None:
        await self.engine.respawn_dead_workers()


class HTTPServer(EngineUnderTest):
    """The SGLang-contract test server in its own process (restartable)."""

    transport = "http"

    def __init__(
        self,
        workdir: Path,
        request_timeout_s: float | None = None,
        config: dict[str, Any] = TINY_QWEN3,
    ) -> None:
        self.workdir = workdir
        self.request_timeout_s = request_timeout_s
        self.config = workdir / "config.json"
        self.config.write_text(json.dumps(config))
        self.proc: subprocess.Popen[bytes] | None = None
        self.engine: SGLangHTTPBackend | None = None
        self._start()

    def _start(self, port: int = 0) -> None:
        """Start the server (on ``port``; 0: a free one) and a new backend of it."""
        self._spawn(port)
        limits = (
            {} if self.request_timeout_s is None else {"request_timeout_s": self.request_timeout_s}
        )
        self.engine = SGLangHTTPBackend(self.url, enable_memory_saver=True, **limits)

    def _spawn(self, port: int) -> None:
        port_file = self.workdir / f"port-{time.monotonic_ns()}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aiosync.testing.sglang_server",
                "--port",
                str(port),
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
        _OURS.add(self.proc.pid)
        deadline = time.monotonic() + 300
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the SGLang test server did not start")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def synchronizer(self, source: RefitSource, initial_version: int = 0) -> WeightSynchronizer:
        assert self.engine is not None
        return HTTPWeightSynchronizer(
            source, self.engine, bucket_bytes=BUCKET_BYTES, initial_version=initial_version
        )

    async def label(self) -> object:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            response = await client.get("/model_info")
            response.raise_for_status()
            return response.json()["weight_version"]

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

    async def corrupt_in_transit(self, bucket: int, byte: int, mask: int = 0xFF) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            body = {"bucket": bucket, "byte": byte, "mask": mask}
            (await client.post("/_aiosync/arm_transit_fault", json=body)).raise_for_status()

    async def corrupt_live(self) -> None:
        name, index, delta = CORRUPTED
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            body = {"name": name, "index": index, "delta": delta}
            (await client.post("/_aiosync/corrupt", json=body)).raise_for_status()

    def restart(self) -> None:
        """Kill the server and start a fresh one on the same port; the backend stays (the
        loop's, which must notice)."""
        port = int(self.url.rsplit(":", 1)[1])
        self.stop()
        self._spawn(port)

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
    if fault in OWNER_FAULTS:
        return await run_owner_cell(engine, fault, seed)
    cell = Cell(engine.transport, fault, note=EXPLAINED.get((engine.transport, fault), ""))
    before = _aiosync_entries()
    trainer = _trainer(seed)
    # "ipc direct": the trainer's parameters in shared memory, so every bucket goes direct.
    shared = share_parameters(trainer.model) if engine.transport == "ipc direct" else None
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
        if fault in BETWEEN_SYNCS:
            await _between_syncs(engine, fault, sync, fault_time, cell)
        else:
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
        if fault == "one bit flipped in transit" and cell.error == "none":
            await _committed_corruption(engine, sync, trainer.model, cell)
        if fault == "second synchronizer" or not sync.is_stale:
            await sync.mark_stale()
        if fault == "server restarted":
            # The loop's own call: it must see the restart and re-sync.
            resynced = await refit_if_stale(sync, engine.engine)
            cell.note = _noted(cell.note, f"refit_if_stale returned {resynced}")
        else:
            resynced = True
            await sync.sync_weights()
        cell.heals = resynced and not sync.is_stale and await _matches(engine, trainer.model)
        if fault in BETWEEN_SYNCS and cell.heals:
            await sync.verify_engine()  # raises (noted: the cell stops) if it did not heal
        return cell
    except Exception as exc:
        # The cell stopped here: say so beside what it means, not instead of it.
        stopped = f"the cell stopped at {type(exc).__name__}: {_short(str(exc), 160)}"
        cell.note = (cell.note + "; " if cell.note else "") + stopped
        return cell
    finally:
        for s in (sync, *others):
            with contextlib.suppress(Exception):
                await s.shutdown()
        if shared is not None:
            shared.close()
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

    limits = sync.timeouts
    if fault == "engine killed":
        at(lambda: os.kill(engine.pid(), signal.SIGKILL))
    elif fault == "engine hangs":
        sync.timeouts = limits.with_keywords(sync_timeout_s=HANG_TIMEOUT_S)
        at(lambda: os.kill(engine.pid(), signal.SIGSTOP))
    elif fault == "engine error":
        assert isinstance(engine, HTTPServer)
        await engine.fault("error")
        fault_time.append(time.monotonic())  # from the first bucket on
    elif fault == "corrupted in transit":
        await engine.corrupt_in_transit(*TRANSIT_FAULT)
        fault_time.append(time.monotonic())  # from the start of the sync
    elif fault == "one bit flipped in transit":
        await engine.corrupt_in_transit(*BIT_FLIP)
        fault_time.append(time.monotonic())
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
            sync.timeouts = limits


def _noted(note: str, more: str) -> str:
    return f"{note}; {more}" if note else more


async def _between_syncs(
    engine: EngineUnderTest,
    fault: str,
    sync: WeightSynchronizer,
    fault_time: list[float],
    cell: Cell,
) -> None:
    """Strike ``fault`` (:data:`BETWEEN_SYNCS`) after version 1 committed; fill
    ``cell.error/seconds`` with what the loop's next call raises (its message noted)."""
    if fault == "live weight corrupted":
        await engine.corrupt_live()
        fault_time.append(time.monotonic())
        error = await _error_of(sync.verify_engine())
    else:
        assert isinstance(engine, HTTPServer) and engine.engine is not None
        await anyio.to_thread.run_sync(engine.restart)
        fault_time.append(time.monotonic())
        error = await _error_of(engine.engine.generate(PROMPTS, max_new_tokens=2))
    if isinstance(error, BaseException):
        cell.error, cell.seconds = type(error).__name__, time.monotonic() - fault_time[0]
        cell.note = _noted(cell.note, f"“{_short(str(error), 120)}”")
    else:
        cell.error = "none"


async def _committed_corruption(
    engine: EngineUnderTest, sync: WeightSynchronizer, model: torch.nn.Module, cell: Cell
) -> None:
    """A corrupted sync committed: note which tensors the engine holds differently from
    the trainer and what ``verify_engine()`` then says."""
    state = await engine.weights()
    expected = dict(DTensorRefitSource(model).iter_weights())
    wrong = []
    for name, tensor in expected.items():
        want = tensor.to(state[name].dtype)
        if not torch.equal(state[name], want):
            (where,) = (state[name] != want).reshape(-1).nonzero()[:1].tolist()
            index = where[0]
            held, sent = state[name].reshape(-1)[index].item(), want.reshape(-1)[index].item()
            count = int((state[name] != want).sum())
            wrong.append(f"{name}: {count} element(s), [{index}] = {held:.3g} for {sent:.3g}")
    cell.note = _noted(cell.note, "committed; the engine holds " + ("; ".join(wrong) or "it all"))
    check = await _outcome(sync.verify_engine())
    cell.note = _noted(cell.note, f"verify_engine() then: {check}")


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

        own = "none"

        async def first() -> None:
            nonlocal own
            own = await _outcome(sync.sync_weights())

        async with anyio.create_task_group() as tg:
            tg.start_soon(intrude)
            tg.start_soon(first)
        if own != "none":
            # The second one committed while the first one's bytes moved (HTTP keeps no
            # sessions): the first refuses to commit over the mix, keeps version 1, and
            # takes the engine back explicitly before it heals.
            cell.note = f"the first synchronizer's own sync: {own}"
            cell.version_kept = sync.weight_version == 1 and sync.is_stale
            await sync.init_communicator()
            return
    # The first synchronizer's refit landed whole, undisturbed by the second.
    cell.version_kept = (
        sync.weight_version == 2
        and not sync.is_stale
        and await _matches(engine, source.inner.model)
    )


# -- who owns the engine --------------------------------------------------------


async def _outcome(call: Awaitable[Any]) -> str:
    """What awaiting ``call`` did: "none" or the error's type and message (shortened)."""
    try:
        await call
    except Exception as exc:
        return f"{type(exc).__name__}: {_short(str(exc))}"
    return "none"


def _short(text: str, limit: int = 90) -> str:
    """``text`` without its run-specific tokens (owner tokens, addresses), at most ``limit``
    characters."""
    text = re.sub(r"\b(0x[0-9a-f]+|[0-9a-f]{16})\b", "…", text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


async def run_owner_cell(engine: EngineUnderTest, fault: str, seed: int) -> Cell:
    """Run an :data:`OWNER_FAULTS` cell against ``engine``; see the module docs."""
    cell = Cell(engine.transport, fault)
    before = _aiosync_entries()
    syncs: list[WeightSynchronizer] = []
    notes: list[str] = []
    try:
        if fault == "sequential takeover":
            await _sequential_takeover(engine, seed, cell, syncs, notes)
        else:
            await _restarted_trainer(engine, seed, cell, syncs, notes)
    except Exception as exc:
        notes.append(f"the cell stopped at {type(exc).__name__}: {_short(str(exc), 160)}")
    finally:
        for s in syncs:
            with contextlib.suppress(Exception):
                await s.shutdown()
        left = sorted(_aiosync_entries() - before)
        cell.left_behind = len(left)
        if left:
            notes.append("left: " + ", ".join(left))
        cell.note = "; ".join(notes)
    return cell


async def _sequential_takeover(
    engine: EngineUnderTest,
    seed: int,
    cell: Cell,
    syncs: list[WeightSynchronizer],
    notes: list[str],
) -> None:
    trainer_a, trainer_b = _trainer(seed), _trainer(seed + 500)
    a = engine.synchronizer(FaultySource(trainer_a.model))
    b = engine.synchronizer(FaultySource(trainer_b.model))
    syncs += [a, b]
    await a.init_communicator()
    await a.mark_stale()
    await a.sync_weights()
    # B takes the same engine: init, then its own version 1.
    b_outcome = await _outcome(b.init_communicator())
    if b_outcome == "none":
        await b.mark_stale()
        b_outcome = await _outcome(b.sync_weights())
    b_landed = b_outcome == "none" and not b.is_stale and await _matches(engine, trainer_b.model)
    notes.append("B's takeover landed" if b_landed else f"B's takeover: {b_outcome}")
    # A's training goes on: a new version, and the loop's next sync.
    with torch.no_grad():
        for p in trainer_a.model.parameters():
            p.mul_(1.25)
    await a.mark_stale()
    start = time.monotonic()
    error = await _error_of(a.sync_weights())
    if isinstance(error, BaseException):
        cell.error, cell.seconds = type(error).__name__, time.monotonic() - start
        notes.append(f"A's sync_weights: “{_short(str(error))}”")
    else:
        cell.error = "none"
    refit = await _error_of(refit_if_stale(a, engine.engine))
    if isinstance(refit, BaseException) and isinstance(error, BaseException):
        same = type(refit) is type(error) and str(refit) == str(error)
        refit_text = "the same" if same else f"{type(refit).__name__}: {_short(str(refit))}"
    elif isinstance(refit, BaseException):
        refit_text = f"{type(refit).__name__}: {_short(str(refit))}"
    else:
        refit_text = "none"
    notes.append(f"A's refit_if_stale: {refit_text}")
    if b_landed:
        cell.version_kept = a.weight_version == 1 and a.is_stale
    cell.generate = await engine.generate()
    # A takes the engine back explicitly.
    await a.init_communicator()
    await a.sync_weights()
    cell.heals = not a.is_stale and await _matches(engine, trainer_a.model)


async def _error_of(call: Awaitable[Any]) -> BaseException | str:
    """The exception awaiting ``call`` raises ("none" if it returns)."""
    try:
        await call
    except Exception as exc:
        return exc
    return "none"


async def _restarted_trainer(
    engine: EngineUnderTest,
    seed: int,
    cell: Cell,
    syncs: list[WeightSynchronizer],
    notes: list[str],
) -> None:
    trainer = _trainer(seed)
    first = engine.synchronizer(FaultySource(trainer.model))
    syncs.append(first)
    await first.init_communicator()
    for version in range(1, RESTART_AT + 1):
        if version > 1:
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.mul_(1.25)
        await first.mark_stale()
        await first.sync_weights()
    label_before = await engine.label()
    await first.shutdown()  # the trainer's process ends (its sockets and store close)
    # The restarted trainer: the same checkpoint (weights of RESTART_AT), a new synchronizer.
    again = engine.synchronizer(FaultySource(trainer.model), initial_version=RESTART_AT)
    syncs.append(again)
    await again.init_communicator()
    stale_at_start = again.is_stale
    errors = [await _outcome(refit_if_stale(again, engine.engine))]
    label_resumed = await engine.label()
    async with again.policy_update():
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.mul_(1.25)
    errors.append(await _outcome(refit_if_stale(again, engine.engine)))
    label_after = await engine.label()
    cell.error = errors[0] if len(set(errors)) == 1 else " then ".join(errors)
    expected = RESTART_AT + 1
    cell.version_kept = (
        str(label_after) == str(expected)
        and again.weight_version == expected
        and again.policy_version == expected
    )
    notes.append(
        f"engine label {label_before} before the restart; the new synchronizer starts at "
        f"{RESTART_AT}, stale at once: {'yes' if stale_at_start else 'no'}; label "
        f"{label_resumed} after its first refit_if_stale, {label_after} after the step's"
    )
    cell.generate = await engine.generate()
    cell.heals = not again.is_stale and await _matches(engine, trainer.model)


# -- the sharded trainer ------------------------------------------------------------


@dataclass
class Job:
    """One run of every rank of the sharded trainer, as observed."""

    #: Each rank's exit code; None: still running after :data:`JOB_LIMIT_S` (killed).
    codes: list[int | None]
    #: What each rank wrote (None: nothing, as a killed rank).
    seen: list[dict[str, Any] | None]
    #: When the fault struck (``time.monotonic()``, the machine's clock), if it did.
    struck_at: float | None
    #: The end of each rank's log.
    logs: list[str]


def _ports(count: int) -> list[int]:
    """``count`` distinct free ports."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def rank_job(transport: str, scenario: str, workdir: Path) -> Job:
    """Run the :data:`RANK_SCRIPTS` of ``transport`` on :data:`RANKS` ranks with
    ``scenario`` (one of the scripts' scenarios) and wait for every rank to exit
    (the failed rank last: the collective script's waits for its stdin to close)."""
    out = workdir / f"{transport}-{scenario}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    ports = _ports(2)

    def argv(rank: int) -> list[str]:
        head = [sys.executable, str(RANK_SCRIPTS[transport]), str(rank), str(RANKS)]
        result = str(out / f"{rank}.json")
        if transport == "ipc":
            return [*head, str(ports[0]), result, scenario]
        return [*head, str(ports[0]), str(ports[1]), result, scenario, str(FAILED_RANK), "probe"]

    logs = [out / f"{r}.log" for r in range(RANKS)]
    procs = [
        subprocess.Popen(
            argv(r),
            env=env,
            stdin=subprocess.PIPE if transport == "collective" else subprocess.DEVNULL,
            stdout=logs[r].open("w"),
            stderr=subprocess.STDOUT,
        )
        for r in range(RANKS)
    ]
    _OURS.update(p.pid for p in procs)
    deadline = time.monotonic() + JOB_LIMIT_S
    codes: dict[int, int | None] = {}
    try:
        for r in [r for r in range(RANKS) if r != FAILED_RANK] + [FAILED_RANK]:
            stdin = procs[r].stdin
            if r == FAILED_RANK and stdin is not None:
                stdin.close()  # the survivors exited: the failed rank may too
            try:
                codes[r] = procs[r].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[r] = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    seen = [
        json.loads(f.read_text()) if (f := out / f"{r}.json").exists() else None
        for r in range(RANKS)
    ]
    stamp = out / f"{FAILED_RANK}.fault"
    struck_at = float(stamp.read_text()) if stamp.exists() else None
    return Job(
        [codes[r] for r in range(RANKS)], seen, struck_at, [f.read_text()[-2000:] for f in logs]
    )


def _healed(job: Job) -> bool:
    """Whether the job's last sync left every rank unstale and every worker bit-exact."""
    if any(s is None or "after_heal" not in s for s in job.seen):
        return False
    rank0 = job.seen[0]
    assert rank0 is not None
    exact = rank0.get("healed_bit_exact")
    exact = all(exact) if isinstance(exact, list) else bool(exact)
    return exact and all(s is not None and s["after_heal"][2] is False for s in job.seen)


@contextlib.contextmanager
def _recording(cell: Cell) -> Iterator[list[str]]:
    """The notes of a cell run inside: an error stops the cell and is noted (the cell
    says where it stopped, not instead of what it saw), then what the run left behind
    is counted and ``cell.note`` set."""
    notes: list[str] = []
    before = _aiosync_entries()
    try:
        yield notes
    except Exception as exc:
        notes.append(f"the cell stopped at {type(exc).__name__}: {_short(str(exc), 160)}")
    finally:
        left = sorted(_aiosync_entries() - before)
        cell.left_behind = len(left)
        if left:
            notes.append("left: " + ", ".join(left))
        cell.note = "; ".join(notes)


def sharded_cell(transport: str, fault: str, workdir: Path) -> Cell:
    """Run one sharded cell: :data:`SHARDED_FAULTS` ``fault`` on rank 1 of the
    ``transport`` trainer; a restarted job heals where the processes cannot."""
    cell = Cell(f"{transport}, {RANKS} FSDP2 ranks", fault)
    scenario = SHARDED_FAULTS[fault]
    with _recording(cell) as notes:
        job = rank_job(transport, scenario, workdir)
        expected_codes = [
            -signal.SIGKILL if r == FAILED_RANK and scenario == "kill" else 0 for r in range(RANKS)
        ]
        for r, (code, want) in enumerate(zip(job.codes, expected_codes, strict=True)):
            if code is None:
                notes.append(f"rank {r} still running after {JOB_LIMIT_S:.0f} s (killed)")
            elif code != want:
                notes.append(f"rank {r} exited {code}: {_short(job.logs[r].strip()[-300:], 200)}")
        survivors = [job.seen[r] for r in range(RANKS) if r != FAILED_RANK]
        failures = [tuple(s["failure"]) if s and s.get("failure") else None for s in survivors]
        first = failures[0]
        if first is None:
            cell.error = "none"
        else:
            kind, message = first
            cell.error = kind
            alike = all(f == first for f in failures)
            names = f"rank {FAILED_RANK}" in message
            notes.append(
                f"every survivor alike: {'yes' if alike else '**no**'}, naming rank "
                f"{FAILED_RANK}: {'yes' if names else '**no**'}: “{_short(message)}”"
            )
            own = job.seen[FAILED_RANK]
            if own is not None and own.get("failure"):
                notes.append(f"rank {FAILED_RANK} raised {own['failure'][0]}")
            times = [s["failed_at"] for s in survivors if s and "failed_at" in s]
            if job.struck_at is not None and len(times) == len(survivors):
                cell.seconds = max(times) - job.struck_at
        written = [s for s in job.seen if s is not None]
        cell.version_kept = bool(written) and all(
            s.get("after_failure") == [s["after_ok"][0] + 1, s["after_ok"][1], True]
            for s in written
        )
        engine = job.seen[0].get("engine_after_failure") if job.seen[0] else None
        if engine is not None:
            if "generate_error" in engine:
                cell.generate = engine["generate_error"][0]
            else:
                cell.generate = "generated"
                if all(engine["weights_valid"]):
                    notes.append("the engine still serves version 1 (every worker valid)")
        if scenario != "kill" and all(s is not None and "after_heal" in s for s in job.seen):
            cell.heals = _healed(job)
        else:
            restart = rank_job(transport, "heal", workdir)
            cell.heals = _healed(restart) and restart.codes == [0] * RANKS
            notes.append("healed after a restart of both ranks")
    return cell


def run_sharded() -> list[Cell]:
    """Every sharded cell, transport by transport."""
    with tempfile.TemporaryDirectory(prefix="faults-ranks-") as workdir:
        return [
            sharded_cell(transport, fault, Path(workdir))
            for transport in RANK_SCRIPTS
            for fault in SHARDED_FAULTS
        ]


# -- elastic fleets -------------------------------------------------------------


def _fleet_synchronizer(
    transport: str, source: RefitSource, fleet: EngineFleet, *, hang: bool
) -> Any:
    """A synchronizer of ``fleet``; with ``hang``, what waits on a hung engine (the RPCs,
    the collective) gives up after :data:`HANG_TIMEOUT_S`."""
    if transport == "ipc":
        limit = HANG_TIMEOUT_S if hang else 30.0
        return IPCWeightSynchronizer(source, fleet, bucket_bytes=BUCKET_BYTES, rpc_timeout_s=limit)
    if transport == "http":
        return HTTPWeightSynchronizer(source, fleet, bucket_bytes=BUCKET_BYTES)
    return create_weight_synchronizer(
        source,
        fleet,
        colocated=False,
        backend="embedded",
        train_cluster=TrainCluster(master_port=_port()),
        inference_world_size=2,
        transport=CollectiveOptions(bucket_bytes=BUCKET_BYTES),
        timeouts=Timeouts(rpc_s=30.0, collective_s=HANG_TIMEOUT_S if hang else 10.0),
    )


async def _kill_serving(members: list[EngineUnderTest], fleet: EngineFleet) -> str:
    """SIGKILL engine 1 of ``members`` between two syncs, while the fleet generates (an
    embedded engine: once engine 1 runs a request); returns what that generate raised."""
    generating = asyncio.ensure_future(fleet.generate(PROMPTS, max_new_tokens=200, ignore_eos=True))
    if isinstance(members[1], Embedded):
        with anyio.fail_after(60):
            while not (await members[1].engine.status())[0]["requests"]:
                await anyio.sleep(0.01)
    os.kill(members[1].pid(), signal.SIGKILL)
    try:
        await generating
    except Exception as exc:
        return type(exc).__name__
    return "none"


async def _end_hung(member: EngineUnderTest) -> None:
    """Kill the stopped engine (SIGCONT first) and, for an embedded one, wait until it
    knows its worker is dead."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(member.pid(), signal.SIGCONT)
        os.kill(member.pid(), signal.SIGKILL)
    if isinstance(member, Embedded):
        with anyio.fail_after(60):
            while not member.engine._pool.dead:
                await anyio.sleep(0.05)


async def _events_so_far(events: Any) -> list[Any]:
    """The events published so far (each buffered before the call that made it returned)."""
    out = []
    while True:
        with anyio.move_on_after(0.5):
            out.append(await events.__anext__())
            continue
        return out


async def quarantine_cell(transport: str, fault: str, seed: int) -> Cell:
    """Run the quarantine cell of ``fault`` (:data:`QUARANTINE_FAULTS`) on ``transport``;
    see the module docs."""
    cell = Cell(f"{transport}, fleet of 2", fault)
    hang = "SIGSTOP" in fault
    with _recording(cell) as notes:
        async with contextlib.AsyncExitStack() as stack:
            members: list[EngineUnderTest] = []
            for _ in range(2):
                if transport == "http":
                    server = HTTPServer(
                        Path(stack.enter_context(tempfile.TemporaryDirectory())),
                        request_timeout_s=HANG_TIMEOUT_S if hang else None,
                    )
                    stack.callback(server.stop)
                    members.append(server)
                else:
                    engine = EmbeddedEngine(
                        dict(TINY_QWEN3), num_workers=1, seed=3, rpc_timeout_s=60
                    )
                    await stack.enter_async_context(engine)
                    members.append(Embedded(transport, engine))
            fleet = EngineFleet(
                [m.engine for m in members],
                on_engine_failure="quarantine",
                min_engines=1,
                probe_timeout_s=PROBE_TIMEOUT_S,
            )
            trainer = _trainer(seed)
            source = FaultySource(trainer.model)
            sync = _fleet_synchronizer(transport, source, fleet, hang=hang)
            stack.push_async_callback(sync.shutdown)
            events = await stack.enter_async_context(sync.subscribe())
            await sync.init_communicator()
            await sync.mark_stale()
            await sync.sync_weights()
            fault_time: list[float] = []

            def strike() -> None:
                fault_time.append(time.monotonic())
                os.kill(members[1].pid(), signal.SIGSTOP if hang else signal.SIGKILL)

            for step, scale in enumerate((1.25, 0.5)):
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        p.mul_(scale)
                await sync.mark_stale()
                if step == 0:
                    if "between syncs" in fault:
                        await fleet.prepare_for_generation()
                        fault_time.append(time.monotonic())
                        notes.append(f"its generate: {await _kill_serving(members, fleet)}")
                    else:
                        source.hook = strike
                    try:
                        cell.error, cell.seconds = await _timed(fault_time, sync.sync_weights())
                    finally:
                        if hang:
                            await _end_hung(members[1])
                    cell.version_kept = (sync.weight_version, sync.is_stale) == (
                        2,
                        False,
                    ) and await _matches(members[0], trainer.model)
                    notes += [f"{k}: {_short(v, 70)}" for k, v in fleet.quarantined.items()]
                    await fleet.prepare_for_generation()
                    try:
                        await fleet.generate(PROMPTS, max_new_tokens=2)
                        cell.generate = "generated"
                    except Exception as exc:
                        cell.generate = type(exc).__name__
                    await members[1].revive()
                    fleet.add_engine(members[1].engine)
                else:
                    await sync.sync_weights()
            seen = [(e.kind, e.engine) for e in await _events_so_far(events)]
            quarantined = [e for kind, e in seen if kind is VersionEventKind.ENGINE_QUARANTINED]
            joined = [e for kind, e in seen if kind is VersionEventKind.ENGINE_JOINED]
            notes.append(f"ENGINE_QUARANTINED {quarantined}, ENGINE_JOINED {joined}")
            exact = [await _matches(m, trainer.model) for m in members]
            cell.heals = not sync.is_stale and all(exact) and len(joined) == 1
    return cell


async def ray_quarantine_cell(seed: int) -> Cell:
    """The :data:`RAY_FAULT` cell: two embedded engines in Ray actors (a local cluster
    of 2 CPUs) behind a quarantining fleet; actor 1 is ``ray.kill``-ed mid-sync. See the
    module docs."""
    cell = Cell(RAY_TRANSPORT, RAY_FAULT)
    # Ray takes the loopback address as the node's (read when ray is first imported).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray

        from aiosync.ray import EngineSpec, launch_engine
    except ImportError:
        return Cell(RAY_TRANSPORT, RAY_FAULT, error="n/a", note="Ray is not installed")
    ray.init(num_cpus=2, object_store_memory=80 * 1024 * 1024, include_dashboard=False)
    try:
        with _recording(cell) as notes:
            spec = EngineSpec.embedded(dict(TINY_QWEN3), seed=3, rpc_timeout_s=60)
            engines = [
                await launch_engine(spec, colocated=True, num_gpus=0, num_cpus=0) for _ in range(2)
            ]
            async with contextlib.AsyncExitStack() as stack:
                for engine in engines:
                    stack.push_async_callback(engine.shutdown)
                    _OURS.update([engine.info.pid, *engine.pids])
                fleet = EngineFleet(
                    engines,
                    on_engine_failure="quarantine",
                    min_engines=1,
                    probe_timeout_s=PROBE_TIMEOUT_S,
                )
                trainer = _trainer(seed)
                source = FaultySource(trainer.model)
                sync = IPCWeightSynchronizer(
                    source, fleet, bucket_bytes=BUCKET_BYTES, rpc_timeout_s=30
                )
                stack.push_async_callback(sync.shutdown)
                events = await stack.enter_async_context(sync.subscribe())
                await sync.init_communicator()
                await sync.mark_stale()
                await sync.sync_weights()
                fault_time: list[float] = []

                def kill() -> None:
                    fault_time.append(time.monotonic())
                    ray.kill(engines[1].actor, no_restart=True)

                with torch.no_grad():
                    for p in trainer.model.parameters():
                        p.mul_(1.25)
                await sync.mark_stale()
                source.hook = kill
                cell.error, cell.seconds = await _timed(fault_time, sync.sync_weights())
                expected = dict(DTensorRefitSource(trainer.model).iter_weights())
                (state,) = await engines[0].hf_state_dicts()
                cell.version_kept = (sync.weight_version, sync.is_stale) == (2, False) and all(
                    torch.equal(state[n], t) for n, t in expected.items()
                )
                notes += [f"{k}: {_short(v, 70)}" for k, v in fleet.quarantined.items()]
                await fleet.prepare_for_generation()
                try:
                    outs = await fleet.generate_with_meta(PROMPTS, max_new_tokens=2)
                    labels = sorted({v for g in outs for v in g.versions})
                    cell.generate = "generated"
                    notes.append(f"the survivor labels its tokens {labels}")
                except Exception as exc:
                    cell.generate = type(exc).__name__
                await engines[1].respawn_dead_workers()  # a new actor
                _OURS.update([engines[1].info.pid, *engines[1].pids])
                fleet.add_engine(engines[1])
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        p.mul_(0.5)
                await sync.mark_stale()
                await sync.sync_weights()
                seen = [(e.kind, e.engine) for e in await _events_so_far(events)]
                quarantined = [e for kind, e in seen if kind is VersionEventKind.ENGINE_QUARANTINED]
                joined = [e for kind, e in seen if kind is VersionEventKind.ENGINE_JOINED]
                notes.append(f"ENGINE_QUARANTINED {quarantined}, ENGINE_JOINED {joined}")
                expected = dict(DTensorRefitSource(trainer.model).iter_weights())
                states = [s for e in engines for s in await e.hf_state_dicts()]
                exact = all(
                    torch.equal(state[n], t) for state in states for n, t in expected.items()
                )
                cell.heals = not sync.is_stale and exact and len(joined) == 1
    finally:
        ray.shutdown()
    return cell


# -- the run ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _engines(
    transports: tuple[str, ...], config: dict[str, Any] = TINY_QWEN3
) -> AsyncIterator[dict[str, EngineUnderTest]]:
    engines: dict[str, EngineUnderTest] = {}
    async with contextlib.AsyncExitStack() as stack:
        for transport in transports:
            if transport == "http":
                workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                server = HTTPServer(workdir, config=config)
                stack.callback(server.stop)
                engines[transport] = server
            else:
                engine = EmbeddedEngine(
                    dict(config), num_workers=1, seed=3, sleep_level=2, rpc_timeout_s=60
                )
                await stack.enter_async_context(engine)
                await engine.start()
                engines[transport] = Embedded(transport, engine)
        yield engines


async def run(transports: tuple[str, ...], faults: frozenset[str] | None = None) -> list[Cell]:
    """The matrix's and the quarantine cells of ``transports`` (only ``faults``, if given)."""
    cells: list[Cell] = []
    if faults is not None and not faults & set(FAULTS):
        transports_of_matrix: tuple[str, ...] = ()
    else:
        transports_of_matrix = transports
    async with _engines(transports_of_matrix) as engines:
        for t_index, transport in enumerate(transports_of_matrix):
            for f_index, fault in enumerate(FAULTS):
                if faults is not None and fault not in faults:
                    continue
                reason = NOT_APPLICABLE.get((transport, fault))
                if reason is not None:
                    cells.append(Cell(transport, fault, error="n/a", note=reason))
                    continue
                cell = await run_cell(engines[transport], fault, seed=100 + 10 * t_index + f_index)
                cells.append(cell)
    for t_index, transport in enumerate(transports):
        if transport != "ipc direct":  # a fleet's handshake and commit: those of ipc
            for f_index, fault in enumerate(QUARANTINE_FAULTS):
                if faults is not None and fault not in faults:
                    continue
                seed = 200 + 10 * t_index + f_index
                cells.append(await quarantine_cell(transport, fault, seed=seed))
    return cells


async def tie_cell(engine: EngineUnderTest, seed: int) -> Cell:
    """The :data:`TIE_FAULT` cell on ``engine`` (one of the tied model); see the module docs."""
    cell = Cell(engine.transport, TIE_FAULT)
    with _recording(cell) as notes:
        model: Any = HFModelRunner.from_config(dict(TINY_QWEN3_TIED), seed=seed).model
        async with contextlib.AsyncExitStack() as stack:
            if engine.transport == "ipc direct":
                stack.enter_context(share_parameters(model))
            sync = engine.synchronizer(FaultySource(model))
            stack.push_async_callback(sync.shutdown)
            await sync.init_communicator()
            await sync.mark_stale()
            await sync.sync_weights()
            untouched = await engine.weights()
            # A resume from a checkpoint that holds both names: two tensors of their own.
            model.load_state_dict(
                {k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True
            )
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.25)
            await sync.mark_stale()
            start = time.monotonic()
            error = await _error_of(sync.sync_weights())
            if isinstance(error, BaseException):
                cell.error, cell.seconds = type(error).__name__, time.monotonic() - start
                notes.append(f"“{_short(str(error), 120)}”")
            else:
                cell.error = "none"
            now = await engine.weights()
            kept = set(now) == set(untouched) and all(
                torch.equal(now[n], t) for n, t in untouched.items()
            )
            changed = sorted(n for n, t in untouched.items() if not torch.equal(now.get(n), t))
            notes.append(
                "the engine's weights untouched: "
                + ("yes" if kept else f"**no** ({len(changed)} changed: {', '.join(changed[:2])}…)")
            )
            cell.version_kept = kept and (sync.weight_version, sync.is_stale) == (1, True)
            cell.generate = await engine.generate()
            model.tie_weights()
            if isinstance(engine, HTTPServer):
                await engine.reset()
            await sync.sync_weights()
            cell.heals = not sync.is_stale and await _matches(engine, model)
    return cell


async def run_ties(transports: tuple[str, ...]) -> list[Cell]:
    """The tied cells, one engine of the tied model per transport."""
    async with _engines(transports, TINY_QWEN3_TIED) as engines:
        return [await tie_cell(engines[t], seed=300 + 10 * i) for i, t in enumerate(transports)]


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
        error = (c.error if not c.note else f"{c.error} ({c.note})").replace("|", "\\|")
        lines.append(
            f"| {c.transport} | {c.fault} | {error} | {seconds} | {_yes(c.version_kept)} "
            f"| {c.generate} | {_yes(c.heals)} | {left} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="the IPC column only, no sharded cells"
    )
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    parser.add_argument("--write", type=Path, help="write the Markdown report to this file")
    parser.add_argument(
        "--faults",
        help="only these faults, comma-separated (names as in the table's fault column; "
        "a partial run, not for --write)",
    )
    args = parser.parse_args()
    every = {*FAULTS, *QUARANTINE_FAULTS, RAY_FAULT, *SHARDED_FAULTS, TIE_FAULT}
    faults = None if args.faults is None else frozenset(f.strip() for f in args.faults.split(","))
    if faults is not None and not faults <= every:
        parser.error(f"unknown faults {sorted(faults - every)}; known: {sorted(every)}")
    if faults is not None and args.write is not None:
        parser.error("--write takes the whole matrix: leave --faults out")
    transports = ("ipc",) if args.quick else TRANSPORTS
    machine = Machine(repeats=1)
    start = time.monotonic()
    cells = asyncio.run(run(transports, faults))
    if not args.quick and (faults is None or RAY_FAULT in faults):
        cells.append(asyncio.run(ray_quarantine_cell(seed=290)))
    if not args.quick and (faults is None or faults & set(SHARDED_FAULTS)):
        cells += run_sharded()
    ties = asyncio.run(run_ties(transports)) if faults is None or TIE_FAULT in faults else []
    machine.finish()
    lines, tie_lines = table(cells), table(ties)
    print("\n".join(lines))
    print("\n".join(["", *tie_lines]))
    print(f"\n{len(cells) + len(ties)} cells in {time.monotonic() - start:.0f} s")
    machine.report(statistic="one run")
    if args.write is not None:
        args.write.write_text(_report(lines, tie_lines, machine))
    if args.json:
        print(json.dumps({"cells": [asdict(c) for c in [*cells, *ties]], **machine.fields()}))


_VERIFICATION = """
## Verified refits

Every transport checks what arrived by default, and a mismatch fails the sync like any
other fault (the `corrupted in transit` cells): `RefitVerificationError` naming the worker
(the server), the bucket and its first tensor, the version kept, the engine refusing to
generate, the next sync healing. Each mode means the same on IPC and the collective:
`True` (their default) digests every byte of every bucket (`aiosync/_digest.py`: the
64-bit word sums of each 4 KiB piece of a tensor, odd-weighted by position, modulo 2^64),
certain to catch any change confined to one 64-bit word (a single flipped bit: an exponent
bit that makes a weight 1e37) and bulk faults (a zeroed, stale, shifted or swapped tensor)
unless their weighted sums cancel exactly; the trainer digests each bucket while packing it
(256 KiB at a time, still in cache), an IPC worker each tensor as `load_weights` took it, a
collective worker the bucket after loading it, a GPU as device kernels. `"sample"` digests
(XXH3) the first and last byte of every tensor and 4096 bytes in runs of 8 drawn afresh per
sync and bucket: bulk faults always, a lone flipped byte of an `n`-byte bucket with
probability 4096 / `n` per sync. `False` checks nothing. Either check runs before any worker
commits (the collective: before the vote; with `overlap="staged"` the previous version stays
live). LoRA adapters: a digest per tensor, checked by the embedded
engine's workers before PEFT loads them, and for vLLM and SGLang on the adapter folder
read back before the engine reads it. HTTP (SGLang checks no digest): a read-back through
`/get_weights_by_name` before the version is labelled (`"sample"`: the first rows of at
most 8 tensors per server and sync, the plan's first and last always, the rest rotating
by version; `True`: every tensor whole, as JSON). `verify_engine()` checks the live
weights against the trainer's, moving none (slime's `--check-weight-update-equal`).
The cost of each check per transport is `benchmarks/verify.py`'s table.
"""


def _report(lines: list[str], tie_lines: list[str], machine: Machine) -> str:
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
            "The tied cells (the tiny Qwen3 with `tie_word_embeddings`; see above):",
            "",
            *tie_lines,
            "",
            "Outside this matrix (they kill the whole trainer, or need a GPU), each a test:",
            "a SIGKILLed trainer ends the engine workers' receive within ~0.1 s",
            "(`tests/ipc/test_ipc_faults.py`; on the collective the workers watch trainer",
            "rank 0's store every 0.1 s while they wait in a broadcast: `tests/collective/",
            "test_collective.py`), the SGLang test server it started exits with it",
            "(`tests/http/test_sglang_test_server_parent_death.py`), and the next aiosync process",
            "sweeps the dead trainer's `/dev/shm` segments and socket folders",
            "(`tests/ipc/test_leftovers.py`); `expandable_segments` (C20) waits for a GPU run.",
            'The collective\'s cells run `overlap="inplace"`; with `"staged"` an engine worker',
            "SIGKILLed mid-sync fails it at once, named (trainer rank 0 asks the engine's",
            "health every 0.25 s while it sends: `tests/collective/test_collective_embedded.py`).",
            "",
            *_VERIFICATION.strip().splitlines(),
            "",
        ]
    )


if __name__ == "__main__":
    main()
