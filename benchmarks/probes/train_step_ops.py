"""Probe (issue 42): where does the student's training step spend its GPU time outside the attention kernels?
One eager step of each cell under the profiler, kernel time grouped by the aten op (and input shapes) that
launched it, the student's small modules compiled as `linearize train` does on CUDA.

    python benchmarks/probes/train_step_ops.py OUT [T B]... [--method lizard-recall]

(the student's method: lizard by default; the teacher's step is profiled beside it in each cell)
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from linearize.bench import train as bt
from linearize.bench.generate import build_model
from linearize.train.graphs import compile_attention_modules
from linearize.train.loop import optimizer_step

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("cells", nargs="*", type=int, help="T B pairs (default 16384 1)")
parser.add_argument("--method", default="lizard")
a = parser.parse_args()
out, method = a.out, a.method
pairs = list(zip(a.cells[::2], a.cells[1::2])) or [(16384, 1)]
dev = torch.device("cuda")
report = []
for T, B in pairs:
    for stage in ("teacher", "stage2"):
        model, _ = build_model("smollm2-135m-random", torch.float32, dev)
        st, params, config = bt.make_stage(model, stage, method, dev)
        compile_attention_modules(model)
        opt = torch.optim.AdamW(params, lr=st.lr)
        batch = bt.random_batch(model.config.vocab_size, B, T)
        for _ in range(3):
            optimizer_step(st, params, opt, [batch], config, dev)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            optimizer_step(st, params, opt, [batch], config, dev)
            torch.cuda.synchronize()
        table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=45,
                                                                     max_name_column_width=40,
                                                                     max_shapes_column_width=70)
        head = f"\n===== {stage if stage == 'teacher' else method + ' ' + stage} T{T} B{B}\n"
        report.append(head + table)
        print(head + "\n".join(table.splitlines()[:30]), flush=True)
        del model, opt, st, params
        torch.cuda.empty_cache()
open(f"{out}/train_step_ops-{method}.txt", "w").write("\n".join(report))
