"""One sync into a remote ``vllm serve`` next to the same sync into an ``AsyncLLM`` in this process.

The same checkpoint (a qwen3-shaped float32 model built from a config and saved
to a temp folder, with a word-level tokenizer: nothing is downloaded) is served
two ways, measured in one run:

* ``in process`` (the baseline): ``AsyncLLM`` behind :class:`aiosync.VLLMGenerationBackend`;
* ``vllm serve``: vLLM's OpenAI server (``VLLM_SERVER_DEV_MODE=1``, aiosync's worker
  extension) on a free 127.0.0.1 port, behind :class:`aiosync.VLLMServerBackend`: every
  worker call of the sync is one ``/collective_rpc`` request, the pause one ``/pause``.

For each transport (IPC: the server is on this host; the collective broadcast over
gloo, as for a server on another host): best seconds of ``--repeats`` syncs (at
least 3; 1 with ``--quick``) after one warm-up, ``mark_stale()`` outside the
timing, and the ratio ``vllm serve / in process``.

vLLM comes from ``.venv-vllm`` (``bash .ci/vllm.sh`` makes it; run
``.venv-vllm/bin/python benchmarks/vllm_server.py``). Where vLLM is not installed
the script prints that in its table and JSON and measures nothing. Starting the
two engines takes most of a run (30-90 s each on a loaded 2-core machine).

Usage::

    .venv-vllm/bin/python benchmarks/vllm_server.py            # ~67 MB, best of 3
    .venv-vllm/bin/python benchmarks/vllm_server.py --quick    # ~4 MB, best of 2
    .venv-vllm/bin/python benchmarks/vllm_server.py --json     # last line: one JSON object
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _machine import Machine, repeats_for

REPO = Path(__file__).resolve().parent.parent
GB = 1e9
EXTENSION = "aiosync.engines.vllm.worker_extension.AiosyncWorkerExtension"
TRANSPORTS = ("ipc", "collective")
#: ~67 MB of float32 (``--quick``: the small one).
FULL = {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
QUICK = {**FULL, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 384}
ENGINE_OPTIONS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 128, "seed": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _save_checkpoint(folder: Path, config: dict[str, Any]) -> Any:
    """A random Qwen3 of ``config`` and a word-level tokenizer in ``folder``; returns the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**config, bos_token_id=None, eos_token_id=None))
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(folder)
    return model.eval()


def _serve(folder: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype"]
    command += ["float32", "--max-model-len", "128", "--seed", "0"]
    command += ["--worker-extension-cls", EXTENSION]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(REPO)}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    import httpx

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"vllm serve did not come up:\n{log.read_text()[-12000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


async def _best(transport: str, trainer: Any, backend: Any, repeats: int) -> float:
    from aiosync import TrainCluster
    from aiosync.refit import DTensorRefitSource
    from aiosync.transports.collective import CollectiveWeightSynchronizer
    from aiosync.transports.ipc import IPCWeightSynchronizer

    source = DTensorRefitSource(trainer)
    start_version = await backend.weight_version() or 0
    if transport == "ipc":
        sync: Any = IPCWeightSynchronizer(
            source, backend, device="cpu", initial_version=start_version
        )
    else:
        sync = CollectiveWeightSynchronizer(
            source,
            backend,
            train_cluster=TrainCluster(master_addr="127.0.0.1", master_port=_free_port()),
            inference_world_size=1,
            dist_backend="gloo",
            initial_version=start_version,
        )
    times = []
    async with sync:
        for _ in range(repeats + 1):  # the first one warms up
            await sync.mark_stale()
            start = time.perf_counter()
            await sync.sync_weights()
            times.append(time.perf_counter() - start)
    return min(times[1:])


async def _measure(folder: Path, trainer: Any, url: str, repeats: int) -> dict[str, list[float]]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from aiosync import VLLMGenerationBackend, VLLMServerBackend

    rows: dict[str, list[float]] = {}
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=str(folder), worker_extension_cls=EXTENSION, **ENGINE_OPTIONS)
    )
    try:
        local = VLLMGenerationBackend(engine)
        for transport in TRANSPORTS:
            rows[transport] = [await _best(transport, trainer, local, repeats)]
    finally:
        engine.shutdown()
    async with VLLMServerBackend(url) as remote:
        for transport in TRANSPORTS:
            rows[transport].append(await _best(transport, trainer, remote, repeats))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small checkpoint, best of 2")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (best; >= 3)")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    machine = Machine(repeats_for(args.quick, args.repeats))
    config = QUICK if args.quick else FULL
    result: dict[str, Any] = {"benchmark": "vllm_server"}
    table = Table(title="one sync: vllm serve vs AsyncLLM in process", caption=None)
    for column in ("transport", "in process s", "vllm serve s", "ratio"):
        table.add_column(column, justify="left" if column == "transport" else "right")
    if importlib.util.find_spec("vllm") is None:
        reason = "vLLM is not installed here: run it with .venv-vllm/bin/python (bash .ci/vllm.sh)"
        table.add_row("not measured", "-", "-", "-")
        result["skipped"] = reason
        machine.finish()
        table.caption = reason
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # Offline, and a KV cache a 2-core test machine can hold (GiB), for both engines.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "model"
            trainer = _save_checkpoint(folder, config)
            nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
            proc, url = _serve(folder, Path(tmp) / "server.log")
            try:
                rows = asyncio.run(_measure(folder, trainer, url, machine.repeats))
            finally:
                os.killpg(proc.pid, 9)
                proc.wait()
        machine.finish()
        table.title = f"{table.title}, {nbytes / GB:.3f} GB float32"
        table.caption = machine.caption()
        result |= {"nbytes": nbytes, "rows": []}
        for transport, (local, remote) in rows.items():
            table.add_row(transport, f"{local:.3f}", f"{remote:.3f}", f"{remote / local:.2f}")
            result["rows"].append(
                {"transport": transport, "in_process_s": local, "server_s": remote}
            )
    Console().print(table)
    machine.report()
    if args.json:
        print(json.dumps(result | machine.fields()))


if __name__ == "__main__":
    main()
