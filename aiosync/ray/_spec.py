"""What an engine actor builds: :class:`EngineSpec`, a picklable recipe for one engine.

The spec travels to the actor (Ray pickles it) and is built there, so the
engine's processes, sockets and memory belong to the actor's process, on the
actor's node and devices. See ``docs/ray.md``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread

__all__ = ["EMBEDDED_ENGINE", "EngineSpec"]

#: The factory path of the embedded reference engine.
EMBEDDED_ENGINE = "aiosync.engines.embedded.engine:EmbeddedEngine"


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """How to build an engine inside an actor: ``factory(*args, **kwargs)``, then ``start()``.

    Attributes:
        factory: ``"package.module:Name"`` or ``"package.module:Name.method"``
            (a class or a classmethod such as vLLM's
            ``"aiosync.engines.vllm.backend:VLLMGenerationBackend.from_model"``),
            imported in the actor.
        args: positional arguments of ``factory`` (picklable).
        kwargs: keyword arguments of ``factory`` (picklable).
        start: the method awaited (or called) once the factory returned, when
            the engine has it (the embedded engine's ``start()`` spawns its
            workers); None: none.
        in_thread: call ``factory`` in a worker thread (a blocking constructor,
            such as ``VLLMGenerationBackend.from_model``), so that the actor's
            event loop keeps answering; False: on the loop (the embedded engine
            must be built there).

    Raises:
        ValueError: ``factory`` is not ``"module:qualified.name"``.
    """

    factory: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    start: str | None = "start"
    in_thread: bool = False

    def __post_init__(self) -> None:
        module, sep, name = self.factory.partition(":")
        if not (module and sep and name) or not all(
            part.isidentifier() for part in (*module.split("."), *name.split("."))
        ):
            raise ValueError(
                f"factory must be 'package.module:Name' (a class or classmethod), got "
                f"{self.factory!r}"
            )

    @classmethod
    def embedded(cls, model: object, **options: Any) -> EngineSpec:
        """The embedded reference engine: ``EmbeddedEngine(model, **options)``, started.

        ``model`` and ``options`` as :class:`~aiosync.EmbeddedEngine` takes them
        (a config dict or ``PretrainedConfig``, ``num_workers=``, ``seed=``,
        ``dtype=``, ...); its worker processes are the actor's children.
        """
        return cls(EMBEDDED_ENGINE, (model,), dict(options))

    async def build(self) -> Any:
        """Import the factory, build the engine and start it (in the actor).

        Raises:
            ImportError, AttributeError: the factory cannot be imported.
            Whatever the factory or ``start`` raises.
        """
        factory = _resolve(self.factory)
        call = functools.partial(factory, *self.args, **dict(self.kwargs))
        engine = await anyio.to_thread.run_sync(call) if self.in_thread else call()
        if inspect.isawaitable(engine):
            engine = await engine
        starter = getattr(engine, self.start, None) if self.start else None
        if callable(starter):
            started = starter()
            if inspect.isawaitable(started):
                await started
        return engine


def _resolve(path: str) -> Any:
    """The object ``"package.module:Name.attr"`` names."""
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj
