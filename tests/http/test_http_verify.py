"""``verify`` on the HTTP transports: a read-back through SGLang's ``/get_weights_by_name``.

Both synchronizers that drive SGLang's HTTP API, against one real test-server process
(TP=1): :class:`HTTPWeightSynchronizer` (colocated, ``/update_weights_from_tensor``)
and :class:`SGLangCollectiveWeightSynchronizer` (a real gloo group on loopback,
``/update_weights_from_distributed``). A test fault armed in the server
(``/_aiosync/arm_transit_fault``) flips one byte of one bucket as TP rank 0 receives
it, before the load: the corruption really reaches the server's weights, and only
the read-back can tell.

The tiny Qwen3 has ``head_dim`` 32, not ``hidden_size // num_attention_heads`` (16),
so SGLang's ``get_weights_by_name`` would misplace k and v: q/k/v_proj are not read
back, and the faults land in other tensors.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aiosync import (
    RefitVerificationError,
    SGLangCollectiveWeightSynchronizer,
    SGLangHTTPBackend,
    SyncError,
    TrainCluster,
)
from aiosync.transports.http import HTTPWeightSynchronizer
from aiosync.transports.http._readback import SAMPLE_READS, Expected, choose_reads
from aiosync.transports.http._wire import FlatBucket, FlatSlot
from tests._support.steps import resync

from .conftest import PROMPTS, TestServer, _serve

pytestmark = pytest.mark.slow

# Several buckets of the tiny model (~0.4 MB in bf16).
BUCKET_BYTES = 48 * 1024
QKV = re.compile(r"\.[qkv]_proj\.")
KINDS = ("http", "distributed")


@pytest.fixture(scope="module")
def verify_server(server_workdir: Path, dense_config: Path) -> Iterator[TestServer]:
    """One TP=1 server for both transports; gloo on loopback (the server inherits it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GLOO_SOCKET_IFNAME", "lo")
        yield from _serve(server_workdir, dense_config)


@pytest.fixture
def server(verify_server: TestServer) -> Iterator[TestServer]:
    verify_server.reset()
    yield verify_server
    verify_server.reset()


def _synchronizer(kind: str, trainer: Any, backend: SGLangHTTPBackend, **options: Any) -> Any:
    if kind == "http":
        return HTTPWeightSynchronizer(trainer, backend, bucket_bytes=BUCKET_BYTES, **options)
    return SGLangCollectiveWeightSynchronizer(
        trainer,
        backend,
        train_cluster=TrainCluster(master_addr="127.0.0.1"),
        dist_backend="gloo",
        bucket_bytes=BUCKET_BYTES,
        collective_timeout_s=60.0,
        **options,
    )


@contextlib.asynccontextmanager
async def _driving(
    kind: str,
    server: TestServer,
    trainer: Any,
    backend_type: type[SGLangHTTPBackend] = SGLangHTTPBackend,
    synced: bool = False,
    **options: Any,
) -> AsyncIterator[tuple[SGLangHTTPBackend, Any]]:
    """A backend of ``server`` and an initialized synchronizer of ``kind`` over it; with
    ``synced``, after its first sync (version 1)."""
    async with (
        backend_type(server.url) as backend,
        _synchronizer(kind, trainer, backend, **options) as sync,
    ):
        if synced:
            await resync(sync)
        yield backend, sync


def _first_checked(plan: tuple[FlatBucket, ...]) -> tuple[FlatBucket, FlatSlot]:
    """A bucket after the first, and its first tensor that is read back."""
    for bucket in plan[1:]:
        for slot in bucket.slots:
            if not QKV.search(slot.name):
                return bucket, slot
    raise AssertionError("no bucket after the first has a tensor that is read back")


def _largest_checked(plan: tuple[FlatBucket, ...]) -> tuple[FlatBucket, FlatSlot]:
    """The largest tensor that is read back, and its bucket."""
    return max(
        ((b, s) for b in plan for s in b.slots if not QKV.search(s.name)),
        key=lambda item: item[1].end - item[1].start,
    )


def _arm(server: TestServer, bucket: int, byte: int) -> None:
    body = {"bucket": bucket, "byte": byte}
    server.admin.post("/_aiosync/arm_transit_fault", json=body).raise_for_status()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _corrupted(sent: torch.Tensor, byte: int) -> torch.Tensor:
    """``sent`` with byte ``byte`` (of its own bytes) flipped, as the fault does."""
    out = sent.clone()
    raw = _bytes(out)
    raw[byte] = raw[byte] ^ 0xFF
    return out


def _read_backs(server: TestServer) -> list[tuple[str, int]]:
    return [
        (e["name"], e["truncate_size"]) for e in server.log() if e["path"] == "/get_weights_by_name"
    ]


@pytest.mark.parametrize("kind", KINDS)
async def test_default_sample_catches_a_flipped_first_byte_and_the_next_sync_heals(
    kind: str, server: TestServer, make_trainer: Any, state_equal: Any
) -> None:
    trainer = make_trainer(seed=41)
    async with _driving(kind, server, trainer) as (backend, sync):
        assert sync.verify == "sample"
        await resync(sync)
        bucket, slot = _first_checked(sync.plan)
        itemsize = bucket.dtype.itemsize
        # The tensor's first byte, in the bucket's bytes: always sampled.
        _arm(server, bucket.index, slot.start * itemsize)
        trainer.step(seed=1)
        await sync.mark_stale()
        with pytest.raises(RefitVerificationError) as caught:
            await sync.sync_weights()
        sent = trainer.expected()[slot.name]
        held = server.state_dict()[slot.name]
        # The cause: the fault reached the server's weights, at that one byte.
        assert torch.equal(held, _corrupted(sent, 0))
        first = (0,) * len(slot.shape)
        message = str(caught.value)
        assert server.url in message and repr(slot.name) in message
        assert f"(bucket {bucket.index})" in message and "verify='sample'" in message
        assert (
            f"element {list(first)} is {float(held[first])!r} on the server, "
            f"{float(sent[first])!r} in what the trainer sent"
        ) in message
        assert sync.weight_version == 1 and sync.is_stale
        assert await backend.get_weight_version() == "1"  # not labelled
        with pytest.raises(SyncError, match="holds no valid weights"):
            await backend.generate(PROMPTS, max_new_tokens=2)

        server.reset()
        await sync.sync_weights()  # no fault armed: heals
        assert sync.weight_version == 2 and not sync.is_stale
        state_equal(server.state_dict(), trainer.expected())
        assert await backend.get_weight_version() == "2"
        assert len(await backend.generate(PROMPTS, max_new_tokens=2)) == len(PROMPTS)
        # "sample" read back tensors among the first and last of every bucket (q/k/v_proj
        # left out), their first rows (1024 elements' worth or all of them): at most
        # SAMPLE_READS, the plan's first and last always (answers come in any order).
        candidates = []
        for b in sync.plan:
            names = [s for s in b.slots if not QKV.search(s.name)]
            for s in names[:1] + names[-1:] if len(names) > 1 else names:
                per_row = math.prod(s.shape[1:])
                candidates.append((s.name, min(s.shape[0], math.ceil(1024 / per_row))))
        reads = _read_backs(server)
        assert len(reads) == len(set(reads)) == min(len(candidates), SAMPLE_READS)
        assert set(reads) <= set(candidates)
        assert {candidates[0], candidates[-1]} <= set(reads)


@pytest.mark.parametrize("kind", KINDS)
async def test_verify_true_catches_a_flipped_byte_in_the_middle_of_a_tensor(
    kind: str, server: TestServer, make_trainer: Any
) -> None:
    trainer = make_trainer(seed=42)
    async with _driving(kind, server, trainer, verify=True, synced=True) as (_backend, sync):
        # Every tensor read back whole (truncate_size = numel), in the source's order;
        # never q/k/v_proj.
        assert _read_backs(server) == [
            (name, tensor.numel())
            for name, tensor in trainer.expected().items()
            if not QKV.search(name)
        ]
        bucket, slot = _largest_checked(sync.plan)
        itemsize = bucket.dtype.itemsize
        numel = slot.end - slot.start
        # An element in the middle, past any sampled rows, its high byte.
        element = numel // 2 + 3
        trainer.step(seed=2)
        await sync.mark_stale()
        server.reset()
        _arm(server, bucket.index, (slot.start + element) * itemsize + 1)
        with pytest.raises(RefitVerificationError) as caught:
            await sync.sync_weights()
        index = [int(i) for i in torch.unravel_index(torch.tensor(element), slot.shape)]
        message = str(caught.value)
        assert repr(slot.name) in message and f"element {index} is " in message
        assert "verify='full'" in message and server.url in message
        assert sync.weight_version == 1 and sync.is_stale
        # The check stopped at that tensor, read whole.
        assert _read_backs(server)[-1] == (slot.name, numel)


@pytest.mark.parametrize("kind", KINDS)
async def test_verify_true_names_every_tensor_it_did_not_compare_in_the_committed_event(
    kind: str, server: TestServer, make_trainer: Any
) -> None:
    """C33: a server that never applied ``q_proj`` (one byte of it flipped on arrival)
    commits, since SGLang's read-back cannot return q/k/v of a model whose ``head_dim``
    is not ``hidden_size // num_attention_heads``; but never silently: the COMMITTED
    event names exactly the tensors the check did not compare, and why."""
    trainer = make_trainer(seed=44)
    async with _driving(kind, server, trainer, verify=True) as (_backend, sync):
        target = next(
            (b, s) for b in sync.plan for s in b.slots if s.name.endswith("q_proj.weight")
        )
        _arm(server, target[0].index, target[1].start * target[0].dtype.itemsize + 1)
        async with sync.subscribe() as events:
            await resync(sync)
            committed = [e async for e in _until_committed(events)][-1]
        skipped = [name for name in trainer.expected() if QKV.search(name)]
        assert [entry.split(":", 1)[0] for entry in committed.unverified] == skipped
        assert all("hidden_size // num_attention_heads" in entry for entry in committed.unverified)
        assert server.state_dict()[target[1].name].ne(trainer.expected()[target[1].name]).any()


async def _until_committed(events: Any) -> AsyncIterator[Any]:
    async for event in events:
        yield event
        if event.kind.value == "committed":
            return


@pytest.mark.parametrize("kind", KINDS)
async def test_verify_false_commits_the_corruption_silently(
    kind: str, server: TestServer, make_trainer: Any
) -> None:
    trainer = make_trainer(seed=43)
    async with _driving(kind, server, trainer, verify=False, synced=True) as (backend, sync):
        bucket, slot = _first_checked(sync.plan)
        _arm(server, bucket.index, slot.start * bucket.dtype.itemsize)
        trainer.step(seed=3)
        await resync(sync)
        assert sync.weight_version == 2 and not sync.is_stale
        assert await backend.get_weight_version() == "2"
        sent = trainer.expected()[slot.name]
        held = server.state_dict()[slot.name]
        # The server computes with a weight the trainer never sent: exactly one byte.
        differing = (_bytes(held) != _bytes(sent)).nonzero().flatten().tolist()
        assert differing == [0]
        assert int(_bytes(held)[0]) == int(_bytes(sent)[0]) ^ 0xFF
        assert _read_backs(server) == []


class _Blind(SGLangHTTPBackend):
    """A server object that cannot read weights back (no ``SGLangWeightReader``)."""

    get_weights_by_name = None  # type: ignore[assignment]


async def test_a_server_object_without_read_back_is_logged_and_not_checked(
    server: TestServer, make_trainer: Any, state_equal: Any, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = make_trainer(seed=44)
    async with _driving("http", server, trainer, backend_type=_Blind) as (_backend, sync):
        await sync.mark_stale()
        with caplog.at_level(logging.WARNING):
            await sync.sync_weights()
    assert sync.weight_version == 1
    state_equal(server.state_dict(), trainer.expected())
    assert "_Blind cannot read weights back" in caplog.text and server.url in caplog.text
    assert _read_backs(server) == []


def test_the_sample_reads_a_fixed_number_per_sync_and_every_bucket_in_turn() -> None:
    kept = [Expected(f"t{i}", i, torch.zeros(1)) for i in range(40)]
    seen: set[str] = set()
    for version in range(1, 40):
        names = [e.name for e in choose_reads(kept, version)]
        assert len(names) == SAMPLE_READS and names == sorted(names, key=lambda n: int(n[1:]))
        assert names[0] == "t0" and names[-1] == "t39"
        seen |= set(names)
    assert seen == {e.name for e in kept}
    assert choose_reads(kept[:5], 3) == kept[:5]


# -- verify_engine(): the live weights, moving none (C34) ----------------------------------

LIVE = "model.layers.1.mlp.down_proj.weight"


def _corrupt(server: TestServer, name: str, index: int) -> None:
    """One element of a live weight written behind the transport's back (+1.0)."""
    body = {"name": name, "index": index}
    server.admin.post("/_aiosync/corrupt", json=body).raise_for_status()


@pytest.mark.parametrize("kind", KINDS)
async def test_verify_engine_names_a_live_tensor_changed_after_the_sync_and_the_next_sync_heals(
    kind: str, server: TestServer, make_trainer: Any, state_equal: Any
) -> None:
    """C34: the read-back of every tensor SGLang can return, against the trainer's source;
    q/k/v_proj (not readable on this model) are named as not compared, not passed."""
    trainer = make_trainer(seed=47)
    async with _driving(kind, server, trainer, verify=False, synced=True) as (_backend, sync):
        names = list(trainer.expected())
        skipped = [name for name in names if QKV.search(name)]
        report = await sync.verify_engine()
        assert report == {
            "workers": 1,
            "tensors": len(names) - len(skipped),
            "unverified": len(skipped),
            "checksummed": 0,
            "version": 1,
        }
        assert [entry.split(":", 1)[0] for entry in sync.live_unverified] == skipped
        _corrupt(server, LIVE, 17)
        with pytest.raises(
            RefitVerificationError,
            match=rf"'{LIVE}' .* is not what the trainer sent: element \[0, 17\]",
        ) as info:
            await sync.verify_engine()
        assert "verify_engine()" in str(info.value) and server.url in str(info.value)
        assert (sync.weight_version, sync.is_stale) == (1, True)
        await resync(sync)
        state_equal(server.state_dict(), trainer.expected())
        assert (await sync.verify_engine())["version"] == 2


@pytest.mark.parametrize("kind", KINDS)
async def test_verify_engine_with_recorded_checksums_finds_a_qkv_tensor_changed_since_the_commit(
    kind: str, server: TestServer, make_trainer: Any
) -> None:
    """C34: ``record_checksums=True`` keeps every server tensor's ``/weights_checker``
    checksum at each commit; a later change of a tensor no read-back can return (q_proj
    of a model whose head_dim is not hidden_size // num_attention_heads) is named."""
    trainer = make_trainer(seed=48)
    target = next(name for name in trainer.expected() if QKV.search(name))
    async with _driving(
        kind, server, trainer, verify=False, record_checksums=True, synced=True
    ) as (_b, sync):
        report = await sync.verify_engine()
        answer = server.admin.post("/weights_checker", json={"action": "checksum"}).json()
        assert (
            report["checksummed"]
            == len(answer["ranks"][0]["checksums"])
            > len(trainer.expected()) // 2
        )
        assert report["version"] == 1
        # Each unverified tensor is still named, with what covered it instead.
        assert all("unchanged since the commit of version 1" in e for e in sync.live_unverified)
        _corrupt(server, target, 5)
        with pytest.raises(
            RefitVerificationError,
            match=rf"{re.escape(target)} \(TP rank 0\) changed since the commit of version 1",
        ):
            await sync.verify_engine()
        assert sync.is_stale
        await resync(sync)
        assert (await sync.verify_engine())["version"] == 2
    checks = [e for e in server.log() if e["path"] == "/weights_checker"]
    assert checks and all(e["status"] in (200, 400) for e in checks)


async def test_verify_engine_refuses_to_pass_when_it_can_compare_nothing(
    server: TestServer, make_trainer: Any
) -> None:
    """A server object that can neither read back nor checksum: verify_engine() says it
    checked nothing instead of passing."""
    trainer = make_trainer(seed=49)
    async with _driving(
        "http", server, trainer, backend_type=_Blind, verify=False, synced=True
    ) as (_b, sync):
        with pytest.raises(SyncError, match="compared nothing"):
            await sync.verify_engine()
        assert not sync.is_stale
