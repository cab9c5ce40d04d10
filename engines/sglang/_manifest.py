"""The SGLang server's refit manifest, derived from its model's HF config on the ``meta`` device.

SGLang's ``load_weights`` takes the model's HF checkpoint names (what
``save_pretrained`` writes: q/k/v and gate/up separate, tied heads absent,
MoE experts per expert) and fuses them itself. So the server expects exactly
the manifest of the HF model its config describes, in the dtype it runs in.
Building that model on ``meta`` allocates nothing and takes well under a
second even for large models, so the check can run at ``init_communicator()``,
before any byte moves.

Which config and dtype: what the server reports in ``/get_server_info``
(``model_path``, ``revision``, ``json_model_override_args``, ``dtype``),
resolved the way SGLang resolves them (``ModelConfig``: ``dtype="auto"`` takes
the config's dtype, except float32, which runs as float16, or bfloat16 for the
Gemma family). ``model_path`` may be a local folder, a ``config.json`` or a Hub
id already in the local HF cache; nothing is downloaded and no remote code runs.
The same config, cached, is what ``SGLangHTTPBackend.expected_config`` reports
for the model-config check (``aiosync._hf_config``).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = [
    "ServerManifests",
    "UnknownManifest",
    "checkpoint_manifest",
    "engine_dtype",
    "load_hf_config",
]

#: ``{hf_name: (shape, dtype)}`` in checkpoint order.
Manifest = dict[str, tuple[tuple[int, ...], "torch.dtype"]]

#: SGLang's dtype names (``server_args.dtype``) and the torch dtype each means.
_DTYPE_NAMES = {
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
# transformers builds a model under a process-wide default dtype (set, then restored):
# two builds at once (the servers of a fleet, each checked from a worker thread) would
# restore each other's and give parameters the wrong dtype. One build at a time.
_BUILD_LOCK = threading.Lock()
# transformers' lazy module is not safe to resolve from two threads at once (the servers of
# a fleet are checked side by side, each from a worker thread; seen in a fresh process:
# "ImportError: cannot import name 'AutoConfig' from 'transformers'"): resolved under a lock.
_IMPORT_LOCK = threading.Lock()
# Keys a saved config.json carries that are not constructor arguments of the config.
_NOT_CONFIG_ARGS = ("model_type", "transformers_version", "architectures")


class UnknownManifest(Exception):
    """The server's manifest cannot be derived here (no config, unknown model or dtype)."""


def _transformers(*names: str) -> tuple[Any, ...]:
    """``transformers.<name>`` for each of ``names``, resolved under :data:`_IMPORT_LOCK`."""
    with _IMPORT_LOCK:
        import transformers

        return tuple(getattr(transformers, name) for name in names)


