"""Run a script as its own process without a fresh interpreter's imports.

``python script.py ARGS`` pays torch's, transformers' and aiosync's imports
(seconds of CPU on 2 cores) in every rank a test starts. :func:`start_script`
instead forks the script's process from the forkserver the embedded engine's
workers come from (:func:`aiosync.engines.embedded._pool.worker_context`, which
preloaded those modules) and runs the file there as ``__main__``, as the
interpreter would: ``sys.argv``, the script's folder first on ``sys.path``, the
given environment, stdout and stderr into a log file, an exit code (0, a
``SystemExit``'s, or 1 with the traceback in the log), the ``atexit`` handlers
at the end. Each script is still a process of its own: SIGKILL it, and what it
held is the kernel's to release.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

from aiosync.engines.embedded._pool import worker_context

__all__ = ["start_script"]


def start_script(
    script: Path, argv: Sequence[str], log: Path, env: Mapping[str, str]
) -> BaseProcess:
    """Start ``script`` with ``argv`` (``sys.argv[1:]``) in a new process; return it.

    Its stdout and stderr are appended to ``log``; ``env`` is its whole environment.
    ``exitcode`` is the script's exit status once it ended.
    """
    # Not a daemon: a daemonic process may not start processes (an engine's workers).
    proc = worker_context().Process(
        target=_run, args=(str(script), list(argv), str(log), dict(env)), daemon=False
    )
    proc.start()
    return proc


def _run(script: str, argv: list[str], log: str, env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        # An interpreter runs these at exit; a multiprocessing child leaves by os._exit.
        atexit._run_exitfuncs()
