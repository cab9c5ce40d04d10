"""A rolling refit of two real SGLang test servers over HTTP: ``EngineFleet(refit="rolling",
max_unavailable=1)``. While the first server is paused in its wave, the fleet's generate
calls go to the second, which answers with the previous version's tokens, labelled so; the
servers take the version one after the other (the first's ``/update_weight_version`` comes
before the second's first bucket), each bit-exact.
"""

from __future__ import annotations

from typing import Any

import pytest

from aiosync import EngineFleet, InFlightPolicy, SGLangHTTPBackend, create_weight_synchronizer
from aiosync.options import HTTPOptions

pytestmark = pytest.mark.slow

BUCKET_BYTES = 64 * 1024


def _updates(server: Any) -> list[dict[str, Any]]:
    return [e for e in server.log() if e["path"] == "/update_weights_from_tensor"]


class SteppedBackend(SGLangHTTPBackend):
    """A real server's backend that runs ``on_paused(self)`` once a sync paused it."""

    on_paused: Any = None

    async def pause_generation(self, mode: InFlightPolicy, clear_cache: bool = True) -> None:
        await super().pause_generation(mode, clear_cache)
        if self.on_paused is not None:
            await self.on_paused(self)


async def test_a_rolling_refit_of_two_servers_serves_the_previous_version_from_the_other(
    servers: Any, make_trainer: Any, state_equal: Any, prompts: list[list[int]]
) -> None:
    trainer = make_trainer(seed=90)
    backends = [SteppedBackend(s.url) for s in servers]
    fleet = EngineFleet(backends, refit="rolling", max_unavailable=1)
    sync = create_weight_synchronizer(
        trainer,
        fleet,
        colocated=True,
        backend="sglang",
        transport=HTTPOptions(bucket_bytes=BUCKET_BYTES),
    )
    try:
        await sync.init_communicator()
        await sync.mark_stale()
        await sync.sync_weights()
        expected = {"1": trainer.reference_generate(prompts, 4)}
        trainer.step(seed=91)
        expected["2"] = trainer.reference_generate(prompts, 4)
        assert expected["1"] != expected["2"]

        during: list[tuple[list[Any], list[Any]]] = []
        seen: dict[str, Any] = {}
        updates_before = len(_updates(servers[1]))

        async def in_first_wave(backend: SteppedBackend) -> None:
            outputs = await fleet.generate_with_meta(prompts, max_new_tokens=4)
            during.append((fleet.serving, outputs))
            seen["second's updates"] = len(_updates(servers[1])) - updates_before

        async def in_second_wave(backend: SteppedBackend) -> None:
            versions = [e.get("new_version") for e in servers[0].log()]
            seen["first's version"] = [v for v in versions if v is not None][-1]

        backends[0].on_paused = in_first_wave
        backends[1].on_paused = in_second_wave
        await sync.mark_stale()
        await sync.sync_weights()
        assert (sync.weight_version, sync.is_stale) == (2, False)

        # During the first server's wave, the second served version 1 and got no byte.
        ((serving, outputs),) = during
        assert serving == [backends[1]]
        assert [r.weight_version for r in outputs] == ["1"] * len(prompts)
        assert [r.token_ids for r in outputs] == expected["1"]
        assert seen == {"second's updates": 0, "first's version": "2"}
        for server in servers:
            state_equal(server.state_dict(), trainer.expected())
        assert fleet.versions == {
            "engine 0 of 2 (SteppedBackend)": 2,
            "engine 1 of 2 (SteppedBackend)": 2,
        }
        outputs = await fleet.generate_with_meta(prompts, max_new_tokens=4)
        assert [r.token_ids for r in outputs] == expected["2"]
    finally:
        await sync.shutdown()
        for backend in backends:
            await backend.aclose()
