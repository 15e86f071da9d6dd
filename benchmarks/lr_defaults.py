"""Which learning rates should `linearize train` default to? A sweep on the bundled teacher at a few
hundred thousand tokens per stage (what a first run on a laptop or a short GPU run sees), then the
winner against the old defaults at the default budget.

    python benchmarks/lr_defaults.py stage1 OUT     # stage-1 lr sweep (no stage 2)
    python benchmarks/lr_defaults.py stage2 OUT --stage1-lr X   # stage-2 lr sweep after stage 1 at X
    python benchmarks/lr_defaults.py confirm OUT --pair 1e-2,1e-4 --pair X,Y --tokens 1000000

Each run is `linearize.train.run` with the CLI's defaults but the rates (and the token budget);
one JSON line per run goes to OUT/lr_defaults.jsonl: the rates, tokens, the teacher's and the
student's validation loss after each stage, wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from linearize.train import TrainConfig, run


def one(out: Path, stage1_lr: float, stage2_lr: float, stage1_tokens: int, stage2_tokens: int, **kw) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = TrainConfig(out=f"{tmp}/run", stage1_lr=stage1_lr, stage2_lr=stage2_lr, stage1_tokens=stage1_tokens,
                             stage2_tokens=stage2_tokens, progress=False, **kw)
        started = time.perf_counter()
        run(config)
        summary = json.loads(Path(f"{tmp}/run/summary.json").read_text())
    record = {"stage1_lr": stage1_lr, "stage2_lr": stage2_lr, "stage1_tokens": stage1_tokens,
              "stage2_tokens": stage2_tokens, "seconds": round(time.perf_counter() - started, 1),
              **{k: summary.get(k) for k in ("teacher_val_loss", "stage1_val_loss", "student_val_loss", "device")},
              "settings": kw}
    for k in ("teacher_val_loss", "stage1_val_loss", "student_val_loss"):
        if record[k] is not None:
            record[k.replace("loss", "ppl")] = round(math.exp(min(record[k], 50)), 2)
    with open(out / "lr_defaults.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "settings"}), flush=True)
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=("stage1", "stage2", "confirm"))
    p.add_argument("out", type=Path)
    p.add_argument("--tokens", type=int, default=300_000, help="tokens per stage")
    p.add_argument("--lrs", default=None, help="comma list of rates to sweep")
    p.add_argument("--stage1-lr", type=float, default=None)
    p.add_argument("--pair", action="append", default=[], help="STAGE1_LR,STAGE2_LR (confirm)")
    p.add_argument("--val-rows", type=int, default=32)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    kw = {"val_rows": args.val_rows}
    if args.phase == "stage1":
        for lr in map(float, (args.lrs or "3e-3,1e-2,3e-2,1e-1").split(",")):
            one(args.out, lr, 1e-4, args.tokens, 0, **kw)
    elif args.phase == "stage2":
        if args.stage1_lr is None:
            sys.exit("stage2 needs --stage1-lr")
        for lr in map(float, (args.lrs or "1e-4,3e-4,1e-3,3e-3").split(",")):
            one(args.out, args.stage1_lr, lr, args.tokens, args.tokens, **kw)
    else:
        for pair in args.pair:
            a, b = map(float, pair.split(","))
            one(args.out, a, b, args.tokens, args.tokens, **kw)


if __name__ == "__main__":
    main()
