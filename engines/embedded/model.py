"""A transformers causal LM behind vLLM's model contract: ``load_weights`` in checkpoint names.

:class:`HFModelRunner` is what ``worker.model_runner.model`` is in the embedded
engine. Receivers (IPC, collective) hand it ``(hf_name, tensor)`` pairs named
as in the model's HF safetensors checkpoint (what ``save_pretrained`` writes),
exactly as they would hand them to vLLM's ``model.load_weights``.

The checkpoint layout is not always the in-memory one. transformers 5.x fuses
MoE experts in memory (``mlp.experts.gate_up_proj [E, 2*Im, H]`` with the gate
rows first, ``mlp.experts.down_proj [E, H, Im]``) while the checkpoint keeps
one 2-D weight per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``).
The runner resolves every checkpoint name once, at construction, to a view of
the in-memory tensor it lands in, so loading costs one dict lookup and one
``copy_`` per tensor whatever the model's size (case C10).

Adapter-only refits load PEFT LoRA adapters next to the base weights, unmerged
(:meth:`HFModelRunner.load_lora_adapter`, see ``_lora.py``); ``generate`` applies
the one it is told to.

Generation advances one token per forward pass (:meth:`HFModelRunner.decode`),
with a gate between steps, so an engine can pause a request mid-way (the
in-flight policy of :class:`aiosync.WeightSynchronizer`); those methods are
:mod:`._decode`'s, this module builds the model and loads its weights.

A tensor-parallel runner (``tensor_parallel=``, see ``_tp.py``) holds one
rank's Megatron slice of the model: its :meth:`~HFModelRunner.weight_layout` says
which :class:`~aiosync.layout.Part` of each checkpoint tensor it keeps,
:meth:`~HFModelRunner.load_weights` still takes FULL checkpoint tensors (and
keeps its slice), :meth:`~HFModelRunner.load_weight_parts` takes slices.

A runner may hold a speculative-decoding draft model beside the target
(``draft=``, another :class:`HFModelRunner`): its checkpoint tensors are named
``draft_prefix + name`` (``"mtp."``, as Qwen3-Next's MTP layers are) and load
through the same calls, in the same sync; :attr:`HFModelRunner.draft_refit` says
whether the manifest lists them (``docs/draft.md``).
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from aiosync.delta import WeightPatch, apply_patch
from aiosync.errors import RefitMismatchError
from aiosync.fp8 import FP8_DTYPE
from aiosync.layout import Part, box_of

from ._decode import DecodeResult, _Decoding
from ._fp8 import _check_quantization, _FP8Weights, _is_fp8_folder, _scale_of_unquantized
from ._lora import PeftAdapters
from ._targets import (
    _checkpoint_manifest,
    _homes,
    _named_tensors,
    _narrow,
    _overlap,
    _resolve_targets,
)

if TYPE_CHECKING:
    from ._tp import TensorParallel

_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.[kv]_scale")

__all__ = ["DecodeResult", "HFModelRunner"]


class HFModelRunner(_Decoding):
    """Wraps a transformers ``PreTrainedModel`` (a causal LM) for an engine worker.

    Args:
        model: the model; its parameters are updated in place by :meth:`load_weights`.
        tensor_parallel: this worker's place in a tensor-parallel replica
            (``_tp.TensorParallel``); the runner then cuts ``model`` (the FULL
            model) to that rank's slice, in place. None: the whole model.
        quantization: ``"fp8"``: serve the model's block-wise FP8 checkpoint
            (``aiosync.refit.fp8``: every linear weight as ``float8_e4m3fn`` plus
            its ``weight_scale_inv`` per 128x128 block, the rest in the model's
            dtype), as :class:`_FP8Weights` says; the initial weights are
            quantized at construction. None: the checkpoint as the model holds it.
        draft: a speculative-decoding draft model's runner, held beside the target
            (an MTP module, an EAGLE head): its tensors load as this runner's, named
            ``draft_prefix + name`` (its own checkpoint name). None: no draft.
        draft_prefix: the prefix of the draft's names here; not empty, and no
            target name may start with it.

    Raises:
        RefitMismatchError: a name ``save_pretrained`` would write has no place in
            the model (a layout this runner does not know).
        ValueError: the model does not split over ``tensor_parallel``'s ranks
            (``_tp.check_tensor_parallel``), an unknown ``quantization``, or
            ``quantization`` with ``tensor_parallel``; a ``draft`` with
            ``tensor_parallel`` or ``quantization``, or an empty ``draft_prefix``
            or one a target name starts with.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        tensor_parallel: TensorParallel | None = None,
        quantization: Literal["fp8"] | None = None,
        draft: HFModelRunner | None = None,
        draft_prefix: str = "mtp.",
    ) -> None:
        _check_quantization(quantization, tensor_parallel is not None)
        _check_draft(draft, draft_prefix, tensor_parallel is not None, quantization)
        #: The speculative-decoding draft model's runner (None: no draft); its
        #: checkpoint names are this runner's under :attr:`draft_prefix`.
        self.draft = draft
        #: What the draft's checkpoint names start with here (``"mtp."``).
        self.draft_prefix = draft_prefix
        #: Whether a sync loads the draft with the target (``"with_target"``: the
        #: manifest lists its tensors) or leaves it as it is (``"frozen"``).
        self.draft_refit: Literal["with_target", "frozen"] = "with_target"
        self.model = model
        self.model.eval()
        #: Held by :meth:`load_weights` and :meth:`generate`: a generation never
        #: reads a half-copied tensor, whichever threads the engine runs them in.
        self.lock = threading.RLock()
        # The FULL checkpoint's names and shapes, before any sharding: what a
        # trainer sends and the transports compare against.
        self._manifest = _checkpoint_manifest(model)
        if draft is not None and any(n.startswith(draft_prefix) for n in self._manifest):
            raise ValueError(
                f"draft_prefix {draft_prefix!r} is the start of a target tensor's name"
            )
        #: This rank's place in its tensor-parallel replica; None: the whole model.
        self.tensor_parallel = tensor_parallel
        self._layout: dict[str, Part] = (
            {name: Part.whole(shape) for name, (shape, _) in self._manifest.items()}
            if tensor_parallel is None
            else tensor_parallel.shard(model, self._manifest)
        )
        # The model's own tensors by their names now (a LoRA adapter loaded later wraps
        # modules and renames them; the objects stay), and where they live (_follow_model).
        self._tensors = _named_tensors(model)
        self._targets = _resolve_targets(model, self._tensors, self._manifest, self._layout)
        self._homes = _homes(self._tensors)
        #: ``"fp8"`` when the runner serves the FP8 checkpoint (None: the model's own).
        self.quantization = quantization
        # The FP8 tensors become the checkpoint this runner loads and reports;
        # the model's weights are dequantized from them before each forward pass.
        self._fp8: _FP8Weights | None = None
        if quantization == "fp8":
            self._fp8 = _FP8Weights(self._manifest, self._targets)
            self._manifest = self._fp8.manifest
            self._layout = {name: Part.whole(shape) for name, (shape, _) in self._manifest.items()}
            self._targets = self._fp8.targets
        # Tied heads are absent from the checkpoint; a sender that still sends
        # them (a source that does not know about the tie) is accepted.
        self._aliases: dict[str, torch.Tensor] = {}
        self._alias_parts: dict[str, Part] = {}
        self._resolve_aliases()
        #: FP8 KV-cache scales received, ``{"model.layers.{i}.self_attn.{k,v}_scale": float}``.
        #: This reference engine has no FP8 KV cache; it records the scales that
        #: vLLM would load into its attention layers, so a refit can be checked.
        self.kv_scales: dict[str, float] = {}
        self._num_layers = int(getattr(model.config, "num_hidden_layers", 0))
        # LoRA adapters, applied unmerged with PEFT (imported on the first load).
        self._adapters = PeftAdapters(model)
        # The forward's KV-cache argument and output: ``cache`` from transformers 5.2x
        # on (``past_key_values`` is deprecated there), ``past_key_values`` before.
        forward = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks the model is split over (1: this runner holds the whole model)."""
        return 1 if self.tensor_parallel is None else self.tensor_parallel.size

    # -- construction ---------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        config: PretrainedConfig | Mapping[str, Any] | str | Path,
        *,
        seed: int = 0,
        dtype: torch.dtype | str = torch.float32,
        tensor_parallel: TensorParallel | None = None,
        quantization: Literal["fp8"] | None = None,
        draft: PretrainedConfig | Mapping[str, Any] | str | Path | None = None,
        draft_prefix: str = "mtp.",
    ) -> HFModelRunner:
        """Build a model from an HF config (or load a local checkpoint folder).

        Args:
            config: a transformers ``PretrainedConfig``, a config dict
                (``config.to_dict()`` or config.json's content; must contain
                ``model_type``), a path to a config.json, or a local
                folder. A folder holding ``*.safetensors`` is loaded with
                ``from_pretrained``; otherwise the weights are initialised randomly.
            seed: ``torch.manual_seed`` for random initialisation.
            dtype: parameter dtype (``torch.bfloat16`` or ``"bfloat16"``).
            tensor_parallel: keep only this rank's slice (see the class); the
                full model is built (or loaded) first, so every rank's slices are
                those of the same initial weights an unsharded runner holds.
            quantization: ``"fp8"``: serve the FP8 checkpoint (see the class). A
                folder holding an FP8 checkpoint (config.json's
                ``quantization_config.quant_method == "fp8"``) is then read
                tensor by tensor, its FP8 bytes and scales as they are on disk;
                any other folder or config is quantized once built.
            draft: a speculative-decoding draft model, as ``config`` (built with
                seed ``seed + 1``, so that it differs from a target of the same
                config), held beside the target under ``draft_prefix`` (see the
                class). None: no draft.
            draft_prefix: the prefix of the draft's checkpoint names here.

        Raises:
            ValueError: the config has no ``model_type``, or does not split over
                ``tensor_parallel``'s ranks, or ``quantization`` is unknown; a draft
                the runner cannot hold (see the class).
            RefitMismatchError: an FP8 folder whose tensors are not the FP8
                checkpoint this runner serves (a missing, unknown or misshapen one).
        """
        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        drafted: dict[str, Any] = {}
        if draft is not None:
            _check_draft(None, draft_prefix, tensor_parallel is not None, quantization, True)
            drafted = {
                "draft": cls.from_config(draft, seed=seed + 1, dtype=dtype),
                "draft_prefix": draft_prefix,
            }
        hf_config = resolve_hf_config(config)
        fp8_folder = (
            isinstance(hf_config, Path) and quantization == "fp8" and _is_fp8_folder(hf_config)
        )
        if isinstance(hf_config, Path) and not fp8_folder:
            model = AutoModelForCausalLM.from_pretrained(hf_config, dtype=torch_dtype)
            return cls(model, tensor_parallel=tensor_parallel, quantization=quantization, **drafted)
        folder = hf_config if isinstance(hf_config, Path) else None
        if folder is not None:
            # transformers dequantizes an FP8 checkpoint on a CPU (and cannot read
            # one with edge blocks): build the model, then load the file's bytes.
            items = json.loads((folder / "config.json").read_text())
            items.pop("quantization_config", None)
            hf_config = resolve_hf_config(items)
        assert isinstance(hf_config, PretrainedConfig)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch_dtype)
        runner = cls(model, tensor_parallel=tensor_parallel, quantization=quantization, **drafted)
        if folder is not None:
            runner._load_checkpoint_files(folder)
        return runner

    def _load_checkpoint_files(self, folder: Path) -> None:
        """Load every tensor of ``folder``'s ``*.safetensors`` (an FP8 checkpoint):
        FP8 weights and scales as stored, other floating tensors cast to the model's dtype.

        Raises:
            RefitMismatchError: a tensor the checkpoint lacks, or one not in it.
        """
        from safetensors import safe_open

        missing = dict(self._manifest)
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name not in self._manifest and _scale_of_unquantized(name, self._manifest):
                        # transformers writes one beside a weight it left bf16 (not whole
                        # blocks): uninitialized memory its FP8Linear never reads.
                        continue
                    tensor = handle.get_tensor(name)
                    spec = missing.pop(name, None)
                    # An FP8 weight is loaded as stored (a bf16 one there is refused).
                    if spec is not None and FP8_DTYPE not in (tensor.dtype, spec[1]):
                        tensor = tensor.to(spec[1])
                    HFModelRunner.load_weights(self, [(name, tensor)])
        if missing:
            raise RefitMismatchError(
                f"{folder}: {len(missing)} tensor(s) of the FP8 checkpoint missing, "
                f"first: {list(missing)[:3]}"
            )

    # -- the loader contract --------------------------------------------------

    def expected_manifest(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{hf_name: (shape, dtype)}`` of the checkpoint, in ``save_pretrained`` order.

        The names, shapes and order are those ``save_pretrained`` writes (tied
        weights removed, MoE experts split per expert; derived with
        transformers' own ``revert_weight_conversion``). Shapes are the FULL
        tensors' on a tensor-parallel rank too (what a trainer sends).

        With a draft model and :attr:`draft_refit` ``"with_target"``, the draft's
        manifest follows, each name under :attr:`draft_prefix`; ``"frozen"``
        leaves it out (a sync then sends none of its tensors).
        """
        return {**self._manifest, **self._draft_manifest()}

    def _draft_manifest(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The draft's manifest under :attr:`draft_prefix` when a sync loads it; else empty."""
        if self.draft is None or self.draft_refit != "with_target":
            return {}
        prefix = self.draft_prefix
        return {f"{prefix}{n}": spec for n, spec in self.draft.expected_manifest().items()}

    def weight_layout(self) -> dict[str, Part]:
        """``{hf_name: part}``: what this runner holds of each checkpoint tensor, in
        :meth:`expected_manifest` order (an :data:`aiosync.layout.Layout`).

        :meth:`Part.whole` for every tensor without tensor parallelism; on a
        tensor-parallel rank the Megatron slice (``_tp.tp_layout``); on an
        expert-parallel one only the experts of its EP group (the other experts'
        names are absent), each whole or cut over the group. Each part's
        ``shape`` is the full tensor's, its ``local_shape`` what the rank stores.
        A draft's tensors (those :meth:`expected_manifest` lists) are whole.
        """
        drafted = {name: Part.whole(shape) for name, (shape, _) in self._draft_manifest().items()}
        return {**self._layout, **drafted}

    def _resolve_aliases(self) -> None:
        tied: Mapping[str, str] = getattr(self.model, "all_tied_weights_keys", None) or {}
        for target, source in tied.items():
            if target not in self._targets and source in self._targets:
                self._aliases[target] = self._targets[source]
                self._alias_parts[target] = self._layout[source]

    def _follow_model(self) -> None:
        """Resolve the targets again when the model's tensors moved since (``p.data``
        re-pointed, as :func:`aiosync.share_parameters` does), so that the runner reads
        and writes the tensors the model computes with. The FP8 checkpoint's tensors
        are the runner's own and never move."""
        if self._fp8 is not None:
            return
        homes = _homes(self._tensors)
        if homes != self._homes:
            self._targets = _resolve_targets(
                self.model, self._tensors, self._manifest, self._layout
            )
            self._resolve_aliases()
            self._homes = homes

    def _lookup(self, name: str) -> tuple[torch.Tensor, Part] | None:
        """The local tensor ``name`` lands in and the part of it held (a tied alias too)."""
        target = self._targets.get(name)
        if target is not None:
            return target, self._layout[name]
        target = self._aliases.get(name)
        if target is not None:
            return target, self._alias_parts[name]
        if self.draft is not None and name.startswith(self.draft_prefix):
            # The draft's tensors load through every path the target's do (whole
            # tensors, parts, boxes, delta patches), whatever draft_refit says: the
            # manifest a transport checks at init is what keeps a frozen draft's out.
            return self.draft._lookup(name[len(self.draft_prefix) :])
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy ``(hf_name, tensor)`` pairs into the model; returns how many were loaded.

        Names are checkpoint names (:meth:`expected_manifest`); a tied
        ``lm_head.weight`` is accepted too. Tensors are FULL checkpoint tensors
        (shape and dtype as :meth:`expected_manifest`), also on a tensor-parallel
        rank, which copies the slice it holds (:meth:`weight_layout`); an
        expert-parallel rank accepts and drops the experts it does not hold. Each
        tensor is copied (any device), so the caller may reuse its buffers afterwards.

        Raises:
            RefitMismatchError: an unknown name, or a shape or dtype that differs
                from the checkpoint's.
        """
        loaded = 0
        with self.lock, torch.no_grad():
            self._follow_model()
            for name, tensor in weights:
                found = self._destination(name, tensor, whole=True)
                if found is None:
                    loaded += 1
                    continue
                target, part = found
                if part.shape != tuple(tensor.shape) or target.dtype != tensor.dtype:
                    raise RefitMismatchError(
                        f"{name}: model {part.shape} {target.dtype}, "
                        f"got {tuple(tensor.shape)} {tensor.dtype}"
                    )
                target.copy_(tensor if part.is_whole else _narrow(tensor, part))
                loaded += 1
        return loaded

    def _destination(
        self, name: str, tensor: torch.Tensor, *, whole: bool
    ) -> tuple[torch.Tensor, Part] | None:
        """Where received tensor ``name`` lands (:meth:`_lookup`); None: it was taken
        here already, an FP8 KV-cache scale (recorded), or, for a ``whole`` checkpoint
        tensor, one another expert-parallel rank holds (dropped).

        Raises:
            RefitMismatchError: an unknown name (or :meth:`_held_elsewhere`'s).
        """
        found = self._lookup(name)
        if found is not None:
            return found
        if self._load_kv_scale(name, tensor) or (whole and self._held_elsewhere(name, tensor)):
            return None
        raise RefitMismatchError(f"{name!r} is not a parameter of this model")

    def _held_elsewhere(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether ``name`` is a checkpoint tensor another expert-parallel rank holds
        (absent from :meth:`weight_layout`): a full tensor of it is accepted and dropped.

        Raises:
            RefitMismatchError: its shape or dtype differs from the checkpoint's.
        """
        spec = self._manifest.get(name)
        if spec is None or name in self._layout:
            return False
        if spec != (tuple(tensor.shape), tensor.dtype):
            raise RefitMismatchError(
                f"{name}: model {spec[0]} {spec[1]}, got {tuple(tensor.shape)} {tensor.dtype}"
            )
        return True

    def load_weight_parts(self, parts: Iterable[tuple[str, Part, torch.Tensor]]) -> int:
        """Copy received slices of checkpoint tensors into the model; returns the
        number of elements written.

        Each ``(hf_name, part, tensor)`` is ``part`` of the FULL tensor ``hf_name``
        (``part.shape`` its full shape, as :meth:`expected_manifest`), ``tensor``
        of shape ``part.local_shape`` and the model's dtype (a shard-aware
        transport's box: a sub-range of what this runner holds, all of it, or a
        range that overlaps it). The overlap of the received box with the held
        part (:meth:`weight_layout`) is written, along whichever dimensions; an
        empty ``part`` (``length == 0``) writes nothing. A 0-d tensor, or an FP8
        KV-cache scale, comes as :meth:`Part.whole`.

        Raises:
            RefitMismatchError: an unknown name, a full shape or dtype that
                differs from the checkpoint's, or ``tensor.shape != part.local_shape``.
            ValueError: a non-empty ``part`` that does not overlap what this
                runner holds (a box meant for another worker).
        """
        checked: list[tuple[str, tuple[tuple[int, int], ...], torch.Tensor]] = []
        with self.lock:
            self._follow_model()
        for name, part, tensor in parts:
            found = self._lookup(name)
            if found is not None and part.shape != found[1].shape:
                raise RefitMismatchError(
                    f"{name}: model {found[1].shape}, got a part of {part.shape}"
                )
            if tuple(tensor.shape) != part.local_shape:
                raise RefitMismatchError(
                    f"{name}: {part} has local shape {part.local_shape}, got {tuple(tensor.shape)}"
                )
            checked.append((name, box_of(part), tensor))
        return self.load_weight_boxes(checked)

    def load_weight_boxes(
        self, boxes: Iterable[tuple[str, Sequence[tuple[int, int]], torch.Tensor]]
    ) -> int:
        """Copy received boxes of checkpoint tensors into the model; returns the
        number of elements written.

        Each ``(hf_name, box, tensor)`` is the region ``box`` (``(start, stop)``
        per dimension of the FULL tensor, cut along any number of dimensions, as
        the shard-aware plan's transfers are) with ``tensor`` of the box's shape
        and the model's dtype. The overlap of the box with the held part
        (:meth:`weight_layout`) is written; an empty box writes nothing. A 0-d
        tensor, or an FP8 KV-cache scale, comes with the empty box ``()``.

        Raises:
            RefitMismatchError: an unknown name, a dtype that differs from the
                model's, a box outside the full tensor, or a tensor whose shape
                is not the box's.
            ValueError: a non-empty box that does not overlap what this runner
                holds (a box meant for another worker).
        """
        written = 0
        with self.lock, torch.no_grad():
            self._follow_model()
            for name, box, tensor in boxes:
                box = tuple((int(lo), int(hi)) for lo, hi in box)
                found = self._destination(name, tensor, whole=False)
                if found is None:
                    written += 1
                    continue
                target, held = found
                if target.dtype != tensor.dtype:
                    raise RefitMismatchError(f"{name}: model {target.dtype}, got {tensor.dtype}")
                if len(box) != len(held.shape) or any(
                    not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, held.shape, strict=True)
                ):
                    raise RefitMismatchError(
                        f"{name}: box {box} is not inside the full shape {held.shape}"
                    )
                if tuple(tensor.shape) != tuple(hi - lo for lo, hi in box):
                    raise RefitMismatchError(
                        f"{name}: box {box} has shape {tuple(hi - lo for lo, hi in box)}, "
                        f"got {tuple(tensor.shape)}"
                    )
                if tensor.numel() == 0:
                    continue
                kept = box_of(held)
                overlap = _overlap(box, kept)
                if overlap is None:
                    raise ValueError(
                        f"{name}: received box {box}, but this runner holds {held}: they do "
                        "not overlap (a box meant for another worker)"
                    )
                # Both tensors are boxes of the full one: narrow each to the overlap,
                # in its own coordinates.
                source, dest = tensor, target
                for dim, (lo, hi) in enumerate(overlap):
                    source = source.narrow(dim, lo - box[dim][0], hi - lo)
                    dest = dest.narrow(dim, lo - kept[dim][0], hi - lo)
                dest.copy_(source)
                written += dest.numel()
        return written

    def apply_weight_patches(self, patches: Iterable[WeightPatch]) -> int:
        """Write delta patches (:class:`aiosync.delta.WeightPatch`, full-tensor
        coordinates) into the live weights, each into the part this runner holds;
        returns the elements written. Every patch is checked before any is written.

        Raises:
            RefitMismatchError: an unknown name, or a patch whose shape or dtype is
                not the checkpoint's (:func:`aiosync.delta.apply_patch`).
        """
        resolved = []
        with self.lock:
            self._follow_model()
        for patch in patches:
            found = self._lookup(patch.name)
            spec = self._manifest.get(patch.name)
            if found is None and spec is not None and spec[0] == tuple(patch.shape):
                continue  # another expert-parallel rank's expert: nothing held here
            if found is None:
                raise RefitMismatchError(f"{patch.name!r} is not a parameter of this model")
            target, held = found
            if tuple(patch.shape) != held.shape or patch.values.dtype != target.dtype:
                raise RefitMismatchError(
                    f"{patch.name}: model {held.shape} {target.dtype}, got a patch of "
                    f"{tuple(patch.shape)} {patch.values.dtype}"
                )
            resolved.append((target, held, patch))
        with self.lock:
            return sum(apply_patch(target, held, patch) for target, held, patch in resolved)

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Record ``model.layers.{i}.self_attn.{k,v}_scale`` (float32, ``()`` or ``(1,)``)."""
        match = _KV_SCALE.fullmatch(name)
        if match is None or int(match.group(1)) >= self._num_layers:
            return False
        if tensor.dtype != torch.float32 or tensor.numel() != 1 or tensor.dim() > 1:
            raise RefitMismatchError(
                f"{name}: a KV-cache scale is float32 of shape () or (1,), "
                f"got {tuple(tensor.shape)} {tensor.dtype}"
            )
        self.kv_scales[name] = float(tensor.reshape(()).item())
        return True

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights as ``save_pretrained`` writes them: checkpoint names and order, copies.

        On a tensor-parallel rank, each tensor is the slice held
        (``weight_layout()[name].local_shape``), not the full tensor; an
        expert-parallel rank's holds only its experts' names. A draft
        model's tensors follow under :attr:`draft_prefix` (frozen or not).
        """
        with self.lock, torch.no_grad():
            self._follow_model()
            state = {name: self._targets[name].detach().clone() for name in self._layout}
        if self.draft is not None:
            prefix = self.draft_prefix
            state.update((f"{prefix}{n}", t) for n, t in self.draft.hf_state_dict().items())
        return state

    def fill_(self, value: float) -> None:
        """Overwrite every weight with ``value`` (an engine that discarded its weights).

        A frozen draft (:attr:`draft_refit`) keeps its weights: no sync would restore
        them (vLLM warns alike and offers ``--sleep-preserve-parameter-names 'draft.*'``).
        """
        with self.lock, torch.no_grad():
            self._follow_model()
            for name in self._layout:
                self._targets[name].fill_(value)
        if self.draft is not None and self.draft_refit == "with_target":
            self.draft.fill_(value)

    # -- LoRA adapters (adapter-only refits) ------------------------------------

    @property
    def lora_adapters(self) -> list[str]:
        """Names of the loaded LoRA adapters, in load order."""
        with self.lock:
            return self._adapters.names

    def load_lora_adapter(
        self, name: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]
    ) -> None:
        """Load a PEFT LoRA adapter under ``name``, unmerged (base weights untouched).

        Args:
            name: the adapter id (e.g. ``aiosync.lora_adapter_name(version)``).
            tensors: ``{peft_name: tensor}`` as PEFT saves them
                (``base_model.model.<module>.lora_A.weight`` ``[r, in_features]``,
                ``...lora_B.weight`` ``[out_features, r]``); cast to the model's dtype.
            config: the adapter's ``adapter_config.json`` dict.

        Raises:
            ValueError: ``name`` is already loaded.
            RefitMismatchError: the adapter does not fit this model (see
                :meth:`PeftAdapters.load`); nothing of it stays loaded.
            NotImplementedError: on a tensor-parallel rank (its layers are sharded;
                PEFT's would not be).
        """
        if self.tensor_parallel_size > 1:
            raise NotImplementedError(
                "LoRA adapters are not supported with tensor_parallel_size > 1 (the adapter "
                "layers would need the same Megatron slicing as the base layers)"
            )
        with self.lock:
            self._adapters.load(name, tensors, config)

    def lora_state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """Copies of loaded adapter ``name``'s tensors as the model applies them
        (:meth:`PeftAdapters.state_dict`: PEFT's saved names, the model's dtype).

        Raises:
            KeyError: ``name`` is not loaded.
        """
        with self.lock:
            return self._adapters.state_dict(name)

    def unload_lora_adapter(self, name: str) -> None:
        """Remove adapter ``name``; no error if it is not loaded."""
        with self.lock:
            self._adapters.remove(name)

    def unload_all_lora_adapters(self) -> None:
        """Remove every adapter: the model is the base model again."""
        with self.lock:
            self._adapters.clear()


