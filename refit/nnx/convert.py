"""Tensor conversion between JAX, numpy and torch, bit-exact and zero-copy where possible.

* JAX → torch (the refit): on CPU through numpy (``np.asarray`` of a CPU
  ``jax.Array`` is a read-only view of its buffer, so no copy); on GPU through
  DLPack (``torch.from_dlpack``, no copy). A multi-device array is gathered
  first, one array at a time.
* numpy/torch → JAX (the loader): numpy on CPU, DLPack for CUDA tensors.
* ml_dtypes types (``bfloat16``, ``float8_*``) have no numpy-native torch
  equivalent: they cross by reinterpreting the bits as ``uint16``/``uint8``,
  never by a float round trip, so every bit survives.

``jax`` is imported lazily: the table and transforms work without it.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    import jax

__all__ = [
    "as_torch_dtype",
    "jax_to_torch",
    "numpy_to_torch",
    "to_torch",
    "torch_dtype_of",
    "torch_to_jax",
    "torch_to_numpy",
]

# ml_dtypes name → (same-width unsigned view, torch dtype).
_BIT_VIEW: dict[str, tuple[type[np.unsignedinteger[Any]], torch.dtype]] = {
    "bfloat16": (np.uint16, torch.bfloat16),
    "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn),
    "float8_e5m2": (np.uint8, torch.float8_e5m2),
    "float8_e4m3fnuz": (np.uint8, torch.float8_e4m3fnuz),
    "float8_e5m2fnuz": (np.uint8, torch.float8_e5m2fnuz),
}
_TORCH_BIT_VIEW: dict[torch.dtype, tuple[torch.dtype, str]] = {
    tdt: (torch.int16 if np.dtype(u).itemsize == 2 else torch.uint8, name)
    for name, (u, tdt) in _BIT_VIEW.items()
}


def torch_dtype_of(dtype: Any) -> torch.dtype:
    """The torch dtype with the same name as a numpy/JAX/ml_dtypes ``dtype``.

    Raises:
        TypeError: no torch dtype of that name.
    """
    name = np.dtype(dtype).name
    if name == "bool":
        return torch.bool
    tdt = getattr(torch, name, None)
    if not isinstance(tdt, torch.dtype):
        raise TypeError(f"no torch dtype for {name!r}")
    return tdt


def as_torch_dtype(dtype: Any) -> torch.dtype:
    """``dtype`` (torch dtype, numpy/JAX dtype or its name) as a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    return torch_dtype_of(dtype)


def numpy_to_torch(arr: np.ndarray) -> torch.Tensor:
    """A torch view of ``arr`` (no copy); ml_dtypes arrays by bit view.

    A read-only array (a CPU ``jax.Array``'s buffer) gives a tensor the caller
    must not write to.
    """
    view = _BIT_VIEW.get(arr.dtype.name)
    src = arr.view(view[0]) if view is not None else arr
    with warnings.catch_warnings():
        # torch warns that it cannot protect a read-only buffer; the refit never writes.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(src)
    return t.view(view[1]) if view is not None else t


def to_torch(x: Any) -> torch.Tensor:
    """An HF-state value (``torch.Tensor``, ``np.ndarray`` or ``jax.Array``) as a tensor."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return numpy_to_torch(x)
    return jax_to_torch(x)


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array (no copy when contiguous); bf16/fp8 as ml_dtypes."""
    t = t.detach().contiguous()
    view = _TORCH_BIT_VIEW.get(t.dtype)
    if view is None:
        return t.numpy()
    import ml_dtypes

    return t.view(view[0]).numpy().view(getattr(ml_dtypes, view[1]))


def _on_host(x: jax.Array) -> bool:
    return all(d.platform == "cpu" for d in x.devices())


def jax_to_torch(x: jax.Array) -> torch.Tensor:
    """A ``jax.Array`` as a torch tensor on the same kind of device, bit-exact.

    CPU: a zero-copy view through numpy. GPU: zero-copy through DLPack; an
    array sharded over several devices is first gathered onto one (a copy of
    this array only); an array spanning processes is all-gathered (a
    collective: every process must call).
    """
    import jax

    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return numpy_to_torch(np.asarray(multihost_utils.process_allgather(x, tiled=True)))
    if _on_host(x):
        return numpy_to_torch(np.asarray(x))
    devices = x.devices()
    if len(devices) > 1:
        if x.is_fully_replicated:
            x = x.addressable_shards[0].data
        else:
            x = jax.device_put(x, next(iter(sorted(devices, key=lambda d: d.id))))
    return torch.from_dlpack(x)


def torch_to_jax(t: torch.Tensor) -> jax.Array:
    """A torch tensor as a ``jax.Array`` (a copy on CPU; DLPack for CUDA tensors)."""
    import jax
    import jax.numpy as jnp

    if t.is_cuda:
        return jax.dlpack.from_dlpack(t.contiguous())
    return jnp.asarray(torch_to_numpy(t))
