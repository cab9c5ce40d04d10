"""Helpers shared by the test directories, imported as ``tests._support`` (the repository
root is on ``sys.path``: ``pythonpath`` in pyproject's pytest options, ``PYTHONPATH`` in the
spawned rank processes).

- :mod:`.modules`: import a helper file (a sibling ``_models.py``, an example script) by path.
- :mod:`.inflight`: the models, prompts and fault source of ``tests/inflight``.
- :mod:`.net`: free loopback ports (``free_ports``).

Dict-backed trainers are :class:`aiosync.testing.StateDictSource`, not test code.
"""
