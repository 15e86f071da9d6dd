"""``run(config)``: a whole two-stage linearization, resumable, into one run directory.

    DIR/config.json        the TrainConfig (a resumed run must match it)
    DIR/metrics.jsonl      every train/validation record of both stages
    DIR/state/*.pt         resume state per stage (and per stage-1 block)
    DIR/linearize.json     the final checkpoint (+ adapter.safetensors): linearize.load(DIR)
    DIR/summary.json       throughput, peak memory, teacher and student validation loss
    DIR/*.png              loss curves
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data import Rows, load_mixture, pack
from ..models.checkpoint import check_directory_path, save
from ..models.convert import (attention_modules, auto_softmax_count, check_auto_count, convert, keep_softmax,
                              linearizable_layers, linearized_layers)
from ..models.lora import add_lora, check_lora_targets, lora_parameters
from ..models.teacher import load_teacher
from ..records import device_name, write_json
from . import distributed
from .config import TrainConfig
from .graphs import cache_frozen_casts, compile_attention_modules
from .loop import MetricsLog, Stage, autocast, autocast_dtype, fit, read_state, resolve_device
from .schedules import mu_at
from .transfer import (Block, choose_softmax_layers, freeze_all_but, make_blocks, run_block, teacher_attention,
                       trainable_attention_parameters)

CONFIG_FILE = "config.json"
RESUME_IRRELEVANT = {"progress", "out", "device"}  # may differ between a run and its resumption


def run(config: TrainConfig, *, resume: bool = False) -> Path:
    """Linearize ``config.model`` with ``config.method``: stage 1, stage 2, checkpoint, curves.

    Launched by ``torchrun`` on several processes, the processes train together (``distributed``)
    and rank 0 writes the run directory."""
    config.validate()
    parallel = distributed.setup(config)
    try:
        out = _run(config, resume, parallel)
    except BaseException:
        if parallel is not None and parallel.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()
        raise
    if parallel is not None:
        parallel.close()
    return out


def _run(config: TrainConfig, resume: bool, parallel) -> Path:
    out = Path(config.out)
    check_run_dir(out, config, resume)
    writer = parallel is None or parallel.writer
    if parallel is not None:
        parallel.barrier()  # every rank has looked at --out before rank 0 writes to it
        if not writer:
            config = dataclasses.replace(config, progress=False)
    device = parallel.device if parallel is not None else resolve_device(config.device)
    torch.manual_seed(config.seed)
    random.seed(config.seed)

    if resume and writer:
        print(f"resuming {out}: loading {config.model} and {config.data}, then each stage goes on "
              "where it stopped", flush=True)
    model, tokenizer = load_teacher(config.model)
    if tokenizer is None:
        raise ValueError(f"model {config.model!r} has no tokenizer files; training needs one to read {config.data!r}")
    if config.lora_targets:  # fail before anything is written, not after stage 1
        check_lora_targets(model, config.lora_targets)
    auto_k = auto_softmax_count(config.softmax_layers)
    if auto_k is not None:
        check_auto_count(auto_k, len(linearizable_layers(model, config.method, **config.overrides)))
        if parallel is not None:  # (its layer swap after stage 1 would have to re-shard the model)
            raise ValueError(f"softmax_layers auto:{auto_k} runs on one process for now, not {parallel.world_size}: "
                             "choose the layers on one, then name them (--softmax-layers 3,7,...)")
    train_rows, val_rows = _rows(config, tokenizer)
    log_progress(config, f"data: {len(train_rows)} training rows ({train_rows.num_tokens:,} tokens), "
                 f"{0 if val_rows is None else len(val_rows)} validation rows of {config.seq_len} tokens")

    if writer:
        out.mkdir(parents=True, exist_ok=True)
        if not (out / CONFIG_FILE).is_file():
            write_json(out / CONFIG_FILE, config.to_dict())
    # ranks other than 0 write their records nowhere
    metrics = MetricsLog(out / "metrics.jsonl" if writer else Path(os.devnull))
    if writer and not resume and metrics.path.exists():
        metrics.path.unlink()
    spread = False
    teacher_modules = attention_modules(model)  # auto:K puts some back after stage 1
    if parallel is None:
        model.to(device)
        teacher = copy.deepcopy(model) if config.distill > 0 else None
        teacher_val = held_out_loss(model, val_rows, config, device) if val_rows is not None else None
        convert(model, config.method, softmax_layers=None if auto_k else config.softmax_layers, **config.overrides)
        model.to(device)
        _compile(model, config, device, teacher)
    else:
        # converted on the CPU, so that only shards reach a GPU (FSDP2 moves each unit's own):
        # the whole model never has to fit one
        teacher = copy.deepcopy(model) if config.distill > 0 else None
        convert(model, config.method, softmax_layers=config.softmax_layers, **config.overrides)
        parallel.choose_mode(config, [m for m in (model, teacher) if m is not None])
        spread = _blocks_spread(model, config)
        if spread:  # block-parallel stage 1 trains on the whole model on each rank
            model.to(device)
        else:
            _distribute(model, teacher, config, parallel, device)
        teacher_val = None
        if val_rows is not None:  # the converted model passing each softmax teacher's output on
            with teacher_attention(model):
                teacher_val = held_out_loss(model, val_rows, config, device)
    summary = {"method": config.method, "model": config.model, "device": device_name(device),
               "teacher_val_loss": teacher_val, "stages": []}
    if parallel is not None:
        summary["processes"] = parallel.world_size
    summary["stages"] += _stage1(model, config, train_rows, val_rows, device, out, metrics, resume, parallel, spread)
    if auto_k is not None:
        choice = _choose_softmax(model, auto_k, config, train_rows if val_rows is None else val_rows, device, metrics)
        keep_softmax(model, choice["layers"], teacher_modules)
        summary["softmax_layers_auto"] = choice
        print(f"softmax_layers auto:{auto_k}: layers {choice['layers']} go back to softmax attention (the largest "
              f"stage-1 transfer error of the {len(choice['errors'])} measured)", flush=True)  # shown with progress off too
    if spread:
        _distribute(model, teacher, config, parallel, device)
    summary["stages"].append(_stage2(model, teacher, config, train_rows, val_rows, device, out, metrics, resume,
                                     parallel))
    if parallel is not None:  # each rank's own peak memory and time beside the run's
        everyone = parallel.all_objects(summary["stages"])
        for i, stage in enumerate(summary["stages"]):
            stage["ranks"] = [{k: theirs[i].get(k) for k in ("seconds", "peak_memory_bytes")} for theirs in everyone]
    student_val = held_out_loss(model, val_rows, config, device) if val_rows is not None else None
    if val_rows is not None and writer:
        summary["stage1_val_loss"] = stage1_val_loss(metrics.path)
        summary["student_val_loss"] = student_val
        for key in ("teacher", "student"):
            summary[f"{key}_val_ppl"] = math.exp(summary[f"{key}_val_loss"])
        summary["val_ppl_ratio"] = summary["student_val_ppl"] / summary["teacher_val_ppl"]
        summary["val_rows"], summary["val_tokens"] = len(val_rows), val_rows.num_tokens

    # what the student was trained on, kept in its checkpoint (evals report the row length as its context)
    model.linearize_spec["training"] = {"seq_len": config.seq_len, "data": config.data, "loss_on": config.loss_on,
                                        "loss_average": config.loss_average, "stage1_tokens": config.stage1_tokens,
                                        "stage2_tokens": config.stage2_tokens, "stage1_memory": config.stage1_memory,
                                        "stage2_attention": config.stage2_attention}
    if auto_k is not None:
        model.linearize_spec["training"]["softmax_layers_auto"] = summary["softmax_layers_auto"]
    if parallel is not None:
        trained = parallel.added_state(model)  # every rank takes part in gathering the shards
        if not writer:
            return out
        model = _unsharded_student(model, trained, config)
    save(model, out, tokenizer=tokenizer, overwrite=True)  # the run's own directory: its checkpoint
    write_json(out / "summary.json", summary)
    from .plots import plot_metrics

    plot_metrics(metrics.path, out)
    print(verdict(summary, config), flush=True)  # the run's result: shown with or without progress bars
    log_progress(config, f"done: {out} (linearize.load({str(out)!r}) opens it)")
    return out


# --------------------------------------------------------------------------------------- verdict


def stage1_val_loss(metrics_path: Path) -> float | None:
    """The student's validation loss after stage 1: stage 2's validation at step 0, before its LoRA
    (initialised to zero) has changed anything."""
    from .plots import read_metrics

    for rec in read_metrics(metrics_path):
        if rec.get("stage") == "stage2" and rec.get("split") == "val" and rec.get("step") == 0:
            return rec["loss"]
    return None


# Student perplexity over the teacher's on the held-out rows: at most CLOSE is "matches", at most FAR
# is "close"; above FAR the student is not usable yet and the verdict says what to try.
CLOSE, FAR = 1.05, 1.5


def verdict(summary: dict, config: TrainConfig) -> str:
    """The block ``linearize train`` ends with: teacher and student validation loss and perplexity
    after each stage, the ratio to the teacher, and one plain sentence on what it means."""
    if summary.get("teacher_val_loss") is None:
        return ("verdict: no validation rows, so no comparison with the teacher "
                f"(val_fraction is {config.val_fraction}; the data may be too small to split)")
    teacher = summary["teacher_val_loss"]
    rows = [("teacher", teacher)]
    if summary.get("stage1_val_loss") is not None and summary["stages"][0]["stage"].startswith("stage1"):
        rows.append(("student after stage 1", summary["stage1_val_loss"]))
    rows.append(("student after stage 2" if config.stage2_tokens else "student", summary["student_val_loss"]))
    lines = [f"verdict on {summary['val_rows']} held-out rows ({summary['val_tokens']:,} tokens of {config.data}, "
             "never trained on):",
             f"  {'':<24}{'loss':>8}{'perplexity':>13}{'vs teacher':>13}"]
    for name, loss in rows:
        ppl = math.exp(min(loss, 50.0))
        lines.append(f"  {name:<24}{loss:>8.3f}{ppl:>13.4g}{ppl / math.exp(teacher):>12.2f}x")
    ratio = math.exp(min(summary["student_val_loss"], 50.0)) / math.exp(teacher)
    if ratio <= 1.0:
        sentence = ("The student's perplexity is at or below the teacher's. The teacher was not fine-tuned on "
                    "this data and the student's LoRA was, so compare on other text too (linearize eval ppl).")
    elif ratio <= CLOSE:
        sentence = f"The student matches its teacher: perplexity within {ratio - 1:.0%} of the teacher's."
    elif ratio <= FAR:
        sentence = (f"The student is close to its teacher ({ratio:.2f}x its perplexity); more training tokens "
                    "(--stage1-tokens, --stage2-tokens) would close the gap.")
    else:
        sentence = (f"The student is far from its teacher ({ratio:.3g}x its perplexity): it is not usable yet. "
                    f"Try more tokens (--stage1-tokens {config.stage1_tokens:,}, --stage2-tokens "
                    f"{config.stage2_tokens:,} now; the papers use 20M per stage) or other learning rates "
                    f"(--stage1-lr {config.stage1_lr:g}, --stage2-lr {config.stage2_lr:g} now).")
    return "\n".join(lines + ["  " + sentence])


# ------------------------------------------------------------------------------------------ data


def _rows(config: TrainConfig, tokenizer):
    """Training and validation rows of ``config.data`` (one source or a weighted mixture).

    Each source is read only as far as the run needs (the larger stage's tokens, and ``val_rows``
    rows of validation), its validation documents held out before mixing; validation rows are
    taken from every source by its weight. With ``loss_on="assistant"`` the rows carry the
    documents' assistant loss masks (train and validation alike).
    """
    mixture, kw = _mixture(config, tokenizer)
    if len(mixture.sources) > 1:
        for source, weight, tokens, val in zip(mixture.sources, mixture.weights, mixture.train_tokens, mixture.val):
            log_progress(config, f"data: {source}: weight {weight:.3g}, {tokens:,} training tokens, "
                         f"{len(val)} held-out documents")
    train = pack(mixture.train, config.seq_len, config.packing, weighting=config.loss_average, **kw)
    log_progress(config, f"data: packed {len(mixture.train):,} documents into {len(train):,} rows of {config.seq_len} "
                 f"({config.packing}), {train.fill:.1%} of slots hold tokens")
    return train, _validation(mixture, config, kw)


def _mixture(config: TrainConfig, tokenizer):
    """``config.data`` read as far as the run needs, and the packing settings of its rows."""
    train_tokens = max(config.stage1_tokens, config.stage2_tokens, config.seq_len * config.batch_size)
    mixture = load_mixture(config.data, tokenizer, train_tokens=train_tokens, val_fraction=config.val_fraction,
                           val_tokens=config.val_rows * config.seq_len, seed=config.seed,
                           note=lambda message: print(message, flush=True))  # shown with progress off too
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    kw = {"pad_id": pad_id, "min_tokens": min(16, config.seq_len), "loss_masks": config.loss_on == "assistant"}
    return mixture, kw


def _validation(mixture, config: TrainConfig, kw: dict):
    """The validation rows: each source's held-out documents packed, ``val_rows`` in all by weight."""
    parts = []
    for docs, weight in zip(mixture.val, mixture.weights):
        if not docs:
            continue
        try:
            rows = pack(docs, config.seq_len, config.packing, **kw)
        except ValueError:  # too little held-out text of this source for a row
            continue
        share = config.val_rows if len(mixture.sources) == 1 else max(1, math.floor(weight * config.val_rows))
        parts.append(_subset(rows, range(min(len(rows), share))))
    return Rows.concat(parts) if parts else None


