"""A sharded trainer's ranks agree on every tensor of the source, one vote per tensor.

The source's gathers (``DTensor.full_tensor``) are collectives that every rank
must call in the same order. A rank whose source raises between two gathers
cannot take part in the remaining ones: its iterator is finished, and a lone
``all_gather_object`` against the others' tensor gather is a collective mismatch
(gloo aborts the process: ``op.preamble.length <= op.nbytes``). So every rank
votes after each tensor it read (or failed to read), before the next gather:
the ranks leave the source together, at the same tensor, and every one knows
which rank failed and why.

A rank that died (SIGKILL) makes gloo's next collective raise a raw
``RuntimeError`` (``Connection reset by peer``); :func:`collective_error` turns it
into a :class:`~aiosync.TransportError` naming the dead rank, found among the
ranks' processes (a colocated trainer's ranks share the engine's host).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any

from aiosync.errors import TransportError

from .._wire import error_fields, rebuild_error

__all__ = ["RankVotes", "collective_error", "process_alive"]

#: How long a survivor looks for the dead rank after gloo failed, seconds: the
#: peer's socket closes while its process is still exiting.
_DEATH_GRACE_S = 2.0
#: Poll interval of that search, seconds.
_DEATH_POLL_S = 0.05


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /proc: trust the kill below
    state = stat.rpartition(")")[2].split()[:1]
    return state not in (["Z"], ["X"])


def collective_error(
    exc: BaseException, processes: Sequence[tuple[str, int]], own_rank: int, what: str
) -> TransportError:
    """The typed error of a failed collective among the trainer's ranks.

    Args:
        exc: what ``torch.distributed`` raised (gloo's ``RuntimeError`` or
            ``DistNetworkError``).
        processes: every rank's ``(hostname, pid)``, in rank order (gathered at init).
        own_rank: this rank.
        what: the collective, for the message (``"the ranks' vote on tensor 4"``).

    Returns:
        :class:`TransportError` ``"trainer rank r died (process pid) during
        {what}: {exc}"`` when rank ``r``'s process on this host is gone (looked
        for up to :data:`_DEATH_GRACE_S` seconds), else ``"{what} failed: {exc}"``.
    """
    host = socket.gethostname()
    deadline = time.monotonic() + _DEATH_GRACE_S
    while True:
        dead = [
            (rank, pid)
            for rank, (rank_host, pid) in enumerate(processes)
            if rank != own_rank and rank_host == host and not process_alive(pid)
        ]
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(_DEATH_POLL_S)
    if dead:
        names = ", ".join(f"trainer rank {rank} died (process {pid})" for rank, pid in dead)
        return TransportError(f"{names} during {what}: {exc}")
    return TransportError(f"{what} failed: {exc}")


class RankVotes:
    """Wraps a sharded source's iterator with one vote per tensor (see module docs).

    Iterating yields the source's ``(name, tensor)`` pairs; after each ``next()``
    on the source (a gathered tensor, its end, or its error) every rank
    ``all_gather_object``s its outcome over ``group``.

    Args:
        weights: this rank's ``iter_weights()`` iterator.
        group: the trainer's ``torch.distributed`` group (gloo).
        rank: this rank in ``group``.
        processes: every rank's ``(hostname, pid)`` (see :func:`collective_error`).

    Attributes:
        verdict: None while every rank read on; else the error every rank raises
            (this rank's own if it failed first, else the failed rank's rebuilt
            with its type and named ``trainer rank r: ...``, or a
            :class:`TransportError` naming a dead rank).
    """

    def __init__(
        self,
        weights: Iterator[tuple[str, Any]],
        group: Any,
        rank: int,
        processes: Sequence[tuple[str, int]],
    ) -> None:
        self._weights = weights
        self._group = group
        self._rank = rank
        self._processes = list(processes)
        self.verdict: BaseException | None = None
        self._count = 0
        self._ended = False

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self

    def __next__(self) -> tuple[str, Any]:
        if self.verdict is not None:
            raise self.verdict
        if self._ended:
            raise StopIteration
        item: tuple[str, Any] | None = None
        failed: Exception | None = None
        try:
            item = next(self._weights)
        except StopIteration:
            pass
        except Exception as exc:  # voted on below, then raised on every rank
            failed = exc
        index = self._count
        self._count += 1
        outcome = None if failed is None else error_fields(failed)
        outcomes = self._vote(outcome, f"the trainer ranks' vote on tensor {index}")
        for rank, fields in enumerate(outcomes):
            if fields is not None:
                if rank == self._rank and failed is not None:
                    self.verdict = failed
                else:
                    self.verdict = rebuild_error(fields, f"trainer rank {rank}")
                    self.verdict.__cause__ = failed
                raise self.verdict
        if item is None:
            self._ended = True
            raise StopIteration
        return item

    def _vote(self, outcome: dict[str, str] | None, what: str) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * len(self._processes)
        try:
            dist.all_gather_object(out, outcome, group=self._group)
        except Exception as exc:  # gloo's RuntimeError / DistNetworkError: a rank is gone
            self.verdict = collective_error(exc, self._processes, self._rank, what)
            raise self.verdict from exc
        return out


def own_process() -> tuple[str, int]:
    """This rank's ``(hostname, pid)``, gathered at init for :func:`collective_error`."""
    return socket.gethostname(), os.getpid()
