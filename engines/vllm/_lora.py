"""LoRA adapters on vLLM: checks before any byte moves, and where the adapter is written.

vLLM 0.32 reads adapters from a PEFT directory only (``LoRARequest.lora_path``);
:meth:`~aiosync.engines.vllm.backend.VLLMGenerationBackend.load_lora_adapter`
writes it under :data:`LORA_DIR_PARENT` and, unless ``adapter.verify`` is False,
reads it back and checks every tensor against the trainer's digests before
vLLM is asked to load it (:func:`aiosync.transports.lora.check_saved_adapter`):
what vLLM reads is what the trainer sent. vLLM's own read of the folder and its
copy into its LoRA slots are vLLM's. No vLLM import here: the worker
extension imports :data:`LORA_PAIR_NAME` inside vLLM's workers.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from aiosync.errors import RefitMismatchError, SyncError, SyncTimeoutError, TransportError
from aiosync.lora import LoRAAdapter
from aiosync.transports._leftovers import dir_prefix
from aiosync.transports.lora import check_saved_adapter

if TYPE_CHECKING:
    from ._drivers import Driver

__all__ = [
    "LORA_DIR_PARENT",
    "LORA_PAIR_NAME",
    "AdapterSlot",
    "check_lora_adapter",
    "check_rank",
    "lora_config_of",
    "lora_dir_parent",
    "raise_lora_problems",
]

_log = logging.getLogger(__name__)

#: Where :meth:`VLLMGenerationBackend.load_lora_adapter` writes the adapter's PEFT
#: directory for vLLM to read (RAM-backed; the temp dir where it does not exist).
#: Each directory is ``aiosync-lora-<pid>-<8 chars>`` and is removed once vLLM
#: has read it.
LORA_DIR_PARENT = "/dev/shm"

#: PEFT's saved names of a LoRA pair: ``<prefix>.<module>.lora_A.weight`` ``[r, in]``,
#: ``...lora_B.weight`` ``[out, r]`` (embedding LoRA, ``lora_embedding_A/B``, is not matched).
LORA_PAIR_NAME = re.compile(r"(?P<module>.+)\.lora_(?P<kind>[AB])\.weight")


def lora_config_of(vllm_config: Any) -> Any:
    """The engine's ``LoRAConfig`` (from its ``VllmConfig``).

    Raises:
        ValueError: the engine was built without ``enable_lora=True``.
    """
    lora_config = getattr(vllm_config, "lora_config", None)
    if lora_config is None:
        raise ValueError(
            "this vLLM engine was built without LoRA support: build it with "
            "enable_lora=True (vllm serve --enable-lora) and max_lora_rank >= the adapter's "
            "rank to load LoRA adapters"
        )
    return lora_config


def check_lora_adapter(adapter: Any, lora_config: Any) -> dict[str, list[int]]:
    """Check ``adapter`` against itself and the engine's ``LoRAConfig``; returns the
    shapes of its LoRA pairs ``{peft_name: [rows, cols]}`` for the workers' check.

    Raises:
        TypeError, ValueError, RefitMismatchError: see ``load_lora_adapter``.
    """
    if not isinstance(adapter, LoRAAdapter):
        raise TypeError(f"expected an aiosync.LoRAAdapter, got {type(adapter).__name__}")
    if isinstance(adapter.version, bool) or not isinstance(adapter.version, int):
        raise TypeError(f"LoRA adapter version must be an int, got {adapter.version!r}")
    if adapter.version < 1:
        raise ValueError(
            f"LoRA adapter version must be >= 1 (vLLM's lora_int_id), got {adapter.version}"
        )
    rank = adapter.config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"LoRA adapter config['r'] must be an int, got {rank!r}")
    pattern = dict(adapter.config.get("rank_pattern") or {})
    check_rank(
        max([rank, *(int(r) for r in pattern.values())]),
        lora_config,
        f"LoRA adapter {adapter.name!r}",
    )
    pairs: dict[str, dict[str, Sequence[int]]] = {}
    shapes: dict[str, list[int]] = {}
    for name, tensor in adapter.tensors.items():
        match = LORA_PAIR_NAME.fullmatch(name)
        if match is None:
            continue  # embedding LoRA, modules_to_save: vLLM checks them
        shape = list(tensor.shape)
        if len(shape) != 2:
            raise RefitMismatchError(f"LoRA tensor {name} must be 2-D, has shape {shape}")
        pairs.setdefault(match["module"], {})[match["kind"]] = shape
        shapes[name] = shape
    if not pairs:
        raise ValueError(f"LoRA adapter {adapter.name!r} holds no lora_A/lora_B tensors")
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise RefitMismatchError(f"LoRA adapter has no {module}.{missing}.weight")
        a_rank, b_rank = pair["A"][0], pair["B"][1]
        if a_rank != b_rank or (not pattern and a_rank != rank):
            raise RefitMismatchError(
                f"LoRA ranks of {module} do not agree: lora_A {list(pair['A'])} "
                f"([r, in_features]), lora_B {list(pair['B'])} ([out_features, r]), "
                f"config r={rank}"
            )
        check_rank(a_rank, lora_config, f"LoRA adapter {adapter.name!r} at {module}")
    return shapes


def check_rank(rank: int, lora_config: Any, what: str) -> None:
    if rank > lora_config.max_lora_rank:
        raise ValueError(
            f"{what} has rank {rank}, above the engine's "
            f"max_lora_rank={lora_config.max_lora_rank}: build the engine with a larger "
            "max_lora_rank (vllm serve --max-lora-rank)"
        )


def raise_lora_problems(what: str, reports: Sequence[Mapping[str, Any]]) -> None:
    """Raise the workers' ``aiosync_vllm_check_lora`` problems as one RefitMismatchError."""
    for report in reports:
        if not report["checked"]:
            _log.debug("LoRA shapes not checked against the model: %s", report["reason"])
    problems = list(dict.fromkeys(p for report in reports for p in report["problems"]))
    if problems:
        raise RefitMismatchError(
            f"{what} does not fit the engine's model: "
            + "; ".join(problems[:5])
            + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        )


