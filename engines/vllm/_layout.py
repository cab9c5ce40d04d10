"""What a vLLM worker holds of each HF checkpoint tensor, and box writes into its layers.

The shard-aware transport (:mod:`aiosync.transports.sharded`) sends each worker
only the slices it keeps, so the worker must say which those are
(``weight_layout() -> {hf_name: Part}``) and write each received box where
vLLM's own ``load_weights`` would have put it (``load_weight_boxes``).
:func:`describe_model` derives both from the worker's layers, the same
attributes their weight loaders narrow with (vLLM 0.32,
``model_executor/layers/linear.py`` and ``vocab_parallel_embedding.py``):

======================================  =================================================
vLLM layer (exact type)                 part of each HF tensor held (``tp_rank`` of ``tp``)
======================================  =================================================
``ColumnParallelLinear``                weight and bias rows ``[r*n, (r+1)*n)`` (dim 0)
``MergedColumnParallelLinear``          each of ``output_sizes`` (``gate_proj``,
                                        ``up_proj``), its rows ``[r*n_i, (r+1)*n_i)``,
                                        packed one after another in dim 0
``QKVParallelLinear``                   ``q_proj`` heads ``num_heads`` per rank;
                                        ``k_proj``/``v_proj`` ``num_kv_heads`` per rank,
                                        rank ``r // num_kv_head_replicas``'s (KV heads
                                        replicated when fewer than ``tp``)
``RowParallelLinear``                   weight columns ``[r*n, (r+1)*n)`` (dim 1),
                                        bias whole
``ReplicatedLinear``, ``GateLinear``     whole (``GateLinear``: an MoE router)
``RoutedExperts`` (``FusedMoE``'s        the experts this rank holds, by the layer's
experts)                                expert map (vLLM's EP placement, linear or
                                        round robin: :mod:`._experts`): each
                                        ``{e}.gate_proj``/``up_proj`` rows and
                                        ``down_proj`` columns ``[r*n, (r+1)*n)``,
                                        whole under EP; other experts absent
``VocabParallelEmbedding``,             rows ``[org_vocab_start_index,
``ParallelLMHead``                      org_vocab_end_index)``: the real vocabulary only,
                                        never vLLM's padding rows
a layer with neither ``quant_method``   whole (norms, ``q_norm``/``k_norm``): vLLM's
nor a custom weight loader              ``default_weight_loader`` copies them whole
======================================  =================================================

HF names are the module's path, a packed layer's (``packed_modules_mapping``:
``qkv_proj`` → ``q_proj``, ``k_proj``, ``v_proj``) with each part's name, checked
against the model's ``hf_to_vllm_mapper`` where it has one. A tied ``lm_head``
(vLLM's ``tie_weights``: the head's ``weight`` *is* the embedding's) is reported
once, as the checkpoint has it (``model.embed_tokens.weight``), and written into
both layers. Anything else is refused with a
:class:`~aiosync.errors.TransportError` naming the layer: quantized models,
LoRA-enabled engines, other layer types (Mamba, subclasses of the above),
layers with buffers or parameters the table does not name, and MoE layers with
EPLB's redundant experts, fused shared experts, expert biases, padded sizes or a
non-gated activation.

**Writes and vLLM's kernel formats.** After loading, vLLM turns some parameters
into kernel formats (``process_weights_after_loading``): on its CPU worker every
unquantized linear layer's weight is packed for oneDNN or sgl-kernel and the
``weight`` parameter is replaced by an empty tensor, and an embedding's weight is
packed into a second copy for the logits GEMM. A box written into the live
parameter would be lost or never read. So boxes are written inside vLLM's
*layerwise reload* (``initialize_layerwise_reload``, which the worker's reload
bracket opens): the first box of a layer materializes its checkpoint-format
tensors (zeroed, as vLLM's loaders zero the vocabulary padding), every box is
copied straight into its region there (``narrow(...)[...].copy_``: no full HF
tensor is ever built, only this rank's layer), and once every element the layer
holds has arrived, vLLM's own step processes it (``process_weights_after_loading``,
then a copy into the kernel tensors that compiled graphs reference). Layers a
receive did not complete are put back as they were by ``finalize_layerwise_reload``;
:meth:`VLLMLayoutModel.receiving` then fails the receive.

**Tied heads and vLLM's own loader.** A refit through the model's ``load_weights``
(the broadcast, IPC) loads the tied tensor into the embedding only, and vLLM's
reload processes only the layer a tied parameter is loaded through (limitation 2
in the docs of its ``model_executor/model_loader/reload`` package): the head's
packed copy would keep the old logits. :class:`TiedHeads` re-runs the head's
processing after such a reload.

See ``docs/vllm.md`` for the engine side and ``docs/topology.md`` for the transports.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from aiosync.errors import RefitMismatchError, TransportError
from aiosync.layout import Part, box_of
from aiosync.transports.sharded import box_within

from ._experts import ExpertPlacement, placed_experts

__all__ = ["TiedHeads", "VLLMLayoutModel", "config_refusal", "describe_model", "tied_heads"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HeldTensor:
    """Where the held part of one HF tensor lives in a vLLM layer.

    Attributes:
        name: HF checkpoint name.
        part: the part of the full HF tensor this worker holds.
        layers: the vLLM module paths whose checkpoint-format parameter holds it
            (two for a tied head: the embedding, then ``lm_head``).
        param: that parameter's name in the module (``weight``, ``bias``).
        offset: first index of the part's local tensor along dim 0 of the
            parameter (``k_proj`` after the ``q_proj`` rows of ``qkv_proj``).
        dtype: the parameter's checkpoint dtype.
        slot: the local expert slot (dim 0 of a ``FusedMoE`` layer's ``w13_weight``
            and ``w2_weight``) the part lives in, ``offset`` then counting along the
            slot's dim 0; None for a parameter that is not stacked per expert.
    """

    name: str
    part: Part
    layers: tuple[str, ...]
    param: str
    offset: int
    dtype: torch.dtype
    slot: int | None = None

    def region(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part's local tensor as a view of the layer's parameter ``tensor``."""
        if self.slot is not None:
            tensor = tensor[self.slot]
        if tensor.ndim == 0:
            return tensor
        return tensor.narrow(0, self.offset, self.part.local_shape[0])


