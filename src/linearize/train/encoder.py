"""``run_encoder(config)``: linearize a sentence encoder (BERT family) into LION, resumably.

The same ``TrainConfig`` and run directory as ``train.run`` (config.json, metrics.jsonl,
state/*.pt, the checkpoint, summary.json, loss curves), with sentences instead of packed rows:

* data: ``data.sentences.load_sentences(config.data)``, sentences cut from local text. Each sentence's split is
  fixed by a hash of its text (``sentence_split``): ~10% "test" (held out for ``eval embed``,
  never trained on), ~10% "val" (validation during training), the rest "train"; so training and
  evaluation agree on the held-out set whatever their other settings. Sentences are truncated to
  ``seq_len`` tokens; ``stage{1,2}_tokens`` count real (non-padding) tokens, so the steps are
  ceil(tokens / (batch_size * grad_accum * mean sentence length)).
* stage 1, attention transfer: in every LION layer, teacher-forced, MSE between the LION heads
  and the encoder's own softmax heads (SDPA over the valid keys) on the same q/k/v; only the
  LION parameters (feature maps, decays, gates) train (``transfer_target`` must be "heads").
* stage 2, LoRA (``lora_targets``, default q/k/v and every ``dense`` projection: attention output,
  FFN and pooler) together with the LION parameters, on the sentence-embedding objective: 1 - the
  cosine similarity between the student's and the teacher's pooled, L2-normalised embeddings
  (pooled from the teacher's forward on the same batch, which the hidden-state term runs anyway;
  embedded before training only when ``distill`` is 0, and for the relational bank's sentences:
  a pass over every training sentence costs minutes on the CPU), plus ``distill`` times the summed
  relative MSE of every layer's hidden states against the teacher's on the same batch
  (``hidden_state_loss``; for encoders ``distill`` weighs this term, there are no logits). The
  per-token, per-layer targets give many more signals per sentence than one pooled vector: on
  MiniLM they sped up stage 2 (docs/results/lion-minilm.md). With ``relational`` > 0, plus that
  weight times ``relational_loss``: KL between the teacher's and the student's softmax
  similarities (temperature ``relational_temperature``) to a fixed bank of the teacher's
  embeddings of the first ``relational_bank`` training sentences (``relational_bank``; never a
  val or test sentence). 1 - cosine weighs every direction of the error alike; nearest-neighbour
  agreement only cares about errors that reorder a sentence's close neighbours, which this term
  measures directly.
* batches: both stages draw fixed batches of similar-length sentences (``length_buckets``) in a
  seeded, per-epoch shuffled order, so little of a batch is padding; a step still takes
  ``batch_size`` sentences.

The encoder's dropout stays off in both stages (``model.eval()``): the target is the teacher's
deterministic embedding. ``val`` reports the transfer MSE (stage 1) and 1 - mean cosine plus the
nearest-neighbour agreement among the validation sentences (stage 2).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from ..models.checkpoint import save
from ..models.attention import TransferRecorder
from ..models.convert import convert
from ..data.sentences import load_sentences, sentence_split
from ..models.encoder import lion_layers, lion_parameters, mean_pool, nn_agreement, sentence_embeddings
from ..models.lora import add_lora, check_lora_targets, lora_parameters
from ..models.teacher import load_teacher
from ..records import write_json
from .config import TrainConfig
from .distributed import launched_world_size
from .loop import MetricsLog, Stage, autocast, fit, resolve_device
from .run import CONFIG_FILE, check_run_dir, log_progress, named_parameters_of
from .transfer import freeze_all_but

ENCODER_LORA_TARGETS = ["query", "key", "value", "dense"]


@dataclass
class SentenceRows:
    """Tokenized sentences for the loop: ``input_ids`` (N, L) long, ``attention_mask`` (N, L), right
    padded; ``targets`` (N, D) the teacher's embeddings (or None). ``batch`` trims padding columns."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        index = torch.as_tensor(list(indices), dtype=torch.long)
        mask = self.attention_mask[index]
        width = max(int(mask.sum(1).max()), 1)
        batch = {"input_ids": self.input_ids[index, :width], "attention_mask": mask[:, :width]}
        if self.targets is not None:
            batch["targets"] = self.targets[index]
        return batch


