"""``/release_memory_occupation`` and ``/resume_memory_occupation`` (the memory saver)."""

from __future__ import annotations

from aiosync.engines.sglang.contract_server._base import _Routes
from aiosync.engines.sglang.contract_server._wire import _error


class _MemoryRoutes(_Routes):
    """SGLang's memory-occupation routes."""

    def _release(self, tags: list[str]) -> None:
        state = self.server.state
        if not state.enable_memory_saver:
            raise _error("release_memory_occupation needs --enable-memory-saver")
        with state.lock:
            if state.running:
                raise _error(
                    "release_memory_occupation should be called only when no ongoing request."
                )
            state.released.update(tags)
            if "kv_cache" in tags:
                state.cache.clear()
                state.scheduler.drop_tree()
        return None

    def _resume(self, tags: list[str]) -> None:
        state = self.server.state
        with state.lock:
            missing = [t for t in tags if t not in state.released]
            if missing:
                raise _error(f"resume_memory_occupation: {missing} not released")
            state.released.difference_update(tags)
        if "weights" in tags and not state.weights_cpu_backup:
            # The memory saver hands back fresh pages: the old weights are gone.
            with state.model_lock:
                for runner in state.ranks:
                    runner.fill_(float("nan"))
        return None

    # -- test-only ------------------------------------------------------------------
