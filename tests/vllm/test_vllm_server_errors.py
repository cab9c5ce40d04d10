""":class:`VLLMServerBackend`'s error paths against a server that refuses every
route (httpx's ``MockTransport`` as the server): no vLLM needed."""

from __future__ import annotations

import httpx
import pytest

from aiosync.engines.vllm.server import VLLMServerBackend
from aiosync.errors import TransportError


def refuse(request: httpx.Request) -> httpx.Response:
    return httpx.Response(503, text=f"{request.url.path} refused")


async def test_a_failed_resume_after_a_failed_pause_is_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with VLLMServerBackend(
        "http://vllm.test", transport=httpx.MockTransport(refuse)
    ) as backend:
        with pytest.raises(TransportError, match="/pause"):
            await backend.pause_generation("abort")
    [record] = [r for r in caplog.records if "after a failed pause" in r.getMessage()]
    assert record.getMessage().startswith(
        "resuming http://vllm.test after a failed pause: TransportError: POST "
        "http://vllm.test/resume"
    ), record.getMessage()
    assert record.exc_info is None  # a secondary failure: the pause's error has the traceback
