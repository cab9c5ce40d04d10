"""``python -m aiosync.testing.sglang_server --model-config`` takes a preset name
(a key of ``aiosync bench --model``) as well as a config.json on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aiosync._model_shapes import MODEL_CONFIGS
from aiosync.engines.sglang.contract_server import stop_server

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0


def server_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "aiosync.testing.sglang_server", *args]


@pytest.fixture
def tiny_server(tmp_path: Path) -> Iterator[str]:
    """The test server started with ``--model-config qwen3-tiny``; yields its base URL."""
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = ("--port", "0", "--port-file", str(port_file), "--model-config", "qwen3-tiny")
    # From tmp_path, so that no file named qwen3-tiny in the repository could be taken instead.
    proc = subprocess.Popen(server_cmd(*args), cwd=tmp_path, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if proc.poll() is not None:
                assert proc.stderr is not None
                pytest.fail(f"server exited {proc.returncode}: {proc.stderr.read().decode()}")
            assert time.monotonic() < deadline, "test server did not start in time"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{int(port_file.read_text())}"
    finally:
        stop_server(proc, timeout_s=30)


@pytest.mark.slow
def test_a_preset_name_builds_that_model_and_serves_generate(tiny_server: str) -> None:
    preset = MODEL_CONFIGS["qwen3-tiny"]
    with httpx.Client(base_url=tiny_server, timeout=60.0) as client:
        info = client.get("/get_model_info").json()
        # A folder holding the preset's config, so that trainers can check their manifest.
        config = json.loads((Path(info["model_path"]) / "config.json").read_text())
        assert (config["model_type"], config["num_hidden_layers"]) == ("qwen3", 8)
        manifest = client.get("/_aiosync/manifest").json()
        # Embeddings, final norm and head, and 11 tensors per decoder layer.
        assert len(manifest) == 3 + 11 * preset["num_hidden_layers"]
        assert manifest[0] == [
            "model.embed_tokens.weight",
            [preset["vocab_size"], preset["hidden_size"]],
            "float32",
        ]
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        answer = client.post("/generate", json=body)
        assert answer.status_code == 200, answer.text
        out = answer.json()["output_ids"]
        assert len(out) == 4 and all(0 <= t < preset["vocab_size"] for t in out)


def test_an_unknown_preset_is_refused_with_the_list(tmp_path: Path) -> None:
    proc = subprocess.run(
        server_cmd("--model-config", "llama-7b"),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert (
        "--model-config 'llama-7b' is neither a config.json or folder on disk nor a preset; "
        f"presets: {', '.join(MODEL_CONFIGS)}"
    ) in proc.stderr


def test_help_names_the_presets() -> None:
    proc = subprocess.run(
        server_cmd("--help"), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m aiosync.testing.sglang_server ")
    text = " ".join(proc.stdout.split())
    assert "or a preset of `aiosync bench --model`: " + ", ".join(MODEL_CONFIGS) in text


@pytest.mark.slow
def test_a_trainer_of_another_size_is_refused_before_any_bucket(tiny_server: str) -> None:
    # The preset has 8 layers; the examples' tiny Qwen3 has 2: the manifest check must see it.
    import anyio

    from aiosync import RefitMismatchError, SGLangHTTPBackend, create_weight_synchronizer
    from aiosync.engines.embedded.configs import TINY_QWEN3
    from aiosync.engines.embedded.model import HFModelRunner
    from aiosync.refit import DTensorRefitSource

    trainer = HFModelRunner.from_config(TINY_QWEN3, seed=1)

    async def init() -> None:
        backend = SGLangHTTPBackend(tiny_server)
        sync = create_weight_synchronizer(
            DTensorRefitSource(trainer.model), backend, colocated=True, backend="sglang"
        )
        # ``async with`` initializes: the manifest check fails on entering the block.
        with pytest.raises(RefitMismatchError, match=r"model\.layers\.2\.self_attn"):
            async with sync:
                pytest.fail("the block must not run")

    anyio.run(init)
