"""Per-tensor digests of a LoRA adapter (``verify=``) and the receiving engine's check.

An adapter-only refit moves a handful of small tensors, each its own "bucket":
tensor ``i`` of :attr:`aiosync.LoRAAdapter.tensors` is digested with
:func:`~aiosync.transports._verify.bucket_digest` over its bytes (one slot: the
whole tensor) and seed :func:`~aiosync.transports._verify.sample_key` of
``(version, i)``, and the receiving engine digests what it received the same way
before the adapter goes live. See ``docs/reliability.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from aiosync.errors import RefitVerificationError
from aiosync.lora import ADAPTER_WEIGHTS_FILE

from .._verify import Verify, bucket_digest, sample_key, transit_fault

__all__ = ["adapter_digests", "check_adapter_tensors", "check_saved_adapter"]


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes, ``uint8[nbytes]``: a view of a contiguous tensor (so a
    test's fault lands in the tensor itself), a copy of another."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _digest(raw: torch.Tensor, index: int, verify: Verify, version: int) -> int:
    return bucket_digest(raw, verify, key=sample_key(version, index), slots=[(0, int(raw.numel()))])


def adapter_digests(
    tensors: Mapping[str, torch.Tensor], verify: Verify, version: int
) -> dict[str, int]:
    """The trainer's digests of an adapter's tensors (blocking; reads each once).

    Args:
        tensors: ``{peft_name: tensor}`` in the adapter's order (any device, dtype).
        verify: ``True`` (every byte), ``"sample"`` or ``False`` (returns ``{}``).
        version: the weight version the adapter carries (seeds the samples).

    Returns:
        ``{peft_name: signed int64 digest}``, in ``tensors``' order.
    """
    if verify is False:
        return {}
    return {
        name: _digest(_raw(tensor), index, verify, version)
        for index, (name, tensor) in enumerate(tensors.items())
    }


def check_adapter_tensors(
    tensors: Mapping[str, torch.Tensor],
    *,
    name: str,
    version: int,
    verify: Verify,
    digests: Mapping[str, int],
    received: str = "arrived",
) -> None:
    """The receiving engine's check of an adapter's tensors, before it goes live.

    Each tensor ``i`` first goes through
    :func:`~aiosync.transports._verify.transit_fault` (a test's fault on "bucket"
    ``i``, flipped in the tensor itself when it is contiguous; else nothing),
    then, unless ``verify`` is False, its digest is compared with the trainer's.

    Args:
        tensors: ``{peft_name: tensor}`` as received, in the adapter's order.
        name, version: the adapter's :attr:`~aiosync.LoRAAdapter.name` and version.
        verify, digests: the adapter's :attr:`~aiosync.LoRAAdapter.verify` and
            :attr:`~aiosync.LoRAAdapter.digests`.
        received: how the message says the bytes came (``"arrived"``, ``"read
            back"``).

    Raises:
        RefitVerificationError: a tensor's digest differs from the trainer's, or
            the trainer digested a tensor that did not arrive (or the reverse);
            names the adapter, the tensor and the mode.
    """
    mode = f"verify={verify!r}"
    for index, (tensor_name, tensor) in enumerate(tensors.items()):
        raw = _raw(tensor)
        transit_fault(raw, index)
        if verify is False:
            continue
        want = digests.get(tensor_name)
        if want is None:
            raise RefitVerificationError(
                f"LoRA adapter {name!r}: tensor {index} ({tensor_name!r}) {received}, but "
                f"the trainer sent no digest for it ({mode})"
            )
        got = _digest(raw, index, verify, version)
        if got != want:
            raise RefitVerificationError(
                f"LoRA adapter {name!r}: tensor {index} ({tensor_name!r}) {received} with "
                f"digest {got}, the trainer sent {want} ({mode})"
            )
    if verify is not False:
        missing = [n for n in digests if n not in tensors]
        if missing:
            raise RefitVerificationError(
                f"LoRA adapter {name!r}: {len(missing)} tensor(s) the trainer sent did not "
                f"arrive, the first {missing[0]!r} ({mode})"
            )


def check_saved_adapter(directory: str | Path, adapter: Any) -> None:
    """Read back the ``adapter_model.safetensors`` that ``adapter.save(directory)``
    wrote and check it (:func:`check_adapter_tensors`): for engines handed the
    adapter as a folder (vLLM, SGLang), what they will read. A no-op with
    ``adapter.verify`` False (nothing is read).

    Args:
        directory: the adapter folder.
        adapter: the :class:`~aiosync.LoRAAdapter` that was saved there.

    Raises:
        RefitVerificationError: a tensor read back differs from the trainer's
            digest, or is missing.
    """
    if adapter.verify is False:
        return
    from safetensors.torch import load_file

    stored = load_file(str(Path(directory) / ADAPTER_WEIGHTS_FILE))
    # The adapter's order, not the file's: tensor i is sampled with its index.
    tensors = {n: stored[n] for n in adapter.tensors if n in stored}
    check_adapter_tensors(
        tensors,
        name=adapter.name,
        version=adapter.version,
        verify=adapter.verify,
        digests=adapter.digests,
        received=f"read back from {directory}",
    )
