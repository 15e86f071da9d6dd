"""The main job (``make demo`` = ``linearize demo``): linearize the bundled SmolLM2-135M with Lizard
on the built-in Shakespeare text in a few CPU minutes, and show what that buys and what it does not.

    1. the plan               what will run and roughly how long
    2. training               ``linearize.train.run``: stage 1 (attention transfer), stage 2 (LoRA);
                              re-running resumes the same run in ``out`` instead of starting over
    3. transfer MSE           each layer's validation MSE before and after stage 1
    4. answers                teacher and student, greedy, on a few chat prompts; validation perplexity
    5. decode memory          bytes of the teacher's KV cache and of the student's state as the
                              context grows (measured with ``models.cache.cache_bytes``)
    6. the shipped student    where the package holds a trained student of this teacher
                              (``models.students``, e.g. ``smollm2-135m-lizard``): its answers,
                              validation perplexity and decode memory beside the teacher's, measured
                              as in 4 and 5, to show what the full recipe gives
    7. closing note           what a few CPU minutes can and cannot do, and the full recipe on a GPU

Every number printed is measured in this run; nothing about the results is hard-coded.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import textwrap
import time
from pathlib import Path

from ..records import human_size
from .args import DEVICE_HELP, add_command, argtype, parse_device

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a linear function is.",
)

# Seconds per optimizer step on the 2-core CPU this demo targets (SmolLM2-135M, lizard, seq_len 256, batch 2,
# nothing else running; validations included), used only for the printed estimate.
CPU_STAGE1_STEP_S = 4.3
CPU_STAGE2_STEP_S = 9.5

# Token budgets of the papers, per stage (lizard-v2 Table: 20M tokens per stage; LoLCATs: 20M
# tokens for attention transfer and 20M for LoRA, "40M tokens overall").
PAPER_TOKENS_PER_STAGE = 20_000_000

EXIT_USAGE = 2
RULE = "=" * 78
_started = time.perf_counter()  # reset by run_demo; headings show the time since


def run_demo(out: str = "runs/demo", device: str = "auto", *, model: str = "smollm2-135m",
             seq_len: int = 256, batch_size: int = 2, stage1_steps: int = 48, stage2_steps: int = 16,
             prompts: list[str] | None = None, max_new_tokens: int = 40,
             contexts: tuple[int, ...] = (256, 1024, 2048)) -> int:
    """Run the demo end to end; returns the process exit code (0 on success, 2 when ``out``
    holds a different run)."""
    global _started
    started = _started = time.perf_counter()
    prompts = list(DEFAULT_PROMPTS if prompts is None else prompts)
    contexts = tuple(contexts)
    _check_arguments(stage1_steps, stage2_steps, prompts, max_new_tokens, contexts)
    config = _train_config(out, device, model, seq_len, batch_size, stage1_steps, stage2_steps)
    config.validate()

    problem = _existing_run_problem(Path(out), config)
    if problem:
        print(f"linearize demo: {problem}", file=sys.stderr)
        return EXIT_USAGE

    show_plan(config, stage1_steps, stage2_steps, prompts, contexts)
    train(config)
    mse = show_transfer_mse(Path(out))
    teacher, student, tokenizer = load_models(Path(out), config)
    answers = show_answers(Path(out), teacher, student, tokenizer, prompts, max_new_tokens)
    memory = show_decode_memory(teacher, student, tokenizer, contexts)
    del student
    shipped = show_shipped_students(Path(out), config, teacher, tokenizer, prompts, max_new_tokens, answers, memory)
    del teacher
    show_closing_note(Path(out), config, mse, memory, shipped)
    _heading(f"Done in {_duration(time.perf_counter() - started)}")
    return 0


# ------------------------------------------------------------------------------------- set-up


def _check_arguments(stage1_steps, stage2_steps, prompts, max_new_tokens, contexts) -> None:
    for name, value in (("stage1_steps", stage1_steps), ("stage2_steps", stage2_steps),
                        ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of non-empty strings, got {prompts!r}")
    if not contexts or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 2 for c in contexts):
        raise ValueError(f"contexts must be a non-empty tuple of integers >= 2, got {contexts!r}")


def _train_config(out, device, model, seq_len, batch_size, stage1_steps, stage2_steps):
    from ..train.config import TrainConfig

    every = max(1, round(stage1_steps / 6))  # ~6 validations in stage 1, ~2 in stage 2
    return TrainConfig(
        method="lizard", model=model, data="shakespeare", out=str(out), seq_len=seq_len,
        batch_size=batch_size, stage1_tokens=stage1_steps * batch_size * seq_len,
        stage2_tokens=stage2_steps * batch_size * seq_len,
        warmup_steps=max(1, min(stage1_steps, stage2_steps) // 4), eval_every=every, save_every=every,
        val_rows=4, device=device)


def _existing_run_problem(out: Path, config) -> str | None:
    """Why ``out`` cannot be used for this demo, or None (empty, absent, or the same run)."""
    from ..train.run import CONFIG_FILE, changed_settings, read_run_config

    if not out.exists():
        return None
    if not out.is_dir():
        return f"{out} exists and is not a directory; pass another --out"
    if not any(out.iterdir()):
        return None
    if not (out / CONFIG_FILE).is_file():
        return f"{out} is not empty and holds no linearize run; pass another --out (an empty or new directory)"
    try:
        before = read_run_config(out)
    except ValueError:
        return f"{out / CONFIG_FILE} is not a valid run configuration; remove {out} or pass another --out"
    changed = changed_settings(before, config)
    now = config.to_dict()
    if changed:
        shown = ", ".join(f"{k}: {before.get(k)!r} there, {now.get(k)!r} here" for k in changed[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        return (f"{out} holds a different run (settings differ: {shown}{more}). Remove it "
                f"(rm -r {out}) to train the demo from scratch, or pass another --out.")
    return None


def _heading(title: str) -> None:
    elapsed = int(time.perf_counter() - _started)
    print(f"\n{RULE}\n{title}{f'  [{elapsed // 60}:{elapsed % 60:02d}]':>{max(0, len(RULE) - len(title))}}\n{RULE}",
          flush=True)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def _device(config):
    from ..train.loop import resolve_device

    return resolve_device(config.device)


# ----------------------------------------------------------------------------------- 1. plan


def show_plan(config, stage1_steps: int, stage2_steps: int, prompts, contexts) -> None:
    from ..models.students import installed_students

    device = _device(config)
    _heading("linearize demo: Lizard on SmolLM2-135M, in a few CPU minutes"
             if config.model == "smollm2-135m" else f"linearize demo: Lizard on {config.model}")
    tokens = config.batch_size * config.seq_len
    print(f"teacher     {config.model}; each softmax attention becomes Lizard's gated linear attention "
          f"+ a sliding window with sinks")
    print(f"data        the built-in Shakespeare plays, rows of {config.seq_len} tokens, "
          f"{config.val_rows} held-out rows for validation")
    print(f"stage 1     attention transfer: {stage1_steps} steps x {tokens:,} tokens = "
          f"{config.stage1_tokens:,} tokens, lr {config.stage1_lr:g}")
    print(f"stage 2     LoRA (rank {config.lora_rank}): {stage2_steps} steps x {tokens:,} tokens = "
          f"{config.stage2_tokens:,} tokens, lr {config.stage2_lr:g}")
    print(f"then        each layer's transfer MSE; teacher vs student on {len(prompts)} prompts; "
          f"decode memory at {', '.join(f'{c:,}' for c in contexts)} tokens of context")
    shipped = [s.name for s in installed_students(config.model)]
    if shipped:
        print(f"and         the trained student shipped with linearize ({', '.join(shipped)}) beside the teacher: "
              f"answers, perplexity, memory")
    print(f"run dir     {config.out} (device: {device})")
    if device.type == "cpu" and config.model == "smollm2-135m":
        scale = config.seq_len * config.batch_size / (256 * 2)
        train_s = scale * (stage1_steps * CPU_STAGE1_STEP_S + stage2_steps * CPU_STAGE2_STEP_S)
        rest = 90 + 40 * len(shipped)  # the shipped student: a load, its answers, 4 rows, 2 prefills
        print(f"time        about {_duration(train_s + rest)} on a 2-core CPU (training ~{_duration(train_s)}, "
              f"the rest ~{_duration(rest)}), plus ~40 s the first time to unpack the bundled teacher")
    elif device.type == "cuda":
        print("time        a minute or two on a GPU")
    if _finished(Path(config.out)):
        print(f"resume      {config.out} holds this run, finished: training is skipped")
    elif (Path(config.out) / "config.json").is_file():
        print(f"resume      {config.out} holds this run, unfinished: it continues where it stopped")


# ------------------------------------------------------------------------------- 2. training


def _finished(out: Path) -> bool:
    """train.run writes summary.json last, after the checkpoint."""
    return (out / "summary.json").is_file() and (out / "linearize.json").is_file()


def train(config) -> Path:
    from ..train import run

    out = Path(config.out)
    if _finished(out):
        _heading("Training: already done")
        print(f"{out} holds the finished run; reusing it (remove the directory to train again)")
        return out
    resume = (out / "config.json").is_file()
    _heading("Training: stage 1 (attention transfer), then stage 2 (LoRA)" + (" -- resuming" if resume else ""))
    return run(config, resume=resume)


# -------------------------------------------------------------------------- 3. transfer MSE


def _layer_mse(out: Path) -> dict[int, tuple[float, float]]:
    """layer -> (validation MSE at the first stage-1 evaluation, at the last one)."""
    from ..train.plots import read_metrics

    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for rec in read_metrics(out / "metrics.jsonl"):
        if not str(rec.get("stage", "")).startswith("stage1") or rec.get("split") != "val" or "layer_mse" not in rec:
            continue
        layers = rec.get("layers") or list(range(len(rec["layer_mse"])))
        for layer, value in zip(layers, rec["layer_mse"]):
            first.setdefault(layer, value)
            last[layer] = value
    return {layer: (first[layer], last[layer]) for layer in sorted(first)}


def show_transfer_mse(out: Path) -> dict:
    _heading("Stage 1: each layer's attention-transfer MSE on held-out text (before -> after)")
    mse = _layer_mse(out)
    if not mse:
        print("no stage-1 validation records in metrics.jsonl: nothing to show")
        return {}
    cells = [f"{layer:>5}  {a:>9.3g}  {b:>9.3g}  {b / a if a > 0 else math.nan:>6.3f}"
             for layer, (a, b) in mse.items()]
    columns = 3 if len(cells) >= 12 else 1
    rows = math.ceil(len(cells) / columns)
    header = f"{'layer':>5}  {'before':>9}  {'after':>9}  {'ratio':>6}"
    print("   |   ".join([header] * min(columns, len(cells))))
    for r in range(rows):
        print("   |   ".join(cells[c * rows + r] for c in range(columns) if c * rows + r < len(cells)))
    fell = sum(b < a for a, b in mse.values())
    ratios = [b / a for a, b in mse.values() if a > 0]
    mean_ratio = statistics.fmean(ratios) if ratios else math.nan
    print(f"\nMSE fell in {fell} of {len(mse)} layers; after/before: mean {mean_ratio:.3f}, "
          f"median {statistics.median(ratios) if ratios else math.nan:.3f} "
          f"(ratio < 1: the layer imitates its softmax attention better)")
    pngs = sorted(p.name for p in out.glob("*.png"))
    if pngs:
        print(f"curves: {', '.join(str(out / p) for p in pngs)}")
    return {"layers": len(mse), "fell": fell, "mean_ratio": mean_ratio}


# ------------------------------------------------------------------------------- 4. answers


def _generate(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """A greedy answer, through the chat template where the tokenizer has one."""
    from ..models.generate import generate_text

    chat = bool(getattr(tokenizer, "chat_template", None))
    return generate_text(model, tokenizer, prompt, max_new_tokens=max_new_tokens, chat=chat).strip()


def _wrap(text: str, width: int) -> list[str]:
    lines = []
    for paragraph in (text or "(nothing)").splitlines() or [""]:
        lines += textwrap.wrap(paragraph, width) or [""]
    return lines


def _side_by_side(left: str, right: str, width: int = 37, labels: tuple[str, str] = ("teacher", "student")) -> str:
    a, b = _wrap(left, width), _wrap(right, width)
    a += [""] * (len(b) - len(a))
    b += [""] * (len(a) - len(b))
    rows = [f"  {labels[0]:<{width}} | {labels[1]}", f"  {'-' * width} | {'-' * width}"]
    rows += [f"  {x:<{width}} | {y}" for x, y in zip(a, b)]
    return "\n".join(rows)


def load_models(out: Path, config):
    """The teacher and the trained student (``linearize.load(out)``) on the run's device."""
    import linearize

    device = _device(config)
    teacher, tokenizer = linearize.load_teacher(config.model, device=device)
    student, _ = linearize.load(out, device=device)
    return teacher, student, tokenizer


