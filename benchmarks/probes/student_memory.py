"""How long does a student's global memory keep anything? Per layer and head: the mean decay gate
over a text, as a memory length 1 / -mean(log gamma) in tokens (what is left of a write after that
many tokens is 1/e), the mean write strength (delta rule's beta) and the window weight alpha.

    PYTHONPATH=src python3 benchmarks/probes/student_memory.py MODEL [--text FILE] [--tokens N]

MODEL is a checkpoint folder or a bundled student's name. A student whose memory lengths are all
under its window (128 tokens) is a sliding-window model: nothing it read earlier can come back.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

DEFAULT_TEXT = Path(__file__).resolve().parents[3] / "shared" / "data" / "kjv_bible.txt"


def memory_profile(model, ids: torch.Tensor) -> list[dict]:
    """Per linearized layer: ``memory`` (tokens, per head), ``beta`` and ``alpha`` (per head, where the
    layer has them), from one forward of ``ids`` (1, T)."""
    from linearize.models.convert import linearized_layers

    layers, seen, hooks = list(linearized_layers(model)), {}, []
    for m in layers:
        for name in ("gate", "beta_proj"):
            module = getattr(m.hybrid, name, None)
            if module is not None:
                hooks.append(module.register_forward_hook(
                    lambda mod, inp, out, key=(m.layer_idx, name): seen.__setitem__(key, out.detach().float())))
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    rows = []
    for m in layers:
        row = {"layer": m.layer_idx}
        log_g = seen.get((m.layer_idx, "gate"))
        if log_g is not None:  # (1, H, T) or (1, H, T, C): mean over tokens (and channels)
            mean = log_g[0].flatten(1).mean(-1) if log_g.dim() == 3 else log_g[0].mean(dim=(1, 2))
            row["memory"] = (-1.0 / mean.clamp_max(-1e-9)).tolist()
        if (m.layer_idx, "beta_proj") in seen:
            row["beta"] = seen[(m.layer_idx, "beta_proj")][0].exp().mean(-1).tolist()
        if hasattr(m.hybrid, "alpha"):
            row["alpha"] = m.hybrid.alpha.detach().float().tolist()
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--json", help="also write the profile here")
    a = p.parse_args(argv)
    import linearize

    model, tokenizer = linearize.load(a.model)
    model.eval()
    text = Path(a.text).read_text(encoding="utf-8", errors="replace")
    ids = tokenizer(text[len(text) // 3:][: a.tokens * 8], return_tensors="pt")["input_ids"][:, : a.tokens]
    rows = memory_profile(model, ids)
    for r in rows:
        mem = " ".join(f"{x:6.0f}" for x in r.get("memory", []))
        extra = f"  beta {sum(r['beta']) / len(r['beta']):.2f}" if "beta" in r else ""
        print(f"layer {r['layer']:2d}  memory (tokens) {mem}{extra}")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "tokens": int(ids.shape[1]), "layers": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
