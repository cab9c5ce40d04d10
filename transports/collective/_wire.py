"""What the collective transport broadcasts besides the buckets: a header and a trailer.

One sync on the data group is::

    header   int64[5 + num_buckets]   magic, version, num_buckets, n_kv, verify, bucket nbytes...
    bucket 0 .. bucket n-1            uint8, the packed buckets (aiosync.transports.packing)
    trailer  uint8[4*n_kv + 8*n_cs]   float32 KV scales, then int64 per-bucket digests
                                      (digests unless verify is off; no trailer when both are empty)

The header's ``verify`` field is the mode (:func:`verify_code`: 0 off, 1 every
byte, 2 a sample), so that every receiver digests what the source digested; the
digests are :func:`aiosync.transports._verify.bucket_digest`'s.

Both sides derive every size from the same digest-checked bucket plan, so two
small broadcasts per sync carry all the metadata, whatever the number of
buckets. A communicator that silently does nothing leaves the receiver's header
zeroed: the magic check catches it even without verify.
"""

from __future__ import annotations

import torch

from aiosync._kv_scales import attention_layers, kv_scale_entries
from aiosync.errors import TransportError

from .._verify import Verify
from ..packing import BucketPlan

__all__ = [
    "attention_layers",
    "decode_trailer",
    "encode_trailer",
    "header_tensor",
    "kv_scale_entries",
    "trailer_nbytes",
    "validate_header",
    "verify_code",
]

_MAGIC = 0x6169_6F73_796E_6301  # "aiosync" + wire format 1


def verify_code(verify: Verify) -> int:
    """The header's ``verify`` field: 0 off, 1 every byte (``True``), 2 ``"sample"``."""
    return 1 if verify is True else 0 if verify is False else 2


def header_tensor(version: int, plan: BucketPlan, n_kv: int, verify: Verify) -> torch.Tensor:
    """The header the source sends: ``int64[5 + num_buckets]`` (CPU)."""
    sizes = [b.nbytes for b in plan.buckets]
    fields = [_MAGIC, version, len(sizes), n_kv, verify_code(verify), *sizes]
    return torch.tensor(fields, dtype=torch.int64)


def validate_header(
    received: torch.Tensor, version: int, plan: BucketPlan, n_kv: int, verify: Verify
) -> None:
    """Compare a received header with what this receiver expects.

    Raises:
        TransportError: the magic, version, bucket count, KV-scale count, verify
            mode or a bucket's byte count differs (a no-op or corrupting
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


def trailer_nbytes(n_kv: int, num_buckets: int, verify: Verify) -> int:
    """Bytes of the trailer (0: no trailer is sent)."""
    return 4 * n_kv + (0 if verify is False else 8 * num_buckets)


def encode_trailer(kv_values: list[float], checksums: list[int]) -> torch.Tensor:
    """float32 KV scales then the int64 per-bucket digests, as one ``uint8`` CPU tensor."""
    parts = [
        torch.tensor(kv_values, dtype=torch.float32).view(torch.uint8),
        torch.tensor(checksums, dtype=torch.int64).view(torch.uint8),
    ]
    return torch.cat(parts)


def decode_trailer(
    buffer: torch.Tensor, n_kv: int, num_checksums: int
) -> tuple[torch.Tensor, list[int]]:
    """Inverse of :func:`encode_trailer`: ``(float32[n_kv] scales, digests)``."""
    raw = buffer.cpu()
    kv = raw[: 4 * n_kv].view(torch.float32).clone()
    # Copied out before the view: after an odd number of float32 scales the digests
    # start 4 bytes off an 8-byte boundary, which an int64 view refuses.
    digests = raw[4 * n_kv : 4 * n_kv + 8 * num_checksums].clone()
    checksums = digests.view(torch.int64).tolist()
    return kv, checksums
