"""Removing what aiosync processes that died left in ``/dev/shm`` and the temp dir.

A process killed by SIGKILL (or ``os._exit``) runs no cleanup: its shared-memory
segments and its ``ipc://`` socket directories stay until reboot. Every such
name carries the creating process's pid, so the next aiosync process to start a
synchronizer or an engine calls :func:`sweep_leftovers`, which removes exactly
aiosync's own entries whose creator is dead:

* ``/dev/shm/aiosync-<pid>-<16 hex>``: IPC transport buckets (``ipc/_shm.py``);
* ``/dev/shm/aiosync-http-<pid>-<16 hex>``: HTTP transport buckets (``http/_segment.py``);
* ``/dev/shm/aiosync-params-<pid>-<16 hex>``: trainer tensors in shared memory
  (``aiosync.refit.share_parameters``, ``aiosync/_arena.py``);
* ``<tempdir>/aiosync-ipc-<pid>-<8 chars>/``: the IPC trainer's socket directory;
* ``<tempdir>/aiosync-engine-<pid>-<8 chars>/``: the embedded engine's RPC socket directory;
* ``<tempdir>/aiosync-sglang-<pid>-<8 chars>/``: ``serve_in_subprocess``'s config folder;
* ``<tempdir>/aiosync-sglang-config-<pid>-<8 chars>/``: the SGLang test server's preset config;
* ``/dev/shm/aiosync-lora-<pid>-<8 chars>/`` (or in the temp dir where there is no
  ``/dev/shm``): a LoRA adapter folder handed to vLLM or SGLang (adapter-only refits).

Nothing else is touched: another name, another user's entry, a symlink, a file
where a directory belongs (or the reverse), or an entry whose pid is alive, is
left alone. A pid is dead when ``os.kill(pid, 0)`` raises ``ProcessLookupError``;
one alive but another user's (``PermissionError``) counts as alive. A pid the
kernel handed to a new process since is alive too: that entry waits for a later
sweep, which errs on the side of keeping.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable

__all__ = ["SHM_DIR", "dir_prefix", "pid_alive", "sweep_leftovers"]

_log = logging.getLogger(__name__)

#: Where POSIX shared memory lives on Linux.
SHM_DIR = "/dev/shm"
# Segment names as ipc/_shm.py, http/_segment.py and aiosync/_arena.py create them.
_SEGMENT_RE = re.compile(r"^aiosync-(?:http-|params-)?(?P<pid>[1-9][0-9]*)-[0-9a-f]{16}$")
# Directories as tempfile.mkdtemp(prefix=dir_prefix(kind)) creates them (8 random
# characters of tempfile's alphabet).
_DIR_KINDS = ("ipc", "engine", "sglang", "sglang-config", "lora")
_DIR_RE = re.compile(
    r"^aiosync-(?:ipc|engine|sglang|sglang-config|lora)-(?P<pid>[1-9][0-9]*)-[a-z0-9_]{8}$"
)


def dir_prefix(kind: str) -> str:
    """The ``tempfile.mkdtemp`` prefix for a socket directory of ``kind`` made by this process.

    Raises:
        ValueError: ``kind`` is not one the sweep knows (``"ipc"``, ``"engine"``,
            ``"sglang"``, ``"sglang-config"``, ``"lora"``).
    """
    if kind not in _DIR_KINDS:
        raise ValueError(f"unknown aiosync directory kind {kind!r}; known: {_DIR_KINDS}")
    return f"aiosync-{kind}-{os.getpid()}-"


def pid_alive(pid: int) -> bool:
    """False only when no process ``pid`` exists (``os.kill(pid, 0)`` → ``ProcessLookupError``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def sweep_leftovers(shm_dir: str = SHM_DIR, temp_dir: str | None = None) -> list[str]:
    """Remove aiosync's segments and socket directories whose creating process is dead.

    Never raises: an entry that cannot be removed (another sweeper got there
    first, a permission error) is skipped and logged; a missing directory is
    nothing to sweep.

    Args:
        shm_dir: where the shared-memory segments live (``/dev/shm``).
        temp_dir: where the socket directories live (default ``tempfile.gettempdir()``).

    Returns:
        The absolute paths removed, sorted.
    """
    removed = _sweep(shm_dir, _SEGMENT_RE, stat.S_ISREG)
    removed += _sweep(shm_dir, _DIR_RE, stat.S_ISDIR)  # LoRA adapter folders
    removed += _sweep(temp_dir or tempfile.gettempdir(), _DIR_RE, stat.S_ISDIR)
    if removed:
        _log.info("removed %d leftover(s) of dead aiosync processes: %s", len(removed), removed)
    return sorted(removed)


def _sweep(directory: str, pattern: re.Pattern[str], is_kind: Callable[[int], bool]) -> list[str]:
    try:
        names = os.listdir(directory)
    except OSError:  # no /dev/shm (not Linux) or an unreadable temp dir
        return []
    uid = os.getuid()
    removed = []
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or pid_alive(int(match["pid"])):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
            # lstat: a symlink is neither a regular file nor a directory, so it is
            # never followed; another user's entry is not ours to judge.
            if info.st_uid != uid or not is_kind(info.st_mode):
                continue
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:  # another process swept it first
            continue
        except OSError as exc:
            _log.warning("cannot remove leftover %s of dead process: %s", path, exc)
            continue
        removed.append(path)
    return removed