def validation_rows(config: TrainConfig, tokenizer):
    """The held-out rows a run of ``config`` validates on (its summary's ``*_val_ppl``), the same
    rows every time for the same settings; None when its data holds too little for a row. The
    training rows are not packed for it."""
    mixture, kw = _mixture(config, tokenizer)
    return _validation(mixture, config, kw)


def _subset(rows, indices):
    return rows.subset(indices)


def _batches(rows, batch_size: int, device):
    for start in range(0, len(rows), batch_size):
        indices = list(range(start, min(start + batch_size, len(rows))))
        batch = rows.batch(indices)
        yield indices, {k: v.to(device) for k, v in batch.items()}


def _steps(tokens: int, config: TrainConfig) -> int:
    return math.ceil(tokens / (config.batch_size * config.grad_accum * config.seq_len))


# --------------------------------------------------------------------------------------- stage 1


def _distribute(model, teacher, config: TrainConfig, parallel, device: torch.device) -> None:
    """The student (and a distillation teacher) made ready for the data-parallel stages.

    fsdp: FSDP2 over them, then compiled as on one device. FSDP2 fixes the module tree, so LoRA goes
    in first: before stage 1 it is left untouched (B = 0 adds nothing), and its random draws are the
    ones stage 2 makes on one process, as stage 1 draws none. replicate: the whole model on this
    rank's device, compiled as on one device; LoRA comes in stage 2, as on one device."""
    if parallel.replicated:
        model.to(device)
        if teacher is not None:
            teacher.to(device)
        _compile(model, config, device, teacher)
        return
    _add_lora(model, config)
    gather = autocast_dtype(device, config.precision)
    parallel.shard(model, gather)
    if teacher is not None:
        parallel.shard(teacher, gather)
    _compile(model, config, device, sharded=True)  # (inside the FSDP units: their weights come in gathered)


