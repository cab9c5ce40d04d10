"""Leftovers of dead processes (issue 15, C16): a SIGKILLed trainer or engine runs no
cleanup; the next aiosync process to start removes exactly the segments and socket
directories whose creating pid is dead, and nothing else."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.transports._leftovers import SHM_DIR, dir_prefix, pid_alive, sweep_leftovers


def _dead_pid() -> int:
    """The pid of a process that ran and was reaped."""
    child = subprocess.Popen(["true"])
    assert child.wait() == 0
    assert not pid_alive(child.pid)
    return child.pid


@pytest.fixture
def live_pid() -> Iterator[int]:
    """The pid of a process alive for the whole test (``cat`` blocked on its stdin)."""
    child = subprocess.Popen(["cat"], stdin=subprocess.PIPE)
    assert child.stdin is not None
    yield child.pid
    child.stdin.close()  # EOF: cat exits
    assert child.wait() == 0


def _names(pid: int) -> dict[str, str]:
    return {
        "ipc_segment": f"aiosync-{pid}-{secrets.token_hex(8)}",
        "http_segment": f"aiosync-http-{pid}-{secrets.token_hex(8)}",
        "ipc_dir": f"aiosync-ipc-{pid}-a1b2c3_d",
        "engine_dir": f"aiosync-engine-{pid}-zz00yy11",
        "sglang_dir": f"aiosync-sglang-{pid}-q_w3e4r5",
        "sglang_config_dir": f"aiosync-sglang-config-{pid}-mm99nn88",
        "lora_dir": f"aiosync-lora-{pid}-k3j4h5g6",
    }


_DIRS = ("ipc_dir", "engine_dir", "sglang_dir", "sglang_config_dir")


def _make(shm: Path, tmp: Path, names: dict[str, str]) -> None:
    (shm / names["ipc_segment"]).write_bytes(b"x" * 64)
    (shm / names["http_segment"]).write_bytes(b"x" * 64)
    for kind in _DIRS:
        (tmp / names[kind]).mkdir(mode=0o700)
        (tmp / names[kind] / "refit.sock").write_bytes(b"")
    # A LoRA adapter folder handed to vLLM/SGLang lives in /dev/shm.
    (shm / names["lora_dir"]).mkdir(mode=0o700)
    (shm / names["lora_dir"] / "adapter_model.safetensors").write_bytes(b"x")


def test_sweep_removes_exactly_the_entries_of_dead_pids(tmp_path: Path, live_pid: int) -> None:
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    dead = _dead_pid()
    gone, kept = _names(dead), _names(live_pid)
    _make(shm, tmp, gone)
    _make(shm, tmp, kept)
    # Not aiosync's (or not in the form it creates): never touched, dead pid or not.
    foreign = [
        shm / f"other-{dead}-{secrets.token_hex(8)}",
        shm / f"aiosync-{dead}-not-hex",
        shm / f"aiosync-sglang-{dead}-{secrets.token_hex(8)}",
        tmp / f"aiosync-sglang-x-{dead}-abcdefgh",
        tmp / "aiosync-ipc-18e3ntd7",  # an old name without a pid
        tmp / f"aiosync-rogue-{dead}-abcdefgh",
        tmp / f"aiosync-ipc-{dead}-toolongname",
    ]
    for path in foreign:
        path.mkdir() if path.parent == tmp else path.write_bytes(b"")
    # The right name, the wrong kind: a directory where a segment belongs, a file
    # where a directory belongs, a symlink (never followed) to a directory.
    wrong_kind_segment = shm / f"aiosync-{dead}-{secrets.token_hex(8)}"
    wrong_kind_segment.mkdir()
    wrong_kind_dir = tmp / f"aiosync-engine-{dead}-abcdefgh"
    wrong_kind_dir.write_bytes(b"")
    target = tmp_path / "precious"
    target.mkdir()
    (target / "data").write_bytes(b"keep")
    (tmp / f"aiosync-ipc-{dead}-12345678").symlink_to(target)

    removed = sweep_leftovers(shm_dir=str(shm), temp_dir=str(tmp))

    expected = [shm / gone["ipc_segment"], shm / gone["http_segment"], shm / gone["lora_dir"]]
    expected += [tmp / gone[kind] for kind in _DIRS]
    assert removed == sorted(str(path) for path in expected)
    assert sorted(os.listdir(shm)) == sorted(
        [kept["ipc_segment"], kept["http_segment"], kept["lora_dir"], wrong_kind_segment.name]
        + [p.name for p in foreign if p.parent == shm]
    )
    assert sorted(os.listdir(tmp)) == sorted(
        [kept[kind] for kind in _DIRS]
        + [wrong_kind_dir.name, f"aiosync-ipc-{dead}-12345678"]
        + [p.name for p in foreign if p.parent == tmp]
    )
    assert (target / "data").read_bytes() == b"keep"
    assert sweep_leftovers(shm_dir=str(shm), temp_dir=str(tmp)) == []


def test_sweep_of_missing_directories_removes_nothing(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    assert sweep_leftovers(shm_dir=missing, temp_dir=missing) == []


def test_dir_prefix_carries_this_pid_and_refuses_unknown_kinds() -> None:
    assert dir_prefix("ipc") == f"aiosync-ipc-{os.getpid()}-"
    assert dir_prefix("engine") == f"aiosync-engine-{os.getpid()}-"
    assert dir_prefix("sglang-config") == f"aiosync-sglang-config-{os.getpid()}-"
    assert dir_prefix("lora") == f"aiosync-lora-{os.getpid()}-"
    with pytest.raises(ValueError, match="unknown aiosync directory kind 'rogue'"):
        dir_prefix("rogue")


@pytest.mark.asyncio(loop_scope="session")  # the engine fixtures' loop
async def test_starting_a_synchronizer_sweeps_real_segments_and_socket_dirs_of_dead_pids(
    dense_engine: EmbeddedEngine, h: SimpleNamespace, live_pid: int
) -> None:
    import _posixshmem  # what ipc/_shm.py creates segments with

    dead = _dead_pid()
    tmp = Path(tempfile.gettempdir())
    gone, kept = _names(dead), _names(live_pid)
    made: list[Path] = []
    for names in (gone, kept):
        for kind in ("ipc_segment", "http_segment"):
            fd = _posixshmem.shm_open("/" + names[kind], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, 4096)
            os.close(fd)
            made.append(Path(SHM_DIR) / names[kind])
        for kind in _DIRS:
            (tmp / names[kind]).mkdir(mode=0o700)
            made.append(tmp / names[kind])
        (Path(SHM_DIR) / names["lora_dir"]).mkdir(mode=0o700)
        made.append(Path(SHM_DIR) / names["lora_dir"])
    try:
        trainer = h.trainer_model(h.DENSE_TIED, seed=40)
        sync = h.ipc_sync(trainer, dense_engine, bucket_bytes=16384)
        await sync.init_communicator()
        try:
            present = sorted(p.name for p in made if p.exists())
            assert present == sorted(kept.values())
            # Its own socket directory (and the engine's) carry the creating pid.
            assert sync.socket_dir is not None
            assert Path(sync.socket_dir).name.startswith(f"aiosync-ipc-{os.getpid()}-")
            engine_dir = dense_engine.socket_dir
            assert engine_dir is not None
            assert Path(engine_dir).name.startswith(f"aiosync-engine-{os.getpid()}-")
            await sync.mark_stale()
            await sync.sync_weights()  # the sweep spared everything this process uses
            await h.assert_engine_equals(dense_engine, trainer)
        finally:
            await sync.shutdown()
    finally:
        for path in made:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()


_EXITS_WITHOUT_CLOSE = """
from aiosync.transports.ipc._shm import SharedBuffer
kept = SharedBuffer.create(4096)
kept.tensor.fill_(7)
print(kept.handle()["name"])
# No close(), no shutdown(): the interpreter exits holding the buffer.
"""


def test_a_trainer_that_exits_without_closing_its_buffers_unlinks_them() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _EXITS_WITHOUT_CLOSE],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    name = out.stdout.strip()
    assert name.startswith("aiosync-")
    assert not os.path.exists(os.path.join(SHM_DIR, name))
