"""Fixtures of the adapter-only refit tests (helpers in ``lora_harness.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from lora_harness import LoRATrainer


@pytest.fixture
def trainer() -> LoRATrainer:
    """A fresh PEFT LoRA trainer on the engines' base model (random nonzero lora_B)."""
    return LoRATrainer()
