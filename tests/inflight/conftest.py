"""Fixtures of the in-flight policy tests: the OLD and NEW reference models.

The helpers themselves live in ``tests/_support/inflight.py``.
"""

from __future__ import annotations

import pytest
from transformers import PreTrainedModel

from tests._support.inflight import LONG, NEW_SEED, OLD_SEED, PROMPT, build_model, hf_greedy


@pytest.fixture(scope="session")
def old_model() -> PreTrainedModel:
    return build_model(OLD_SEED)


@pytest.fixture(scope="session")
def new_model() -> PreTrainedModel:
    return build_model(NEW_SEED)


@pytest.fixture(scope="session")
def old_tokens(old_model: PreTrainedModel) -> list[int]:
    """OLD's greedy output for PROMPT, LONG tokens (transformers' generate)."""
    return hf_greedy(old_model, PROMPT, LONG)
