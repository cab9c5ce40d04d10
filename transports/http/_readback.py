"""The HTTP transports' ``verify`` check: tensors read back through SGLang's own API.

A real SGLang server checks no digest a trainer sends, so the HTTP transports do not
digest their buckets: after the last bucket loaded, and before the version is
labelled, the trainer reads tensors back through SGLang's ``POST /get_weights_by_name``
and compares them with what it sent. ``verify="sample"`` reads the first rows
(:data:`SAMPLE_ELEMENTS`) of the first and last tensor of every bucket, kept from
the packed bucket; ``verify=True`` every tensor whole, re-read from the source. What
SGLang answers, and where its answer is not the checkpoint's tensor:
``docs/sglang-contract.md`` (``/get_weights_by_name``).

This module holds what the trainer keeps (:class:`Expected`), which tensors SGLang
reads back as the checkpoint holds them (:func:`readable`) and the comparison
(:func:`first_difference`); :class:`~aiosync.transports.http.HTTPWeightSynchronizer`
drives it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._wire import FlatBucket

__all__ = [
    "SAMPLE_ELEMENTS",
    "SAMPLE_READS",
    "Expected",
    "Unreadable",
    "choose_reads",
    "first_difference",
    "keep_samples",
    "qkv_readable",
    "readable",
    "sample_rows",
    "served_dtype",
]

#: ``verify="sample"`` reads back at least this many elements of each sampled
#: tensor (its first rows: SGLang truncates a tensor's first dimension), or all of
#: it when smaller.
SAMPLE_ELEMENTS = 1024

#: ``verify="sample"`` reads back at most this many tensors per server and sync: each
#: read is an HTTP round trip through SGLang's scheduler (a few ms), so a cost that grew
#: with the buckets would grow with the model.
SAMPLE_READS = 8


def choose_reads(kept: Sequence[Expected], version: int) -> list[Expected]:
    """At most :data:`SAMPLE_READS` of ``kept`` (in plan order): always the first and the
    last, the others spread evenly over the rest, shifted every version so that the
    syncs of a run read every bucket in turn."""
    if len(kept) <= SAMPLE_READS:
        return list(kept)
    inner = len(kept) - 2
    picks = SAMPLE_READS - 2
    shift = version % inner
    chosen = {0, len(kept) - 1} | {1 + (shift + k * inner // picks) % inner for k in range(picks)}
    return [kept[i] for i in sorted(chosen)]


# The checkpoint names SGLang's get_weights_by_name cuts out of its fused qkv_proj:
# at offsets computed with hidden_size // num_attention_heads as the head size.
_QKV = re.compile(r"\.[qkv]_proj\.")
# SGLang's ``dtype`` server argument, as torch dtypes ("auto": the model's own, unknown here).
_SERVED_DTYPES: Mapping[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
}


class Unreadable(Exception):
    """SGLang's answer for a tensor cannot be compared with the checkpoint's (no rows,
    another row shape): the tensor is not checked, and the sync does not fail for it."""


@dataclass(frozen=True, slots=True)
class Expected:
    """What the trainer sent of one tensor, to compare with a server's read-back.

    Attributes:
        name: HF checkpoint name.
        bucket: index of the bucket it travelled in.
        values: its first rows as sent (CPU, the bucket's dtype; ``values.shape[0]``
            rows of the tensor's first dimension, the rest of its shape whole).
    """

    name: str
    bucket: int
    values: torch.Tensor

    @property
    def rows(self) -> int:
        """The ``truncate_size`` to ask for: SGLang truncates the first dimension."""
        return int(self.values.shape[0])


def qkv_readable(config: Any) -> bool:
    """Whether SGLang's ``get_weights_by_name`` cuts ``q_proj``/``k_proj``/``v_proj``
    at the checkpoint's rows for a model of this HF config.

    SGLang's method (``LlamaForCausalLM.get_weights_by_name``) narrows its fused
    ``qkv_proj`` with ``hidden_size // num_attention_heads`` as the head size; a model
    whose ``head_dim`` differs (Qwen3, Mistral-Nemo) gets other rows back. False
    when the config is unknown (None) or lacks the sizes.
    """
    if config is None:
        return False
    get = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key, None)
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
        return False
    head_dim = get("head_dim")
    return head_dim is None or head_dim == hidden // heads


def readable(name: str, shape: tuple[int, ...], qkv: bool) -> bool:
    """Whether the checkpoint tensor ``name`` of ``shape`` is read back.

    Not: a 0-d or empty tensor (SGLang slices the first dimension), and
    ``q_proj``/``k_proj``/``v_proj`` unless ``qkv`` (:func:`qkv_readable`).
    """
    if not shape or 0 in shape:
        return False
    return qkv or _QKV.search(name) is None


def sample_rows(shape: tuple[int, ...]) -> int:
    """The first rows of a tensor of ``shape`` that ``"sample"`` reads back: enough to
    hold :data:`SAMPLE_ELEMENTS` elements, at most all of them, at least one."""
    per_row = math.prod(shape[1:])
    return min(shape[0], max(1, math.ceil(SAMPLE_ELEMENTS / max(per_row, 1))))


def keep_samples(bucket: FlatBucket, flat: torch.Tensor, qkv: bool) -> list[Expected]:
    """``"sample"``'s share of a packed bucket: the first rows (:func:`sample_rows`)
    of its first and last :func:`readable` tensor, copied to the host.

    Args:
        bucket: the layout of ``flat``.
        flat: the packed ``[bucket.numel]`` buffer of ``bucket.dtype`` (any device),
            read before it is sent or reused.
        qkv: :func:`qkv_readable` of the model.

    Returns:
        Zero, one or two :class:`Expected`; a few KiB each whatever the bucket's size.
    """
    slots = [s for s in bucket.slots if readable(s.name, s.shape, qkv)]
    chosen = slots[:1] + slots[-1:] if len(slots) > 1 else slots
    out = []
    for slot in chosen:
        rows = sample_rows(slot.shape)
        values = flat[slot.start : slot.end].view(slot.shape)[:rows]
        out.append(Expected(slot.name, bucket.index, values.to("cpu", copy=True)))
    return out


def served_dtype(server_info: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype an SGLang server holds its weights in (its ``dtype`` argument, as
    ``/get_server_info`` reports it); None for ``"auto"`` or anything else."""
    value = server_info.get("dtype")
    return _SERVED_DTYPES.get(value) if isinstance(value, str) else None


def first_difference(
    expected: torch.Tensor, answer: Any, served: torch.dtype | None = None
) -> str | None:
    """Where a server's ``/get_weights_by_name`` answer differs from what was sent.

    SGLang answers ``param.float().tolist()[:truncate_size]`` (the first rows, as
    float32 values, JSON; ``orjson`` writes NaN and infinities as ``null``). The
    rows both hold are compared (a tensor-parallel server answers its TP rank 0's
    rows of a tensor split along its first dimension, a vocabulary padded to a
    multiple of 64 has more): each element as float32, equal, or both not finite
    (``null``), or equal to the trainer's value cast to ``served`` first (the server
    holds a narrower dtype than was sent, and its load rounded).

    Args:
        expected: the trainer's first rows (CPU, any float dtype).
        answer: the server's JSON answer (nested lists of floats and ``None``).
        served: the dtype the server holds (:func:`served_dtype`), None: unknown.

    Returns:
        None when they agree; else ``"element [i, j]: ... on the server, ... sent"``
        (the first differing element, row-major).

    Raises:
        Unreadable: the answer has no rows, or rows of another shape.
    """
    try:
        got = np.asarray(answer, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise Unreadable(f"the answer is not a tensor's rows ({exc})") from exc
    shape = tuple(expected.shape)
    if got.ndim != len(shape) or tuple(got.shape[1:]) != shape[1:]:
        raise Unreadable(
            f"the server answers rows of shape {tuple(got.shape[1:])}, the checkpoint's "
            f"tensor {shape} has rows of {shape[1:]}"
        )
    rows = min(int(got.shape[0]), shape[0])
    if rows == 0:
        raise Unreadable("the server answers no rows")
    # float64 back to float32 is exact: the server converted float32 values.
    held = torch.from_numpy(np.ascontiguousarray(got[:rows])).to(torch.float32)
    sent = expected[:rows]
    want = sent.to(torch.float32)
    same = (held == want) | (torch.isnan(held) & ~torch.isfinite(want))
    if served is not None and served.is_floating_point and served.itemsize < sent.element_size():
        same |= held == sent.to(served).to(torch.float32)
    if bool(same.all()):
        return None
    flat_index = int((~same).reshape(-1).nonzero()[0, 0])
    where = list(np.unravel_index(flat_index, tuple(same.shape)))
    index = [int(i) for i in where]
    return (
        f"element {index} is {float(held[tuple(index)])!r} on the server, "
        f"{float(want[tuple(index)])!r} in what the trainer sent"
    )
