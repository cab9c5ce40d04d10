"""What the collective transport broadcasts besides the buckets: a header and a trailer.

One sync on the data group is::

    header   int64[5 + num_buckets]   magic, version, num_buckets, n_kv, verify, bucket nbytes...
    bucket 0 .. bucket n-1            uint8, the packed buckets (aiosync.transports.packing)
    trailer  uint8[4*n_kv + 8*n_cs]   float32 KV scales, then int64 per-bucket checksums
                                      (checksums only with verify; no trailer when both are empty)

Both sides derive every size from the same digest-checked bucket plan, so two
small broadcasts per sync carry all the metadata, whatever the number of
buckets. A communicator that silently does nothing leaves the receiver's header
zeroed: the magic check catches it even without verify.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from aiosync.errors import RefitMismatchError, TransportError

from ..packing import BucketPlan

__all__ = [
    "attention_layers",
    "decode_trailer",
    "encode_trailer",
    "header_tensor",
    "kv_scale_entries",
    "trailer_nbytes",
    "validate_header",
]

_MAGIC = 0x6169_6F73_796E_6301  # "aiosync" + wire format 1
_KV_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.[kv]_scale")
_ATTN_PREFIX = re.compile(r"model\.layers\.(\d+)\.self_attn\.")


def attention_layers(names: Iterable[str]) -> frozenset[int]:
    """Layer indices ``i`` with a ``model.layers.{i}.self_attn.`` tensor among ``names``
    (HF checkpoint names of the refit manifest): the layers that have a KV cache."""
    return frozenset(
        int(m.group(1)) for m in (_ATTN_PREFIX.match(n) for n in names) if m is not None
    )


def kv_scale_entries(
    kv_scales: Mapping[str | int, float] | None,
    layers: frozenset[int] | None = None,
) -> list[tuple[str, float]]:
    """FP8 KV-cache scales → ``(engine parameter name, value)`` pairs, in key order.

    A layer index ``i`` gives both ``model.layers.{i}.self_attn.k_scale`` and
    ``...v_scale`` (one scale per layer, vLLM's per-tensor FP8 KV cache); a
    string key must be such a full name. The values travel as float32
    scalars and are loaded as 0-d float32 tensors.

    Args:
        layers: the attention layers of the refit manifest (:func:`attention_layers`);
            when given, every key must name one of them.

    Raises:
        ValueError: a string key that is not a KV-scale name, a negative layer
            index or one that is not in ``layers``, or a scale set twice.
        RefitMismatchError: a full name whose layer has no attention in ``layers``.
    """
    if not kv_scales:
        return []
    out: list[tuple[str, float]] = []
    known = "none" if not layers else ", ".join(str(i) for i in sorted(layers))
    for key, value in kv_scales.items():
        if isinstance(key, int) and not isinstance(key, bool):
            if key < 0:
                raise ValueError(f"kv_scales layer index must be >= 0, got {key}")
            if layers is not None and key not in layers:
                raise ValueError(
                    f"kv_scales layer index {key} is not an attention layer of the "
                    f"refit manifest (layers with self_attn: {known})"
                )
            prefix = f"model.layers.{key}.self_attn."
            out += [(prefix + "k_scale", float(value)), (prefix + "v_scale", float(value))]
        elif isinstance(key, str) and (match := _KV_NAME.fullmatch(key)):
            if layers is not None and int(match.group(1)) not in layers:
                raise RefitMismatchError(
                    f"kv_scales key {key!r}: the refit manifest has no "
                    f"'model.layers.{match.group(1)}.self_attn.' tensors "
                    f"(layers with self_attn: {known})"
                )
            out.append((key, float(value)))
        else:
            raise ValueError(
                f"kv_scales key {key!r} is neither a layer index nor "
                "'model.layers.{i}.self_attn.{k|v}_scale'"
            )
    names = [name for name, _ in out]
    if len(set(names)) != len(names):
        raise ValueError("kv_scales sets a scale twice (a layer index and its name)")
    return out


def header_tensor(version: int, plan: BucketPlan, n_kv: int, verify: bool) -> torch.Tensor:
    """The header the source sends: ``int64[5 + num_buckets]`` (CPU)."""
    sizes = [b.nbytes for b in plan.buckets]
    return torch.tensor([_MAGIC, version, len(sizes), n_kv, int(verify), *sizes], dtype=torch.int64)


def validate_header(
    received: torch.Tensor, version: int, plan: BucketPlan, n_kv: int, verify: bool
) -> None:
    """Compare a received header with what this receiver expects.

    Raises:
        TransportError: the magic, version, bucket count, KV-scale count, verify
            flag or a bucket's byte count differs (a no-op or corrupting
            communicator, or a protocol mismatch).
    """
    expected = header_tensor(version, plan, n_kv, verify)
    got = received.cpu()
    if int(got[0]) != _MAGIC:
        raise TransportError("bad sync header (magic mismatch): the communicator delivered no data")
    if not torch.equal(got, expected):
        fields = ["magic", "version", "num_buckets", "n_kv", "verify"]
        for i, (a, b) in enumerate(zip(got.tolist(), expected.tolist(), strict=True)):
            if a != b:
                what = fields[i] if i < len(fields) else f"bucket {i - len(fields)} nbytes"
                raise TransportError(f"sync header {what}: source sent {a}, expected {b}")


def trailer_nbytes(n_kv: int, num_buckets: int, verify: bool) -> int:
    """Bytes of the trailer (0: no trailer is sent)."""
    return 4 * n_kv + (8 * num_buckets if verify else 0)


def encode_trailer(kv_values: list[float], checksums: list[int]) -> torch.Tensor:
    """float32 KV scales then int64 checksums, as one ``uint8`` CPU tensor."""
    parts = [
        torch.tensor(kv_values, dtype=torch.float32).view(torch.uint8),
        torch.tensor(checksums, dtype=torch.int64).view(torch.uint8),
    ]
    return torch.cat(parts)


def decode_trailer(
    buffer: torch.Tensor, n_kv: int, num_checksums: int
) -> tuple[torch.Tensor, list[int]]:
    """Inverse of :func:`encode_trailer`: ``(float32[n_kv] scales, checksums)``."""
    raw = buffer.cpu()
    kv = raw[: 4 * n_kv].view(torch.float32).clone()
    checksums = raw[4 * n_kv : 4 * n_kv + 8 * num_checksums].view(torch.int64).tolist()
    return kv, checksums
