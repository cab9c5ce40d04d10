"""The send and receive loops' trace hook (``benchmarks/collective.py --trace``): per-bucket
timestamps on both sides of a real gloo group on 127.0.0.1 (two threads of this process)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from aiosync.transports.collective._group import SyncGroup, create_sync_group, open_store
from aiosync.transports.collective._loops import RotatingBuffers, receive_buckets, send_buckets
from aiosync.transports.packing import plan_buckets, unpack

#: Three buckets of 4096 bytes: two tensors each.
MANIFEST = {f"w{i}": ((512,), torch.float32) for i in range(6)}


def _pair() -> tuple[SyncGroup, SyncGroup]:
    server = open_store("127.0.0.1", 0, is_master=True, timeout_s=30)
    groups: dict[int, SyncGroup] = {}

    def join(rank: int) -> None:
        store = (
            server
            if rank == 0
            else open_store("127.0.0.1", server.port, is_master=False, timeout_s=30)
        )
        groups[rank] = create_sync_group(
            store=store,
            rank=rank,
            world_size=2,
            train_world_size=1,
            backend="gloo",
            device=torch.device("cpu"),
            timeout_s=30,
            session="trace",
        )

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return groups[0], groups[1]


def test_every_bucket_is_traced_in_order_on_both_sides() -> None:
    plan = plan_buckets(MANIFEST, 4096)
    assert len(plan.buckets) == 3
    gen = torch.Generator().manual_seed(0)
    source = {name: torch.randn(512, generator=gen) for name in MANIFEST}
    sender, receiver = _pair()
    sent: list[tuple[str, int, float]] = []
    got: list[tuple[str, int, float]] = []
    landed: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def load(bucket: Any, buf: torch.Tensor) -> None:
        landed.update((name, view.clone()) for name, view in unpack(buf, bucket))

    def send() -> None:
        try:
            send_buckets(
                sender,
                plan,
                RotatingBuffers(plan, torch.device("cpu")),
                iter(source.items()),
                version=1,
                kv=[],
                verify=True,
                trace=lambda e, i: sent.append((e, i, time.perf_counter())),
            )
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        receive_buckets(
            receiver,
            plan,
            RotatingBuffers(plan, torch.device("cpu")),
            version=1,
            n_kv=0,
            verify=True,
            on_bucket=load,
            trace=lambda e, i: got.append((e, i, time.perf_counter())),
        )
    finally:
        thread.join(60)
        sender.destroy()
        receiver.destroy()
    assert errors == []
    assert list(landed) == list(source)
    assert all(torch.equal(landed[n], t) for n, t in source.items())
    for events, order in (
        (sent, ("gathered", "packed", "broadcasting", "sent")),
        (got, ("posted", "received", "loaded")),
    ):
        assert sorted((e, i) for e, i, _ in events) == sorted(
            (e, k) for k in range(3) for e in order
        )
        # Each side's stamps of one bucket are taken in this order by one thread.
        at = {(e, i): t for e, i, t in events}
        for k in range(3):
            times = [at[(e, k)] for e in order]
            assert times == sorted(times), (k, events)
    # One clock for both sides: the source stamps "broadcasting" before it hands
    # bucket k to the collective, so the receiver cannot have it earlier. (The
    # source's "sent" and the receiver's stamps are not ordered: either side may
    # see the broadcast complete first.)
    broadcasting = {i: t for e, i, t in sent if e == "broadcasting"}
    received = {i: t for e, i, t in got if e == "received"}
    assert all(received[k] >= broadcasting[k] for k in range(3))
