"""``NNXRefitSource``: a JAX (flax NNX) trainer's weights as the engine's HF state dict."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from aiosync.sources import RefitManifest, RefitSource

from .convert import as_torch_dtype
from .table import ModelMap

__all__ = ["NNXRefitSource"]


class NNXRefitSource(RefitSource):
    """The :class:`aiosync.RefitSource` of a flax NNX model or state.

    Args:
        state_or_model: an ``nnx.Module`` (its ``nnx.Param`` state is read
            afresh on every call, so in-place optimizer updates are seen), an
            ``nnx.State``, or a nested ``dict`` of ``jax.Array`` in the map's
            NNX layout. After a functional update, pass the new state to
            :meth:`update_state`.
        model_map: the family's :class:`~aiosync.refit.nnx.table.ModelMap`
            (``aiosync.refit.model_map_for(hf_config)``).
        dtype: the engine's dtype (e.g. ``torch.bfloat16`` for fp32 master
            weights); every floating-point tensor is cast on the JAX arrays'
            device before it is yielded (integer and bool tensors keep theirs,
            as with ``aiosync.refit.DTensorRefitSource``). Default: each array's own dtype.
        contiguous: yield contiguous tensors (default). ``False`` yields a
            transposed kernel or an unstacked expert as a strided view of the
            JAX buffer, saving a copy when the consumer packs into its own
            buffer anyway (every aiosync transport does, through
            ``aiosync.transports.packing.pack``).

    Names, shapes and order are those of the HF checkpoint (the table order:
    embeddings, layers in order, final norm, ``lm_head`` when untied), with
    per-expert names for Qwen3-MoE/Qwen3-Next and fused experts for Gemma 4.
    On a multi-process (sharded) trainer every process must iterate: gathering
    a non-addressable array is a collective.
    """

    def __init__(
        self,
        state_or_model: Any,
        model_map: ModelMap,
        *,
        dtype: Any = None,
        contiguous: bool = True,
    ) -> None:
        if not isinstance(model_map, ModelMap):
            raise TypeError(f"model_map must be a ModelMap, got {type(model_map).__name__}")
        self.model_map = model_map
        self.dtype: torch.dtype | None = None if dtype is None else as_torch_dtype(dtype)
        self.contiguous = contiguous
        self._source = state_or_model

    def hf_config(self) -> Any | None:
        """The HF config the model map was built from (``model_map_for(config)``
        records it), which the transports compare with each engine's at init
        (:class:`aiosync.sources.ConfigSource`); None: the map has none."""
        return self.model_map.hf_config

    def update_state(self, state: Any) -> None:
        """Refit from ``state`` (an ``nnx.State`` or nested dict) from now on."""
        self._source = state

    def _params(self) -> Any:
        src = self._source
        try:
            from flax import nnx
        except ImportError:  # a plain dict of arrays needs no flax
            return src
        if isinstance(src, nnx.Module):
            return nnx.state(src, nnx.Param)
        return src

    def prepare_refit_info(self) -> RefitManifest:
        """``{hf_name: (shape, torch dtype)}`` in stream order; reads no array data.

        Raises:
            RefitMismatchError: the NNX state does not match the map (a missing,
                unknown or misshapen array, named with its HF name).
        """
        return self.model_map.manifest(self._params(), dtype=self.dtype)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` one at a time, in manifest order.

        Each tensor is in the manifest's shape and dtype, contiguous unless
        ``contiguous=False``, on the JAX arrays' device (DLPack on GPU, a numpy
        view on CPU). It may share memory with the JAX array when no copy was
        needed: read it, never write to it.

        Raises:
            RefitMismatchError: as :meth:`prepare_refit_info`, before any tensor.
        """
        return self.model_map.to_hf(self._params(), dtype=self.dtype, contiguous=self.contiguous)
