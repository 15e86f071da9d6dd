"""The attention-transfer report: how close each linearized layer stays to the teacher's softmax.

For a checkpoint and held-out text it measures, with teacher forcing (every layer reads the
teacher's hidden states, as in stage 1):

- per layer, the MSE between the student's and the teacher's attention heads (before ``o_proj``),
  for the trained checkpoint and for the same conversion untrained (fresh feature maps and gates);
- for a few (layer, head) pairs, the attention weights of teacher, trained and untrained student
  over the first ``map_tokens`` tokens of one row (LoLCATs appendix E.2 style).

Every mixer here is linear in the values, so its weights are read exactly by feeding the identity
as values (v = I: row t of the output is the weight each key gets from query t). A mixer that is
not (TPTT's delta branch ends in an RMSNorm) has no weight matrix; its maps are left out and the
JSON says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from ..data.packing import pack
from ..data.sources import load_documents
from ..models.checkpoint import load, read_meta
from ..models.convert import convert, linearized_layers
from ..models.attention import TransferRecorder
from ..models.loading import model_label
from ..models.lora import lora_disabled
from ..models.teacher import load_teacher
from ..records import environment, markdown_table, new_figure, save_png, write_outputs

STEM = "report"


def _untrained_like(meta: dict, device, dtype):
    model, _ = load_teacher(meta["base"]["name"], device=device, dtype=dtype)
    torch.manual_seed(0)
    return convert(model, meta["method"], softmax_layers=meta["softmax_layers"], **meta["overrides"])


def _linear_in_values(model) -> bool:
    return all(m.hybrid.config.global_rule != "delta" for m in linearized_layers(model))


@torch.no_grad()
def layer_mse(model, batches: list[dict]) -> dict[int, float]:
    """Per linearized layer: mean over batches of MSE(student heads, teacher heads), teacher-forced."""
    layers = linearized_layers(model)
    sums = {m.layer_idx: 0.0 for m in layers}
    recorder = TransferRecorder("heads")
    try:
        for m in layers:
            m.transfer = recorder
        for batch in batches:
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            for i, loss in recorder.losses.items():
                sums[i] += float(loss) / len(batches)
    finally:
        for m in layers:
            m.transfer = None
    return sums


@torch.no_grad()
def attention_maps(model, input_ids: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> dict:
    """{(layer, head): (teacher (T, T), student (T, T))} weights for one row, teacher-forced."""
    by_idx = {m.layer_idx: m for m in linearized_layers(model)}
    captured: dict[int, tuple] = {}
    hooks = []
    recorder = TransferRecorder("heads")
    try:
        for layer in {p[0] for p in pairs}:
            m = by_idx[layer]
            m.transfer = recorder
            hooks.append(m.hybrid.register_forward_pre_hook(
                lambda mod, args, kwargs, i=layer: captured.__setitem__(i, (args, kwargs)), with_kwargs=True))
        for m in by_idx.values():
            m.transfer = recorder
        model(input_ids=input_ids)
    finally:
        for h in hooks:
            h.remove()
        for m in by_idx.values():
            m.transfer = None
    out = {}
    for layer, head in pairs:
        m = by_idx[layer]
        args, kwargs = captured[layer]
        q, k, v, q_rope, k_rope, x = args[:6]
        T = q.shape[2]
        # identity values: output row t = the weight of every key for query t
        eye = torch.eye(T, dtype=v.dtype, device=v.device).expand(v.shape[0], v.shape[1], T, T)
        teacher = m.teacher_heads(q_rope, k_rope, eye, None)
        student, _ = m.hybrid(q, k, eye, q_rope, k_rope, x, None, None, q_far=kwargs.get("q_far"))
        out[(layer, head)] = (teacher[0, head].float().cpu(), student[0, head].float().cpu())
    return out


def pick_pairs(layer_ids: list[int], layers: Sequence[int] | None, heads: int) -> list[tuple[int, int]]:
    """(layer, head) pairs to draw: the given layers (default first, middle, last) x heads 0..heads-1."""
    if layers is None:
        layers = sorted({layer_ids[0], layer_ids[len(layer_ids) // 2], layer_ids[-1]})
    bad = [i for i in layers if i not in layer_ids]
    if bad:
        raise ValueError(f"layers {bad} are not linearized layers of this model (linearized: {layer_ids})")
    return [(i, h) for i in layers for h in range(heads)]


def run_report(checkpoint: str, data: str, out_dir: str | Path, *, rows: int = 8, seq_len: int = 256,
               batch_size: int = 4, layers: Sequence[int] | None = None, heads: int = 2, map_tokens: int = 64,
               device: str | None = None, dtype: torch.dtype | None = None, text_field: str | None = None) -> dict:
    """Write report.json, report.png and report.md for a linearized checkpoint on held-out ``data``."""
    for name, value in (("rows", rows), ("seq_len", seq_len), ("batch_size", batch_size), ("heads", heads),
                        ("map_tokens", map_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    meta = read_meta(checkpoint)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    student, tokenizer = load(checkpoint, device=device, dtype=dtype)
    untrained = _untrained_like(meta, device, dtype)
    if tokenizer is None:
        raise ValueError(f"checkpoint {checkpoint} has no tokenizer; the report needs one to read {data}")
    packed = pack(load_documents(data, tokenizer, text_field=text_field), seq_len, "concat",
                  pad_id=tokenizer.pad_token_id or 0)
    if len(packed) == 0:
        raise ValueError(f"{data} gives no rows of {seq_len} tokens")
    # the last rows: training reads sources from the front, so these are the least likely seen
    chosen = list(range(max(0, len(packed) - rows), len(packed)))
    batches = [{k: v.to(device) for k, v in packed.batch(chosen[i:i + batch_size]).items()}
               for i in range(0, len(chosen), batch_size)]
    layer_ids = sorted(m.layer_idx for m in linearized_layers(student))
    pairs = pick_pairs(layer_ids, layers, min(heads, linearized_layers(student)[0].num_heads))

    maps: list[dict] = []
    reason = None
    # Stage-2 LoRA also moves the projections the teacher's softmax is computed from: switch it
    # off so "teacher" means the teacher (a merged checkpoint cannot, and the JSON says so).
    with lora_disabled(student):
        mse_trained, mse_untrained = layer_mse(student, batches), layer_mse(untrained, batches)
        if _linear_in_values(student):
            ids = batches[0]["input_ids"][:1, :map_tokens]
            trained_maps, untrained_maps = attention_maps(student, ids, pairs), attention_maps(untrained, ids, pairs)
            for pair in pairs:
                teacher, s = trained_maps[pair]
                maps.append({"layer": pair[0], "head": pair[1], "teacher": teacher.tolist(), "student": s.tolist(),
                             "untrained": untrained_maps[pair][1].tolist()})
        else:
            reason = f"{meta['method']}'s linear branch ends in an RMSNorm, so it has no attention-weight matrix"
    data_out = {
        "checkpoint": str(checkpoint), "label": model_label(checkpoint), "method": meta["method"],
        "base": meta["base"]["name"], "data": data, "rows": len(chosen), "seq_len": seq_len,
        "layers": layer_ids,
        "mse": {"trained": [mse_trained[i] for i in layer_ids], "untrained": [mse_untrained[i] for i in layer_ids]},
        "merged": bool(meta.get("merged")),  # any stage-2 LoRA is folded in and cannot be switched off
        "maps": maps, "maps_skipped": reason, "map_tokens": int(min(map_tokens, seq_len)),
        "environment": environment(device),
    }
    write_outputs(out_dir, STEM, data_out, report_markdown, report_figure)
    return data_out


def report_markdown(data: dict) -> str:
    tr, un = data["mse"]["trained"], data["mse"]["untrained"]
    rows = [[i, a, b, f"{b / a:.1f}x" if a > 0 else "–"] for i, a, b in zip(data["layers"], tr, un)]
    mean_tr, mean_un = sum(tr) / len(tr), sum(un) / len(un)
    env = data["environment"]
    lines = [f"# Attention-transfer report: {data['label']}", "",
             f"{data['method']} on {data['base']}; {data['rows']} held-out rows of {data['seq_len']} tokens "
             f"from {data['data']}, teacher-forced. MSE of the attention heads against the teacher's softmax.", "",
             f"Mean MSE: trained {mean_tr:.4g}, untrained {mean_un:.4g} "
             f"({sum(a < b for a, b in zip(tr, un))} of {len(tr)} layers closer after training).", "",
             markdown_table(["layer", "MSE trained", "MSE untrained", "untrained / trained"], rows), ""]
    if data["maps_skipped"]:
        lines += [f"Attention maps: not drawn ({data['maps_skipped']}).", ""]
    else:
        shown = ", ".join(f"{m['layer']}/{m['head']}" for m in data["maps"])
        lines += [f"Attention maps over the first {data['map_tokens']} tokens of one row are in report.png "
                  f"(layer/head: {shown}).", ""]
    lines += [f"Device: {env['device']}; torch {env['torch']}. Command: `{env['command']}`", ""]
    return "\n".join(lines)


def report_figure(data: dict, path: Path) -> None:
    from matplotlib.colors import PowerNorm
    from matplotlib.ticker import MaxNLocator

    maps = data["maps"]
    fig, _ = new_figure((9.0, 3.2 + 2.6 * len(maps)), nrows=0)
    grid = fig.add_gridspec(1 + len(maps), 3, height_ratios=[1.2] + [1.0] * len(maps))
    top = fig.add_subplot(grid[0, :])
    top.semilogy(data["layers"], data["mse"]["untrained"], "o-", color="#d7191c", label="untrained conversion")
    top.semilogy(data["layers"], data["mse"]["trained"], "o-", color="#1a9641", label="trained")
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_xlabel("layer")
    top.set_ylabel("attention MSE vs teacher")
    top.set_title(f"{data['label']}: per-layer attention-transfer MSE ({data['rows']} held-out rows)", fontsize=9)
    top.legend(fontsize=8)
    for r, m in enumerate(maps, start=1):
        # a square-root colour scale: attention is spiky, and the linear scale hides the tail
        norm = PowerNorm(0.5, vmin=0, vmax=max(max(row) for row in m["teacher"]))
        for c, (key, title) in enumerate((("teacher", "teacher softmax"), ("student", "trained"),
                                          ("untrained", "untrained"))):
            ax = fig.add_subplot(grid[r, c])
            ax.imshow(m[key], cmap="viridis", norm=norm, aspect="equal")
            ax.set_title(f"layer {m['layer']} head {m['head']}: {title}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    save_png(fig, path)
