"""The conformance kit: one contract, checked on every transport (``docs/capabilities.md``).

A :class:`TransportCase` says how to build one transport's synchronizer on CPU against a
real engine (the embedded engine's worker processes, or the SGLang contract test server
:mod:`aiosync.testing.sglang_server`); the ``check_*`` functions take a case, a started
:class:`KitEngine` and a :class:`KitTrainer` and assert one cell of the contract:

- ``plain``: after a sync every worker holds exactly the trainer's tensors (its
  tensor-parallel slices), the synchronizer is at version 1 and not stale, and the engine
  generates the trainer's greedy tokens under version 1.
- ``verify_true``/``verify_sample``, ``delta``, ``trace``: a declared option is honoured
  (and lands bit-exact); an undeclared one is refused at construction
  (:class:`~aiosync.UnsupportedOptionError`), never silently dropped.
- ``kv_scales``: declared, the scales reach every worker; undeclared, ``sync_weights``
  raises ``NotImplementedError`` (the transport's ``kv_scales_refusal``) before any byte.
- ``verify_engine``: the engine's weights hash as the trainer's, and a trainer that moved
  on is named (:class:`~aiosync.RefitVerificationError`) and makes the synchronizer stale.
- ``cancel``: a sync cancelled mid-stream leaves ``is_stale`` True, the version unchanged,
  and the engine refusing to generate or still serving the previous version exactly; the
  next sync heals it.
- ``killed_worker`` (engines that respawn workers): a worker SIGKILLed mid-sync fails it
  typed, the version unchanged and stale; the respawned engine is healed by the next sync.
- ``bad_manifest``: a source whose manifest names a tensor the engine lacks is refused
  (:class:`~aiosync.RefitMismatchError`) before any byte: the engine keeps its weights.
- ``second_owner``: a second synchronizer on an engine the first owns is refused
  (:class:`~aiosync.OwnershipError`) where it could break the first's sync, and the
  engine's version labels follow whichever owns it (case C27).
- ``elastic`` (where declared): a quarantining fleet sets a killed engine aside, named,
  and commits to the other; revived, it joins with the next sync; one killed while
  serving fails the fleet's generate, named (C29, C36, C40).
- ``in_flight_wait``/``_abort``/``_keep``: a request running through a sync ends as its
  policy says, its tokens and version labels exact, never a silent mix (C13).

Which cells a transport runs follows from its declared
:class:`~aiosync.TransportCapabilities` (:func:`cells`); :func:`capability_table` renders
the same declarations as the docs' table. ``tests/conformance/test_kit.py`` runs the kit.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import torch

from aiosync import (
    OwnershipError,
    RefitMismatchError,
    RefitVerificationError,
    SamplingParams,
    SyncOptions,
    Timeouts,
    TrainCluster,
    TransportError,
    UnsupportedOptionError,
    VersionEventKind,
    create_weight_synchronizer,
)
from aiosync.options import (
    TRANSPORT_OPTIONS,
    CollectiveOptions,
    HTTPOptions,
    IPCOptions,
    SGLangCollectiveOptions,
    ShardedOptions,
    TransportCapabilities,
    TransportOptions,
)
from aiosync.sources import RefitManifest, RefitSource

__all__ = [
    "CAPABILITY_COLUMNS",
    "CASES",
    "CELLS",
    "KitEngine",
    "KitTrainer",
    "TransportCase",
    "capabilities_of",
    "capability_table",
    "cells",
    "declares",
    "run_cell",
]

#: The model every case serves: the tiny Qwen3 of the embedded engine, in bf16 (the
#: trainer's dtype too, so the engine must hold its tensors bit for bit).
DTYPE = "bfloat16"
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9]]
#: Small buckets: every sync moves several of them, so a cancel lands mid-stream.
BUCKET_BYTES = 16 * 1024
#: The scales ``kv_scales`` sends: layer -> scale (both K and V).
KV_SCALES = {0: 0.5, 1: 0.25}
#: The manifest entry ``bad_manifest`` renames (the engine has no tensor of the new name).
RENAMED = ("model.norm.weight", "model.final_norm.weight")
#: The live weight the delta cell corrupts (replicated on tensor-parallel ranks).
CORRUPTED = "model.layers.1.post_attention_layernorm.weight"


def _tiny_config() -> dict[str, Any]:
    from aiosync.engines.embedded.configs import TINY_QWEN3

    return dict(TINY_QWEN3)


def _free_port() -> int:
    """A loopback port nothing holds, drawn below the kernel's ephemeral range: a port
    ``bind(0)`` hands out may go to an outgoing connection before the group binds it."""
    for _ in range(1000):
        port = random.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("no free loopback port in 20000-32767")


# --------------------------------------------------------------------------- trainer


class KitTrainer(RefitSource):
    """A bf16 tiny Qwen3 behind :class:`~aiosync.refit.DTensorRefitSource`.

    ``step(seed)`` changes every 7th element of every parameter (an "optimizer step"
    a delta can compress); ``on_tensor(i)`` runs before the ``i``-th tensor is yielded;
    ``rename`` renames manifest entries (and the tensors yielded).
    """

    def __init__(self, seed: int, *, rename: Mapping[str, str] | None = None) -> None:
        from aiosync.engines.embedded.model import HFModelRunner
        from aiosync.refit import DTensorRefitSource

        self.runner = HFModelRunner.from_config(_tiny_config(), seed=seed, dtype=torch.bfloat16)
        self.model = self.runner.model
        self.inner = DTensorRefitSource(self.model)
        self.rename = dict(rename or {})
        self.on_tensor: Callable[[int], None] | None = None

    def prepare_refit_info(self) -> RefitManifest:
        return {self.rename.get(n, n): spec for n, spec in self.inner.prepare_refit_info().items()}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, tensor) in enumerate(self.inner.iter_weights()):
            if self.on_tensor is not None:
                self.on_tensor(i)
            yield self.rename.get(name, name), tensor

    def hf_config(self) -> Any:
        return self.inner.hf_config()

    def step(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                flat = p.view(-1)
                flat[::7] += (torch.randn(flat[::7].shape, generator=gen) * 0.05).to(p.dtype)

    def state(self) -> dict[str, torch.Tensor]:
        """What the engine must hold after a sync: the source's tensors, copies."""
        return {n: t.clone() for n, t in self.inner.iter_weights()}

    def full_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state().values())

    def generate(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        return self.runner.generate([list(p) for p in prompts], max_new_tokens=n, ignore_eos=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)


def patch_bytes(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the smallest encoding of every changed tensor: what a delta moves."""
    from aiosync.delta import encode_patch

    patches = (encode_patch(n, 0, _bits(old[n]), new[n]) for n in new)
    return sum(p.nbytes for p in patches if p is not None)


def box_patch_bytes(
    plan: Any, old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> int:
    """Bytes a shard-aware delta moves: per transfer of ``plan`` (one box of one tensor),
    nothing when no bit of the box changed, else the smaller of its dense bytes and int32
    indices + values of its changed elements (ties dense)."""
    total = 0
    for t in plan.transfers():
        index = tuple(slice(lo, hi) for lo, hi in t.box)
        before, after = old[t.name][index], new[t.name][index]
        changed = int((_bits(before.contiguous()) != _bits(after.contiguous())).sum())
        if changed:
            size = after.element_size()
            total += min(after.numel() * size, changed * (4 + size))
    return total


# --------------------------------------------------------------------------- engines


class KitEngine:
    """A started engine as the kit reads it: what each worker holds, what it serves."""

    #: What the factory is given (the engine, or a client of the server).
    generation: Any
    kind: str
    #: Workers (tensor-parallel ranks) that hold weights.
    workers: int
    #: What a fleet says of this engine once :meth:`kill` ended it (its quarantine reason).
    death: str = ""

    async def states(self) -> list[dict[str, torch.Tensor]]:
        """Each worker's weights, in checkpoint names (a tensor-parallel rank: its slices)."""
        raise NotImplementedError

    async def expected(self, full: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """What each worker must hold when it holds ``full``."""
        return [dict(full) for _ in range(self.workers)]

    async def kv_scales(self) -> list[dict[str, float]]:
        """The FP8 KV-cache scales each worker loaded, ``{name: value}``."""
        raise NotImplementedError

    async def generate(self, prompts: Sequence[Sequence[int]], n: int) -> list[Any]:
        """Greedy generation: one :class:`~aiosync.Generation` per prompt."""
        await self.generation.prepare_for_generation()
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        return list(await self.generation.generate_with_meta(prompts, params))

    async def holds(self, full: Mapping[str, torch.Tensor]) -> bool:
        """Whether every worker holds ``full`` bit for bit (names and values)."""
        for state, want in zip(await self.states(), await self.expected(full), strict=True):
            if set(state) != set(want):
                return False
            if not all(torch.equal(_bits(state[n]), _bits(t)) for n, t in want.items()):
                return False
        return True

    async def decoded(self) -> int:
        """Tokens the engine's longest running request has generated so far (0: none)."""
        raise NotImplementedError

    def spare(self) -> contextlib.AbstractAsyncContextManager[KitEngine]:
        """A fresh engine of this kind and size (a fleet's second member), closed after."""
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL the engine's workers (a server: its process); blocking, thread-safe."""
        raise NotImplementedError

    async def revive(self, stack: contextlib.AsyncExitStack) -> KitEngine:
        """After :meth:`kill`: an engine to add to the fleet again (the same one with its
        workers respawned, or a fresh one closed by ``stack``)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Close what the kit opened besides the engine."""


class EmbeddedKitEngine(KitEngine):
    """An :class:`~aiosync.engines.embedded.engine.EmbeddedEngine` (worker processes)."""

    kind = "embedded"
    death = "died"

    def __init__(self, engine: Any) -> None:
        self.generation = engine
        self.workers = engine.world_size

    async def states(self) -> list[dict[str, torch.Tensor]]:
        return list(await self.generation.hf_state_dicts())

    async def expected(self, full: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        out = []
        for layout in await self.generation.weight_layouts():
            want = {}
            for name, tensor in full.items():
                part = layout[name] if layout else None
                if part is not None and part.shape:  # a tensor-parallel slice
                    tensor = tensor.narrow(part.dim, part.start, part.length)
                want[name] = tensor
            out.append(want)
        return out

    async def kv_scales(self) -> list[dict[str, float]]:
        return [dict(s["kv_scales"]) for s in await self.generation.status()]

    async def corrupt(self, name: str, tensor: torch.Tensor) -> None:
        """Load ``tensor`` as ``name`` into every worker, behind any transport's back
        (a replicated tensor: every tensor-parallel rank holds it whole)."""
        from aiosync.engines.embedded._worker import tensor_to_wire

        await self.generation.collective_rpc(
            "embedded_load_state_dict", ({name: tensor_to_wire(tensor)},)
        )

    async def decoded(self) -> int:
        return max((await self.generation.status())[0]["requests"], default=0)

    def spare(self) -> contextlib.AbstractAsyncContextManager[KitEngine]:
        return embedded_engine(tensor_parallel_size=self.workers)

    def kill(self) -> None:
        for pid in self.generation.pids:
            os.kill(pid, signal.SIGKILL)

    async def revive(self, stack: contextlib.AsyncExitStack) -> KitEngine:
        with anyio.fail_after(60):  # until the engine saw every worker die
            while any(p.exitcode is None for p in self.generation.processes):
                await anyio.sleep(0.05)
        assert await self.generation.respawn_dead_workers() == list(range(self.workers))
        return self


class ServerKitEngine(KitEngine):
    """A running :mod:`aiosync.testing.sglang_server` and an ``SGLangHTTPBackend`` of it."""

    kind = "sglang"
    death = "ConnectError"

    def __init__(
        self, url: str, tp_size: int, process: subprocess.Popen[bytes] | None = None
    ) -> None:
        import httpx

        from aiosync import SGLangHTTPBackend

        self.url = url
        self.workers = tp_size
        #: The server's process, where the kit started it (:meth:`kill` needs it).
        self.process = process
        self.generation = SGLangHTTPBackend(url)
        self.admin = httpx.AsyncClient(base_url=url, timeout=60.0)

    async def states(self) -> list[dict[str, torch.Tensor]]:
        from safetensors.torch import load as safetensors_load

        out = []
        for rank in range(self.workers):
            response = await self.admin.get("/_aiosync/state_dict", params={"rank": rank})
            response.raise_for_status()
            out.append(safetensors_load(response.content))
        return out

    async def kv_scales(self) -> list[dict[str, float]]:
        response = await self.admin.get("/_aiosync/kv_scales")
        response.raise_for_status()
        return [dict(rank) for rank in response.json()]

    async def reset(self) -> None:
        """Clear the server's faults and request log (``/_aiosync/reset``)."""
        (await self.admin.post("/_aiosync/reset")).raise_for_status()

    async def decoded(self) -> int:
        load = (await self.admin.get("/_aiosync/load")).json()
        return int(load["generated_tokens"]) if load["running"] + load["waiting"] else 0

    @contextlib.asynccontextmanager
    async def spare(self) -> AsyncIterator[KitEngine]:
        with _test_server(tp_size=self.workers) as (url, process):
            server = ServerKitEngine(url, self.workers, process)
            try:
                yield server
            finally:
                await server.aclose()

    def kill(self) -> None:
        assert self.process is not None, "the kit did not start this server"
        self.process.kill()
        self.process.wait()

    async def revive(self, stack: contextlib.AsyncExitStack) -> KitEngine:
        """A server killed is gone: a fresh one (another URL)."""
        return await stack.enter_async_context(self.spare())

    async def aclose(self) -> None:
        await self.generation.aclose()
        await self.admin.aclose()


@contextlib.asynccontextmanager
async def embedded_engine(*, tensor_parallel_size: int = 1) -> AsyncIterator[EmbeddedKitEngine]:
    """An embedded engine of the tiny Qwen3 (bf16, seed 3): one worker, or one replica
    of ``tensor_parallel_size`` ranks."""
    from aiosync.engines.embedded.engine import EmbeddedEngine

    async with EmbeddedEngine(
        _tiny_config(),
        num_workers=1,  # replicas
        tensor_parallel_size=tensor_parallel_size,
        dtype=DTYPE,
        seed=3,
        rpc_timeout_s=120,
    ) as engine:
        yield EmbeddedKitEngine(engine)


@contextlib.contextmanager
def sglang_test_server(*, tp_size: int = 1, start_timeout_s: float = 300.0) -> Iterator[str]:
    """``python -m aiosync.testing.sglang_server`` on the tiny Qwen3 (bf16, seed 3, gloo on
    loopback for SGLang's weight-update group); yields its URL, stops it after."""
    with _test_server(tp_size=tp_size, start_timeout_s=start_timeout_s) as (url, _):
        yield url


@contextlib.contextmanager
def _test_server(
    *, tp_size: int = 1, start_timeout_s: float = 300.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """:func:`sglang_test_server`, its process too."""
    with tempfile.TemporaryDirectory(prefix="aiosync-kit-") as folder:
        config = Path(folder) / "config.json"
        config.write_text(json.dumps(_tiny_config()))
        port_file = Path(folder) / "port"
        argv = [sys.executable, "-m", "aiosync.testing.sglang_server", "--port", "0"]
        argv += ["--port-file", str(port_file), "--model-config", str(config)]
        argv += ["--seed", "3", "--dtype", DTYPE, "--tp-size", str(tp_size)]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not port_file.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"the test server exited with {proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError("the test server did not start in time")
                time.sleep(0.1)
            yield f"http://127.0.0.1:{int(port_file.read_text())}", proc
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class TransportCase:
    """How the kit builds one transport on CPU.

    Attributes:
        name: the case's id (a test id).
        options: the transport's options class (it names the synchronizer class).
        engine: which kit engine it drives: ``"embedded"`` (one worker),
            ``"embedded_tp2"`` (one replica of two tensor-parallel ranks), ``"server"``
            (the SGLang contract test server).
        colocated: the topology the factory is told.
        defaults: the options every build starts from (keywords of ``options``).
    """

    name: str
    options: type[TransportOptions]
    engine: str
    colocated: bool
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def capabilities(self) -> TransportCapabilities:
        return capabilities_of(self.options)

    def build(
        self, source: RefitSource, engine: KitEngine, *, sync: SyncOptions | None = None
    ) -> Any:
        """The synchronizer, through :func:`aiosync.create_weight_synchronizer`."""
        topology: dict[str, Any] = {}
        if not self.colocated:
            topology = {
                "train_cluster": TrainCluster(master_addr="127.0.0.1", master_port=_free_port()),
                "inference_world_size": engine.workers,
            }
        return create_weight_synchronizer(
            source,
            engine.generation,
            colocated=self.colocated,
            backend=engine.kind,
            transport=self.options(**self.defaults),
            sync=sync,
            timeouts=Timeouts(rpc_s=30.0, collective_s=20.0, sync_s=120.0),
            **topology,
        )


def capabilities_of(options: type[TransportOptions]) -> TransportCapabilities:
    """The ``capabilities`` declared by the synchronizer class ``options`` names."""
    module, name = options.transport
    declared = getattr(importlib.import_module(module), name).capabilities
    assert isinstance(declared, TransportCapabilities)
    return declared


#: The transports the kit runs on CPU (LoRA's adapter-only refit has its own suite,
#: ``tests/lora``: it needs an adapter source and engines started with LoRA).
CASES: tuple[TransportCase, ...] = (
    TransportCase("ipc", IPCOptions, "embedded", True, {"bucket_bytes": BUCKET_BYTES}),
    TransportCase(
        "collective",
        CollectiveOptions,
        "embedded",
        False,
        {"dist_backend": "gloo", "bucket_bytes": BUCKET_BYTES},
    ),
    TransportCase(
        "sharded",
        ShardedOptions,
        "embedded_tp2",
        False,
        {"dist_backend": "gloo", "bucket_bytes": BUCKET_BYTES},
    ),
    TransportCase("http", HTTPOptions, "server", True, {"bucket_bytes": BUCKET_BYTES}),
    TransportCase(
        "sglang_collective",
        SGLangCollectiveOptions,
        "server",
        False,
        {"dist_backend": "gloo", "bucket_bytes": BUCKET_BYTES},
    ),
)

#: The kit's cells, in order; each is a ``check_*`` of this module.
CELLS: tuple[str, ...] = (
    "plain",
    "verify_true",
    "verify_sample",
    "bad_verify",
    "delta",
    "kv_scales",
    "trace",
    "verify_engine",
    "cancel",
    "killed_worker",
    "bad_manifest",
    "second_owner",
    "elastic",
    "in_flight_wait",
    "in_flight_abort",
    "in_flight_keep",
)


def declares(capabilities: TransportCapabilities, cell: str) -> bool:
    """Whether ``cell`` is a capability the transport declares (else the kit checks
    the typed refusal); ``plain``, ``cancel`` and ``bad_manifest`` every transport owes."""
    if cell == "verify_true":
        return True in capabilities.verify
    if cell == "verify_sample":
        return "sample" in capabilities.verify
    if cell in ("delta", "kv_scales", "trace", "verify_engine", "elastic"):
        return bool(getattr(capabilities, cell))
    return True


#: Cells that need an engine able to respawn a killed worker (the embedded engine): a
#: killed SGLang server is gone for the cells after it.
RESPAWNING = frozenset({"killed_worker"})
#: Cells run only where declared: an undeclared one has no typed refusal to check (the
#: synchronizer refuses ``EngineFleet(refit="rolling")`` on a transport without
#: ``elastic``, not a quarantining fleet).
DECLARED_ONLY = frozenset({"elastic"})


def cells() -> list[tuple[str, str]]:
    """Every ``(case, cell)`` the kit runs: the parametrization of ``test_kit.py``."""
    return [
        (case.name, cell)
        for case in CASES
        for cell in CELLS
        if (cell not in RESPAWNING or case.engine != "server")
        and (cell not in DECLARED_ONLY or declares(case.capabilities, cell))
    ]


# --------------------------------------------------------------------------- checks


async def _sync(sync: Any) -> None:
    await sync.mark_stale()
    await sync.sync_weights()


async def _assert_serves(engine: KitEngine, trainer: KitTrainer, version: int) -> None:
    """The engine generates the trainer's greedy tokens, every token under ``version``."""
    generations = await engine.generate(PROMPTS, 4)
    assert [list(g.token_ids) for g in generations] == trainer.generate(PROMPTS, 4)
    assert {(g.first_version, g.last_version) for g in generations} == {(version, version)}


async def check_plain(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """Two syncs: each leaves every worker holding exactly the trainer's tensors, the
    synchronizer at the next version and not stale, the engine serving it."""
    async with case.build(trainer, engine) as sync:
        assert sync.weight_version == 0
        for version in (1, 2):
            if version == 2:
                trainer.step(seed=version)
            await _sync(sync)
            assert (sync.weight_version, sync.policy_version, sync.is_stale) == (
                version,
                version,
                False,
            )
            assert await engine.holds(trainer.state())
        await _assert_serves(engine, trainer, 2)


async def _check_option(
    case: TransportCase, engine: KitEngine, trainer: KitTrainer, options: SyncOptions
) -> None:
    """Declared: a sync with ``options`` lands bit-exact. Undeclared: refused at build."""
    name, value = next(iter(options.given().items()))
    refusal = case.capabilities.refusal(name, value)
    if refusal is not None:
        try:
            case.build(trainer, engine, sync=options)
        except UnsupportedOptionError as error:
            assert refusal in str(error), (refusal, str(error))
            return
        raise AssertionError(f"{case.name} built with undeclared {name}={value!r}")
    async with case.build(trainer, engine, sync=options) as sync:
        await _sync(sync)
        assert (sync.weight_version, sync.is_stale) == (1, False)
        assert getattr(sync, name) == value
        assert await engine.holds(trainer.state())


async def check_verify_true(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    await _check_option(case, engine, trainer, SyncOptions(verify=True))


async def check_verify_sample(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    await _check_option(case, engine, trainer, SyncOptions(verify="sample"))


async def check_bad_verify(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """A ``verify=`` that is neither True, False nor "sample", given to the transport's
    constructor: ``ValueError`` before anything is built. A transport that declares no
    check (``verify`` is ``{False}``) takes no ``verify=`` and refuses ``verify=True``."""
    if case.capabilities.verify == frozenset({False}):
        await _check_option(case, engine, trainer, SyncOptions(verify=True))
        return
    module, name = case.options.transport
    cls = getattr(importlib.import_module(module), name)
    topology: dict[str, Any] = {}
    if not case.colocated:
        topology = {"train_cluster": TrainCluster(), "inference_world_size": engine.workers}
    for bad in ("full", "off", "Sample", 1, 0, None):
        try:
            cls(trainer, engine.generation, verify=bad, **topology)
        except ValueError as error:
            assert str(error) == f"verify must be True, False or 'sample', got {bad!r}"
        else:
            raise AssertionError(f"{name} took verify={bad!r}")


async def check_trace(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """Declared: a traced sync records ``last_trace`` (None before). Else refused."""
    options = SyncOptions(trace=True)
    if not case.capabilities.trace:
        await _check_option(case, engine, trainer, options)
        return
    async with case.build(trainer, engine, sync=options) as sync:
        assert sync.last_trace is None
        await _sync(sync)
        assert isinstance(sync.last_trace, dict) and sync.last_trace
        assert await engine.holds(trainer.state())


async def check_delta(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """Declared: the first sync is full, the next move exactly the changed bits' patches
    (per box on a shard-aware plan), an unchanged trainer moves 0 bytes, and every worker
    ends bit-identical. Undeclared: refused at build."""
    options = SyncOptions(delta=True)
    if not case.capabilities.delta:
        await _check_option(case, engine, trainer, options)
        return
    full = trainer.full_bytes()
    async with case.build(trainer, engine, sync=options) as sync, sync.subscribe() as events:

        async def committed() -> tuple[bool, int]:
            await _sync(sync)
            async for event in events:
                if event.kind is VersionEventKind.COMMITTED:
                    return event.delta, event.nbytes
            raise AssertionError("no COMMITTED event")

        plan = getattr(sync, "transfer_plan", None)
        if plan is not None:  # shard-aware: every receiver's slices (replicated ones each)
            full = sum(plan.receiver_nbytes)
        assert await committed() == (False, full)  # no baseline yet
        for seed in (1, 2):
            before = trainer.state()
            trainer.step(seed)
            after = trainer.state()
            want = box_patch_bytes(plan, before, after) if plan else patch_bytes(before, after)
            assert await committed() == (True, want)
            assert 0 < want < full
            assert await engine.holds(after)
        assert await committed() == (True, 0)  # nothing changed: the version still moves
        assert sync.weight_version == 4
        await _assert_serves(engine, trainer, 4)
        if not isinstance(engine, EmbeddedKitEngine):
            return
        # A live weight written behind the transport's back: verify_engine() names it and
        # makes the synchronizer stale; the next sync is full and heals every worker, the
        # one after it a delta again.
        await engine.corrupt(CORRUPTED, trainer.state()[CORRUPTED] * 3)
        try:
            await sync.verify_engine()
        except RefitVerificationError as error:
            assert CORRUPTED in str(error), str(error)
        else:
            raise AssertionError("verify_engine() missed a corrupted live weight")
        assert (sync.is_stale, sync.weight_version) == (True, 4)
        trainer.step(seed=3)
        assert await committed() == (False, full)
        assert await engine.holds(trainer.state())
        await sync.verify_engine()
        trainer.step(seed=4)
        assert (await committed())[0] is True
        assert await engine.holds(trainer.state())


async def check_kv_scales(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """Declared: the scales reach every worker with the weights. Undeclared:
    ``NotImplementedError`` (the transport's ``kv_scales_refusal``) before any byte."""
    async with case.build(trainer, engine) as sync:
        if not case.capabilities.kv_scales:
            before = await engine.states()
            await sync.mark_stale()
            try:
                await sync.sync_weights(kv_scales=KV_SCALES)
            except NotImplementedError as error:
                assert str(error) == type(sync).kv_scales_refusal
            else:
                raise AssertionError(f"{case.name} took kv_scales it does not declare")
            assert (sync.weight_version, sync.is_stale) == (0, True)
            after = await engine.states()
            assert all(
                torch.equal(a[n], b[n]) for a, b in zip(before, after, strict=True) for n in a
            )
            return
        await sync.mark_stale()
        await sync.sync_weights(kv_scales=KV_SCALES)
        assert (sync.weight_version, sync.is_stale) == (1, False)
        want = {
            f"model.layers.{layer}.self_attn.{kv}_scale": value
            for layer, value in KV_SCALES.items()
            for kv in "kv"
        }
        assert await engine.kv_scales() == [want] * engine.workers
        assert await engine.holds(trainer.state())
        # A scale named in full travels alone; a layer without attention is refused
        # before anything moves (the manifest has 2 layers).
        await sync.mark_stale()
        await sync.sync_weights(kv_scales={"model.layers.1.self_attn.v_scale": 0.125})
        want["model.layers.1.self_attn.v_scale"] = 0.125
        assert await engine.kv_scales() == [want] * engine.workers
        await sync.mark_stale()
        try:
            await sync.sync_weights(kv_scales={7: 1.0})
        except ValueError as error:
            assert "layer index 7 is not an attention layer" in str(error), str(error)
        else:
            raise AssertionError("a scale of layer 7 was taken")
        assert (sync.weight_version, sync.policy_version, sync.is_stale) == (2, 3, True)
        assert await engine.kv_scales() == [want] * engine.workers


async def check_verify_engine(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """Declared: after a sync ``verify_engine()`` counts every worker and tensor at the
    version; once the trainer moved on unsynced, it raises ``RefitVerificationError``
    naming a tensor and the synchronizer is stale. Undeclared: ``NotImplementedError``."""
    async with case.build(trainer, engine) as sync:
        await _sync(sync)
        if not case.capabilities.verify_engine:
            try:
                await sync.verify_engine()
            except (NotImplementedError, TypeError):
                return
            raise AssertionError(f"{case.name} verified an engine it does not declare to")
        report = await sync.verify_engine()
        assert (report["workers"], report["version"]) == (engine.workers, 1)
        assert report["tensors"] > 0
        trainer.step(seed=5)
        try:
            await sync.verify_engine()
        except RefitVerificationError as error:
            first = next(iter(trainer.prepare_refit_info()))  # the step changed every tensor
            assert repr(first) in str(error) or f" {first} " in str(error), str(error)
        else:
            raise AssertionError("verify_engine() missed a trainer that moved on")
        assert (sync.is_stale, sync.weight_version) == (True, 1)
        await sync.sync_weights()
        assert await engine.holds(trainer.state())
        healed = await sync.verify_engine()
        # The re-sync rewrites the same policy version: nothing new was published.
        assert (healed["version"], sync.weight_version, sync.is_stale) == (1, 1, False)


def _cancel_at(scope: anyio.CancelScope, at: int) -> Callable[[int], None]:
    def hook(i: int) -> None:
        if i != at:
            return
        try:
            anyio.from_thread.run_sync(scope.cancel)  # the source runs in a worker thread
        except RuntimeError:
            scope.cancel()  # the source runs on the event loop

    return hook


async def _assert_refuses_or_serves(
    engine: KitEngine, before: Mapping[str, torch.Tensor], version: int, trainer: Any
) -> None:
    """The engine refuses to generate, or serves ``version`` holding ``before`` exactly."""
    from aiosync import SyncError

    try:
        generations = await engine.generate(PROMPTS, 2)
    except SyncError:
        return
    assert {g.last_version for g in generations} == {version}
    assert await engine.holds(before)
    del trainer


async def check_cancel(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """A sync cancelled while the source yields its 6th tensor (buckets already moved):
    the cancellation propagates, ``is_stale`` stays True and the version at 1, the
    engine refuses to generate or serves version 1 exactly; the next sync heals it."""
    async with case.build(trainer, engine) as sync:
        await _sync(sync)
        v1 = trainer.state()
        trainer.step(seed=7)
        await sync.mark_stale()
        with anyio.CancelScope() as scope:
            trainer.on_tensor = _cancel_at(scope, 6)
            await sync.sync_weights()
        trainer.on_tensor = None
        assert scope.cancelled_caught
        assert (sync.weight_version, sync.policy_version, sync.is_stale) == (1, 2, True)
        await _assert_refuses_or_serves(engine, v1, 1, trainer)
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert await engine.holds(trainer.state())
        await _assert_serves(engine, trainer, 2)


async def check_killed_worker(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """An engine worker SIGKILLed while the source yields its 6th tensor: the sync fails
    typed (:class:`~aiosync.TransportError`), ``is_stale`` stays True and the version at
    1; once the engine respawned it, a re-initialized synchronizer heals every worker and
    the engine serves the new version. (Engines that respawn workers: the embedded one.)"""
    assert isinstance(engine, EmbeddedKitEngine)
    async with case.build(trainer, engine) as sync:
        await _sync(sync)
        victim = engine.workers - 1
        pid = engine.generation.pids[victim]

        def kill(i: int) -> None:
            if i == 6:
                os.kill(pid, signal.SIGKILL)

        trainer.step(seed=9)
        await sync.mark_stale()
        trainer.on_tensor = kill
        try:
            await sync.sync_weights()
        except TransportError:
            pass
        else:
            raise AssertionError(f"{case.name} committed a sync its worker died in")
        finally:
            trainer.on_tensor = None
        assert (sync.weight_version, sync.policy_version, sync.is_stale) == (1, 2, True)
        # The dead worker's replica comes back whole (the kit's engines have one).
        assert await engine.generation.respawn_dead_workers() == list(range(engine.workers))
        await sync.init_communicator()
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert await engine.holds(trainer.state())
        await _assert_serves(engine, trainer, 2)


async def check_bad_manifest(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """A manifest naming a tensor the engine lacks: ``RefitMismatchError`` naming it,
    version 0, and the engine's weights untouched."""
    before = await engine.states()
    trainer.rename = dict([RENAMED])
    sync = case.build(trainer, engine)
    try:
        async with sync:
            await _sync(sync)
    except RefitMismatchError as error:
        # Named both ways: the engine lacks the new name, the trainer the old one.
        assert RENAMED[1] in str(error) and RENAMED[0] in str(error), str(error)
    else:
        raise AssertionError(f"{case.name} synced a manifest the engine does not match")
    finally:
        trainer.rename = {}
    assert sync.weight_version == 0
    after = await engine.states()
    assert all(torch.equal(a[n], b[n]) for a, b in zip(before, after, strict=True) for n in a)


async def check_second_owner(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """A second synchronizer of another trainer (a restarted one, versions from 0) on an
    engine the first owns (case C27): never both commit, and the engine's version labels
    follow the synchronizer that owns it.

    A transport that holds a sync group on the workers (the non-colocated ones) refuses
    the second at init (:class:`~aiosync.OwnershipError`, "another synchronizer") while
    the first lives, and the first keeps syncing undisturbed; once the first shut down,
    the second takes the engine over. One that holds nothing between syncs (colocated)
    lets the second commit: the first turns stale, its next sync is refused naming the
    second's owner token and version before any byte moves, and its
    ``init_communicator()`` takes the engine over again (the second is refused then)."""
    other = KitTrainer(seed=77)
    async with case.build(trainer, engine) as first:
        await _sync(first)
        second = case.build(other, engine)
        if not case.colocated:
            try:
                async with second:
                    raise AssertionError(f"{case.name} let a second synchronizer in")
            except OwnershipError as error:
                # The holder named: the workers' group ("another synchronizer"), or
                # SGLang's weight-update group ("for a live trainer").
                assert re.search("another synchronizer|for a live trainer", str(error)), error
            assert second.weight_version == 0
            trainer.step(seed=2)
            await _sync(first)
            assert (first.weight_version, first.is_stale) == (2, False)
            assert await engine.holds(trainer.state())
            await _assert_serves(engine, trainer, 2)
        else:
            async with second:
                assert (second.weight_version, second.is_stale) == (0, True)
                await _sync(second)
                assert (second.weight_version, second.is_stale) == (1, False)
                assert await engine.holds(other.state())
                await _assert_serves(engine, other, 1)
                assert (first.weight_version, first.is_stale) == (1, True)
                trainer.step(seed=2)
                await first.mark_stale()
                try:
                    await first.sync_weights()
                except OwnershipError as error:
                    want = f"owner {second.owner}) committed its version 1"
                    assert want in str(error), str(error)
                else:
                    raise AssertionError(f"{case.name} synced over another's commit")
                assert (first.weight_version, first.is_stale) == (1, True)
                assert await engine.holds(other.state())  # refused before any byte
                await first.init_communicator()  # the explicit take-over
                await first.sync_weights()
                assert (first.weight_version, first.is_stale) == (2, False)
                assert await engine.holds(trainer.state())
                await _assert_serves(engine, trainer, 2)
                assert second.is_stale
                try:
                    await second.sync_weights()
                except OwnershipError as error:
                    assert "no longer owns its engine" in str(error), str(error)
                else:
                    raise AssertionError(f"{case.name} synced over another's commit")
            return
    # The first is gone (shut down): the second takes its engine over.
    async with case.build(other, engine) as second:
        await _sync(second)
        assert (second.weight_version, second.is_stale) == (1, False)
        assert await engine.holds(other.state())
        await _assert_serves(engine, other, 1)


class FleetKitEngine(KitEngine):
    """Kit engines behind one :class:`~aiosync.EngineFleet` (``fleet_options``)."""

    def __init__(self, members: Sequence[KitEngine], **fleet_options: Any) -> None:
        from aiosync import EngineFleet

        self.members = list(members)
        self.generation = EngineFleet([m.generation for m in members], **fleet_options)
        self.kind = members[0].kind
        self.workers = sum(m.workers for m in members)

    def label(self, member: KitEngine) -> str:
        """How the fleet names ``member`` (events, errors, ``quarantined``)."""
        everyone = self.generation.members
        index = next(i for i, e in enumerate(everyone) if e is member.generation)
        return f"engine {index} of {len(everyone)} ({type(member.generation).__name__})"


async def _events_until(
    events: Any, kind: VersionEventKind, version: int
) -> list[tuple[VersionEventKind, int, str | None]]:
    """The events up to the first ``kind`` of ``version``: ``(kind, version, engine)``."""
    seen = []
    with anyio.fail_after(60):
        async for event in events:
            seen.append((event.kind, event.version, event.engine))
            if (event.kind, event.version) == (kind, version):
                return seen
    raise AssertionError(f"the events ended before {kind} {version}: {seen}")


def _once_at(index: int, call: Callable[[], None]) -> Callable[[int], None]:
    """A source hook: ``call()`` at the ``index``-th tensor, once (a quarantine's
    second round iterates the source again)."""
    done: list[bool] = []

    def hook(i: int) -> None:
        if i == index and not done:
            done.append(True)
            call()

    return hook


async def _committed_without(
    dead: Mapping[str, KitEngine],
    version: int,
    sync: Any,
    fleet: FleetKitEngine,
    engine: KitEngine,
    trainer: KitTrainer,
    events: Any,
) -> None:
    """``version`` committed on ``engine`` alone: the fleet set ``dead`` aside (by label,
    each reason saying how it died; an ``ENGINE_QUARANTINED`` event of ``version`` for
    the last), ``engine`` holds the trainer's tensors and the fleet serves them."""
    members = fleet.generation
    assert (sync.weight_version, sync.is_stale) == (version, False)
    assert list(members.quarantined) == list(dead)
    for label, member in dead.items():
        assert member.death in members.quarantined[label], members.quarantined
    assert members.serving == [engine.generation]
    seen = await _events_until(events, VersionEventKind.COMMITTED, version)
    assert (VersionEventKind.ENGINE_QUARANTINED, version, list(dead)[-1]) in seen
    assert await engine.holds(trainer.state())
    await _assert_serves(fleet, trainer, version)


async def check_elastic(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """Declared (``elastic``): the kit's engine and a spare behind
    ``EngineFleet(on_engine_failure="quarantine")`` (cases C29, C36, C40).

    The spare (engine 0: the survivor's ranks move) killed mid-sync is set aside,
    named (``ENGINE_QUARANTINED``), and the same ``sync_weights()`` commits version 2
    on the other: bit-exact, served. Revived (its workers respawned: it leaves the
    quarantine; or a fresh server) and added, it joins with the next sync
    (``COMMITTED`` then ``ENGINE_JOINED``) and serves only once that committed. Killed
    while serving, it fails the fleet's generate, named (:class:`~aiosync.TransportError`);
    between syncs it fails the pause and is set aside likewise: version 4 commits on the
    other, which the fleet serves at once; reviving it changes nothing served."""
    async with contextlib.AsyncExitStack() as stack:
        spare = await stack.enter_async_context(engine.spare())
        fleet = FleetKitEngine([spare, engine], on_engine_failure="quarantine")
        members = fleet.generation
        victim = fleet.label(spare)
        sync = await stack.enter_async_context(case.build(trainer, fleet))
        events = await stack.enter_async_context(sync.subscribe())
        await _sync(sync)
        assert [await e.holds(trainer.state()) for e in (engine, spare)] == [True, True]

        trainer.step(seed=11)
        trainer.on_tensor = _once_at(6, spare.kill)
        try:
            await _sync(sync)  # commits on the kit's engine
        finally:
            trainer.on_tensor = None
        await _committed_without({victim: spare}, 2, sync, fleet, engine, trainer, events)

        joiner = await spare.revive(stack)
        members.add_engine(joiner.generation)
        assert members.serving == [engine.generation]  # joining: no generate calls yet
        joined = fleet.label(joiner)
        trainer.step(seed=12)
        await _sync(sync)
        assert (sync.weight_version, sync.is_stale) == (3, False)
        assert {id(e) for e in members.serving} == {id(engine.generation), id(joiner.generation)}
        # A fresh server joined: the killed one stays set aside, named anew (the fleet grew).
        gone = {} if joiner is spare else {fleet.label(spare): spare}
        assert list(members.quarantined) == list(gone)
        seen = await _events_until(events, VersionEventKind.ENGINE_JOINED, 3)
        assert seen[-2:] == [
            (VersionEventKind.COMMITTED, 3, None),
            (VersionEventKind.ENGINE_JOINED, 3, joined),
        ]
        assert [await e.holds(trainer.state()) for e in (engine, joiner)] == [True, True]
        await _assert_serves(fleet, trainer, 3)

        # Dead while serving (C40): the fleet's generate fails naming it; the next
        # sync's pause fails on it and it is set aside before any byte.
        failures: list[BaseException] = []

        async def serve() -> None:
            try:
                await fleet.generate([LONG_PROMPT] * 2, LONG)  # one request per engine
            except TransportError as error:
                failures.append(error)

        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            with anyio.fail_after(120):
                while await joiner.decoded() < STARTED:
                    await anyio.sleep(0.005)
            joiner.kill()
        (failure,) = failures
        assert str(failure).startswith(f"{joined}: "), failure
        trainer.step(seed=13)
        await _sync(sync)
        dead = {**gone, joined: joiner}
        await _committed_without(dead, 4, sync, fleet, engine, trainer, events)
        # Reviving the set-aside engine changes nothing the fleet serves.
        await joiner.revive(stack)  # (and leaves the spare whole for its close)
        assert (sync.weight_version, sync.is_stale) == (4, False)


#: The in-flight cells' request: its prompt and length (tokens; long enough that the
#: sync lands while it runs), and how many tokens it has when the sync starts.
LONG_PROMPT = [3, 1, 4, 1, 5]
LONG = 400
STARTED = 30


async def _sync_during_request(
    case: TransportCase, engine: KitEngine, trainer: KitTrainer, policy: str
) -> tuple[Any, list[int], Any]:
    """Version 1 synced; a LONG greedy request, and once it has STARTED tokens version
    2 synced with ``in_flight=policy``; then the engine serves version 2. Returns the
    request's result, what version 1 alone computes for it, and the ``COMMITTED``
    event of version 2 (``SYNC_STARTED`` of it just before)."""
    async with case.build(trainer, engine) as sync, sync.subscribe() as events:
        await _sync(sync)
        # One token more than the request: its first LONG are what version 1 computes
        # for it, and an answer cache (the SGLang server's) cannot serve the request.
        (alone,) = await engine.generate([LONG_PROMPT], LONG + 1)
        assert (alone.first_version, alone.last_version, alone.aborted) == (1, 1, False)
        assert alone.token_ids[:4] == trainer.generate([LONG_PROMPT], 4)[0]
        trainer.step(seed=14)
        await sync.mark_stale()
        results: list[Any] = []

        async def request() -> None:
            results.extend(await engine.generate([LONG_PROMPT], LONG))

        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            with anyio.fail_after(120):
                while await engine.decoded() < STARTED:
                    await anyio.sleep(0.005)
            await sync.sync_weights(in_flight=policy)
        assert (sync.weight_version, sync.is_stale) == (2, False)
        seen = []
        with anyio.fail_after(60):
            async for event in events:
                seen.append(event)
                if (event.kind, event.version) == (VersionEventKind.COMMITTED, 2):
                    break
        assert (seen[-2].kind, seen[-2].version) == (VersionEventKind.SYNC_STARTED, 2)
        await _assert_serves(engine, trainer, 2)
    (result,) = results
    return result, list(alone.token_ids[:LONG]), seen[-1]


async def check_in_flight_wait(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """``in_flight="wait"`` (case C13): the running request finishes on version 1, every
    token what version 1 alone computes, before a byte moves (the pause lasts within the
    sync, not zero); then version 2 commits and serves."""
    result, alone, committed = await _sync_during_request(case, engine, trainer, "wait")
    assert list(result.token_ids) == alone
    assert (result.aborted, result.first_version, result.last_version) == (False, 1, 1)
    assert (result.version_change_at, result.spans_versions) == (None, False)
    assert 0.0 < committed.pause_s <= committed.duration_s


async def check_in_flight_abort(
    case: TransportCase, engine: KitEngine, trainer: KitTrainer
) -> None:
    """``in_flight="abort"`` (case C13): the running request ends aborted (finish reason
    ``"abort"``) with a prefix of version 1's output, every token labelled version 1;
    version 2 commits and serves."""
    result, alone, _ = await _sync_during_request(case, engine, trainer, "abort")
    k = len(result.token_ids)
    assert (result.aborted, result.finish_reason) == (True, "abort")
    assert STARTED <= k < LONG
    assert list(result.token_ids) == alone[:k]
    assert (result.first_version, result.last_version, result.spans_versions) == (1, 1, False)


async def check_in_flight_keep(case: TransportCase, engine: KitEngine, trainer: KitTrainer) -> None:
    """``in_flight="keep"`` (case C13): the running request lives through the refit and
    says so: tokens ``[0, k)`` are version 1's output, labelled 1, the rest computed by
    version 2 (``first_version`` 1, ``last_version`` 2, ``version_change_at`` k); never
    a silent mix. (Where the rest comes from, the old prefix's KV cache or a recompute,
    is the engine's: its own tests compare it with transformers.)"""
    result, alone, _ = await _sync_during_request(case, engine, trainer, "keep")
    k = result.version_change_at
    assert k is not None and STARTED <= k < LONG, k
    assert (result.aborted, result.finish_reason, len(result.token_ids)) == (False, "length", LONG)
    assert (result.first_version, result.last_version, result.spans_versions) == (1, 2, True)
    assert list(result.token_ids[:k]) == alone[:k]
    assert list(result.token_ids[k:]) != alone[k:]


_CHECKS: dict[str, Callable[[TransportCase, KitEngine, KitTrainer], Any]] = {
    "plain": check_plain,
    "verify_true": check_verify_true,
    "verify_sample": check_verify_sample,
    "bad_verify": check_bad_verify,
    "delta": check_delta,
    "kv_scales": check_kv_scales,
    "trace": check_trace,
    "verify_engine": check_verify_engine,
    "cancel": check_cancel,
    "killed_worker": check_killed_worker,
    "bad_manifest": check_bad_manifest,
    "second_owner": check_second_owner,
    "elastic": check_elastic,
    "in_flight_wait": check_in_flight_wait,
    "in_flight_abort": check_in_flight_abort,
    "in_flight_keep": check_in_flight_keep,
}


async def run_cell(case: TransportCase, cell: str, engine: KitEngine, *, seed: int) -> None:
    """Run one cell of the kit against a started engine, with a fresh trainer (``seed``
    differs from the engine's, so every sync changes every tensor)."""
    trainer = KitTrainer(seed)
    await _CHECKS[cell](case, engine, trainer)


# --------------------------------------------------------------------------- table

#: The docs' columns: (header, what a cell says).
CAPABILITY_COLUMNS: tuple[tuple[str, Callable[[TransportCapabilities], str]], ...] = (
    ("verify", lambda c: ", ".join(repr(m) for m in (False, "sample", True) if m in c.verify)),
    ("delta", lambda c: _yes(c.delta)),
    ("kv_scales", lambda c: _yes(c.kv_scales)),
    ("trace", lambda c: _yes(c.trace)),
    ("elastic", lambda c: _yes(c.elastic)),
    ("sharded_trainer", lambda c: _yes(c.sharded_trainer)),
    ("verify_engine", lambda c: _yes(c.verify_engine)),
)


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def capability_table() -> str:
    """The docs' capability table (markdown), generated from each transport's declared
    :class:`~aiosync.TransportCapabilities`; the last column names the kit's case."""
    kit = {case.options: case.name for case in CASES}
    header = ["transport (options)", *(name for name, _ in CAPABILITY_COLUMNS), "kit case"]
    rows = [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]
    for options in TRANSPORT_OPTIONS:
        caps = capabilities_of(options)
        name = f"`{options.transport[1]}` (`{options.__name__}`)"
        cells_ = [render(caps) for _, render in CAPABILITY_COLUMNS]
        rows.append("| " + " | ".join([name, *cells_, kit.get(options, "-")]) + " |")
    return "\n".join(rows) + "\n"
