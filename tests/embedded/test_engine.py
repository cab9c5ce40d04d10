"""EmbeddedEngine: real worker processes driven by name over msgpack RPC."""

from __future__ import annotations

import os
import signal
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import pytest_asyncio
import torch

from aiosync.capabilities import EngineWorkers
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.errors import SyncError, SyncTimeoutError, TransportError
from aiosync.synchronizer import GenerationBackend
from tests._support.steps import sleep_at_level_2

pytestmark = pytest.mark.asyncio(loop_scope="module")

DENSE = TINY_QWEN3
SEED = 4
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[EmbeddedEngine]:
    async with EmbeddedEngine(DENSE, num_workers=2, seed=SEED, rpc_timeout_s=120) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference() -> HFModelRunner:
    return HFModelRunner.from_config(DENSE, seed=SEED)


async def test_engine_speaks_the_generation_and_worker_protocols(engine: EmbeddedEngine) -> None:
    assert isinstance(engine, GenerationBackend)
    assert isinstance(engine, EngineWorkers)
    status = await engine.status()
    assert [s["rank"] for s in status] == [0, 1]
    assert [s["pid"] for s in status] == engine.pids
    assert len(set(engine.pids)) == 2 and os.getpid() not in engine.pids
    assert engine.socket_dir is not None
    assert stat.S_IMODE(os.stat(engine.socket_dir).st_mode) == 0o700


async def test_workers_hold_the_seeded_model_and_the_worker_extension(
    engine: EmbeddedEngine, reference: HFModelRunner
) -> None:
    expected = reference.hf_state_dict()
    for state in await engine.hf_state_dicts():
        assert list(state) == list(expected)
        assert all(torch.equal(state[n], t) for n, t in expected.items())
    # AiosyncWorkerExtension is mixed in: its RPCs answer (here: a malformed plan).
    replies = await engine.collective_rpc("aiosync_ipc_init", ({"manifest": []},))
    assert [(r["ok"], r["type"]) for r in replies] == [(False, "RefitMismatchError")] * 2


async def test_generate_splits_prompts_over_workers_and_matches_the_model(
    engine: EmbeddedEngine, reference: HFModelRunner
) -> None:
    outs = await engine.generate(PROMPTS, max_new_tokens=5)
    assert outs == reference.generate(PROMPTS, max_new_tokens=5)
    assert await engine.generate(PROMPTS[:1], max_new_tokens=5) == outs[:1]
    assert await engine.generate([], max_new_tokens=5) == []


async def test_unknown_and_private_methods_are_refused(engine: EmbeddedEngine) -> None:
    with pytest.raises(AttributeError, match="no_such_method"):
        await engine.collective_rpc("no_such_method")
    with pytest.raises(AttributeError, match="not an RPC method"):
        await engine.collective_rpc("_aiosync_ipc_state")


async def test_sleeping_engine_refuses_to_generate_until_woken(engine: EmbeddedEngine) -> None:
    await engine.finish_generation()
    assert [s["asleep"] for s in await engine.status()] == [["kv_cache", "weights"]] * 2
    with pytest.raises(SyncError, match="asleep"):
        await engine.generate(PROMPTS, max_new_tokens=2)
    await engine.prepare_for_generation(["weights"])
    assert [s["asleep"] for s in await engine.status()] == [["kv_cache"]] * 2
    await engine.prepare_for_generation(["kv_cache"])
    assert len(await engine.generate(PROMPTS, max_new_tokens=2)) == 4
    with pytest.raises(ValueError, match="unknown tags"):
        await engine.prepare_for_generation(["optimizer"])


async def test_level2_sleep_discards_weights_and_tells_listeners(
    engine: EmbeddedEngine, reference: HFModelRunner
) -> None:
    calls: list[str] = []
    engine.add_weights_discarded_listener(lambda: calls.append("discarded"))
    await sleep_at_level_2(engine)
    assert calls == ["discarded"]
    await engine.prepare_for_generation()
    with pytest.raises(SyncError, match="not valid"):
        await engine.generate(PROMPTS, max_new_tokens=2)
    for state in await engine.hf_state_dicts():
        assert all(not t.any() for t in state.values())
    # Loading the weights back (what a sync does) makes the engine usable again;
    # the RPC carries plain bytes, no pickle.
    payload = {
        name: [str(t.dtype).removeprefix("torch."), list(t.shape), t.numpy().tobytes()]
        for name, t in reference.hf_state_dict().items()
    }
    assert await engine.collective_rpc("embedded_load_state_dict", (payload,)) == [len(payload)] * 2
    assert all(s["weights_valid"] for s in await engine.status())
    assert await engine.generate(PROMPTS, max_new_tokens=3) == reference.generate(
        PROMPTS, max_new_tokens=3
    )


