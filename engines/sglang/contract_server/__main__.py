"""``python -m aiosync.engines.sglang.contract_server``: the same as ``python -m
aiosync.testing.sglang_server``."""

from aiosync.engines.sglang.contract_server._cli import main

main()
