"""Delta patches into a vLLM worker: a host copy of what it holds, then a reload of
the layers a patch touched.

A vLLM layer cannot take a patch in place: on its CPU worker every linear weight
and the embedding are repacked into kernel formats after loading, and a GPU
layer may be too (quantized, or fused by a later ``process_weights_after_loading``),
so the checkpoint-format values a patch is relative to no longer exist in the
layer. With a delta synchronizer (its init says ``delta=True``) each worker keeps
:class:`HostCopy`: the checkpoint-format part of every HF tensor it holds (its
:meth:`~._layout.VLLMLayoutModel.weight_layout`; a TP rank keeps its slices), in
host memory, written as every full receive loads them. A delta sync then:

1. writes each patch's share into the copy (:func:`aiosync.delta.apply_patch`
   through the part held: full-tensor coordinates, never a full tensor), and a
   sharded delta's dense boxes into their region of it;
2. after the last patch and before the sync votes (``finish_weight_patches``),
   writes every layer a patch touched, whole, from the copy into vLLM's
   layerwise reload (:meth:`~._layout.VLLMLayoutModel.load_weight_boxes`), which
   processes it into kernel format as a full reload does. Layers no patch touched
   keep their kernel tensors (``finalize_layerwise_reload`` puts them back).

Bytes on the wire are the patches'; the worker still rebuilds each touched layer
from host memory (at RL learning rates nearly every layer has a changed element).
Memory: one host copy of the worker's held weights (its TP share), kept while a
delta synchronizer feeds the worker. The copy is trusted only while it equals
the live weights: it becomes invalid on any failed receive, on a full receive
that did not write every held tensor, and when patches were written into it
but not finished; until the next full receive the worker then reports no held
version, so the trainer sends every tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from aiosync.delta import WeightPatch, apply_patch
from aiosync.errors import RefitMismatchError
from aiosync.layout import box_of
from aiosync.transports.sharded import box_within

from ._layout import VLLMLayoutModel

__all__ = ["HostCopy"]


class HostCopy:
    """A vLLM worker's host copy of the checkpoint-format parts it holds; the
    :class:`~aiosync.delta.StagedPatchModel` its delta receives write into.

    Args:
        layout: the worker's model as the shard-aware transport sees it (the parts
            held, the layers holding them).

    Attributes:
        valid: the copy equals the live weights (a delta may be applied).
        rewrote: this receive rewrote layers from the copy (a delta).
    """

    def __init__(self, layout: VLLMLayoutModel) -> None:
        self.layout = layout
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.empty(entry.part.local_shape, dtype=entry.dtype)
            for name, entry in layout.held.items()
        }
        self.valid = False
        self.rewrote = False
        self._elements: dict[str, int] = {}  # written by this receive's full loads
        self._touched: set[str] = set()  # patched, not yet finished

    @property
    def nbytes(self) -> int:
        """Host memory the copy holds, bytes."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    # -- one receive (the worker's reload bracket) -----------------------------

    def begin(self) -> None:
        """A receive starts."""
        self._elements, self._touched, self.rewrote = {}, set(), False

    def end(self, ok: bool) -> None:
        """The receive ended (``ok``: without an exception). The copy stays valid
        after a finished delta, becomes valid after a full receive that wrote every
        held tensor, and is invalid after anything else that wrote into it."""
        if not ok or self._touched:
            self.valid = False
        elif self._elements:
            self.valid = all(
                self._elements.get(name) == t.numel() for name, t in self.tensors.items()
            )
        self._elements, self._touched = {}, set()

    def record_full(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass full HF tensors on to vLLM's ``load_weights``, copying the part held
        of each (names the worker does not hold, a tied ``lm_head``, pass untouched)."""
        for name, tensor in weights:
            entry = self.layout.held.get(name)
            if entry is not None and tuple(tensor.shape) == entry.part.shape:
                part = entry.part
                held = tensor if part.is_whole else tensor.narrow(part.dim, part.start, part.length)
                self.tensors[name].copy_(held)
                self._elements[name] = part.numel
            yield name, tensor

    def record_box(self, name: str, box: Sequence[tuple[int, int]], tensor: torch.Tensor) -> None:
        """A box a full sharded receive wrote into the layers (checked there)."""
        part = self.layout.held[name].part
        self.tensors[name][box_within(tuple(box), part)].copy_(tensor)
        self._elements[name] = self._elements.get(name, 0) + tensor.numel()

    # -- StagedPatchModel --------------------------------------------------------

    def apply_weight_patches(self, patches: Iterable[WeightPatch]) -> int:
        """Write each patch's share into the copy; the layers are written by
        :meth:`finish_weight_patches`. Returns the elements written.

        Raises:
            RefitMismatchError: a name this worker does not hold, or a patch of
                another shape or dtype (checked before that patch is written).
        """
        written = 0
        for patch in patches:
            entry = self.layout.held.get(patch.name)
            if entry is None:
                raise RefitMismatchError(f"{patch.name!r} is not held by this vLLM worker")
            written += apply_patch(self.tensors[patch.name], entry.part, patch)
            self._touched.add(patch.name)
        return written

    def load_weight_boxes(
        self, boxes: Iterable[tuple[str, Sequence[tuple[int, int]], torch.Tensor]]
    ) -> int:
        """A sharded delta's dense boxes: into the copy, as patches are.

        Raises:
            RefitMismatchError: an unknown name, another dtype, or a box outside the
                part held.
        """
        written = 0
        for name, box, tensor in boxes:
            entry = self.layout.held.get(name)
            if entry is None:
                raise RefitMismatchError(f"{name!r} is not held by this vLLM worker")
            if tensor.dtype != entry.dtype:
                raise RefitMismatchError(
                    f"{name}: the engine holds {entry.dtype}, got {tensor.dtype}"
                )
            try:
                index = box_within(tuple((int(lo), int(hi)) for lo, hi in box), entry.part)
            except ValueError as exc:
                raise RefitMismatchError(f"{name}: box {box} is not inside {entry.part}") from exc
            self.tensors[name][index].copy_(tensor)
            self._touched.add(name)
            written += tensor.numel()
        return written

    def finish_weight_patches(self) -> None:
        """Write every layer a patch touched, whole, from the copy into vLLM's
        layerwise reload, which processes each into kernel format.

        Raises:
            TransportError: outside the worker's reload bracket, or a layer did not
                complete (``finalize_layerwise_reload`` puts it back as it was).
        """
        touched, self._touched = self._touched, set()
        if not touched:
            return
        held = self.layout.held
        # A layer is rewritten whole: every tensor it holds, and so every layer those
        # tensors live in (a tied embedding and its head).
        layers: set[str] = set()
        names: set[str] = set()
        todo = set(touched)
        while todo:
            name = todo.pop()
            names.add(name)
            new = set(held[name].layers) - layers
            layers |= new
            todo |= {n for n, e in held.items() if n not in names and not new.isdisjoint(e.layers)}
        boxes: list[tuple[str, Any, torch.Tensor]] = [
            (n, box_of(held[n].part), self.tensors[n]) for n in held if n in names
        ]
        layout = self.layout
        self.rewrote = True
        tee, layout.tee = layout.tee, None  # the copy is the source here
        try:
            if layout.is_receiving:
                layout.load_weight_boxes(boxes)
            else:
                with layout.receiving(whole=False):
                    layout.load_weight_boxes(boxes)
        finally:
            layout.tee = tee
