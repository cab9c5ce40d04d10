"""GPU tests: collected only with ``-m gpu``; skipped, with the reason, without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# gpu_checks.py is both a script (run.sh) and this directory's helper module;
# the spawned receiver process imports it by this name too.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    reason = f"needs a CUDA device (torch {torch.__version__}, cuda available: False)"
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