def show_answers(out: Path, teacher, student, tokenizer, prompts, max_new_tokens: int) -> list[str]:
    """Print teacher and student answers side by side; returns the teacher's answers."""
    _heading(f"Teacher vs student: greedy answers ({max_new_tokens} new tokens at most)")
    answers = []
    for i, prompt in enumerate(prompts, 1):
        t = _generate(teacher, tokenizer, prompt, max_new_tokens)
        s = _generate(student, tokenizer, prompt, max_new_tokens)
        answers.append(t)
        print(f"\n[{i}] {prompt}")
        print(_side_by_side(t, s))
    summary = _summary(out)
    if summary.get("teacher_val_ppl") is not None:
        after1 = _student_ppl_after_stage1(out)
        print(f"\nvalidation perplexity (held-out Shakespeare): teacher {summary['teacher_val_ppl']:.1f}, "
              + (f"student after stage 1 {after1:.1f}, " if after1 is not None else "")
              + f"student after stage 2 {summary['student_val_ppl']:.1f}")
    return answers


def _summary(out: Path) -> dict:
    path = out / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _student_ppl_after_stage1(out: Path) -> float | None:
    loss = _summary(out).get("stage1_val_loss")
    return None if loss is None else math.exp(min(loss, 50.0))


# ------------------------------------------------------------------------- 5. decode memory


