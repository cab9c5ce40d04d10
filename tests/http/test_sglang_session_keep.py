"""SGLang 0.5.23's weight-update session, the retract + flush of ``in_flight="keep"``
(sglang issue #33783) and the test server under concurrent load, against real
test-server processes. The contracts: ``docs/sglang-contract.md``."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from aiosync import SGLangHTTPBackend, SyncError, TransportError
from aiosync.engines.sglang._generation import SGLangGeneration, continued
from aiosync.transports.http import HTTPWeightSynchronizer

from .conftest import REPO, TestServer, _serve

pytestmark = pytest.mark.slow

BUCKET_BYTES = 64 * 1024
# SGLang 0.5.23, scheduler_components/weight_updater.py.
OUTSIDE_SESSION = (
    "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
)
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
# Long enough that the kept requests are mid-decode when the sync pauses them.
KEEP_TOKENS = 400


@pytest.fixture(scope="module")
def session_server_proc(server_workdir: Path, dense_config: Path) -> Iterator[TestServer]:
    """A server with SGLang 0.5.23's session (the default) and #33783's flush."""
    yield from _serve(server_workdir, dense_config)


@pytest.fixture(scope="module")
def legacy_server_proc(server_workdir: Path, dense_config: Path) -> Iterator[TestServer]:
    """A server from before the session: no /begin_weight_update, /end_weight_update."""
    yield from _serve(server_workdir, dense_config, "--no-weight-update-session")


@pytest.fixture
def server(session_server_proc: TestServer) -> TestServer:
    session_server_proc.reset()
    # Each test's trainer counts from version 0: SGLang's label before any update.
    body = {"new_version": "default", "abort_all_requests": False}
    session_server_proc.admin.post("/update_weight_version", json=body).raise_for_status()
    session_server_proc.reset()
    return session_server_proc


@pytest.fixture
def legacy_server(legacy_server_proc: TestServer) -> TestServer:
    legacy_server_proc.reset()
    return legacy_server_proc


def _paths(server: TestServer) -> list[tuple[str, Any]]:
    return [(e["path"], e.get("status")) for e in server.log() if e["path"] != "/get_server_info"]


async def _closed(backend: Any, sync: Any) -> None:
    """The backend closed, then the synchronizer shut down."""
    await backend.aclose()
    await sync.shutdown()


async def _synced(server: TestServer, trainer: Any, **kw: Any) -> tuple[Any, Any]:
    backend = SGLangHTTPBackend(server.url, **kw)
    sync = HTTPWeightSynchronizer(trainer, backend, bucket_bytes=BUCKET_BYTES)
    await sync.init_communicator()
    return backend, sync


async def test_every_update_runs_inside_one_session_and_is_bit_exact(
    server: TestServer, make_trainer: Any, state_equal: Any
) -> None:
    trainer = make_trainer(seed=31)
    backend, sync = await _synced(server, trainer)
    await sync.mark_stale()
    await sync.sync_weights()
    state_equal(server.state_dict(), trainer.expected())
    paths = [p for p, _ in _paths(server)]
    updates = [i for i, p in enumerate(paths) if p == "/update_weights_from_tensor"]
    assert len(updates) == len(sync.plan) > 1
    assert paths.count("/begin_weight_update") == paths.count("/end_weight_update") == 1
    assert paths.index("/begin_weight_update") < updates[0]
    assert updates[-1] < paths.index("/end_weight_update") < paths.index("/flush_cache")
    assert all(s == 200 for _, s in _paths(server))
    assert backend.weight_update_session is True
    await _closed(backend, sync)


async def test_server_without_session_is_driven_sessionless_probed_once(
    legacy_server: TestServer, make_trainer: Any, state_equal: Any
) -> None:
    trainer = make_trainer(seed=32)
    backend, sync = await _synced(legacy_server, trainer)
    for step in (1, 2):
        trainer.step(seed=step)
        await sync.mark_stale()
        await sync.sync_weights()
        state_equal(legacy_server.state_dict(), trainer.expected())
    log = _paths(legacy_server)
    # One probe in two syncs, answered 404; never an end.
    assert [e for e in log if e[0].endswith("_weight_update")] == [("/begin_weight_update", 404)]
    assert backend.weight_update_session is False
    assert await backend.get_weight_version() == "2"
    await _closed(backend, sync)


def test_session_rules_and_messages_are_sglangs(server: TestServer) -> None:
    admin = server.admin
    update = {"serialized_named_tensors": ["x"], "load_format": "flattened_bucket"}
    refused = admin.post("/update_weights_from_tensor", json=update)
    assert refused.status_code == 400
    assert refused.json() == {"success": False, "message": OUTSIDE_SESSION}
    ended = admin.post("/end_weight_update", json={})
    assert (ended.status_code, ended.json()["message"]) == (400, NO_SESSION)
    # BeginWeightUpdateReqInput.selector is "target" | "draft" | "all": another is
    # SGLang's validation error (400, ErrorResponse), and no session opens.
    bad = admin.post("/begin_weight_update", json={"selector": "experts"})
    assert (bad.status_code, bad.json()["object"], bad.json()["code"]) == (400, "error", 400)
    assert "selector" in bad.json()["message"]
    assert admin.post("/end_weight_update", json={}).status_code == 400
    assert admin.post("/begin_weight_update", json={}).json() == {
        "success": True,
        "message": "Success",
    }
    again = admin.post("/begin_weight_update", json={})
    assert (again.status_code, again.json()["message"]) == (400, SESSION_OPEN)
    assert admin.post("/end_weight_update", json={}).status_code == 200


async def test_bucket_rejected_mid_sync_ends_the_session_and_next_sync_succeeds(
    server: TestServer, make_trainer: Any, state_equal: Any
) -> None:
    trainer = make_trainer(seed=33)
    backend, sync = await _synced(server, trainer)
    # The server rejects a bucket part-way through the stream.
    # At most two buckets exist at a time: armed at bucket 2, it hits bucket 1 or 2.
    third = sync.plan[2].slots[0].name
    armed: list[str] = []

    def on_tensor(name: str) -> None:
        if name == third and not armed:
            armed.append(name)
            server.fault("/update_weights_from_tensor", "error", count=1)

    trainer.on_tensor = on_tensor
    await sync.mark_stale()
    with pytest.raises(TransportError, match="injected fault"):
        await sync.sync_weights()
    log = _paths(server)
    statuses = [s for p, s in log if p == "/update_weights_from_tensor"]
    assert statuses[0] == 200 and statuses[-1] == 500
    # The failed sync still closed its session, after the refusal; it never flushed.
    refused = log.index(("/update_weights_from_tensor", 500))
    assert [e for e in log[refused:] if e[0].endswith("_weight_update")] == [
        ("/end_weight_update", 200)
    ]
    assert ("/flush_cache", 200) not in log
    assert not backend.weights_valid
    with pytest.raises(SyncError, match="mix of two versions"):
        await backend.generate([[1, 2]], max_new_tokens=2)

    trainer.on_tensor = None
    server.reset()
    await sync.sync_weights()
    state_equal(server.state_dict(), trainer.expected())
    assert [p for p, _ in _paths(server)].count("/begin_weight_update") == 1
    await _closed(backend, sync)


async def test_session_left_open_by_a_dead_trainer_is_ended_before_the_sync(
    server: TestServer, make_trainer: Any, state_equal: Any
) -> None:
    server.admin.post("/begin_weight_update", json={}).raise_for_status()
    trainer = make_trainer(seed=34)
    backend, sync = await _synced(server, trainer)
    await sync.mark_stale()
    await sync.sync_weights()
    state_equal(server.state_dict(), trainer.expected())
    sessions = [e for e in _paths(server) if e[0].endswith("_weight_update")]
    assert sessions[:4] == [
        ("/begin_weight_update", 200),  # the dead trainer's
        ("/begin_weight_update", 400),
        ("/end_weight_update", 200),
        ("/begin_weight_update", 200),
    ]
    await _closed(backend, sync)


async def _running(server: TestServer, count: int) -> None:
    """Until ``count`` requests decode (each has a token)."""
    while True:
        load = server.admin.get("/_aiosync/load").json()
        if load["running"] + load["waiting"] == count and load["generated_tokens"] >= count:
            return
        await anyio.sleep(0.01)


@contextlib.asynccontextmanager
async def _while_running(
    server: TestServer, backend: Any, prompts: list[list[int]]
) -> AsyncIterator[dict[int, SGLangGeneration]]:
    """Each prompt a greedy KEEP_TOKENS request, all running on the server when the body
    starts; their results (by prompt index), complete once the block ended."""
    results: dict[int, SGLangGeneration] = {}

    async def generate(i: int) -> None:
        (results[i],) = await backend.generate_with_meta(
            [prompts[i]], max_new_tokens=KEEP_TOKENS, temperature=0.0, ignore_eos=True
        )

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(generate, i)
        with anyio.fail_after(60):
            await _running(server, len(prompts))
        yield results


async def test_keep_under_load_requeues_through_the_refused_flush_and_serves_new_kv(
    server: TestServer, make_trainer: Any
) -> None:
    trainer = make_trainer(seed=35)
    backend, sync = await _synced(server, trainer)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    await sync.mark_stale()
    async with _while_running(server, backend, prompts) as results:
        await sync.sync_weights(in_flight="keep")
    log = _paths(server)
    flushes = [s for p, s in log if p == "/flush_cache"]
    # #33783: refused while the retracted requests wait; accepted once requeued.
    assert flushes[0] == 400 and flushes[-1] == 200
    assert ("/pause_generation", 200) in log
    reference = trainer.reference_generate
    for i, generation in results.items():
        split = generation.meta_info["aiosync_continued_at"]
        assert 0 < split < KEEP_TOKENS
        assert len(generation.token_ids) == KEEP_TOKENS
        assert generation.finish_reason == "length" and not generation.aborted
        assert generation.meta_info["aiosync_stale_kv"] is False
        # Old weights (never synced: None) up to the pause, version 1 after.
        assert (generation.first_version, generation.last_version) == (None, 1)
        assert generation.version_change_at == split and generation.spans_versions
        # The rest is what the new weights alone compute from prompt + tokens so far.
        head = [*prompts[i], *generation.token_ids[:split]]
        assert generation.token_ids[split : split + 8] == reference([head], 8)[0]
    load = server.admin.get("/_aiosync/load").json()
    assert (load["running"], load["waiting"]) == (0, 0)
    await _closed(backend, sync)


async def test_keep_sync_failing_on_its_flush_never_resumes_on_half_loaded_weights(
    server: TestServer, make_trainer: Any, state_equal: Any
) -> None:
    trainer = make_trainer(seed=36)
    backend, sync = await _synced(server, trainer, flush_timeout_s=0.5)
    server.fault("/flush_cache", "busy")  # every flush refused, as SGLang's 400
    await sync.mark_stale()
    async with _while_running(server, backend, [[1, 2, 3], [4, 5]]) as results:
        with pytest.raises(TransportError, match="flush_cache did not succeed"):
            await sync.sync_weights(in_flight="keep")
    for generation in results.values():
        # Ended with the tokens the old weights made; nothing after the buckets loaded.
        assert generation.aborted and 0 < len(generation.token_ids) < KEEP_TOKENS
        assert generation.meta_info["weight_versions"] == [
            {"version": "default", "start": 0, "end": len(generation.token_ids)}
        ]
    assert not backend.weights_valid
    assert ("/end_weight_update", 200) in _paths(server)
    server.reset()
    await sync.sync_weights()
    state_equal(server.state_dict(), trainer.expected())
    await _closed(backend, sync)


async def test_concurrent_generates_of_two_lengths_leave_nothing_running(
    server: TestServer,
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

        async def generate(n: int) -> None:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": n}}
            response = await client.post("/generate", json=body)
            assert response.status_code == 200, response.text
            assert len(response.json()["output_ids"]) <= n

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(generate, 3 if i % 2 else 9)
        load = (await client.get("/_aiosync/load")).json()
        assert (load["running"], load["waiting"]) == (0, 0)
        assert (await client.post("/flush_cache")).status_code == 200
    assert all(e["status"] == 200 for e in server.log() if e["path"] == "/generate")


def test_busy_port_fails_at_once_with_a_clear_message_and_leaves_nothing() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "aiosync.testing.sglang_server", "--port", str(port),
             "--model-config", "qwen3-tiny"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in stderr
    assert "Traceback" not in stderr
    # Nothing of the server's own: its pid names its folders (other tests' servers
    # may run beside it).
    assert not list(Path(tempfile.gettempdir()).glob(f"aiosync-sglang-config-{proc.pid}-*"))


def test_a_request_kept_across_a_commit_spans_versions_without_token_labels() -> None:
    answer = {"output_ids": [5, 6], "meta_info": {"weight_version": "1"}}
    # Submitted before any label (the initial weights), answered after version 1.
    spanned = SGLangGeneration.from_answer(answer, submitted_version=None, spanned=True)
    assert (spanned.first_version, spanned.last_version) == (None, 1)
    assert spanned.spans_versions
    alone = SGLangGeneration.from_answer(answer, submitted_version=None)
    assert (alone.first_version, alone.last_version, alone.spans_versions) == (1, 1, False)


def test_sglangs_per_token_version_spans_give_the_exact_change_as_on_vllm() -> None:
    # SGLang 0.5.23's answer to a request kept across a refit from "1" to "2" after 3 tokens.
    spans = [{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 3, "end": 5}]
    answer = {"output_ids": [5, 6, 7, 8, 9], "meta_info": {"weight_versions": spans,
              "weight_version": "2"}}  # fmt: skip
    kept = SGLangGeneration.from_answer(answer, submitted_version=1, spanned=True)
    assert (kept.first_version, kept.last_version, kept.version_change_at) == (1, 2, 3)
    # Spans that do not cover the output tokens are not trusted: the scalar's rules apply.
    short = {"output_ids": [5, 6, 7, 8, 9, 10], "meta_info": answer["meta_info"]}
    fallback = SGLangGeneration.from_answer(short, submitted_version=1, spanned=True)
    assert (fallback.first_version, fallback.last_version) == (1, 2)
    assert fallback.version_change_at is None and fallback.spans_versions
    # No token: SGLang's one empty span of the label now.
    empty = {"output_ids": [], "meta_info": {"weight_versions": [{"version": "2", "start": 0,
             "end": 0}], "weight_version": "2"}}  # fmt: skip
    none = SGLangGeneration.from_answer(empty)
    assert (none.first_version, none.last_version, none.version_change_at) == (None, None, None)


def test_continued_generation_joins_version_spans_shifted_past_the_first_part() -> None:
    first = SGLangGeneration.from_answer(
        {"output_ids": [1, 2, 3], "meta_info": {"weight_version": "2", "finish_reason":
         {"type": "abort"}, "weight_versions": [{"version": "2", "start": 0, "end": 3}]}},
    )  # fmt: skip
    rest = SGLangGeneration.from_answer(
        {"output_ids": [4, 5], "meta_info": {"weight_version": "3", "finish_reason":
         {"type": "length"}, "weight_versions": [{"version": "2", "start": 0, "end": 1},
         {"version": "3", "start": 1, "end": 2}]}},
    )  # fmt: skip
    joined = continued(first, rest)
    assert joined.meta_info["weight_versions"] == [
        {"version": "2", "start": 0, "end": 4},
        {"version": "3", "start": 4, "end": 5},
    ]
    assert (joined.first_version, joined.last_version, joined.version_change_at) == (2, 3, 4)


def test_continued_generation_joins_parts_with_the_exact_version_change() -> None:
    first = SGLangGeneration.from_answer(
        {"output_ids": [1, 2, 3], "meta_info": {"weight_version": "2", "prompt_tokens": 4,
         "finish_reason": {"type": "abort"}}},
    )  # fmt: skip
    rest = SGLangGeneration.from_answer(
        {"output_ids": [4, 5], "meta_info": {"weight_version": "3", "prompt_tokens": 7,
         "finish_reason": {"type": "length"}}},
    )  # fmt: skip
    joined = continued(first, rest)
    assert joined.token_ids == [1, 2, 3, 4, 5]
    assert (joined.first_version, joined.last_version, joined.version_change_at) == (2, 3, 3)
    assert joined.finish_reason == "length" and not joined.aborted
    assert joined.meta_info["prompt_tokens"] == 4
    assert json.dumps(joined.meta_info["aiosync_continued_at"]) == "3"


async def test_a_second_sync_through_one_backend_never_ends_the_first_ones_session(
    server: TestServer,
) -> None:
    async with SGLangHTTPBackend(server.url) as backend:
        assert await backend.begin_weight_update() is True
        with pytest.raises(TransportError, match="another sync through it is in flight"):
            await backend.begin_weight_update()
        await backend.end_weight_update()
    sessions = [e for e in _paths(server) if e[0].endswith("_weight_update")]
    assert sessions == [("/begin_weight_update", 200), ("/end_weight_update", 200)]
