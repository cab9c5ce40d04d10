"""Fixtures of the collective-transport tests: one pool of spawned engine workers,
reused by every test, and a trainer model in this process."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from collective_harness import QWEN3, QWEN3_MOE, WorkerPool

#: Worker 3 has a different MLP width: its manifest differs from the trainer's.
MISMATCHED = {**QWEN3, "intermediate_size": 96}
#: Pool layout: 0-2 Qwen3 (as the trainer), 3 mismatched Qwen3, 4 Qwen3-MoE.
POOL_CONFIGS = [QWEN3, QWEN3, QWEN3, MISMATCHED, QWEN3_MOE]


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    workers = WorkerPool(POOL_CONFIGS, seed=1)
    try:
        yield workers
    finally:
        workers.close()


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
