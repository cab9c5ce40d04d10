"""Read an HF config uniformly, whether a ``PretrainedConfig`` or a ``config.json`` dict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_MISSING = object()


class ConfigView:
    """Attribute-or-key access to an HF config, with aliases for renamed fields.

    transformers 5.24 re-serialises some fields under other names
    (``num_experts`` → ``num_local_experts``); :meth:`get` tries each alias.
    """

    def __init__(self, config: Any) -> None:
        self.raw = config

    def get(self, *names: str, default: Any = _MISSING) -> Any:
        """The first of ``names`` the config has (and is not ``None``).

        Raises:
            ValueError: none present and no ``default``.
        """
        for name in names:
            if isinstance(self.raw, Mapping):
                value = self.raw.get(name)
            else:
                value = getattr(self.raw, name, None)
            if value is not None:
                return value
        if default is _MISSING:
            raise ValueError(f"config has no {' / '.join(names)}")
        return default

    def int(self, *names: str, default: Any = _MISSING) -> int:
        """:meth:`get` as an ``int``."""
        return int(self.get(*names, default=default))

    def sub(self, name: str) -> ConfigView:
        """A nested config (``text_config`` of a multimodal config)."""
        return ConfigView(self.get(name))
