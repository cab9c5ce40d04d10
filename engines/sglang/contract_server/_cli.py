"""Starting the server: :func:`make_server`, :func:`serve_in_subprocess` and the command
line (``python -m aiosync.testing.sglang_server``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from aiosync._model_shapes import MODEL_CONFIGS
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.engines.sglang.contract_server._base import _Server
from aiosync.engines.sglang.contract_server._handler import _Handler
from aiosync.engines.sglang.contract_server._state import ServerState
from aiosync.errors import TransportError
from aiosync.transports._leftovers import dir_prefix, sweep_leftovers
from aiosync.transports.http import (
    use_file_system_sharing,
)

_DESCRIPTION = (
    "A contract-true stand-in for SGLang's HTTP server, on the embedded transformers engine."
)


def make_server(state: ServerState, port: int = 0) -> _Server:
    """Bind a server for ``state`` on 127.0.0.1:``port`` (0: any free port)."""
    server = _Server(("127.0.0.1", port), _Handler)
    server.state = state
    return server


@contextlib.asynccontextmanager
async def serve_in_subprocess(
    model_config: Mapping[str, Any],
    *,
    seed: int = 0,
    dtype: str = "float32",
    args: Sequence[str] = (),
    start_timeout_s: float = 300.0,
) -> AsyncIterator[str]:
    """Run this server in its own process on 127.0.0.1; yield its base URL.

    Args:
        model_config: an HF config dict with ``model_type`` (random init, ``seed``).
        seed: the server model's init seed.
        dtype: the server model's dtype name (``"float32"``, ``"bfloat16"``).
        args: more command-line flags (``["--api-key", "k", "--enable-memory-saver"]``).
        start_timeout_s: limit for the model build and bind, seconds.

    The server exits with this process, however it ends (even SIGKILL): it holds
    the read end of a pipe whose write end only this process has (``--parent-fd``);
    the kernel closes that on death and the server reads EOF. A child this process
    forks (not spawns) inherits the write end and keeps the server up while it lives.
    Leftovers of dead aiosync processes are removed first
    (:mod:`aiosync.transports._leftovers`).

    Raises:
        TransportError: the server exited before it was ready.
        TimeoutError: it was not ready within ``start_timeout_s``.
    """
    sweep_leftovers()
    with tempfile.TemporaryDirectory(prefix=dir_prefix("sglang")) as tmp:
        config_path, port_file = Path(tmp) / "config.json", Path(tmp) / "port"
        config_path.write_text(json.dumps(dict(model_config)))
        # os.pipe() is close-on-exec: only the server (pass_fds) gets the read end.
        parent_r, parent_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "aiosync.testing.sglang_server", "--port", "0",
                 "--port-file", str(port_file), "--model-config", str(config_path),
                 "--seed", str(seed), "--dtype", dtype, "--parent-fd", str(parent_r), *args],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(parent_r,),
            )  # fmt: skip
        except BaseException:
            os.close(parent_w)
            raise
        finally:
            os.close(parent_r)
        try:
            with anyio.fail_after(start_timeout_s):
                while not port_file.exists():
                    if proc.poll() is not None:
                        raise TransportError(f"SGLang test server exited with {proc.returncode}")
                    await anyio.sleep(0.1)
            yield f"http://127.0.0.1:{port_file.read_text()}"
        finally:
            stop_server(proc, 10)
            os.close(parent_w)


def stop_server(proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """Stop a server process: SIGTERM, then SIGKILL if it has not exited within
    ``timeout_s`` seconds; returns once it exited."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _model_config(parser: argparse.ArgumentParser, value: str) -> str | dict[str, Any]:
    """``--model-config``: a path on disk wins; otherwise a preset name of ``aiosync bench``."""
    if Path(value).exists():
        return value
    if value in MODEL_CONFIGS:
        return dict(MODEL_CONFIGS[value])
    parser.error(
        f"--model-config {value!r} is neither a config.json or folder on disk nor a preset; "
        f"presets: {', '.join(MODEL_CONFIGS)}"
    )


