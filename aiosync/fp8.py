"""The block-wise FP8 checkpoint layout: which tensors it quantizes, and the quantizer.

The layout of the Qwen3-FP8 checkpoints and of transformers' ``FineGrainedFP8Config``
(``quant_method "fp8"``, ``weight_block_size [128, 128]``): every quantized linear
weight as ``<module>.weight`` (``float8_e4m3fn``, the weight's shape) followed by
``<module>.weight_scale_inv`` (``float32``, ``[out/128, in/128]``), everything else in
bf16. A linear weight whose shape is not whole blocks stays bf16, without a scale of
its own: transformers 5.25's quantizer (``Fp8Quantize._quantize_one``) passes it
through (the released Qwen3-FP8 checkpoints have no such weight: every dim there is a
multiple of 128). ``save_pretrained`` of such a model still writes a
``weight_scale_inv`` beside it, uninitialized memory that ``FP8Linear`` never reads
(its forward takes a weight of more than one byte as it is); a refit does not send it.

The quantizer (:func:`quantize_fp8_blocks`) is transformers 5.24's own (unchanged in 5.25)
(``integrations/finegrained_fp8.py``, ``Fp8Quantize._quantize_one``), op for op, so its
tensors are bit-identical to transformers'. The dequantizer
(:func:`dequantize_fp8_blocks`) is what ``from_pretrained`` of such a checkpoint
computes (``Fp8Dequantize._dequantize_one``: the product in float32, then one cast).
:func:`fp8_manifest` is the one rule, shared by the trainer's
:class:`~aiosync.refit.FP8RefitSource` and the embedded engine's loader
(``EmbeddedEngine(quantization="fp8")``), of which tensors are quantized: the two
sides cannot drift apart. A core module, so that both import it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from aiosync.errors import RefitMismatchError
from aiosync.sources import RefitManifest

__all__ = [
    "DEFAULT_MODULES_TO_NOT_CONVERT",
    "FP8_BLOCK_SIZE",
    "FP8_DTYPE",
    "check_block_size",
    "dequantize_fp8_blocks",
    "fp8_manifest",
    "fp8_scale_name",
    "quantize_fp8_blocks",
]

#: The FP8 weight dtype of these checkpoints (``"fmt": "e4m3"``).
FP8_DTYPE: torch.dtype = torch.float8_e4m3fn
#: ``(rows, columns)`` of one scaling block: transformers' and the released checkpoints' default.
FP8_BLOCK_SIZE: tuple[int, int] = (128, 128)
#: Modules (transformers' ``modules_to_not_convert`` patterns) whose weights stay bf16.
#: ``lm_head``: transformers never converts the output embedding; embeddings are
#: ``nn.Embedding``, not linear; ``mlp.gate``: the Qwen3-MoE/Qwen3-Next routers
#: (``*TopKRouter``, not ``nn.Linear``), kept bf16 by transformers and by the
#: released Qwen3-MoE FP8 checkpoints.
DEFAULT_MODULES_TO_NOT_CONVERT: tuple[str, ...] = ("lm_head", r".*embed_tokens\w*", "mlp.gate")

_FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
_FP8_MIN = torch.finfo(FP8_DTYPE).min
_WEIGHT = ".weight"
# transformers' ``should_convert_module`` boundary (``quantizers/quantizers_utils.py``).
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


def fp8_scale_name(weight_name: str) -> str:
    """``<module>.weight`` → ``<module>.weight_scale_inv`` (transformers' naming)."""
    return weight_name.removesuffix(_WEIGHT) + ".weight_scale_inv"


def _converts(module: str, patterns: Sequence[str]) -> bool:
    """transformers' ``should_convert_module``: False when a pattern matches ``module``
    from its start up to a module boundary (also as a regex) or as a suffix."""
    return not any(
        re.match(rf"(?:{key}){_BOUNDARY}", module) or module.endswith(key) for key in patterns
    )


def _is_quantized(
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    patterns: Sequence[str],
    block_size: tuple[int, int],
) -> bool:
    """Whether checkpoint tensor ``name`` is an FP8 linear weight: a 2-D floating
    ``<module>.weight`` whose module no pattern of ``patterns`` excludes, made of whole
    ``block_size`` blocks (transformers' ``Fp8Quantize`` leaves any other bf16)."""
    return (
        name.endswith(_WEIGHT)
        and len(shape) == 2
        and dtype.is_floating_point
        and dtype.itemsize > 1
        and shape[0] % block_size[0] == 0
        and shape[1] % block_size[1] == 0
        and _converts(name.removesuffix(_WEIGHT), patterns)
    )


def _grid(shape: Sequence[int], block_size: tuple[int, int]) -> tuple[int, int]:
    rows, cols = shape
    return -(-rows // block_size[0]), -(-cols // block_size[1])


def check_block_size(block_size: object) -> tuple[int, int]:
    if (
        not isinstance(block_size, tuple | list)
        or len(block_size) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_size)
    ):
        raise ValueError(f"block_size must be two positive ints, got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def fp8_manifest(
    manifest: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    *,
    block_size: tuple[int, int] = FP8_BLOCK_SIZE,
    modules_to_not_convert: Sequence[str] = DEFAULT_MODULES_TO_NOT_CONVERT,
    dtype: torch.dtype | None = torch.bfloat16,
) -> RefitManifest:
    """The FP8 checkpoint's manifest of a model whose (unquantized) checkpoint is ``manifest``.

    In ``manifest``'s order, each quantized weight (a 2-D floating ``<module>.weight``,
    its module not matched by ``modules_to_not_convert``, transformers' patterns, its
    shape whole ``block_size`` blocks, as transformers' ``Fp8Quantize`` requires) becomes
    ``<module>.weight`` ``(out, in) float8_e4m3fn`` immediately followed by
    ``<module>.weight_scale_inv`` ``(out/bm, in/bn) float32``; every other floating
    tensor (a linear weight that is not whole blocks included, without a scale) gets
    ``dtype`` (None: its own); non-floating ones keep theirs.

    Raises:
        ValueError: ``block_size`` is not two positive ints.
        RefitMismatchError: ``manifest`` already holds FP8 tensors or a scale name
            it would produce (an already quantized checkpoint).
    """
    block = check_block_size(block_size)
    out: RefitManifest = {}
    for name, (shape, tensor_dtype) in manifest.items():
        if tensor_dtype.is_floating_point and tensor_dtype.itemsize == 1:
            raise RefitMismatchError(
                f"{name} is already {tensor_dtype}: the source is quantized; wrap its "
                "unquantized source instead"
            )
        if _is_quantized(name, shape, tensor_dtype, modules_to_not_convert, block):
            scale = fp8_scale_name(name)
            if scale in manifest:
                raise RefitMismatchError(f"{scale} is already in the source's manifest")
            out[name] = (tuple(shape), FP8_DTYPE)
            out[scale] = (_grid(shape, block), torch.float32)
        elif tensor_dtype.is_floating_point and dtype is not None:
            out[name] = (tuple(shape), dtype)
        else:
            out[name] = (tuple(shape), tensor_dtype)
    return out


def quantize_fp8_blocks(
    weight: torch.Tensor, block_size: tuple[int, int] = FP8_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 quantization of a 2-D weight: ``(weight_fp8, weight_scale_inv)``.

    Per block ``B`` of ``block_size`` (rows, columns), in float32:
    ``amax = max|B|``; ``scale = 448 / amax`` (1 when ``amax == 0``);
    ``weight_fp8 = clamp(B * scale, -448, 448)`` cast to ``float8_e4m3fn``
    (round to nearest even); ``weight_scale_inv = 1 / scale``. These are
    transformers 5.24's ``Fp8Quantize._quantize_one`` ops in its order (bit for
    bit the same tensors), and ``weight_fp8 * weight_scale_inv`` dequantizes.

    A shape that is not a multiple of the block (an edge block) is quantized on
    ``FP8Linear``'s ``ceil(rows/bm) x ceil(cols/bn)`` scale grid (DeepSeek-V3's
    checkpoints' layout), an edge block's ``amax`` that of its real elements:
    transformers' quantizer applied to the weight zero-padded to whole blocks,
    then cropped. transformers itself leaves such a weight unquantized, and so
    does :func:`fp8_manifest` (what :class:`~aiosync.refit.FP8RefitSource` and the
    embedded engine follow): this function never meets one there.

    Args:
        weight: ``(out, in)`` floating tensor, any device (the result is on it).
        block_size: ``(bm, bn)``, positive.

    Returns:
        ``weight_fp8`` ``(out, in) float8_e4m3fn`` and ``weight_scale_inv``
        ``(ceil(out/bm), ceil(in/bn)) float32``.

    Raises:
        ValueError: ``weight`` is not 2-D floating, holds a non-finite value, or
            ``block_size`` is malformed.
    """
    bm, bn = check_block_size(block_size)
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(
            f"FP8 quantization takes a 2-D float weight, got {weight.dtype} {tuple(weight.shape)}"
        )
    rows, cols = weight.shape
    grid_r, grid_c = _grid((rows, cols), (bm, bn))
    value = weight.detach().to(torch.float32)
    pad_r, pad_c = grid_r * bm - rows, grid_c * bn - cols
    if pad_r or pad_c:
        value = F.pad(value, (0, pad_c, 0, pad_r))  # zeros: no block's amax changes
    reshaped = value.reshape(grid_r, bm, grid_c, bn)
    max_abs = reshaped.abs().amax(dim=(-3, -1))
    if not bool(torch.isfinite(max_abs).all()):
        raise ValueError("FP8 quantization of a weight holding inf or nan")
    # From here on transformers' ``Fp8Quantize._quantize_one``, op for op.
    safe_max_abs = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = _FP8_MAX / safe_max_abs
    scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))
    inv_scales = (1.0 / scales).to(torch.float32)
    scaled = reshaped * scales.unsqueeze(-1).unsqueeze(-3)
    quantized = torch.clamp(scaled, min=_FP8_MIN, max=_FP8_MAX).to(FP8_DTYPE)
    quantized = quantized.reshape(grid_r * bm, grid_c * bn)
    if pad_r or pad_c:
        quantized = quantized[:rows, :cols].contiguous()
    return quantized, inv_scales


def dequantize_fp8_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    block_size: tuple[int, int] = FP8_BLOCK_SIZE,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``weight * scale_inv`` per block: what loading the FP8 checkpoint gives.

    Each element is ``float32(weight) * float32(scale_inv[i // bm, j // bn])``, then
    cast once to ``dtype``: transformers' ``Fp8Dequantize._dequantize_one`` (its
    ``from_pretrained(..., dequantize=True)``, the CPU path) for a grid that divides
    the shape, bit for bit; edge blocks take their block's scale (the grid is
    ``ceil``, as :func:`quantize_fp8_blocks` writes it).

    Raises:
        ValueError: ``weight`` is not 2-D ``float8_e4m3fn`` or ``scale_inv`` is not
            the ``(ceil(out/bm), ceil(in/bn))`` grid.
    """
    bm, bn = check_block_size(block_size)
    if weight.dim() != 2 or weight.dtype != FP8_DTYPE:
        raise ValueError(
            f"expected a 2-D {FP8_DTYPE} weight, got {weight.dtype} {tuple(weight.shape)}"
        )
    rows, cols = weight.shape
    grid = _grid((rows, cols), (bm, bn))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"weight_scale_inv of a {(rows, cols)} weight in {(bm, bn)} blocks is {grid}, "
            f"got {tuple(scale_inv.shape)}"
        )
    scale = scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(bm, dim=0)[:rows].repeat_interleave(bn, dim=1)[:, :cols]
    return (weight.to(torch.float32) * scale).to(dtype)
