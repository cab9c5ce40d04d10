"""The trainer's side of a refit: the source every transport reads, and its optional checks.

A :class:`RefitSource` yields the trainer's weights as the model's HF state dict;
:class:`GathersInto`, :class:`Preflight` and :class:`ConfigSource` are what a source
may also do, each a runtime-checkable Protocol. See ``docs/refit.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = ["ConfigSource", "GathersInto", "Preflight", "RefitManifest", "RefitSource"]

#: ``{hf_name: (shape, dtype)}`` in the order the source yields the tensors.
RefitManifest = dict[str, tuple[tuple[int, ...], "torch.dtype"]]


@runtime_checkable
class RefitSource(Protocol):
    """The trainer's side of every transport: its weights as the HF state dict.

    Names and shapes are those of the model's HF safetensors checkpoint (what
    ``save_pretrained`` writes and what the engine's ``load_weights`` takes),
    not the trainer's in-memory layout. Implementations: ``aiosync.refit.DTensorRefitSource``
    (torch, DTensor/FSDP2) and ``aiosync.refit.NNXRefitSource`` (JAX/flax NNX).
    Subclass this protocol explicitly to inherit the no-op offload hooks.
    """

    def prepare_refit_info(self) -> RefitManifest:
        """Return ``{hf_name: (shape, dtype)}``, ordered, identical on every rank."""
        ...

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield full, unsharded tensors in exactly the manifest's order, shape and dtype.

        On a sharded trainer every rank must iterate (gathers are collectives);
        only the source rank's tensors are sent.
        """
        ...

    def offload_before_refit(self) -> None:
        """Colocated only: free device memory (optimizer state) before the refit."""
        return None

    def offload_after_refit(self) -> None:
        """Colocated only: undo :meth:`offload_before_refit` after the refit, even on failure."""
        return None


@runtime_checkable
class GathersInto(Protocol):
    """A refit source that gathers a sharded tensor straight into memory the transport
    offers (``DTensorRefitSource`` does): the IPC sender offers its bucket's slot, so
    the gather is the trainer's only copy of those bytes."""

    def iter_weights_into(
        self, destination: Callable[[str], torch.Tensor | None]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`RefitSource.iter_weights`, except that a gathered tensor may be written
        into ``destination(hf_name)``: a contiguous tensor of the manifest's shape and
        dtype (called in the consumer's thread just before the gather), or None, when
        the source allocates as ``iter_weights`` does. A yielded tensor that is that
        destination holds the tensor's bytes already. Every rank gathers alike whatever
        its destination answers: the collectives stay matched."""
        ...


@runtime_checkable
class Preflight(Protocol):
    """A refit source that can tell, moving nothing, that a sync of it would be wrong
    (``DTensorRefitSource``: a tie the manifest relies on was broken, case C37).

    ``sync_weights`` calls :meth:`preflight` before it pauses the engine or moves a
    byte, so a refused sync leaves every engine exactly as it was. A sharded trainer's
    ranks run the same check at the start of their streams instead, where their
    votes keep them agreed."""

    def preflight(self) -> None:
        """Raise if a sync of this source must not start.

        Raises:
            RefitMismatchError: the source no longer matches its manifest.
        """
        ...


@runtime_checkable
class ConfigSource(Protocol):
    """A refit source that knows its model's HF config (``DTensorRefitSource`` does):
    the transports compare it with each engine's at init."""

    def hf_config(self) -> Any | None:
        """The trainer's HF config (a ``PretrainedConfig`` or its dict); None: unknown."""
        ...