def _context_tokens(tokenizer, length: int) -> list[int]:
    """``length`` tokens of real text (Shakespeare), repeated if the plays were ever too short."""
    from ..data import load_documents

    docs = load_documents("shakespeare", tokenizer, max_documents=2)
    ids = [t for d in docs for t in d]
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def _decode_cache_bytes(model, ids) -> int:
    """Prefill ``ids[:-1]`` in one forward, decode ``ids[-1]`` with the cache, and return the
    bytes the cache holds (every tensor reachable from it) with ``len(ids)`` tokens of context."""
    import torch

    from ..models.cache import cache_bytes

    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        cache = model(input_ids=x[:, :-1], use_cache=True).past_key_values
        cache = model(input_ids=x[:, -1:], past_key_values=cache, use_cache=True).past_key_values
    sizes = cache_bytes(cache)
    return sizes["linear"] + sizes["softmax"]


def _memory_table(rows, label: str = "student state") -> None:
    """``rows``: (context, teacher bytes, student bytes) each."""
    w = max(13, len(label))
    print(f"\n{'context':>9} | {'teacher KV cache':>16} | {label:>{w}} | {'teacher/student':>15}")
    print(f"{'-' * 9}-+-{'-' * 16}-+-{'-' * w}-+-{'-' * 15}")
    for n, t, s in rows:
        print(f"{n:>9,} | {human_size(t):>16} | {human_size(s):>{w}} | {t / s if s else math.inf:>14.2f}x")


