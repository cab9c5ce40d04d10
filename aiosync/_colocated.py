"""The colocated bracket: what every colocated transport does around its transfer.

The trainer offloads (``policy.offload_before_refit``), the engines wake their
weights, the transport moves the bytes, then, also after a failure or a cancellation
(shielded), the trainer reloads (``offload_after_refit``) and the engines wake their
KV cache. See ``docs/lifecycle.md``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.to_thread

from ._fanout import each_named
from .capabilities import Engine, SleepReporting, implements
from .sources import RefitSource

if TYPE_CHECKING:
    from .synchronizer import WeightSynchronizer

__all__ = ["colocated_refit", "wake_engines"]

_log = logging.getLogger("aiosync.synchronizer")


@contextlib.asynccontextmanager
async def colocated_refit(
    sync: WeightSynchronizer, engines: Sequence[Any] | None = None
) -> AsyncIterator[None]:
    """The colocated bracket around a transfer, for every colocated transport.

    Offloads the trainer (``policy.offload_before_refit``, in a worker thread), wakes
    each engine's weights, runs the block, then, also after a failure or cancellation
    (shielded): ``offload_after_refit`` and each engine's KV-cache wake, bounded by
    ``timeouts.rpc_s``, after a failure by ``timeouts.after_failure_s`` (the engine may
    be why it failed). An error of the clean-up after a failure is logged, never raised
    over the block's. Only a tag the engine may have released is woken
    (:class:`~aiosync.capabilities.SleepReporting`; one that does not say is woken).
    Engines are woken only where ``sync`` drives the generation.

    Args:
        engines: the engines to wake; default ``(sync.generation,)``.
    """
    failed = True
    try:
        await _offload_hook(sync.policy, "offload_before_refit")
        await wake_engines(sync, "weights", engines)
        yield
        failed = False
    finally:
        with anyio.CancelScope(shield=True):
            limit = sync.timeouts.after_failure_s if failed else sync.timeouts.rpc_s
            try:
                await _offload_hook(sync.policy, "offload_after_refit")
                with anyio.fail_after(limit):
                    await wake_engines(sync, "kv_cache", engines)
            except Exception as exc:
                if not failed:
                    raise
                _log.error(  # secondary: the block's own error carries the traceback
                    "colocated refit: the clean-up after a failed sync also failed: %s: %s",
                    type(exc).__name__,
                    exc,
                )


async def _offload_hook(policy: RefitSource, name: str) -> None:
    """Run the policy's offload hook ``name`` in a worker thread (it may move gigabytes),
    unless it is :class:`RefitSource`'s own no-op: a thread hop each way is a good part
    of a small sync's cost."""
    if getattr(type(policy), name, None) is getattr(RefitSource, name):
        return
    await anyio.to_thread.run_sync(getattr(policy, name))


async def wake_engines(
    sync: WeightSynchronizer, tag: str, engines: Sequence[Any] | None = None
) -> None:
    """Wake ``tag`` (``"weights"``, ``"kv_cache"``) on each engine that may have released it.

    Only an :class:`~aiosync.capabilities.Engine` is woken, and only when it may be
    asleep (:class:`~aiosync.capabilities.SleepReporting`; one that does not say is
    woken), and only where ``sync`` drives the generation. The engines are woken side by
    side; a failure names the engine.

    Args:
        engines: default ``(sync.generation,)``.
    """
    if not sync._drives_generation():
        return
    targets = tuple(
        e for e in (engines if engines is not None else (sync.generation,)) if implements(e, Engine)
    )
    await each_named(targets, lambda _i, e: _wake(e, tag), _engine_label(len(targets)))


def _engine_label(count: int) -> Callable[[int], str]:
    return lambda index: f"engine {index} of {count}"


def _may_sleep(engine: object, tag: str) -> bool:
    """Whether ``tag`` may be released on ``engine``: an engine that does not say is woken."""
    tags = cast(SleepReporting, engine).asleep_tags if implements(engine, SleepReporting) else None
    return tags is None or tag in tags


async def _wake(engine: Engine, tag: str) -> None:
    if _may_sleep(engine, tag):
        await engine.prepare_for_generation([tag])
