"""A lower layer's error becomes aiosync's in one place: ``aiosync.errors.map_exceptions``,
and the HTTP engine clients' one table of httpx errors."""

from __future__ import annotations

import httpx
import pytest

from aiosync.engines.sglang._client import SGLangClient
from aiosync.engines.vllm.server import VLLMServerBackend
from aiosync.errors import SyncTimeoutError, TransportError, map_exceptions


def test_the_first_matching_type_makes_the_error_raised_from_the_original() -> None:
    mapping = {
        TimeoutError: lambda exc: SyncTimeoutError(f"late: {exc}"),
        OSError: lambda exc: TransportError(f"gone: {exc}"),
    }
    original = ConnectionRefusedError("refused")
    with pytest.raises(TransportError) as caught, map_exceptions(mapping):
        raise original
    assert str(caught.value) == "gone: refused"
    assert caught.value.__cause__ is original


def test_an_error_no_type_names_propagates_unchanged() -> None:
    original = ValueError("bad")
    with (
        pytest.raises(ValueError) as caught,
        map_exceptions({OSError: lambda exc: TransportError(str(exc))}),
    ):
        raise original
    assert caught.value is original


def _failing(error: Exception) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        raise error

    return httpx.MockTransport(handler)


_REFUSED = httpx.ConnectError("refused")
_LATE = httpx.ReadTimeout("slow")


@pytest.mark.parametrize(
    ("error", "kind", "message"),
    [
        (_REFUSED, TransportError, "ConnectError: refused"),
        (_LATE, SyncTimeoutError, f"no answer within 5.0 s ({_LATE!r})"),
    ],
    ids=["connect", "timeout"],
)
async def test_the_sglang_client_names_the_request_and_the_httpx_error(
    error: httpx.HTTPError, kind: type[Exception], message: str
) -> None:
    client = SGLangClient(
        "http://127.0.0.1:9",
        api_key=None,
        tp_size=1,
        request_timeout_s=5.0,
        flush_timeout_s=5.0,
        transport=_failing(error),
    )
    with pytest.raises(kind) as caught:
        await client.server_info()
    assert str(caught.value) == f"GET http://127.0.0.1:9/get_server_info: {message}"
    assert caught.value.__cause__ is error
    await client.aclose()


@pytest.mark.parametrize(
    ("error", "kind", "message"),
    [
        (httpx.ConnectError("refused"), TransportError, "ConnectError: refused"),
        (
            httpx.ReadTimeout("slow"),
            SyncTimeoutError,
            "no answer within 7.0 s (ReadTimeout('slow'))",
        ),
    ],
)
async def test_the_vllm_server_backend_translates_httpx_errors(
    error: Exception, kind: type[Exception], message: str
) -> None:
    backend = VLLMServerBackend("http://127.0.0.1:9", rpc_timeout_s=7.0, transport=_failing(error))
    with pytest.raises(kind) as caught:
        await backend.server_info()
    assert str(caught.value) == f"GET http://127.0.0.1:9/server_info: {message}"
    assert caught.value.__cause__ is error