def show_decode_memory(teacher, student, tokenizer, contexts) -> dict:
    _heading("Decode memory as the context grows (cache held by one sequence, fp32)")
    text = _context_tokens(tokenizer, max(contexts))
    rows = []
    for n in contexts:
        t0 = time.perf_counter()
        t = _decode_cache_bytes(teacher, text[:n])
        s = _decode_cache_bytes(student, text[:n])
        rows.append((n, t, s))
        print(f"  measured {n:,} tokens in {time.perf_counter() - t0:.1f} s", flush=True)

    _memory_table(rows)

    student_flat = len({s for _, _, s in rows}) == 1
    per_token = [t / n for n, t, _ in rows]
    teacher_linear = max(per_token) - min(per_token) <= 1e-9 * max(per_token)
    print()
    if student_flat:
        print(f"student: {human_size(rows[0][2])} at every context length -- its state does not grow "
              f"({rows[0][2]:,} bytes each time)")
    else:
        print("student: its state is NOT the same at every length: "
              + ", ".join(f"{s:,} B at {n:,}" for n, _, s in rows))
    if teacher_linear:
        print(f"teacher: grows linearly with the context, {per_token[0] / 1024:.1f} KiB per token "
              f"({human_size(rows[-1][1])} at {rows[-1][0]:,} tokens)")
    else:
        print("teacher: bytes per token differ across lengths: "
              + ", ".join(f"{t / n:,.0f} B/token at {n:,}" for n, t, _ in rows))
    if student_flat and teacher_linear and per_token[0] > 0:
        even = rows[0][2] / per_token[0]
        print(f"break-even: the student's state equals the teacher's cache at ~{even:,.0f} tokens of "
              f"context; beyond that the student needs less, and the gap widens with every token")
    return {"rows": rows, "student_flat": student_flat, "teacher_linear": teacher_linear}


