"""Declarative model maps: HF checkpoint names ↔ NNX state paths through invertible transforms.

A :class:`ModelMap` is a table of :class:`Rule` s. Each rule names some HF
checkpoint tensors (with their shapes, from the model's config), the NNX state
paths they become, and a chain of :mod:`~aiosync.refit.nnx.transforms`. The loader
(:meth:`ModelMap.to_jax`) runs every chain forward; the refit
(:meth:`ModelMap.to_hf`) runs the same chains backwards, so the two directions
cannot drift apart. Names and shapes follow the HF safetensors checkpoint
(what ``save_pretrained`` writes and what vLLM/SGLang ``load_weights`` take).

The per-family tables are in ``qwen3.py``, ``qwen3_moe.py``, ``qwen3_next.py``
and ``gemma4.py``; ``registry.model_map_for(config)`` picks one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from aiosync.errors import RefitMismatchError
from aiosync.sources import RefitManifest

from .convert import as_torch_dtype, jax_to_torch, to_torch, torch_dtype_of, torch_to_jax
from .transforms import (
    Reshape,
    Shape,
    Stack,
    Transform,
    Transpose,
    apply_forward,
    apply_inverse,
    forward_shapes,
)

__all__ = [
    "ModelMap",
    "NNXPath",
    "Rule",
    "checkpoint_sort_key",
    "copy",
    "flatten_params",
    "heads_in",
    "heads_in_nhd",
    "heads_out",
    "linear",
    "path_str",
    "stacked_experts",
]

#: A path into the NNX state (``nnx.state(model).to_pure_dict()``): attribute
#: names and list indices, e.g. ``("layers", 3, "attn", "q_proj", "w")``.
NNXPath = tuple[str | int, ...]

_MAX_NAMED = 5


def path_str(path: NNXPath) -> str:
    """``("layers", 0, "attn")`` → ``"layers/0/attn"`` (for error messages)."""
    return "/".join(str(p) for p in path)


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in items[:_MAX_NAMED])
    more = len(items) - _MAX_NAMED
    return shown + (f" (+{more} more)" if more > 0 else "")


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of a model map.

    Attributes:
        hf: HF checkpoint names, in the order the chain consumes them.
        nnx: NNX state paths, in the order the chain produces them.
        hf_shapes: the HF tensors' shapes (from the config), one per name.
        chain: transforms HF → JAX; empty means the array is kept as is.
        sort_as: the name transformers holds these tensors under in memory
            (``…experts.gate_up_proj`` for per-expert gate/up weights), which
            decides their place in a ``"natural"``-ordered map; default ``hf[0]``.
        nnx_shapes: derived: the JAX arrays' shapes.

    Raises:
        ValueError: the chain does not turn ``len(hf)`` tensors of ``hf_shapes``
            into ``len(nnx)`` tensors.
    """

    hf: tuple[str, ...]
    nnx: tuple[NNXPath, ...]
    hf_shapes: tuple[Shape, ...]
    chain: tuple[Transform, ...] = ()
    sort_as: str | None = None
    nnx_shapes: tuple[Shape, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.hf) != len(self.hf_shapes):
            raise ValueError(
                f"rule {self.hf[:1]}: {len(self.hf)} names, {len(self.hf_shapes)} shapes"
            )
        try:
            out = forward_shapes(self.chain, self.hf_shapes)
        except ValueError as exc:
            raise ValueError(f"rule for {self.hf[0]!r}: {exc}") from exc
        if len(out) != len(self.nnx):
            raise ValueError(
                f"rule for {self.hf[0]!r} makes {len(out)} arrays for {len(self.nnx)} NNX paths"
            )
        object.__setattr__(self, "nnx_shapes", tuple(out))


# -- rule builders (the vocabulary of the per-family tables) -------------------


def copy(hf: str, path: NNXPath, shape: Shape) -> Rule:
    """Kept as is (norm scales, embeddings, ``A_log``...)."""
    return Rule((hf,), (path,), (shape,))


