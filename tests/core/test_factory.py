"""create_weight_synchronizer: every cell of the topology x backend matrix, and its errors."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

import aiosync
from aiosync import TrainCluster, create_weight_synchronizer
from tests._support.builders import factory_pick


@pytest.mark.parametrize(
    ("backend", "colocated", "class_name"),
    [
        ("vllm", False, "CollectiveWeightSynchronizer"),
        ("vllm", True, "IPCWeightSynchronizer"),
        ("embedded", False, "CollectiveWeightSynchronizer"),
        ("embedded", True, "IPCWeightSynchronizer"),
        ("sglang", True, "HTTPWeightSynchronizer"),
        ("sglang", False, "SGLangCollectiveWeightSynchronizer"),
    ],
)
def test_factory_picks_transport(source, engine, backend, colocated, class_name):
    extra = {} if colocated else {"train_cluster": TrainCluster(), "inference_world_size": 2}
    if backend == "sglang":
        from aiosync.engines.sglang.backend import SGLangHTTPBackend

        engine = SGLangHTTPBackend("http://127.0.0.1:9")  # constructing connects to nothing
    sync = create_weight_synchronizer(
        source,
        engine,
        colocated=colocated,
        backend=backend,
        in_flight="keep",
        initial_version=12,
        **extra,
    )
    assert type(sync) is getattr(aiosync, class_name)
    assert isinstance(sync, aiosync.WeightSynchronizer)
    # Every transport's constructor takes the resumed step and the in-flight policy
    # to the base class.
    assert (sync.policy_version, sync.weight_version) == (12, 12)
    assert sync.in_flight == "keep"


def test_non_colocated_sglang_refuses_the_shard_aware_transfer(source):
    from aiosync.engines.sglang.backend import SGLangHTTPBackend

    with pytest.raises(ValueError, match="SGLang servers receive SGLang's own broadcast"):
        create_weight_synchronizer(
            source,
            SGLangHTTPBackend("http://127.0.0.1:9"),
            colocated=False,
            backend="sglang",
            train_cluster=TrainCluster(),
            inference_world_size=1,
            sharded=True,
        )


@pytest.mark.parametrize(
    ("kwargs", "missing"),
    [
        ({}, "train_cluster and inference_world_size"),
        ({"train_cluster": TrainCluster()}, "needs inference_world_size"),
        ({"inference_world_size": 2}, "needs train_cluster"),
    ],
)
def test_non_colocated_requires_cluster_and_world_size(source, engine, kwargs, missing):
    with pytest.raises(ValueError, match=missing):
        create_weight_synchronizer(source, engine, colocated=False, backend="vllm", **kwargs)


class _AdapterSource(aiosync.LoRAAdapterSource):
    """A LoRAAdapterSource as the factory sees it: ``lora_adapter_config()`` decides."""

    def prepare_refit_info(self):
        return {}

    def iter_weights(self):
        return iter(())

    def lora_adapter_config(self):
        return {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


class _LoRAEngine:
    """An engine that serves adapter-only refits (it has ``load_lora_adapter``)."""

    async def load_lora_adapter(self, adapter):
        return None

    async def prepare_for_generation(self, tags=None):
        return None

    async def finish_generation(self):
        return None


@pytest.mark.parametrize("colocated", [True, False])
@pytest.mark.parametrize("backend", aiosync.KNOWN_BACKENDS)
def test_factory_picks_the_adapter_transport_for_a_lora_adapter_source(backend, colocated):
    source = _AdapterSource()
    assert isinstance(source, aiosync.LoRAAdapterSource)
    # Every backend and topology; no train_cluster or inference_world_size needed.
    sync = create_weight_synchronizer(
        source, _LoRAEngine(), colocated=colocated, backend=backend, in_flight="abort"
    )
    assert type(sync) is aiosync.LoRAAdapterSynchronizer
    assert sync.in_flight == "abort"
    assert (sync.policy_version, sync.weight_version) == (0, 0)


def test_factory_makes_a_fleet_of_lora_engines_and_refuses_an_engine_without_lora(engine):
    engines = [_LoRAEngine(), _LoRAEngine()]
    sync = create_weight_synchronizer(_AdapterSource(), engines, colocated=True, backend="vllm")
    assert isinstance(sync.generation, aiosync.EngineFleet)
    assert sync.generation.engines == engines
    without = r"engine 1 of 2 \(RecordingEngine\) has no load_lora_adapter"
    with pytest.raises(TypeError, match=without):
        create_weight_synchronizer(
            _AdapterSource(), [_LoRAEngine(), engine], colocated=True, backend="vllm"
        )


def test_colocated_must_be_a_bool(source, engine):
    with pytest.raises(TypeError, match="colocated must be a bool"):
        create_weight_synchronizer(source, engine, colocated="no", backend="vllm")  # type: ignore[arg-type]


def test_unknown_backend_lists_known_ones(source, engine):
    with pytest.raises(ValueError, match="known backends: vllm, sglang, embedded"):
        create_weight_synchronizer(source, engine, colocated=True, backend="trtllm")


def test_import_aiosync_and_dir_stay_free_of_heavy_modules():
    code = (
        "import sys, aiosync\n"
        "names = dir(aiosync)\n"
        "assert {'IPCWeightSynchronizer', 'EmbeddedEngine', 'refit', 'engines'} <= set(names)\n"
        "heavy = sorted(set(sys.modules) & {'torch', 'zmq', 'httpx', 'jax', 'transformers', "
        "'numpy', "
        "'aiosync.transports', 'aiosync.refit', 'aiosync.engines'})\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == ""


def test_subpackages_are_attributes_without_an_explicit_import():
    code = (
        "import aiosync\n"
        "print(aiosync.refit.DTensorRefitSource.__module__, aiosync.engines.__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.split() == ["aiosync.refit.torch_source", "aiosync.engines"]


def test_public_api_is_exported():
    for name in aiosync.__all__:
        if name not in aiosync._LAZY:
            assert hasattr(aiosync, name), name


@pytest.mark.parametrize("dist_backend", ["gloo", "nccl"])
def test_factory_builds_a_collective_on_the_chosen_dist_backend(source, engine, dist_backend):
    # Building an NCCL collective needs no GPU: only forming its group does.
    sync = factory_pick(source, engine, world_size=2, dist_backend=dist_backend)
    assert type(sync) is aiosync.CollectiveWeightSynchronizer
    assert sync.dist_backend == dist_backend
    assert sync.device.type == ("cuda" if dist_backend == "nccl" else "cpu")


def _vllm_collective(source: Any, engine: Any, **options: Any) -> Any:
    """The factory's pick for one vLLM engine in other processes (one inference rank)."""
    return create_weight_synchronizer(
        source,
        engine,
        colocated=False,
        backend="vllm",
        train_cluster=TrainCluster(),
        inference_world_size=1,
        **options,
    )


