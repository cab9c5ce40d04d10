"""The kit's asserts are pytest's (rewritten: a failing cell shows its values)."""

import pytest

pytest.register_assert_rewrite("aiosync.testing.conformance")