def load_hf_config(
    source: PretrainedConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    revision: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> PretrainedConfig:
    """The model's HF config from what SGLang was started with.

    Args:
        source: a ``PretrainedConfig``; a config dict (with ``model_type``); a
            path to a ``config.json`` or a model folder; or a Hub id that is in
            the local HF cache (never downloaded).
        revision: the Hub revision (SGLang's ``--revision``).
        overrides: config fields to replace (SGLang's ``--json-model-override-args``).

    Raises:
        UnknownManifest: no such file, folder or cached Hub id, or no ``model_type``.
    """
    AutoConfig, PretrainedConfig = _transformers("AutoConfig", "PretrainedConfig")

    if isinstance(source, PretrainedConfig):
        config = copy.deepcopy(source)  # the overrides must not change the caller's
    elif isinstance(source, Mapping):
        config = _config_from_dict(source)
    else:
        path = Path(source)
        try:
            if path.is_file():
                config = _config_from_dict(json.loads(path.read_text()))
            else:
                # A folder, or a Hub id: only what is already on this machine.
                config = AutoConfig.from_pretrained(
                    str(source), revision=revision, local_files_only=True, trust_remote_code=False
                )
        except UnknownManifest:
            raise
        except OSError as exc:
            raise UnknownManifest(
                f"{str(source)!r} is no config.json or model folder here, and no Hub id in the "
                "local HF cache (nothing is downloaded)"
            ) from exc
        except Exception as exc:  # ValueError (remote code, unknown architecture), ...
            raise UnknownManifest(
                f"cannot load the model config from {str(source)!r}: {type(exc).__name__}: {exc}"
            ) from exc
    if overrides:
        config.update(dict(overrides))
    return config


def _config_from_dict(items: Mapping[str, Any]) -> PretrainedConfig:
    (AutoConfig,) = _transformers("AutoConfig")

    model_type = items.get("model_type")
    if not model_type:
        raise UnknownManifest("the model config has no 'model_type'")
    kwargs = {k: v for k, v in items.items() if k not in _NOT_CONFIG_ARGS}
    try:
        return AutoConfig.for_model(str(model_type), **kwargs)
    except (ValueError, KeyError, TypeError) as exc:
        raise UnknownManifest(
            f"transformers does not know model_type {model_type!r}: {exc}"
        ) from exc


def engine_dtype(config: PretrainedConfig, dtype: str | None) -> torch.dtype:
    """The dtype an SGLang server started with ``--dtype dtype`` runs ``config``'s model in.

    Args:
        config: the model's HF config.
        dtype: SGLang's ``dtype`` server argument (``"auto"``, ``"bfloat16"``,
            ``"half"``, ...); None is ``"auto"``, SGLang's default.

    Raises:
        UnknownManifest: a dtype name SGLang does not accept.
    """
    import torch

    name = (dtype or "auto").lower()
    if name != "auto":
        if name not in _DTYPE_NAMES:
            raise UnknownManifest(f"the server reports an unknown dtype {dtype!r}")
        resolved: torch.dtype = getattr(torch, _DTYPE_NAMES[name])
        return resolved
    text = getattr(config, "get_text_config", lambda: config)()
    declared = getattr(text, "dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, _DTYPE_NAMES.get(declared, declared), None)
    if not isinstance(declared, torch.dtype):
        declared = torch.float32
    if declared != torch.float32:
        return declared
    # SGLang runs float32 checkpoints in half precision unless told otherwise.
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    return torch.bfloat16 if model_type.startswith("gemma") else torch.float16


def checkpoint_manifest(
    config: PretrainedConfig, dtype: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{hf_name: (shape, dtype)}`` of ``config``'s checkpoint, built on ``meta`` (no memory).

    The names, shapes and order are what ``save_pretrained`` writes (tied
    weights removed, MoE experts per expert), as the embedded engine derives
    them. Thread-safe: builds run one at a time (transformers sets the
    process-wide default dtype while it builds).

    Raises:
        UnknownManifest: quantized models (their checkpoint layout is the
            quantizer's), or a config transformers cannot build as a causal LM.
    """
    import torch

    (AutoModelForCausalLM,) = _transformers("AutoModelForCausalLM")

    from ..embedded.model import HFModelRunner

    if getattr(config, "quantization_config", None):
        raise UnknownManifest("the model is quantized; its checkpoint layout is not derivable")
    try:
        with _BUILD_LOCK, torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return HFModelRunner(model).expected_manifest()
    except Exception as exc:  # any model transformers cannot build here
        raise UnknownManifest(
            f"cannot build {type(config).__name__} as a causal LM: {type(exc).__name__}: {exc}"
        ) from exc


class ServerManifests:
    """One server's HF config and manifest, derived from ``/get_server_info`` and cached
    per configuration.

    Args:
        hf_config: the served model's HF config as given to the backend (a
            ``PretrainedConfig``, a dict, a path or a cached Hub id); None: the
            server's ``model_path``.
        base_url: the server, for the warning.
    """

    def __init__(
        self,
        hf_config: PretrainedConfig | Mapping[str, Any] | str | os.PathLike[str] | None,
        base_url: str,
    ) -> None:
        self.hf_config = hf_config
        self._base_url = base_url
        # (configuration key, config); the manifest's key adds the dtype.
        self._config: tuple[Any, PretrainedConfig] | None = None
        self._cache: tuple[Any, Manifest] | None = None
        self._warned = False

    def _key(self, info: Mapping[str, Any]) -> tuple[Any, Any, Any, str]:
        """``(source, revision, overrides, key)``: what the config is loaded from, and
        a key that changes whenever the loaded config would."""
        source = self.hf_config if self.hf_config is not None else info.get("model_path")
        revision = info.get("revision")
        overrides = _overrides(info.get("json_model_override_args"))
        key = json.dumps(
            [
                id(source) if not isinstance(source, str | os.PathLike) else os.fspath(source),
                revision,
                overrides,
            ],
            sort_keys=True,
            default=str,
        )
        return source, revision, overrides, key

    async def _load(self, info: Mapping[str, Any]) -> PretrainedConfig:
        """The served model's config (worker thread: it imports transformers), cached.

        Raises:
            UnknownManifest: no ``model_path``, unreadable overrides, or a config
                that cannot be loaded here.
        """
        source, revision, overrides, key = self._key(info)
        if self._config is not None and self._config[0] == key:
            return self._config[1]
        if source is None:
            raise UnknownManifest("the server reports no model_path")
        if isinstance(overrides, str):
            raise UnknownManifest(f"unreadable json_model_override_args: {overrides}")
        config = await anyio.to_thread.run_sync(
            functools.partial(
                load_hf_config,
                source,
                revision=None if revision is None else str(revision),
                overrides=overrides,
            )
        )
        self._config = (key, config)
        return config

    def _unknown(self, exc: UnknownManifest, what: str) -> None:
        """Raise for a given ``hf_config`` that fails; warn once for the server's own."""
        from aiosync.errors import SyncError

        if self.hf_config is not None:
            raise SyncError(f"hf_config: {exc}") from exc
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"cannot check the refit {what} against {self._base_url} before the first "
                f"bucket ({exc}); pass SGLangHTTPBackend(hf_config=...) to check it",
                RuntimeWarning,
                stacklevel=4,
            )

    async def config(self, info: Mapping[str, Any]) -> PretrainedConfig | None:
        """The HF config the server of ``info`` computes with (its
        ``json_model_override_args`` applied), or None when it cannot be loaded
        here (a ``RuntimeWarning`` says why, once). Callers must not modify it.

        Raises:
            SyncError: the ``hf_config`` given cannot be loaded.
        """
        try:
            return await self._load(info)
        except UnknownManifest as exc:
            self._unknown(exc, "model config")
            return None

    async def derive(self, info: Mapping[str, Any]) -> Manifest | None:
        """The manifest the server of ``info`` loads, or None when it cannot be built here.

        Built in a worker thread (it imports transformers and builds on ``meta``),
        with the server's ``json_model_override_args`` applied, in the dtype it runs.
        None: a ``RuntimeWarning`` says why, once.

        Raises:
            SyncError: the ``hf_config`` given cannot be loaded or built.
        """
        dtype = info.get("dtype")
        key = (self._key(info)[3], dtype)
        if self._cache is not None and self._cache[0] == key:
            return dict(self._cache[1])
        try:
            config = await self._load(info)
            manifest = await anyio.to_thread.run_sync(
                _derive, config, None if dtype is None else str(dtype)
            )
        except UnknownManifest as exc:
            self._unknown(exc, "manifest")
            return None
        self._cache = (key, manifest)
        return dict(manifest)


def _overrides(raw: Any) -> dict[str, Any] | str:
    """SGLang's ``json_model_override_args`` (a JSON object as a string); the text if unreadable."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(str(raw))
    except ValueError:
        return str(raw)
    return dict(value) if isinstance(value, dict) else str(raw)


def _derive(config: PretrainedConfig, dtype: str | None) -> Manifest:
    """dtype → meta model → checkpoint manifest (worker thread: it builds a model)."""
    return checkpoint_manifest(config, engine_dtype(config, dtype))
