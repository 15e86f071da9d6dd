"""How well LION's rest keys are weighed: per layer of a LION MiniLM checkpoint with exact keys
(sinks 1 + window 2), on the teacher's own q, k, v of 128 validation sentences (LoRA off), the
squared error of the rest's output (the keys that are neither [CLS] nor within 2 of the query)
against the teacher's softmax over the same keys, as a share of a uniform average's error, for
the checkpoint's trained Hedgehog features (with and without its decays), the second-order Taylor
kernel 1 + t s + (t s)^2 / 2 of the scaled scores s (Based's map, no training), and exp(t s).
Quoted in docs/results/lion-minilm-trials.json (session of 2026-11-22).

    .venv/bin/python scripts/lion_rest_kernels.py runs/lion-minilm-s-v4
"""
import math, sys
import torch, linearize
from linearize.train.encoder import load_sentences
from linearize.models.encoder import lion_layers
from linearize.models.lora import lora_disabled
from linearize.ops.lion.naive import lion_mask
torch.set_num_threads(2)
model, tok = linearize.load(sys.argv[1] if len(sys.argv) > 1 else "runs/lion-minilm-s-v4")
teacher, _ = linearize.load_teacher("minilm-l6")
sents = load_sentences("/work/shared/data/wiki_demo.txt,/work/shared/data/c4_demo.jsonl", split="val", max_sentences=128)
enc = tok(sents, padding=True, truncation=True, max_length=128, return_tensors="pt")
valid = enc["attention_mask"].bool()
B, T = valid.shape
xs = {}
layers = teacher.encoder.layer
hooks = [l.attention.self.register_forward_pre_hook(lambda m, a, kw, i=i: xs.__setitem__(i, (a[0] if a else kw["hidden_states"]).detach()), with_kwargs=True) for i, l in enumerate(layers)]
with torch.no_grad():
    teacher(**enc)
for h in hooks: h.remove()
idx = torch.arange(T)
exact = (idx < 1)[None, :] | ((idx[:, None] - idx[None, :]).abs() <= 2)
rest = ~exact[None] & valid[:, None, :]              # (B, T, T)
qmask = valid & rest.any(-1)                          # queries with a rest
def out(w, v):
    w = w * rest[:, None]
    return (w @ v) / w.sum(-1, keepdim=True).clamp_min(1e-30)
with torch.no_grad(), lora_disabled(model):
    for li, lsa in enumerate(lion_layers(model)):
        x = xs[li]
        q, k, v = lsa.heads(x)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        s_r = s.masked_fill(~rest[:, None], float("-inf"))
        oT = torch.softmax(s_r, -1).nan_to_num(0) @ v
        def err(o):
            e = ((o - oT) ** 2).sum(-1)                   # (B, H, T)
            return (e * qmask[:, None]).sum().item() / qmask.sum().item() / q.shape[1]
        base = err(out(torch.ones_like(s), v))
        lion = lsa.lion
        M = lion_mask(lion.log_decay(x), T, valid, batch_size=B, dtype=torch.float32, log_a_back=lion.log_decay_back(x))
        hh = err(out((lion.phi_q(q) @ lion.phi_k(k).transpose(-1, -2)) * M, v)) / base
        hh_nodecay = err(out(lion.phi_q(q) @ lion.phi_k(k).transpose(-1, -2), v)) / base
        tay = {t: err(out(1 + t * s + (t * s) ** 2 / 2, v)) / base for t in (0.25, 0.5, 0.75, 1.0, 1.5)}
        tayM = {t: err(out((1 + t * s + (t * s) ** 2 / 2) * M, v)) / base for t in (0.5, 1.0)}
        ex = {t: err(out(torch.exp(t * s), v)) / base for t in (0.5, 1.0)}
        print(f"layer {li}: uniform err {base:.4f} | hedgehog+decay {hh:.3f} hedgehog no decay {hh_nodecay:.3f} | taylor " +
              " ".join(f"t{t}:{e:.3f}" for t, e in tay.items()) + " | taylor*M " + " ".join(f"t{t}:{e:.3f}" for t, e in tayM.items()) +
              " | exp " + " ".join(f"t{t}:{e:.3f}" for t, e in ex.items()), flush=True)
