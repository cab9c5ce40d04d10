"""One actor call, awaited within its limit: :func:`remote`, the one place where Ray's
exceptions become aiosync's."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import ray
import ray.exceptions

from aiosync.errors import SyncTimeoutError, TransportError

if TYPE_CHECKING:
    from ._engine import RayEngine

__all__ = ["actor_label", "remote"]


async def remote(
    engine: RayEngine, method: str, limit_s: float | None, submit: Callable[[], Any]
) -> Any:
    """Submit one actor call (``submit()`` returns its ObjectRef) and await it within
    ``limit_s`` (None: no limit), translating Ray's errors into aiosync's: the one
    place where they are translated.

    * ``RayActorError`` (died, restarting, unavailable) -> :class:`TransportError`
      naming the actor (``__cause__``: Ray's error); the engine's weights count as
      discarded.
    * ``RayTaskError`` (an actor method raised) -> the original exception, its
      type and message kept (``__cause__``: Ray's error, with the remote traceback).
    * any other ``RayError`` (a crashed worker, a lost object) -> TransportError.
    * the limit passed -> :class:`SyncTimeoutError`. A call given up (timed out,
      cancelled) is cancelled in the actor too (``ray.cancel``).
    """
    ref = submit()
    try:
        with anyio.fail_after(math.inf if limit_s is None else limit_s):
            return await ref
    except BaseException as exc:
        label = actor_label(engine)
        if isinstance(exc, ray.exceptions.RayActorError):
            engine._actor_lost(exc)
            raise TransportError(
                f"{label} died (or is restarting) during {method}(): {_reason(exc)}"
            ) from exc
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause
            if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
                raise cause from exc
        if isinstance(exc, ray.exceptions.RayError):
            raise TransportError(f"{label}: {method}() failed in Ray: {_reason(exc)}") from exc
        with contextlib.suppress(Exception):
            ray.cancel(ref)
        if isinstance(exc, TimeoutError):
            raise SyncTimeoutError(f"{label} did not answer {method}() within {limit_s} s") from exc
        raise


def actor_label(engine: RayEngine) -> str:
    """The actor as error messages name it (id, engine, node, pid once known)."""
    info = engine._info
    if info is None:
        return "the engine actor"
    return f"engine actor {info.actor_id[:12]} ({info.engine}, node {info.node_ip}, pid {info.pid})"


def _reason(exc: BaseException) -> str:
    """Ray's message without its indented detail lines (ids, pids: they are in the
    label), e.g. ``"The actor died unexpectedly before finishing this task. The actor
    is dead because it was killed by `ray.kill`."``."""
    lines = [line.strip() for line in str(exc).splitlines() if line and not line[0].isspace()]
    return " ".join(lines) or type(exc).__name__
