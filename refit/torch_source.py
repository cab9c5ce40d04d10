"""``DTensorRefitSource``: a torch trainer's weights as the HF checkpoint, streamed.

Works for a plain ``nn.Module``, a module whose parameters are DTensors
(``distribute_tensor`` with any ``Shard``/``Replicate`` placements) and an
FSDP2 (``fully_shard``) model, also under ``torch.compile``/DDP wrappers. One
module tensor is gathered at a time (one all-gather of its equal row pieces, else
``DTensor.full_tensor()``), so the model is never materialized twice; a transport
may offer the memory to gather into (``iter_weights_into``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from aiosync.errors import RefitMismatchError
from aiosync.sources import RefitManifest, RefitSource

from ._peft import LoraMerge, MergedPeft, find_peft_model
from ._torch_names import (
    Reverter,
    _adapter_reverter,
    _dedup_tied,
    _hf_checkpoint_order,
    _hf_reverter,
    _same_tensor,
    _strip_wrapper_prefixes,
    _tied_aliases,
    _unwrap,
)
from ._torch_rules import _zero_copy_split

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DTensorRefitSource"]

_log = logging.getLogger(__name__)

# torch 2.13 renamed ``all_gather_into_tensor`` (deprecated there); torch >= 2.6 is supported.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, slots=True)
class _Entry:
    """One module tensor and the checkpoint tensors it becomes."""

    module_key: str  # key in the (wrapped) model's state_dict
    key: str  # the same without wrapper prefixes, as the reverter expects it
    outputs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # (hf_name, shape, dtype)
    # "plain": the tensor is the checkpoint tensor ``outputs[0]``; "views": a zero-copy
    # rule (``_torch_rules``) splits it; "revert": the reverter converts it.
    mode: Literal["plain", "views", "revert"]
    merge: LoraMerge | None = None  # a PEFT model's LoRA, merged into the gathered tensor


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "full_tensor") and hasattr(tensor, "placements")


def _even_rows_group(tensor: Any) -> ProcessGroup | None:
    """The group whose one all-gather of ``tensor``'s local pieces is its full value:
    a DTensor sharded on dim 0 alone, over a 1-D mesh, in equal pieces (the rows divide
    by the mesh's size); None for any other layout. Decided from the global layout
    alone, so every rank decides alike."""
    from torch.distributed.tensor import Shard  # loaded already: ``tensor`` is a DTensor

    mesh = tensor.device_mesh
    placements = tensor.placements
    if mesh.ndim != 1 or len(placements) != 1 or tensor.dim() == 0:
        return None
    # ``type() is``: a subclass such as ``_StridedShard`` orders its pieces otherwise.
    if type(placements[0]) is not Shard or placements[0].dim != 0:
        return None
    if tensor.shape[0] % mesh.size() != 0:
        return None
    group: ProcessGroup = mesh.get_group()
    return group


def _gather_rows(
    tensor: Any,
    group: ProcessGroup,
    destination: Callable[[str], torch.Tensor | None] | None,
    name: str,
) -> torch.Tensor:
    """``tensor``'s full value (see :func:`_even_rows_group`) by one all-gather, written
    into ``destination(name)`` when that fits it (the IPC bucket's slot), else into a
    new tensor: the same collective on every rank either way."""
    local = tensor.to_local().contiguous()
    shape = tuple(tensor.shape)
    out = None if destination is None else destination(name)
    if out is None or not (
        tuple(out.shape) == shape
        and out.dtype == local.dtype
        and out.device == local.device
        and out.is_contiguous()
    ):
        out = torch.empty(shape, dtype=local.dtype, device=local.device)
    _all_gather_single(out, local, group=group)
    return out


def _hf_config_of(model: nn.Module) -> Any | None:
    """``model.config`` when it is a transformers ``PretrainedConfig``, else None.

    Duck-typed (``model_type`` and ``to_dict()``), so that no transformers import
    is needed and a module's own ``config`` attribute of another kind is not
    mistaken for an HF config.
    """
    config = getattr(model, "config", None)
    if isinstance(getattr(config, "model_type", None), str) and callable(
        getattr(config, "to_dict", None)
    ):
        return config
    return None


class DTensorRefitSource(RefitSource):
    """The refit source of a torch trainer: HF checkpoint names, one tensor at a time.

    Names and shapes are those ``save_pretrained`` writes (the HF safetensors
    checkpoint), not the module's: wrapper prefixes are stripped, tied weights
    (``lm_head.weight`` when ``tie_word_embeddings``) appear once when they are
    one tensor (a head the config ties but the model holds separately, a
    broken tie, is never dropped: see :attr:`broken_ties`), and tensors
    that transformers fuses in memory are split back as transformers' own
    reversal (``revert_weight_conversion``) does (Qwen3-MoE / Qwen3-Next:
    ``mlp.experts.gate_up_proj [E, 2*Im, H]`` → ``mlp.experts.{e}.gate_proj.weight
    [Im, H]`` and ``...up_proj.weight [Im, H]``; ``mlp.experts.down_proj [E, H, Im]``
    → ``mlp.experts.{e}.down_proj.weight [H, Im]``), as zero-copy views where a
    rule in ``refit/_torch_rules.py`` matches it exactly. Gemma 4 keeps its
    experts fused, as its checkpoints do.

    A PEFT LoRA trainer (``peft.get_peft_model(model, LoraConfig(...))``, also
    inside FSDP2/DDP/compile wrappers) is refit **merged**, as TRL does: the
    base model's checkpoint, exactly what ``peft_model.merge_and_unload()
    .save_pretrained()`` writes (names, shapes, order of the base model's own
    source), each targeted weight ``[out, in]`` streamed as ``W + scaling · B @ A``
    with the active adapter's ``lora_A [r, in]`` and ``lora_B [out, r]``
    (PEFT's arithmetic: ``scaling`` is ``lora_alpha / r``, ``/ sqrt(r)`` with
    ``use_rslora``, per module with ``rank_pattern``/``alpha_pattern``; the
    product in fp32, then the manifest dtype), bit for bit what
    ``merge_and_unload()`` gives for fp32 adapters. The trainer's modules are
    never modified. A ``modules_to_save`` module is sent as the adapter's
    trained copy under the original name. For the adapter alone, see
    ``LoRAAdapterRefitSource``.

    Order: ``save_pretrained``'s (the ``state_dict`` order, naturally sorted by
    transformers when a conversion applies; all experts' ``gate_proj``, then all
    ``up_proj``), the order ``aiosync.engines.embedded``'s ``expected_manifest`` uses.
    Identical on every rank.

    On a sharded model every rank must call :meth:`iter_weights` (each DTensor
    gather is a collective); every rank receives the full tensors.

    Args:
        model: the trainer's model (``nn.Module``; a transformers ``PreTrainedModel``
            inside any wrappers gets the checkpoint-name reversal).
        dtype: manifest dtype. A ``torch.dtype`` casts every floating-point tensor
            to it (fp32 master weights → bf16 engine); integer and bool tensors
            keep theirs. A mapping ``{hf_name: dtype}`` casts just those names.
            None keeps each tensor's dtype.
        state_dict_adapter: an object with ``to_hf(state_dict) -> state_dict``
            (torchtitan's ``StateDictAdapter``) used instead of transformers'
            reversal; called with one tensor at a time.
        optimizer: a ``torch.optim.Optimizer`` whose state
            :meth:`offload_before_refit` moves to CPU (colocated refits).

    Raises:
        TypeError: ``dtype`` or ``state_dict_adapter`` is malformed.
        ValueError: a PEFT model whose configuration the merged refit does not
            support, naming the option: a PEFT type other than LoRA, DoRA
            (``use_dora``) or another LoRA variant, several active adapters,
            ``lora_bias``, ``target_parameters``, ``trainable_token_indices``,
            ``layer_replication``, LoRA on a non-linear layer (embeddings,
            quantized layers) or on a tied weight, adapters merged in place
            (``merge_adapter()``); or PEFT tuner layers without their ``PeftModel``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
        state_dict_adapter: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if dtype is not None and not isinstance(dtype, torch.dtype | Mapping):
            raise TypeError(f"dtype must be a torch.dtype or a mapping, got {dtype!r}")
        if isinstance(dtype, Mapping):
            for name, value in dtype.items():
                if not isinstance(value, torch.dtype):
                    raise TypeError(f"dtype[{name!r}] must be a torch.dtype, got {value!r}")
        self.model = model
        self.dtype = dtype
        self.optimizer = optimizer
        inner = _unwrap(model)
        peft_model = find_peft_model(inner)
        # A PEFT model is refit as its base model, its adapter merged (``_peft``).
        self._peft: MergedPeft | None = None
        if peft_model is not None:
            self._peft = MergedPeft(peft_model, _tied_aliases(peft_model.get_base_model()))
            inner = self._peft.base_model
        # The model whose checkpoint is sent (the base model of a PEFT one): its
        # config is the trainer's side of the config check (hf_config()).
        self._base_model = inner
        self._hf_model = inner if state_dict_adapter is None else None
        self._reverter: Reverter | None = (
            _adapter_reverter(state_dict_adapter)
            if state_dict_adapter is not None
            else _hf_reverter(inner)
        )
        self._tied = _tied_aliases(inner)
        self._plan: tuple[_Entry, ...] | None = None
        self._broken_ties: dict[str, str] = {}
        # The ties the plan relies on (the tied name left out of the manifest):
        # ``(tied name, its module key, source name, its module key)``.
        self._held_ties: tuple[tuple[str, str, str, str], ...] = ()
        self._offloaded: list[tuple[dict[str, Any], str, torch.device]] = []

    # -- manifest -------------------------------------------------------------

    def _target_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        if self.dtype is None:
            return dtype
        if isinstance(self.dtype, torch.dtype):
            return self.dtype if dtype.is_floating_point else dtype
        return self.dtype.get(name, dtype)

    def _module_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        """``(module_key, stripped_key, tensor)`` for parameters and persistent buffers,
        tied duplicates removed. References only: nothing is gathered or copied."""
        raw = [
            (_strip_wrapper_prefixes(k), k, t)
            for k, t in self.model.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor)
        ]
        if self._peft is not None:
            raw = self._peft.checkpoint_tensors(raw)
        by_key = {key: module_key for key, module_key, _ in raw}
        if len(by_key) != len(raw):
            raise RefitMismatchError("two state_dict keys map to the same name after unwrapping")
        kept, broken = _dedup_tied([(key, t) for key, _, t in raw], self._tied)
        for name, source in broken.items():
            _log.warning(
                "the config ties %s to %s (tie_word_embeddings), but the model holds it as a "
                "separate tensor whose values may have drifted: it is sent as its own checkpoint "
                "tensor. An engine that ties it refuses the refit (RefitMismatchError); re-tie "
                "it (model.tie_weights()) or set tie_word_embeddings=False on both sides",
                name,
                source,
            )
        self._broken_ties = broken
        self._held_ties = tuple(
            (name, by_key[name], source, by_key[source])
            for name, source in self._tied.items()
            if name in by_key and source in by_key and name not in broken
        )
        return [(by_key[key], key, t) for key, t in kept]

    def _build_plan(self) -> tuple[_Entry, ...]:
        entries: list[_Entry] = []
        seen: set[str] = set()
        metas: dict[str, torch.Tensor] = {}
        for module_key, key, tensor in self._module_tensors():
            meta = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
            metas[key] = meta
            reverted = self._reverter(key, meta) if self._reverter is not None else {key: meta}
            outputs = tuple(
                (name, tuple(t.shape), self._target_dtype(name, t.dtype))
                for name, t in reverted.items()
            )
            for name, _, _ in outputs:
                if name in seen:
                    raise RefitMismatchError(f"checkpoint name {name!r} produced twice")
                seen.add(name)
            # transformers' reversal leaves an unconverted tensor as it is, so it is
            # skipped; an adapter may change values at the same shape, so it never is.
            untouched = len(outputs) == 1 and outputs[0][:2] == (key, tuple(tensor.shape))
            mode: Literal["plain", "views", "revert"] = "plain"
            if self._reverter is not None and (self._hf_model is None or not untouched):
                mode = "revert"
                if self._hf_model is not None and self._rule_agrees(key, meta, outputs):
                    mode = "views"
            merge = self._peft.merge_for(key) if self._peft is not None else None
            entries.append(_Entry(module_key, key, outputs, mode, merge))
        if self._hf_model is not None:
            entries = self._in_checkpoint_order(entries, metas)
        return tuple(entries)

    @staticmethod
    def _rule_agrees(
        key: str,
        meta: torch.Tensor,
        outputs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...],
    ) -> bool:
        """Whether a zero-copy rule gives exactly transformers' names, shapes and order."""
        views = _zero_copy_split(key, meta)
        if views is None:
            return False
        return [(n, tuple(v.shape)) for n, v in views] == [(n, s) for n, s, _ in outputs]

    def _in_checkpoint_order(
        self, entries: list[_Entry], metas: dict[str, torch.Tensor]
    ) -> list[_Entry]:
        """Reorder ``entries`` into ``save_pretrained``'s order, checking that the
        per-tensor reversal gives exactly what the whole-state-dict one gives.

        Raises:
            RefitMismatchError: the model's conversion cannot be reversed one
                tensor at a time (a checkpoint tensor built from several module tensors).
        """
        assert self._hf_model is not None
        expected = _hf_checkpoint_order(self._hf_model, metas)
        if expected is None:
            return entries
        position = {name: i for i, (name, _) in enumerate(expected)}
        missing = [n for e in entries for n, _, _ in e.outputs if n not in position]
        if missing:
            raise RefitMismatchError(
                f"per-tensor conversion gives names save_pretrained does not: {missing[:3]}"
            )
        ordered = sorted(entries, key=lambda e: position[e.outputs[0][0]])
        got = [(n, s) for e in ordered for n, s, _ in e.outputs]
        if got != expected:
            pairs = enumerate(zip(got, expected, strict=False))
            first = next((i for i, (a, b) in pairs if a != b), min(len(got), len(expected)))
            raise RefitMismatchError(
                "this model's checkpoint conversion cannot be streamed one tensor at a time: "
                f"entry {first} differs from save_pretrained's layout"
            )
        return ordered

    def _entries(self) -> tuple[_Entry, ...]:
        if self._plan is None:
            self._plan = self._build_plan()
        return self._plan

    @property
    def broken_ties(self) -> dict[str, str]:
        """``{tied name: source name}`` for ties the config declares but the model broke.

        Such a name (``lm_head.weight`` when ``tie_word_embeddings`` is set but the
        head is a tensor of its own) is in the manifest and streamed like any
        other; a warning is logged when the manifest is built. Empty for a model
        whose ties hold. Builds the manifest (shapes only) if needed.
        """
        self._entries()
        return dict(self._broken_ties)

    def prepare_refit_info(self) -> RefitManifest:
        """``{hf_name: (shape, dtype)}`` in :meth:`iter_weights` order (HF checkpoint names).

        Computed from shapes only (meta tensors): no gather, no collective.
        Cached: the model's structure must not change afterwards.

        Raises:
            RefitMismatchError: two tensors map to one checkpoint name, or the
                model's conversion cannot be reversed one tensor at a time.
        """
        return {name: (shape, dtype) for e in self._entries() for name, shape, dtype in e.outputs}

    def hf_config(self) -> Any | None:
        """The model's HF config (a transformers ``PretrainedConfig``), which the
        transports compare with each engine's at init (:class:`aiosync.sources.ConfigSource`).

        Of a PEFT model: its base model's config (the merged refit sends the base
        model's checkpoint). None for a module that holds no HF config (a plain
        ``nn.Module``, a torchtitan model): nothing is compared then.
        """
        return _hf_config_of(self._base_model)

    # -- streaming --------------------------------------------------------------

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)``: full, unsharded, manifest shape and dtype, in order.

        One module tensor is gathered at a time (a collective on a sharded model:
        every rank must iterate). Tensors are on the parameters' device. When no
        cast or gather is needed a yielded tensor is a view of the live parameter
        (possibly non-contiguous): consume it before the next optimizer step.

        Raises:
            RefitMismatchError: the model changed since :meth:`prepare_refit_info`
                (of a PEFT model: its active adapter, or an adapter merged in place;
                a tie the manifest relies on was broken: :meth:`check_ties`),
                at the first ``next()`` for a tie, before any tensor is yielded.
        """
        return self._weights(None)

    def iter_weights_into(
        self, destination: Callable[[str], torch.Tensor | None]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`iter_weights`, gathering a sharded tensor into ``destination(hf_name)``
        where it can (:class:`aiosync.sources.GathersInto`): a checkpoint tensor that
        is a module tensor sharded on dim 0 in equal pieces over a 1-D mesh (FSDP2's
        layout when the rows divide by the world) is one all-gather into it. Any other
        tensor, or a destination of another shape, dtype or device, is gathered as
        :meth:`iter_weights` does.
        """
        return self._weights(destination)

    def preflight(self) -> None:
        """:class:`~aiosync.sources.Preflight`: :meth:`check_ties`, which
        ``sync_weights`` runs before it pauses the engine or moves a byte.

        Raises:
            RefitMismatchError: a tie the manifest relies on was broken.
        """
        self.check_ties()

    def check_ties(self, live: Mapping[str, Any] | None = None) -> None:
        """Check that every tie the manifest relies on still holds (case C37).

        The manifest leaves a tied name out (``lm_head.weight`` when it is
        ``model.embed_tokens.weight``); a trainer that unties it afterwards
        (``load_state_dict(..., assign=True)``, a new ``Parameter``,
        ``param.data = ...``) would train a head no sync sends. Called at the
        start of every stream (:meth:`iter_weights`, the shard-aware
        transport's layouts): a pointer compare per tie.

        Args:
            live: the model's ``state_dict(keep_vars=True)``, if already at hand.

        Raises:
            RefitMismatchError: a tied tensor no longer aliases its source,
                naming both (nothing is streamed).
        """
        self._entries()  # the plan, and with it the ties it relies on
        if not self._held_ties:
            return
        if live is None:
            live = self.model.state_dict(keep_vars=True)
        for name, module_key, source, source_key in self._held_ties:
            tied, origin = live.get(module_key), live.get(source_key)
            if not isinstance(tied, torch.Tensor) or not isinstance(origin, torch.Tensor):
                continue  # vanished: the stream names it
            if not _same_tensor(tied, origin):
                raise RefitMismatchError(
                    f"{name} is no longer tied to {source}: the manifest leaves {name} out "
                    "(the config ties it), but the model now holds a tensor of its own "
                    "(untied after the manifest was built, e.g. by load_state_dict(..., "
                    "assign=True) or param.data = ...), which no sync would send. Re-tie "
                    "it (model.tie_weights()) before syncing, or set tie_word_embeddings="
                    "False on both sides and build the synchronizer again"
                )

    def _weights(
        self, destination: Callable[[str], torch.Tensor | None] | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        entries = self._entries()
        if self._peft is not None:
            self._peft.check_unchanged()
        live = self.model.state_dict(keep_vars=True)
        self.check_ties(live)
        # Everything below works on detached tensors, so no autograd graph is
        # built. ``torch.no_grad()`` is not held across the ``yield``: the grad
        # mode is thread-local and a consumer may resume this generator from a
        # worker thread, which would then be left with gradients off.
        for entry in entries:
            tensor = live.get(entry.module_key)
            if not isinstance(tensor, torch.Tensor):
                raise RefitMismatchError(f"{entry.module_key!r} vanished from the model")
            full = tensor.detach()
            if entry.merge is not None:
                # Gathered in its own dtype: the merge rounds once, as PEFT's does.
                full = entry.merge.merged(full)
            elif _is_dtensor(full):
                # Cast the local shard first when every output gets the same dtype:
                # the gather then moves and allocates engine-dtype bytes (an
                # elementwise cast commutes with the gather, bit for bit).
                dtypes = {dtype for _, _, dtype in entry.outputs}
                if len(dtypes) == 1 and full.dtype.is_floating_point:
                    full = full.to(dtypes.pop())
                group = _even_rows_group(full) if entry.mode == "plain" else None
                if group is None:
                    full = full.full_tensor()  # type: ignore[attr-defined]
                else:
                    full = _gather_rows(full, group, destination, entry.outputs[0][0])
            outputs = self._convert(entry, full)
            del full  # the outputs hold what they need
            for index, (name, shape, dtype) in enumerate(entry.outputs):
                got = next(outputs, None)
                if got is None or got[0] != name or tuple(got[1].shape) != shape:
                    found = "nothing" if got is None else f"{got[0]} {tuple(got[1].shape)}"
                    which = (
                        f" (its output {index + 1} of {len(entry.outputs)})"
                        if len(entry.outputs) > 1
                        else ""
                    )
                    raise RefitMismatchError(
                        f"{entry.key}: the checkpoint expects {name} {shape}{which}, "
                        f"got {found} (the parameter changed since the manifest was built?)"
                    )
                out = got[1].to(dtype)
                del got  # drop the uncast view before the consumer runs
                yield name, out
                del out
            extra = next(outputs, None)
            if extra is not None:
                raise RefitMismatchError(f"{entry.key}: unexpected extra tensor {extra[0]}")

    def _convert(self, entry: _Entry, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint tensors of one full module tensor, lazily where possible."""
        if entry.mode == "plain":
            return iter(((entry.outputs[0][0], full),))
        if entry.mode == "views":
            views = _zero_copy_split(entry.key, full)
            assert views is not None  # checked on meta when the plan was built
            return views
        assert self._reverter is not None
        return iter(self._reverter(entry.key, full).items())

    def _convert_chunk(
        self, entry: _Entry, chunk: torch.Tensor, first_row: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint tensors held in rows ``[first_row, first_row + len(chunk))``
        of a fused tensor a zero-copy rule splits (an FSDP2 rank's chunk of
        ``[E, ...]``: whole experts), as views named with their global expert index.

        Only for ``entry.mode == "views"`` (the rule agreed with transformers'
        reversal when the plan was built).
        """
        assert entry.mode == "views", entry
        views = _zero_copy_split(entry.key, chunk, first_row)
        assert views is not None  # checked on meta when the plan was built
        return views

    # -- colocated offload ----------------------------------------------------

    def offload_before_refit(self) -> None:
        """Move the optimizer's state tensors to CPU (colocated refits free device memory).

        State already on CPU stays where it is (a no-op on CPU-only machines).
        Calling it twice without :meth:`offload_after_refit` is a no-op the second time.
        """
        if self.optimizer is None or self._offloaded:
            return
        cpu = torch.device("cpu")
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                    self._offloaded.append((state, key, value.device))
                    state[key] = value.to(cpu, non_blocking=True)
        if self._offloaded and torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def offload_after_refit(self) -> None:
        """Move what :meth:`offload_before_refit` moved back to its device. Idempotent."""
        moved, self._offloaded = self._offloaded, []
        for state, key, device in moved:
            state[key] = state[key].to(device, non_blocking=True)
        if moved and torch.cuda.is_available():
            torch.cuda.synchronize()
