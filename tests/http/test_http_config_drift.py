"""Model config drift that keeps the shapes, over HTTP: a server started from a
config whose ``rope_theta`` differs from the trainer's loads the trainer's tensors
(same names, shapes, dtypes) and generates other tokens, so ``init_communicator()``
compares the trainer's HF config with the one the server's ``model_path`` holds
(``SGLangHTTPBackend.expected_config``) and refuses before any weight update."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aiosync import EngineFleet, RefitMismatchError, SGLangHTTPBackend, SyncError
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.transports.http import HTTPWeightSynchronizer
from tests._support.modules import load_module

# The test-server handle of this directory's conftest (pytest's importlib mode keeps
# conftest modules off the import path); module-scoped servers are started with it.
_servers = load_module(Path(__file__).parent / "conftest.py", "http_test_servers")
TestServer = _servers.TestServer

pytestmark = pytest.mark.slow

BUCKET_BYTES = 64 * 1024
#: TINY_QWEN3 with another RoPE base (transformers' Qwen3 default is 10000.0).
DRIFTED: dict[str, Any] = {**TINY_QWEN3, "rope_theta": 500000.0}


@pytest.fixture(scope="module")
def drifted_server(server_workdir: Path) -> Iterator[TestServer]:
    """A server whose ``model_path`` config has ``rope_theta`` 500000.0."""
    path = server_workdir / "drifted-config.json"
    path.write_text(json.dumps(DRIFTED))
    yield from _servers._serve(server_workdir, path)


@pytest.fixture(scope="module")
def dense_server(server_workdir: Path, dense_config: Path) -> Iterator[TestServer]:
    """A server on the trainer's own config (TINY_QWEN3)."""
    yield from _servers._serve(server_workdir, dense_config)


def weight_updates(server: TestServer) -> list[str]:
    """The requests that reached the server other than ``/get_server_info``."""
    return [e["path"] for e in server.log() if e["path"] != "/get_server_info"]


async def test_a_server_with_another_rope_theta_is_refused_before_any_weight_update(
    drifted_server: TestServer, make_trainer: Any
) -> None:
    drifted_server.reset()
    before = drifted_server.state_dict()
    source = make_trainer(seed=61).inner  # DTensorRefitSource: it knows its HF config
    async with SGLangHTTPBackend(drifted_server.url) as backend:
        sync = HTTPWeightSynchronizer(source, backend, bucket_bytes=BUCKET_BYTES)
        with pytest.raises(RefitMismatchError) as caught:
            await sync.init_communicator()
        await sync.mark_stale()
        with pytest.raises(SyncError, match="init_communicator"):
            await sync.sync_weights()
        assert sync.weight_version == 0
    message = str(caught.value)
    assert "in 1 field(s)" in message
    assert "rope_parameters.rope_theta: trainer 10000.0, engine 500000.0" in message
    assert weight_updates(drifted_server) == []
    after = drifted_server.state_dict()
    assert all((after[name] == tensor).all() for name, tensor in before.items())


@pytest.mark.parametrize(
    ("server_name", "config", "engine_field", "engine_value"),
    [
        # The server's config is read from its model_path, as the trainer's from its model.
        pytest.param("drifted_server", DRIFTED, "rope_theta", 500000.0, id="same-config"),
        # Same computation: the KV-cache switch and the position limit are no drift.
        pytest.param(
            "dense_server",
            {**TINY_QWEN3, "use_cache": False, "max_position_embeddings": 64},
            "use_cache",
            True,
            id="fields-that-may-differ",
        ),
    ],
)
async def test_configs_that_agree_pass_and_sync(
    request: pytest.FixtureRequest,
    make_trainer: Any,
    state_equal: Any,
    server_name: str,
    config: dict[str, Any],
    engine_field: str,
    engine_value: object,
) -> None:
    server: TestServer = request.getfixturevalue(server_name)
    server.reset()
    trainer = make_trainer(seed=62, config=config)
    async with SGLangHTTPBackend(server.url) as backend:
        engine = await backend.expected_config()
        assert engine is not None
        value = (
            engine.rope_parameters["rope_theta"]
            if engine_field == "rope_theta"
            else getattr(engine, engine_field)
        )
        assert value == engine_value
        async with HTTPWeightSynchronizer(
            trainer.inner, backend, bucket_bytes=BUCKET_BYTES
        ) as sync:
            await sync.mark_stale()
            await sync.sync_weights()
            assert sync.weight_version == 1
    state_equal(server.state_dict(), trainer.expected())


async def test_a_fleet_names_the_drifted_server_and_updates_neither(
    dense_server: TestServer, drifted_server: TestServer, make_trainer: Any
) -> None:
    for server in (dense_server, drifted_server):
        server.reset()
    source = make_trainer(seed=64).inner
    async with (
        SGLangHTTPBackend(dense_server.url) as first,
        SGLangHTTPBackend(drifted_server.url) as second,
    ):
        sync = HTTPWeightSynchronizer(
            source, EngineFleet([first, second]), bucket_bytes=BUCKET_BYTES
        )
        with pytest.raises(
            RefitMismatchError,
            match=r"^engine 1 of 2 \(SGLangHTTPBackend\): .*"
            r"rope_parameters\.rope_theta: trainer 10000\.0, "
            r"engine 500000\.0",
        ):
            await sync.init_communicator()
    assert weight_updates(dense_server) == []
    assert weight_updates(drifted_server) == []


async def test_a_given_hf_config_is_what_the_trainer_is_compared_with(
    dense_server: TestServer, make_trainer: Any
) -> None:
    dense_server.reset()
    source = make_trainer(seed=65).inner
    # hf_config= replaces the server's model_path for the manifest and the config alike.
    async with SGLangHTTPBackend(dense_server.url, hf_config=DRIFTED) as backend:
        sync = HTTPWeightSynchronizer(source, backend, bucket_bytes=BUCKET_BYTES)
        with pytest.raises(RefitMismatchError, match=r"trainer 10000\.0, engine 500000\.0"):
            await sync.init_communicator()
    assert weight_updates(dense_server) == []
