"""``/get_weights_by_name`` and ``/weights_checker``: the weights as SGLang's fused,
vocabulary-padded layout shows them, and its checksums."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from aiosync.engines.embedded.model import HFModelRunner
from aiosync.engines.sglang.contract_server._base import _Routes
from aiosync.engines.sglang.contract_server._state import ServerState
from aiosync.engines.sglang.contract_server._wire import _error, _HTTPError, _is_int


class _CheckerRoutes(_Routes):
    """SGLang's weight read-back and checker routes."""

    def _get_weights_by_name(self, data: Any) -> Any:
        """SGLang's ``GetWeightsByNameReqInput``: ``name`` (str), ``truncate_size``
        (default 100). GET or POST, as SGLang's route.

        Answers 200 with TP rank 0's tensor as SGLang 0.5.23's
        ``LlamaForCausalLM.get_weights_by_name`` gives it (:func:`_sglang_weight`):
        ``.to(torch.float32).tolist()[:truncate_size]`` (the first ``truncate_size``
        entries of the first dimension; NaN and infinities ``null``, as ``orjson``
        writes them); 400 ``{"error": {"message": "Get parameter by name failed"}}``
        where SGLang's method returns None (no such parameter, a 0-d tensor); 422 for
        a malformed body.
        """
        state = self.server.state
        body = data if isinstance(data, dict) else {}
        name, truncate_size = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str) or not _is_int(truncate_size):
            raise _HTTPError(
                422, {"detail": "name (str) is required; truncate_size must be an int"}
            )
        with state.model_lock:
            rows = _sglang_weight(state.ranks, name, truncate_size)
        if rows is None:
            raise _error("Get parameter by name failed")
        return rows

    def _weights_checker(self, data: Any) -> Any:
        """SGLang 0.5.23's ``CheckWeightsReqInput`` (GET or POST, body optional):
        ``action`` (default ``"checksum"``; ``"snapshot"``, ``"reset_tensors"``,
        ``"compare"``), ``allow_quant_error`` (bool), ``skip_tensor_list`` (substrings of
        names left out), ``selector`` (``"target"``, ``"draft"``, ``"all"``: the draft's
        checksums are keyed ``"draft." + name``, its own names, as SGLang's
        ``_merge_checksum_payloads``; no draft: ``"draft"`` checks nothing). SGLang's
        ``WeightChecker`` over each TP rank's ``named_parameters()`` and ``named_buffers()``
        (this server's: the HF names; SGLang's: its own, the fused
        ``qkv_proj``/``gate_up_proj``), the rotary caches skipped.

        * ``snapshot``: each rank copies its tensors (SGLang: into host memory);
        * ``compare``: each rank compares its tensors with its snapshot, bit for bit,
          then drops the snapshot; a rank without one fails (an ``assert``: message
          ``""``). Only TP rank 0 answers an SGLang scheduler request, so only its
          outcome comes back;
        * ``reset_tensors``: each rank overwrites its tensors with random values;
        * ``checksum``: each rank hashes each tensor (``tensor_hash``: on CPU the first
          8 bytes of its bytes' SHA-256, big-endian, as 16 hex digits; on GPU a Triton
          hash), all ranks gathered.

        Answers 200 ``{"success": true, "message": "Success."}`` plus, for
        ``checksum``, ``"ranks"`` (one ``ChecksumInfo`` per TP rank: ``checksums``
        ``{name: hex}``, ``per_gpu_checksum``, ``parallelism_info``) and
        ``"per_engine_checksum"``; 400 ``{"success": false, "message": ...}`` on
        failure (a compare's names each differing tensor: ``"check tensor equality
        failed:\\nname=N max_abs_err=... "``); 422 for a malformed body.
        """
        state = self.server.state
        body = {} if data is None else data
        action = body.get("action", "checksum") if isinstance(body, dict) else None
        skip = body.get("skip_tensor_list") if isinstance(body, dict) else None
        if not (
            isinstance(body, dict)
            and isinstance(action, str)
            and isinstance(body.get("allow_quant_error", False), bool)
            and (skip is None or (isinstance(skip, list) and all(isinstance(x, str) for x in skip)))
            and body.get("selector", "all") in ("target", "draft", "all")
        ):
            raise _HTTPError(
                422,
                {
                    "detail": "action (str), allow_quant_error (bool), skip_tensor_list "
                    "(list of str), selector ('target', 'draft' or 'all')"
                },
            )
        selector = body.get("selector", "all")
        roles = [
            (role, runners)
            for role, runners in (("target", state.ranks), ("draft", state.draft_ranks))
            if selector in (role, "all") and runners
        ]
        if not roles:
            # No draft runner: SGLang's check_weights merges nothing and succeeds.
            return {"success": True, "message": "Success."}
        with state.model_lock:
            try:
                ranks = [
                    _merge_checksums(
                        [
                            (
                                role,
                                _check_weights(
                                    state, rank, runners[rank], action, skip or [], role
                                ),
                            )
                            for role, runners in roles
                        ]
                    )
                    for rank in range(state.tp_size)
                ]
            except _CheckFailed as exc:
                raise _HTTPError(400, {"success": False, "message": str(exc)}) from exc
        answer: dict[str, Any] = {"success": True, "message": "Success."}
        if action == "checksum":
            answer["ranks"] = ranks
            engine = hashlib.sha256()
            for info in ranks:
                engine.update(str((info or {}).get("per_gpu_checksum")).encode())
            answer["per_engine_checksum"] = engine.hexdigest()
        return answer


