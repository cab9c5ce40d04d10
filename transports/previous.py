"""The last good version, kept by a worker so that a failed refit can put it back.

With ``on_failure="serve_previous"`` (:class:`~aiosync.WeightSynchronizer`) every
worker is armed (:meth:`PreviousWeights`, through ``aiosync_keep_previous``): when a
refit of version *v* is about to write the live weights (:func:`begin_refit`, called
by every receiver where it turns the weights invalid), the worker copies them, as
they are, into a host buffer tagged *v*. A sync of *v* that fails or is cancelled
before its commit then asks each worker to put that copy back
(``aiosync_restore_previous(v)``): bit for bit the version the engine served before,
valid again, still labelled as it was. A worker the refit never wrote keeps what it
has. The cost: one copy of the worker's weights in host memory, allocated once, and
one device-to-host copy of them per sync that writes the worker.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import ParamSpec, TypeVar

import torch

from .validity import HoldsWeights, is_valid, mark_invalid

__all__ = ["PreviousWeights", "begin_refit", "receiving", "whole_receive"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class PreviousWeights:
    """A host copy of the tensors of ``modules`` (their ``state_dict``: parameters and
    buffers), taken before a refit writes them.

    Args:
        modules: what holds the worker's live weights (the model, a draft model).

    Attributes:
        version: the version whose refit the copy precedes (None: no copy yet).
    """

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        self._modules = list(modules)
        self.version: int | None = None
        self._saved: list[torch.Tensor] | None = None
        #: Held by a receive from its start to its end, whichever way it ends: a
        #: restore waits for it (a receive cut short on the trainer's side may still
        #: be writing when the restore arrives).
        self.receiving = threading.Lock()

    def _live(self) -> Iterable[torch.Tensor]:
        # One entry per storage: tied weights (embeddings and lm_head) once.
        seen: set[int] = set()
        for module in self._modules:
            for tensor in module.state_dict(keep_vars=True).values():
                key = id(tensor)
                if key not in seen:
                    seen.add(key)
                    yield tensor.detach()

    @property
    def nbytes(self) -> int:
        """Host bytes the copy takes: the live weights' (tied tensors once)."""
        return sum(t.numel() * t.element_size() for t in self._live())

    def keep(self, version: int) -> None:
        """Copy the live weights now: the refit of ``version`` is about to write them.
        The host buffers are allocated by the first call and reused after."""
        with torch.no_grad():
            live = list(self._live())
            if self._saved is None or [t.shape for t in self._saved] != [t.shape for t in live]:
                self._saved = [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in live]
            for saved, tensor in zip(self._saved, live, strict=True):
                saved.copy_(tensor)
        self.version = version

    def restore(self, version: int, timeout_s: float) -> bool:
        """Put back the copy taken before the refit of ``version``, once no receive is
        writing; False (nothing done) when the last copy preceded another version's
        refit.

        Raises:
            TimeoutError: a receive still ran after ``timeout_s`` seconds.
        """
        if not self.receiving.acquire(timeout=timeout_s):
            raise TimeoutError(f"a refit was still writing the weights after {timeout_s} s")
        try:
            return self._put_back(version)
        finally:
            self.receiving.release()

    def _put_back(self, version: int) -> bool:
        if self._saved is None or self.version != version:
            return False
        with torch.no_grad():
            for saved, tensor in zip(self._saved, self._live(), strict=True):
                tensor.copy_(saved)
        return True


@contextlib.contextmanager
def receiving(worker: object) -> Iterator[None]:
    """Hold an armed worker's :attr:`PreviousWeights.receiving` for a receive."""
    previous: PreviousWeights | None = getattr(worker, "aiosync_previous", None)
    if previous is None:
        yield
        return
    with previous.receiving:
        yield


def whole_receive(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate a worker's receive RPC (its first argument the worker): it runs under
    :func:`receiving`, so no restore lands while it may write."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with receiving(args[0]):
            return method(*args, **kwargs)

    return wrapper


def begin_refit(worker: HoldsWeights, version: int) -> None:
    """A refit of ``version`` is about to write ``worker``'s live weights: an armed
    worker (``aiosync_previous``) whose weights are one whole version copies them
    first (its first write of this refit only: after it the weights are invalid),
    then the weights turn invalid (:func:`~aiosync.transports.validity.mark_invalid`)."""
    previous: PreviousWeights | None = getattr(worker, "aiosync_previous", None)
    if previous is not None and is_valid(worker):
        previous.keep(version)
    mark_invalid(worker)