def test_factory_rejects_an_unknown_dist_backend_before_building_anything(source, engine):
    with pytest.raises(ValueError, match=r"unknown dist_backend 'mpi'; known: nccl, gloo"):
        _vllm_collective(source, engine, dist_backend="mpi")
    # backend= is the engine kind: "gloo" there is an unknown engine, and says which are known.
    with pytest.raises(ValueError, match="known backends: vllm, sglang, embedded"):
        create_weight_synchronizer(source, engine, colocated=False, backend="gloo")


def test_factory_passes_timeouts_and_the_older_keywords_to_the_transport(source, engine):
    sync = _vllm_collective(
        source,
        engine,
        dist_backend="gloo",
        timeouts=aiosync.Timeouts(sync_s=40.0, rpc_s=5.0),
        rpc_timeout_s=3.0,
        collective_timeout_s=9.0,
        verify=True,
        overlap="staged",
        bucket_bytes=4096,
    )
    assert sync.timeouts == aiosync.Timeouts(sync_s=40.0, rpc_s=3.0, collective_s=9.0)
    assert (sync.sync_timeout_s, sync.rpc_timeout_s, sync.collective_timeout_s) == (40, 3, 9)
    assert (sync.verify, sync.overlap, sync.bucket_bytes) == (True, "staged", 4096)


def test_factory_refuses_a_keyword_the_chosen_transport_does_not_take(source, engine):
    # dist_backend belongs to the non-colocated collective, not to the colocated IPC transport.
    with pytest.raises(TypeError, match=r"IPCWeightSynchronizer .* takes no dist_backend"):
        create_weight_synchronizer(
            source, engine, colocated=True, backend="vllm", dist_backend="gloo"
        )


