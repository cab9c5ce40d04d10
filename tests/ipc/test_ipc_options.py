"""IPCWeightSynchronizer options: validated before anything is opened; buffer sizing."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aiosync.errors import SyncError
from aiosync.factory import create_weight_synchronizer
from aiosync.transports.ipc import IPCWeightSynchronizer, default_bucket_bytes

MiB = 1024**2


class _Source:
    def prepare_refit_info(self) -> dict[str, Any]:
        return {"w": ((4,), torch.float32)}

    def iter_weights(self) -> Any:
        yield "w", torch.zeros(4)

    def offload_before_refit(self) -> None: ...

    def offload_after_refit(self) -> None: ...


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"bucket_bytes": 0}, "bucket_bytes"),
        ({"buffer_memory_fraction": 0.0}, "buffer_memory_fraction"),
        ({"buffer_memory_fraction": 1.5}, "buffer_memory_fraction"),
        ({"rpc_timeout_s": 0}, "rpc_timeout_s"),
    ],
)
def test_bad_options_raise_value_error(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        IPCWeightSynchronizer(_Source(), object(), **options)


def test_default_bucket_is_a_fraction_of_free_memory_within_bounds() -> None:
    cpu = torch.device("cpu")
    assert default_bucket_bytes(cpu, 1e-12) == 16 * MiB
    assert 16 * MiB <= default_bucket_bytes(cpu) <= 5 * 1024 * MiB
    assert default_bucket_bytes(cpu, 1.0) <= 5 * 1024 * MiB


def test_default_bucket_cuts_a_refit_into_pipelined_buckets() -> None:
    cpu = torch.device("cpu")
    # 64 MiB of bf16 in 16 tensors of 4 MiB: 8 buckets of 8 MiB.
    manifest = {f"w{i}": ((2 * MiB,), torch.bfloat16) for i in range(16)}
    assert default_bucket_bytes(cpu, 1.0, manifest) == 8 * MiB
    # Never below 4 MiB, never below the largest tensor, never above the memory share.
    assert default_bucket_bytes(cpu, 1.0, {"w": ((MiB,), torch.float32)}) == 4 * MiB
    big = {"a": ((5 * MiB,), torch.float32), "b": ((MiB,), torch.float32)}
    assert default_bucket_bytes(cpu, 1.0, big) == 20 * MiB
    assert default_bucket_bytes(cpu, 1e-12, manifest) == 8 * MiB
    huge = {"w": ((1 << 40,), torch.float32)}
    assert default_bucket_bytes(cpu, 1e-12, huge) == 16 * MiB


def test_factory_picks_ipc_for_colocated_embedded_and_vllm() -> None:
    for backend in ("embedded", "vllm"):
        sync = create_weight_synchronizer(
            _Source(), object(), colocated=True, backend=backend, bucket_bytes=MiB
        )
        assert type(sync) is IPCWeightSynchronizer
        assert sync.bucket_bytes == MiB


async def test_sync_before_init_is_refused() -> None:
    sync = IPCWeightSynchronizer(_Source(), object(), bucket_bytes=MiB)
    await sync.mark_stale()
    with pytest.raises(SyncError, match="init_communicator"):
        await sync.sync_weights()
    await sync.shutdown()
