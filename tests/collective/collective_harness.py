"""A minimal engine for the collective tests: spawned worker processes hosting a tiny
transformers model (:class:`HFModelRunner`) and the real :class:`CollectiveWorkerMixin`.

It implements ``collective_rpc`` (the :class:`aiosync.EngineWorkers` protocol)
over multiprocessing pipes, and lets a test pick a subset of the workers, kill
one and restart it. Imported by ``conftest.py`` under this unique module name so
that spawned children can unpickle the worker entry point.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import threading
import traceback
from collections.abc import Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.to_thread

from aiosync.engines.embedded.configs import TINY_QWEN3, TINY_QWEN3_MOE
from aiosync.errors import RefitMismatchError, SyncTimeoutError, TransportError

#: The prompts the collective tests generate from.
PROMPTS = [[1, 2, 3, 4], [7, 9, 11]]
QWEN3 = TINY_QWEN3
QWEN3_MOE = TINY_QWEN3_MOE

_ERRORS: dict[str, type[Exception]] = {
    "RefitMismatchError": RefitMismatchError,
    "TransportError": TransportError,
    "SyncTimeoutError": SyncTimeoutError,
}


def _worker_main(conn: Any, config: dict[str, Any], seed: int) -> None:
    import torch

    from aiosync.engines.embedded.model import HFModelRunner
    from aiosync.transports.collective.worker import CollectiveWorkerMixin

    torch.set_num_threads(1)

    class Runner(HFModelRunner):
        """The embedded runner, plus what a vLLM model does with FP8 KV scales."""

        kv_scales: dict[str, float]
        crash_after_loads: int | None = None

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
            if self.crash_after_loads is not None:
                self.crash_after_loads -= 1
                if self.crash_after_loads < 0:
                    os._exit(17)  # the engine process dies in the middle of a refit
            rest = []
            for name, tensor in weights:
                if name.endswith(("k_scale", "v_scale")):
                    assert tensor.dtype == torch.float32 and tensor.dim() == 0, tensor
                    self.kv_scales[name] = float(tensor)
                else:
                    rest.append((name, tensor))
            return super().load_weights(rest)

    class Worker(CollectiveWorkerMixin):
        def __init__(self) -> None:
            self.rank = 0
            runner = Runner.from_config(config, seed=seed)
            runner.kv_scales = {}
            self.model_runner = SimpleNamespace(model=runner)

        def test_set_rank(self, rank: int) -> None:
            self.rank = rank

        def test_set_env(self, name: str, value: str | None) -> None:
            """Set (None: unset) an environment variable of this worker process, e.g.
            ``GLOO_SOCKET_IFNAME``, which gloo reads when a group is formed."""
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

        def test_state_dict(self) -> dict[str, torch.Tensor]:
            return self.model_runner.model.hf_state_dict()

        def test_generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
            if not self.aiosync_weights_valid:
                raise TransportError("weights invalid: refusing to generate")
            return self.model_runner.model.generate(
                prompts, max_new_tokens=max_new_tokens, ignore_eos=True
            )

        def test_kv_scales(self) -> dict[str, float]:
            return dict(self.model_runner.model.kv_scales)

        def test_arm_crash(self, after_loads: int) -> None:
            self.model_runner.model.crash_after_loads = after_loads

        def test_drop_bucket_data(self) -> None:
            """Make this worker's communicator report success without delivering
            bucket bytes (a no-op communicator on an unsupported device, case C12)."""
            group = self._aiosync_collective_state().group
            real = type(group).broadcast

            def lossy(tensor: torch.Tensor, *, what: str) -> Any:
                if what.startswith("receive of bucket"):
                    tensor = torch.empty_like(tensor)
                return real(group, tensor, what=what)

            group.broadcast = lossy  # type: ignore[method-assign]

        def test_init_default_group(self, port: int, world_size: int) -> None:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=self.rank,
                world_size=world_size,
            )

        def test_default_all_reduce(self) -> int:
            import torch.distributed as dist

            t = torch.tensor([self.rank + 1])
            dist.all_reduce(t)
            return int(t)

        def test_destroy_default_group(self) -> None:
            import torch.distributed as dist

            dist.destroy_process_group()

    worker = Worker()
    lock = threading.Lock()

    def serve(call_id: int, method: str, kwargs: dict[str, Any]) -> None:
        try:
            reply: tuple[Any, ...] = (call_id, "ok", getattr(worker, method)(**kwargs))
        except BaseException as exc:
            reply = (call_id, "err", type(exc).__name__, f"{exc}\n{traceback.format_exc()}")
        with lock:
            conn.send(reply)

    conn.send((0, "ok", "ready"))
    # Like the real engines, RPCs run in threads: a staged receive or a long
    # receive does not block a generate.
    while True:
        try:
            call_id, method, kwargs = conn.recv()
        except EOFError:
            return
        threading.Thread(target=serve, args=(call_id, method, kwargs), daemon=True).start()


class WorkerPool:
    """Spawned engine workers; ``view(indices)`` gives an :class:`aiosync.EngineWorkers`."""

    def __init__(self, configs: Sequence[Mapping[str, Any]], seed: int = 1) -> None:
        self._ctx = mp.get_context("spawn")
        self._configs = [dict(c) for c in configs]
        self._seed = seed
        self._ids = itertools.count(1)
        self._procs: list[Any] = [None] * len(configs)
        self._conns: list[Any] = [None] * len(configs)
        self._replies: list[dict[int, tuple[Any, ...]]] = [{} for _ in configs]
        self._locks = [threading.Lock() for _ in configs]
        for i in range(len(configs)):
            self._start(i)
        for i in range(len(configs)):
            self._wait_ready(i)

    def _start(self, i: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_worker_main, args=(child, self._configs[i], self._seed + i), daemon=True
        )
        proc.start()
        child.close()
        self._procs[i], self._conns[i], self._replies[i] = proc, parent, {}

    def _wait_ready(self, i: int) -> None:
        if not self._conns[i].poll(600):
            raise RuntimeError(f"worker {i} did not start")
        assert self._conns[i].recv() == (0, "ok", "ready")

    def restart(self, i: int) -> None:
        """Replace worker ``i`` (e.g. after it was killed) by a fresh process."""
        self.kill(i)
        self._start(i)
        self._wait_ready(i)

    def kill(self, i: int) -> None:
        proc = self._procs[i]
        if proc is not None and proc.is_alive():
            proc.kill()
        if proc is not None:
            proc.join(30)

    def pid(self, i: int) -> int:
        return int(self._procs[i].pid)

    def is_alive(self, i: int) -> bool:
        return bool(self._procs[i].is_alive())

    def close(self) -> None:
        for i in range(len(self._procs)):
            self.kill(i)
            self._conns[i].close()

    def _call_blocking(
        self, i: int, method: str, kwargs: Mapping[str, Any], timeout_s: float | None
    ) -> Any:
        call_id = next(self._ids)
        conn = self._conns[i]
        try:
            with self._locks[i]:
                conn.send((call_id, method, dict(kwargs)))
        except OSError as exc:
            raise TransportError(f"worker {i} is gone: {exc}") from exc
        deadline = timeout_s
        waited = 0.0
        while call_id not in self._replies[i]:
            with self._locks[i]:
                if call_id in self._replies[i]:
                    break
                try:
                    ready = conn.poll(0.05)
                    if ready:
                        reply = conn.recv()
                        self._replies[i][reply[0]] = reply
                        continue
                except (EOFError, OSError) as exc:
                    self._procs[i].join(5)  # reaped: is_alive() says so from now on
                    raise TransportError(f"worker {i} died during {method}") from exc
            waited += 0.05
            if deadline is not None and waited > deadline:
                raise SyncTimeoutError(f"worker {i}: {method} exceeded {timeout_s} s")
        reply = self._replies[i].pop(call_id)
        if reply[1] == "ok":
            return reply[2]
        cls = _ERRORS.get(reply[2], TransportError)
        raise cls(f"worker {i}: {reply[2]}: {reply[3]}")

    async def call(self, i: int, method: str, /, **kwargs: Any) -> Any:
        """Call ``method(**kwargs)`` on worker ``i`` (300 s limit)."""
        return await self.call_with_timeout(i, method, kwargs, 300.0)

    async def call_with_timeout(
        self, i: int, method: str, kwargs: Mapping[str, Any], timeout_s: float | None
    ) -> Any:
        return await anyio.to_thread.run_sync(
            self._call_blocking, i, method, kwargs, timeout_s, abandon_on_cancel=True
        )

    async def view(self, indices: Sequence[int]) -> Workers:
        """The workers ``indices`` as one engine, with ranks 0..len-1 in that order."""
        for rank, i in enumerate(indices):
            await self.call(i, "test_set_rank", rank=rank)
        return Workers(self, list(indices))


class Workers:
    """A subset of a :class:`WorkerPool` as one engine (``collective_rpc``)."""

    def __init__(self, pool: WorkerPool, indices: list[int]) -> None:
        self.pool = pool
        self.indices = indices
        #: Per-rank exceptions of the last ``collective_rpc`` (for assertions).
        self.last_errors: dict[int, BaseException] = {}

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[Any]:
        assert not args, "the collective transport passes keyword arguments only"
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}

        async def one(rank: int, i: int, scope: anyio.CancelScope) -> None:
            try:
                results[rank] = await self.pool.call_with_timeout(
                    i, method, kwargs or {}, timeout_s
                )
            except Exception as exc:
                errors[rank] = exc
                if not self.pool.is_alive(i):
                    # As vLLM's executor: a dead worker fails the call at once (the
                    # others may be waiting for it in a collective).
                    scope.cancel()

        async with anyio.create_task_group() as tg:
            for rank, i in enumerate(self.indices):
                tg.start_soon(one, rank, i, tg.cancel_scope)
        self.last_errors = errors
        if errors:
            # A mismatch first (the cause is the data), then a dead worker (the others'
            # errors may be its echoes), then rank order.
            ranked = sorted(
                errors.items(),
                key=lambda kv: (
                    not isinstance(kv[1], RefitMismatchError),
                    self.pool.is_alive(self.indices[kv[0]]),
                    kv[0],
                ),
            )
            raise ranked[0][1]
        return [results[r] for r in range(len(self.indices))]


class RecordingWorkers(Workers):
    """The harness engine, recording which RPCs were made (``methods``, in order)."""

    def __init__(self, workers: Workers) -> None:
        super().__init__(workers.pool, workers.indices)
        self.methods: list[str] = []

    async def collective_rpc(self, method: str, *call: Any, **named: Any) -> list[Any]:
        self.methods.append(method)
        return await super().collective_rpc(method, *call, **named)


async def assert_bit_exact(pool: WorkerPool, indices: list[int], expected: dict[str, Any]) -> None:
    """Workers ``indices`` of ``pool`` hold exactly ``expected`` (name -> tensor): its
    names, in order, and every tensor bit for bit."""
    import torch

    for i in indices:
        got = await pool.call(i, "test_state_dict")
        assert list(got) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (i, name)
