"""An SGLang server restarted on the same URL between syncs (C38): it holds fresh weights
under SGLang's ``"default"`` label and another ``startup_time``. The backend notices (at
``refit_if_stale`` and in every ``/generate`` answer) and tells the synchronizer as it
tells any discard: stale, and the next ``refit_if_stale`` syncs."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aiosync import SyncError, refit_if_stale
from tests.http.conftest import TestServer, http_sync

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Restartable:
    """A test server on a fixed loopback port that can be stopped and started again there."""

    def __init__(self, workdir: Path, config: Path) -> None:
        self.workdir, self.config, self.port = workdir, config, _free_port()
        self.server = self._start()

    def _start(self) -> TestServer:
        return TestServer(self.workdir, self.config, "--port", str(self.port))

    def restart(self) -> None:
        self.server.close()
        self.server = self._start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)


@pytest.fixture(scope="module")
def restartable(server_workdir: Path, dense_config: Path) -> Iterator[Restartable]:
    served = Restartable(server_workdir, dense_config)
    try:
        yield served
    finally:
        served.server.close()


async def test_a_server_restarted_between_syncs_makes_the_synchronizer_stale_and_refit_heals(
    restartable: Restartable, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    trainer = make_trainer(seed=141)
    url = restartable.url
    async with http_sync(url, trainer) as (backend, sync):
        assert await refit_if_stale(sync, backend) is False  # a live server: nothing to do

        restartable.restart()
        assert restartable.url == url
        # The same URL answers, with the server's own (seeded) weights and label.
        assert restartable.generate(prompts, 1)[0][1] == "default"
        assert (sync.policy_version, sync.weight_version) == (1, 1)

        assert await refit_if_stale(sync, backend) is True
        assert (sync.weight_version, sync.is_stale) == (1, False)
        assert await backend.get_weight_version() == "1"
        state_equal(restartable.state_dict(), trainer.expected())
        assert await backend.generate(prompts, max_new_tokens=3) == trainer.reference_generate(
            prompts, 3
        )
        await sync.shutdown()


async def test_a_generate_answered_by_a_restarted_server_is_refused_and_turns_the_sync_stale(
    restartable: Restartable, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    trainer = make_trainer(seed=142)
    async with http_sync(restartable.url, trainer) as (backend, sync):
        restartable.restart()
        # The answer was computed with the restarted server's weights: never handed out.
        with pytest.raises(SyncError, match=r"weight_version 'default'.* restarted"):
            await backend.generate(prompts, max_new_tokens=2)
        assert sync.is_stale and not backend.weights_valid
        with pytest.raises(SyncError, match="restarted"):
            await backend.generate(prompts, max_new_tokens=2)

        assert await refit_if_stale(sync, backend) is True
        state_equal(restartable.state_dict(), trainer.expected())
        assert await backend.generate(prompts, max_new_tokens=3) == trainer.reference_generate(
            prompts, 3
        )
        await sync.shutdown()