def linear(hf: str, path: NNXPath, out_features: int, in_features: int) -> Rule:
    """``nn.Linear`` weight ``[out, in]`` ↔ flax kernel ``(in, out)`` (``W.T``)."""
    return Rule((hf,), (path,), ((out_features, in_features),), (Transpose((1, 0)),))


def heads_in(hf: str, path: NNXPath, heads: int, head_dim: int, hidden: int) -> Rule:
    """q/k/v weight ``[heads*D, H]`` ↔ tunix Einsum ``(H, heads, D)`` (``W.T.reshape``)."""
    return Rule(
        (hf,),
        (path,),
        ((heads * head_dim, hidden),),
        (Transpose((1, 0)), Reshape((hidden, heads * head_dim), (hidden, heads, head_dim))),
    )


def heads_in_nhd(hf: str, path: NNXPath, heads: int, head_dim: int, hidden: int) -> Rule:
    """q/k weight ``[heads*D, H]`` ↔ Gemma Einsum ``(heads, H, D)``."""
    return Rule(
        (hf,),
        (path,),
        ((heads * head_dim, hidden),),
        (Reshape((heads * head_dim, hidden), (heads, head_dim, hidden)), Transpose((0, 2, 1))),
    )


def heads_out(hf: str, path: NNXPath, heads: int, head_dim: int, hidden: int) -> Rule:
    """o weight ``[H, N*D]`` ↔ Einsum ``(N, D, H)`` (``W.T.reshape``)."""
    return Rule(
        (hf,),
        (path,),
        ((hidden, heads * head_dim),),
        (Transpose((1, 0)), Reshape((heads * head_dim, hidden), (heads, head_dim, hidden))),
    )


def stacked_experts(
    hf: Sequence[str], path: NNXPath, out_features: int, in_features: int, *, sort_as: str
) -> Rule:
    """Per-expert ``[out, in]`` weights ↔ one stacked ``(E, in, out)`` array.

    Each expert is transposed like a Linear kernel, then the E experts are
    stacked on axis 0 (tunix ``_stack_experts``); the refit unbinds them back
    into ``E`` tensors named ``…experts.{e}.…``. ``sort_as`` is transformers'
    fused in-memory name (see :class:`Rule`).
    """
    return Rule(
        tuple(hf),
        (path,),
        ((out_features, in_features),) * len(hf),
        (Transpose((1, 0)), Stack(0)),
        sort_as=sort_as,
    )


# -- stream order ------------------------------------------------------------


def checkpoint_sort_key(name: str) -> list[tuple[Any, ...]]:
    """Sort key of transformers' ``save_pretrained`` reordering (``dot_natural_key``).

    When a model has a weight conversion (fused experts), transformers sorts
    the in-memory names by this key before reverting them: dotted parts, digits
    numerically and before words, a word's trailing digits numerically.
    """
    parts: list[tuple[Any, ...]] = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
            continue
        text = part.rstrip("0123456789")
        digits = part[len(text) :]
        parts.append((1, text, int(digits)) if digits else (1, text))
    return parts


# -- the NNX state as flat paths ---------------------------------------------


def _key(k: Any) -> str | int:
    if isinstance(k, int):
        return k
    s = str(k)
    return int(s) if s.isdigit() else s


def _leaf(v: Any) -> Any:
    # nnx.Variable / VariableState leaves carry the array in `.value`.
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return v
    return getattr(v, "value", v)


