"""Case C13 on the HTTP transport into the SGLang test server: a ``/generate`` in flight
while a refit runs, for each in-flight policy (SGLang's ``/pause_generation`` modes).

Each test syncs OLD, starts a LONG greedy ``/generate``, waits until the server
reports tokens generated (``/_aiosync/load``), then syncs NEW, and checks the exact
tokens and the per-token version labels against transformers.

What every transport owes for ``"wait"`` and ``"abort"`` is checked by the conformance
kit's ``in_flight_*`` cells; this module keeps what is the server's own: the exact
continuation of ``"keep"``, and the failure paths.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest
import pytest_asyncio
from transformers import PreTrainedModel

from aiosync.engines.sglang import SGLangGeneration, SGLangHTTPBackend
from aiosync.events import VersionEventKind
from aiosync.testing.sglang_server import serve_in_subprocess
from aiosync.transports.http import HTTPWeightSynchronizer
from tests._support import inflight
from tests._support.inflight import LONG, PROMPT, InflightEnv, hf_greedy, stage

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class HTTPEnv(InflightEnv):
    """The test server's backend (``/generate``) and an admin client (``/_aiosync/load``)."""

    backend: SGLangHTTPBackend
    admin: httpx.AsyncClient


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env() -> AsyncIterator[HTTPEnv]:
    trainer = inflight.build_model(inflight.OLD_SEED)
    source = inflight.FaultySource(trainer)
    async with (
        serve_in_subprocess(inflight.CONFIG, seed=inflight.ENGINE_SEED) as url,
        SGLangHTTPBackend(url) as backend,
        HTTPWeightSynchronizer(source, backend) as sync,
        httpx.AsyncClient(base_url=url) as admin,
    ):
        yield HTTPEnv(sync, trainer, source, backend=backend, admin=admin)


async def _mid_request(admin: httpx.AsyncClient, at_least: int = 30) -> None:
    with anyio.fail_after(120):
        while True:
            load = (await admin.get("/_aiosync/load")).json()
            if load["running"] + load["waiting"] == 1 and load["generated_tokens"] >= at_least:
                return
            await anyio.sleep(0.005)


async def _run_during_request(env: HTTPEnv, call: Any) -> tuple[SGLangGeneration, list[str], Any]:
    """A LONG ``/generate`` with ``call()`` once it is mid-way: the result, its
    per-token version labels, and ``call()``'s."""
    results: list[SGLangGeneration] = []

    async def request() -> None:
        results.extend(
            await env.backend.generate_with_meta(
                [PROMPT], max_new_tokens=LONG, sampling_params={"ignore_eos": True}
            )
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await _mid_request(env.admin)
        outcome = await call()
    (result,) = results
    # SGLang's spans ([{"version", "start", "end"}], runs of output tokens) per token.
    spans = result.meta_info["weight_versions"]
    labels = [span["version"] for span in spans for _ in range(span["start"], span["end"])]
    assert len(labels) == len(result.token_ids)
    return result, labels, outcome


async def test_keep_retracts_the_request_and_continues_it_on_new_weights(
    env: HTTPEnv,
    old_model: PreTrainedModel,
    new_model: PreTrainedModel,
    old_tokens: list[int],
) -> None:
    old, new = await stage(env, old_model, new_model)
    result, versions, _ = await _run_during_request(
        env, lambda: env.sync.sync_weights(in_flight="keep")
    )
    k = versions.index(str(new))
    assert 30 <= k < LONG
    assert result.aborted is False
    assert versions == [str(old)] * k + [str(new)] * (LONG - k)
    # The aiosync.Generation fields say the same: two versions, changing at token k.
    assert (result.first_version, result.last_version, result.version_change_at) == (old, new, k)
    assert (result.spans_versions, result.finish_reason) == (True, "length")
    assert result.output_ids[:k] == old_tokens[:k]
    # Retracted (SGLang's mode for keep with clear_cache): the new weights recompute
    # the prompt and the k tokens kept, then continue greedily.
    rest = hf_greedy(new_model, PROMPT + old_tokens[:k], LONG - k)
    assert result.output_ids[k:] == rest
    assert rest != old_tokens[k:]
    log = [(e["path"], e.get("status")) for e in (await env.admin.get("/_aiosync/log")).json()]
    paths = [path for path, _ in log]
    start = len(paths) - 1 - paths[::-1].index("/begin_weight_update") - 1
    sync_paths = paths[start:]
    # One weight-update session around the load and verify's read-back (the default
    # "sample": /get_weights_by_name before the session ends), inside the retract pause.
    session = sync_paths[: sync_paths.index("/end_weight_update") + 1]
    assert session[:3] == [
        "/pause_generation",
        "/begin_weight_update",
        "/update_weights_from_tensor",
    ]
    assert session[-1] == "/end_weight_update"
    assert session[3:-1] and set(session[3:-1]) == {"/get_weights_by_name"}
    # The retracted request waits in the queue, so SGLang refuses the first flush
    # (sglang #33783): the backend aborts and requeues it, flushes, and continues it
    # on the new weights after the refit resumed generation.
    flushes = [status for path, status in log[start:] if path == "/flush_cache"]
    assert flushes == [400, 200]
    # Generation resumes, then the requeued request is sent again (under load another
    # /generate of the test's may land in the log after it: order, not the tail).
    resumed = sync_paths.index("/continue_generation")
    assert "/generate" in sync_paths[resumed + 1 :]


async def test_a_failed_refit_resumes_generation(
    env: HTTPEnv,
    old_model: PreTrainedModel,
    new_model: PreTrainedModel,
    old_tokens: list[int],
) -> None:
    old, _ = await stage(env, old_model, new_model)
    env.source.fail_before = RuntimeError("trainer offload failed")

    async def failing_sync() -> None:
        with pytest.raises(RuntimeError, match="trainer offload failed"):
            await env.sync.sync_weights(in_flight="wait")

    async with env.sync.subscribe() as events:
        result, versions, _ = await _run_during_request(env, failing_sync)
        with anyio.fail_after(10):
            failed = [await anext(events) for _ in range(2)][-1]
    assert result.output_ids == old_tokens
    assert (result.aborted, versions) == (False, [str(old)] * LONG)
    assert failed.kind == VersionEventKind.FAILED and failed.pause_s > 0.0
    assert (env.sync.weight_version, env.sync.is_stale) == (old, True)
    paths = [e["path"] for e in (await env.admin.get("/_aiosync/log")).json()]
    assert paths[-1] == "/continue_generation"
    # Resumed: a new request is admitted and answered by OLD (nothing moved).
    with anyio.fail_after(60):
        assert await env.backend.generate([PROMPT], max_new_tokens=9) == [old_tokens[:9]]
