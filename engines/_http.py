"""How an HTTP engine client's httpx errors become aiosync's: one table for every client.

The SGLang client (``sglang/_client.py``) and vLLM's server backend
(``vllm/server.py``) send each request inside ``with map_exceptions(http_errors(...))``
(:func:`aiosync.errors.map_exceptions`).
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from aiosync.errors import ExceptionMapping, SyncTimeoutError, TransportError

__all__ = ["http_errors"]


def http_errors(where: str, timed_out: Callable[[BaseException], str]) -> ExceptionMapping:
    """httpx's timeouts -> :class:`SyncTimeoutError` (``timed_out(exc)`` its message), any
    other httpx error (a refused connection, a dropped answer) -> :class:`TransportError`
    naming the request ``where`` and httpx's error."""
    return {
        httpx.TimeoutException: lambda exc: SyncTimeoutError(timed_out(exc)),
        httpx.HTTPError: lambda exc: TransportError(f"{where}: {type(exc).__name__}: {exc}"),
    }
