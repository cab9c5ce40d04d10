"""Disaggregated SGLang: servers on other hosts receive the weights over a process group.

The trainer (one process: it gathers the full tensors, as for the other
transports) hosts a ``TCPStore`` and forms SGLang's weight-update group with the
servers' workers (``/init_weights_update_group``; the key layout:
:mod:`._custom_group`): the trainer is rank 0, server ``i``'s TP rank ``r`` is rank
``1 + sum(tp of servers before i) + r``. Per sync, inside every server's
weight-update session (``/begin_weight_update`` ... ``/end_weight_update``, where it
has one), each single-dtype bucket travels as one uint8 broadcast of its tensors'
bytes back to back, SGLang's ``load_format="flattened_bucket"``, while
``/update_weights_from_distributed`` with its names, dtypes and shapes is in flight
on every server; the next bucket is packed meanwhile. Then ``verify``'s read-back
through ``/get_weights_by_name`` (sampled tensors compared with what was sent, not a
per-bucket digest: SGLang checks none), ``/flush_cache`` and ``/update_weight_version``
on every server, as the colocated HTTP transport does (the two share everything but
the bytes' path: :class:`HTTPWeightSynchronizer`).

Endpoints as read in SGLang 0.5.23 (``python/sglang/srt/entrypoints/http_server.py``,
``managers/io_struct.py``, ``model_executor/model_runner.py``
``_update_bucketed_weights_from_distributed``): ``docs/sglang-contract.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any, Unpack, cast

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from aiosync._config import DEFAULT_BUCKET_BYTES
from aiosync._fanout import each_named, most_telling
from aiosync.cluster import TrainCluster
from aiosync.errors import RefitMismatchError, TransportError
from aiosync.sources import RefitSource
from aiosync.synchronizer import SharedKeywords, WeightSynchronizer

from .._options import check_positive
from .._verify import Verify
from ..http import SGLangDistributedServer
from ..http._readback import Expected
from ..http._wire import FLATTENED_BUCKET, FlatBucket, group_flat
from ..http.synchronizer import (
    HTTPWeightSynchronizer,
    _kv_bucket,
    _pack_and_keep,
    _pack_and_wait,
)
from ._custom_group import CustomGroup, join_custom_group
from ._group import open_store
from ._sglang_groups import (
    ALREADY_CREATED,
    CancellableStore,
    held_elsewhere,
    reclaim_dead_groups,
    record_formation,
    remove_record,
)
from .synchronizer import DIST_BACKENDS, DistBackend

__all__ = ["DEFAULT_GROUP_NAME", "SGLangCollectiveWeightSynchronizer"]

_log = logging.getLogger(__name__)

#: SGLang's default ``group_name`` (``InitWeightsUpdateGroupReqInput``).
DEFAULT_GROUP_NAME = "weight_update_group"


class SGLangCollectiveWeightSynchronizer(HTTPWeightSynchronizer):
    """Refits SGLang servers on other hosts: a broadcast group plus their HTTP API.

    Args:
        policy: the trainer's refit source (HF checkpoint names).
        generation: the servers: :class:`~aiosync.transports.http.SGLangDistributedServer`
            objects (an :class:`aiosync.SGLangHTTPBackend` is one), a list of
            them or an :class:`aiosync.EngineFleet`.
        train_cluster: where the group meets: ``master_addr`` must be an address
            of this host that every server can reach; ``master_port`` 0 lets
            the OS pick (the port the servers were given: :attr:`master_port`).
            One trainer rank (``world_size == 1``).
        dist_backend: ``"gloo"`` (CPU buffers) or ``"nccl"`` (buffers on the
            current CUDA device); None: nccl when CUDA is available, else gloo.
        group_name: SGLang's ``group_name``; a group formed again after a
            failure or a membership change is named ``f"{group_name}-{n}"``
            (the store keeps the keys of the earlier ones).
        inference_world_size: the servers' ranks in all (``sum`` of their TP
            sizes), checked against what they report before any rendezvous;
            None: not checked. An elastic fleet's quarantine or ``add_engine``
            sets it to what the servers then in the sync report.
        bucket_bytes: limit per bucket, bytes (two buffers of about this size).
        collective_timeout_s: limit of the group's formation and of each
            bucket's broadcast, seconds.
        abort_all_requests, timeouts, sync_timeout_s, event_backlog, in_flight,
            initial_version, trace: as :class:`~aiosync.transports.http.HTTPWeightSynchronizer`.
        verify: as :class:`~aiosync.transports.http.HTTPWeightSynchronizer` (default
            ``"sample"``): after the last bucket's broadcast loaded, before the version
            is labelled, tensors are READ BACK through each server's
            ``/get_weights_by_name`` and compared with what was broadcast (the sampled
            tensors' first rows kept from the packed buffers, or with ``True`` every
            tensor re-read from the source); not a per-bucket digest, which SGLang
            would not check. A difference raises :class:`~aiosync.RefitVerificationError`.
        record_checksums: as :class:`~aiosync.transports.http.HTTPWeightSynchronizer`
            (``verify_engine()`` then also finds a server tensor changed since the commit).

    Raises:
        TypeError: a server does not satisfy ``SGLangDistributedServer``.
        ValueError: a bad ``dist_backend``, ``bucket_bytes``, ``collective_timeout_s``
            or ``verify``; no server or the same one twice.
        NotImplementedError: ``train_cluster.world_size > 1``.
    """

    # Its capabilities are HTTPWeightSynchronizer's (verify, trace, elastic, verify_engine).

    def __init__(
        self,
        policy: RefitSource,
        generation: SGLangDistributedServer | Sequence[SGLangDistributedServer] | Any,
        *,
        train_cluster: TrainCluster | None = None,
        dist_backend: DistBackend | None = None,
        group_name: str = DEFAULT_GROUP_NAME,
        inference_world_size: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        collective_timeout_s: float = 120.0,
        abort_all_requests: bool = False,
        trace: bool = False,
        verify: Verify = "sample",
        record_checksums: bool = False,
        **shared: Unpack[SharedKeywords],
    ) -> None:
        cluster = train_cluster or TrainCluster()
        if cluster.world_size != 1:
            raise NotImplementedError(
                "SGLangCollectiveWeightSynchronizer runs on one trainer process (it "
                f"gathers the full tensors); got TrainCluster(world_size={cluster.world_size})"
            )
        if dist_backend is None:
            dist_backend = "nccl" if torch.cuda.is_available() else "gloo"
        if dist_backend not in DIST_BACKENDS:
            raise ValueError(f"dist_backend must be one of {DIST_BACKENDS}, got {dist_backend!r}")
        check_positive("collective_timeout_s", collective_timeout_s)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist_backend == "nccl" and torch.cuda.is_available()
            else torch.device("cpu")
        )
        super().__init__(
            policy,
            generation,
            bucket_bytes=bucket_bytes,
            device=device,
            abort_all_requests=abort_all_requests,
            trace=trace,
            verify=verify,
            record_checksums=record_checksums,
            **shared,
        )
        self._distributed_servers()  # refused here, before anything is set up
        self.train_cluster = cluster
        self.dist_backend: DistBackend = dist_backend
        self.inference_world_size = inference_world_size
        self.collective_timeout_s = collective_timeout_s
        self._base_group_name = group_name
        self._formations = 0
        self._store: dist.TCPStore | None = None
        self._group: CustomGroup | None = None
        # The servers that joined the current group (they leave it at re-formation
        # and shutdown), and its name there.
        self._joined: tuple[SGLangDistributedServer, ...] = ()
        self._joined_name = group_name

    @property
    def master_port(self) -> int | None:
        """The port of the group's store (known once :meth:`init_communicator` bound it)."""
        return None if self._store is None else int(self._store.port)

    @property
    def group_name(self) -> str:
        """The name of the current (or next) weight-update group on the servers."""
        return self._joined_name

    async def open(self, sync: WeightSynchronizer) -> None:
        """Everything :meth:`HTTPWeightSynchronizer.init_communicator` checks (plan,
        TP sizes, settings, manifest, config), then the group: the store bound
        (at once: a port in use fails here), every server's
        ``/init_weights_update_group`` while this process joins as rank 0.

        Raises:
            RefitMismatchError: ``inference_world_size`` differs from the servers'
                TP sizes (before any rendezvous), or a manifest/config check failed.
            TransportError, SyncTimeoutError: a server refused or the group did
                not form within ``collective_timeout_s`` (the message names the server).
        """
        await super().open(sync)
        await self._form_group()

    async def _form_group(self) -> None:
        await self._leave_group(failed=False)
        ranks = sum(self._tp_sizes)
        if self.inference_world_size is not None and self.inference_world_size != ranks:
            raise RefitMismatchError(
                f"inference_world_size={self.inference_world_size}, but the servers report "
                f"{ranks} ranks (tp_size {list(self._tp_sizes)})"
            )
        cluster = self.train_cluster
        if self._store is None:
            port = cluster.master_port
            self._store = await anyio.to_thread.run_sync(
                lambda: open_store(
                    cluster.master_addr,
                    port,
                    is_master=True,
                    timeout_s=self.collective_timeout_s,
                )
            )
        store = self._store
        name = self._base_group_name
        if self._formations:
            name = f"{name}-{self._formations}"
        self._formations += 1
        world = 1 + ranks
        offsets = [1 + sum(self._tp_sizes[:i]) for i in range(len(self._tp_sizes))]
        servers = self._distributed_servers()
        started = await reclaim_dead_groups(servers, self.timeouts.rpc_s, self._label)
        joined: list[CustomGroup] = []
        # The trainer's side of the rendezvous, ended at once when a server refuses.
        rendezvous = CancellableStore(store, self.collective_timeout_s)
        # The servers that answered: only their groups of this name are ours to destroy.
        formed: list[SGLangDistributedServer] = []

        def join() -> None:
            joined.append(
                join_custom_group(
                    rendezvous,
                    group_name=name,
                    rank=0,
                    world_size=world,
                    backend=self.dist_backend,
                    timeout_s=self.collective_timeout_s,
                )
            )

        async def init(index: int, server: SGLangDistributedServer) -> None:
            try:
                await server.init_weights_update_group(
                    master_address=cluster.master_addr,
                    master_port=int(store.port),
                    rank_offset=offsets[index],
                    world_size=world,
                    group_name=name,
                    backend=self.dist_backend,
                    timeout_s=self.collective_timeout_s + self.timeouts.rpc_s,
                )
            except TransportError as exc:
                if ALREADY_CREATED not in str(exc):
                    raise
                raise held_elsewhere(server, name, started[index]) from exc
            formed.append(server)

        self._joined_name = name
        try:
            async with anyio.create_task_group() as tg:
                # The backend's constructor blocks until every rank joined; a server
                # that refuses cancels the task group, and the rendezvous with it.
                tg.start_soon(lambda: anyio.to_thread.run_sync(join, abandon_on_cancel=True))
                tg.start_soon(lambda: each_named(servers, init, self._label))
        except BaseExceptionGroup as group:
            await self._abandon_formation(rendezvous, joined, formed)
            raise most_telling(group) from None
        except BaseException:
            await self._abandon_formation(rendezvous, joined, formed)
            raise
        self._joined = servers
        record_formation(servers, started, name, cluster.master_addr, int(store.port))
        (self._group,) = joined
        _log.info(
            "weight-update group %r formed: %d ranks (trainer + %s), store %s:%d",
            name,
            world,
            list(self._tp_sizes),
            cluster.master_addr,
            store.port,
        )

    async def _abandon_formation(
        self,
        rendezvous: CancellableStore,
        joined: list[CustomGroup],
        formed: Sequence[SGLangDistributedServer],
    ) -> None:
        """A formation failed: end this process's rendezvous now, and have the servers
        that formed the group (none when one refused: a group forms only whole) leave
        it; never a server that did not answer, whose group of this name may be
        another trainer's."""
        rendezvous.cancel()
        _close_later(joined)
        self._joined = tuple(formed)
        await self._leave_group(failed=True)

    async def _leave_group(self, *, failed: bool) -> None:
        """Every server that joined leaves the group (``/destroy_weights_update_group``,
        side by side, bounded, errors logged: a dead server cannot answer), then
        this process does (a broken group in a thread of its own: a broadcast still
        blocked in it holds the backend until its timeout)."""
        group, self._group = self._group, None
        joined, self._joined = self._joined, ()
        if group is not None and failed:
            group.broken = True
        limit = self.timeouts.after_failure_s if failed else self.timeouts.rpc_s

        async def destroy(index: int, server: SGLangDistributedServer) -> None:
            try:
                with anyio.fail_after(limit):
                    await server.destroy_weights_update_group(self._joined_name, timeout_s=limit)
                # Gone from the server: no later trainer is to reclaim it.
                remove_record(server.base_url, self._joined_name, pid=os.getpid())
            except Exception as exc:
                # Labelled by URL: after a quarantine ``self.servers`` no longer holds it.
                where = f"SGLang server {index} of the old group ({server.base_url})"
                _log.warning("%s: /destroy_weights_update_group: %r", where, exc)

        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for index, server in enumerate(joined):
                    tg.start_soon(destroy, index, server)
            if group is not None and not group.broken:
                # No broadcast in flight: closed now, so that no thread of it outlives the
                # synchronizer (one still inside gloo at interpreter exit aborts the process).
                await anyio.to_thread.run_sync(group.close)
        if group is not None and group.broken:
            _close_later([group])

    def _refit_bracket(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Not colocated: nothing of the trainer to offload; the servers' weights are
        woken before any byte (their KV cache is ``prepare_for_generation()``'s)."""
        return self._wake_weights_first()

    @contextlib.asynccontextmanager
    async def _wake_weights_first(self) -> AsyncIterator[None]:
        with anyio.fail_after(self.timeouts.rpc_s):
            await self._wake_engines("weights", self.servers)
        yield

    async def _send_buckets(
        self,
        kv: Sequence[tuple[str, float]] = (),
        trace: list[dict[str, Any]] | None = None,
        kept: list[Expected] | None = None,
    ) -> int:
        """Broadcast every bucket (then the KV-scale one, if ``kv``) while each server's
        ``/update_weights_from_distributed`` for it is in flight; returns the payload
        bytes. ``kept``: gets ``verify="sample"``'s tensors of each bucket as packed,
        before it travels. The next bucket is packed while one travels (two buffers per dtype),
        and sent while the servers load the one before. Any
        failure or cancellation leaves the group broken (formed again by the
        next sync), so that no half-received broadcast is ever matched with
        another bucket's."""
        if self._group is None or self._group.broken:
            await self._form_group()
        group = self._group
        assert group is not None
        for server in self.servers:
            server.note_weights_loading()
        send, receive = anyio.create_memory_object_stream[tuple[FlatBucket, torch.Tensor]](0)
        device = self.device or torch.device("cpu")
        # Two buffers per dtype, reused: the producer fills one while the other travels.
        spare: dict[torch.dtype, list[torch.Tensor]] = {}

        def buffer(bucket: FlatBucket) -> torch.Tensor:
            free = spare.setdefault(bucket.dtype, [])
            # By position: list.remove would compare tensors elementwise (and raise
            # for two of different sizes).
            fits = next((i for i, b in enumerate(free) if b.numel() >= bucket.numel), None)
            if fits is None:
                flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
            else:
                flat = free.pop(fits)
            return flat[: bucket.numel]

        async def produce() -> None:
            async with send:
                groups = group_flat(self.policy.iter_weights(), self._plan, self._trainer_manifest)
                while True:
                    item = await anyio.to_thread.run_sync(next, groups, None)
                    if item is None:
                        break
                    bucket, tensors = item
                    flat = buffer(bucket)
                    await anyio.to_thread.run_sync(
                        _pack_and_keep, bucket, tensors, flat, None, kept, self._read_qkv
                    )
                    del tensors
                    await send.send((bucket, flat))
                if kv:
                    bucket, tensors = _kv_bucket(len(self._plan), kv)
                    flat = buffer(bucket)
                    _pack_and_wait(bucket, tensors, flat)
                    await send.send((bucket, flat))

        nbytes = 0
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                # Bucket k+1's requests and broadcast start as soon as bucket k's bytes
                # are out (the servers take requests in order, so k+1's receive waits
                # for k's load there), overlapping the round trip and k's load; bucket
                # k+1 waits for k's answers before k+2 starts: two in flight at most.
                answered: anyio.Event | None = None
                async with receive:
                    async for bucket, flat in receive:
                        done = anyio.Event()
                        tg.start_soon(self._post_bucket_requests, group, bucket, done)
                        await self._broadcast(group, bucket, flat)
                        # The broadcast returned on the source: the buffer may be refilled.
                        spare.setdefault(bucket.dtype, []).append(flat)
                        nbytes += bucket.nbytes
                        if answered is not None:
                            await answered.wait()
                        answered = done
        except BaseExceptionGroup as exc_group:
            group.broken = True
            raise most_telling(exc_group) from None
        except BaseException:
            group.broken = True
            raise
        return nbytes

    async def _post_bucket_requests(
        self, group: CustomGroup, bucket: FlatBucket, done: anyio.Event
    ) -> None:
        """Every server's ``/update_weights_from_distributed`` for ``bucket``; sets
        ``done`` once all of them answered (a failure raises into the sync's task group)."""
        names = [slot.name for slot in bucket.slots]
        dtype = str(bucket.dtype).removeprefix("torch.")
        shapes = [list(slot.shape) for slot in bucket.slots]
        first = bucket.index == 0

        async def post(index: int, server: SGLangDistributedServer) -> None:
            await server.update_weights_from_distributed(
                names,
                [dtype] * len(names),
                shapes,
                group_name=group.group_name,
                load_format=FLATTENED_BUCKET,
                flush_cache=False,
                abort_all_requests=self.abort_all_requests and first,
            )

        # The group's members, checked when it formed (no per-bucket re-check).
        await each_named(self._joined, post, self._label)
        done.set()

    async def _broadcast(self, group: CustomGroup, bucket: FlatBucket, flat: torch.Tensor) -> None:
        """``bucket``'s bytes from this process (rank 0) to every server rank, in a
        worker thread (abandoned on cancellation: the group is broken then)."""
        raw = flat.view(torch.uint8)
        what = f"broadcast of bucket {bucket.index} ({bucket.nbytes} bytes)"
        await anyio.to_thread.run_sync(
            lambda: group.broadcast(raw, what=what), abandon_on_cancel=True
        )

    def _distributed_servers(self) -> tuple[SGLangDistributedServer, ...]:
        """The servers now in the sync, each checked to receive over a process group
        (at construction and at every formation: an elastic fleet's newcomer too).

        Raises:
            TypeError: one is not an ``SGLangDistributedServer`` (named).
        """
        servers = self.servers
        for i, server in enumerate(servers):
            if not isinstance(server, SGLangDistributedServer):
                raise TypeError(
                    f"server {i} ({type(server).__name__}) cannot receive over a process "
                    "group: it lacks init_weights_update_group / update_weights_from_distributed "
                    "/ destroy_weights_update_group (SGLangDistributedServer)"
                )
        return cast(tuple[SGLangDistributedServer, ...], servers)

    async def rejoin(self, sync: WeightSynchronizer) -> None:
        # The survivors (or the newcomers) form a new group: ranks contiguous again,
        # and the fleet's rank count is what its servers now report.
        await self._leave_group(failed=True)
        self.inference_world_size = None
        await super().rejoin(sync)
        self.inference_world_size = sum(self._tp_sizes)

    async def close(self, sync: WeightSynchronizer) -> None:
        """Every server leaves the group, this process too, the store is closed; then
        :meth:`HTTPWeightSynchronizer.shutdown`. Idempotent."""
        await self._leave_group(failed=False)
        self._store = None
        await super().close(sync)

    def __repr__(self) -> str:
        info: dict[str, Any] = {
            "urls": [server.base_url for server in self.servers],
            "group": self._joined_name,
            "backend": self.dist_backend,
            "buckets": len(self._plan),
            "weight_version": self.weight_version,
        }
        return f"SGLangCollectiveWeightSynchronizer({info})"


def _close_later(groups: Sequence[CustomGroup]) -> None:
    """Close ``groups`` in a daemon thread: closing waits for a broadcast still
    blocked in the backend (until its timeout), which must not block the loop."""

    def close() -> None:
        for group in groups:
            group.close()

    if groups:
        threading.Thread(target=close, name="aiosync-group-close", daemon=True).start()
