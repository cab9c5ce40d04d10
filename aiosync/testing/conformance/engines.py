"""The kit's engines: what a started engine holds and serves, as the cells read it.

:class:`KitEngine` is the interface; :class:`EmbeddedKitEngine` the embedded engine's
worker processes (:func:`embedded_engine`), :class:`LoRAKitEngine` one serving a LoRA
adapter (:func:`lora_engine`), :class:`ServerKitEngine` the SGLang contract test server
(:func:`sglang_test_server`), :class:`FleetKitEngine` several behind an
:class:`~aiosync.EngineFleet`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from aiosync import SamplingParams
from aiosync.engines.sglang.contract_server import stop_server

from .trainers import DTYPE, ENGINE_SEED, LORA_DTYPE, _bits, _tiny_config


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
        seed=ENGINE_SEED,
        rpc_timeout_s=120,
    ) as engine:
        yield EmbeddedKitEngine(engine)


class LoRAKitEngine(EmbeddedKitEngine):
    """An embedded engine (fp32) serving the LoRA case: what each worker holds is the
    adapter it applies (``embedded_lora_state_dict``, PEFT's saved names; nothing before
    the first sync), and holding an adapter means its base weights are the engine's own,
    untouched."""

    def __init__(self, engine: Any, base: list[dict[str, torch.Tensor]]) -> None:
        super().__init__(engine)
        #: Each worker's base weights when the engine started.
        self.base = base

    async def states(self) -> list[dict[str, torch.Tensor]]:
        from aiosync.engines.embedded._worker import tensor_from_wire

        adapters = await self.generation.collective_rpc("embedded_lora_state_dict")
        return [{n: tensor_from_wire(f) for n, f in state.items()} for state in adapters]

    async def expected(self, full: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return [dict(full) for _ in range(self.workers)]

    async def holds(self, full: Mapping[str, torch.Tensor]) -> bool:
        if not await super().holds(full):
            return False
        bases = list(await self.generation.hf_state_dicts())
        return all(
            set(held) == set(base) and all(torch.equal(held[n], t) for n, t in base.items())
            for held, base in zip(bases, self.base, strict=True)
        )

    async def restore_base(self) -> None:
        """Load the base weights into every worker, as a full refit would (what an
        adapter-only refit needs after a respawn or a level-2 sleep lost them)."""
        from aiosync.engines.embedded._worker import tensor_to_wire

        wire = {name: tensor_to_wire(t) for name, t in self.base[0].items()}
        await self.generation.collective_rpc("embedded_load_state_dict", (wire,))

    def spare(self) -> contextlib.AbstractAsyncContextManager[KitEngine]:
        return lora_engine(workers=self.workers)


@contextlib.asynccontextmanager
async def lora_engine(*, workers: int = 2) -> AsyncIterator[LoRAKitEngine]:
    """An embedded engine of the tiny Qwen3 (fp32, seed :data:`ENGINE_SEED`) for the LoRA
    case: ``workers`` replicas (the adapter must reach each)."""
    from aiosync.engines.embedded.engine import EmbeddedEngine

    async with EmbeddedEngine(
        _tiny_config(), num_workers=workers, dtype=LORA_DTYPE, seed=ENGINE_SEED, rpc_timeout_s=120
    ) as engine:
        yield LoRAKitEngine(engine, list(await engine.hf_state_dicts()))


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
        argv += ["--seed", str(ENGINE_SEED), "--dtype", DTYPE, "--tp-size", str(tp_size)]
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
            stop_server(proc, timeout_s=30)


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


async def start_engine(kind: str, stack: contextlib.AsyncExitStack) -> KitEngine:
    """A kit engine of ``kind`` (``TransportCase.engine``), closed by ``stack``."""
    if kind == "server":
        url = stack.enter_context(sglang_test_server())
        server = ServerKitEngine(url, tp_size=1)
        stack.push_async_callback(server.aclose)
        return server
    if kind == "lora":
        return await stack.enter_async_context(lora_engine())
    tp = {"embedded": 1, "embedded_tp2": 2}[kind]
    return await stack.enter_async_context(embedded_engine(tensor_parallel_size=tp))
