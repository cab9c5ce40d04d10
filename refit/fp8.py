"""FP8 refits: the block-wise FP8 checkpoint of a model, streamed from any refit source.

:class:`FP8RefitSource` wraps a :class:`~aiosync.sources.RefitSource` and yields
what an FP8 checkpoint of the model holds, in the layout of the Qwen3-FP8 checkpoints
and of transformers' ``FineGrainedFP8Config`` (``quant_method "fp8"``,
``weight_block_size [128, 128]``): every quantized linear weight as ``<module>.weight``
(``float8_e4m3fn``, the weight's shape) followed by ``<module>.weight_scale_inv``
(``float32``, ``[out/128, in/128]``), everything else in bf16, a linear weight whose
shape is not whole blocks included (transformers leaves it unquantized; see
:mod:`aiosync.fp8`). Bit for bit what transformers writes, except the
``weight_scale_inv`` it writes beside such a bf16 weight (uninitialized memory no
loader reads), which is not sent.

The quantizer (:func:`quantize_fp8_blocks`) is transformers 5.24's own (unchanged in 5.25)
(``integrations/finegrained_fp8.py``, ``Fp8Quantize._quantize_one``), op for op, so its
tensors are bit-identical to transformers'. The dequantizer
(:func:`dequantize_fp8_blocks`) is what ``from_pretrained`` of such a checkpoint
computes (``Fp8Dequantize._dequantize_one``: the product in float32, then one cast).
:func:`~aiosync.fp8.fp8_manifest` (core, :mod:`aiosync.fp8`) is the one rule,
shared by this source and the embedded engine's loader
(``EmbeddedEngine(quantization="fp8")``), of which tensors are quantized: the two
sides cannot drift apart; the codec's names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from aiosync.errors import RefitMismatchError
from aiosync.fp8 import (
    DEFAULT_MODULES_TO_NOT_CONVERT,
    FP8_BLOCK_SIZE,
    FP8_DTYPE,
    check_block_size,
    dequantize_fp8_blocks,
    fp8_manifest,
    fp8_scale_name,
    quantize_fp8_blocks,
)
from aiosync.sources import ConfigSource, RefitManifest, RefitSource

__all__ = [
    "DEFAULT_MODULES_TO_NOT_CONVERT",
    "FP8_BLOCK_SIZE",
    "FP8_DTYPE",
    "FP8RefitSource",
    "dequantize_fp8_blocks",
    "fp8_manifest",
    "fp8_scale_name",
    "quantize_fp8_blocks",
]


class FP8RefitSource(RefitSource):
    """A refit source yielding the FP8 checkpoint of what ``source`` yields.

    For each tensor of ``source`` in its order: a quantized weight (see
    :func:`fp8_manifest`: 2-D floating ``<module>.weight`` of whole blocks, module
    not in ``modules_to_not_convert``) is yielded as ``<module>.weight``
    (``float8_e4m3fn``) then ``<module>.weight_scale_inv`` (``float32``
    ``[out/bm, in/bn]``), quantized by :func:`quantize_fp8_blocks`
    (transformers' quantizer, bit for bit) on the tensor's device, from the
    tensor as the source yields it (fp32 master weights quantize from fp32; give
    the source ``dtype=torch.bfloat16`` to quantize what a bf16 model's
    ``save_pretrained`` would); every other
    floating tensor is cast to ``dtype`` (bf16: what the FP8 checkpoints store
    besides the linear weights); the rest is yielded as it is.
    :meth:`prepare_refit_info` describes exactly that stream.

    Blocks are taken over FULL tensors: ``source.iter_weights()`` yields them
    whole (a :class:`~aiosync.refit.DTensorRefitSource` gathers each one first),
    so an FSDP shard boundary that cuts a 128-row block does not matter; on a
    sharded trainer every rank iterates and quantizes (only the source rank's
    result is sent). The shard-aware transport, which sends each rank's shards
    without a gather, refuses it on a sharded trainer (it takes a
    ``DTensorRefitSource`` there).

    Args:
        source: the unquantized source (bf16/fp32 weights, HF checkpoint names).
        block_size: ``(rows, columns)`` of a scaling block; default 128 x 128.
        modules_to_not_convert: transformers' ``modules_to_not_convert`` patterns
            (a module prefix up to a ``.``, a regex with that boundary, or a suffix):
            their weights are not quantized. Default :data:`DEFAULT_MODULES_TO_NOT_CONVERT`.
        dtype: dtype of the floating tensors that are not quantized; None: the source's.

    Raises:
        TypeError: ``source`` is not a refit source (or is already an FP8 one), or
            ``dtype`` is not a floating dtype of two bytes or more.
        ValueError: ``block_size`` is not two positive ints.
    """

    def __init__(
        self,
        source: RefitSource,
        *,
        block_size: tuple[int, int] = FP8_BLOCK_SIZE,
        modules_to_not_convert: Sequence[str] = DEFAULT_MODULES_TO_NOT_CONVERT,
        dtype: torch.dtype | None = torch.bfloat16,
    ) -> None:
        if isinstance(source, FP8RefitSource):
            raise TypeError("the source already yields FP8 tensors: wrap its own source")
        if not callable(getattr(source, "prepare_refit_info", None)) or not callable(
            getattr(source, "iter_weights", None)
        ):
            raise TypeError(f"source must be a RefitSource, got {type(source).__name__}")
        if dtype is not None and (
            not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2
        ):
            raise TypeError(f"dtype must be a floating torch.dtype of >= 2 bytes, got {dtype!r}")
        if isinstance(modules_to_not_convert, str):
            raise TypeError("modules_to_not_convert must be a sequence of patterns, not a str")
        self.source = source
        self.block_size = check_block_size(block_size)
        self.modules_to_not_convert = tuple(modules_to_not_convert)
        self.dtype = dtype
        self._inner: RefitManifest | None = None
        self._manifest: RefitManifest | None = None

    def prepare_refit_info(self) -> RefitManifest:
        """``{hf_name: (shape, dtype)}`` of the FP8 checkpoint, in :meth:`iter_weights`
        order (:func:`fp8_manifest` of the source's manifest). Cached.

        Raises:
            RefitMismatchError: the source's manifest is already quantized.
        """
        if self._manifest is None:
            inner = dict(self.source.prepare_refit_info())
            self._manifest = fp8_manifest(
                inner,
                block_size=self.block_size,
                modules_to_not_convert=self.modules_to_not_convert,
                dtype=self.dtype,
            )
            self._inner = inner
        return dict(self._manifest)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the FP8 checkpoint's ``(hf_name, tensor)`` pairs in manifest order.

        Each quantized weight's two tensors come one after the other, on the
        device of the source's tensor.

        Raises:
            RefitMismatchError: the source yields another name, shape or dtype
                than its manifest says (this manifest would then be wrong).
            ValueError: a weight to quantize holds inf or nan.
        """
        manifest = self.prepare_refit_info()
        inner = self._inner
        assert inner is not None
        expected = iter(inner.items())
        for name, tensor in self.source.iter_weights():
            want = next(expected, None)
            if want is None or want[0] != name or tuple(tensor.shape) != want[1][0]:
                found = f"{name} {tuple(tensor.shape)}"
                raise RefitMismatchError(
                    f"the wrapped source yielded {found}, its manifest says "
                    f"{'nothing more' if want is None else f'{want[0]} {want[1][0]}'}"
                )
            if tensor.dtype != want[1][1]:
                raise RefitMismatchError(
                    f"{name}: the wrapped source yielded {tensor.dtype}, its manifest says "
                    f"{want[1][1]}"
                )
            if manifest[name][1] == FP8_DTYPE:
                try:
                    quantized, scale_inv = quantize_fp8_blocks(tensor, self.block_size)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
                del tensor  # the quantized copies hold what is needed
                yield name, quantized
                del quantized
                yield fp8_scale_name(name), scale_inv
            else:
                out = tensor.to(manifest[name][1])
                del tensor
                yield name, out
                del out
        left = next(expected, None)
        if left is not None:
            raise RefitMismatchError(f"the wrapped source stopped before {left[0]}")

    def quantization_config(self) -> dict[str, Any]:
        """The ``quantization_config`` of the FP8 checkpoint's ``config.json``, as the
        released FP8 checkpoints and transformers' ``FineGrainedFP8Config`` write it."""
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block_size),
            "modules_to_not_convert": list(self.modules_to_not_convert),
        }

    def hf_config(self) -> Any | None:
        """The wrapped source's HF config (:class:`~aiosync.sources.ConfigSource`),
        for the transports' config check; None when it has none."""
        if isinstance(self.source, ConfigSource):
            return self.source.hf_config()
        return None

    def offload_before_refit(self) -> None:
        """The wrapped source's (colocated refits)."""
        hook = getattr(self.source, "offload_before_refit", None)
        if hook is not None:
            hook()

    def offload_after_refit(self) -> None:
        """The wrapped source's."""
        hook = getattr(self.source, "offload_after_refit", None)
        if hook is not None:
            hook()