@pytest.mark.parametrize(
    ("tensor_parallel_size", "options", "class_name"),
    [
        (2, {}, "ShardedWeightSynchronizer"),  # the engine holds slices: each byte once
        (1, {}, "CollectiveWeightSynchronizer"),  # whole copies: the broadcast
        (2, {"verify": True}, "CollectiveWeightSynchronizer"),  # a broadcast-only option
        (2, {"delta": True}, "ShardedWeightSynchronizer"),  # delta refits on the plan too
        (2, {"sharded": False}, "CollectiveWeightSynchronizer"),
        (1, {"sharded": True}, "ShardedWeightSynchronizer"),
    ],
)
def test_factory_picks_the_shard_aware_transfer_for_engines_that_hold_slices(
    source, tensor_parallel_size, options, class_name
):
    from aiosync.engines.embedded.configs import TINY_QWEN3

    # Constructing the engine starts no process.
    engine = aiosync.EmbeddedEngine(TINY_QWEN3, tensor_parallel_size=tensor_parallel_size)
    sync = factory_pick(source, engine, **options)
    assert type(sync) is getattr(aiosync, class_name)


def test_sharded_is_refused_for_a_colocated_engine(source, engine):
    with pytest.raises(ValueError, match="sharded=True is a non-colocated transport"):
        create_weight_synchronizer(source, engine, colocated=True, backend="vllm", sharded=True)


@pytest.mark.parametrize(
    ("sizes", "class_name"),
    [
        ((1, 2), "ShardedWeightSynchronizer"),  # one member holds slices
        ((1, 1), "CollectiveWeightSynchronizer"),  # whole copies everywhere
    ],
)
def test_factory_asks_every_member_of_a_fleet_whether_it_holds_slices(source, sizes, class_name):
    from aiosync.engines.embedded.configs import TINY_QWEN3

    engines = [aiosync.EmbeddedEngine(TINY_QWEN3, tensor_parallel_size=n) for n in sizes]
    sync = create_weight_synchronizer(
        source,
        engines,
        colocated=False,
        backend="embedded",
        train_cluster=TrainCluster(),
        inference_world_size=sum(e.world_size for e in engines),
    )
    assert type(sync) is getattr(aiosync, class_name)


def test_a_fleet_member_without_a_layout_keeps_the_broadcast(source, engine):
    from aiosync.engines.embedded.configs import TINY_QWEN3

    sliced = aiosync.EmbeddedEngine(TINY_QWEN3, tensor_parallel_size=2)
    sync = create_weight_synchronizer(
        source,
        [sliced, engine],
        colocated=False,
        backend="embedded",
        train_cluster=TrainCluster(),
        inference_world_size=3,
    )
    assert type(sync) is aiosync.CollectiveWeightSynchronizer


def test_a_trainer_rank_without_the_engine_must_say_sharded_or_not(source):
    # Rank 1 of a sharded trainer passes no engine: a guess could differ from rank 0's.
    cluster = TrainCluster(world_size=2, rank=1, master_port=29777)
    with pytest.raises(ValueError, match="pass sharded=True or False, the same on every rank"):
        create_weight_synchronizer(
            source, None, colocated=False, backend="embedded",
            train_cluster=cluster, inference_world_size=2,
        )  # fmt: skip
    sync = create_weight_synchronizer(
        source, None, colocated=False, backend="embedded",
        train_cluster=cluster, inference_world_size=2, sharded=False,
    )  # fmt: skip
    assert type(sync) is aiosync.CollectiveWeightSynchronizer


class _RefusingEngine:
    """Reports TP=2 but, from its config, no layout (as a quantized vLLM engine)."""

    tensor_parallel_size = 2
    layout_refusal = "the model is quantized ('fp8')"

    async def weight_layouts(self) -> list[Any]:
        raise AssertionError("the factory never asks the workers")

    async def collective_rpc(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []


def test_an_engine_that_cannot_report_its_layout_keeps_the_broadcast(source):
    sync = create_weight_synchronizer(
        source,
        _RefusingEngine(),
        colocated=False,
        backend="vllm",
        train_cluster=TrainCluster(),
        inference_world_size=2,
    )
    assert type(sync) is aiosync.CollectiveWeightSynchronizer
