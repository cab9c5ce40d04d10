"""The synchronizer's side of ``on_failure="serve_previous"``: arm the workers, and put
the previous version back after a failed sync (the workers' side:
:mod:`aiosync.transports.previous`; ``docs/fleets.md``). Torch-free."""

from __future__ import annotations

import logging
from typing import Any

import anyio

from .capabilities import EngineWorkers, implements
from .errors import UnsupportedOptionError

__all__ = ["arm_previous", "restore_previous"]

_log = logging.getLogger(__name__)


async def arm_previous(engine: Any, timeout_s: float) -> int:
    """Every worker of ``engine`` keeps a host copy of its weights from now on
    (``aiosync_keep_previous``); returns the host bytes they keep, all together.

    Raises:
        UnsupportedOptionError: the engine has no workers (``collective_rpc``) or they
            cannot keep a copy (vLLM), before any byte moves.
    """
    if not implements(engine, EngineWorkers):
        raise UnsupportedOptionError(
            f"on_failure='serve_previous': {type(engine).__name__} has no workers "
            "(collective_rpc) to keep the previous version"
        )
    try:
        reserved = await engine.collective_rpc(
            "aiosync_keep_previous", (True,), timeout_s=timeout_s
        )
    except NotImplementedError as exc:
        raise UnsupportedOptionError(f"on_failure='serve_previous': {exc}") from exc
    return sum(int(n) for n in reserved)


async def restore_previous(engine: Any, version: int, limit_s: float) -> bool:
    """After the sync of ``version`` failed, before the engine resumes: every worker puts
    back the weights it held before that refit wrote them (``aiosync_restore_previous``,
    each once its receive ended). Shielded, bounded by ``limit_s`` seconds. Returns
    whether all did; a worker that could not (dead, respawned, its weights discarded)
    leaves the engine refusing, as with ``"refuse"``, and is logged."""
    if not implements(engine, EngineWorkers):
        return False
    try:
        with anyio.CancelScope(shield=True), anyio.fail_after(limit_s):
            await engine.collective_rpc(
                "aiosync_restore_previous", (version, limit_s), timeout_s=limit_s
            )
    except Exception as exc:
        _log.error(
            "on_failure='serve_previous': the previous version could not be put back after "
            "version %d failed (the engine refuses until a sync succeeds): %s: %s",
            version,
            type(exc).__name__,
            exc,
        )
        return False
    return True
