"""``TrainConfig``: every setting of a two-stage linearization run, one dataclass.

The CLI builds it from a YAML/JSON file and flags (flag names are the field names with dashes);
``linearize.train.run(config)`` runs it. ``validate`` names any bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from numbers import Integral, Real

PACKING = ("split", "pack", "concat")  # data.packing.PACKING_POLICIES, kept here so the CLI need not import torch
TRANSFER_TARGETS = ("heads", "output")
LR_SCHEDULES = ("cosine", "plateau", "constant")
MU_SCHEDULES = ("constant", "ramp", "cyclic", "switch")
PRECISIONS = ("auto", "bf16", "fp32")
LOSS_ON = ("all", "assistant")
LOSS_AVERAGES = ("token", "document")  # data.packing.WEIGHTINGS
SHARDS = ("auto", "fsdp", "replicate")  # train.distributed.Parallel.mode


@dataclass
class TrainConfig:
    # what to linearize, on what, and where the run lives
    method: str = "lizard"
    model: str = "smollm2-135m"          # a bundled teacher name, a local HF directory, or a hub id
    data: str = "shakespeare"            # a file (.jsonl, .jsonl.xz, ...), a folder, "shakespeare", "passkey", "retrieval:FORMAT", a HF dataset name, or a mixture A:0.6,B:0.4
    out: str = "runs/lizard"
    softmax_layers: list[int] | float | str | None = None  # kept as softmax attention: indices (0,5,9), a fraction of the layers (0.25), or auto:K (after stage 1, the K layers with the largest transfer error go back to softmax)
    overrides: dict = field(default_factory=dict)  # AttentionConfig fields (window, gate, ...)

    # data
    seq_len: int = 512
    packing: str = "pack"                # pack: whole documents several to a row, full rows (the state crosses documents in a row; only documents longer than a row are cut) | split: documents never share a row, short ones padded | concat: the papers' packing, documents cut at row ends
    val_fraction: float = 0.05
    loss_on: str = "all"                 # stage-2 next-token loss on all tokens | assistant: only chat/Alpaca answers (plain text still counts whole)
    loss_average: str = "token"          # stage 2's loss is the mean over labelled tokens | document: the mean over documents (each, or each seq_len-long piece of a longer one, weighs the same: a retrieval example's 5-token answer counts as much as a 500-token chat)
    val_rows: int = 16                   # validation rows evaluated (at most)
    seed: int = 0

    # stage 1: attention transfer
    stage1_tokens: int = 1_000_000
    stage1_lr: float = 3e-2              # measured: docs/results/lr-defaults-smollm2.md
    transfer_target: str = "heads"       # heads: per head before o_proj (LoLCATs) | output: after o_proj
    stage1_memory: bool = True           # stage 1 also trains the global memory's decay gate and write strength | off: they keep their initial long memory (matching the teacher on ordinary text, stage 1 learns to close them)
    block_size: int | None = None        # layers trained together; None = all jointly

    # stage 2: LoRA
    stage2_tokens: int = 1_000_000
    stage2_lr: float = 3e-3
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: list[str] | None = None  # None: the architecture's q, k, v, o projections
    stage2_attention: bool = False       # stage 2 also trains the new attention modules (feature maps, gates, write strength, sinks, window weight) beside LoRA, at stage2_lr
    distill: float = 0.0                 # weight of KL(teacher || student) on logits; 0 = next-token loss only
    distill_temperature: float = 1.0
    relational: float = 0.0              # encoders: weight of KL(teacher || student) similarities to a bank; 0 = off
    relational_temperature: float = 0.05  # encoders: softmax temperature of the relational term
    relational_bank: int = 4096          # encoders: teacher embeddings of training sentences in the bank
    mu_schedule: str = "ramp"            # liza only: constant | ramp 0.01 -> 0.5 | cyclic | switch
    mu_steps: int = 100

    # the loop (both stages)
    batch_size: int = 8
    grad_accum: int = 1
    weight_decay: float = 0.0
    lr_schedule: str = "cosine"          # cosine with warmup (Lizard) | plateau (LoLCATs) | constant
    warmup_steps: int = 10
    plateau_patience: int = 2            # evaluations without improvement before the LR is cut
    plateau_factor: float = 0.1
    clip: float = 1.0                    # gradient norm clipping; 0 = off
    precision: str = "auto"              # auto: bf16 autocast on CUDA, fp32 elsewhere
    device: str = "auto"
    eval_every: int = 50                 # optimizer steps between validations
    early_stop_patience: int | None = None  # validations without improvement before stopping
    max_nonfinite: int = 5               # consecutive non-finite losses before the run stops
    save_every: int = 50                 # optimizer steps between resume checkpoints
    progress: bool = True
    shard: str = "auto"                  # several processes: fsdp (FSDP2, each rank 1/N of the weights) | replicate (each rank a whole copy, gradients all-reduced after the step; CUDA graphs and compile as on one GPU) | auto: replicate on CUDA where the model takes at most 1/8 of a GPU's memory, else fsdp (CPU ranks: fsdp)
    cuda_graph: bool = True              # on CUDA: each micro-batch's forward+backward replayed as one CUDA graph
    compile: bool = True                 # on CUDA: the feature maps, gates and the layers' elementwise glue fused by torch.compile

    def validate(self) -> "TrainConfig":
        from ..methods import methods

        if self.method not in methods():
            raise ValueError(f"method must be one of {sorted(methods())}, got {self.method!r}")
        _one_of(self, "packing", PACKING)
        _one_of(self, "transfer_target", TRANSFER_TARGETS)
        _one_of(self, "lr_schedule", LR_SCHEDULES)
        _one_of(self, "mu_schedule", MU_SCHEDULES)
        _one_of(self, "precision", PRECISIONS)
        _one_of(self, "loss_on", LOSS_ON)
        _one_of(self, "loss_average", LOSS_AVERAGES)
        _one_of(self, "shard", SHARDS)
        if str(self.method).startswith("lion-"):  # encoders read comma-joined sentence sources (train/encoder.py)
            if not isinstance(self.data, str):
                raise ValueError(f"data of an encoder method must be a string (sources joined by commas), got {self.data!r}")
        else:
            from ..data.mixture import format_data_spec

            self.data = format_data_spec(self.data)  # a list/mapping from a config file -> "A:0.6,B:0.4"; names a bad spec
        for name in ("seq_len", "batch_size", "grad_accum", "lora_rank", "mu_steps", "eval_every",
                     "save_every", "max_nonfinite", "val_rows", "relational_bank"):
            _positive_int(self, name)
        for name in ("stage1_tokens", "stage2_tokens", "warmup_steps", "plateau_patience"):
            _non_negative_int(self, name)
        for name in ("block_size", "early_stop_patience"):
            if getattr(self, name) is not None:
                _positive_int(self, name)
        for name in ("stage1_lr", "stage2_lr", "lora_alpha", "distill_temperature", "relational_temperature"):
            _positive_real(self, name)
        for name in ("weight_decay", "clip", "lora_dropout", "relational"):
            value = getattr(self, name)
            if not _is_real(value) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        for name, lo, hi in (("val_fraction", 0.0, 0.5), ("distill", 0.0, 1.0), ("plateau_factor", 0.0, 1.0)):
            value = getattr(self, name)
            if not _is_real(value) or not lo <= value <= hi:
                raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
        if self.val_fraction == 0 and (self.early_stop_patience or self.lr_schedule == "plateau"):
            raise ValueError("early stopping and the plateau schedule need a validation split; val_fraction is 0")
        from ..models.convert import auto_softmax_count

        if auto_softmax_count(self.softmax_layers) is not None:  # names a malformed auto:K
            self.softmax_layers = f"auto:{auto_softmax_count(self.softmax_layers)}"
            if str(self.method).startswith("lion-"):
                raise ValueError(f"softmax_layers {self.softmax_layers!r} is for causal methods; "
                                 f"{self.method!r} takes layer indices or a fraction")
            if self.stage1_tokens == 0:
                raise ValueError(f"softmax_layers {self.softmax_layers!r} measures each layer's error after stage 1; "
                                 "stage1_tokens is 0 (give stage 1 tokens, or name the layers)")
        elif isinstance(self.softmax_layers, str):
            raise ValueError(f"softmax_layers must be layer indices, a fraction or auto:K, got {self.softmax_layers!r}")
        if not isinstance(self.overrides, dict):
            raise ValueError(f"overrides must be a mapping of AttentionConfig fields, got {self.overrides!r}")
        if self.lora_targets is not None and (not isinstance(self.lora_targets, list) or not self.lora_targets
                                              or not all(isinstance(t, str) and t for t in self.lora_targets)):
            raise ValueError(f"lora_targets must be a non-empty list of module names, got {self.lora_targets!r}")
        for name in ("progress", "cuda_graph", "compile", "stage1_memory", "stage2_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith(("cuda", "mps"))):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda[:N]' or 'mps', got {self.device!r}")
        from ..methods import method_config

        method_config(self.method, **self.overrides)  # names a bad override
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown training setting(s) {unknown}; allowed: {sorted(names)}")
        from ..methods import method_training, methods

        method = values.get("method", cls.method)
        if method in methods():  # the method's own recipe under what is given (an unknown one is named in validate)
            values = {**method_training(method), **values}
        return cls(**values).validate()


def _is_real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _one_of(config, name: str, allowed: tuple) -> None:
    value = getattr(config, name)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _positive_int(config, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _non_negative_int(config, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _positive_real(config, name: str) -> None:
    value = getattr(config, name)
    if not _is_real(value) or value <= 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