# SGLang's LlamaForCausalLM.stacked_params_mapping: (checkpoint name part, shard id),
# cut out of its fused qkv_proj / gate_up_proj.
_STACKED = (
    (".q_proj", "q"),
    (".k_proj", "k"),
    (".v_proj", "v"),
    (".gate_proj", 0),
    (".up_proj", 1),
)
# The dense layers LlamaForCausalLM fuses: its params_dict has no other stacked name.
_FUSED_NAME = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)$"
)
#: SGLang's vocabulary padding (``DEFAULT_VOCAB_PADDING_SIZE``) of the embedding and head.
_VOCAB_PADDING = 64


def _sglang_weight(ranks: Sequence[HFModelRunner], name: str, truncate_size: int) -> Any:
    """What SGLang 0.5.23's ``/get_weights_by_name`` answers for ``name``; None where its
    model's method returns None (a name it has no parameter for, a 0-d tensor).

    ``LlamaForCausalLM.get_weights_by_name`` (``python/sglang/srt/models/llama.py``), on
    the TP rank 0 of ``len(ranks)`` ranks, applied to whichever model this server
    serves (SGLang's ``Qwen3ForCausalLM`` has no such method: a real Qwen3 server
    answers 400 for every name):

    * ``q_proj``/``k_proj``/``v_proj``: rank 0's fused ``qkv_proj`` (its rows of q, k
      and v, laid out with the attention's ``head_dim``), narrowed at offsets computed
      with ``hidden_size // num_attention_heads`` as the head size, as SGLang does (for
      a model whose ``head_dim`` differs, k and v come back as other rows);
    * ``gate_proj``/``up_proj``: rank 0's ``gate_up_proj`` halves,
      ``intermediate_size // tp`` rows each;
    * ``o_proj``/``down_proj``: every rank's columns gathered (whole);
    * ``embed_tokens``/``lm_head``: rank 0's vocabulary shard, padded with zero rows to
      a multiple of 64 (a tied ``lm_head`` is the embedding);
    * anything else: the tensor as rank 0 holds it (the whole tensor).

    Then ``.to(torch.float32).tolist()[:truncate_size]``, non-finite values ``None``.
    """
    try:
        weight = _rank0_view(ranks, name)
        rows = weight[:truncate_size].to(torch.float32)
    except (AttributeError, KeyError, IndexError, RuntimeError, TypeError, ValueError):
        return None
    if bool(torch.isfinite(rows).all()):
        return rows.tolist()
    values = rows.numpy().astype(object)
    values[~np.isfinite(rows.numpy())] = None
    return values.tolist()


