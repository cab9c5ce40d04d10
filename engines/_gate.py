"""The pause gate of aiosync's engines, in two twins: threads and anyio.

:class:`GenerationGate` (threads) sits in front of every request of an embedded
worker (admission) and between its decode steps (:meth:`HFModelRunner.decode`'s
``gate``). While paused no request is admitted (callers wait until
:meth:`GenerationGate.resume`), and the requests already running follow the
pause's mode:

* ``"abort"``: each ends before its next step, keeping the tokens it has,
  marked aborted; :meth:`GenerationGate.pause` returns once all have ended.
* ``"wait"``: each runs to its end; :meth:`~GenerationGate.pause` returns then.
* ``"keep"``: each stops before its next step and waits there, its KV cache
  kept; :meth:`~GenerationGate.pause` returns once none is inside a step, and
  they continue after :meth:`~GenerationGate.resume` (the weights loaded
  meanwhile compute their remaining tokens).

Requests run in the worker's RPC threads, pause and resume in others; one
``threading.Condition`` orders them.

:class:`AdmissionGate` (anyio, one event loop) admits an engine object's
``generate`` calls in the trainer's process: the embedded engine and the vLLM
backend hold new calls there while a sync pauses them, and the vLLM backend
holds them while a LoRA adapter loads (:meth:`AdmissionGate.exclusive`). What
running requests do is the engine's business (its workers' gate, vLLM's scheduler).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import anyio

from aiosync.capabilities import IN_FLIGHT_POLICIES
from aiosync.errors import SyncError, SyncTimeoutError

__all__ = ["AdmissionGate", "GenerationGate", "RequestTicket"]

_MODES = IN_FLIGHT_POLICIES


@dataclass
class RequestTicket:
    """One admitted request's standing at the gate (see :class:`GenerationGate`)."""

    aborted: bool = False
    in_step: bool = False
    #: Decode steps started so far (tokens computed or being computed).
    steps: int = 0


class GenerationGate:
    """Admission and per-step gate of one worker's requests (the module docs)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._mode: str | None = None
        # Bumped by every pause and resume, so that a pause superseded by a
        # resume (its caller gave up) stops waiting.
        self._epoch = 0
        self._tickets: list[RequestTicket] = []

    @property
    def mode(self) -> str | None:
        """The pause in force (``"abort"``, ``"wait"``, ``"keep"``), None when running."""
        return self._mode

    def progress(self) -> list[int]:
        """Per request admitted and not yet ended (frozen ones included), the
        decode steps it started, in admission order."""
        with self._cond:
            return [t.steps for t in self._tickets]

    @contextlib.contextmanager
    def request(self) -> Iterator[RequestTicket]:
        """Admit one request (waiting while paused); the block is the request's life."""
        with self._cond:
            while self._mode is not None:
                self._cond.wait()
            ticket = RequestTicket()
            self._tickets.append(ticket)
        try:
            yield ticket
        finally:
            with self._cond:
                self._tickets.remove(ticket)
                self._cond.notify_all()

    def step(self, ticket: RequestTicket) -> bool:
        """Before each decode step: False ends the request (aborted); blocks while
        paused in ``"keep"`` mode."""
        with self._cond:
            if ticket.in_step:
                ticket.in_step = False
                self._cond.notify_all()
            while not ticket.aborted and self._mode == "keep":
                self._cond.wait()
            if ticket.aborted:
                return False
            ticket.in_step = True
            ticket.steps += 1
            return True

    def pause(self, mode: str) -> int:
        """Stop admitting requests and apply ``mode`` to the running ones; returns,
        per the module docs, once that holds, with the number of requests still
        admitted (frozen ones in ``"keep"`` mode, else 0).

        Raises:
            ValueError: an unknown ``mode``.
        """
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        with self._cond:
            self._mode = mode
            self._epoch += 1
            epoch = self._epoch
            if mode == "abort":
                for ticket in self._tickets:
                    ticket.aborted = True
            self._cond.notify_all()

            def settled() -> bool:
                if mode == "keep":
                    return not any(t.in_step for t in self._tickets)
                return not self._tickets

            while not settled() and self._epoch == epoch:
                self._cond.wait()
            return len(self._tickets)

    def resume(self) -> None:
        """Admit requests again and let frozen ones continue. Idempotent."""
        with self._cond:
            self._mode = None
            self._epoch += 1
            self._cond.notify_all()


