"""Import a Python file by path, once per process, under a fixed module name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_module"]


def load_module(path: Path, name: str | None = None) -> ModuleType:
    """Import ``path`` as module ``name`` (default: the file's stem) and keep it in
    ``sys.modules``, so a second call, a spawned script importing the same name from its
    own ``sys.path``, and dataclasses (which look their module up) all see one module.

    Used for helper files pytest's importlib mode keeps off ``sys.path`` (``_models.py``
    beside the tests) and for scripts that are not packages (``examples/*.py``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    name = name or path.stem
    if name in sys.modules:
        return sys.modules[name]
    if not path.is_file():
        raise FileNotFoundError(path)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a half-run module must not be served next time
        raise
    return module