def _compile(model, config: TrainConfig, device: torch.device, teacher=None, sharded: bool = False) -> None:
    """The feature maps and gates compiled where the config asks and the device is CUDA (a model
    on one device, a replicated rank or an FSDP rank); the frozen projections' autocast casts kept
    (``cache_frozen_casts``; not under FSDP, which gathers them in the autocast dtype already), the
    distillation teacher's too."""
    if config.compile and device.type == "cuda":
        compile_attention_modules(model)
    if autocast_dtype(device, config.precision) is not None and not sharded:
        for m in (model, teacher):
            if m is not None:
                cache_frozen_casts(m)


def _blocks_spread(model, config: TrainConfig) -> bool:
    """Block-parallel stage 1 (several processes and several blocks): each rank trains its own
    blocks, whole, on its own device, from the teacher's hidden states cached on disk."""
    return (config.block_size is not None and _steps(config.stage1_tokens, config) > 0
            and bool(trainable_attention_parameters(model, memory=config.stage1_memory))
            and len(make_blocks(model, config.block_size)) > 1)


def _stage1(model, config, train_rows, val_rows, device, out, metrics, resume, parallel=None,
            spread: bool = False) -> list[dict]:
    """Stage 1, block by block. ``parallel``: data parallel over the ranks (FSDP). ``spread``:
    block-parallel instead, block b trained by rank b mod N; the ranks share the block inputs
    through files (memory-mapped), then each block's weights are sent from its rank to all."""
    steps = _steps(config.stage1_tokens, config)
    if not trainable_attention_parameters(model, memory=config.stage1_memory):
        log_progress(config, f"stage 1: method {config.method!r} has no attention parameters to learn "
                     "(nothing to transfer); going straight to stage 2")
        metrics.write({"event": "stage1_skipped", "stage": "stage1", "reason": "no trainable attention parameters"})
        return []
    if steps == 0:
        return []
    blocks = make_blocks(model, config.block_size)
    model.eval()  # the teacher path must behave as at inference; the new modules have no dropout
    summaries = []
    train_inputs = val_inputs = None  # block inputs (CPU); None = the embeddings
    if len(blocks) > 1:  # each block trains on its own copy of the rows it will see
        needed = min(len(train_rows), steps * config.batch_size * config.grad_accum)
        g = torch.Generator().manual_seed(config.seed)
        train_rows = _subset(train_rows, torch.randperm(len(train_rows), generator=g)[:needed].tolist())
    if spread and resume and all(_finished(out / "state" / f"stage1-block{b}.pt") for b in range(len(blocks))):
        spread_train = spread_val = [None] * len(blocks)  # each block's state is read back, nothing recomputed
    elif spread:
        cache = out / "state" / "block_inputs"
        spread_train = _shared_block_inputs(model, blocks, train_rows, config, device, cache / "train", parallel)
        spread_val = (_shared_block_inputs(model, blocks, val_rows, config, device, cache / "val", parallel)
                      if val_rows is not None else [None] * len(blocks))
    inputs_at = 0
    for b, block in enumerate(blocks):
        if spread:
            if b % parallel.world_size != parallel.rank:
                continue
            train_inputs, val_inputs = spread_train[b], spread_val[b]
        elif block.start > inputs_at:  # advance the cached inputs to the block's first layer
            span = Block(inputs_at, block.start, tuple(
                m.layer_idx for m in linearized_layers(model) if inputs_at <= m.layer_idx < block.start))
            train_inputs = _block_outputs(model, train_rows, span, train_inputs, config, device)
            if val_rows is not None:
                val_inputs = _block_outputs(model, val_rows, span, val_inputs, config, device)
        inputs_at = block.start
        name = "stage1" if len(blocks) == 1 else f"stage1-block{b}"
        params = trainable_attention_parameters(model, block, memory=config.stage1_memory)
        named = named_parameters_of(model, params)
        freeze_all_but(model, params)
        log_progress(config, f"{name}: layers {list(block.layers)}, {sum(p.numel() for p in params):,} parameters, "
                     f"{steps} steps")

        def loss_fn(batch, block=block):
            return transfer_loss(model, batch, config.transfer_target, block)

        def extra(indices, batch, inputs=train_inputs):
            if inputs is not None:
                batch["block_inputs"] = inputs[indices, :batch["input_ids"].shape[1]]
            return batch

        eval_fn = None
        if val_rows is not None:
            def eval_fn(block=block, inputs=val_inputs):
                return _transfer_eval(model, val_rows, block, inputs, config, device)

        stage = Stage(name, named, loss_fn, eval_fn, steps, config.stage1_lr, graphable=True,
                      loss_tokens=transfer_tokens)
        if parallel is not None and not spread:  # (spread: the model is whole on each rank)
            parallel.stage_layout(model, config.transfer_target)
        # a block trained on its own rank has its own log, merged into the run's afterwards
        log = MetricsLog(out / "state" / f"metrics-{name}.jsonl") if spread else metrics
        summaries.append(fit(stage, train_rows, config, device, out / "state" / f"{name}.pt", log, resume,
                             extra_batch=extra, parallel=None if spread else parallel))
    for p in model.parameters():
        p.requires_grad_(False)
    if spread:
        summaries = _gather_blocks(model, blocks, summaries, parallel, metrics, out)
    return summaries


