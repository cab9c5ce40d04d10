"""Shared test configuration: every test here runs on CPU with real processes and sockets."""

from __future__ import annotations

import os

# Tests never download: models are built from small configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
