"""The in-flight policy on an embedded worker: who may start a request, who may take a step.

A :class:`GenerationGate` sits in front of every request (admission) and
between its decode steps (:meth:`HFModelRunner.decode`'s ``gate``). While the
worker is paused no request is admitted (callers wait until
:meth:`GenerationGate.resume`), and the requests already running follow the
pause's mode:

* ``"abort"``: each ends before its next step, keeping the tokens it has,
  marked aborted; :meth:`GenerationGate.pause` returns once all have ended.
* ``"wait"``: each runs to its end; :meth:`~GenerationGate.pause` returns then.
* ``"keep"``: each stops before its next step and waits there, its KV cache
  kept; :meth:`~GenerationGate.pause` returns once none is inside a step, and
  they continue after :meth:`~GenerationGate.resume` (the weights loaded
  meanwhile compute their remaining tokens).

Threads: requests run in the worker's RPC threads, pause and resume in others;
one ``threading.Condition`` orders them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["GenerationGate", "RequestTicket"]

_MODES = ("abort", "wait", "keep")


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
