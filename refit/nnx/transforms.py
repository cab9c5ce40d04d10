"""Invertible tensor transforms between the HF checkpoint layout and the JAX layout.

Every transform maps a *list* of tensors to a list of tensors, so one kind of
object covers one-to-one steps (transpose, reshape), many-to-one steps (stack
experts, fuse k/v) and one-to-many steps (split an interleaved projection).
``forward`` goes HF → JAX (the loader), ``inverse`` goes JAX → HF (the refit);
``inverse(forward(xs))`` returns ``xs`` bit for bit, and the shape functions
let a model map compute every shape from its config without touching data.

The tensors are ``torch.Tensor`` (on the JAX arrays' device when refitting).
Transposes, unstacking and splitting return views, so the refit materialises
one HF tensor at a time, when it is yielded.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Concat",
    "Inverted",
    "Reshape",
    "Shape",
    "Stack",
    "Transform",
    "Transpose",
    "Unstack",
    "apply_forward",
    "apply_inverse",
    "forward_shapes",
]

#: A tensor shape.
Shape = tuple[int, ...]


class Transform(ABC):
    """One invertible step of a model map's chain (HF layout → JAX layout)."""

    @abstractmethod
    def forward(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """HF → JAX direction (the loader)."""

    @abstractmethod
    def inverse(self, ys: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """JAX → HF direction (the refit): the exact inverse of :meth:`forward`."""

    @abstractmethod
    def forward_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        """Shapes :meth:`forward` produces from inputs of ``shapes``.

        Raises:
            ValueError: ``shapes`` cannot be an input of this transform.
        """

    @abstractmethod
    def inverse_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        """Shapes :meth:`inverse` produces from inputs of ``shapes``."""


class _Elementwise(Transform):
    """A one-to-one transform applied to each tensor of the list."""

    @abstractmethod
    def _fwd(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _inv(self, y: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _fwd_shape(self, shape: Shape) -> Shape: ...

    @abstractmethod
    def _inv_shape(self, shape: Shape) -> Shape: ...

    def forward(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [self._fwd(x) for x in xs]

    def inverse(self, ys: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [self._inv(y) for y in ys]

    def forward_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        return [self._fwd_shape(tuple(s)) for s in shapes]

    def inverse_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        return [self._inv_shape(tuple(s)) for s in shapes]


@dataclass(frozen=True, slots=True)
class Transpose(_Elementwise):
    """Permute axes: ``y = x.permute(perm)``; inverse permutes back.

    ``Transpose((1, 0))`` turns an ``nn.Linear`` weight ``[out, in]`` into a
    flax kernel ``[in, out]``.
    """

    perm: tuple[int, ...]

    def __post_init__(self) -> None:
        if sorted(self.perm) != list(range(len(self.perm))):
            raise ValueError(f"Transpose perm {self.perm} is not a permutation")

    @property
    def _inverse_perm(self) -> tuple[int, ...]:
        inv = [0] * len(self.perm)
        for i, p in enumerate(self.perm):
            inv[p] = i
        return tuple(inv)

    def _check_rank(self, shape: Shape) -> None:
        if len(shape) != len(self.perm):
            raise ValueError(f"Transpose{self.perm} needs rank {len(self.perm)}, got {shape}")

    def _fwd(self, x: torch.Tensor) -> torch.Tensor:
        self._check_rank(tuple(x.shape))
        return x.permute(self.perm)

    def _inv(self, y: torch.Tensor) -> torch.Tensor:
        self._check_rank(tuple(y.shape))
        return y.permute(self._inverse_perm)

    def _fwd_shape(self, shape: Shape) -> Shape:
        self._check_rank(shape)
        return tuple(shape[p] for p in self.perm)

    def _inv_shape(self, shape: Shape) -> Shape:
        self._check_rank(shape)
        return tuple(shape[p] for p in self._inverse_perm)


@dataclass(frozen=True, slots=True)
class Reshape(_Elementwise):
    """Reshape between two fixed shapes of equal size (split or merge head axes).

    ``Reshape((H, N * D), (H, N, D))`` splits a query kernel into heads.
    """

    hf_shape: Shape
    jax_shape: Shape

    def __post_init__(self) -> None:
        if math.prod(self.hf_shape) != math.prod(self.jax_shape):
            raise ValueError(f"Reshape {self.hf_shape} -> {self.jax_shape} changes the size")

    def _fwd(self, x: torch.Tensor) -> torch.Tensor:
        self._fwd_shape(tuple(x.shape))
        return x.reshape(self.jax_shape)

    def _inv(self, y: torch.Tensor) -> torch.Tensor:
        self._inv_shape(tuple(y.shape))
        return y.reshape(self.hf_shape)

    def _fwd_shape(self, shape: Shape) -> Shape:
        if tuple(shape) != self.hf_shape:
            raise ValueError(f"Reshape expects {self.hf_shape}, got {shape}")
        return self.jax_shape

    def _inv_shape(self, shape: Shape) -> Shape:
        if tuple(shape) != self.jax_shape:
            raise ValueError(f"Reshape inverse expects {self.jax_shape}, got {shape}")
        return self.hf_shape


def _same_shapes(shapes: Sequence[Shape], what: str) -> Shape:
    if not shapes:
        raise ValueError(f"{what} needs at least one tensor")
    first = tuple(shapes[0])
    for s in shapes[1:]:
        if tuple(s) != first:
            raise ValueError(f"{what} needs equal shapes, got {first} and {tuple(s)}")
    return first


@dataclass(frozen=True, slots=True)
class Stack(Transform):
    """Stack ``n`` equal-shaped tensors along a new ``axis`` (many → one).

    Stacks per-expert weights into ``[E, ...]``; the inverse unbinds them
    (views). Also fuses k and v into one ``(2, K, H, D)`` array.
    """

    axis: int = 0

    def forward(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        _same_shapes([tuple(x.shape) for x in xs], "Stack")
        return [torch.stack(list(xs), dim=self.axis)]

    def inverse(self, ys: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(ys) != 1:
            raise ValueError(f"Stack inverse takes one tensor, got {len(ys)}")
        return list(ys[0].unbind(self.axis))

    def forward_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        s = list(_same_shapes(shapes, "Stack"))
        s.insert(self.axis, len(shapes))
        return [tuple(s)]

    def inverse_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        if len(shapes) != 1:
            raise ValueError(f"Stack inverse takes one tensor, got {len(shapes)}")
        s = list(shapes[0])
        n = s.pop(self.axis)
        return [tuple(s)] * n


@dataclass(frozen=True, slots=True)
class Concat(Transform):
    """Concatenate tensors along ``axis`` (many → one); inverse splits by ``sizes``."""

    axis: int
    sizes: tuple[int, ...]

    def _check(self, shapes: Sequence[Shape]) -> None:
        if len(shapes) != len(self.sizes) or any(
            s[self.axis] != n for s, n in zip(shapes, self.sizes, strict=True)
        ):
            raise ValueError(f"Concat expects sizes {self.sizes} on axis {self.axis}, got {shapes}")

    def forward(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self._check([tuple(x.shape) for x in xs])
        return [torch.cat(list(xs), dim=self.axis)]

    def inverse(self, ys: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.inverse_shapes([tuple(y.shape) for y in ys])
        return list(ys[0].split(list(self.sizes), dim=self.axis))

    def forward_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        self._check(shapes)
        s = list(shapes[0])
        s[self.axis] = sum(self.sizes)
        return [tuple(s)]

    def inverse_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        if len(shapes) != 1 or shapes[0][self.axis] != sum(self.sizes):
            raise ValueError(
                f"Concat inverse expects one tensor of {sum(self.sizes)} on axis "
                f"{self.axis}, got {shapes}"
            )
        out = []
        for n in self.sizes:
            s = list(shapes[0])
            s[self.axis] = n
            out.append(tuple(s))
        return out


@dataclass(frozen=True, slots=True)
class Inverted(Transform):
    """``inner`` run backwards: its inverse is this forward (e.g. :data:`Unstack`)."""

    inner: Transform

    def forward(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.inner.inverse(xs)

    def inverse(self, ys: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.inner.forward(ys)

    def forward_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        return self.inner.inverse_shapes(shapes)

    def inverse_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        return self.inner.forward_shapes(shapes)


def Unstack(axis: int = 0) -> Inverted:
    """Split one tensor into its slices along ``axis`` (one → many); inverse stacks."""
    return Inverted(Stack(axis))


def apply_forward(chain: Sequence[Transform], xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``chain`` HF → JAX."""
    out = list(xs)
    for t in chain:
        out = t.forward(out)
    return out


def apply_inverse(chain: Sequence[Transform], ys: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``chain`` JAX → HF (inverses in reverse order)."""
    out = list(ys)
    for t in reversed(chain):
        out = t.inverse(out)
    return out


def forward_shapes(chain: Sequence[Transform], shapes: Sequence[Shape]) -> list[Shape]:
    """Shapes ``chain`` produces HF → JAX from HF ``shapes``."""
    out = [tuple(s) for s in shapes]
    for t in chain:
        out = t.forward_shapes(out)
    return out
