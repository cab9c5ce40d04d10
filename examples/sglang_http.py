"""Colocated SGLang over HTTP: weights posted to the server's ``/update_weights_from_tensor``.

``create_weight_synchronizer(colocated=True, backend="sglang")`` picks
``HTTPWeightSynchronizer``; it drives the server through ``SGLangHTTPBackend``
(memory-saver release/resume, flattened buckets, cache flush). Without SGLang
installed this starts aiosync's contract-true SGLang test server (the embedded
transformers engine behind SGLang's HTTP API) in its own process; pass
``--url`` to use a real ``sglang.launch_server``.

Run::

    python examples/sglang_http.py --steps 3
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import anyio
import httpx
import torch
from safetensors.torch import load as safetensors_load

from aiosync import create_weight_synchronizer, refit_if_stale
from aiosync.engines.embedded.configs import TINY_QWEN3 as CONFIG
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.engines.sglang.backend import SGLangHTTPBackend
from aiosync.refit import DTensorRefitSource
from aiosync.testing.sglang_server import serve_in_subprocess

PROMPT = [1, 2, 3, 4]


class TestServerBackend(SGLangHTTPBackend):
    """``SGLangHTTPBackend`` with the embedded engine's ``generate`` keywords, and a weight read.

    ``hf_state_dicts()`` reads the test server's weights (``/_aiosync/state_dict``,
    test servers only) so that a caller can check them against the trainer's.
    """

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        sampling_params: Mapping[str, Any] | None = None,
    ) -> list[list[int]]:
        params = {**(sampling_params or {}), "ignore_eos": ignore_eos}
        if seed is not None:
            params["sampling_seed"] = seed
        return await super().generate(
            prompts, max_new_tokens=max_new_tokens, temperature=temperature, sampling_params=params
        )

    async def hf_state_dicts(self) -> list[dict[str, torch.Tensor]]:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=60) as client:
            response = await client.get("/_aiosync/state_dict")
            response.raise_for_status()
        return [safetensors_load(response.content)]


@contextlib.asynccontextmanager
async def launch_test_server(
    config: Mapping[str, Any], *, seed: int = 0, start_timeout_s: float = 300.0
) -> AsyncIterator[TestServerBackend]:
    """Start ``python -m aiosync.testing.sglang_server`` on 127.0.0.1; yield its backend."""
    async with serve_in_subprocess(config, seed=seed, start_timeout_s=start_timeout_s) as url:
        backend = TestServerBackend(url)
        try:
            yield backend
        finally:
            await backend.aclose()


@contextlib.asynccontextmanager
async def open_server(url: str | None) -> AsyncIterator[SGLangHTTPBackend]:
    if url is None:
        async with launch_test_server(CONFIG) as backend:
            yield backend
    else:
        async with SGLangHTTPBackend(url) as backend:
            yield backend


async def main(steps: int, url: str | None) -> None:
    trainer = HFModelRunner.from_config(CONFIG, seed=0)
    model = trainer.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = DTensorRefitSource(model, optimizer=optimizer)
    async with open_server(url) as server:
        sync = create_weight_synchronizer(source, server, colocated=True, backend="sglang")
        async with sync:  # initializes the communicator
            for _ in range(steps):
                batch = torch.randint(0, 128, (4, 8))
                model(batch, labels=batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                await sync.mark_stale()

                await refit_if_stale(sync, server)
                (server_out,) = await server.generate([PROMPT], max_new_tokens=6)
                (trainer_out,) = trainer.generate([PROMPT], max_new_tokens=6)
                same = server_out == trainer_out
                print(
                    f"{type(sync).__name__}: weight_version {sync.weight_version} "
                    f"(server reports {await server.get_weight_version()!r})  "
                    f"server {server_out}  trainer {trainer_out}  "
                    f"{'equal' if same else 'DIFFERENT'}"
                )
                if not same:
                    raise SystemExit("server and trainer disagree after a refit")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--url", default=None, help="a running SGLang server")
    args = parser.parse_args()
    anyio.run(main, args.steps, args.url)
