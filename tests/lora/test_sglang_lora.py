"""Adapter-only refits into SGLang: ``SGLangHTTPBackend`` against the SGLang-contract test
server (a real process on 127.0.0.1 with ``--enable-lora``), SGLang's own endpoints
(``/load_lora_adapter``, ``/unload_lora_adapter``, ``/generate``'s ``lora_path``).

The server applies the adapter with PEFT to its fp32 model; its greedy output
must equal that of ``copy.deepcopy(peft_model).merge_and_unload()``, token for token.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import lora_harness
import pytest
from lora_harness import NEW_TOKENS, PROMPTS, LoRATrainer, base_generate, lora_server

from aiosync import (
    LoRAAdapterSynchronizer,
    RefitMismatchError,
    SGLangHTTPBackend,
    SyncError,
    TransportError,
    VersionEventKind,
    create_weight_synchronizer,
)
from aiosync.transports._leftovers import SHM_DIR
from tests._support.steps import first_sync

pytestmark = pytest.mark.asyncio(loop_scope="function")

MAX_LORA_RANK = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An fp32 server on the engines' seed with ``--enable-lora --max-lora-rank 8``."""
    folder = tmp_path_factory.mktemp("lora-server")
    yield from lora_server(folder, "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK))


@pytest.fixture
def fresh(server: Any) -> Iterator[Any]:
    """The server with its faults and log cleared and no adapter loaded."""
    for name in server.admin.get("/_aiosync/lora_adapters").json():
        server.admin.post("/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
    server.reset()
    yield server


@contextlib.asynccontextmanager
async def _adapter_sync(
    server: Any, trainer: LoRATrainer
) -> AsyncIterator[tuple[SGLangHTTPBackend, LoRAAdapterSynchronizer]]:
    """A backend of ``server``, and a LoRA synchronizer of ``trainer``'s adapter into it."""
    async with (
        SGLangHTTPBackend(server.url) as backend,
        LoRAAdapterSynchronizer(trainer.source, backend) as sync,
    ):
        yield backend, sync


@pytest.fixture(scope="module")
def base_outputs() -> list[list[int]]:
    return base_generate()


def _adapters(server: Any) -> dict[str, str]:
    response = server.admin.get("/_aiosync/lora_adapters")
    response.raise_for_status()
    return dict(response.json())


def _lora_calls(server: Any) -> list[tuple[str, Any, Any]]:
    """The server's LoRA requests, in order: ``(path, lora_name, status)``."""
    return [
        (e["path"], e.get("lora_name"), e["status"])
        for e in server.log()
        if e["path"] in ("/load_lora_adapter", "/unload_lora_adapter")
    ]


def _our_shm_dirs() -> list[str]:
    prefix = f"aiosync-lora-{os.getpid()}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


async def test_sync_loads_the_adapter_and_generate_applies_it(
    fresh: Any, trainer: LoRATrainer, base_outputs: list[list[int]]
) -> None:
    async with (
        SGLangHTTPBackend(fresh.url) as backend,
        create_weight_synchronizer(
            trainer.source, backend, colocated=True, backend="sglang"
        ) as sync,
    ):
        assert type(sync) is LoRAAdapterSynchronizer
        await sync.init_communicator()
        async with sync.subscribe() as events:
            await sync.mark_stale()
            await sync.sync_weights()
            got = [await events.__anext__() for _ in range(3)]
        assert [(e.kind, e.version, e.nbytes) for e in got] == [
            (VersionEventKind.STALE, 1, 0),
            (VersionEventKind.SYNC_STARTED, 1, 0),
            (VersionEventKind.COMMITTED, 1, lora_harness.ADAPTER_NBYTES),
        ]
        assert (sync.weight_version, sync.is_stale) == (1, False)
        assert backend.lora_adapter == "aiosync-v1"

        outputs = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert outputs == trainer.merged_generate()
        assert outputs != base_outputs
        # /generate named the adapter; the base model (no lora_path) is untouched.
        generates = [e for e in fresh.log() if e["path"] == "/generate"]
        assert [e.get("lora_path") for e in generates] == ["aiosync-v1"]
        assert [out for out, _ in fresh.generate(PROMPTS, NEW_TOKENS)] == base_outputs
        # The adapter folder in /dev/shm was read during the load and is gone.
        (path,) = _adapters(fresh).values()
        assert Path(path).parent == Path(SHM_DIR)
        assert not Path(path).exists() and _our_shm_dirs() == []
        assert _lora_calls(fresh) == [("/load_lora_adapter", "aiosync-v1", 200)]


async def test_a_second_sync_loads_the_new_adapter_then_unloads_the_old(
    fresh: Any, trainer: LoRATrainer
) -> None:
    async with _adapter_sync(fresh, trainer) as (backend, sync):
        await first_sync(sync)
        first = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        async with sync.policy_update():
            trainer.step(seed=3)
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert backend.lora_adapter == "aiosync-v2"
        second = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert second == trainer.merged_generate()
        assert second != first
        assert list(_adapters(fresh)) == ["aiosync-v2"]
        assert _lora_calls(fresh) == [
            ("/load_lora_adapter", "aiosync-v1", 200),
            ("/load_lora_adapter", "aiosync-v2", 200),
            ("/unload_lora_adapter", "aiosync-v1", 200),
        ]


async def test_a_failed_load_keeps_the_version_and_the_backend_refuses_until_a_sync_lands(
    fresh: Any, trainer: LoRATrainer
) -> None:
    async with _adapter_sync(fresh, trainer) as (backend, sync):
        await first_sync(sync)
        trainer.step(seed=5)
        await sync.mark_stale()
        fresh.fault("/load_lora_adapter", "error", count=1)
        with pytest.raises(TransportError, match="HTTP 500: injected fault on /load_lora_adapter"):
            await sync.sync_weights()
        assert (sync.weight_version, sync.policy_version, sync.is_stale) == (1, 2, True)
        # Version 1 is still on the server, but the backend serves neither it nor half of 2.
        assert list(_adapters(fresh)) == ["aiosync-v1"]
        with pytest.raises(SyncError, match="'aiosync-v2' did not complete"):
            await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert backend.lora_adapter is None
        assert _our_shm_dirs() == []  # removed on the failure path too

        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)
        assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == (
            trainer.merged_generate()
        )
        assert list(_adapters(fresh)) == ["aiosync-v2"]
        assert _lora_calls(fresh) == [
            ("/load_lora_adapter", "aiosync-v1", 200),
            ("/load_lora_adapter", "aiosync-v2", 500),
            # The failed load may have landed: the retry clears the name first.
            ("/unload_lora_adapter", "aiosync-v2", 400),
            ("/load_lora_adapter", "aiosync-v2", 200),
            ("/unload_lora_adapter", "aiosync-v1", 200),
        ]


async def test_kv_scales_are_refused_before_any_request(fresh: Any, trainer: LoRATrainer) -> None:
    async with _adapter_sync(fresh, trainer) as (_backend, sync):
        await sync.init_communicator()
        await sync.mark_stale()
        fresh.reset()
        with pytest.raises(NotImplementedError, match="KV-cache scales"):
            await sync.sync_weights(kv_scales={0: 1.0, 1: 1.0})
        assert fresh.log() == []
        assert (sync.weight_version, sync.is_stale) == (0, True)


async def test_the_server_refuses_unknown_and_duplicate_adapter_names_as_sglang_does(
    fresh: Any, trainer: LoRATrainer, tmp_path: Path
) -> None:
    async with _adapter_sync(fresh, trainer) as (_backend, sync):
        await first_sync(sync)
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}, "lora_path": "x"}
    answer = fresh.admin.post("/generate", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["message"].startswith(
        "The following requested LoRA adapters are not loaded: {'x'}"
    )
    answer = fresh.admin.post("/unload_lora_adapter", json={"lora_name": "x"})
    assert answer.status_code == 400
    assert answer.json() == {
        "success": False,
        "error_message": "LoRA with name x does not exist. Loaded LoRAs: dict_keys(['aiosync-v1'])",
        "loaded_adapters": _adapters(fresh),
    }
    again = {"lora_name": "aiosync-v1", "lora_path": str(tmp_path), "pinned": False}
    answer = fresh.admin.post("/load_lora_adapter", json=again)
    assert (answer.status_code, answer.json()["error_message"]) == (
        400,
        "Failed to load LoRA adapter aiosync-v1 because it is already loaded",
    )


async def test_init_checks_the_servers_lora_settings_and_shapes_before_any_load(
    fresh: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    too_wide = LoRATrainer(r=2 * MAX_LORA_RANK)
    too_high = r"rank 16 exceeds the SGLang server's --max-lora-rank 8"
    async with SGLangHTTPBackend(fresh.url) as backend:
        with pytest.raises(ValueError, match=too_high):
            async with LoRAAdapterSynchronizer(too_wide.source, backend):
                pytest.fail("an adapter above --max-lora-rank was accepted")
    narrow = LoRATrainer(config={**lora_harness.CONFIG, "intermediate_size": 96})
    async with SGLangHTTPBackend(fresh.url) as backend:
        with pytest.raises(RefitMismatchError, match=r"mlp\.gate_proj\.weight: the engine's model"):
            async with LoRAAdapterSynchronizer(narrow.source, backend):
                pytest.fail("an adapter for another model was accepted")
    assert _lora_calls(fresh) == []

    for plain in lora_server(tmp_path_factory.mktemp("plain-server")):  # no --enable-lora
        async with SGLangHTTPBackend(plain.url) as backend:
            with pytest.raises(ValueError, match="runs without --enable-lora"):
                async with LoRAAdapterSynchronizer(LoRATrainer().source, backend):
                    pytest.fail("a server without --enable-lora was accepted")
        answer = plain.admin.post(
            "/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nonexistent"}
        )
        assert answer.status_code == 400
        assert answer.json()["error_message"] == (
            "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        )
