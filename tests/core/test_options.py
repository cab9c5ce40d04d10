"""Options as typed objects: the factory's signature, the choice by options class, the
refusals, and every constructor keyword reachable through the objects."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import warnings
from collections.abc import Iterator

import pytest

import aiosync
from aiosync import (
    CollectiveOptions,
    HTTPOptions,
    IPCOptions,
    ShardedOptions,
    SyncOptions,
    Timeouts,
    TrainCluster,
    UnsupportedOptionError,
    create_weight_synchronizer,
)
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.options import TRANSPORT_OPTIONS
from aiosync.synchronizer import SharedKeywords

#: Constructor keywords reached otherwise than by a field of the transport's options
#: class or of SyncOptions: the topology, the Timeouts object and its fields, and a
#: deprecated alias.
_REACHED_OTHERWISE = {
    "train_cluster",
    "inference_world_size",
    "timeouts",
    "sync_timeout_s",
    "rpc_timeout_s",
    "collective_timeout_s",
    "backend",  # CollectiveWeightSynchronizer's deprecated name of dist_backend
}


@contextlib.contextmanager
def _new_path() -> Iterator[None]:
    """Within it, a DeprecationWarning (the old keywords' path) is an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        yield


def test_the_factory_takes_at_most_eight_keywords() -> None:
    params = inspect.signature(create_weight_synchronizer).parameters.values()
    keywords = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keywords == [
        "colocated",
        "backend",
        "train_cluster",
        "inference_world_size",
        "transport",
        "sync",
        "timeouts",
    ]


@pytest.mark.parametrize("options", TRANSPORT_OPTIONS, ids=lambda c: c.__name__)
def test_every_constructor_keyword_is_reachable_through_the_options(
    options: type[aiosync.TransportOptions],
) -> None:
    module, name = options.transport
    cls = getattr(importlib.import_module(module), name)
    params = list(inspect.signature(cls).parameters.values())[2:]  # after source, engine
    # ``**shared``: the keywords every transport passes on to WeightSynchronizer.
    (var,) = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    assert var.annotation == "Unpack[SharedKeywords]"
    takes = {p.name for p in params if p is not var} | set(SharedKeywords.__annotations__)
    own = {f.name for f in dataclasses.fields(options)}
    shared = {f.name for f in dataclasses.fields(SyncOptions)}
    assert own <= takes, f"{options.__name__} fields {own - takes} are not {name}'s keywords"
    assert takes - own - shared - _REACHED_OTHERWISE == set()
    # A shared option the transport declares is one of its keywords.
    caps = cls.capabilities
    declared = {"in_flight", "initial_version", "event_backlog", "on_failure"}
    declared |= {n for n in ("delta", "trace") if getattr(caps, n)}
    declared |= {"verify"} if caps.verify != {False} else set()
    assert declared <= takes


def test_an_options_class_chooses_its_transport_over_the_automatic_choice(source) -> None:
    engine = aiosync.EmbeddedEngine(TINY_QWEN3, tensor_parallel_size=2)
    topology = {"train_cluster": TrainCluster(), "inference_world_size": 2}
    with _new_path():
        # Left alone, an engine holding slices gets the shard-aware transfer.
        auto = create_weight_synchronizer(source, engine, colocated=False, **topology)
        chosen = create_weight_synchronizer(
            source,
            engine,
            colocated=False,
            transport=CollectiveOptions(overlap="staged", bucket_bytes=8192),
            sync=SyncOptions(verify="sample", initial_version=3),
            timeouts=Timeouts(rpc_s=7.0, collective_s=11.0),
            **topology,
        )
    assert type(auto) is aiosync.ShardedWeightSynchronizer
    assert type(chosen) is aiosync.CollectiveWeightSynchronizer
    assert (chosen.overlap, chosen.bucket_bytes, chosen.verify) == ("staged", 8192, "sample")
    assert (chosen.weight_version, chosen.rpc_timeout_s, chosen.collective_timeout_s) == (3, 7, 11)


def test_a_shared_option_the_chosen_transport_cannot_honour_is_refused_never_a_switch(
    source,
) -> None:
    engine = aiosync.EmbeddedEngine(TINY_QWEN3, tensor_parallel_size=2)
    with pytest.raises(UnsupportedOptionError) as refused:
        create_weight_synchronizer(
            source,
            engine,
            colocated=False,
            train_cluster=TrainCluster(),
            inference_world_size=2,
            sync=SyncOptions(verify=True),
        )
    assert str(refused.value) == (
        "ShardedWeightSynchronizer does not honour verify=True (it honours False) "
        "(transport=CollectiveOptions() is the rank-0 broadcast, which does)"
    )
    assert isinstance(refused.value, TypeError)  # as a keyword a callee does not take


def test_http_refuses_a_delta_refit(source) -> None:
    from aiosync.engines.sglang.backend import SGLangHTTPBackend

    server = SGLangHTTPBackend("http://127.0.0.1:9")  # constructing connects to nothing
    with pytest.raises(UnsupportedOptionError, match=r"^HTTPWeightSynchronizer .* delta=True$"):
        create_weight_synchronizer(source, server, colocated=True, sync=SyncOptions(delta=True))


def test_the_engine_kind_is_read_from_the_engine(source) -> None:
    from aiosync.engines.sglang.backend import SGLangHTTPBackend

    with _new_path():
        ipc = create_weight_synchronizer(
            source,
            aiosync.EmbeddedEngine(TINY_QWEN3),
            colocated=True,
            transport=IPCOptions(bucket_bytes=4096),
        )
        http = create_weight_synchronizer(
            source, SGLangHTTPBackend("http://127.0.0.1:9"), colocated=True
        )
    assert (type(ipc), ipc.bucket_bytes) == (aiosync.IPCWeightSynchronizer, 4096)
    assert type(http) is aiosync.HTTPWeightSynchronizer


def test_an_engine_that_does_not_say_its_kind_needs_backend(source, engine) -> None:
    with pytest.raises(ValueError, match=r"does not say which kind it is.*pass backend="):
        create_weight_synchronizer(source, engine, colocated=True)
    sync = create_weight_synchronizer(source, engine, colocated=True, backend="vllm")
    assert type(sync) is aiosync.IPCWeightSynchronizer


def test_a_backend_that_contradicts_the_engine_is_refused(source) -> None:
    with pytest.raises(ValueError, match="backend='sglang', but the engine says it is embedded"):
        create_weight_synchronizer(
            source, aiosync.EmbeddedEngine(TINY_QWEN3), colocated=True, backend="sglang"
        )


@pytest.mark.parametrize(
    ("transport", "colocated", "message"),
    [
        (IPCOptions(), False, "IPCOptions is a colocated transport; this is colocated=False"),
        (
            ShardedOptions(),
            True,
            "ShardedOptions is a non-colocated transport; this is colocated=True",
        ),
        (HTTPOptions(), True, "HTTPOptions drives sglang engines; this engine is 'embedded'"),
    ],
)
def test_a_transport_for_another_topology_or_engine_is_refused(
    source, transport, colocated, message
) -> None:
    topology = {} if colocated else {"train_cluster": TrainCluster(), "inference_world_size": 1}
    with pytest.raises(ValueError, match=f"^{message}$"):
        create_weight_synchronizer(
            source,
            aiosync.EmbeddedEngine(TINY_QWEN3),
            colocated=colocated,
            transport=transport,
            **topology,
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"verify": "all"}, "verify must be True, False or 'sample', got 'all'"),
        ({"in_flight": "drop"}, "in_flight must be one of abort, wait, keep, got 'drop'"),
        ({"initial_version": -1}, "initial_version must be an int >= 0, got -1"),
    ],
)
def test_sync_options_refuse_bad_values_when_built(fields, message) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        SyncOptions(**fields)


def test_the_old_keywords_still_work_with_a_deprecation_warning(source, engine) -> None:
    with pytest.warns(DeprecationWarning, match=r"create_weight_synchronizer\(bucket_bytes="):
        sync = create_weight_synchronizer(
            source, engine, colocated=True, backend="vllm", bucket_bytes=2048
        )
    assert sync.bucket_bytes == 2048
    with pytest.raises(TypeError, match="unexpected keyword argument 'bucket_size'"):
        create_weight_synchronizer(source, engine, colocated=True, backend="vllm", bucket_size=1)


def test_an_option_turned_off_where_the_transport_has_none_is_accepted(source) -> None:
    engine = aiosync.EmbeddedEngine(TINY_QWEN3, tensor_parallel_size=2)
    sync = create_weight_synchronizer(
        source,
        engine,
        colocated=False,
        train_cluster=TrainCluster(),
        inference_world_size=2,
        transport=ShardedOptions(),
        sync=SyncOptions(verify=False, trace=False, delta=True),
    )
    assert type(sync) is aiosync.ShardedWeightSynchronizer
    assert sync.delta_baseline is not None
