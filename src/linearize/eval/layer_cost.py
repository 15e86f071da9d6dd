"""The cost of one attention layer, measured in the process that calls it: ``eval embed`` runs
``measure_layer`` in a fresh Python process per (form, length), so this module imports torch and the
LION layer only (not transformers, seconds of start-up in each of those processes)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch


def _rss_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", status).group(1))


def measure_layer(form: str, length: int, *, heads: int, head_dim: int, hidden: int, lion: dict | None,
                  threads: int, max_seconds: float = 3.0, max_repeats: int = 5) -> dict:
    """Time (ms) and extra memory (MiB) of one attention layer on (1, heads, length, head_dim) q/k/v.

    Meant to run in a fresh process (``eval.embed.attention_cost`` starts one per call) so that the memory peak belongs to
    this call alone. ``lion``: the LionConfig fields (``form`` is overridden); None for SDPA.
    """
    from ..layers.lion import LionAttention, LionConfig

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, head_dim) for _ in range(3))
    x = torch.randn(1, length, hidden)
    if form == "sdpa":
        def run():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    else:
        layer = LionAttention(LionConfig().with_overrides(**{**lion, "form": form}), heads, head_dim, hidden)

        def run():
            return layer(q, k, v, x)
    with torch.no_grad():
        clear_refs = Path("/proc/self/clear_refs")
        try:
            clear_refs.write_text("5")  # reset the peak resident size to the current one
            before = _rss_kib("VmRSS")
        except OSError:
            before = None
        start = time.perf_counter()
        out = run()
        first = time.perf_counter() - start
        extra = (_rss_kib("VmHWM") - before) / 1024 if before is not None else None
        del out
        times = []
        while len(times) < max_repeats and (not times or sum(times) + first < max_seconds):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    times.sort()
    return {"ms": 1e3 * times[len(times) // 2], "first_ms": 1e3 * first, "repeats": len(times), "extra_mib": extra}