# ----------------------------------------------------------------------- 6. the shipped student


def show_shipped_students(out: Path, config, teacher, tokenizer, prompts, max_new_tokens: int,
                          teacher_answers: list[str], memory: dict) -> list[dict]:
    """The trained students the package ships for this teacher (``models.students``), beside it:
    greedy answers to the same prompts, perplexity on the run's held-out rows (as its summary
    measured the teacher and the demo's student), decode memory at the same contexts. Returns one
    ``{"name", "val_ppl", "state_bytes"}`` per student shown; nothing is shown where none is installed."""
    from ..models.students import BUNDLED_STUDENTS, installed_students

    students = installed_students(config.model)
    absent = [s.name for s in BUNDLED_STUDENTS.values() if s.teacher == config.model and not s.installed()]
    if absent:
        print(f"\n(the trained student {', '.join(absent)} is not installed: `pip install -e .` from a complete "
              "linearize source tree installs it)")
    if not students:
        return []
    import linearize
    from ..models.checkpoint import read_meta
    from ..train.run import held_out_loss, validation_rows

    device = _device(config)
    rows = validation_rows(config, tokenizer)
    summary = _summary(out)
    text = _context_tokens(tokenizer, max(n for n, _, _ in memory["rows"]))
    shown = []
    for spec in students:
        _heading(f"The trained student shipped with linearize: {spec.name}")
        training = read_meta(spec.name).get("training") or {}
        size = human_size(sum(p.stat().st_size for p in spec.folder.glob("*.safetensors")
                              if not p.name.startswith("reference")))
        if training:
            print(f"{config.model} converted with {spec.method} and trained with the full two-stage recipe: "
                  f"{training.get('stage1_tokens', 0):,} + {training.get('stage2_tokens', 0):,} tokens of "
                  f"{training.get('data')}, rows of {training.get('seq_len')} tokens; shipped as {size} of new "
                  f"weights beside the teacher's")
        student, _ = linearize.load(spec.name, device=device)
        for i, (prompt, answer) in enumerate(zip(prompts, teacher_answers), 1):
            print(f"\n[{i}] {prompt}")
            print(_side_by_side(answer, _generate(student, tokenizer, prompt, max_new_tokens),
                                labels=("teacher", spec.name)))
        ppl = math.exp(min(held_out_loss(student, rows, config, device), 50.0)) if rows is not None else None
        if ppl is not None:
            parts = [f"teacher {summary['teacher_val_ppl']:.1f}" if summary.get("teacher_val_ppl") else None,
                     f"this demo's student {summary['student_val_ppl']:.1f}" if summary.get("student_val_ppl") else None,
                     f"{spec.name} {ppl:.1f}"]
            print(f"\nvalidation perplexity (the same held-out Shakespeare rows): "
                  + ", ".join(p for p in parts if p))
        # the shortest and the longest context only: the prefills are most of this section's time
        ends = memory["rows"][:1] + memory["rows"][1:][-1:]
        measured = [(n, t, _decode_cache_bytes(student, text[:n])) for n, t, _ in ends]
        _memory_table(measured, f"{spec.name} state")
        shown.append({"name": spec.name, "val_ppl": ppl, "state_bytes": [s for _, _, s in measured]})
        del student
    return shown


# --------------------------------------------------------------------------- 7. closing note


