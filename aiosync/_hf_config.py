"""Model-config drift that keeps the shapes: compare the fields that change the computation.

The manifest check catches names, shapes and dtypes; an engine built with another
``rope_theta`` or ``rms_norm_eps`` loads the trainer's tensors and generates other
tokens. Where both sides know their HF config, a transport compares them at init
with :func:`compare_hf_configs`. Every field is compared except those in
:data:`MAY_DIFFER` (bookkeeping, training-only and token-id fields), so a new
computation field of a future model is checked by default. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .errors import RefitMismatchError

__all__ = ["MAY_DIFFER", "compare_hf_configs", "config_fields"]

#: Fields that may differ between the trainer's and the engine's config: they do
#: not change what the forward pass computes from the same weights (the dtype is
#: the manifest's check; token ids, label maps and output switches are I/O).
MAY_DIFFER: frozenset[str] = frozenset(
    {
        "_name_or_path",
        "_attn_implementation",
        "_commit_hash",
        "architectures",
        "attention_dropout",
        "bos_token_id",
        "chunk_size_feed_forward",
        "dtype",
        "eos_token_id",
        "id2label",
        "initializer_range",
        "is_encoder_decoder",
        "label2id",
        "max_position_embeddings",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "pad_token_id",
        "problem_type",
        "quantization_config",
        "return_dict",
        "router_aux_loss_coef",
        "tokenizer_class",
        "torch_dtype",
        "transformers_version",
        "use_cache",
    }
)


def config_fields(config: Any) -> dict[str, Any]:
    """A config (a transformers ``PretrainedConfig`` or its ``to_dict()``/``config.json``
    dict) as flat comparable fields: the text config of a multimodal one, RoPE
    settings as ``rope_parameters.<key>`` whether the config spells them as
    transformers 5 does (``rope_parameters``) or older ones did (``rope_theta``,
    ``rope_scaling`` with ``type``).

    Raises:
        TypeError: neither a mapping nor an object with ``to_dict()``.
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if not isinstance(config, Mapping):
        to_dict = getattr(config, "to_dict", None)
        if not callable(to_dict):
            raise TypeError(f"an HF config or its dict is needed, got {type(config).__name__}")
        config = to_dict()
    if isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    fields = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
    rope: dict[str, Any] = {}
    if "rope_theta" in fields:
        rope["rope_theta"] = fields.pop("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        section = config.get(key)
        if isinstance(section, Mapping):
            for name, value in section.items():
                rope["rope_type" if name == "type" else name] = value
    rope.setdefault("rope_type", "default")
    fields.update({f"rope_parameters.{name}": value for name, value in rope.items()})
    return fields


def compare_hf_configs(
    trainer: Any, engine: Any, *, may_differ: Iterable[str] = (), where: str = "the engine"
) -> None:
    """Raise if the two configs differ in a field that changes the computation.

    Fields present on one side only are not compared (a config written by another
    transformers version carries other defaults); ``rope_theta`` and the other RoPE
    fields always are. Floats compare exactly: a drifted ``rms_norm_eps`` is drift.

    Args:
        trainer, engine: HF configs or their dicts (see :func:`config_fields`).
        may_differ: more field names to skip, beside :data:`MAY_DIFFER`.
        where: names the engine side in the message.

    Raises:
        RefitMismatchError: naming every differing field with both values.
    """
    skip = MAY_DIFFER | frozenset(may_differ)
    ours, theirs = config_fields(trainer), config_fields(engine)
    differing = [
        (name, ours[name], theirs[name])
        for name in sorted(ours.keys() & theirs.keys())
        if name not in skip and ours[name] != theirs[name]
    ]
    if differing:
        listed = "; ".join(f"{name}: trainer {a!r}, engine {b!r}" for name, a, b in differing)
        raise RefitMismatchError(
            f"the model config of {where} differs from the trainer's in {len(differing)} "
            f"field(s) that change what the same weights compute: {listed}. Build the engine "
            "from the trainer's config (aiosync._hf_config.MAY_DIFFER lists what may differ)"
        )