def main(argv: list[str] | None = None) -> None:
    """Command line: build the model, bind, write the port, serve until killed."""
    parser = argparse.ArgumentParser(
        prog="python -m aiosync.testing.sglang_server", description=_DESCRIPTION
    )
    parser.add_argument("--port", type=int, default=0, help="0: a free port (default)")
    parser.add_argument("--port-file", type=Path, help="write the bound port here when ready")
    parser.add_argument(
        "--model-config",
        required=True,
        help="config.json, a folder holding one (with *.safetensors: loaded, else random "
        f"weights), or a preset of `aiosync bench --model`: {', '.join(MODEL_CONFIGS)} "
        "(qwen3-tiny builds in seconds; the others are full-size, random weights)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for generation and load_weights (default 1: test machines are "
        "shared, and more threads than free cores make OpenMP spin)",
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    parser.add_argument("--max-lora-rank", type=int, default=None)
    parser.add_argument("--lora-target-modules", nargs="*", default=None)
    parser.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="a draft model beside the target (as --model-config; built with seed + 1), its "
        "tensors named --speculative-draft-prefix + its own names in updates, loaded by the "
        "updates whose selector is 'draft' or 'all' (docs/draft.md)",
    )
    parser.add_argument("--speculative-draft-prefix", default="mtp.")
    parser.add_argument(
        "--no-weight-update-session",
        action="store_true",
        help="act as an SGLang before the weight-update session (PRs #28710, #28001): no "
        "/begin_weight_update, /end_weight_update (404), updates accepted without one",
    )
    parser.add_argument(
        "--weights-update-timeout-s",
        type=float,
        default=120.0,
        help="limit of a weight-update group's formation (/init_weights_update_group) and of "
        "each of its broadcasts (/update_weights_from_distributed), seconds (default 120)",
    )
    parser.add_argument(
        "--parent-fd",
        type=int,
        default=None,
        help="read end of a pipe from the parent: EOF (the parent died or closed it) stops "
        "the server",
    )
    args = parser.parse_args(argv)
    folders: list[str] = []  # removed however the server stops

    def stop(*_: object) -> None:
        # Stopped with SIGTERM (as serve_in_subprocess does) or orphaned: remove the
        # preset's config folder, then leave at once (an unwinding exit races torch's
        # native threads). The weight-update groups are not closed first: gloo's
        # teardown waits out a broadcast in flight; the kernel closes their sockets.
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    if args.parent_fd is not None:
        # Watching from the start: a parent that dies during the model build counts too.
        _stop_on_eof(args.parent_fd, stop)
    # Resolved before the model build so that a typo fails at once, with the presets listed.
    model_config = _model_config(parser, args.model_config)
    # Bound before the model build too: a busy port fails at once, and leaves nothing.
    try:
        server = _Server(("127.0.0.1", args.port), _Handler)
    except OSError as exc:
        print(
            f"aiosync SGLang test server: cannot listen on 127.0.0.1:{args.port}: "
            f"{exc.strerror or exc} (another process holds the port? pass --port 0 for a "
            "free one)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(2)
    use_file_system_sharing()
    torch.set_num_threads(args.threads)
    runner = HFModelRunner.from_config(model_config, seed=args.seed, dtype=args.dtype)
    model_path = str(args.model_config)
    config_dir = None
    if isinstance(model_config, dict):
        # A preset has no folder: write its config so that /get_server_info's model_path
        # lets a trainer check its manifest against this model, as with real SGLang.
        config_dir = tempfile.mkdtemp(prefix=dir_prefix("sglang-config"))
        folders.append(config_dir)
        runner.model.config.save_pretrained(config_dir)
        model_path = config_dir
    draft_ranks: list[HFModelRunner] = []
    draft_path = None
    if args.speculative_draft_model_path is not None:
        draft_config = _model_config(parser, args.speculative_draft_model_path)
        draft = HFModelRunner.from_config(draft_config, seed=args.seed + 1, dtype=args.dtype)
        draft_ranks.append(draft)
        draft_path = str(args.speculative_draft_model_path)
        if isinstance(draft_config, dict):
            draft_dir = tempfile.mkdtemp(prefix=dir_prefix("sglang-config"))
            folders.append(draft_dir)
            draft.model.config.save_pretrained(draft_dir)
            draft_path = draft_dir
    state = ServerState(
        runner=runner,
        draft_ranks=draft_ranks,
        draft_prefix=args.speculative_draft_prefix,
        draft_model_path=draft_path,
        tp_size=args.tp_size,
        api_key=args.api_key,
        enable_memory_saver=args.enable_memory_saver,
        weights_cpu_backup=args.enable_weights_cpu_backup,
        model_path=model_path,
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=args.lora_target_modules,
        weight_update_session=not args.no_weight_update_session,
        weights_update_timeout_s=args.weights_update_timeout_s,
    )
    server.state = state
    port = server.server_address[1]
    if args.port_file is not None:
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)
    print(f"aiosync SGLang test server on http://127.0.0.1:{port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        if config_dir is not None:
            shutil.rmtree(config_dir, ignore_errors=True)


def _stop_on_eof(fd: int, stop: Callable[[], None]) -> None:
    """Call ``stop`` when pipe ``fd`` reads EOF: every write end closed (the parent died).

    A daemon thread blocks in ``read``; nothing polls. The parent never writes, so
    any bytes that arrive are read and ignored.
    """

    def watch() -> None:
        with contextlib.suppress(OSError):  # a broken fd means no parent to wait for either
            while os.read(fd, 64):
                pass
        stop()

    threading.Thread(target=watch, name="aiosync-parent-watch", daemon=True).start()