def flatten_params(params: Any) -> dict[NNXPath, Any]:
    """A nested mapping (``dict``, ``nnx.State``) of arrays as ``{path: array}``.

    ``nnx.State`` is read through ``to_pure_dict()``; digit keys become ints
    so ``"0"`` and ``0`` name the same layer.
    """
    if hasattr(params, "to_pure_dict"):
        try:
            from flax import nnx

            params = nnx.to_pure_dict(params)
        except ImportError:
            params = params.to_pure_dict()
    flat: dict[NNXPath, Any] = {}
    stack: list[tuple[NNXPath, Any]] = [((), params)]
    while stack:
        prefix, node = stack.pop()
        if isinstance(node, Mapping):
            for k, v in node.items():
                stack.append(((*prefix, _key(k)), v))
        elif isinstance(node, list | tuple) and not hasattr(node, "shape"):
            for i, v in enumerate(node):
                stack.append(((*prefix, i), v))
        else:
            flat[prefix] = _leaf(node)
    return flat


def _insert(tree: dict[Any, Any], path: NNXPath, value: Any) -> None:
    node = tree
    for k in path[:-1]:
        node = node.setdefault(k, {})
    node[path[-1]] = value


# -- the map ---------------------------------------------------------------------


class ModelMap:
    """One model family's loader and exact inverse, derived from one rule table.

    Args:
        model_type: the HF ``model_type`` it was built for.
        rules: the table, in the model's ``state_dict`` order (module
            registration order, fused experts expanded in place).
        order: ``"table"`` streams in rule order; ``"natural"`` sorts the rules
            (stably) by :func:`checkpoint_sort_key` of ``sort_as``, as
            ``save_pretrained`` does for models with a weight conversion
            (Qwen3-MoE, Qwen3-Next). Either way the stream order is the order of
            transformers' own reverted state dict, so a manifest built from the
            torch model (``aiosync.refit.DTensorRefitSource``) lists the same names in
            the same order.
        ignore_prefixes: HF names the loader skips without error (``mtp.`` for
            Qwen3-Next, the vision/audio towers of a multimodal Gemma 4).
        hf_config: the HF config (a ``PretrainedConfig`` or ``config.json`` dict)
            the table was derived from; :func:`~aiosync.refit.nnx.model_map_for`
            records it. :class:`~aiosync.refit.nnx.NNXRefitSource` reports it, so
            that the transports compare it with the engine's config.

    Raises:
        ValueError: two rules share an HF name or an NNX path.
    """

    def __init__(
        self,
        model_type: str,
        rules: Sequence[Rule],
        *,
        order: Literal["table", "natural"] = "table",
        ignore_prefixes: Sequence[str] = (),
        hf_config: Any = None,
    ) -> None:
        self.model_type = model_type
        #: The HF config the table was derived from (None: not recorded).
        self.hf_config: Any = hf_config
        if order == "natural":
            rules = sorted(rules, key=lambda r: checkpoint_sort_key(r.sort_as or r.hf[0]))
        elif order != "table":
            raise ValueError(f"order must be 'table' or 'natural', got {order!r}")
        self.rules: tuple[Rule, ...] = tuple(rules)
        self.ignore_prefixes = tuple(ignore_prefixes)
        self._hf_shapes: dict[str, Shape] = {}
        self._nnx_shapes: dict[NNXPath, Shape] = {}
        self._owner: dict[NNXPath, Rule] = {}
        for rule in self.rules:
            for name, shape in zip(rule.hf, rule.hf_shapes, strict=True):
                if name in self._hf_shapes:
                    raise ValueError(f"{model_type}: HF name {name!r} appears twice in the table")
                self._hf_shapes[name] = shape
            for path, shape in zip(rule.nnx, rule.nnx_shapes, strict=True):
                if path in self._nnx_shapes:
                    raise ValueError(f"{model_type}: NNX path {path_str(path)} appears twice")
                self._nnx_shapes[path] = shape
                self._owner[path] = rule

    def __repr__(self) -> str:
        return (
            f"ModelMap({self.model_type!r}, {len(self._hf_shapes)} HF tensors, "
            f"{len(self._nnx_shapes)} NNX arrays)"
        )

    def hf_shapes(self) -> dict[str, Shape]:
        """``{hf_name: shape}`` in checkpoint (stream) order."""
        return dict(self._hf_shapes)

    def nnx_shapes(self) -> dict[NNXPath, Shape]:
        """``{nnx_path: shape}`` of the JAX layout."""
        return dict(self._nnx_shapes)

    # -- loader: HF → JAX ------------------------------------------------------

    def _check_hf_keys(self, names: Sequence[str]) -> None:
        present = set(names)
        missing = [n for n in self._hf_shapes if n not in present]
        extra = sorted(
            n
            for n in present
            if n not in self._hf_shapes and not n.startswith(self.ignore_prefixes or ("\0",))
        )
        if missing:
            raise RefitMismatchError(
                f"{self.model_type}: HF state is missing {len(missing)} tensor(s): "
                f"{_names(missing)}"
            )
        if extra:
            raise RefitMismatchError(
                f"{self.model_type}: HF state has {len(extra)} tensor(s) the map does not know: "
                f"{_names(extra)}"
            )

    def to_jax(self, hf_state: Mapping[str, Any], *, dtype: Any = None) -> dict[Any, Any]:
        """The loader: an HF state dict → the nested dict of the NNX state.

        Args:
            hf_state: ``{hf_name: np.ndarray | torch.Tensor}`` as
                ``safetensors`` loads the checkpoint (CPU or CUDA tensors).
            dtype: cast every floating-point array to this dtype (torch, numpy
                or JAX dtype; integer and bool arrays keep theirs);
                default keeps each tensor's dtype (then :meth:`to_hf` returns
                the input bit for bit).

        Returns:
            Nested ``dict`` (layer indices as ``int`` keys) of ``jax.Array``,
            in the structure ``nnx.state(model).to_pure_dict()`` has; load it
            with ``nnx.replace_by_pure_dict``.

        Raises:
            RefitMismatchError: a name is missing or unknown, a shape differs
                from the config's, or tensors fused by one rule differ in dtype
                (the error names the HF key).
        """
        self._check_hf_keys(list(hf_state))
        cast = None if dtype is None else as_torch_dtype(dtype)
        tree: dict[Any, Any] = {}
        for rule in self.rules:
            xs: list[torch.Tensor] = []
            for name, shape in zip(rule.hf, rule.hf_shapes, strict=True):
                t = to_torch(hf_state[name])
                if tuple(t.shape) != shape:
                    raise RefitMismatchError(
                        f"{self.model_type}: HF tensor {name!r} has shape {tuple(t.shape)}, "
                        f"the config gives {shape}"
                    )
                if xs and t.dtype != xs[0].dtype:
                    raise RefitMismatchError(
                        f"{self.model_type}: HF tensor {name!r} is {t.dtype} but {rule.hf[0]!r} "
                        f"is {xs[0].dtype}; they are fused into one array"
                    )
                xs.append(t)
            for path, y in zip(rule.nnx, apply_forward(rule.chain, xs), strict=True):
                _insert(tree, path, torch_to_jax(y.to(_target(y.dtype, cast))))
        return tree

    # -- refit: JAX → HF -------------------------------------------------------

    def check_params(self, params: Any, *, strict: bool = True) -> dict[NNXPath, Any]:
        """Validate an NNX state against the table; return it flat (``{path: array}``).

        Args:
            params: nested mapping or ``nnx.State`` of ``jax.Array``.
            strict: also reject paths the table does not know.

        Raises:
            RefitMismatchError: a path is missing, unknown (``strict``), or has
                the wrong shape; the error names the path and its HF name(s).
        """
        flat = flatten_params(params)
        missing = [p for p in self._nnx_shapes if p not in flat]
        if missing:
            raise RefitMismatchError(
                f"{self.model_type}: NNX state is missing {len(missing)} array(s): "
                f"{_names([path_str(p) for p in missing])} "
                f"(HF {self._owner[missing[0]].hf[0]!r})"
            )
        if strict:
            extra = sorted(path_str(p) for p in flat if p not in self._nnx_shapes)
            if extra:
                raise RefitMismatchError(
                    f"{self.model_type}: NNX state has {len(extra)} array(s) the map does not "
                    f"know: {_names(extra)}"
                )
        for path, shape in self._nnx_shapes.items():
            got = tuple(flat[path].shape)
            if got != shape:
                raise RefitMismatchError(
                    f"{self.model_type}: NNX array {path_str(path)} (HF "
                    f"{self._owner[path].hf[0]!r}) has shape {got}, the config gives {shape}"
                )
        for rule in self.rules:
            dtypes = {str(flat[p].dtype) for p in rule.nnx}
            if len(dtypes) > 1:
                raise RefitMismatchError(
                    f"{self.model_type}: NNX arrays {_names([path_str(p) for p in rule.nnx])} "
                    f"(HF {rule.hf[0]!r}) mix dtypes {sorted(dtypes)}; the HF side fuses them"
                )
        return flat

    def manifest(self, params: Any, *, dtype: Any = None, strict: bool = True) -> RefitManifest:
        """The refit manifest ``{hf_name: (shape, torch dtype)}`` in stream order.

        Dtypes are the JAX arrays' (or ``dtype`` when given). Touches no data.

        Raises:
            RefitMismatchError: as :meth:`check_params`.
        """
        flat = self.check_params(params, strict=strict)
        cast = None if dtype is None else as_torch_dtype(dtype)
        out: RefitManifest = {}
        for rule in self.rules:
            tdt = _target(torch_dtype_of(flat[rule.nnx[0]].dtype), cast)
            for name, shape in zip(rule.hf, rule.hf_shapes, strict=True):
                out[name] = (shape, tdt)
        return out

    def to_hf(
        self, params: Any, *, dtype: Any = None, strict: bool = True, contiguous: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The refit: stream ``(hf_name, tensor)`` from an NNX state, in table order.

        The whole state is validated before the first tensor is yielded. Each
        tensor is contiguous, in the HF checkpoint's shape, on the JAX arrays'
        device (CPU or CUDA), materialised only when yielded: at most one HF
        tensor (plus views) beyond the JAX state exists at a time. A tensor
        needing no transform and no cast may share memory with the JAX array:
        read it, never write it.

        Args:
            params: nested mapping or ``nnx.State`` of ``jax.Array``.
            dtype: cast every floating-point tensor to this dtype (e.g. fp32
                master weights to an engine's ``torch.bfloat16``); integer and
                bool tensors, and every tensor by default, keep the JAX dtype.
            strict: reject NNX paths the table does not know.
            contiguous: when False, a tensor the inverse leaves as a strided
                view (a transposed kernel, an unstacked expert) is yielded as
                that view, uncopied: a consumer that copies into its own buffer
                anyway (``aiosync.transports.packing.pack`` accepts any strides) then
                makes the only copy.

        Raises:
            RefitMismatchError: as :meth:`check_params` (before anything is yielded).
        """
        flat = self.check_params(params, strict=strict)
        cast = None if dtype is None else as_torch_dtype(dtype)
        return self._stream(flat, cast, contiguous)

    def _stream(
        self, flat: dict[NNXPath, Any], cast: torch.dtype | None, contiguous: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for rule in self.rules:
            ys = [jax_to_torch(flat[p]) for p in rule.nnx]
            views = apply_inverse(rule.chain, ys)
            del ys
            for name, view in zip(rule.hf, views, strict=True):
                yield name, _materialize(view, _target(view.dtype, cast), contiguous)


def _target(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is sent as: ``cast`` applies to floating point only."""
    return cast if cast is not None and dtype.is_floating_point else dtype


def _materialize(view: torch.Tensor, dtype: torch.dtype, contiguous: bool) -> torch.Tensor:
    """``view`` cast to ``dtype`` (and made contiguous if asked), in one copy at most."""
    if view.dtype == dtype and (view.is_contiguous() or not contiguous):
        return view
    return torch.empty(view.shape, dtype=dtype, device=view.device).copy_(view)