def _rank0_view(ranks: Sequence[HFModelRunner], name: str) -> torch.Tensor:
    """:func:`_sglang_weight`'s tensor before the truncation (raises where SGLang's does)."""
    tp = len(ranks)
    config = ranks[0].model.config
    for shard, shard_id in _STACKED:
        if shard not in name:
            continue
        if not _FUSED_NAME.match(name):
            raise KeyError(name)  # no such entry in LlamaForCausalLM's params_dict
        if shard_id in ("q", "k", "v"):
            heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            # Rank 0's shard of the fused layer: its heads of q, k and v (a kv head
            # replicated when there are fewer kv heads than ranks).
            q, k, v = (_hf_tensor(ranks[0], name.replace(shard, p)) for p in _QKV_PARTS)
            local_kv = max(1, kv_heads // tp) * head_dim
            fused = torch.cat([q[: heads // tp * head_dim], k[:local_kv], v[:local_kv]])
            size_of = config.hidden_size // heads  # SGLang's get_weights_by_name
            offset, size = {
                "q": (0, heads // tp * size_of),
                "k": (heads // tp * size_of, kv_heads // tp * size_of),
                "v": ((heads // tp + kv_heads // tp) * size_of, kv_heads // tp * size_of),
            }[str(shard_id)]
            return fused.narrow(0, offset, size)
        half = config.intermediate_size // tp
        gate = _hf_tensor(ranks[0], name.replace(shard, ".gate_proj"))
        up = _hf_tensor(ranks[0], name.replace(shard, ".up_proj"))
        return torch.cat([gate[:half], up[:half]]).narrow(0, 0 if shard_id == 0 else half, half)
    weight = _hf_tensor(ranks[0], name)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        vocab = weight.shape[0]
        per_rank = -(-vocab // _VOCAB_PADDING) * _VOCAB_PADDING // tp
        if per_rank > vocab:
            weight = torch.cat([weight, weight.new_zeros((per_rank - vocab, *weight.shape[1:]))])
        return weight[:per_rank]
    if tp > 1 and ("o_proj" in name or "down_proj" in name):
        # Row-parallel: rank r holds columns r; SGLang all-gathers them (dim 1; a 1-D
        # bias fails there, as in SGLang).
        columns = weight.shape[1] // tp
        parts = [_hf_tensor(ranks[r], name).narrow(1, r * columns, columns) for r in range(tp)]
        return torch.cat(parts, dim=1)
    return weight


_QKV_PARTS = (".q_proj", ".k_proj", ".v_proj")


def _hf_tensor(runner: HFModelRunner, name: str) -> torch.Tensor:
    """Checkpoint tensor ``name`` of ``runner``'s model (KeyError: it has none)."""
    try:
        return runner.model.get_parameter(name).detach()
    except AttributeError:
        # Not a module path of the model (PEFT-wrapped layers, FP8 scales): the
        # checkpoint view, a copy of every tensor (rare).
        return runner.hf_state_dict()[name]


class _CheckFailed(Exception):
    """A ``/weights_checker`` action failed on a rank (SGLang's message)."""


#: SGLang 0.5.23's ``_NON_PERSISTENT_BUFFER_PATTERNS`` (``utils/weight_checker.py``):
#: never reset, compared or hashed.
_UNCHECKED = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")


def _check_weights(
    state: ServerState,
    rank: int,
    runner: HFModelRunner,
    action: str,
    skip: Sequence[str],
    role: str = "target",
) -> dict[str, Any] | None:
    """One TP rank's ``WeightChecker.handle`` (SGLang 0.5.23) on its ``role``'s runner
    (``"target"``, ``"draft"``): returns its ``ChecksumInfo`` for ``checksum``, else
    None; raises :class:`_CheckFailed`."""
    key: int | tuple[str, int] = rank if role == "target" else (role, rank)
    model = runner.model
    tensors = {
        name: t.data
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if not any(p in name for p in (*_UNCHECKED, *skip))
    }
    if action == "snapshot":
        state.weight_snapshots[key] = {name: t.detach().clone() for name, t in tensors.items()}
        return None
    if action == "reset_tensors":
        with torch.no_grad():
            for t in tensors.values():
                t.copy_(torch.rand(t.shape, dtype=torch.float32).to(t.dtype))
        return None
    if action == "compare":
        snapshot = state.weight_snapshots.get(key)
        if snapshot is None:
            raise _CheckFailed("")  # SGLang's bare ``assert self._snapshot_tensors is not None``
        errors = []
        for name, actual in tensors.items():
            expect = snapshot[name]
            if torch.equal(expect.view(torch.uint8), actual.view(torch.uint8)):
                continue
            diff = (expect.float() - actual.float()).abs()
            errors.append(
                f"name={name} max_abs_err={float(diff.max())} mean_abs_err={float(diff.mean())} "
                f"num_exceed={int((diff > 0).sum())} expect={_raw(expect)} actual={_raw(actual)} "
            )
        del state.weight_snapshots[key]
        # Only TP rank 0 answers SGLang's scheduler requests: another rank's outcome is lost.
        if errors and rank == 0:
            raise _CheckFailed("check tensor equality failed:\n" + "\n".join(errors))
        return None
    if action == "checksum":
        checksums = {name: _tensor_hash(t) for name, t in tensors.items()}
        placement = {"tp_rank": rank, "tp_size": state.tp_size, "dp_rank": 0, "dp_size": 1}
        return {
            "checksums": checksums,
            "per_gpu_checksum": _overall_checksum(checksums),
            "parallelism_info": [
                {"role": role, **placement, "pp_rank": 0, "pp_size": 1}
                | {"rank": rank, "size": state.tp_size}
            ],
        }
    raise _CheckFailed(f"Unsupported action={action!r}")


def _overall_checksum(checksums: Mapping[str, str]) -> str:
    overall = hashlib.sha256()
    for name in sorted(checksums):
        overall.update(name.encode())
        overall.update(checksums[name].encode())
    return overall.hexdigest()


def _merge_checksums(
    payloads: Sequence[tuple[str, dict[str, Any] | None]],
) -> dict[str, Any] | None:
    """One TP rank's ``ChecksumInfo`` over its runners (SGLang 0.5.23's
    ``_merge_checksum_payloads``): a draft's names prefixed by its role, the target's
    as they are; None when no runner answered one (an action other than ``checksum``)."""
    answered = [(role, p) for role, p in payloads if p is not None]
    if not answered:
        return None
    if len(answered) == 1 and answered[0][0] == "target":
        return answered[0][1]
    merged: dict[str, str] = {}
    infos: list[Any] = []
    for role, payload in answered:
        for name, checksum in payload["checksums"].items():
            merged[name if role == "target" else f"{role}.{name}"] = checksum
        infos.extend(payload["parallelism_info"])
    return {
        "checksums": merged,
        "per_gpu_checksum": _overall_checksum(merged),
        "parallelism_info": infos,
    }


def _tensor_hash(tensor: torch.Tensor) -> str:
    """SGLang's ``f"{tensor_hash(t):016x}"`` on a CPU tensor (``mm_utils.tensor_hash``)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{int.from_bytes(hashlib.sha256(raw).digest()[:8], 'big'):016x}"


def _raw(tensor: torch.Tensor) -> str:
    """SGLang's ``repr(RawComparable)``."""
    return f"raw(shape={tuple(tensor.shape)} dtype={tensor.dtype})"
