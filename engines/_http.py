"""What every HTTP engine client shares: its httpx client, each request's limits, and the
one table by which httpx's errors become aiosync's.

The SGLang client (``sglang/_client.py``) and vLLM's server backend
(``vllm/server/``) build their client with :func:`http_client`, give each request
:func:`request_timeout` and send it inside ``with map_exceptions(http_errors(...))``
(:func:`aiosync.errors.map_exceptions`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import httpx

from aiosync.errors import ExceptionMapping, SyncTimeoutError, TransportError

__all__ = [
    "CONNECT_TIMEOUT_S",
    "answer_body",
    "http_client",
    "http_errors",
    "http_status",
    "request_timeout",
]

#: Limit for connecting to a server, seconds: it never legitimately takes long.
CONNECT_TIMEOUT_S = 10.0


def http_client(
    base_url: str,
    api_key: str | None,
    timeout_s: float,
    transport: httpx.AsyncBaseTransport | None,
) -> httpx.AsyncClient:
    """An httpx client of the server at ``base_url``: ``api_key`` sent as ``Authorization:
    Bearer`` (none: no header), ``timeout_s`` (seconds) each request's default limit."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url,
        headers=headers,
        timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
        transport=transport,
    )


def request_timeout(limit: float) -> httpx.Timeout:
    """One request's httpx limits: ``limit`` seconds in all (infinite: none), connecting
    within :data:`CONNECT_TIMEOUT_S` or ``limit`` if shorter."""
    if not math.isfinite(limit):
        return httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
    return httpx.Timeout(limit, connect=min(limit, CONNECT_TIMEOUT_S))


def http_errors(where: str, timed_out: Callable[[BaseException], str]) -> ExceptionMapping:
    """httpx's timeouts -> :class:`SyncTimeoutError` (``timed_out(exc)`` its message), any
    other httpx error (a refused connection, a dropped answer) -> :class:`TransportError`
    naming the request ``where`` and httpx's error."""
    return {
        httpx.TimeoutException: lambda exc: SyncTimeoutError(timed_out(exc)),
        httpx.HTTPError: lambda exc: TransportError(f"{where}: {type(exc).__name__}: {exc}"),
    }


def answer_body(response: httpx.Response) -> Any:
    """A 2xx answer's body: None when empty, the JSON value, or else the text."""
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text


def http_status(exc: TransportError) -> int | None:
    """The HTTP status of a non-2xx answer a client's request raised ``exc`` for
    (``vars(exc)["http_status"]``), None for other errors. (Kept on the instance, not
    in a subclass: the fan-out renames aiosync errors by their exact type.)"""
    status = vars(exc).get("http_status")
    return status if isinstance(status, int) else None
