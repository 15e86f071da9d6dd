"""Which LION form is faster for short inputs: one LION layer's forward, and forward + backward, in
the chunk and the parallel form at 1024 tokens per call (B x T = 32 x 32 ... 1 x 1024), with and
without exact keys, on this machine's CPU. It chose ``layers.lion.AUTO_PARALLEL_MAX`` (the
default form ``auto`` runs parallel up to that length, chunk beyond). Writes OUT.json and OUT.md.

    .venv/bin/python benchmarks/probes/lion_forms_short.py --out docs/results/lion-forms-short --threads 2
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from linearize.records import environment, markdown_table
from linearize.layers.lion import AUTO_PARALLEL_MAX, LionAttention, LionConfig

SHAPES = ((32, 32), (16, 64), (8, 128), (4, 256), (2, 512), (1, 1024))
EXACT = {"pure": {}, "sinks 1 + window 2": {"sinks": 1, "window": 2}}


def time_layer(layer: LionAttention, B: int, T: int, form: str, backward: bool, repeats: int) -> float:
    """Median ms of ``repeats`` calls (after one warm-up) on MiniLM-shaped random inputs."""
    H, D, HID = layer.num_heads, layer.head_dim, layer.hidden_size
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g, requires_grad=backward) for _ in range(3))
    x = torch.randn(B, T, HID, generator=g)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            y = layer(q, k, v, x, form=form)
            if backward:
                y.sum().backward()
        if i:
            times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="path stem: OUT.json and OUT.md are written")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--variant", default="s", choices=["lit", "d", "s"])
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    rows = []
    for label, exact in EXACT.items():
        layer = LionAttention(LionConfig(variant=a.variant, **exact), 12, 32, 384)  # MiniLM's attention shape
        for B, T in SHAPES:
            row = {"keys": label, "B": B, "T": T}
            for form in ("chunk", "parallel"):
                for backward in (False, True):
                    row[f"{form} {'fwd+bwd' if backward else 'fwd'} ms"] = time_layer(layer, B, T, form, backward,
                                                                                       a.repeats)
            rows.append(row)
            print(json.dumps(row), flush=True)
    command = "python " + " ".join(shlex.quote(x) for x in [sys.argv[0], *(argv or sys.argv[1:])])
    env = {**environment("cpu"), "command": command, "threads": a.threads, "auto_parallel_max": AUTO_PARALLEL_MAX}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"environment": env, "variant": a.variant, "rows": rows}, indent=1))
    cols = [c for c in rows[0] if c.endswith("ms")]
    md = [f"# LION forms on short inputs (lion-{a.variant}, 12 heads of 32, {a.threads} CPU threads)", "",
          "One LION layer, median ms over {} calls; B x T = 1024 tokens per call.".format(a.repeats), "",
          markdown_table(["keys", "B x T", *cols],
                         [[r["keys"], f"{r['B']} x {r['T']}", *(round(r[c], 1) for c in cols)] for r in rows]), "",
          f"The default form `auto` runs the parallel form up to {AUTO_PARALLEL_MAX} tokens and the chunk form "
          "beyond.", "", f"Device: {env['device']}; torch {env['torch']}. Command: `{command}`", ""]
    out.with_suffix(".md").write_text("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
