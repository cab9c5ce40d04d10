"""One rank of a 2-rank (gloo) LoRA trainer refitting its adapter into an SGLang-contract server.

Run by ``test_sharded_lora.py``: ``python _sharded_lora_trainer.py RANK WORLD PORT URL OUT``.
Every rank holds the same adapter and runs a ``LoRAAdapterSynchronizer`` over the
group; rank 0 holds the server's backend. A sync that succeeds, one that fails on
rank 1 only (its source breaks mid-read), and one that heals; each rank writes
what it saw to ``OUT`` (JSON).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from lora_harness import NEW_TOKENS, PROMPTS, LoRATrainer

from aiosync import LoRAAdapterSynchronizer, RefitMismatchError, SGLangHTTPBackend
from aiosync.refit import LoRAAdapterRefitSource


class _BreakableSource(LoRAAdapterRefitSource):
    """Raises after two tensors while ``broken`` (only rank 1 breaks)."""

    broken = False

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(super().iter_weights()):
            if self.broken and i == 2:
                raise RefitMismatchError("rank 1's source broke mid-read")
            yield item


async def _run(rank: int, url: str) -> dict[str, Any]:
    trainer = LoRATrainer()
    source = _BreakableSource(trainer.model)
    backend = SGLangHTTPBackend(url) if rank == 0 else None
    out: dict[str, Any] = {"rank": rank}
    sync = LoRAAdapterSynchronizer(source, backend, process_group=dist.group.WORLD)

    def versions() -> list[Any]:
        return [sync.policy_version, sync.weight_version, sync.is_stale]

    async with sync, sync.subscribe() as events:
        await sync.init_communicator()
        await sync.mark_stale()
        await sync.sync_weights()
        out["after_ok"] = versions()
        if backend is not None:
            out["ok_matches_merged"] = (
                await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
            ) == trainer.merged_generate()

        trainer.step(seed=9)
        await sync.mark_stale()
        source.broken = rank == 1
        try:
            await sync.sync_weights()
        except Exception as exc:
            out["failure"] = [type(exc).__name__, str(exc)]
        source.broken = False
        out["after_failure"] = versions()
        if backend is not None:
            # Never loaded: the ranks agreed before rank 0 loaded anything.
            out["adapter_after_failure"] = backend.lora_adapter

        await sync.sync_weights()
        out["after_heal"] = versions()
        if backend is not None:
            out["heal_matches_merged"] = (
                await backend.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
            ) == trainer.merged_generate()
            await backend.aclose()
        seen = [await events.__anext__() for _ in range(8)]
        out["events"] = [[e.kind.value, e.version, e.nbytes] for e in seen]
    return out


def main() -> None:
    rank, world, port, url, path = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        result = asyncio.run(_run(rank, url))
    finally:
        dist.destroy_process_group()
    Path(path).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
