"""A :class:`~aiosync.ray.RayEngine` claims exactly the capabilities of the engine in
its actor: :func:`claiming` makes its class with each method the engine lacks set to
``None`` (how a ``runtime_checkable`` Protocol is told no) and each mirrored property
the engine lacks raising AttributeError."""

from __future__ import annotations

from typing import Any, TypeVar

from ._host import ALWAYS_METHODS, CAPABILITIES, EXTRA_METHODS

__all__ = ["base_class", "claiming"]

E = TypeVar("E")

#: Methods a RayEngine forwards, by the capability that brings them (None: always
#: claimed when the engine has them).
_METHODS_OF: dict[str, str | None] = {
    **{m: name for name, (_, methods, _) in CAPABILITIES.items() for m in methods},
    **{m: None for m in ALWAYS_METHODS + EXTRA_METHODS},
}
_PROPERTIES_OF: dict[str, str] = {
    p: name for name, (_, _, props) in CAPABILITIES.items() for p in props
}
# The engine's own respawns are optional; the actor's are always there.
_KEEP = frozenset({"respawn_dead_workers"})


def _absent(name: str, capability: str) -> property:
    def get(self: object) -> Any:
        raise AttributeError(f"the engine in this actor is no {capability}: it has no {name}")

    return property(get)


def base_class(cls: type[E]) -> type[E]:
    """The class a :func:`claiming` class was made from (itself otherwise)."""
    base: type[E] = getattr(cls, "_claims_for", cls)
    return base


#: One class per (base, capabilities, methods): made once, reused by every RayEngine.
_CLAIMING: dict[tuple[str, frozenset[str], frozenset[str]], type] = {}


def claiming(base: type[E], capabilities: frozenset[str], methods: frozenset[str]) -> type[E]:
    """``base`` less what the engine lacks: its methods ``None`` (a runtime Protocol
    then says no), its mirrored properties raising AttributeError."""
    key = (f"{base.__module__}.{base.__qualname__}#{id(base)}", capabilities, methods)
    made: type[E] | None = _CLAIMING.get(key)
    if made is not None:
        return made
    blocked: dict[str, Any] = {
        m: None
        for m, capability in _METHODS_OF.items()
        if m not in _KEEP and (m not in methods or (capability and capability not in capabilities))
    }
    blocked |= {
        p: _absent(p, capability)
        for p, capability in _PROPERTIES_OF.items()
        if capability not in capabilities
    }
    name = base.__name__
    cls: type[E] = type(
        name, (base,), {**blocked, "_claims_for": base, "__module__": base.__module__}
    )
    cls.__qualname__ = base.__qualname__
    _CLAIMING[key] = cls
    return cls