def resolve_hf_config(
    config: PretrainedConfig | Mapping[str, Any] | str | Path,
) -> PretrainedConfig | Path:
    """The config :meth:`HFModelRunner.from_config` builds a model from, or the
    checkpoint folder it loads (a folder holding ``*.safetensors``).

    A dict (or config.json) loses its bookkeeping and dtype keys, as the runner's
    own ``dtype`` argument sets the dtype; the rest goes to ``AutoConfig.for_model``,
    which fills in transformers' defaults.

    Raises:
        ValueError: the config has no ``model_type``.
    """
    if isinstance(config, PretrainedConfig):
        config = config.to_dict()
    if isinstance(config, Mapping):
        items = dict(config)
    else:
        path = Path(config)
        if path.is_dir() and any(path.glob("*.safetensors")):
            return path
        items = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    model_type = items.pop("model_type", None)
    if not model_type:
        raise ValueError("the config has no 'model_type'")
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        items.pop(key, None)
    built: PretrainedConfig = AutoConfig.for_model(model_type, **items)
    return built


def _check_draft(
    draft: HFModelRunner | None,
    prefix: object,
    tensor_parallel: bool,
    quantization: object,
    given: bool = False,
) -> None:
    """Raise ValueError for a draft this runner cannot hold (TypeError for a non-runner);
    ``given``: a draft is coming (before it is built)."""
    if draft is None and not given:
        return
    if draft is not None and not isinstance(draft, HFModelRunner):
        raise TypeError(f"draft must be an HFModelRunner, got {type(draft).__name__}")
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"draft_prefix must be a non-empty string, got {prefix!r}")
    if tensor_parallel or quantization is not None:
        raise ValueError(
            "a draft model works with neither tensor_parallel nor quantization in the "
            "embedded engine"
        )
