"""The layout of an adapter-only refit: PEFT's saved names, and the base weights they adapt.

PEFT saves a LoRA adapter (``adapter_model.safetensors``, what
``get_peft_model_state_dict`` returns) as two tensors per adapted linear layer,
named after the layer's path in the base model behind PEFT's wrapper prefix
``base_model.model.``:

* ``base_model.model.<module>.lora_A.weight`` ``[r, in_features]``
* ``base_model.model.<module>.lora_B.weight`` ``[out_features, r]``

where ``<module>.weight`` is the base layer's weight ``[out_features, in_features]``
in the HF checkpoint (``save_pretrained``'s names, what an engine's
``expected_manifest()`` gives). vLLM and SGLang read the same layout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiosync.errors import RefitMismatchError

__all__ = [
    "AdaptedModule",
    "adapted_modules",
    "check_adapter_config",
    "check_against_base",
    "check_lora_kind",
]

_PEFT_PREFIX = "base_model.model."
_LORA_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")


@dataclass(frozen=True, slots=True)
class AdaptedModule:
    """One linear layer the adapter adapts.

    Attributes:
        module: its path in the base model (``model.layers.0.self_attn.q_proj``).
        rank: the adapter's rank ``r`` there.
        in_features: columns of the base weight (``lora_A``'s second dimension).
        out_features: rows of the base weight (``lora_B``'s first dimension).
    """

    module: str
    rank: int
    in_features: int
    out_features: int

    @property
    def base_weight(self) -> str:
        """The base weight's checkpoint name, ``<module>.weight``."""
        return f"{self.module}.weight"

    @property
    def target(self) -> str:
        """The layer's own name, the last part of :attr:`module` (``q_proj``)."""
        return self.module.rsplit(".", 1)[-1]


def adapted_modules(
    manifest: Mapping[str, tuple[Sequence[int], Any]],
) -> dict[str, AdaptedModule]:
    """The layers a LoRA adapter's manifest adapts, ``{module: AdaptedModule}`` in manifest order.

    Raises:
        RefitMismatchError: an empty manifest, a name that is not a LoRA tensor in
            PEFT's saved layout (``modules_to_save`` copies, DoRA magnitudes, LoRA
            on embeddings, a name without the ``base_model.model.`` prefix), a
            layer with only one of ``lora_A``/``lora_B``, a tensor that is not
            2-D, or ``lora_A``/``lora_B`` whose ranks differ.
    """
    if not manifest:
        raise RefitMismatchError("the LoRA adapter's manifest is empty")
    halves: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, (shape, _dtype) in manifest.items():
        match = _LORA_NAME.fullmatch(name)
        if match is None:
            hint = (
                f" (PEFT's saved names start with {_PEFT_PREFIX!r})"
                if not name.startswith(_PEFT_PREFIX)
                else ""
            )
            raise RefitMismatchError(
                f"{name!r} is not a LoRA tensor in PEFT's saved layout "
                f"('base_model.model.<module>.lora_A.weight' / '.lora_B.weight'){hint}: "
                "adapter-only refits carry the lora_A/lora_B of linear layers only"
            )
        dims = tuple(int(d) for d in shape)
        if len(dims) != 2:
            raise RefitMismatchError(f"{name}: a LoRA weight is 2-D, got shape {dims}")
        halves.setdefault(match["module"], {})[match["half"]] = dims
    modules: dict[str, AdaptedModule] = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            (present,) = pair
            missing = "B" if present == "A" else "A"
            raise RefitMismatchError(
                f"{_PEFT_PREFIX}{module}: has lora_{present} but no lora_{missing}.weight"
            )
        (rank, in_features), (out_features, rank_b) = pair["A"], pair["B"]
        if rank != rank_b:
            raise RefitMismatchError(
                f"{_PEFT_PREFIX}{module}: lora_A [r, in] {pair['A']} and lora_B [out, r] "
                f"{pair['B']} have different ranks"
            )
        modules[module] = AdaptedModule(module, rank, in_features, out_features)
    return modules


def check_lora_kind(config: Mapping[str, Any], where: str, *, peft_type: str = "") -> None:
    """What an adapter refit carries: a plain LoRA adapter (``peft_type`` ``"LORA"``;
    ``peft_type=`` is taken where the config has none), no DoRA magnitudes, no
    ``modules_to_save`` copies.

    Raises:
        RefitMismatchError: any of those, ``where`` (the config's origin) named.
    """
    if str(config.get("peft_type", peft_type)).rsplit(".", 1)[-1] != "LORA":
        raise RefitMismatchError(
            f"{where} has peft_type={config.get('peft_type')!r}: not a LoRA adapter"
        )
    if config.get("use_dora"):
        raise RefitMismatchError(f"{where}: DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        raise RefitMismatchError(
            f"{where}: modules_to_save={config['modules_to_save']!r}: adapter-only refits "
            "carry LoRA tensors only; merge those modules into the base model or refit the "
            "full model"
        )


def check_adapter_config(config: Mapping[str, Any], modules: Mapping[str, AdaptedModule]) -> None:
    """Check the ``adapter_config.json`` dict against the tensors.

    Raises:
        RefitMismatchError: ``peft_type`` is not ``"LORA"``, ``use_dora``,
            ``modules_to_save`` set, ``r`` missing, or (without ``rank_pattern``)
            a tensor rank that differs from ``r``.
    """
    check_lora_kind(config, "lora_adapter_config()")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise RefitMismatchError(f"lora_adapter_config() needs an int rank 'r' >= 1, got {r!r}")
    if not config.get("rank_pattern"):
        odd = [m for m in modules.values() if m.rank != r]
        if odd:
            raise RefitMismatchError(
                f"{_PEFT_PREFIX}{odd[0].module}: rank {odd[0].rank}, but the config's r is {r} "
                "(and it has no rank_pattern)"
            )


def check_against_base(
    modules: Mapping[str, AdaptedModule],
    base: Mapping[str, tuple[Sequence[int], Any]],
    where: str = "the engine's model",
) -> None:
    """Check that every adapted layer exists in the base checkpoint with matching shapes.

    Args:
        modules: from :func:`adapted_modules`.
        base: the engine's ``{hf_name: (shape, dtype)}`` (its ``expected_manifest()``).
        where: names the engine in messages.

    Raises:
        RefitMismatchError: a layer whose ``<module>.weight`` is not in ``base``
            (names the closest names there), is not 2-D, or whose ``[out, in]``
            differs from ``lora_B``'s ``out`` / ``lora_A``'s ``in``.
    """
    for module in modules.values():
        entry = base.get(module.base_weight)
        if entry is None:
            suffix = f".{module.target}.weight"
            near = [name for name in base if name.endswith(suffix)][:3]
            raise RefitMismatchError(
                f"the adapter targets {module.module!r}, but {where} has no "
                f"{module.base_weight!r}" + (f" (it has e.g. {near})" if near else "")
            )
        shape = tuple(int(d) for d in entry[0])
        if len(shape) != 2 or shape != (module.out_features, module.in_features):
            raise RefitMismatchError(
                f"{module.base_weight}: {where} has shape {shape}, the adapter's lora_A "
                f"[r, in] / lora_B [out, r] imply [{module.out_features}, {module.in_features}]"
            )
