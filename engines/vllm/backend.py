"""A real vLLM engine as aiosync's generation backend and engine workers.

:class:`VLLMGenerationBackend` wraps a ``vllm.LLM`` (synchronous; its calls run
in a worker thread through ``anyio.to_thread``) or a ``vllm.v1.engine.async_llm.AsyncLLM``
(awaited directly) and gives the training loop and the transports what they
expect of any engine:

* :class:`aiosync.EngineWorkers` — ``collective_rpc(method, args, kwargs, timeout_s)``
  calls the worker extension's ``aiosync_*`` methods by name through vLLM's own
  ``collective_rpc`` (the engine must be built with
  ``worker_extension_cls=`` :data:`WORKER_EXTENSION`).
* :class:`aiosync.GenerationBackend` — ``prepare_for_generation(tags)`` wakes
  the engine (``wake_up(tags)``) and drops the prefix cache (KV computed with old
  weights must not survive a refit); ``finish_generation()`` puts it to sleep
  (``sleep(level)``).
* ``generate(prompts)`` — greedy (or sampled) token ids for token-id prompts.

Sleep mode exists only where vLLM supports it (CUDA, ROCm, XPU) and the engine
was built with ``enable_sleep_mode=True``. vLLM's CPU worker rejects
``enable_sleep_mode`` and turns ``sleep``/``wake_up`` into no-ops; there this
backend logs once that no memory is released and does nothing, rather than
pretend (see ``docs/vllm.md``).

Errors: a worker's exception reaches the client of a multiprocess vLLM engine
as a plain ``Exception`` carrying only its message; the worker extension
(:mod:`aiosync.engines.vllm.worker`) tags aiosync's own errors in that message and
this module re-raises them with their type (``RefitMismatchError``,
``TransportError``, ``SyncTimeoutError``); anything else becomes a
``TransportError``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread

from aiosync._config import DEFAULT_RPC_TIMEOUT_S
from aiosync.errors import SyncError, SyncTimeoutError, TransportError

__all__ = ["WORKER_EXTENSION", "VLLMGenerationBackend"]

_log = logging.getLogger(__name__)

#: The class to pass as vLLM's ``worker_extension_cls``.
WORKER_EXTENSION = "aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension"

#: The tags ``wake_up`` accepts (vLLM's ``LLM.wake_up``).
_WAKE_TAGS = frozenset({"weights", "kv_cache", "scheduling"})

_LLM_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()

# ``[aiosync:TypeName] message``, written by aiosync.engines.vllm.worker.
_TAGGED_ERROR = re.compile(r"\[aiosync:(\w+)\] (.*)", re.DOTALL)


class VLLMGenerationBackend:
    """aiosync's engine interface over a live vLLM engine.

    Args:
        engine: a ``vllm.LLM`` or an ``AsyncLLM``, built with
            ``worker_extension_cls=WORKER_EXTENSION``.
        sleep_level: ``sleep(level)`` used by :meth:`finish_generation`: 1 offloads
            weights to host memory and drops the KV cache; 2 discards the weights
            too (the next wake needs a refit: the transports are told, see
            :meth:`add_weights_discarded_listener`).
        rpc_timeout_s: default limit of one :meth:`collective_rpc`, seconds.

    Raises:
        ValueError: ``sleep_level`` is not 1 or 2.
        TypeError: ``engine`` is neither kind of vLLM engine.
    """

    def __init__(
        self,
        engine: Any,
        *,
        sleep_level: int = 1,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    ) -> None:
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        if not callable(getattr(engine, "collective_rpc", None)):
            raise TypeError(f"{type(engine).__name__} is not a vLLM LLM/AsyncLLM engine")
        self.engine = engine
        self.sleep_level = sleep_level
        self.rpc_timeout_s = rpc_timeout_s
        self._is_async = inspect.iscoroutinefunction(engine.collective_rpc)
        self._sleep_mode = _sleep_mode_enabled(engine)
        self._asleep = False
        self._discard_listeners: list[Callable[[], None]] = []
        # vllm.LLM is not thread-safe: one call at a time per engine, whichever
        # backend wraps it. The lock is taken inside the worker thread, so a call
        # abandoned on timeout keeps it until vLLM returns and the next call waits
        # for that (within its own timeout).
        self._llm_lock = _LLM_LOCKS.setdefault(engine, threading.Lock())
        self._warned_no_sleep = False
        self._request_ids = 0

    @classmethod
    def from_model(
        cls,
        model: str,
        *,
        sleep_level: int = 1,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        **llm_kwargs: Any,
    ) -> VLLMGenerationBackend:
        """Build a ``vllm.LLM`` with aiosync's worker extension, then wrap it.

        Args:
            model: the model folder (an HF checkpoint: config.json, safetensors,
                tokenizer files) or hub name.
            **llm_kwargs: passed to ``vllm.LLM`` (``enforce_eager``, ``dtype``,
                ``enable_sleep_mode``, ...). ``worker_extension_cls`` defaults
                to :data:`WORKER_EXTENSION`.

        Raises:
            ImportError: vLLM is not installed.
        """
        from vllm import LLM

        llm_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
        return cls(
            LLM(model=model, **llm_kwargs), sleep_level=sleep_level, rpc_timeout_s=rpc_timeout_s
        )

    # -- EngineWorkers -----------------------------------------------------------

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every vLLM worker; results in rank order.

        Args and results must be msgpack-safe (str, int, float, bool, None, bytes,
        list, dict): vLLM serializes them between its processes.

        Raises:
            SyncTimeoutError: no answer within ``timeout_s`` (default
                ``rpc_timeout_s``) seconds. The engine keeps running the call
                (aiosync's worker methods end on their own timeouts); later
                calls wait behind it.
            RefitMismatchError, TransportError, SyncTimeoutError: re-raised from
                a worker that raised one; any other worker error is a
                ``TransportError`` with its message.
        """
        timeout = self.rpc_timeout_s if timeout_s is None else timeout_s
        call_kwargs = dict(kwargs or {})
        try:
            with anyio.fail_after(timeout):
                if self._is_async:
                    result = await self.engine.collective_rpc(
                        method, timeout=None, args=tuple(args), kwargs=call_kwargs
                    )
                else:
                    result = await self._in_thread(
                        functools.partial(
                            self.engine.collective_rpc,
                            method,
                            # Never vLLM's own timeout: its executor then raises but
                            # leaves the late reply queued for the next call.
                            timeout=None,
                            args=tuple(args),
                            kwargs=call_kwargs,
                        )
                    )
        except TimeoutError as exc:
            if isinstance(exc, SyncError):
                raise
            raise SyncTimeoutError(
                f"vLLM collective_rpc {method!r} did not return within {timeout} s"
            ) from exc
        except SyncError:
            raise
        except Exception as exc:
            raise _rebuild_worker_error(method, exc) from exc
        return list(result)

    # -- GenerationBackend -------------------------------------------------------

    @property
    def sleep_mode(self) -> bool:
        """True when ``sleep``/``wake_up`` really release and restore device memory."""
        return self._sleep_mode

    def add_weights_discarded_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever the engine discards its weights (``sleep_level=2``).

        The transports register their synchronizer's invalidation here (the
        embedded engine has the same hook), so after such a sleep ``is_stale``
        is true and the loop refits before generating again (case C6).
        """
        self._discard_listeners.append(callback)

    async def on_weights_committed(self, version: int) -> None:
        """Set vLLM's weight version to ``str(version)`` (``LLM.llm_engine.set_weight_version``,
        ``AsyncLLM.update_weight_version``): outputs from now on carry it. Called by the
        synchronizer after a sync landed on every worker; a vLLM without weight
        versions is left as is."""
        if self._is_async:
            update = getattr(self.engine, "update_weight_version", None)
            if update is not None:
                await update(str(version))
            return
        setter = getattr(getattr(self.engine, "llm_engine", None), "set_weight_version", None)
        if setter is not None:
            await self._in_thread(functools.partial(setter, str(version)))

    async def weight_version(self) -> str | None:
        """The weight version vLLM reports (None: this vLLM has none)."""
        if self._is_async:
            get = getattr(self.engine, "get_weight_version", None)
            return None if get is None else str(await get())
        getter = getattr(getattr(self.engine, "llm_engine", None), "get_weight_version", None)
        return None if getter is None else str(await self._in_thread(getter))

    async def prepare_for_generation(self, tags: Sequence[str] | None = None) -> None:
        """Wake the engine (``tags``: ``"weights"``, ``"kv_cache"``; None: all).

        Waking the KV cache (``"kv_cache"`` or None) also drops vLLM's prefix
        cache, so no KV computed with the previous weights is reused after a
        refit. vLLM refuses that while requests hold KV blocks (it returns
        False); those requests are then preempted (``reset_running_requests``)
        and recompute their KV with the new weights. Call it with
        ``["weights"]`` before a colocated refit and with ``["kv_cache"]`` after
        it to keep peak memory low.

        Raises:
            ValueError: an unknown tag.
            TransportError: vLLM refused to drop its prefix cache even with the
                running requests preempted.
        """
        wake = None if tags is None else list(tags)
        if wake is not None:
            unknown = sorted(set(wake) - _WAKE_TAGS)
            if unknown:
                raise ValueError(f"unknown wake-up tags {unknown}; known: {sorted(_WAKE_TAGS)}")
        if self._sleep_mode and self._asleep:
            await self._call("wake_up", wake)
            if wake is None or "kv_cache" in wake:
                self._asleep = False
        elif not self._sleep_mode:
            self._warn_no_sleep()
        if wake is None or "kv_cache" in wake:
            await self._reset_prefix_cache()

    async def _reset_prefix_cache(self) -> None:
        if await self._call("reset_prefix_cache") is not False:
            return  # done (None: a vLLM that does not say)
        # Requests hold KV blocks computed with the previous weights: preempt them.
        try:
            done = await self._call("reset_prefix_cache", reset_running_requests=True)
        except TypeError:  # a vLLM without reset_running_requests
            done = False
        if done is False:
            raise TransportError(
                "vLLM refused to reset its prefix cache while requests hold KV blocks: "
                "KV computed with the previous weights would be reused"
            )

    async def finish_generation(self) -> None:
        """Sleep at ``sleep_level`` so the trainer gets the device memory back.

        A no-op, logged once, where vLLM has no sleep mode (its CPU worker) or
        the engine was built without ``enable_sleep_mode=True``.
        """
        if not self._sleep_mode:
            self._warn_no_sleep()
            return
        if self._asleep:
            return
        await self._call("sleep", self.sleep_level)
        self._asleep = True
        if self.sleep_level >= 2:
            for callback in self._discard_listeners:
                callback()

    # -- generation --------------------------------------------------------------

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = True,
    ) -> list[list[int]]:
        """Generate from token-id prompts; returns the new token ids per prompt.

        Args:
            prompts: one list of token ids per prompt.
            max_new_tokens: tokens to generate per prompt.
            temperature: 0.0 is greedy.
            ignore_eos: keep going past an end-of-sequence token, so every
                output has ``max_new_tokens`` tokens.

        Raises:
            SyncError: a worker holds half-updated weights (a refit failed
                part-way); refit before generating.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        statuses = await self.collective_rpc("aiosync_vllm_status")
        invalid = [s["rank"] for s in statuses if not s["weights_valid"]]
        if invalid:
            raise SyncError(
                f"vLLM worker(s) {invalid} hold partially updated weights; sync before generating"
            )
        params = SamplingParams(
            temperature=temperature, max_tokens=max_new_tokens, seed=seed, ignore_eos=ignore_eos
        )
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        if self._is_async:
            results: list[list[int]] = [[] for _ in inputs]
            async with anyio.create_task_group() as tg:
                for i, prompt in enumerate(inputs):
                    tg.start_soon(self._generate_async, prompt, params, results, i)
            return results
        outputs = await self._call("generate", inputs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    async def shutdown(self) -> None:
        """Stop the engine and its processes."""
        if self._is_async:
            self.engine.shutdown()
            return
        await self._in_thread(functools.partial(_shutdown_llm, self.engine))

    # -- helpers -----------------------------------------------------------------

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.engine, name)
        if self._is_async:
            return await fn(*args, **kwargs)
        return await self._in_thread(functools.partial(fn, *args, **kwargs))

    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        def locked() -> Any:
            with self._llm_lock:
                return fn()

        return await anyio.to_thread.run_sync(locked, abandon_on_cancel=True)

    async def _generate_async(
        self, prompt: Any, params: Any, results: list[list[int]], index: int
    ) -> None:
        self._request_ids += 1
        final = None
        async for out in self.engine.generate(prompt, params, f"aiosync-{self._request_ids}"):
            final = out
        assert final is not None
        results[index] = list(final.outputs[0].token_ids)

    def _warn_no_sleep(self) -> None:
        if not self._warned_no_sleep:
            self._warned_no_sleep = True
            _log.warning(
                "vLLM sleep mode is off on this engine (vLLM supports it only on CUDA/ROCm/XPU "
                "with enable_sleep_mode=True; its CPU worker ignores sleep/wake_up): "
                "finish_generation() releases no memory and prepare_for_generation() "
                "only resets the prefix cache"
            )


def _sleep_mode_enabled(engine: Any) -> bool:
    config = getattr(engine, "vllm_config", None)
    if config is None:
        config = getattr(getattr(engine, "llm_engine", None), "vllm_config", None)
    model_config = getattr(config, "model_config", None)
    return bool(getattr(model_config, "enable_sleep_mode", False))


def _rebuild_worker_error(method: str, exc: Exception) -> Exception:
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
