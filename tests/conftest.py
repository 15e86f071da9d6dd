"""Puts tests/ on sys.path, so test modules in subfolders (tests/ops/, ...) import the shared
helpers (``fixtures``, ``helpers``, ``kernel_cases``) as the top-level ones do."""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
