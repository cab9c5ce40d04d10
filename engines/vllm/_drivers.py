"""How :class:`~aiosync.engines.vllm.backend.VLLMGenerationBackend` calls each kind of vLLM engine.

One driver per engine kind, so that the difference between a synchronous
``vllm.LLM`` (not thread-safe: one call at a time in a worker thread, through
``anyio.to_thread``) and an ``AsyncLLM`` (awaited directly) lives here alone:
:class:`LLMDriver` and :class:`AsyncLLMDriver`, chosen by :func:`driver_for`.
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
import anyio.to_thread

from aiosync.errors import TransportError

if TYPE_CHECKING:
    from aiosync.capabilities import InFlightPolicy

    from .._gate import AdmissionGate

__all__ = ["AsyncLLMDriver", "Driver", "LLMDriver", "driver_for", "rebuild_worker_error"]

_LLM_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()

# ``[aiosync:TypeName] message``, written by aiosync.engines.vllm.worker.
_TAGGED_ERROR = re.compile(r"\[aiosync:(\w+)\] (.*)", re.DOTALL)


class Driver(ABC):
    """The calls the backend makes into one vLLM engine (the module docs)."""

    #: The in-flight policies :meth:`pause` supports.
    pause_modes: ClassVar[tuple[InFlightPolicy, ...]]

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def vllm_config(self) -> Any:
        """The engine's ``VllmConfig`` (None: not found on this vLLM)."""
        # AsyncLLM has it; vllm.LLM keeps it on its llm_engine (and older vLLMs neither).
        config = getattr(self.engine, "vllm_config", None)
        if config is None:
            config = getattr(getattr(self.engine, "llm_engine", None), "vllm_config", None)
        return config

    @property
    def hf_config(self) -> Any:
        """The engine's ``model_config.hf_config`` (a ``PretrainedConfig``; None: not found)."""
        return getattr(getattr(self.vllm_config, "model_config", None), "hf_config", None)

    @abstractmethod
    def engine_core(self) -> Any:
        """vLLM's engine-core client (None: not found)."""

    def can_fan_out(self, core: Any, managed: int) -> bool:
        """Whether RPC replies can be collected from each of ``managed`` engines."""
        return False

    @abstractmethod
    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The engine's method ``name`` (``sleep``, ``wake_up``, ``reset_prefix_cache``)."""

    @abstractmethod
    async def collective_rpc(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], fan_out: bool
    ) -> list[Any]:
        """vLLM's ``collective_rpc`` (``fan_out``: every managed engine's replies)."""

    @abstractmethod
    async def lora_call(self, name: str, *args: Any) -> Any:
        """``add_lora`` / ``remove_lora`` / ``list_loras`` (errors as vLLM raises them)."""

    @abstractmethod
    async def set_weight_version(self, label: str) -> None:
        """Label the engine's outputs from now on (a vLLM without labels: nothing)."""

    @abstractmethod
    async def get_weight_version(self) -> str | None:
        """The engine's label (None: a vLLM without labels)."""

    @abstractmethod
    async def generate(
        self, inputs: Sequence[Any], params: Any, lora: Any, gate: AdmissionGate
    ) -> list[Any]:
        """vLLM's ``CompletionOutput`` of each input, in order."""

    @abstractmethod
    async def pause(self, mode: InFlightPolicy, clear_cache: bool, gate: AdmissionGate) -> bool:
        """Hold the running requests per ``mode`` (``gate`` already holds new calls);
        returns whether vLLM itself cleared its prefix cache."""

    @abstractmethod
    async def resume(self) -> None:
        """Let vLLM schedule again (after :meth:`pause`, or a pause cut short)."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine and its processes."""


class LLMDriver(Driver):
    """A synchronous ``vllm.LLM``: every call in a worker thread, one at a time."""

    pause_modes = ("wait",)

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        # vllm.LLM is not thread-safe: one call at a time per engine, whichever
        # backend wraps it. The lock is taken inside the worker thread, so a call
        # abandoned on timeout keeps it until vLLM returns and the next call waits
        # for that (within its own timeout).
        self._lock = _LLM_LOCKS.setdefault(engine, threading.Lock())

    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        def locked() -> Any:
            with self._lock:
                return fn()

        return await anyio.to_thread.run_sync(locked, abandon_on_cancel=True)

    def engine_core(self) -> Any:
        return getattr(getattr(self.engine, "llm_engine", None), "engine_core", None)

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await self._in_thread(functools.partial(getattr(self.engine, name), *args, **kwargs))

    async def collective_rpc(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], fan_out: bool
    ) -> list[Any]:
        result = await self._in_thread(
            functools.partial(
                self.engine.collective_rpc,
                method,
                # Never vLLM's own timeout: its executor then raises but leaves
                # the late reply queued for the next call.
                timeout=None,
                args=tuple(args),
                kwargs=kwargs,
            )
        )
        return list(result)

    async def lora_call(self, name: str, *args: Any) -> Any:
        # vllm.LLM has add_lora/remove_lora/list_loras only through llm_engine.
        return await self._in_thread(
            functools.partial(getattr(self.engine.llm_engine, name), *args)
        )

    async def set_weight_version(self, label: str) -> None:
        # Weight-version labels are newer than some vLLMs this runs on.
        setter = getattr(getattr(self.engine, "llm_engine", None), "set_weight_version", None)
        if setter is not None:
            await self._in_thread(functools.partial(setter, label))

    async def get_weight_version(self) -> str | None:
        # As set_weight_version: absent on older vLLMs.
        getter = getattr(getattr(self.engine, "llm_engine", None), "get_weight_version", None)
        return None if getter is None else str(await self._in_thread(getter))

    async def generate(
        self, inputs: Sequence[Any], params: Any, lora: Any, gate: AdmissionGate
    ) -> list[Any]:
        outputs = await self.call(
            "generate", list(inputs), params, use_tqdm=False, lora_request=lora
        )
        return [o.outputs[0] for o in outputs]

    async def pause(self, mode: InFlightPolicy, clear_cache: bool, gate: AdmissionGate) -> bool:
        # vLLM gives LLM no pause: wait for this backend's running calls.
        await gate.idle()
        return False

    async def resume(self) -> None:
        return None

    async def shutdown(self) -> None:
        await self._in_thread(functools.partial(_shutdown_llm, self.engine))