@dataclass
class BucketedRows:
    """``rows`` served as fixed batches of similar length (``length_buckets``), for ``loop.fit``.

    Item j is the whole batch ``buckets[j]``, so ``fit`` runs with a batch size of 1 and its seeded
    per-epoch permutations shuffle the order of the batches. A batch is as wide as its longest
    sentence; random batches of these 5-64-word sentences are padded to about 2.5x their mean
    length, sorted ones hardly at all, which about halves the time of a step on the CPU with the
    same sentences per step. ``batch`` adds ``index``, the rows it took (the relational term uses it).
    """

    rows: SentenceRows
    buckets: list[list[int]]

    def __len__(self) -> int:
        return len(self.buckets)

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        rows = [i for j in indices for i in self.buckets[j]]
        return {**self.rows.batch(rows), "index": torch.as_tensor(rows, dtype=torch.long)}


def length_buckets(rows: SentenceRows, batch_size: int, seed: int, pool: int = 64) -> list[list[int]]:
    """Batches of ``batch_size`` rows of similar length: a seeded shuffle, cut into pools of ``pool``
    batches, each pool sorted by length and cut into batches (every row exactly once)."""
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    lengths = rows.attention_mask.sum(1).tolist()
    buckets = []
    for start in range(0, len(order), batch_size * pool):
        part = sorted(order[start:start + batch_size * pool], key=lambda i: lengths[i])
        buckets += [part[i:i + batch_size] for i in range(0, len(part), batch_size)]
    return buckets


