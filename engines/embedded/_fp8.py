"""A ``quantization="fp8"`` runner's checkpoint: the block-wise FP8 weights it serves
and the compute weights derived from them (``docs/`` on FP8)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from aiosync.fp8 import FP8_DTYPE, dequantize_fp8_blocks, fp8_manifest, quantize_fp8_blocks

if TYPE_CHECKING:
    pass


def _check_quantization(quantization: object, tensor_parallel: bool) -> None:
    """Raise ValueError unless ``quantization`` is None or ``"fp8"`` without tensor parallelism."""
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    if quantization is not None and tensor_parallel:
        raise ValueError(
            "quantization='fp8' does not work with tensor parallelism (a Megatron slice "
            "would cut 128x128 scaling blocks); use tensor_parallel_size=1"
        )


def _scale_of_unquantized(
    name: str, manifest: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
) -> bool:
    """Whether ``name`` is the ``weight_scale_inv`` of a weight the FP8 checkpoint
    holds unquantized (``manifest``: the runner's FP8 one)."""
    suffix = ".weight_scale_inv"
    weight = name.removesuffix(suffix) + ".weight"
    return name.endswith(suffix) and weight in manifest and manifest[weight][1] != FP8_DTYPE


def _is_fp8_folder(folder: Path) -> bool:
    """Whether ``folder``'s config.json declares a block-wise FP8 checkpoint."""
    config = folder / "config.json"
    if not config.is_file():
        return False
    quantization = json.loads(config.read_text()).get("quantization_config") or {}
    return isinstance(quantization, dict) and quantization.get("quant_method") == "fp8"


class _FP8Weights:
    """The FP8 checkpoint a ``quantization="fp8"`` runner serves, and the model's
    compute weights derived from it.

    The checkpoint is :func:`aiosync.refit.fp8.fp8_manifest` of the model's own (the
    rule :class:`~aiosync.refit.FP8RefitSource` quantizes by): each linear weight
    ``<module>.weight`` ``float8_e4m3fn`` followed by ``<module>.weight_scale_inv``
    ``float32 [out/128, in/128]`` (a weight that is not whole blocks stays
    unquantized, as transformers leaves it); every other tensor in the model's
    dtype. This object holds the two FP8 tensors of each pair (1 byte per weight
    plus the scales); they are the runner's load targets, so a refit, a box of a
    shard-aware transport, a delta patch of the FP8 bytes and ``hf_state_dict``
    all read or write them like any other checkpoint tensor, in any order and
    any bucket.

    :meth:`refresh`, called before every forward pass (under the runner's lock),
    dequantizes into the model's weight each pair either half of which was
    written since (``dequantize_fp8_blocks``: ``float32(w) * scale``, one cast
    to the model's dtype, what transformers' ``from_pretrained`` of the FP8
    checkpoint computes). Writes are seen through the tensors' version counters,
    which every in-place write (``copy_``, indexing, ``fill_``) bumps: until the
    next forward pass, a pair with only one half new (its partner in a later
    bucket) is simply not looked at.
    """

    def __init__(
        self,
        manifest: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        targets: Mapping[str, torch.Tensor],
    ) -> None:
        self.manifest = fp8_manifest(manifest, dtype=None)
        self.targets: dict[str, torch.Tensor] = {}
        # (FP8 weight, scale, the model's weight) and their versions when last dequantized.
        self._pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._seen: list[tuple[int, int]] = []
        names = iter(self.manifest.items())
        for name, (_, dtype) in names:
            if dtype != FP8_DTYPE:
                self.targets[name] = targets[name]
                continue
            scale_name, _ = next(names)  # the manifest puts the scale right after
            weight, scale = quantize_fp8_blocks(targets[name])
            self.targets[name], self.targets[scale_name] = weight, scale
            self._pairs.append((weight, scale, targets[name]))
            self._seen.append((-1, -1))
        self.refresh()

    def refresh(self) -> int:
        """Dequantize every pair written since its last dequantization; returns how many."""
        done = 0
        with torch.no_grad():
            for index, (weight, scale, compute) in enumerate(self._pairs):
                versions = (weight._version, scale._version)
                if versions != self._seen[index]:
                    compute.copy_(dequantize_fp8_blocks(weight, scale, dtype=compute.dtype))
                    self._seen[index] = versions
                    done += 1
        return done
