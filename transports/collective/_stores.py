"""A ``torch.distributed`` store over another whose blocking waits a subclass makes
interruptible: :class:`ForwardingStore` (the sync group's rendezvous, SGLang's
weight-update group formation)."""

from __future__ import annotations

import datetime

import torch.distributed as dist

__all__ = ["ForwardingStore"]


class ForwardingStore(dist.Store):
    """Passes every call on to ``inner``, except the blocking ones: ``get`` waits for
    its key through :meth:`wait`, which each subclass implements (polling ``inner``
    and ending early on its own cancellation).

    Args:
        inner: the store that holds the keys (a ``TCPStore`` or a ``PrefixStore``).
    """

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self._inner = inner

    def set(self, key: str, value: str | bytes) -> None:
        self._inner.set(key, value)  # type: ignore[arg-type]

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._inner.get(key)

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        return self._inner.compare_set(key, expected_value, desired_value)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait until every key of ``keys`` is set (the subclass's; abstract here)."""
        raise NotImplementedError