def tokenize_sentences(tokenizer, sentences: Sequence[str], max_length: int) -> SentenceRows:
    enc = tokenizer(list(sentences), padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    return SentenceRows(enc["input_ids"], enc["attention_mask"])


def _subset(rows: SentenceRows, n: int) -> SentenceRows:
    return SentenceRows(rows.input_ids[:n], rows.attention_mask[:n], None if rows.targets is None else rows.targets[:n])


# ------------------------------------------------------------------------------------------ run


def run_encoder(config: TrainConfig, *, resume: bool = False) -> Path:
    """Linearize the encoder ``config.model`` with ``config.method`` (lion-lit | lion-d | lion-s):
    stage 1, stage 2, checkpoint (``linearize.load(out)`` opens it), summary and curves.

    Settings used: method, model, data, out, softmax_layers, overrides, seq_len (max tokens per
    sentence), val_rows (validation sentences), seed, stage1/2_tokens and _lr, lora_*, and the loop
    settings. Only as many training sentences as the longer stage draws are tokenized and embedded
    by the teacher (the first ones of the seeded shuffle), so a large source costs no more.
    """
    config.validate()
    if not config.method.startswith("lion-"):
        raise ValueError(f"run_encoder trains the LION methods (lion-lit, lion-d, lion-s), got {config.method!r}")
    processes = launched_world_size()
    if processes > 1:
        raise ValueError(f"the encoder methods train on one process; {config.method!r} was launched on {processes} "
                         "(use python, not torchrun, or --nproc-per-node 1)")
    if config.transfer_target != "heads":
        raise ValueError(f"encoders transfer attention per head; transfer_target must be 'heads', got {config.transfer_target!r}")
    out = Path(config.out)
    check_run_dir(out, config, resume)
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    random.seed(config.seed)

    model, tokenizer = load_teacher(config.model)
    if tokenizer is None:
        raise ValueError(f"model {config.model!r} has no tokenizer files; training needs one")
    targets = config.lora_targets or ENCODER_LORA_TARGETS
    check_lora_targets(model, targets)
    train_sentences = load_sentences(config.data, split="train", seed=config.seed)
    val_sentences = load_sentences(config.data, split="val", max_sentences=config.val_rows, seed=config.seed)
    train_rows = tokenize_sentences(tokenizer, train_sentences, config.seq_len)
    val_rows = tokenize_sentences(tokenizer, val_sentences, config.seq_len)
    mean_len = train_rows.num_tokens / len(train_rows)
    steps = lambda tokens: math.ceil(tokens / (config.batch_size * config.grad_accum * mean_len))  # noqa: E731
    needed = max(steps(config.stage1_tokens), steps(config.stage2_tokens)) * config.batch_size * config.grad_accum
    bank_size = min(len(train_rows), config.relational_bank) if config.relational > 0 else 0
    train_rows = _subset(train_rows, min(len(train_rows), max(needed, bank_size, 1)))
    log_progress(config, f"data: {len(train_rows)} training sentences ({train_rows.num_tokens:,} tokens, {mean_len:.1f} "
                 f"per sentence), {len(val_rows)} validation sentences")

    out.mkdir(parents=True, exist_ok=True)
    if not (out / CONFIG_FILE).is_file():
        write_json(out / CONFIG_FILE, config.to_dict())
    metrics = MetricsLog(out / "metrics.jsonl")
    if not resume and metrics.path.exists():
        metrics.path.unlink()
    model.to(device).eval()
    teacher = copy.deepcopy(model)
    if config.distill == 0:
        # with the hidden-state term every step runs the teacher anyway and pools its own targets
        train_rows.targets = _teacher_targets(teacher, train_rows, config, device, out)
    val_rows.targets = _teacher_targets(teacher, val_rows, config, device, None)

    bank = None
    if bank_size:  # the bank needs the teacher's embeddings of its own sentences only
        bank_rows = _subset(train_rows, bank_size)
        bank_targets = (bank_rows.targets if bank_rows.targets is not None
                        else _teacher_targets(teacher, bank_rows, config, device, out))
        bank = relational_bank(train_sentences, bank_targets, bank_size)

    batches = BucketedRows(train_rows, length_buckets(train_rows, config.batch_size, config.seed))
    loop_config = dataclasses.replace(config, batch_size=1)  # one item of ``batches`` is a whole batch

    convert(model, config.method, softmax_layers=config.softmax_layers, **config.overrides)
    model.to(device).eval()
    summary = {"method": config.method, "model": config.model, "device": str(device), "stages": [],
               "relational_bank": bank_size}

    # stage 1: attention transfer, teacher-forced, every LION layer at once
    params = lion_parameters(model)
    if steps(config.stage1_tokens) and params:
        layers = [m.layer_idx for m in lion_layers(model)]
        freeze_all_but(model, params)
        log_progress(config, f"stage1: layers {layers}, {sum(p.numel() for p in params):,} parameters, "
                     f"{steps(config.stage1_tokens)} steps")

        def loss1(batch):
            losses = transfer_losses(model, batch)
            mse = [losses[i] for i in layers]
            return torch.stack(mse).sum(), {"layer_mse": [x.item() for x in mse], "layers": layers}

        def eval1():
            sums = torch.zeros(len(layers), dtype=torch.float64)
            for batch, idx in _batches(val_rows, config.batch_size, device, by_length=True):
                with torch.no_grad(), autocast(device, config.precision):
                    losses = transfer_losses(model, batch)
                sums += torch.tensor([float(losses[i]) for i in layers], dtype=torch.float64) * len(idx)
            mse = (sums / len(val_rows)).tolist()
            return float(sum(mse)), {"layer_mse": mse, "layers": layers}

        stage = Stage("stage1", named_parameters_of(model, params), loss1, eval1, steps(config.stage1_tokens), config.stage1_lr)
        summary["stages"].append(fit(stage, batches, loop_config, device, out / "state" / "stage1.pt", metrics, resume))

    # stage 2: LoRA + the LION parameters on the teacher's sentence embeddings (no LoRA without steps)
    if steps(config.stage2_tokens):
        add_lora(model, rank=config.lora_rank, alpha=config.lora_alpha, dropout=config.lora_dropout, targets=targets)
        model.to(device).eval()
        params = lora_parameters(model) + lion_parameters(model)
        freeze_all_but(model, params)
        log_progress(config, f"stage2: LoRA rank {config.lora_rank} on {targets} + the LION parameters, "
                     f"{sum(p.numel() for p in params):,} parameters, {steps(config.stage2_tokens)} steps")

    def loss2(batch):
        extras = {}
        if config.distill == 0:
            student, target = sentence_embeddings(model, batch), batch["targets"]
            loss = torch.zeros((), device=student.device)
        else:
            kw = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                  "output_hidden_states": True}
            result = model(**kw)
            with torch.no_grad():
                reference = teacher(**kw).hidden_states
            student = F.normalize(mean_pool(result.last_hidden_state, batch["attention_mask"]).float(), dim=-1)
            target = F.normalize(mean_pool(reference[-1], batch["attention_mask"]).float(), dim=-1)
            hidden = hidden_state_loss(result.hidden_states[1:], reference[1:], batch["attention_mask"])
            loss = config.distill * hidden
            extras["hidden"] = hidden.item()
        cos = (student * target).sum(-1)
        loss = loss + (1 - cos).mean()
        extras["cosine"] = cos.mean().item()
        if bank is not None:
            # a batch row that is itself in the bank would see its own target at similarity 1: leave it out
            index = batch["index"]
            own = index.unsqueeze(1) == torch.arange(bank.shape[0], device=index.device).unsqueeze(0)
            rel = relational_loss(student, target, bank, config.relational_temperature, exclude=own)
            loss = loss + config.relational * rel
            extras["relational"] = rel.item()
        return loss, extras

    def eval2():
        agreement = embedding_agreement(model, val_rows, config.batch_size, device)
        return 1 - agreement["mean_cosine"], agreement

    if steps(config.stage2_tokens):
        stage = Stage("stage2", named_parameters_of(model, params), loss2, eval2, steps(config.stage2_tokens), config.stage2_lr)
        summary["stages"].append(fit(stage, batches, loop_config, device, out / "state" / "stage2.pt", metrics, resume))
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    summary["val"] = embedding_agreement(model, val_rows, config.batch_size, device)
    save(model, out, tokenizer=tokenizer, overwrite=True)  # the run's own directory: its checkpoint
    write_json(out / "summary.json", summary)
    from .plots import plot_metrics

    plot_metrics(metrics.path, out)
    log_progress(config, f"done: {out} (validation: mean cosine {summary['val']['mean_cosine']:.4f}, nearest-neighbour "
                 f"agreement {summary['val']['nn_agreement']:.3f}; linearize.load({str(out)!r}) opens it)")
    return out


