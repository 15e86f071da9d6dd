"""Puts tests/ on sys.path, so test modules in subfolders (tests/ops/, ...) import the shared
helpers (``fixtures``, ``helpers``, ``kernel_cases``) as the top-level ones do."""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def pytest_collection_modifyitems(session, config, items):
    """Modules with slow tests run first, those most made of slow tests first, each module's tests
    kept together and in order (its module fixtures are set up once): on CI's two workers a long
    test started last runs alone while the other worker idles."""
    counts: dict[str, list[int]] = {}
    for item in items:
        c = counts.setdefault(item.nodeid.split("::")[0], [0, 0])
        c[0] += 1
        c[1] += item.get_closest_marker("slow") is not None
    items.sort(key=lambda item: -counts[item.nodeid.split("::")[0]][1] / counts[item.nodeid.split("::")[0]][0])
