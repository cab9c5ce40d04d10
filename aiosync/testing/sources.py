"""``StateDictSource``: a ``RefitSource`` over a plain ``{hf_name: tensor}`` dict.

The trainer of tests, benchmarks and ``aiosync bench``: no model, no gather, just tensors in
checkpoint names. For an ``nn.Module`` (plain, DTensor or FSDP2) use
:class:`aiosync.refit.DTensorRefitSource`. See ``docs/sglang-test-server.md`` for the
engine side of the same toolbox.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType

import torch

from aiosync.errors import RefitMismatchError
from aiosync.sources import RefitManifest, RefitSource

__all__ = ["StateDictSource"]


class StateDictSource(RefitSource):
    """The trainer's weights as an ordered ``{hf_name: tensor}`` dict, streamed as they are.

    Names are the HF checkpoint's (what the engine's ``load_weights`` takes); the dict's
    order is the manifest's and the stream's. The tensors are held by reference: an
    in-place change (``tensor.add_(1.0)``, an optimizer step on the same storage) is what
    the next sync sends, and :meth:`update` swaps one tensor for another of the same shape
    and dtype. The manifest is therefore fixed at construction.

    Args:
        state_dict: ``{hf_name: tensor}``, any shapes and dtypes, on any device, in the
            order the engine should receive them. May be empty (a transport's fixed cost).

    Raises:
        TypeError: a name is not a ``str`` or a value is not a ``torch.Tensor``.
    """

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in state_dict.items():
            if not isinstance(name, str):
                raise TypeError(f"state dict names must be str, got {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        self._tensors: dict[str, torch.Tensor] = dict(state_dict)

    @classmethod
    def random(cls, manifest: RefitManifest, *, seed: int = 0) -> StateDictSource:
        """Tensors of ``manifest``'s names, shapes and dtypes, standard normal (CPU).

        Drawn in float32 from ``torch.Generator().manual_seed(seed)`` in manifest order,
        then cast, so one ``(manifest, seed)`` gives the same bytes everywhere.
        """
        gen = torch.Generator().manual_seed(seed)
        return cls(
            {
                name: torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
                for name, (shape, dtype) in manifest.items()
            }
        )

    @property
    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """The live tensors, read-only mapping (mutate the tensors, or use :meth:`update`)."""
        return MappingProxyType(self._tensors)

    def prepare_refit_info(self) -> RefitManifest:
        """``{hf_name: (shape, dtype)}`` in dict order; a fresh dict on every call."""
        return {name: (tuple(t.shape), t.dtype) for name, t in self._tensors.items()}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` in manifest order: the held tensors, not copies."""
        yield from list(self._tensors.items())

    def update(self, name: str, tensor: torch.Tensor) -> None:
        """Replace ``name``'s tensor; the next sync sends the new one.

        Raises:
            KeyError: ``name`` is not in the state dict.
            RefitMismatchError: ``tensor``'s shape or dtype differs from the manifest's
                (the engine was told the manifest; it cannot change between syncs).
        """
        old = self._tensors[name]
        if tuple(tensor.shape) != tuple(old.shape) or tensor.dtype != old.dtype:
            raise RefitMismatchError(
                f"{name!r}: the manifest says {tuple(old.shape)} {old.dtype}, "
                f"got {tuple(tensor.shape)} {tensor.dtype}"
            )
        self._tensors[name] = tensor
