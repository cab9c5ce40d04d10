"""The SGLang test server's ``/get_weights_by_name``, as SGLang 0.5.23 answers it.

SGLang's route (``entrypoints/http_server.py``) takes ``GetWeightsByNameReqInput``
(``name``, ``truncate_size`` = 100), GET or POST, and answers 200 with
``LlamaForCausalLM.get_weights_by_name``'s ``param.float().tolist()[:truncate_size]``
of TP rank 0 (the first entries of the FIRST dimension), or 400
``{"error": {"message": "Get parameter by name failed"}}`` where the method returns
None. Servers run in this process, so every rank's tensors are read straight from
``ServerState.ranks``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.model import HFModelRunner
from aiosync.testing.sglang_server import ServerState, make_server
from aiosync.transports._verify import transit_fault

FAILED = {"error": {"message": "Get parameter by name failed"}}
LAYER = "model.layers.0"


@contextlib.contextmanager
def _serving(tp_size: int) -> Iterator[tuple[str, ServerState]]:
    runner = HFModelRunner.from_config(TINY_QWEN3, seed=1, dtype=torch.bfloat16)
    state = ServerState(runner=runner, tp_size=tp_size)
    server = make_server(state)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def tp1() -> Iterator[tuple[str, ServerState]]:
    with _serving(1) as served:
        yield served


@pytest.fixture(scope="module")
def tp2() -> Iterator[tuple[str, ServerState]]:
    with _serving(2) as served:
        yield served


def _read(url: str, body: Any, method: str = "POST") -> httpx.Response:
    return httpx.request(method, f"{url}/get_weights_by_name", json=body, timeout=30.0)


def _rows(url: str, name: str, truncate_size: int | None = None) -> torch.Tensor:
    body: dict[str, Any] = {"name": name}
    if truncate_size is not None:
        body["truncate_size"] = truncate_size
    response = _read(url, body)
    assert response.status_code == 200, response.text
    return torch.tensor(response.json(), dtype=torch.float32)


def _weight(state: ServerState, name: str, rank: int = 0) -> torch.Tensor:
    return state.ranks[rank].hf_state_dict()[name].to(torch.float32)


def test_the_answer_is_the_first_rows_as_float32_and_truncate_size_defaults_to_100(
    tp1: tuple[str, ServerState],
) -> None:
    url, state = tp1
    embed = _weight(state, "model.embed_tokens.weight")  # (128, 64)
    # The first dimension is truncated: rows of a matrix, whole rows.
    assert torch.equal(_rows(url, "model.embed_tokens.weight"), embed[:100])
    assert torch.equal(_rows(url, "model.embed_tokens.weight", 3), embed[:3])
    assert torch.equal(_rows(url, "model.embed_tokens.weight", 10_000), embed)
    # Elements of a vector; GET takes the same body.
    norm = _weight(state, "model.norm.weight")
    response = _read(url, {"name": "model.norm.weight", "truncate_size": 5}, method="GET")
    assert response.status_code == 200 and response.json() == norm[:5].tolist()
    # The row-parallel layers, whole (nothing to gather on one rank).
    down = _weight(state, f"{LAYER}.mlp.down_proj.weight")
    assert torch.equal(_rows(url, f"{LAYER}.mlp.down_proj.weight", 64), down)


def test_stacked_names_are_sglangs_rows_of_the_fused_layers(
    tp1: tuple[str, ServerState],
) -> None:
    url, state = tp1
    gate, up = (_weight(state, f"{LAYER}.mlp.{p}_proj.weight") for p in ("gate", "up"))
    assert torch.equal(_rows(url, f"{LAYER}.mlp.gate_proj.weight", 1000), gate)
    assert torch.equal(_rows(url, f"{LAYER}.mlp.up_proj.weight", 1000), up)
    q, k = (_weight(state, f"{LAYER}.self_attn.{p}_proj.weight") for p in ("q", "k"))
    # SGLang narrows qkv_proj with hidden_size // num_attention_heads = 16 as the head
    # size, this Qwen3's head_dim is 32: q comes back as its first 4 * 16 rows, and k
    # as more rows of q (offset 64, 2 * 16 rows).
    assert torch.equal(_rows(url, f"{LAYER}.self_attn.q_proj.weight", 1000), q[:64])
    assert torch.equal(_rows(url, f"{LAYER}.self_attn.k_proj.weight", 1000), q[64:96])
    assert not torch.equal(_rows(url, f"{LAYER}.self_attn.k_proj.weight", 1000), k[:32])


def test_tp2_answers_rank_0s_shard_and_gathers_row_parallel_layers(
    tp2: tuple[str, ServerState],
) -> None:
    url, state = tp2
    # Column-parallel: rank 0's rows only (64 of the 128 of the embedding, 64 of the
    # gate's 128 intermediate rows); its q: 2 of 4 heads, SGLang's 16 rows each.
    embed = _weight(state, "model.embed_tokens.weight")
    assert torch.equal(_rows(url, "model.embed_tokens.weight", 1000), embed[:64])
    gate = _weight(state, f"{LAYER}.mlp.gate_proj.weight")
    assert torch.equal(_rows(url, f"{LAYER}.mlp.gate_proj.weight", 1000), gate[:64])
    q = _weight(state, f"{LAYER}.self_attn.q_proj.weight")
    assert torch.equal(_rows(url, f"{LAYER}.self_attn.q_proj.weight", 1000), q[:32])
    # Row-parallel: each rank's columns, from that rank's own copy.
    name = f"{LAYER}.self_attn.o_proj.weight"
    with torch.no_grad():
        state.ranks[1].model.get_parameter(name)[:, 64:] += 1.0
    try:
        expected = torch.cat([_weight(state, name, 0)[:, :64], _weight(state, name, 1)[:, 64:]], 1)
        assert torch.equal(_rows(url, name, 1000), expected)
    finally:
        with torch.no_grad():
            state.ranks[1].model.get_parameter(name)[:, 64:] -= 1.0


def test_non_finite_values_are_null_as_orjson_writes_them(
    tp1: tuple[str, ServerState],
) -> None:
    url, state = tp1
    name = "model.layers.1.input_layernorm.weight"
    weight = state.runner.model.get_parameter(name)
    saved = weight.detach().clone()
    with torch.no_grad():
        weight[1] = float("nan")
        weight[2] = float("inf")
    try:
        answer = _read(url, {"name": name, "truncate_size": 4}).json()
        assert answer == [float(saved[0]), None, None, float(saved[3])]
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_what_sglang_cannot_read_is_a_400_and_a_malformed_body_a_422(
    tp1: tuple[str, ServerState],
) -> None:
    url, _ = tp1
    for name in ("model.layers.9.mlp.down_proj.weight", "model.layers.0.self_attn.k_scale", ""):
        response = _read(url, {"name": name})
        assert (response.status_code, response.json()) == (400, FAILED), name
    for body in ({}, {"name": 3}, {"name": "model.norm.weight", "truncate_size": "5"}):
        assert _read(url, body).status_code == 422, body


def test_arming_the_transit_fault_takes_a_bucket_and_a_byte(
    tp1: tuple[str, ServerState],
) -> None:
    url, _ = tp1
    for body in ({"bucket": 0}, {"bucket": -1, "byte": 0}, {"bucket": 0, "byte": "1"}):
        response = httpx.post(f"{url}/_aiosync/arm_transit_fault", json=body, timeout=30.0)
        assert response.status_code == 400, body


def test_an_armed_transit_fault_flips_only_the_bits_of_its_mask(
    tp1: tuple[str, ServerState],
) -> None:
    url, _ = tp1
    for mask in (0, 256, "64"):
        body = {"bucket": 7, "byte": 0, "mask": mask}
        response = httpx.post(f"{url}/_aiosync/arm_transit_fault", json=body, timeout=30.0)
        assert response.status_code == 400, body
    body = {"bucket": 7, "byte": 5, "mask": 0x40}  # one exponent bit (the fault matrix's)
    httpx.post(f"{url}/_aiosync/arm_transit_fault", json=body, timeout=30.0).raise_for_status()
    received = torch.full((16,), 0x81, dtype=torch.uint8)
    transit_fault(received, 7)  # what TP rank 0 does to bucket 7 as it arrives
    expected = torch.full((16,), 0x81, dtype=torch.uint8)
    expected[5] = 0xC1
    assert torch.equal(received, expected)
    # Without a mask the whole byte flips, as before.
    body = {"bucket": 7, "byte": 2}
    httpx.post(f"{url}/_aiosync/arm_transit_fault", json=body, timeout=30.0).raise_for_status()
    transit_fault(received, 7)
    expected[2] = 0x7E
    assert torch.equal(received, expected)


def test_the_request_log_keeps_only_its_last_entries() -> None:
    runner = HFModelRunner.from_config(TINY_QWEN3, seed=1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="log_limit must be >= 1, got 0"):
        ServerState(runner=runner, log_limit=0)
    state = ServerState(runner=runner, log_limit=2)
    server = make_server(state)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for name in (f"{LAYER}.mlp.up_proj.weight", f"{LAYER}.mlp.down_proj.weight", "lm_head"):
            _read(url, {"name": name, "truncate_size": 1})
        log = httpx.get(f"{url}/_aiosync/log", timeout=30.0).json()
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    # The oldest of three reads is gone; the last two stay, in order.
    assert [entry["name"] for entry in log] == [f"{LAYER}.mlp.down_proj.weight", "lm_head"]
