"""Run a script or a module as its own process without a fresh interpreter's imports.

``python script.py ARGS`` (or ``python -m module ARGS``) pays torch's,
transformers' and aiosync's imports (seconds of CPU on 2 cores) in every rank
or server a test starts. :func:`start_script` and :func:`start_module` instead
fork the process from the forkserver the embedded engine's workers come from
(:func:`aiosync.engines.embedded._pool.worker_context`, which preloaded those
modules) and run the file or module there as ``__main__``, as the interpreter
would: ``sys.argv``, the script's folder first on ``sys.path``, the given
environment, stdout and stderr into a log file, an exit code (0, a
``SystemExit``'s, or 1 with the traceback in the log), the ``atexit`` handlers
at the end. Each is still a process of its own: SIGKILL it, and what it held
is the kernel's to release.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from aiosync.engines.embedded._pool import worker_context
from tests._support.net import free_ports

__all__ = ["rank_results", "start_module", "start_script"]


def start_script(
    script: Path, argv: Sequence[str], log: Path | None, env: Mapping[str, str]
) -> BaseProcess:
    """Start ``python script ARGV`` in a new process; return it.

    Its stdout and stderr are appended to ``log`` (None: this process's, as the
    forkserver got them); ``env`` is its whole environment. ``exitcode`` is the
    script's exit status once it ended.
    """
    return _start(str(script), False, argv, log, env)


def start_module(
    module: str, argv: Sequence[str], log: Path | None, env: Mapping[str, str]
) -> BaseProcess:
    """Start ``python -m module ARGV`` in a new process; return it (see :func:`start_script`)."""
    return _start(module, True, argv, log, env)


def _start(
    target: str, is_module: bool, argv: Sequence[str], log: Path | None, env: Mapping[str, str]
) -> BaseProcess:
    # Not a daemon: a daemonic process may not start processes (an engine's workers).
    proc = worker_context().Process(
        target=_run,
        args=(target, is_module, list(argv), None if log is None else str(log), dict(env)),
        daemon=False,
    )
    proc.start()
    return proc


def _run(
    target: str, is_module: bool, argv: list[str], log: str | None, env: dict[str, str]
) -> None:
    os.environ.clear()
    os.environ.update(env)
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    sys.argv = [target, *argv]
    try:
        if is_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    finally:
        # An interpreter runs these at exit; a multiprocessing child leaves by os._exit.
        atexit._run_exitfuncs()


def per_transport_ranks_fixture(script: Path, label: str, transports: Sequence[str]) -> Any:
    """A module fixture ``ranks`` parametrized by ``transports``: :func:`per_transport_ranks`
    of ``script`` (assign it to the module's ``ranks``)."""
    import pytest

    @pytest.fixture(scope="module", params=list(transports))
    def ranks(
        request: Any, tmp_path_factory: Any, spawn_ranks: Any
    ) -> tuple[str, list[dict[str, Any]]]:
        return per_transport_ranks(request, tmp_path_factory, spawn_ranks, script, label)

    return ranks


def per_transport_ranks(
    request: Any, tmp_path_factory: Any, spawn_ranks: Any, script: Path, label: str
) -> tuple[str, list[dict[str, Any]]]:
    """A module fixture's body, parametrized by transport (``request.param``): ``script``
    run on 2 ranks with the transport as its argument (:func:`rank_results`, in a folder
    named ``label-TRANSPORT``); the transport and what each rank wrote."""
    transport = str(request.param)
    folder = tmp_path_factory.mktemp(f"{label}-{transport}")
    return transport, rank_results(spawn_ranks, folder, script, 2, transport)


def rank_results(
    spawn_ranks: Callable[[Path, int, Callable[[int], Sequence[str]]], None],
    folder: Path,
    script: Path,
    world: int,
    *args: str,
    store_ports: int = 1,
) -> list[dict[str, Any]]:
    """Run a rank script on ``world`` ranks through the ``spawn_ranks`` fixture (which
    gives ``RANK WORLD_SIZE PG_PORT``), then ``store_ports`` free store ports,
    ``folder/RANK.json`` and ``args`` (:func:`tests._support.fsdp2.rank_main`'s
    argv); return what each rank wrote there, rank 0's first."""
    stores = [str(p) for p in free_ports(store_ports)] if store_ports else []
    spawn_ranks(script, world, lambda r: [*stores, str(folder / f"{r}.json"), *args])
    return [json.loads((folder / f"{r}.json").read_text()) for r in range(world)]
