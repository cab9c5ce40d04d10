"""The in-flight policy (``/pause``, ``/resume``, ``/abort_requests``), the commit of a
version and sleeping and waking (``/sleep``, ``/wake_up``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from aiosync.capabilities import (
    IN_FLIGHT_POLICIES,
    InFlightPolicy,
)
from aiosync.errors import (
    TransportError,
)

if TYPE_CHECKING:
    pass

from aiosync.engines.vllm.server._weights import _WeightRoutes
from aiosync.engines.vllm.server._wire import _WAKE_TAGS, _bool_field, _log


class _InFlight(_WeightRoutes):
    """Pausing, committing and sleeping."""

    # -- the in-flight policy ----------------------------------------------------------

    async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True) -> None:
        """Stop generation for a sync: ``POST /pause?mode=...``, then drop the prefix cache.

        New :meth:`generate_with_meta` calls of this backend wait (up to their
        ``timeout_s``) until :meth:`resume_generation`; the server queues every
        client's new requests. Running requests:

        * ``"abort"``: end now with their tokens (finish reason ``"abort"``);
          returns once this backend's running calls have their last chunk.
          Where the server has ``/abort_requests`` (vLLM 0.32.0, 0.34.0): ``POST
          /pause?mode=keep``, then ``POST /abort_requests {}``. The scheduler stops
          first, then every request the server holds ends (any client's, and any
          that arrived between the two calls); requests sent after that are
          queued until the resume, on every release. (``/pause?mode=abort`` also
          pauses, but vLLM 0.34 answers requests sent during that pause with 503
          ``RetryableRequestError``; a sync should delay the other clients'
          rollouts, not fail them.) Without ``/abort_requests``, or when the
          server publishes no ``/openapi.json``: ``POST /pause?mode=abort``.
        * ``"wait"``: the server answers once they finished on the old weights;
          returns once this backend's calls have their last chunk.
        * ``"keep"``: frozen between two tokens; they continue after the resume,
          their remaining tokens computed by the weights the server then holds.

        ``clear_cache``: the prefix cache is reset explicitly with
        ``POST /reset_prefix_cache`` once the pause is complete (for ``"keep"``
        with ``reset_running_requests=true``: the frozen requests give up their
        KV blocks and recompute them with the new weights on resume). The
        route's own ``clear_cache`` query is deprecated and ignored with
        ``mode=keep`` (``vllm/entrypoints/rl/online/api_router.py``, 0.32), so
        it is always sent ``false`` and never relied on.

        Raises:
            ValueError: an unknown ``mode`` (before any request).
            TransportError: the server failed the pause or refused to drop its
                prefix cache; generation is resumed before it is raised.
            SyncTimeoutError: not done within ``rpc_timeout_s``; generation is
                resumed before it is raised.
        """
        if mode not in IN_FLIGHT_POLICIES:
            raise ValueError(f"unknown in-flight mode {mode!r}; known: {list(IN_FLIGHT_POLICIES)}")
        abort_route = mode == "abort" and await self._serves("/abort_requests") is True
        self._committed_in_pause = None
        async with self._gate.pausing(
            self.rpc_timeout_s,
            self.resume_generation,
            timeout_message=f"pause_generation({mode!r}) of {self.base_url} did not complete "
            f"within {self.rpc_timeout_s} s",
            where=self.base_url,
            log=_log,
        ):
            if abort_route:
                # Frozen first, so that nothing is computed between the two calls;
                # then everything the server holds ends with finish reason "abort".
                await self._request("POST", "/pause", params={"mode": "keep", "clear_cache": False})
                await self._request("POST", "/abort_requests", body={})
            else:
                await self._request("POST", "/pause", params={"mode": mode, "clear_cache": False})
            if mode != "keep":
                await self._gate.drained()
            if clear_cache:
                await self._reset_prefix_cache(preempt=mode == "keep")

    async def resume_generation(self) -> None:
        """``POST /resume``: the server schedules again (frozen ``"keep"`` requests
        continue) and this backend's held calls run. Idempotent.

        Raises:
            TransportError, SyncTimeoutError: the server failed the resume (held
                calls are let through all the same).
        """
        if self._committed_in_pause is not None:
            # From here the server computes with the committed weights.
            self._set_computing(self._committed_in_pause)
            self._committed_in_pause = None
        self._gate.resume()
        await self._request("POST", "/resume")

    async def is_paused(self) -> bool:
        """``GET /is_paused``: whether the server's scheduler is paused (by any client).

        Raises:
            TransportError, SyncTimeoutError: the request failed.
        """
        return _bool_field(await self._request("GET", "/is_paused"), "is_paused", "/is_paused")

    @property
    def generation_paused(self) -> bool:
        """True between this backend's :meth:`pause_generation` and :meth:`resume_generation`."""
        return self._gate.paused

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """``POST /reset_prefix_cache``: drop the server's prefix cache; whether it did.

        Args:
            reset_running_requests: preempt running (or frozen) requests first,
                so that their KV blocks go too (they recompute them).

        Raises:
            TransportError, SyncTimeoutError: the request failed.
        """
        answer = await self._request(
            "POST",
            "/reset_prefix_cache",
            params={"reset_running_requests": reset_running_requests},
        )
        if not isinstance(answer, dict) or not isinstance(answer.get("success"), bool):
            raise TransportError(f"/reset_prefix_cache answered {str(answer)[:200]}")
        return answer["success"]

    async def _reset_prefix_cache(self, *, preempt: bool) -> None:
        if not preempt and await self.reset_prefix_cache():
            return
        # Requests hold KV blocks computed with the previous weights: preempt them.
        if not await self.reset_prefix_cache(reset_running_requests=True):
            raise TransportError(
                f"the vLLM server at {self.base_url} refused to reset its prefix cache "
                "even with the running requests preempted: KV computed with the previous "
                "weights would be reused"
            )

    # -- versions ----------------------------------------------------------------------

    async def on_weights_committed(self, version: int) -> None:
        """``POST /update_weight_version`` with ``str(version)``: ``/weight_info`` reports
        it from now on, and tokens this backend receives once the server computes
        with the new weights (after the resume, when the sync paused it) are
        labelled ``version``.

        Raises:
            TransportError, SyncTimeoutError: the request failed.
        """
        await self._request("POST", "/update_weight_version", body={"new_version": str(version)})
        if self._gate.paused:
            self._committed_in_pause = version
        else:
            self._set_computing(version)
        if self.record_checksums:
            await self._record_checksums(version)

    # -- waking and sleeping -----------------------------------------------------------

    def add_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever the server discards its weights (``sleep_level=2``)."""
        self._discard_listeners.append(listener)

    def remove_weights_discarded_listener(self, listener: Callable[[], None]) -> None:
        """Undo :meth:`add_weights_discarded_listener` (no error if absent)."""
        if listener in self._discard_listeners:
            self._discard_listeners.remove(listener)

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """Wake the server (``POST /wake_up?tags=...``; None: all) if this backend put it
        to sleep; waking the KV cache (``"kv_cache"`` or None) also drops the prefix
        cache, so no KV computed with the previous weights is reused after a refit.

        Raises:
            ValueError: an unknown tag.
            TransportError, SyncTimeoutError: the server failed, or refused to drop
                its prefix cache even with the running requests preempted.
        """
        wake = None if tags is None else list(tags)
        if wake is not None:
            unknown = sorted(set(wake) - _WAKE_TAGS)
            if unknown:
                raise ValueError(f"unknown wake-up tags {unknown}; known: {sorted(_WAKE_TAGS)}")
        if self._asleep:
            await self._request("POST", "/wake_up", params={"tags": wake or []})
            if wake is None or "kv_cache" in wake:
                self._asleep = False
        if wake is None or "kv_cache" in wake:
            await self._reset_prefix_cache(preempt=False)

    async def finish_generation(self) -> None:
        """``POST /sleep?level=sleep_level`` so the trainer gets the device memory back.

        A no-op, logged once, where the server has no sleep mode (started without
        ``--enable-sleep-mode``, or vLLM's CPU build). Level 2 discards the weights:
        the listeners are told before this returns.

        Raises:
            TransportError, SyncTimeoutError: the server failed.
        """
        if not await self.sleep_mode():
            if not self._warned_no_sleep:
                self._warned_no_sleep = True
                _log.warning(
                    "the vLLM server at %s has no sleep mode (--enable-sleep-mode, CUDA/ROCm/"
                    "XPU only): finish_generation() releases no memory",
                    self.base_url,
                )
            return
        if self._asleep:
            return
        try:
            await self._request("POST", "/sleep", params={"level": self.sleep_level})
        finally:
            # A failed sleep may have released part of it: assume it did.
            self._asleep = True
            if self.sleep_level >= 2:
                self._checksums = None  # the weights are gone: nothing to compare with
                for listener in list(self._discard_listeners):
                    listener()

    async def is_sleeping(self) -> bool:
        """``GET /is_sleeping``.

        Raises:
            TransportError, SyncTimeoutError: the request failed.
        """
        return _bool_field(
            await self._request("GET", "/is_sleeping"), "is_sleeping", "/is_sleeping"
        )