def config_refusal(vllm_config: Any) -> str | None:
    """Why an engine of ``vllm_config`` cannot report its layout, known from its config
    alone (None: its layers say): a quantized model, or one with LoRA enabled."""
    quantization = getattr(vllm_config.model_config, "quantization", None)
    if quantization is not None:
        return (
            f"the model is quantized ({quantization!r}): the shard-aware transport "
            "describes unquantized models only; use CollectiveWeightSynchronizer"
        )
    if getattr(vllm_config, "lora_config", None) is not None:
        return (
            "the engine has LoRA enabled (its layers are wrapped): the shard-aware "
            "transport describes plain layers only; use CollectiveWeightSynchronizer"
        )
    return None


def describe_model(model: Any, vllm_config: Any) -> dict[str, HeldTensor]:
    """``{hf_name: HeldTensor}`` of a vLLM worker's model, in module order.

    Args:
        model: the worker's model (``model_runner.get_model()``) after vLLM loaded
            it: its reload metadata (``record_metadata_for_reloading``) gives the
            checkpoint-format parameters.
        vllm_config: the worker's ``VllmConfig``.

    Raises:
        TransportError: anything this module cannot describe exactly (see the
            module docs), naming the layer.
    """
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    refusal = config_refusal(vllm_config)
    if refusal is not None:
        raise TransportError(refusal)
    packed: Mapping[str, Sequence[str]] = getattr(model, "packed_modules_mapping", None) or {}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    linear_kinds: dict[type, str] = {
        QKVParallelLinear: "qkv",
        MergedColumnParallelLinear: "merged",
        ColumnParallelLinear: "column",
        RowParallelLinear: "row",
        ReplicatedLinear: "replicated",
        GateLinear: "replicated",
    }
    embeddings = (VocabParallelEmbedding, ParallelLMHead)
    heads = tied_heads(model)
    held: dict[str, HeldTensor] = {}
    owner_of: dict[int, str] = {}  # id of a live parameter -> HF name (ties)
    for path, layer in model.named_modules():
        params = _checkpoint_params(path, layer)
        if not params:
            continue
        tied = [
            owner_of[id(p)]
            for n, p in layer._parameters.items()
            if p is not None and id(p) in owner_of and n in params
        ]
        if tied:
            _add_tie(held, tied, path, layer, params, path in heads)
            continue
        kind = linear_kinds.get(type(layer))
        if kind is not None:
            entries = _linear(path, layer, kind, params, packed)
        elif type(layer) in embeddings:
            entries = _embedding(path, layer, params)
        elif type(layer) is RoutedExperts:
            entries = _routed_experts(path, layer, params)
        elif hasattr(layer, "quant_method") or hasattr(layer, "base_layer"):
            raise TransportError(
                f"{path}: a {type(layer).__name__} layer, which the shard-aware transport "
                "cannot describe; use CollectiveWeightSynchronizer"
            )
        else:
            entries = _replicated(path, layer, params)
        for entry in entries:
            _check_mapped(mapper, entry, path)
            if entry.name in held:
                raise TransportError(f"{path}: {entry.name} is held by two layers")
            held[entry.name] = entry
        for n, p in layer._parameters.items():
            if p is not None and n in params:
                owner_of[id(p)] = next(e.name for e in entries if e.param == n)
    return held