async def test_frozen_worker_times_out_with_sync_timeout_error(engine: EmbeddedEngine) -> None:
    pid = engine.pids[1]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(SyncTimeoutError, match=r"worker\(s\) \[1\]"):
            await engine.collective_rpc("embedded_status", timeout_s=1.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [s["rank"] for s in await engine.status()] == [0, 1]


async def test_dead_worker_fails_calls_with_transport_error_and_can_be_respawned(
    engine: EmbeddedEngine, reference: HFModelRunner
) -> None:
    calls: list[str] = []

    def listener() -> None:
        calls.append("discarded")

    engine.add_weights_discarded_listener(listener)
    try:
        assert await engine.respawn_dead_workers() == []  # nothing dead: nothing discarded
        assert calls == []
        pid = engine.pids[0]
        os.kill(pid, signal.SIGKILL)
        # Every error that reports the dead worker says how to heal.
        heal = r".*EmbeddedEngine\.respawn_dead_workers\(\) starts"
        with pytest.raises(TransportError, match=rf"worker 0 (died|is dead): {heal}"):
            await engine.collective_rpc("embedded_status", timeout_s=60)
        # Known dead: the next call fails before sending.
        with pytest.raises(TransportError, match=rf"worker 0 is dead: {heal}"):
            await engine.collective_rpc("embedded_status", timeout_s=60)
        with pytest.raises(TransportError, match=rf"worker\(s\) \[0\] died {heal}"):
            await engine.check_health()
        assert await engine.respawn_dead_workers() == [0]
    finally:
        engine.remove_weights_discarded_listener(listener)
    assert engine.pids[0] != pid
    # The new worker holds initial, not synced, weights: it must not serve them.
    assert calls == ["discarded"]
    assert [s["weights_valid"] for s in await engine.status()] == [False, True]
    with pytest.raises(SyncError, match="worker 0: weights are not valid"):
        await engine.generate(PROMPTS, max_new_tokens=3)
    payload = {
        name: [str(t.dtype).removeprefix("torch."), list(t.shape), t.numpy().tobytes()]
        for name, t in reference.hf_state_dict().items()
    }
    assert await engine.collective_rpc("embedded_load_state_dict", (payload,)) == [len(payload)] * 2
    assert await engine.generate(PROMPTS, max_new_tokens=3) == reference.generate(
        PROMPTS, max_new_tokens=3
    )


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"num_workers": "2"}, TypeError, "num_workers must be an int, got str"),
        ({"num_workers": True}, TypeError, "num_workers must be an int, got bool"),
        ({"num_workers": 0}, ValueError, "num_workers must be >= 1, got 0"),
        ({"dtype": "float8"}, ValueError, "floating dtype .* got 'float8'"),
        ({"dtype": "int32"}, ValueError, "floating dtype .* got 'int32'"),
        ({"dtype": torch.float32}, TypeError, "dtype must be a dtype name"),
    ],
)
async def test_bad_constructor_arguments_raise_before_any_process_starts(
    options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        EmbeddedEngine(DENSE, **options)  # type: ignore[arg-type]


async def test_shutdown_stops_workers_and_removes_the_socket_dir() -> None:
    engine = EmbeddedEngine(DENSE, num_workers=1, seed=SEED, worker_extension_cls=None)
    await engine.start()
    directory = engine.socket_dir
    assert directory is not None and Path(directory).exists()
    [proc] = engine.processes
    await engine.shutdown()
    assert not proc.is_alive()
    assert not Path(directory).exists()
    with pytest.raises(TransportError, match="shut down"):
        await engine.status()
    await engine.shutdown()


async def test_engine_takes_a_transformers_config_object(reference: HFModelRunner) -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model(**DENSE)
    async with EmbeddedEngine(config, num_workers=1, seed=SEED, worker_extension_cls=None) as e:
        [state] = await e.hf_state_dicts()
    expected = reference.hf_state_dict()
    assert list(state) == list(expected)
    assert all(torch.equal(state[n], t) for n, t in expected.items())


@pytest.mark.parametrize("model", [42, object(), [("model_type", "qwen3")]])
async def test_a_model_that_is_not_a_config_raises_type_error_before_any_process(
    model: object,
) -> None:
    with pytest.raises(TypeError, match="model must be an HF config"):
        EmbeddedEngine(model)


async def test_without_transformers_the_engine_names_the_extra_before_any_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'aiosync\[embedded\]'"):
        EmbeddedEngine(DENSE)


_UNGUARDED_SCRIPT = """
import asyncio
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine


async def main():
    async with EmbeddedEngine(TINY_QWEN3, num_workers=1, worker_extension_cls=None):
        pass

asyncio.run(main())  # no `if __name__ == "__main__":` guard
"""


async def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_UNGUARDED_SCRIPT)
    with anyio.fail_after(600):
        proc = await anyio.run_process([sys.executable, str(script)], check=False)
    assert proc.returncode == 1
    last = proc.stderr.decode().strip().splitlines()[-1]
    assert last.startswith("aiosync.errors.TransportError: engine worker 0 died: process ")
    assert last.endswith(
        "exited with code 87: the worker re-ran the main script (multiprocessing imports "
        "it again in every worker) and the script started an engine there: put the code that "
        "starts the engine under 'if __name__ == \"__main__\":'"
    )


async def test_a_worker_takes_the_environment_its_engine_had_when_it_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Workers fork from a forkserver started with the first engine (at the latest,
    # here): a variable set after it reaches the later engine's worker only because
    # each worker takes its parent's environment, as a spawned process does.
    reader = "tests._support.extensions.EnvironmentReader"
    name = "AIOSYNC_TEST_WORKER_ENVIRONMENT"
    monkeypatch.delenv(name, raising=False)
    async with EmbeddedEngine(DENSE, worker_extension_cls=reader) as first:
        monkeypatch.setenv(name, "second")
        async with EmbeddedEngine(DENSE, worker_extension_cls=reader) as second:
            assert await first.collective_rpc("read_environment", (name,)) == [None]
            assert await second.collective_rpc("read_environment", (name,)) == ["second"]
