"""Buffers another process can map: POSIX shared memory on CPU, CUDA IPC on GPU.

The IPC transport packs buckets into a :class:`SharedBuffer` and sends only its
:meth:`SharedBuffer.handle` — a dict of plain fields (str, int, bytes, bool), so
it travels as msgpack; no pickle is ever needed. :func:`open_handle` maps the
same memory in the receiving process.

* CPU: a named POSIX shared-memory segment (``shm_open`` + ``mmap``), mode 0600,
  opened by name from any process of the same user. The creator unlinks it in
  :meth:`SharedBuffer.close`; mappings stay valid until closed.
* CUDA: the fields of ``UntypedStorage._share_cuda_()`` (the CUDA IPC memory
  handle and torch's cross-process reference counter, as
  ``torch.multiprocessing.reductions`` uses them), plus the device's UUID so a
  receiver with a different ``CUDA_VISIBLE_DEVICES`` finds the same GPU.
* Nothing: a bucket of zero bytes (a manifest of zero-size tensors) travels as
  :data:`EMPTY_HANDLE`; no segment exists (a 0-byte ``mmap`` is an error) and
  the receiver gets an empty tensor.

With ``expandable_segments:True`` (``PYTORCH_CUDA_ALLOC_CONF``/``PYTORCH_ALLOC_CONF``)
torch's caching allocator maps memory with the CUDA virtual-memory API, whose
blocks ``cudaIpcGetMemHandle`` cannot share (case C20). The staging buffers are
therefore allocated with the setting switched off for that one allocation and
restored right after (``aiosync/_cuda_ipc.py``), as verl and NeMo-RL
do; where torch cannot switch it, the allocation fails with a
:class:`~aiosync.errors.TransportError` naming the setting, before any byte moves.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from aiosync._cuda_ipc import ipc_shareable_allocations, share_fields
from aiosync.errors import TransportError

__all__ = ["EMPTY_HANDLE", "MappedBuffer", "SharedBuffer", "open_handle"]

_NAME_PREFIX = "aiosync-"
# What a segment name we created looks like (a bucket's, or a trainer arena's of
# direct mode: aiosync/_arena.py); anything else in a handle is refused so a forged
# message cannot make a receiver map an arbitrary segment.
_NAME_RE = re.compile(r"^aiosync-(?:params-)?[0-9]+-[0-9a-f]{16}$")

#: The handle of a zero-byte buffer: no memory is shared, the receiver maps nothing.
EMPTY_HANDLE: Mapping[str, Any] = {"kind": "empty", "nbytes": 0}


def _posix() -> Any:
    # Python's own binding of shm_open/shm_unlink (what multiprocessing.shared_memory
    # uses); calling it directly avoids the resource tracker, which would unlink a
    # segment when any process that merely opened it exits.
    import _posixshmem

    return _posixshmem


def _unlink_segment(name: str, owner: int) -> None:
    # Only the creating process unlinks: a forked child inherits the buffer objects
    # (and their exit handlers), not the segments.
    if os.getpid() != owner:
        return
    with contextlib.suppress(FileNotFoundError):
        _posix().shm_unlink("/" + name)


class SharedBuffer:
    """A flat ``uint8`` buffer of ``nbytes`` bytes that other processes can map.

    Create it with :meth:`create`; write through :attr:`tensor`; send
    :meth:`handle`; release with :meth:`close` (unlinks the CPU segment).

    Attributes:
        tensor: ``uint8 [nbytes]`` on ``device``.
        nbytes: size in bytes.
    """

    def __init__(self, tensor: torch.Tensor, handle: dict[str, Any], mm: mmap.mmap | None) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self._handle = handle
        self._mmap = mm
        self._closed = False
        # A CPU segment's name goes at close(), or when this buffer is collected or the
        # interpreter exits without one (a trainer that never called shutdown()).
        self._unlink = (
            weakref.finalize(self, _unlink_segment, handle["name"], os.getpid())
            if handle["kind"] == "shm"
            else None
        )

    @classmethod
    def create(cls, nbytes: int, device: torch.device | str = "cpu") -> SharedBuffer:
        """Allocate ``nbytes`` (> 0) bytes on ``device`` (``cpu`` or ``cuda:N``).

        A zero-byte bucket needs no buffer: send :data:`EMPTY_HANDLE` instead.

        Raises:
            ValueError: ``nbytes`` is not positive or the device type is unsupported.
            OSError: the shared-memory segment cannot be created (``/dev/shm`` full).
        """
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        device = torch.device(device)
        if device.type == "cuda":
            return cls._create_cuda(nbytes, device)
        if device.type != "cpu":
            raise ValueError(f"shared buffers live on cpu or cuda, not {device}")
        posix = _posix()
        name = f"{_NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = posix.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
        except BaseException:
            posix.shm_unlink("/" + name)
            raise
        finally:
            os.close(fd)
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
        return cls(tensor, {"kind": "shm", "name": name, "nbytes": nbytes}, mm)

    @classmethod
    def _create_cuda(cls, nbytes: int, device: torch.device) -> SharedBuffer:
        with ipc_shareable_allocations():
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return cls(tensor, share_fields(tensor), None)

    def handle(self) -> dict[str, Any]:
        """msgpack-safe fields naming this memory: ``{"kind": "shm"|"cuda", "nbytes", ...}``."""
        return dict(self._handle)

    def close(self) -> None:
        """Release the buffer; on CPU unlink the segment (open mappings stay valid). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._unlink is not None:
            self._unlink()
        del self.tensor
        if self._mmap is not None:
            # A view may still reference the mapping; it is then unmapped when collected.
            with contextlib.suppress(BufferError):
                self._mmap.close()


