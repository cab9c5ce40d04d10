"""The two-rank harness of gpu_checks.py, run over gloo on CPU, so that the NCCL
run on a two-GPU machine exercises a harness already known to work."""

from __future__ import annotations

import socket

import gpu_checks


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_rank_collective_harness_moves_weights_bit_exactly_over_gloo() -> None:
    manifest = gpu_checks.qwen3_manifest(gpu_checks.QWEN3_TINY)
    result = gpu_checks.collective_refit(
        manifest, backend="gloo", bucket_bytes=64 * 1024, rounds=2, port=_port()
    )
    assert result["backend"] == "gloo"
    assert result["buckets"] > 2
    assert result["weight_version"] == 2
    assert result["mismatched"] == []
    assert result["bit_exact"] is True
