"""Fixtures for the HTTP transport: a real test server process on 127.0.0.1, a real trainer.

Servers are module-scoped (one process per test module; building a model costs
seconds on a loaded CPU), the fleet's pair session-scoped. Every test syncs
before it asserts and resets the server's faults and log first, so what a
previous test left does not matter. Backends and synchronizers are built inside
each test (they are cheap), so no async fixture crosses event loops.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load as safetensors_load
from transformers import AutoConfig, AutoModelForCausalLM

from aiosync import SGLangHTTPBackend, create_weight_synchronizer
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.refit import DTensorRefitSource
from aiosync.sources import RefitManifest, RefitSource
from aiosync.transports.http import HTTPWeightSynchronizer
from tests._support.launch import start_module

REPO = Path(__file__).resolve().parents[2]

DENSE: dict[str, Any] = TINY_QWEN3
#: The server starts from this seed; trainers use others, so a sync changes every tensor.
SERVER_SEED = 1
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9]]
SERVER_START_TIMEOUT_S = 300.0
API_KEY = "test-key-123"
#: Small buckets, so a refit of the tiny model takes several requests.
BUCKET_BYTES = 64 * 1024


class TestServer:
    """A ``python -m aiosync.testing.sglang_server`` process and an admin client.

    ``proc`` is a ``multiprocessing`` process (``pid``, ``kill()``, ``join()``)."""

    __test__ = False

    def __init__(self, workdir: Path, config: Path, *extra: str) -> None:
        port_file = workdir / f"port-{os.getpid()}-{time.monotonic_ns()}"
        argv = [
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--model-config",
            str(config),
            "--seed",
            str(SERVER_SEED),
            "--dtype",
            "bfloat16",
            *extra,
        ]
        self.api_key = extra[extra.index("--api-key") + 1] if "--api-key" in extra else None
        # ``python -m aiosync.testing.sglang_server ARGV``, forked from the preloaded
        # forkserver (its own process, without a fresh interpreter's imports).
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = start_module("aiosync.testing.sglang_server", argv, None, env)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not port_file.exists():
            if not self.proc.is_alive():
                raise RuntimeError(f"test server exited with {self.proc.exitcode}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("test server did not start in time")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"
        self.admin = httpx.Client(base_url=self.url, timeout=60.0)

    def reset(self) -> None:
        self.admin.post("/_aiosync/reset").raise_for_status()

    def log(self) -> list[dict[str, Any]]:
        response = self.admin.get("/_aiosync/log")
        response.raise_for_status()
        return list(response.json())

    def fault(self, path: str, mode: str, count: int | None = None) -> None:
        body = {"path": path, "mode": mode, "count": count}
        self.admin.post("/_aiosync/faults", json=body).raise_for_status()

    def state_dict(self, rank: int = 0) -> dict[str, torch.Tensor]:
        """TP rank ``rank``'s weights (each rank loads its own payload entry)."""
        response = self.admin.get("/_aiosync/state_dict", params={"rank": rank})
        response.raise_for_status()
        return safetensors_load(response.content)

    def generate(self, prompts: Sequence[Sequence[int]], n: int) -> list[tuple[list[int], str]]:
        """Greedy ``/generate`` straight to the server (no backend to refuse it):
        ``(output_ids, meta_info.weight_version)`` per prompt."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {
            "input_ids": [list(p) for p in prompts],
            "sampling_params": {"max_new_tokens": n, "temperature": 0.0},
        }
        response = self.admin.post("/generate", json=body, headers=headers)
        response.raise_for_status()
        return [(r["output_ids"], r["meta_info"]["weight_version"]) for r in response.json()]

    def kv_scales(self) -> list[dict[str, float]]:
        """The FP8 KV-cache scales each TP rank loaded, ``{name: value}``."""
        response = self.admin.get("/_aiosync/kv_scales")
        response.raise_for_status()
        return [dict(rank) for rank in response.json()]

    def close(self) -> None:
        self.admin.close()
        self.proc.terminate()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


class Trainer(RefitSource):
    """A real fp32 trainer model behind ``DTensorRefitSource`` (bf16 on the wire, case C8),
    with a lifecycle log of the colocated hooks."""

    def __init__(self, seed: int, config: dict[str, Any] = DENSE) -> None:
        items = dict(config)
        hf_config = AutoConfig.for_model(items.pop("model_type"), **items)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        self.inner = DTensorRefitSource(self.model, dtype=torch.bfloat16)
        self.events: list[str] = []
        #: Called with each name just before the source yields it.
        self.on_tensor: Callable[[str], None] | None = None

    def prepare_refit_info(self) -> RefitManifest:
        return self.inner.prepare_refit_info()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.events.append("stream")
        for name, tensor in self.inner.iter_weights():
            if self.on_tensor is not None:
                self.on_tensor(name)
            yield name, tensor

    def offload_before_refit(self) -> None:
        self.events.append("offload_before")

    def offload_after_refit(self) -> None:
        self.events.append("offload_after")

    def step(self, seed: int) -> None:
        """An "optimizer step": perturb every parameter deterministically."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)

    def expected(self) -> dict[str, torch.Tensor]:
        """What the engine must hold after a sync: the source's tensors (bf16)."""
        return {name: t.clone() for name, t in self.inner.iter_weights()}

    def reference_generate(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        """Greedy generation of an in-process engine holding exactly the synced weights."""
        runner = HFModelRunner.from_config(DENSE, seed=SERVER_SEED + 100, dtype=torch.bfloat16)
        runner.load_weights(self.inner.iter_weights())
        return runner.generate([list(p) for p in prompts], max_new_tokens=n)


def _mapped_segments(pid: int) -> set[str]:
    """The HTTP bucket segments (``/dev/shm/aiosync-http-*``) process ``pid`` maps now,
    unlinked ones included (``/proc/<pid>/maps``)."""
    with open(f"/proc/{pid}/maps") as maps:
        return {
            line.split("/dev/shm/", 1)[1].split()[0]
            for line in maps
            if "/dev/shm/aiosync-http-" in line
        }


def assert_state_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected) or set(actual) == set(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


@pytest.fixture(scope="session")
def dense_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("http-model") / "config.json"
    path.write_text(json.dumps(DENSE))
    return path


@pytest.fixture(scope="session")
def server_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("http-servers")


def _serve(workdir: Path, config: Path, *extra: str) -> Iterator[TestServer]:
    server = TestServer(workdir, config, *extra)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def tp2_server(server_workdir: Path, dense_config: Path) -> Iterator[TestServer]:
    """A server with two tensor-parallel ranks, no memory saver."""
    yield from _serve(server_workdir, dense_config, "--tp-size", "2")


@pytest.fixture(scope="module")
def saver_server(server_workdir: Path, dense_config: Path) -> Iterator[TestServer]:
    """A server with ``--enable-memory-saver``."""
    yield from _serve(server_workdir, dense_config, "--enable-memory-saver")


@pytest.fixture(scope="module")
def auth_server(server_workdir: Path, dense_config: Path) -> Iterator[TestServer]:
    """A server with ``--api-key`` :data:`API_KEY`."""
    yield from _serve(server_workdir, dense_config, "--api-key", API_KEY)


@pytest.fixture(scope="session")
def server_pair(
    server_workdir: Path, dense_config: Path
) -> Iterator[tuple[TestServer, TestServer]]:
    """Two plain servers (TP=1, no memory saver) for fleets, started once per session."""
    yield from serve_pair(server_workdir, dense_config)


def serve_pair(workdir: Path, config: Path, *extra: str) -> Iterator[tuple[TestServer, TestServer]]:
    """Two servers started with ``extra``, closed after the ``yield`` (a fixture's body)."""
    first = TestServer(workdir, config, *extra)
    try:
        second = TestServer(workdir, config, *extra)
    except BaseException:
        first.close()
        raise
    try:
        yield first, second
    finally:
        first.close()
        second.close()


@pytest.fixture
def make_trainer() -> type[Trainer]:
    """``make_trainer(seed)``: a real trainer on the tiny dense model."""
    return Trainer


@pytest.fixture
def state_equal() -> Any:
    """``state_equal(actual, expected)``: bit-exact comparison of two state dicts."""
    return assert_state_equal


@pytest.fixture
def mapped_segments() -> Callable[[int], set[str]]:
    """``mapped_segments(pid)``: the HTTP bucket segments process ``pid`` maps now
    (``/proc/<pid>/maps``, unlinked ones included)."""
    return _mapped_segments


@pytest.fixture
def prompts() -> list[list[int]]:
    return [list(p) for p in PROMPTS]


@contextlib.asynccontextmanager
async def http_sync(
    url: str, trainer: Any, *, synced: bool = True, **backend_options: Any
) -> AsyncIterator[tuple[SGLangHTTPBackend, HTTPWeightSynchronizer]]:
    """A backend on ``url`` (``backend_options``) and an initialised
    :class:`HTTPWeightSynchronizer` of ``trainer`` in :data:`BUCKET_BYTES` buckets; with
    ``synced``, after a first sync (version 1). The backend is closed at the end."""
    async with SGLangHTTPBackend(url, **backend_options) as backend:
        sync = HTTPWeightSynchronizer(trainer, backend, bucket_bytes=BUCKET_BYTES)
        await sync.init_communicator()
        if synced:
            await sync.mark_stale()
            await sync.sync_weights()
        yield backend, sync


@pytest.fixture
def servers(server_pair: tuple[TestServer, TestServer]) -> Iterator[tuple[TestServer, TestServer]]:
    """The session's pair of servers, reset before and after (:func:`reset_around`)."""
    yield from reset_around(server_pair)


def reset_around(servers: tuple[TestServer, TestServer]) -> Iterator[tuple[TestServer, TestServer]]:
    """A fixture's body: ``servers`` with their faults and logs cleared before and after
    (a hung request released)."""
    for server in servers:
        server.reset()
    yield servers
    for server in servers:
        server.reset()


@contextlib.asynccontextmanager
async def fleet_sync(
    servers: Any, trainer: Any, **factory_options: Any
) -> AsyncIterator[tuple[Any, list[SGLangHTTPBackend]]]:
    """A backend per server and the factory's synchronizer of ``trainer`` over all of them
    (``create_weight_synchronizer(trainer, backends, backend="sglang", **factory_options)``);
    shut down and closed at the end."""
    backends = [SGLangHTTPBackend(s.url) for s in servers]
    sync = create_weight_synchronizer(trainer, backends, backend="sglang", **factory_options)
    try:
        yield sync, backends
    finally:
        await sync.shutdown()
        for backend in backends:
            await backend.aclose()