def _checkpoint_params(path: str, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The layer's own parameters in checkpoint format (shapes, dtypes): those vLLM
    recorded for reloading, plus ``bias``, which its reload never moves (``SKIP_TENSORS``)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_TENSORS

    live = {n: p for n, p in layer._parameters.items() if p is not None}
    if not live:
        return {}
    info = LAYERWISE_INFO.get(layer)
    if info is None:
        raise TransportError(
            f"{path}: vLLM recorded no reload metadata for this layer "
            "(record_metadata_for_reloading): its checkpoint format is unknown"
        )
    recorded, buffers = info.restore_metadata
    if buffers:
        raise TransportError(
            f"{path}: a {type(layer).__name__} layer with buffers {sorted(buffers)}, which "
            "the shard-aware transport cannot describe; use CollectiveWeightSynchronizer"
        )
    params = dict(recorded)
    for name, param in live.items():
        if name in SKIP_LOAD_TENSORS:
            raise TransportError(f"{path}: holds {name}, which vLLM's reload does not load")
        if name in SKIP_TENSORS:
            params[name] = param
    return params


def _part_entry(
    name: str,
    path: str,
    param: str,
    tensor: torch.Tensor,
    shape: tuple[int, ...],
    dim: int,
    start: int,
    length: int,
    offset: int = 0,
    dtype: torch.dtype | None = None,
) -> HeldTensor:
    """One entry, checked to fit the layer's checkpoint-format parameter ``tensor``
    (``dtype``: the checkpoint dtype, when the parameter may hold another)."""
    try:
        part = Part(shape, dim, start, length)
    except ValueError as exc:
        raise TransportError(f"{path}.{param}: {name} has no part {exc}") from exc
    if part.is_whole:
        part = Part.whole(shape)  # one spelling of "all of it", whatever the cut dim
    entry = HeldTensor(name, part, (path,), param, offset, dtype or tensor.dtype)
    local = part.local_shape
    rows = tuple(tensor.shape)
    fits = len(rows) == len(local) and (
        not local or (offset + local[0] <= rows[0] and rows[1:] == local[1:])
    )
    if not fits:
        raise TransportError(
            f"{path}.{param}: {name}'s part {part} (local {local}, at row {offset}) does "
            f"not fit the parameter's checkpoint shape {rows}"
        )
    return entry


def _linear(
    path: str,
    layer: Any,
    kind: str,
    params: Mapping[str, torch.Tensor],
    packed: Mapping[str, Sequence[str]],
) -> list[HeldTensor]:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    if type(layer.quant_method) is not UnquantizedLinearMethod:
        raise TransportError(
            f"{path}: quantized ({type(layer.quant_method).__name__}); the shard-aware "
            "transport describes unquantized layers only"
        )
    unknown = sorted(set(params) - {"weight", "bias"})
    if unknown or "weight" not in params:
        raise TransportError(f"{path}: parameters {sorted(params)}, expected weight (and bias)")
    for name, tensor in params.items():
        if getattr(tensor, "is_sharded_weight", False):
            raise TransportError(f"{path}.{name}: pre-sharded on disk (is_sharded_weight)")
    parent, _, leaf = path.rpartition(".")
    prefix = f"{parent}." if parent else ""
    rank, size = int(layer.tp_rank), int(layer.tp_size)
    in_full = int(layer.input_size)
    # The checkpoint dtype: vLLM's CPU GEMM may keep a bias in float32 after loading.
    dtype = layer.params_dtype
    entries: list[HeldTensor] = []
    if kind in ("qkv", "merged"):
        subs = list(packed.get(leaf, ()))
        if kind == "qkv":
            q = int(layer.num_heads) * int(layer.head_size)
            k = int(layer.num_kv_heads) * int(layer.head_size)
            v = int(layer.num_kv_heads) * int(layer.v_head_size)
            kv_rank = rank // int(layer.num_kv_head_replicas)
            pieces = [
                (int(layer.total_num_heads) * int(layer.head_size), rank * q, q, 0),
                (int(layer.total_num_kv_heads) * int(layer.head_size), kv_rank * k, k, q),
                (int(layer.total_num_kv_heads) * int(layer.v_head_size), kv_rank * v, v, q + k),
            ]
        else:
            pieces = []
            offset = 0
            for full in (int(n) for n in layer.output_sizes):
                local = full // size
                pieces.append((full, rank * local, local, offset))
                offset += local
        if len(subs) != len(pieces):
            raise TransportError(
                f"{path}: a {type(layer).__name__} of {len(pieces)} parts, but the model's "
                f"packed_modules_mapping gives {leaf!r} the checkpoint modules {subs} "
                "(fused on disk?)"
            )
        for sub, (full, start, length, offset) in zip(subs, pieces, strict=True):
            for pname, tensor in params.items():
                shape = (full, in_full) if pname == "weight" else (full,)
                name = f"{prefix}{sub}.{pname}"
                entries.append(
                    _part_entry(name, path, pname, tensor, shape, 0, start, length, offset, dtype)
                )
        return entries
    if leaf in packed:
        raise TransportError(
            f"{path}: a {type(layer).__name__}, but packed_modules_mapping packs {leaf!r}"
        )
    out_full = int(layer.output_size)
    for pname, tensor in params.items():
        name = f"{path}.{pname}"
        if kind == "column":
            n = int(layer.output_size_per_partition)
            shape = (out_full, in_full) if pname == "weight" else (out_full,)
            entries.append(_part_entry(name, path, pname, tensor, shape, 0, rank * n, n, 0, dtype))
        elif kind == "row" and pname == "weight":
            n = int(layer.input_size_per_partition)
            entries.append(
                _part_entry(
                    name, path, pname, tensor, (out_full, in_full), 1, rank * n, n, 0, dtype
                )
            )
        else:  # a row-parallel bias, a replicated layer: whole on every rank
            shape = (out_full, in_full) if pname == "weight" else (out_full,)
            entries.append(_part_entry(name, path, pname, tensor, shape, 0, 0, shape[0], 0, dtype))
    return entries


def _embedding(path: str, layer: Any, params: Mapping[str, torch.Tensor]) -> list[HeldTensor]:
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if type(layer.quant_method) is not UnquantizedEmbeddingMethod:
        raise TransportError(
            f"{path}: quantized ({type(layer.quant_method).__name__}); the shard-aware "
            "transport describes unquantized layers only"
        )
    if set(params) != {"weight"}:
        raise TransportError(f"{path}: parameters {sorted(params)}, expected weight only")
    if int(layer.num_added_embeddings) != 0:
        raise TransportError(
            f"{path}: {layer.num_added_embeddings} added (LoRA) vocabulary rows, which the "
            "checkpoint does not hold"
        )
    indices = layer.shard_indices
    start = int(indices.org_vocab_start_index)
    length = int(indices.org_vocab_end_index) - start
    shape = (int(layer.org_vocab_size), int(layer.embedding_dim))
    return [
        _part_entry(f"{path}.weight", path, "weight", params["weight"], shape, 0, start, length)
    ]


def _replicated(path: str, layer: Any, params: Mapping[str, torch.Tensor]) -> list[HeldTensor]:
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    entries = []
    for pname, tensor in params.items():
        # The recorded tensors keep the wrapper of an earlier reload (its
        # online_process_loader is set on them): the layer's loader is under it.
        loader = _get_original_loader(tensor)
        if loader is not default_weight_loader:
            raise TransportError(
                f"{path}.{pname}: loaded by {getattr(loader, '__qualname__', loader)!r}, "
                "which the shard-aware transport cannot describe; use "
                "CollectiveWeightSynchronizer"
            )
        shape = tuple(int(n) for n in tensor.shape)
        entries.append(
            _part_entry(
                f"{path}.{pname}", path, pname, tensor, shape, 0, 0, shape[0] if shape else 1
            )
        )
    return entries


def _routed_experts(path: str, layer: Any, params: Mapping[str, torch.Tensor]) -> list[HeldTensor]:
    """The experts a ``RoutedExperts`` layer (``FusedMoE``'s weights) holds, each
    gate/up/down projection cut as vLLM's expert weight loader narrows it
    (``routed_experts.py``: ``_load_w13``, ``_load_w2``).

    The experts come from the layer's own expert map (global id -> local slot,
    what its weight loader uses), checked against vLLM's placement for the
    layer's EP rank and effective strategy (:func:`._experts.placed_experts`).
    """
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    if type(layer.quant_method) is not UnquantizedFusedMoEMethod:
        raise TransportError(
            f"{path}: quantized experts ({type(layer.quant_method).__name__}); the "
            "shard-aware transport describes unquantized layers only"
        )
    if set(params) != {"w13_weight", "w2_weight"}:
        raise TransportError(
            f"{path}: expert parameters {sorted(params)}, expected w13_weight and w2_weight "
            "(expert biases are not described)"
        )
    config = layer.moe_config
    parallel = config.moe_parallel_config
    manager = layer.expert_map_manager
    logical = int(config.num_logical_experts)
    if bool(parallel.enable_eplb) or int(layer.global_num_experts) != logical:
        raise TransportError(
            f"{path}: EPLB ({int(layer.global_num_experts) - logical} redundant experts, "
            "placement that moves at run time): the shard-aware transport describes "
            "static expert placement only; use CollectiveWeightSynchronizer"
        )
    if int(manager.num_fused_shared_experts) or not config.is_act_and_mul:
        raise TransportError(
            f"{path}: fused shared experts or a non-gated activation, which the "
            "shard-aware transport does not describe"
        )
    tp_size = int(parallel.tp_size)
    hidden = int(config.hidden_dim)
    full = int(config.intermediate_size)
    local = int(layer.intermediate_size_per_partition)
    if hidden != int(config.hidden_dim_unpadded) or local * tp_size != full:
        raise TransportError(
            f"{path}: padded experts (hidden {hidden} of {config.hidden_dim_unpadded}, "
            f"{local} x {tp_size} intermediate rows of {full})"
        )
    num = int(layer.global_num_experts)
    expert_map = manager.expert_map  # None without EP: every expert, in order
    ep_size = int(manager.ep_size) if expert_map is not None else 1
    ep_rank = int(manager.ep_rank) if expert_map is not None else 0
    if expert_map is None:
        held = tuple(range(num))
    else:
        slots = {int(s): g for g, s in enumerate(expert_map[:num].tolist()) if int(s) >= 0}
        held = tuple(slots[s] for s in sorted(slots))
        if sorted(slots) != list(range(len(held))):
            raise TransportError(f"{path}: expert map slots {sorted(slots)} are not 0..n-1")
    strategy = str(manager.placement_strategy)
    try:
        expected = placed_experts(ep_size, ep_rank, num, strategy)
        placement = ExpertPlacement(
            path.removesuffix(".routed_experts"),
            held,
            hidden,
            full,
            tp_size,
            int(parallel.tp_rank),
            (layer.ckpt_gate_proj_name, layer.ckpt_down_proj_name, layer.ckpt_up_proj_name),
        )
    except ValueError as exc:
        raise TransportError(f"{path}: {exc}") from exc
    if held != expected:
        raise TransportError(
            f"{path}: the layer's expert map holds experts {list(held)}, not those of "
            f"vLLM's {strategy} placement for EP rank {ep_rank} of {ep_size}, "
            f"{list(expected)}"
        )
    if int(layer.local_num_experts) != len(held) or not path.endswith(".routed_experts"):
        raise TransportError(
            f"{path}: {layer.local_num_experts} local experts, {len(held)} in its map "
            "(or not a FusedMoE's routed_experts)"
        )
    dtype = layer.params_dtype
    entries = []
    for name, slot, shard, part in placement.tensors():
        param = "w2_weight" if shard == "w2" else "w13_weight"
        offset = local if shard == "w3" else 0
        tensor = params[param]
        rows = tuple(tensor.shape)
        want = part.local_shape
        if rows[0] != len(held) or rows[2:] != want[1:] or offset + want[0] > rows[1]:
            raise TransportError(
                f"{path}.{param}: {name}'s part {part} (local {want}, at row {offset} of "
                f"slot {slot}) does not fit the parameter's checkpoint shape {rows}"
            )
        entries.append(HeldTensor(name, part, (path,), param, offset, dtype, slot))
    return entries


def _add_tie(
    held: dict[str, HeldTensor],
    names: list[str],
    path: str,
    layer: Any,
    params: Mapping[str, torch.Tensor],
    is_head: bool,
) -> None:
    """``layer`` shares its parameter with an earlier one, which must make it a tied
    head (``is_head``: :func:`tied_heads` lists it): writes of that HF tensor go to
    both layers, which must hold the same part of it."""
    if len(names) != 1 or set(params) != {"weight"} or not is_head:
        raise TransportError(f"{path}: shares parameters with {names}, not as a tied head does")
    first = held[names[0]]
    mine = _embedding(path, layer, params)[0]
    if mine.part != first.part or mine.offset != first.offset:
        raise TransportError(
            f"{path}: tied to {first.name} but holds {mine.part}, not {first.part}"
        )
    held[first.name] = HeldTensor(
        first.name, first.part, (*first.layers, path), first.param, first.offset, first.dtype
    )


def tied_heads(model: Any) -> dict[str, str]:
    """``{head path: embedding path}``: the model's tied heads, in module order.

    A tied head is a ``VocabParallelEmbedding`` (``ParallelLMHead``) whose ``weight``
    is the very parameter of an earlier one (vLLM's ``tie_weights``, or
    ``maybe_retie_word_embeddings`` after loading); vLLM's ``AutoWeightsLoader``
    finds ties the same way to load such a tensor once
    (``models/utils.py:_get_tied_embedding_params``). Read the live model: inside a
    layerwise reload every layer holds a parameter of its own.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    first: dict[int, str] = {}  # id of an embedding's weight -> the first layer holding it
    heads: dict[str, str] = {}
    for path, layer in model.named_modules():
        if not isinstance(layer, VocabParallelEmbedding):
            continue
        weight = layer._parameters.get("weight")
        if weight is None:
            continue
        owner = first.setdefault(id(weight), path)
        if owner != path:
            heads[path] = owner
    return heads


class TiedHeads:
    """Re-runs the post-load processing of the tied heads that a layerwise reload
    through the model's ``load_weights`` puts back unprocessed.

    vLLM's reload (``model_executor/model_loader/reload/layerwise.py``) gives each
    layer a parameter of its own; the tied tensor reaches the embedding only
    (``AutoWeightsLoader`` loads a tied name once), which is processed and copied
    into the kernel ``weight`` both layers share. ``finalize_layerwise_reload`` then
    puts the head, which loaded nothing, back as it was: its ``weight`` is the new
    one, but what its ``process_weights_after_loading`` derived from it is not. On
    vLLM's CPU worker that is the packed copy the logits GEMM reads
    (``UnquantizedEmbeddingMethod`` → ``layers/utils.py:dispatch_cpu_unquantized_gemm``:
    the oneDNN handle or sgl-kernel's packed weight behind ``layer.cpu_linear``).
    A head the reload did process is left alone: the shard-aware receive writes the
    tied tensor into both layers (:class:`VLLMLayoutModel`).

    Build it from the live model before ``initialize_layerwise_reload``, call
    :meth:`left_stale` after the loads and before ``finalize_layerwise_reload``,
    and :meth:`reprocess` on its result after that.

    Args:
        model: the worker's model (``model_runner.get_model()``), loaded.
    """

    def __init__(self, model: Any) -> None:
        modules = dict(model.named_modules())
        #: ``(head path, head, its embedding)`` of each tied head (:func:`tied_heads`).
        self.heads = [(h, modules[h], modules[e]) for h, e in tied_heads(model).items()]

    def left_stale(self) -> list[tuple[str, Any]]:
        """``(path, head)`` of each head whose embedding this reload loaded (processed
        it, or loaded part of it: ``finalize_layerwise_reload`` processes that) while
        the head loaded nothing. Inside the reload, before
        ``finalize_layerwise_reload``, which resets the progress read here."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        def loaded(layer: torch.nn.Module) -> bool:
            info = LAYERWISE_INFO.get(layer)
            # Every layer is in the reload (can_load) until it is processed.
            return info is not None and (not info.can_load() or info.load_numel > 0)

        return [
            (path, head) for path, head, embed in self.heads if loaded(embed) and not loaded(head)
        ]

    @staticmethod
    def reprocess(heads: Iterable[tuple[str, Any]]) -> None:
        """Run each head's ``quant_method.process_weights_after_loading`` again, from
        the ``weight`` it shares with its reloaded embedding, as vLLM did at startup
        after loading (``model_loader/utils.py:process_weights_after_loading``).
        After ``finalize_layerwise_reload`` only.

        Only ``UnquantizedEmbeddingMethod`` is re-run: it derives the kernel's copy
        and leaves ``weight`` as it is, so running it on the processed layer again
        is exact. On CUDA it does nothing (it packs only on the CPU platform; the
        logits GEMM reads the shared ``weight`` there), so this costs one call per
        head. Another method (a quantized head) may transform ``weight`` in place
        and must not run twice: such a head is left as vLLM's reload leaves it,
        with a warning.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )

        with torch.no_grad():
            for path, head in heads:
                method = head.quant_method
                if type(method) is UnquantizedEmbeddingMethod:
                    method.process_weights_after_loading(head)
                else:
                    _log.warning(
                        "%s: tied to a reloaded embedding, but its %s processing cannot "
                        "run twice; it may compute with the old weights",
                        path,
                        type(method).__name__,
                    )


def _check_mapped(mapper: Any, entry: HeldTensor, path: str) -> None:
    """The model's ``hf_to_vllm_mapper`` must send the HF name to this parameter."""
    if mapper is None:
        return
    # An expert's name reaches the layer through its expert mapping, unrenamed.
    expected = entry.name if entry.slot is not None else f"{path}.{entry.param}"
    mapped = mapper.map_name(entry.name) if hasattr(mapper, "map_name") else expected
    if mapped != expected:
        raise TransportError(
            f"{entry.name}: the model's hf_to_vllm_mapper maps it to {mapped!r}, "
            f"but the layer holding it is {expected!r}"
        )


@dataclass(eq=False)
class _Receive:
    """Per-layer progress of one receive (one reload bracket)."""

    written: dict[str, int] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)


class VLLMLayoutModel:
    """A vLLM worker's model as the shard-aware transport sees it: the
    :class:`~aiosync.transports.sharded.worker.LayoutModel` of a vLLM worker.

    Args:
        model: the worker's model (``model_runner.get_model()``), loaded.
        vllm_config: the worker's ``VllmConfig``.

    Raises:
        TransportError: the model cannot be described exactly (:func:`describe_model`).
    """

    def __init__(self, model: Any, vllm_config: Any) -> None:
        self.model = model
        self.held = describe_model(model, vllm_config)
        self._modules: dict[str, torch.nn.Module] = dict(model.named_modules())
        expected: dict[str, int] = {}
        for entry in self.held.values():
            for path in entry.layers:
                expected[path] = expected.get(path, 0) + entry.part.numel
        #: Elements each layer holds: a layer is processed once all of them arrived.
        self.expected = expected
        #: Called with every box written (the delta host copy records them).
        self.tee: Callable[[str, Sequence[tuple[int, int]], torch.Tensor], None] | None = None
        self._receive: _Receive | None = None

    def weight_layout(self) -> dict[str, Part]:
        """``{hf_name: part held}``, full HF shapes (an :data:`aiosync.layout.Layout`;
        names this worker does not hold, a tied ``lm_head.weight``, are absent)."""
        return {name: entry.part for name, entry in self.held.items()}

    @property
    def is_receiving(self) -> bool:
        """Inside :meth:`receiving`."""
        return self._receive is not None

    @contextmanager
    def receiving(self, *, whole: bool = True) -> Iterator[None]:
        """Bracket one receive's :meth:`load_weight_boxes` calls, inside vLLM's
        layerwise reload (the worker's reload bracket).

        Args:
            whole: every layer must complete (a full receive); else only the layers
                written to (a delta's rewritten layers; the others keep their
                kernel tensors).

        Raises:
            TransportError: on leaving without an error, some layer did not get every
                element it holds (``finalize_layerwise_reload`` puts it back as it was).
        """
        self._receive = _Receive()
        try:
            yield
            receive = self._receive
            missing = sorted(
                path
                for path, n in self.expected.items()
                if n and path not in receive.done and (whole or path in receive.written)
            )
            if missing:
                raise TransportError(
                    f"{len(missing)} vLLM layer(s) did not receive every element they "
                    f"hold, first {missing[0]} ({receive.written.get(missing[0], 0)} of "
                    f"{self.expected[missing[0]]}); they keep their old weights"
                )
        finally:
            self._receive = None

    def load_weight_boxes(
        self, boxes: Iterable[tuple[str, Sequence[tuple[int, int]], torch.Tensor]]
    ) -> int:
        """Write received boxes of HF tensors into the layers; returns the elements written.

        Each ``(hf_name, box, tensor)`` is the region ``box`` (``(start, stop)`` per
        dimension of the FULL HF tensor) with ``tensor`` of the box's shape and the
        checkpoint dtype. It must lie inside the part this worker holds
        (:meth:`weight_layout`); it is copied into that region of the layer's
        checkpoint-format parameter, and a layer whose every element arrived is
        processed into vLLM's kernel format (see the module docs). Call inside
        :meth:`receiving`; each element once per receive.

        Raises:
            RefitMismatchError: an unknown name, another dtype, a box outside the
                held part (or the full tensor), a tensor of another shape, or a
                layer that already got every element. Raised before anything of
                that box is written.
            TransportError: called outside :meth:`receiving` or outside vLLM's
                layerwise reload.
        """
        receive = self._receive
        if receive is None:
            raise TransportError("load_weight_boxes runs inside receiving() (a reload bracket)")
        written = 0
        with torch.no_grad():
            for name, raw_box, tensor in boxes:
                entry = self.held.get(name)
                if entry is None:
                    raise RefitMismatchError(f"{name!r} is not held by this vLLM worker")
                box = tuple((int(lo), int(hi)) for lo, hi in raw_box)
                index = self._index(entry, box, tensor)
                for path in entry.layers:
                    if path in receive.done:
                        raise RefitMismatchError(
                            f"{name}: box {box} arrived after {path} got every element"
                        )
                for path in entry.layers:
                    target = self._target(path, entry.param)
                    entry.region(target)[index].copy_(tensor)
                    count = receive.written.get(path, 0) + tensor.numel()
                    receive.written[path] = count
                    if count >= self.expected[path]:
                        self._process(path)
                        receive.done.add(path)
                if self.tee is not None:
                    self.tee(name, box, tensor)
                written += tensor.numel()
        return written

    def _index(
        self, entry: HeldTensor, box: tuple[tuple[int, int], ...], tensor: torch.Tensor
    ) -> tuple[slice, ...]:
        name, part = entry.name, entry.part
        if tensor.dtype != entry.dtype:
            raise RefitMismatchError(f"{name}: the engine holds {entry.dtype}, got {tensor.dtype}")
        shape = tuple(hi - lo for lo, hi in box)
        if tuple(tensor.shape) != shape:
            raise RefitMismatchError(
                f"{name}: box {box} has shape {shape}, got {tuple(tensor.shape)}"
            )
        try:
            return box_within(box, part)
        except ValueError as exc:
            raise RefitMismatchError(
                f"{name}: box {box} is not inside the part this vLLM worker holds, "
                f"{box_of(part)} of {part.shape}"
            ) from exc

    def _target(self, path: str, param: str) -> torch.Tensor:
        """The layer's checkpoint-format ``param``, materialized on its first box."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import materialize_layer
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        layer = self._modules[path]
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            raise TransportError(
                f"{path}: not in vLLM's layerwise reload; boxes are written inside the "
                "worker's reload bracket"
            )
        tensors = get_layer_tensors(layer)
        fresh = [n for n, t in tensors.items() if t.is_meta]
        if fresh:
            materialize_layer(layer, info)
            tensors = get_layer_tensors(layer)
            for n in fresh:
                tensors[n].zero_()  # vLLM's loaders zero the vocabulary padding too
        return tensors[param]

    def _process(self, path: str) -> None:
        """vLLM's own end of a layer's reload: ``process_weights_after_loading``, then
        the copy into the kernel tensors (``_layerwise_process``, with no buffered
        loader calls to replay: the boxes are already in place)."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            LAYERWISE_INFO,
            _layerwise_process,
        )

        layer = self._modules[path]
        _layerwise_process(layer, LAYERWISE_INFO[layer])
