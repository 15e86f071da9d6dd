"""The LION layer's three forms (exact keys, Hedgehog / Taylor / Taylor + Hedgehog, padding) on CUDA against the
fp64 CPU parallel form, fp32 and bf16, and the chunk form's backward on CUDA. Run on a GPU machine from the repo root:

    PYTHONPATH=src python3 scripts/lion_gpu_check.py
"""
import torch
from linearize.layers.lion import LionAttention, LionConfig

torch.manual_seed(0)
H, D, HID, B, T = 4, 16, 64, 2, 300
for fmap in ("hedgehog", "taylor", "taylor+hedgehog"):
    for exact in ({}, {"sinks": 1, "window": 2}):
        cfg = LionConfig(variant="s", asymmetric=True, feature_map=fmap, chunk_size=32, **exact)
        layer = LionAttention(cfg, H, D, HID)
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(0.1 * torch.randn_like(p))
        q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
        x = torch.randn(B, T, HID)
        valid = torch.ones(B, T, dtype=torch.bool)
        valid[1, 250:] = False
        with torch.no_grad():
            ref = layer.double()(q.double(), k.double(), v.double(), x.double(), valid, form="parallel")
            g = layer.float().cuda()
            for dt in (torch.float32, torch.bfloat16):
                for form in ("parallel", "chunk", "recurrent"):
                    if form == "recurrent" and dt == torch.bfloat16:
                        continue
                    y = g(*(t.cuda().to(dt) for t in (q, k, v)), x.cuda().to(dt), valid.cuda(), form=form)
                    err = ((y.double().cpu() - ref).norm() / ref.norm()).item()
                    print(f"{fmap:16s} exact={bool(exact)!s:5s} {str(dt):15s} {form:9s} rel err {err:.2e}")
        layer.cpu()
        # gradients on CUDA, chunk form
        g = layer.float().cuda()
        qq, kk, vv = (t.cuda().requires_grad_() for t in (q, k, v))
        g(qq, kk, vv, x.cuda(), valid.cuda(), form="chunk").pow(2).sum().backward()
        bad = [n for n, p in g.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
        print(f"{fmap:16s} exact={bool(exact)!s:5s} chunk backward on CUDA: parameters without a finite gradient: {bad}")
        layer.cpu()
print(torch.cuda.get_device_name())
