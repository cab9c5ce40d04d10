"""The docs' capability table (``docs/capabilities.md``), generated from the declarations."""

from __future__ import annotations

from collections.abc import Callable

from aiosync.options import TRANSPORT_OPTIONS, TransportCapabilities

from .cases import CASES, capabilities_of

#: The docs' columns: (header, what a cell says).
CAPABILITY_COLUMNS: tuple[tuple[str, Callable[[TransportCapabilities], str]], ...] = (
    ("verify", lambda c: ", ".join(repr(m) for m in (False, "sample", True) if m in c.verify)),
    ("delta", lambda c: _yes(c.delta)),
    ("kv_scales", lambda c: _yes(c.kv_scales)),
    ("trace", lambda c: _yes(c.trace)),
    ("elastic", lambda c: _yes(c.elastic)),
    ("sharded_trainer", lambda c: _yes(c.sharded_trainer)),
    ("verify_engine", lambda c: _yes(c.verify_engine)),
)


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def capability_table() -> str:
    """The docs' capability table (markdown), generated from each transport's declared
    :class:`~aiosync.TransportCapabilities`; the last column names the kit's case."""
    kit = {case.options: case.name for case in CASES}
    header = ["transport (options)", *(name for name, _ in CAPABILITY_COLUMNS), "kit case"]
    rows = [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]
    for options in TRANSPORT_OPTIONS:
        caps = capabilities_of(options)
        name = f"`{options.transport[1]}` (`{options.__name__}`)"
        cells_ = [render(caps) for _, render in CAPABILITY_COLUMNS]
        rows.append("| " + " | ".join([name, *cells_, kit.get(options, "-")]) + " |")
    return "\n".join(rows) + "\n"
