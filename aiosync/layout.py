"""Who holds which part of each HF tensor: the vocabulary of shard-aware transfer.

A trainer rank (the *source* side) and an inference worker (the *destination*
side) each describe what they hold of the HF checkpoint as a :data:`Layout`:
for every HF tensor name they hold any of, the :class:`Part` of it they keep.
A name absent from a layout is not held there at all (an expert another
expert-parallel rank owns, an ``lm_head`` kept only on the last pipeline stage).

Parts are contiguous ranges along one dimension of the full HF tensor, which is
what every layout in use needs: FSDP2/DTensor ``Shard(0)`` (dim-0 chunks, the
last one possibly shorter or empty), Megatron column-parallel weights (dim 0 of
``q/k/v/gate/up_proj.weight``), row-parallel ones (dim 1 of ``o/down_proj``),
vocab-parallel embedding and ``lm_head`` rows (dim 0), and replicated tensors
(the whole tensor, ``Part.whole``). A fused in-memory parameter (vLLM's
``qkv_proj``) is several HF tensors, each with its own part.

The layouts are plain data: JSON-friendly through :meth:`Part.to_wire` /
:meth:`Part.from_wire`, so engines report them over RPC.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Layout", "Part", "box_of", "even_chunks"]


@dataclass(frozen=True, slots=True)
class Part:
    """Elements ``[start, start + length)`` along ``dim`` of one full HF tensor.

    Attributes:
        shape: the full HF tensor's shape.
        dim: the dimension the part is cut along (``0`` for a whole tensor).
        start: first index along ``dim``.
        length: number of indices along ``dim`` (``0``: an empty shard, held by
            nobody in practice but legal, as FSDP2's last chunks can be).
    """

    shape: tuple[int, ...]
    dim: int
    start: int
    length: int

    def __post_init__(self) -> None:
        if not self.shape:
            if (self.dim, self.start, self.length) != (0, 0, 1):
                raise ValueError(f"a 0-d tensor is held whole, not {self}")
            return
        if not 0 <= self.dim < len(self.shape):
            raise ValueError(f"dim {self.dim} out of range for shape {self.shape}")
        if self.start < 0 or self.length < 0 or self.start + self.length > self.shape[self.dim]:
            raise ValueError(
                f"[{self.start}, {self.start + self.length}) out of range along dim {self.dim} "
                f"of shape {self.shape}"
            )

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Part:
        """The whole tensor (a replicated or unsharded one)."""
        shape = tuple(int(n) for n in shape)
        return cls(shape, 0, 0, shape[0] if shape else 1)

    @property
    def is_whole(self) -> bool:
        return not self.shape or (self.start == 0 and self.length == self.shape[self.dim])

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the part as its holder stores it."""
        if not self.shape:
            return ()
        return tuple(self.length if d == self.dim else n for d, n in enumerate(self.shape))

    @property
    def numel(self) -> int:
        n = 1
        for size in self.local_shape:
            n *= size
        return n

    def to_wire(self) -> list[object]:
        return [list(self.shape), self.dim, self.start, self.length]

    @classmethod
    def from_wire(cls, fields: Sequence[object]) -> Part:
        shape, dim, start, length = fields
        assert isinstance(shape, Sequence)
        return cls(tuple(int(n) for n in shape), int(dim), int(start), int(length))  # type: ignore[call-overload]


#: HF tensor name → the part held (names not held are absent).
Layout = Mapping[str, Part]


def even_chunks(size: int, parts: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each of ``parts`` chunks of ``size``, as ``torch.chunk`` cuts.

    FSDP2 shards dim 0 this way: chunks of ``ceil(size / parts)``, the last ones
    shorter or empty. Megatron TP needs ``size % parts == 0`` and gets equal chunks.
    """
    step = -(-size // parts)
    return [(min(i * step, size), max(0, min(step, size - i * step))) for i in range(parts)]


def box_of(part: Part) -> tuple[tuple[int, int], ...]:
    """The part as ``(start, stop)`` per dimension of the full tensor."""
    return tuple(
        (part.start, part.start + part.length) if d == part.dim else (0, n)
        for d, n in enumerate(part.shape)
    )