def show_closing_note(out: Path, config, mse: dict, memory: dict, shipped: list[dict] | None = None) -> None:
    _heading("What a few CPU minutes can and cannot do")
    summary = _summary(out)
    seen = {s.get("stage"): s.get("tokens") for s in summary.get("stages", [])}
    s1 = sum(v or 0 for k, v in seen.items() if str(k).startswith("stage1"))
    s2 = seen.get("stage2") or 0
    paper = PAPER_TOKENS_PER_STAGE
    print(textwrap.fill(
        f"Tokens seen: stage 1 {s1:,}, stage 2 {s2:,}. The papers train on 20M tokens per stage "
        f"(Lizard: 20M for stage 1 and 20M for stage 2; LoLCATs: 20M for attention transfer and 20M "
        f"for LoRA, 40M in all): {paper / max(s1, 1):,.0f}x and {paper / max(s2, 1):,.0f}x what this demo "
        f"saw. Expect the student's answers to be worse than the teacher's (compare them above).",
        width=100))
    t_ppl, s_ppl = summary.get("teacher_val_ppl"), summary.get("student_val_ppl")
    print("\nWhat it can do already:")
    if memory.get("student_flat"):
        rows = memory["rows"]
        print(f"  - constant decode memory: {human_size(rows[0][2])} of state whether the context is "
              f"{rows[0][0]:,} or {rows[-1][0]:,} tokens (the teacher: {human_size(rows[0][1])} -> {human_size(rows[-1][1])})")
    if mse:
        print(f"  - imitate the teacher's attention better: the transfer MSE fell in {mse['fell']} of "
              f"{mse['layers']} layers, to {mse['mean_ratio']:.0%} of its starting value on average")
    if s_ppl is not None:
        after1 = _student_ppl_after_stage1(out)
        print(f"  - model held-out Shakespeare: validation perplexity {s_ppl:.1f} (teacher {t_ppl:.1f}"
              + (f"; {after1:.1f} after stage 1 alone" if after1 is not None else "") + ")")
    print("What it cannot do yet:")
    if t_ppl and s_ppl and s_ppl > t_ppl:
        print(f"  - match the teacher: its validation perplexity is {s_ppl / t_ppl:.2f}x the teacher's")
    print("  - answer as reliably as the teacher: a few thousand tokens of Shakespeare teach the new attention")
    print("    little about chat (the papers use 20M tokens of instruction or web text per stage)")
    print(f"  - use long contexts well: it trained on rows of {config.seq_len} tokens; holding a long context in")
    print("    constant memory is not the same as recalling from it (Lizard trains on 2,048-token rows and")
    print("    passkey data for that)")
    print("\nThe full recipe on a GPU (a few million tokens per stage; the papers use 20M):")
    print(f"  linearize train --method lizard --model {config.model} --data shakespeare --out runs/lizard \\\n"
          "      --stage1-tokens 2M --stage2-tokens 2M --seq-len 1024 --batch-size 8 --device cuda")
    print('  linearize generate --model runs/lizard --chat --prompt "What is the capital of France?"')
    for student in shipped or []:
        print(f"What that gives, trained and shipped with linearize ({student['name']}, shown above):")
        print(f'  linearize generate --model {student["name"]} --chat --prompt "What is the capital of France?"')
    print("Your own text: --data FILE_OR_FOLDER (.txt, .md, .json/.jsonl with text, Alpaca or chat records, "
          "also .gz/.xz; A:0.6,B:0.4 mixes sources); `linearize train --help` lists every setting.")


# ------------------------------------------------------------------------------------ command


def cmd_demo(args) -> int:
    return int(run_demo(out=args.out, device=args.device) or 0)


def add_parser(sub) -> None:
    p = add_command(sub, "demo", "the main job: linearize the bundled SmolLM2-135M with Lizard and compare",
                    "Linearize the bundled SmolLM2-135M-Instruct with Lizard on the built-in text, show each layer's "
                    "transfer MSE falling, compare teacher and student answers and their decode memory.",
                    """\
                    examples:
                      linearize demo
                      linearize demo --out runs/my-demo --device cpu""")
    p.add_argument("--out", default="runs/demo", metavar="DIR", help="run directory (default: %(default)s)")
    p.add_argument("--device", type=argtype(parse_device), default="auto", metavar="DEVICE", help=DEVICE_HELP)
    p.set_defaults(func=cmd_demo)