def transfer_losses(model, batch: dict) -> dict[int, torch.Tensor]:
    """One teacher-forced forward: {layer index: MSE(LION heads, softmax heads)} (differentiable)."""
    recorder = TransferRecorder("heads")
    layers = lion_layers(model)
    try:
        for m in layers:
            m.transfer = recorder
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for m in layers:
            m.transfer = None
    return recorder.losses


def hidden_state_loss(student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor],
                      attention_mask: torch.Tensor) -> torch.Tensor:
    """Σ over layers of MSE(student, teacher hidden states) / mean(teacher²), real tokens only.

    Each layer's term is relative (its teacher's scale divided out), so no layer dominates.
    """
    keep = attention_mask.bool()
    return sum((s.float() - t.float())[keep].pow(2).mean() / t.float()[keep].pow(2).mean().clamp_min(1e-12)
               for s, t in zip(student, teacher))


def relational_bank(sentences: Sequence[str], targets: torch.Tensor, size: int) -> torch.Tensor:
    """The bank of the relational term: the teacher's embeddings (``targets``, row i = ``sentences[i]``)
    of the first ``size`` sentences. Only training sentences may enter it, so that no held-out
    sentence shapes what the student learns; any other split is refused, not skipped."""
    if size > min(len(sentences), targets.shape[0]):
        raise ValueError(f"a bank of {size} needs as many sentences and targets, got {len(sentences)} and {targets.shape[0]}")
    held_out = [s for s in sentences[:size] if sentence_split(s) != "train"]
    if held_out:
        raise ValueError(f"the relational bank takes training sentences only; {len(held_out)} are held out, "
                         f"e.g. {held_out[0]!r}")
    return targets[:size].detach()


