"""The collective transport's small pieces, without processes: KV-scale names,
the sync header and trailer, option checks."""

from __future__ import annotations

import pytest
import torch

from aiosync import Timeouts, TrainCluster, TransportError
from aiosync.transports.collective import CollectiveWeightSynchronizer, kv_scale_entries
from aiosync.transports.collective._wire import (
    decode_trailer,
    encode_trailer,
    header_tensor,
    trailer_nbytes,
    validate_header,
)
from aiosync.transports.packing import plan_buckets

MANIFEST = {
    "model.embed_tokens.weight": ((8, 4), torch.bfloat16),
    "model.norm.weight": ((4,), torch.float32),
}


def test_kv_scale_entries_name_both_scales_of_a_layer_index() -> None:
    assert kv_scale_entries({2: 0.5, "model.layers.0.self_attn.v_scale": 2.0}) == [
        ("model.layers.2.self_attn.k_scale", 0.5),
        ("model.layers.2.self_attn.v_scale", 0.5),
        ("model.layers.0.self_attn.v_scale", 2.0),
    ]
    assert kv_scale_entries(None) == []


@pytest.mark.parametrize(
    ("scales", "match"),
    [
        ({"model.layers.0.k_scale": 1.0}, "neither a layer index"),
        ({0: 1.0, "model.layers.0.self_attn.k_scale": 2.0}, "twice"),
    ],
)
def test_kv_scale_entries_reject_bad_keys(scales: dict[str | int, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kv_scale_entries(scales)


def test_header_names_the_first_differing_field() -> None:
    plan = plan_buckets(MANIFEST, 64)
    header = header_tensor(3, plan, 2, True)
    validate_header(header.clone(), 3, plan, 2, True)
    with pytest.raises(TransportError, match="version: source sent 3, expected 4"):
        validate_header(header, 4, plan, 2, True)
    other = plan_buckets(MANIFEST, 1024)
    with pytest.raises(TransportError, match="num_buckets"):
        validate_header(header, 3, other, 2, True)
    with pytest.raises(TransportError, match="delivered no data"):
        validate_header(torch.zeros_like(header), 3, plan, 2, True)


@pytest.mark.parametrize("scales", [[0.5, 0.25], [0.5, 0.25, 0.125]], ids=["even", "odd"])
def test_trailer_round_trips_scales_and_checksums(scales: list[float]) -> None:
    # An odd number of float32 scales puts the int64 digests 4 bytes off an 8-byte
    # boundary: they must decode all the same.
    raw = encode_trailer(scales, [2**61 - 2, -7])
    assert raw.numel() == trailer_nbytes(len(scales), 2, verify=True) == 4 * len(scales) + 16
    kv, checksums = decode_trailer(raw, len(scales), 2)
    assert torch.equal(kv, torch.tensor(scales))
    assert checksums == [2**61 - 2, -7]
    assert trailer_nbytes(0, 5, verify=False) == 0


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"inference_world_size": 0}, ValueError),
        ({"dist_backend": "mpi"}, ValueError),
        ({"overlap": "eventually"}, ValueError),
        ({"bucket_bytes": 0}, ValueError),
        ({"collective_timeout_s": 0}, ValueError),
        ({"train_cluster": ("127.0.0.1", 1)}, TypeError),
    ],
)
def test_bad_options_are_rejected_at_construction(
    options: dict[str, object], error: type[Exception]
) -> None:
    kwargs: dict[str, object] = {"train_cluster": TrainCluster(), "inference_world_size": 1}
    kwargs.update(options)
    with pytest.raises(error):
        CollectiveWeightSynchronizer(None, None, **kwargs)  # type: ignore[arg-type]


def test_default_backend_and_bucket_size_on_cpu() -> None:
    sync = CollectiveWeightSynchronizer(
        None,  # type: ignore[arg-type]
        None,
        train_cluster=TrainCluster(),
        inference_world_size=1,
    )
    assert (sync.dist_backend, sync.bucket_bytes, sync.world_size) == ("gloo", 512 * 1024**2, 2)


def test_backend_is_the_deprecated_name_of_dist_backend() -> None:
    with pytest.warns(DeprecationWarning, match="now dist_backend"):
        sync = CollectiveWeightSynchronizer(
            None,  # type: ignore[arg-type]
            None,
            train_cluster=TrainCluster(),
            inference_world_size=1,
            backend="gloo",
        )
    assert (sync.dist_backend, sync.backend) == ("gloo", "gloo")


def test_limits_come_from_timeouts_and_the_older_keywords_override_them() -> None:
    def build(**limits: object) -> CollectiveWeightSynchronizer:
        return CollectiveWeightSynchronizer(
            None,  # type: ignore[arg-type]
            None,
            train_cluster=TrainCluster(),
            inference_world_size=1,
            **limits,  # type: ignore[arg-type]
        )

    sync = build(timeouts=Timeouts(sync_s=50.0, rpc_s=7.0))
    # The collective's own limit defaults to the per-step one.
    assert (sync.sync_timeout_s, sync.rpc_timeout_s, sync.collective_timeout_s) == (50, 7, 7)
    sync = build(
        timeouts=Timeouts(rpc_s=7.0),
        rpc_timeout_s=3.0,
        collective_timeout_s=9.0,
        sync_timeout_s=20.0,
    )
    assert (sync.sync_timeout_s, sync.rpc_timeout_s, sync.collective_timeout_s) == (20, 3, 9)
    assert sync.timeouts == Timeouts(sync_s=20.0, rpc_s=3.0)
    with pytest.raises(ValueError, match="rpc_s"):
        build(rpc_timeout_s=0.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
async def test_an_nccl_synchronizer_builds_without_a_gpu_and_its_init_says_why_it_cannot_form() -> (
    None
):
    sync = CollectiveWeightSynchronizer(
        None,  # type: ignore[arg-type]
        None,
        train_cluster=TrainCluster(),
        inference_world_size=2,
        dist_backend="nccl",
    )
    assert (sync.dist_backend, sync.device.type, sync.world_size) == ("nccl", "cuda", 3)
    with pytest.raises(TransportError, match="dist_backend='nccl' needs a CUDA build"):
        await sync.init_communicator()
    assert sync.master_port is None  # refused before the store was bound
    await sync.shutdown()