class AdmissionGate:
    """Admission of an engine object's ``generate`` calls (the module docs).

    Args:
        engine: how errors name the engine (``"the vLLM engine"``).
    """

    def __init__(self, engine: str) -> None:
        self._engine = engine
        self._running = 0
        self._loading = False
        self._paused = False
        #: Requests of the running calls that the engine has started answering
        #: and not finished (the vLLM backend counts its ``AsyncLLM`` streams):
        #: :meth:`drained` waits for them. Call :meth:`notify` after a change.
        self.streaming = 0
        self._changed: anyio.Event | None = None

    @property
    def paused(self) -> bool:
        """True between :meth:`pause` and :meth:`resume`."""
        return self._paused

    @property
    def running(self) -> int:
        """The calls admitted and not yet ended."""
        return self._running

    async def _wait(self) -> None:
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

    def notify(self) -> None:
        """Wake every waiter to look again (after :attr:`streaming` changed)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    @contextlib.asynccontextmanager
    async def shared(self, timeout_s: float) -> AsyncIterator[float]:
        """Admit one call (waiting while paused or loading); the block is its life.
        Yields what is left of ``timeout_s``, seconds.

        Raises:
            SyncTimeoutError: still paused (or loading) after ``timeout_s`` seconds.
        """
        start = anyio.current_time()
        try:
            with anyio.fail_after(timeout_s):
                while self._loading or self._paused:
                    await self._wait()
        except TimeoutError as exc:
            why = "paused for a sync" if self._paused else "loading a LoRA adapter"
            raise SyncTimeoutError(
                f"generate waited {timeout_s} s for {self._engine}, still {why}"
            ) from exc
        # No await between the wait above and the count: a pause either sees
        # this call running or admits nothing.
        self._running += 1
        try:
            yield max(0.0, timeout_s - (anyio.current_time() - start))
        finally:
            self._running -= 1
            self.notify()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the gate alone: wait for the running calls to end; calls that
        arrive meanwhile wait until the block ends."""
        while self._loading:
            await self._wait()
        self._loading = True
        try:
            while self._running:
                await self._wait()
            yield
        finally:
            self._loading = False
            self.notify()

    def pause(self) -> None:
        """Hold every later call until :meth:`resume`."""
        self._paused = True

    @contextlib.asynccontextmanager
    async def pausing(
        self,
        limit_s: float,
        resume: Callable[[], Awaitable[None]],
        *,
        timeout_message: str,
        where: str,
        log: logging.Logger,
    ) -> AsyncIterator[None]:
        """An engine's ``pause_generation``, its block what pauses the engine: later
        calls are held (:meth:`pause`) and the block is bounded by ``limit_s`` seconds.

        On any failure of the block (its cancellation too) the engine is resumed
        first, ``resume()`` shielded and bounded by ``limit_s``, so a failed pause
        leaves nothing held; a resume that fails with a :class:`~aiosync.SyncError`
        is one line on ``log`` (naming ``where``), the pause's error being the one
        raised.

        Raises:
            SyncTimeoutError: ``timeout_message``: the block ran past ``limit_s``.
            Whatever the block raised.
        """
        self.pause()
        try:
            with anyio.fail_after(limit_s):
                yield
        except BaseException as exc:
            with anyio.CancelScope(shield=True), anyio.move_on_after(limit_s):
                try:
                    await resume()
                except SyncError as resume_exc:  # secondary: the pause's error has the traceback
                    log.error(
                        "resuming %s after a failed pause: %s: %s",
                        where,
                        type(resume_exc).__name__,
                        resume_exc,
                    )
            if isinstance(exc, TimeoutError) and not isinstance(exc, SyncError):
                raise SyncTimeoutError(timeout_message) from exc
            raise

    def resume(self) -> None:
        """Admit calls again. Idempotent."""
        self._paused = False
        self.notify()

    async def idle(self) -> None:
        """Wait until no admitted call runs."""
        while self._running:
            await self._wait()

    async def drained(self) -> None:
        """Wait until :attr:`streaming` is 0."""
        while self.streaming:
            await self._wait()
