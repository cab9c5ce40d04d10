"""One digest of a tensor's bits, the same on the trainer and on every worker."""

from __future__ import annotations

import hashlib

import torch

__all__ = ["tensor_digest"]


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 (hex) of ``tensor``'s raw bytes, row-major (what a worker holds must
    hash as what the trainer sent, bit for bit; vLLM's ``/weight_checker`` also
    hashes with SHA-256)."""
    raw = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return hashlib.sha256(raw.numpy().data).hexdigest()
