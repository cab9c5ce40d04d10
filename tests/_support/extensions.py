"""Worker extensions the tests name by dotted path (``worker_extension_cls``): an
engine worker imports them, so they live in an importable module, not a test file."""

from __future__ import annotations

import os


class EnvironmentReader:
    """The worker's view of its environment, as an RPC."""

    def read_environment(self, name: str) -> str | None:
        """``os.environ.get(name)`` in the worker process."""
        return os.environ.get(name)