CHOICE_EVENT = "softmax_layers_chosen"


def _choose_softmax(model, k: int, config, rows, device, metrics: MetricsLog) -> dict:
    """After stage 1: measure every linearized layer's transfer error on ``rows`` (the validation
    rows, else the training rows, ``val_rows`` of them) and pick the ``k`` largest. Recorded in
    metrics.jsonl; a resumed run reuses the recorded choice, so its stage-2 state still fits."""
    for rec in _read_records(metrics.path):
        if rec.get("event") == CHOICE_EVENT:
            return {key: rec[key] for key in ("k", "layers", "errors")}
    errors = measure_transfer_errors(model, rows.subset(range(min(len(rows), config.val_rows))), config, device)
    choice = {"k": k, "layers": choose_softmax_layers(errors, k), "errors": {str(i): e for i, e in errors.items()}}
    metrics.write({"event": CHOICE_EVENT, "stage": "stage1", "target": config.transfer_target, **choice})
    return choice


def _read_records(path: Path) -> list[dict]:
    from .plots import read_metrics

    return read_metrics(path) if Path(path).is_file() else []


def measure_transfer_errors(model, rows, config: TrainConfig, device) -> dict[int, float]:
    """{layer index: MSE(student, teacher)} of every linearized layer of ``model``, averaged over
    ``rows``, teacher-forced (each layer sees the teacher's hidden states, so one pass measures all;
    ``config.transfer_target`` says where: heads or output)."""
    layers = tuple(sorted(m.layer_idx for m in linearized_layers(model)))
    if not layers:
        raise ValueError("the model has no linearized layers to measure")
    _, extra = _transfer_eval(model, rows, Block(0, layers[-1] + 1, layers), None, config, device)
    return dict(zip(extra["layers"], extra["layer_mse"]))