def lora_dir_parent() -> str:
    return LORA_DIR_PARENT if os.path.isdir(LORA_DIR_PARENT) else tempfile.gettempdir()


class AdapterSlot:
    """The LoRA adapter a vLLM backend's ``generate`` passes, and the aiosync
    adapters it added to vLLM and has not removed.

    Args:
        driver: the engine's driver.
        rpc: the backend's ``collective_rpc`` (the workers' shape checks).
        reset_prefix_cache: drops vLLM's prefix cache (a reloaded adapter name).
        timeout_s: the backend's current ``rpc_timeout_s``.
    """

    def __init__(
        self,
        driver: Driver,
        rpc: Callable[..., Awaitable[list[Any]]],
        reset_prefix_cache: Callable[[], Awaitable[None]],
        timeout_s: Callable[[], float],
    ) -> None:
        self._driver = driver
        self._rpc = rpc
        self._reset_prefix_cache = reset_prefix_cache
        self._timeout_s = timeout_s
        #: The ``LoRARequest`` every generate passes; None: the base model.
        self.request: Any = None
        #: Why generate refuses after a failed load; None: it does not.
        self.error: str | None = None
        self._ids: set[int] = set()

    async def call(self, name: str, *args: Any) -> Any:
        """vLLM's ``name`` (``add_lora``, ``remove_lora``, ``list_loras``).

        Raises:
            TransportError: vLLM raised (its message).
        """
        try:
            return await self._driver.lora_call(name, *args)
        except Exception as exc:
            raise TransportError(f"vLLM {name} failed: {exc}") from exc

    async def held(self) -> set[int]:
        """The ``lora_int_id`` of every adapter vLLM holds."""
        return {int(i) for i in await self.call("list_loras")}

    async def usable_before_status(self) -> Any:
        """The request a generate passes now (None: the base model); check it with
        :meth:`check_held` once the workers' status is read.

        Raises:
            SyncError: the last load failed.
        """
        if self.error is not None:
            raise SyncError(f"{self.error}; load a LoRA adapter before generating")
        return self.request

    async def check_held(self, lora: Any) -> None:
        """Raises:
        SyncError: vLLM no longer holds ``lora`` (a request of :meth:`usable_before_status`).
        """
        if lora is not None and lora.lora_int_id not in await self.held():
            # Its directory is gone: vLLM would try to read it again and its
            # engine core would die (LoRAAdapterNotFoundError in a step).
            raise SyncError(
                f"vLLM no longer holds LoRA adapter {lora.lora_name!r} (a full-weight "
                "refit or vLLM's adapter cache removed it); load it again before generating"
            )

    async def load(self, adapter: LoRAAdapter) -> None:
        """Load ``adapter`` and make it :attr:`request` (the backend's
        ``load_lora_adapter`` documents it); a failure of any kind leaves
        :attr:`error` set and no request."""
        try:
            await self._load(adapter)
        except BaseException as exc:  # cancelled too: vLLM may hold part of it
            self.request = None
            name = getattr(adapter, "name", adapter)  # maybe not a LoRAAdapter at all
            self.error = f"loading LoRA adapter {name!r} failed ({type(exc).__name__}: {exc})"
            raise

    async def _load(self, adapter: LoRAAdapter) -> None:
        from vllm.lora.request import LoRARequest

        shapes = check_lora_adapter(adapter, lora_config_of(self._driver.vllm_config))
        reports = await self._rpc("aiosync_vllm_check_lora", (shapes,))
        raise_lora_problems(f"LoRA adapter {adapter.name!r}", reports)
        replaced = adapter.version in await self.held()
        folder = await anyio.to_thread.run_sync(
            lambda: tempfile.mkdtemp(prefix=dir_prefix("lora"), dir=lora_dir_parent())
        )
        try:
            await anyio.to_thread.run_sync(adapter.save, folder)
            # What vLLM will read, checked before it reads it (verify=False: nothing).
            await anyio.to_thread.run_sync(check_saved_adapter, folder, adapter)
            # load_inplace: reload even if an adapter with this id is held (a retry
            # of the same version); generate() passes a request without it, or
            # vLLM would re-read the (removed) directory at every step.
            await self._add(LoRARequest(adapter.name, adapter.version, folder, load_inplace=True))
        finally:
            # Synchronous: a cancelled load must still remove it (a few MB in RAM).
            shutil.rmtree(folder, ignore_errors=True)
        self.request = LoRARequest(adapter.name, adapter.version, folder)
        self.error = None
        for stale in sorted(self._ids - {adapter.version}):
            await self.call("remove_lora", stale)
            self._ids.discard(stale)
        if replaced:  # same name, new tensors: KV cached under that name is stale
            await self._reset_prefix_cache()

    async def _add(self, request: Any) -> None:
        self._ids.add(request.lora_int_id)  # vLLM may hold part of it, even on failure
        timeout = self._timeout_s()
        try:
            with anyio.fail_after(timeout):
                added = await self.call("add_lora", request)
        except TimeoutError as exc:
            raise SyncTimeoutError(
                f"vLLM add_lora({request.lora_name!r}) did not return within {timeout} s"
            ) from exc
        except TransportError as exc:
            # A failed add can leave the adapter registered, half-copied into its
            # slot (vLLM 0.32 registers it before activating it): drop it.
            with suppress(Exception):
                await self.call("remove_lora", request.lora_int_id)
                self._ids.discard(request.lora_int_id)
            raise TransportError(
                f"vLLM could not load LoRA adapter {request.lora_name!r}: {exc.__cause__ or exc}"
            ) from exc
        if not added:
            raise TransportError(f"vLLM did not load LoRA adapter {request.lora_name!r}")