def relational_loss(student: torch.Tensor, teacher: torch.Tensor, bank: torch.Tensor, temperature: float,
                    exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Listwise relational distillation: mean over rows of KL(softmax(t_i·bank/τ) || softmax(s_i·bank/τ)).

    ``student``, ``teacher`` (B, D) L2-normalised embeddings of the same sentences; ``bank`` (N, D)
    fixed teacher embeddings of other sentences. 1 - cosine treats every direction of the error
    alike; this term weighs the error by how it reorders the sentence's neighbours, which is what
    nearest-neighbour agreement counts. A small τ (0.02-0.05) concentrates it on the closest
    neighbours. ``exclude`` (B, N) bool drops bank entries (a row's own sentence) from both
    distributions. Zero exactly when the student's similarities to the bank equal the teacher's.
    """
    logits_s = student.float() @ bank.float().T / temperature
    logits_t = teacher.float() @ bank.float().T / temperature
    if exclude is not None:  # the same finite fill on both sides: those entries add exactly 0
        logits_s = logits_s.masked_fill(exclude, -1e4)
        logits_t = logits_t.masked_fill(exclude, -1e4)
    log_t = F.log_softmax(logits_t, dim=-1)
    return (log_t.exp() * (log_t - F.log_softmax(logits_s, dim=-1))).sum(-1).mean()


@torch.no_grad()
def embedding_agreement(model, rows: SentenceRows, batch_size: int, device) -> dict:
    """Mean cosine to ``rows.targets`` and nearest-neighbour agreement, over ``rows``."""
    student = _embed_rows(model, rows, batch_size, device)
    cos = (student * rows.targets).sum(-1)
    return {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()),
            "nn_agreement": nn_agreement(student, rows.targets)}


def _batches(rows: SentenceRows, batch_size: int, device, by_length: bool = False):
    """(batch on ``device``, row indices); ``by_length`` groups rows of similar length (less padding)."""
    order = torch.arange(len(rows))
    if by_length:
        order = torch.argsort(rows.attention_mask.sum(1), stable=True)
    for start in range(0, len(rows), batch_size):
        idx = order[start:start + batch_size].tolist()
        yield {k: v.to(device) for k, v in rows.batch(idx).items()}, idx


@torch.no_grad()
def _embed_rows(model, rows: SentenceRows, batch_size: int, device) -> torch.Tensor:
    """Pooled, normalised embeddings of every row (N, D), fp32 on the CPU."""
    out = None
    for batch, idx in _batches(rows, batch_size, device, by_length=True):
        e = sentence_embeddings(model, batch).float().cpu()
        out = e.new_empty(len(rows), e.shape[-1]) if out is None else out
        out[idx] = e
    return out


@torch.no_grad()
def _teacher_targets(teacher, rows: SentenceRows, config: TrainConfig, device, out: Path | None) -> torch.Tensor:
    """The teacher's embeddings of every row (N, D), cached in the run directory for a resume."""
    key = zlib.crc32(rows.input_ids.numpy().tobytes()) ^ zlib.crc32(rows.attention_mask.numpy().tobytes())
    cache = out / "state" / "teacher_embeddings.pt" if out is not None else None
    if cache is not None and cache.is_file():
        saved = torch.load(cache, map_location="cpu", weights_only=True)
        if saved.get("key") == key:
            return saved["targets"]
    targets = _embed_rows(teacher, rows, max(config.batch_size, 64), device)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + ".tmp")
        torch.save({"key": key, "targets": targets}, tmp)
        tmp.replace(cache)
    return targets


__all__ = ["ENCODER_LORA_TARGETS", "BucketedRows", "SentenceRows", "embedding_agreement", "relational_bank",
           "relational_loss", "run_encoder", "length_buckets", "tokenize_sentences", "transfer_losses"]
