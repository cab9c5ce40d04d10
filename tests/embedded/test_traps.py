"""The embedded engine's small traps: a script piped on stdin, a start after shutdown."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import pytest

from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.errors import SyncError

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

PROMPT = [1, 2, 3]
SEED = 3

# A guarded script, as a user pipes it in: `python - < train.py`. __main__.__file__ is
# then '<stdin>', which spawn would re-import in every worker from '<cwd>/<stdin>'.
_STDIN_SCRIPT = f"""
import asyncio, json, sys
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine


async def main():
    async with EmbeddedEngine(TINY_QWEN3, num_workers=2, seed={SEED}) as engine:
        await engine.prepare_for_generation()
        outs = await engine.generate([{PROMPT}] * 2, max_new_tokens=4)
    print(json.dumps({{"main_file": sys.modules["__main__"].__file__, "outs": outs}}))

if __name__ == "__main__":
    asyncio.run(main())
"""


async def test_a_script_piped_on_stdin_starts_workers_that_generate(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_STDIN_SCRIPT)
    with anyio.fail_after(600), script.open("rb") as stdin:
        # cwd tmp_path: no '<stdin>' file there for spawn to find by accident.
        proc = await anyio.run_process(
            [sys.executable, "-"], stdin=stdin, cwd=tmp_path, check=False
        )
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr[-4000:]
    assert "FileNotFoundError" not in stderr
    seen = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    # The main module's file is what Python set, restored once the workers started.
    assert seen["main_file"] == "<stdin>"
    # Both workers built the seeded model and answer as the same model here does.
    (expected,) = HFModelRunner.from_config(TINY_QWEN3, seed=SEED).generate(
        [PROMPT], max_new_tokens=4
    )
    assert seen["outs"] == [expected, expected]


async def test_start_after_shutdown_raises_instead_of_returning_a_dead_engine() -> None:
    engine = EmbeddedEngine(TINY_QWEN3, num_workers=1, worker_extension_cls=None)
    await engine.start()
    (pid,) = engine.pids
    await engine.shutdown()
    with pytest.raises(SyncError, match=r"start\(\) after shutdown\(\).*build a new") as info:
        await engine.start()
    assert type(info.value) is SyncError  # a misuse, not a peer's failure (TransportError)
    with pytest.raises(SyncError, match=r"after shutdown"):
        async with engine:
            pass
    # Nothing was spawned again: the one worker is the first, reaped.
    assert engine.pids == [pid]
    assert [p.exitcode for p in engine.processes] == [0]


async def test_start_after_a_shutdown_before_any_start_raises_and_spawns_nothing() -> None:
    engine = EmbeddedEngine(TINY_QWEN3, num_workers=1, worker_extension_cls=None)
    await engine.shutdown()
    with pytest.raises(SyncError, match=r"start\(\) after shutdown\(\)"):
        await engine.start()
    assert engine.pids == [] and engine.socket_dir is None
