"""Probe (issue 42): does compiling the small per-layer modules (Hedgehog feature maps, gates) with
torch.compile shorten the graphed training step? Stage 2 and stage 1 of SmolLM2-135M (random weights),
graphed, with and without, side by side in one process.

    python benchmarks/probes/train_step_compile.py OUT [T B]...
"""
import json
import sys

import torch

from linearize.bench import train as bt
from linearize.layers.feature_maps import HedgehogFeatureMap
from linearize.layers.gates import GATES

real_make_stage = bt.make_stage
MODE = {"compile": False}


def make_stage(model, stage, method, device):
    st = real_make_stage(model, stage, method, device)
    if MODE["compile"]:
        for m in model.modules():
            if isinstance(m, (HedgehogFeatureMap, *GATES.values())):
                m.compile()
    return st


bt.make_stage = make_stage
out = sys.argv[1]
pairs = [(int(a), int(b)) for a, b in zip(sys.argv[2::2], sys.argv[3::2])] or [(2048, 8), (16384, 1)]
dev = torch.device("cuda")
rows = []
for T, B in pairs:
    for stage in ("stage2", "stage1"):
        for comp in (False, True):
            MODE["compile"] = comp
            c = bt.run_cell("smollm2-135m-random", T, "lizard", stage, "kernels", batch_size=B, steps=8, warmup=3,
                            device=dev, layers=None, ours=set(), graph=True)
            c.pop("top_kernels_by_launches", None), c.pop("top_kernels_by_time", None)
            rows.append(c)
            print(T, B, stage, "compile" if comp else "plain", round(c.get("step_ms_median", -1), 1),
                  round(c.get("gpu_kernel_ms", -1), 1), c.get("gpu_launches"), c.get("graph_failed"), flush=True)
json.dump(rows, open(f"{out}/compile_probe.json", "w"), indent=1)