class AsyncLLMDriver(Driver):
    """An ``AsyncLLM``: awaited on the event loop."""

    pause_modes = ("abort", "wait", "keep")

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self._request_ids = 0

    def engine_core(self) -> Any:
        return getattr(self.engine, "engine_core", None)

    def can_fan_out(self, core: Any, managed: int) -> bool:
        # call_utility_all_async exists on vLLMs whose DP client can collect every
        # engine's replies (its plain collective_rpc returns the first engine's).
        return managed > 1 and callable(getattr(core, "call_utility_all_async", None))

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.engine, name)(*args, **kwargs)

    async def collective_rpc(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], fan_out: bool
    ) -> list[Any]:
        if fan_out:
            # vLLM's collective_rpc utility on each engine the client manages, in
            # data-parallel order (its own call returns the first engine's replies only).
            per_engine = await self.engine.engine_core.call_utility_all_async(
                "collective_rpc", method, None, tuple(args), kwargs
            )
            return [reply for replies in per_engine for reply in replies]
        result = await self.engine.collective_rpc(
            method, timeout=None, args=tuple(args), kwargs=kwargs
        )
        return list(result)

    async def lora_call(self, name: str, *args: Any) -> Any:
        return await getattr(self.engine, name)(*args)

    async def set_weight_version(self, label: str) -> None:
        # Weight-version labels are newer than some vLLMs this runs on.
        update = getattr(self.engine, "update_weight_version", None)
        if update is not None:
            await update(label)

    async def get_weight_version(self) -> str | None:
        # As set_weight_version: absent on older vLLMs.
        get = getattr(self.engine, "get_weight_version", None)
        return None if get is None else str(await get())

    async def generate(
        self, inputs: Sequence[Any], params: Any, lora: Any, gate: AdmissionGate
    ) -> list[Any]:
        results: list[Any] = [None for _ in inputs]
        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate(inputs):
                tg.start_soon(self._generate_one, prompt, params, lora, gate, results, i)
        return results

    async def _generate_one(
        self, prompt: Any, params: Any, lora: Any, gate: AdmissionGate, results: list[Any], i: int
    ) -> None:
        self._request_ids += 1
        final = None
        try:
            async for out in self.engine.generate(
                prompt, params, f"aiosync-{self._request_ids}", lora_request=lora
            ):
                if final is None:
                    gate.streaming += 1
                final = out
        finally:
            if final is not None:
                gate.streaming -= 1
                gate.notify()
        assert final is not None
        results[i] = final.outputs[0]

    async def pause(self, mode: InFlightPolicy, clear_cache: bool, gate: AdmissionGate) -> bool:
        try:
            await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)
        except Exception as exc:
            raise TransportError(f"vLLM pause_generation(mode={mode!r}) failed: {exc}") from exc
        if mode != "keep":
            await gate.drained()
        return True

    async def resume(self) -> None:
        try:
            await self.engine.resume_generation()
        except Exception as exc:
            raise TransportError(f"vLLM resume_generation failed: {exc}") from exc

    async def shutdown(self) -> None:
        self.engine.shutdown()


def driver_for(engine: Any) -> Driver:
    """The driver of ``engine``: an ``AsyncLLM`` (its ``collective_rpc`` is a
    coroutine function) or a ``vllm.LLM``.

    Raises:
        TypeError: ``engine`` is neither (it has no ``collective_rpc``).
    """
    rpc = getattr(engine, "collective_rpc", None)  # not an aiosync capability: vLLM's own
    if not callable(rpc):
        raise TypeError(f"{type(engine).__name__} is not a vLLM LLM/AsyncLLM engine")
    return AsyncLLMDriver(engine) if inspect.iscoroutinefunction(rpc) else LLMDriver(engine)


def rebuild_worker_error(method: str, exc: Exception) -> Exception:
    """A worker's error from vLLM's message-only exception (``[aiosync:Type] message``
    keeps aiosync's type; anything else is a ``TransportError``)."""
    from aiosync.transports._wire import rebuild_error

    match = _TAGGED_ERROR.search(str(exc))
    if match is None:
        return TransportError(f"vLLM collective_rpc {method!r} failed: {exc}")
    return rebuild_error(
        {"type": match.group(1), "message": match.group(2)}, f"vLLM worker ({method})"
    )


def _shutdown_llm(llm: Any) -> None:
    # vllm.LLM has no public close(); its engine core client owns the processes.
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        core.shutdown()
