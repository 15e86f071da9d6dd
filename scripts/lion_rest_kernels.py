"""How well LION's rest keys are weighed: per layer of a LION MiniLM checkpoint with exact keys
(sinks 1 + window 2), on the teacher's own q, k, v of 128 validation sentences (LoRA off), the
squared error of the rest's output (the keys that are neither [CLS] nor within 2 of the query)
against the teacher's softmax over the same keys, as a share of a uniform average's error, for
the checkpoint's trained Hedgehog features (with and without its decays), the second-order Taylor
kernel 1 + t s + (t s)^2 / 2 of the scaled scores s (Based's map, no training), and exp(t s).
First it prints where the teacher's attention mass goes ([CLS], [SEP], the window, the rest).
Quoted in docs/results/lion-minilm-trials.json (session of 2026-11-22).

    .venv/bin/python scripts/lion_rest_kernels.py runs/lion-minilm-s-v4
"""
import math
import sys

import torch

import linearize
from linearize.models.encoder import lion_layers
from linearize.models.lora import lora_disabled
from linearize.ops.lion.naive import lion_mask
from linearize.data.sentences import load_sentences

DATA = "/work/shared/data/wiki_demo.txt,/work/shared/data/c4_demo.jsonl"
SINKS, WINDOW = 1, 2


def teacher_forward(teacher, enc) -> tuple[dict[int, torch.Tensor], tuple[torch.Tensor, ...]]:
    """One forward of the teacher: the hidden states entering each attention layer, (B, T,
    hidden), and each layer's softmax attention weights, (B, H, T, T)."""
    xs, hooks = {}, []
    for i, layer in enumerate(teacher.encoder.layer):
        def grab(module, args, kwargs, i=i):
            xs[i] = (args[0] if args else kwargs["hidden_states"]).detach()
        hooks.append(layer.attention.self.register_forward_pre_hook(grab, with_kwargs=True))
    with torch.no_grad():
        attentions = teacher(**enc, output_attentions=True).attentions
    for h in hooks:
        h.remove()
    return xs, attentions


def attention_mass(attentions, enc) -> None:
    """Where the teacher's softmax mass goes, per layer (mean over valid queries and heads): [CLS],
    [SEP] (the last real token), the other keys within 2 of the query, and the rest."""
    valid = enc["attention_mask"].bool()
    B, T = valid.shape
    sep = valid.sum(1) - 1
    idx = torch.arange(T)
    for li, a in enumerate(attentions):                      # (B, H, T, T)
        H = a.shape[1]
        m_cls = a[..., 0]
        m_sep = a.gather(3, sep.view(B, 1, 1, 1).expand(B, H, T, 1)).squeeze(-1)
        near = ((idx[:, None] - idx[None, :]).abs() <= WINDOW) & (idx[None, :] != 0)
        near = near[None] & (idx[None, None, :] != sep.view(B, 1, 1))   # (B, T, T)
        m_near = (a * near[:, None]).sum(-1)
        q = valid[:, None, :].expand(B, H, T)

        def mean(m):
            return ((m * q).sum() / q.sum()).item()
        print(f"layer {li}: mass on [CLS] {mean(m_cls):.3f}, [SEP] {mean(m_sep):.3f}, "
              f"within {WINDOW} {mean(m_near):.3f}, rest {mean(1 - m_cls - m_sep - m_near):.3f}", flush=True)


def main(checkpoint: str) -> None:
    torch.set_num_threads(2)
    model, tok = linearize.load(checkpoint)
    teacher, _ = linearize.load_teacher("minilm-l6")
    enc = tok(load_sentences(DATA, split="val", max_sentences=128), padding=True, truncation=True, max_length=128,
              return_tensors="pt")
    valid = enc["attention_mask"].bool()
    B, T = valid.shape
    teacher.set_attn_implementation("eager")  # SDPA returns no attention weights
    xs, attentions = teacher_forward(teacher, enc)
    attention_mass(attentions, enc)
    idx = torch.arange(T)
    exact = (idx < SINKS)[None, :] | ((idx[:, None] - idx[None, :]).abs() <= WINDOW)
    rest = ~exact[None] & valid[:, None, :]              # (B, T, T): the keys LION covers
    queries = valid & rest.any(-1)                        # queries that have a rest

    def rest_output(w, v):
        w = w * rest[:, None]
        return (w @ v) / w.sum(-1, keepdim=True).clamp_min(1e-30)

    with torch.no_grad(), lora_disabled(model):
        for li, lsa in enumerate(lion_layers(model)):
            x = xs[li]
            q, k, v = lsa.heads(x)
            s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            o_teacher = torch.softmax(s.masked_fill(~rest[:, None], float("-inf")), -1).nan_to_num(0) @ v

            def err(weights):
                e = ((rest_output(weights, v) - o_teacher) ** 2).sum(-1)   # (B, H, T)
                return (e * queries[:, None]).sum().item() / queries.sum().item() / q.shape[1]

            base = err(torch.ones_like(s))
            lion = lsa.lion
            M = lion_mask(lion.log_decay(x), T, valid, batch_size=B, dtype=torch.float32,
                          log_a_back=lion.log_decay_back(x))
            phi = lion.phi_q(q) @ lion.phi_k(k).transpose(-1, -2)
            taylor = lambda t: 1 + t * s + (t * s) ** 2 / 2  # noqa: E731
            rows = {"hedgehog+decay": err(phi * M), "hedgehog no decay": err(phi)}
            rows |= {f"taylor t{t}": err(taylor(t)) for t in (0.25, 0.5, 0.75, 1.0, 1.5)}
            rows |= {f"taylor*M t{t}": err(taylor(t) * M) for t in (0.5, 1.0)}
            rows |= {f"exp t{t}": err(torch.exp(t * s)) for t in (0.5, 1.0)}
            print(f"layer {li}: uniform err {base:.4f} | " + " ".join(f"{n} {e / base:.3f}" for n, e in rows.items()),
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/lion-minilm-s-v4")