class MappedBuffer:
    """The receiving side's view of a :class:`SharedBuffer`.

    Attributes:
        tensor: ``uint8 [nbytes]``, aliasing the sender's memory.
    """

    def __init__(self, tensor: torch.Tensor, mm: mmap.mmap | None) -> None:
        self.tensor = tensor
        self._mmap = mm

    def close(self) -> None:
        """Drop the mapping (views made from :attr:`tensor` must be gone)."""
        del self.tensor
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()


def open_handle(handle: Mapping[str, Any]) -> MappedBuffer:
    """Map the buffer a :meth:`SharedBuffer.handle` describes.

    :data:`EMPTY_HANDLE` maps nothing: the result holds an empty CPU tensor.

    Raises:
        TransportError: malformed fields, a segment name aiosync did not create,
            a segment that is gone or smaller than ``nbytes``, an empty handle
            claiming bytes, or a CUDA device this process cannot see.
    """
    try:
        kind = handle["kind"]
        nbytes = int(handle["nbytes"])
        if kind == "empty":
            if nbytes != 0:
                raise TransportError(f"an empty buffer handle claims {nbytes} bytes")
            return MappedBuffer(torch.empty(0, dtype=torch.uint8), None)
        if kind == "shm":
            return _open_shm(str(handle["name"]), nbytes)
        if kind == "cuda":
            return _open_cuda(handle, nbytes)
    except TransportError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise TransportError(f"malformed buffer handle: {exc!r}") from exc
    raise TransportError(f"unknown buffer kind {kind!r}")


def _open_shm(name: str, nbytes: int) -> MappedBuffer:
    if not _NAME_RE.match(name) or nbytes <= 0:
        raise TransportError(f"refusing buffer handle {name!r} of {nbytes} bytes")
    try:
        fd = _posix().shm_open("/" + name, os.O_RDWR, mode=0o600)
    except OSError as exc:
        raise TransportError(f"shared memory {name!r} cannot be opened: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise TransportError(f"shared memory {name!r} has {size} bytes, need {nbytes}")
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return MappedBuffer(torch.frombuffer(mm, dtype=torch.uint8), mm)


def _cuda_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise TransportError(f"CUDA device {uuid} is not visible to this process")


def _open_cuda(fields: Mapping[str, Any], nbytes: int) -> MappedBuffer:
    index = _cuda_index(str(fields["device_uuid"]))
    torch.cuda._lazy_init()
    event_handle = fields["event_handle"] or None
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        bytes(fields["handle"]),
        int(fields["size_bytes"]),
        int(fields["offset_bytes"]),
        bytes(fields["ref_counter_handle"]),
        int(fields["ref_counter_offset"]),
        event_handle,
        bool(fields["event_sync_required"]),
    )
    tensor = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
    tensor.set_(storage, 0, (nbytes,), (1,))
    return MappedBuffer(tensor, None)
