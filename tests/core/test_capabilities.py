"""``implements(obj, P)``: the sync's hot path asks it instead of ``isinstance``, so
it must answer as ``isinstance`` does for every capability Protocol and engine."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from aiosync import capabilities
from aiosync.capabilities import implements
from aiosync.engines.embedded.configs import TINY_QWEN3
from aiosync.engines.embedded.engine import EmbeddedEngine
from aiosync.engines.fleet import EngineFleet
from aiosync.engines.sglang.backend import SGLangHTTPBackend
from aiosync.engines.vllm.server import VLLMServerBackend

PROTOCOLS = [
    p
    for _, p in inspect.getmembers(capabilities, inspect.isclass)
    if getattr(p, "_is_runtime_protocol", False) and p.__module__ == capabilities.__name__
]


class Halfway:
    """Has an engine's wake but its sleep set to None (a method member that is None)."""

    async def prepare_for_generation(self, tags: Any = None) -> None:
        return None

    finish_generation = None


class Elastic:
    """An elastic fleet whose epoch is an instance attribute, not a class one."""

    def __init__(self) -> None:
        self.membership_epoch = 0

    async def set_aside_failed(self, error: BaseException) -> list[tuple[str, str]]:
        return []

    def take_joined(self) -> list[str]:
        return []


def _objects() -> list[object]:
    embedded = EmbeddedEngine(TINY_QWEN3, num_workers=1)
    return [
        embedded,
        EngineFleet([embedded]),
        SGLangHTTPBackend("http://127.0.0.1:1"),
        VLLMServerBackend("http://127.0.0.1:1"),
        Halfway(),
        Elastic(),
        object(),
        None,
    ]


def test_the_protocols_are_found() -> None:
    assert {"Engine", "PausableEngine", "ElasticEngines", "EngineSet"} <= {
        p.__name__ for p in PROTOCOLS
    }


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.__name__)
def test_implements_answers_as_isinstance(protocol: type) -> None:
    answers = [(type(o).__name__, implements(o, protocol)) for o in _objects()]
    assert answers == [(type(o).__name__, isinstance(o, protocol)) for o in _objects()]


def test_members_on_the_instance_and_none_methods_count_as_isinstance_counts_them() -> None:
    embedded, _fleet, *_servers, halfway, elastic, _obj, _none = _objects()
    assert implements(embedded, capabilities.PausableEngine)
    assert implements(elastic, capabilities.ElasticEngines)  # its epoch set in __init__
    assert not implements(halfway, capabilities.Engine)  # finish_generation is None