def _shared_block_inputs(model, blocks: list[Block], rows, config, device, prefix: Path, parallel) -> list:
    """Block-parallel stage 1: the teacher's hidden states entering each block, for every row:
    (N, seq_len, hidden) tensors mapped from files ``prefix-block{b}.bin`` (kept on disk when they
    do not fit memory); None for a block at layer 0 (the embeddings). Each rank computes every Nth
    batch, through the layers between consecutive blocks as sequential stage 1 does."""
    store = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (len(rows), config.seq_len, model.config.hidden_size)
    cached = [b for b, block in enumerate(blocks) if block.start > 0]
    files = parallel.shared_tensors([prefix.with_name(f"{prefix.name}-block{b}.bin") for b in cached], shape, store)
    shared = [None] * len(blocks)
    linear = [m.layer_idx for m in linearized_layers(model)]
    start, inputs = 0, None
    for b, into in zip(cached, files):
        span = Block(start, blocks[b].start, tuple(i for i in linear if start <= i < blocks[b].start))
        _block_outputs(model, rows, span, inputs, config, device, into=into, part=(parallel.rank, parallel.world_size))
        start, inputs, shared[b] = blocks[b].start, into, into
    parallel.barrier()  # every rank's rows are in
    return shared


def _gather_blocks(model, blocks: list[Block], summaries: list[dict], parallel, metrics: MetricsLog, out: Path):
    """After block-parallel stage 1: every block's weights from its rank to all, the blocks'
    summaries in block order, and (rank 0) their logs appended to the run's."""
    for b, block in enumerate(blocks):
        parallel.broadcast(trainable_attention_parameters(model, block), src=b % parallel.world_size)
    everyone = parallel.all_objects(summaries)
    ordered = [everyone[b % parallel.world_size][b // parallel.world_size] for b in range(len(blocks))]
    if parallel.writer:
        seen = set()
        if metrics.path.is_file():
            seen = {_record_key(json.loads(line)) for line in metrics.path.read_text().splitlines() if line.strip()}
        for b in range(len(blocks)):
            log = out / "state" / f"metrics-stage1-block{b}.jsonl"
            if not log.is_file():
                continue
            for line in log.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill
                if _record_key(record) not in seen:  # (merged already before an interruption)
                    metrics.write(record)
            log.unlink()
        shutil.rmtree(out / "state" / "block_inputs", ignore_errors=True)
    parallel.barrier()
    return ordered


def _finished(state_path: Path) -> bool:
    return state_path.is_file() and bool(read_state(state_path)["loop"]["done"])


def _record_key(record: dict) -> tuple:
    return record.get("stage"), record.get("split"), record.get("step"), record.get("event")


def transfer_tokens(batch: dict) -> int:
    """The tokens stage 1's loss averages over: every real one."""
    return int(batch["attention_mask"].sum())


def transfer_loss(model, batch: dict, target: str, block: Block) -> tuple[torch.Tensor, dict]:
    """Stage 1's loss on one batch: the sum over ``block``'s layers of the student's attention MSE to the
    teacher's (``target``: "heads" or "output"), and each layer's MSE."""
    losses = run_block(model, batch, target, block, batch.get("block_inputs"))
    mse = [losses[i] for i in block.layers]
    mse = torch.stack(mse)
    return mse.sum(), {"layer_mse": mse.detach(), "layers": list(block.layers)}


@torch.no_grad()
def _block_outputs(model, rows, span: Block, inputs, config, device, into: torch.Tensor | None = None,
                   part: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Teacher hidden states leaving ``span`` for every row: (N, T, hidden) on the CPU.

    ``into``: write them into this (N, T, hidden) tensor instead; ``part=(i, n)``: only batches
    i, i + n, ... (one rank's share)."""
    outs = []
    store = torch.bfloat16 if device.type == "cuda" else torch.float32
    for k, (indices, batch) in enumerate(_batches(rows, config.batch_size, device)):
        if k % part[1] != part[0]:
            continue
        captured = []
        block_in = None if inputs is None else inputs[indices, :batch["input_ids"].shape[1]].to(device)
        with autocast(device, config.precision):
            run_block(model, batch, config.transfer_target, span, block_in, capture=captured)
        h = captured[0].to("cpu", store)
        h = F.pad(h, (0, 0, 0, config.seq_len - h.shape[1]))  # batches are trimmed; rows are not
        if into is not None:
            into[indices] = h
        else:
            outs.append(h)
    return into if into is not None else torch.cat(outs)


@torch.no_grad()
def _transfer_eval(model, rows, block: Block, inputs, config, device) -> tuple[float, dict]:
    sums = torch.zeros(len(block.layers), dtype=torch.float64)
    count = 0
    for indices, batch in _batches(rows, config.batch_size, device):
        block_in = None if inputs is None else inputs[indices, :batch["input_ids"].shape[1]].to(device)
        with autocast(device, config.precision):
            losses = run_block(model, batch, config.transfer_target, block, block_in)
        sums += torch.tensor([float(losses[i]) for i in block.layers], dtype=torch.float64) * len(indices)
        count += len(indices)
    mse = (sums / count).tolist()
    return float(sum(mse)), {"layer_mse": mse, "layers": list(block.layers)}


# --------------------------------------------------------------------------------------- stage 2


def _stage2(model, teacher, config, train_rows, val_rows, device, out, metrics, resume, parallel=None) -> dict:
    if getattr(model, "linearize_lora", None) is None:  # (several processes: added before sharding)
        _add_lora(model, config)
        model.to(device)
    params = lora_parameters(model)
    if config.stage2_attention:
        params += trainable_attention_parameters(model)
    freeze_all_but(model, params)  # (several processes: stage 1 froze the LoRA it ran with)
    if parallel is not None:
        parallel.stage_layout(model, None)
    steps = _steps(config.stage2_tokens, config)
    log_progress(config, f"stage2: LoRA rank {config.lora_rank} on {model.linearize_lora['targets']}"
                 f"{' and the attention modules' if config.stage2_attention else ''}, "
                 f"{sum(p.numel() for p in params):,} parameters, {steps} steps")
    uses_mu = model.linearize_spec["config"]["combine"] == "mu"

    def set_mu(step: int) -> float:
        mu = mu_at(step, config.mu_schedule, config.mu_steps, model.linearize_spec["config"]["mu"])
        for m in linearized_layers(model):
            m.hybrid.mu.fill_(mu)
        return mu

    def loss_fn(batch):
        return lm_loss(model, batch, teacher, config)

    eval_fn = None
    if val_rows is not None:
        def eval_fn():
            loss = held_out_loss(model, val_rows, config, device)
            model.train()
            return loss, {"ppl": math.exp(min(loss, 50.0))}

    stage = Stage("stage2", named_parameters_of(model, params), loss_fn, eval_fn, steps, config.stage2_lr,
                  before_step=set_mu if uses_mu else None, graphable=True, loss_tokens=lm_tokens)
    model.train()
    summary = fit(stage, train_rows, config, device, out / "state" / "stage2.pt", metrics, resume, parallel=parallel)
    model.eval()
    if uses_mu:  # the checkpoint keeps the mu the model ended with
        final_mu = set_mu(max(steps - 1, 0))
        model.linearize_spec["overrides"]["mu"] = final_mu
        model.linearize_spec["config"]["mu"] = final_mu
    for p in model.parameters():
        p.requires_grad_(False)
    return summary


def _add_lora(model, config: TrainConfig) -> None:
    add_lora(model, rank=config.lora_rank, alpha=config.lora_alpha, dropout=config.lora_dropout,
             targets=config.lora_targets)


def lm_tokens(batch: dict) -> float:
    """What stage 2's losses average over: the tokens whose next token has a label, or with
    ``loss_weight`` (``loss_average="document"``) those tokens' weights summed."""
    if "loss_weight" in batch:
        return float(batch["loss_weight"][:, 1:].sum())
    return int((batch["labels"][:, 1:] != -100).sum())


def lm_loss(model, batch: dict, teacher, config: TrainConfig) -> tuple[torch.Tensor, dict]:
    """Stage 2's loss on one batch: next-token cross-entropy, mixed with KL(teacher || student) on the
    logits by ``config.distill`` when a ``teacher`` is given."""
    mask = batch.get("attention_mask")  # (none: no padding, as a CUDA graph gets it)
    out_ = model(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False)
    weights = _position_weights(batch["labels"], batch.get("loss_weight"))
    ce = _next_token_loss(out_.logits, batch["labels"], weights)
    if teacher is None:
        return ce, {"ce": ce.detach()}
    with torch.no_grad():
        t_logits = teacher(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False).logits
    kl = _distill_loss(out_.logits, t_logits, weights, config.distill_temperature)
    return (1 - config.distill) * ce + config.distill * kl, {"ce": ce.detach(), "kl": kl.detach()}


def _position_weights(labels: torch.Tensor, loss_weight: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T - 1) float32: the weight of the prediction at each position (of the next token): 1
    where the next token has a label, else 0; with ``loss_weight`` (B, T), the next token's weight."""
    if loss_weight is not None:
        return loss_weight[:, 1:].float() * (labels[:, 1:] != -100)
    return (labels[:, 1:] != -100).float()


def _next_token_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of each labelled token given the ones before it (labels -100 are skipped:
    padding, and with ``loss_on="assistant"`` every token outside an assistant answer), weighted by
    ``weights`` (``_position_weights``; None: each labelled token alike). A batch with no labelled
    token gives 0 (with a gradient), not NaN. Reads no device value on the host."""
    w = (_position_weights(labels) if weights is None else weights).flatten()
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100,
                         reduction="none")
    return (ce * w).sum() / w.sum().clamp_min(1e-6)


def _distill_loss(student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor, temperature: float):
    """KL(teacher || student) at each position, weighted by ``weights`` (B, T - 1)
    (``_position_weights``: the positions whose next token the next-token loss trains: with
    ``loss_on="assistant"``, those predicting an assistant answer), scaled by T^2 (Hinton et al.).
    0 (with a gradient) when no position weighs anything."""
    # every position's KL, the weighted ones summed: no boolean indexing, which would read the mask on the host
    s = F.log_softmax(student[:, :-1].float() / temperature, -1)
    t = F.log_softmax(teacher[:, :-1].float() / temperature, -1)
    kl = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)
    return (kl * weights).sum() / weights.sum().clamp_min(1e-6) * temperature**2


@torch.no_grad()
def held_out_loss(model, rows, config, device) -> float:
    """Mean next-token cross-entropy over every labelled token of ``rows`` (batches of
    ``config.batch_size``, in ``config.precision``); its exp is a summary's validation perplexity."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for _, batch in _batches(rows, config.batch_size, device):
        with autocast(device, config.precision):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        n = int((batch["labels"][:, 1:] != -100).sum())
        if n == 0:
            continue
        total += float(_next_token_loss(logits, batch["labels"])) * n
        count += n
    model.train(was_training)
    return total / max(count, 1)


# --------------------------------------------------------------------------------------- helpers


def _unsharded_student(sharded, trained: dict, config: TrainConfig):
    """The student as one process holds it (for ``save``): the teacher loaded again, converted
    as the run converted it, with the trained tensors gathered from the ranks."""
    model, _ = load_teacher(config.model)
    convert(model, config.method, softmax_layers=config.softmax_layers, **config.overrides)
    _add_lora(model, config)
    result = model.load_state_dict(trained, strict=False)
    if result.unexpected_keys:
        raise RuntimeError(f"gathered tensors the student does not have: {result.unexpected_keys[:4]}")
    for name, value in vars(sharded).items():
        if name.startswith("linearize_"):
            setattr(model, name, copy.deepcopy(value))
    return model.eval()


def named_parameters_of(model, params) -> dict:
    """``{name: parameter}`` of ``model`` for the parameters in ``params``."""
    ids = {id(p) for p in params}
    return {n: p for n, p in model.named_parameters() if id(p) in ids}


def read_run_config(out: Path) -> dict | None:
    """The settings a run recorded in ``out`` (None if it holds no run); a broken file is named."""
    saved = Path(out) / CONFIG_FILE
    if not saved.is_file():
        return None
    try:
        values = json.loads(saved.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"cannot resume: {saved} is not valid JSON ({e})") from None
    if not isinstance(values, dict):
        raise ValueError(f"cannot resume: {saved} does not hold a mapping of settings")
    return values


def changed_settings(saved: dict, config: TrainConfig) -> list[str]:
    """The settings that differ between a recorded run and ``config`` (those a resume may change excepted).
    A setting the run did not record (added since, e.g. ``loss_on``) counts as its default."""
    now = config.to_dict()
    saved = {**TrainConfig().to_dict(), **saved}
    return sorted(k for k in set(saved) | set(now) if k not in RESUME_IRRELEVANT and saved.get(k) != now.get(k))


def check_run_dir(out: Path, config: TrainConfig, resume: bool) -> None:
    check_directory_path(out, f"--out {out}")  # a file there: say so before loading anything
    saved = out / CONFIG_FILE
    if resume:
        before = read_run_config(out)
        if before is None:
            raise FileNotFoundError(f"nothing to resume: {saved} does not exist (start the run without --resume)")
        changed = changed_settings(before, config)
        if changed:
            raise ValueError(f"cannot resume {out}: settings {changed} differ from the run's {saved}")
    elif out.exists() and any(out.iterdir()):
        hint = " (it holds a run: pass --resume to continue it)" if saved.is_file() else ""
        raise ValueError(f"output directory {out} is not empty{hint}; choose another --out")


def log_progress(config: TrainConfig, message: str) -> None:
    """Print ``message`` when the run shows progress (``config.progress``)."""
    if config.progress:
        print(message, flush=True)
