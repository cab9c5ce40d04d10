"""msgpack messages and re-typed remote errors, shared by the IPC transport and the embedded engine.

Nothing here unpickles: a peer can send data, never code.
"""

from __future__ import annotations

import builtins
from typing import Any

import msgpack

from aiosync import errors
from aiosync.errors import TransportError

# Exception types a worker's error may be re-raised as in the parent; anything
# else becomes a TransportError carrying the worker's type name and message.
_ERROR_TYPES: dict[str, type[Exception]] = {
    name: getattr(errors, name) for name in errors.__all__
} | {
    name: getattr(builtins, name)
    for name in ("ValueError", "TypeError", "KeyError", "NotImplementedError", "AttributeError")
}


def encode(obj: Any) -> bytes:
    """msgpack-encode ``obj`` (str, int, float, bool, None, bytes, list, dict)."""
    return msgpack.packb(obj, use_bin_type=True)


def decode(payload: bytes) -> dict[str, Any]:
    """Decode one message; it must be a map.

    Raises:
        TransportError: the bytes are not a msgpack map.
    """
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise TransportError(f"undecodable message ({len(payload)} bytes): {exc!r}") from exc
    if not isinstance(msg, dict):
        raise TransportError(f"message is a {type(msg).__name__}, expected a map")
    return msg


def error_fields(exc: BaseException) -> dict[str, str]:
    """``{"type", "message"}`` describing ``exc`` for the wire."""
    return {"type": type(exc).__name__, "message": str(exc)}


def rebuild_error(fields: dict[str, Any], where: str) -> Exception:
    """The exception a worker reported, re-typed where the type is known.

    Args:
        fields: ``{"type", "message"}`` from :func:`error_fields`.
        where: who raised it, for the message (``"engine worker 1"``).
    """
    type_name = str(fields.get("type", "Exception"))
    message = str(fields.get("message", ""))
    cls = _ERROR_TYPES.get(type_name)
    if cls is None:
        return TransportError(f"{where} raised {type_name}: {message}")
    return cls(f"{where}: {message}")
