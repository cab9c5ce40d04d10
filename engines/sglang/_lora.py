"""LoRA adapters on an SGLang server (``--enable-lora``): load by folder, unload the replaced.

An adapter is written as a PEFT folder under ``/dev/shm`` (``aiosync-lora-<pid>-*``),
loaded with ``/load_lora_adapter`` and the folder removed once the server answered;
``/generate`` then names it in ``lora_path``. Why the path endpoint: ``docs/sglang.md``.
Unless ``adapter.verify`` is False the folder is read back and every tensor
checked against the trainer's digests before the server is asked to load it
(:func:`aiosync.transports.lora.check_saved_adapter`); the server's own read and
copy are SGLang's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread

from aiosync.errors import RefitMismatchError, SyncTimeoutError, TransportError
from aiosync.lora import LoRAAdapter
from aiosync.transports._leftovers import SHM_DIR, dir_prefix
from aiosync.transports.lora import check_saved_adapter

__all__ = ["SGLangAdapters", "check_adapter_fits"]

#: ``post(path, body)``: one POST to the server, its JSON answer (as ``SGLangClient._post``).
Post = Callable[[str, Any], Awaitable[Any]]

#: SGLang's names for the layers it adapts (``lora/utils.py``, ``get_normalized_target_modules``).
_SGLANG_MODULE = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


class SGLangAdapters:
    """The adapters aiosync loaded on one server, and the one every ``/generate`` applies.

    Args:
        post: the server's POST (:meth:`SGLangClient._post`).
    """

    def __init__(self, post: Post) -> None:
        self._post = post
        # Loaded and not unloaded (one whose load failed without an answer may be among them).
        self._names: list[str] = []
        self._active: str | None = None
        # Why generation refuses on account of an adapter load (in flight or failed).
        self._refusal: str | None = None

    @property
    def active(self) -> str | None:
        """The adapter every ``/generate`` applies (``lora_path``); None: the base model."""
        return self._active

    @property
    def refusal(self) -> str | None:
        """Why no adapter may be applied now (a load in flight or failed); None: usable."""
        return self._refusal

    def begin(self, name: str) -> None:
        """A load of ``name`` starts: from now until it succeeds, generation refuses
        (the previous adapter is never served silently)."""
        self._refusal = (
            f"loading LoRA adapter {name!r} did not complete (failed, timed out or cancelled)"
        )
        self._active = None

    async def load(self, adapter: LoRAAdapter) -> None:
        """Load ``adapter`` (after :meth:`begin`), then unload every other one loaded.

        Raises:
            RefitVerificationError: the folder written for the server, read back,
                differs from the trainer's digests (the server is not asked).
            TransportError: the server refused the adapter (its ``error_message``
                quoted), an unload failed, or the connection failed.
            SyncTimeoutError: no answer in time.
        """
        name = adapter.name
        if name in self._names:
            # An earlier load of this name may have landed before it failed; SGLang
            # refuses a name it holds. Unknown to the server is fine too.
            await self._unload(name, quiet=True)
        directory = tempfile.mkdtemp(
            prefix=dir_prefix("lora"), dir=SHM_DIR if os.path.isdir(SHM_DIR) else None
        )
        try:
            await anyio.to_thread.run_sync(adapter.save, directory)
            # What the server will read, checked before it reads it (verify=False: nothing).
            await anyio.to_thread.run_sync(check_saved_adapter, directory, adapter)
            # Recorded first: a request that fails without an answer may have loaded it.
            self._names.append(name)
            body = {"lora_name": name, "lora_path": directory, "pinned": False}
            _check_answer(await self._post("/load_lora_adapter", body), "/load_lora_adapter")
        finally:
            # SGLang read the folder during the request; a failed one needs it no more.
            shutil.rmtree(directory, ignore_errors=True)
        failures = []
        for old in [n for n in self._names if n != name]:
            try:
                await self._unload(old)
            except (TransportError, SyncTimeoutError) as exc:
                failures.append(f"{old}: {exc}")
        if failures:
            raise TransportError(
                f"loaded LoRA adapter {name!r} but could not unload the one(s) it replaces: "
                + "; ".join(failures)
            )
        self._active = name
        self._refusal = None

    async def _unload(self, name: str, *, quiet: bool = False) -> None:
        """POST ``/unload_lora_adapter``; ``quiet``: a refusal (not loaded) is no error."""
        try:
            answer = await self._post("/unload_lora_adapter", {"lora_name": name})
            _check_answer(answer, "/unload_lora_adapter")
        except TransportError:
            if not quiet:
                raise
        if name in self._names:
            self._names.remove(name)


def check_adapter_fits(
    info: Mapping[str, Any], base_url: str, target_modules: Sequence[str], max_rank: int
) -> None:
    """Whether a server with ``/get_server_info`` ``info`` can load an adapter of this shape.

    Raises:
        ValueError: the server runs without ``--enable-lora``, or ``max_rank``
            exceeds its ``--max-lora-rank``.
        RefitMismatchError: a target module is outside its ``--lora-target-modules``
            (SGLang's names: ``q/k/v_proj`` count as ``qkv_proj``, ``gate/up_proj``
            as ``gate_up_proj``).
    """
    if "enable_lora" in info and not info["enable_lora"] and not info.get("lora_paths"):
        raise ValueError(
            f"the SGLang server {base_url} runs without --enable-lora: it cannot load "
            "LoRA adapters (start it with --enable-lora --max-lora-rank R "
            "--lora-target-modules ...)"
        )
    limit = info.get("max_lora_rank")
    if isinstance(limit, int) and max_rank > limit:
        raise ValueError(
            f"the adapter's rank {max_rank} exceeds the SGLang server's --max-lora-rank {limit}"
        )
    allowed = info.get("lora_target_modules")
    if isinstance(allowed, list | tuple) and allowed and "all" not in allowed:
        outside = sorted(_sglang_modules(target_modules) - _sglang_modules(allowed))
        if outside:
            raise RefitMismatchError(
                f"the adapter targets {outside}, outside the SGLang server's "
                f"--lora-target-modules {sorted(allowed)}"
            )


def _sglang_modules(names: Sequence[str]) -> set[str]:
    return {_SGLANG_MODULE.get(str(n), str(n)) for n in names}


def _check_answer(answer: Any, path: str) -> None:
    """A ``LoRAUpdateOutput`` that says ``success: false`` (with a 2xx) is a failure too."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise TransportError(f"{path} failed: {answer.get('error_message')}")
