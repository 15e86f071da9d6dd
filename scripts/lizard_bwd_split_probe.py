"""Does Lizard's backward gain from running in batch parts on parallel CUDA streams?

The backward is two kernels in a row, the window's and then the fused gated one (which reads the
window's dv and dy . o_w), each one program per (batch, head) with one program per
multiprocessor: at B16 and 32 heads, 512 programs on 132 multiprocessors, 3.88 waves, the last
with 16 idle. Split the batch into parts, each part's window kernel then gated kernel on a
stream of its own: a part's gated programs can start on the multiprocessors another part's
window kernel leaves idle. This times the two kernels over the whole batch on one stream against
the parts on streams (same intermediates, from one forward of the op), medians over rounds.

    python scripts/lizard_bwd_split_probe.py --out OUT [--shape 16x2048] [--rounds 5] [--parts 2,4]

Writes OUT/lizard-bwd-split.json. (The parts gained on an H100 in the GPU's time but not as a
default in the op: docs/results/lizard-host-time-h100.md.)
"""

from __future__ import annotations

import argparse
import statistics

import torch
from triton.testing import do_bench

from linearize.bench.kernels import _shape_inputs
from linearize.ops.gla import triton as kgla
from linearize.ops.window_attn import triton as kwin
from linearize.ops.lizard_attn.fused import lizard_attention
from probe_common import write_rows

NAMES = ("lq", "lk", "v", "log_g", "q", "k", "alpha", "sinks")


def _backward_inputs(B: int, T: int) -> dict:
    """One training forward of the op at the bench's inputs; what its backward reads."""
    x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
    leaves = [x[n].detach().requires_grad_() for n in NAMES]
    lq, lk, v, lg, q, k, alpha, sinks = leaves
    y = lizard_attention(lq, lk, v, lg, q, k, alpha, window=128, sink_logits=sinks)[0]
    node = y.grad_fn
    phi_q, phi_k, v_, log_g, q_w, k_w, sinks_, alpha_, kmin, y_kept = node.saved_tensors
    normalize, log_space, eps, window, scale, segs, has_state, cfg, gcfg, wcfg = node.args
    if y_kept is None or node.inter["o_g"] is not None or node.inter["paired"]:
        raise SystemExit("this probe takes the default path (og_from_y, all states)")
    return dict(phi_q=phi_q, phi_k=phi_k, v=v_, log_g=log_g, q_w=q_w, k_w=k_w, sinks=sinks_, alpha=alpha_, y=y_kept,
                dy=x["dy"], eps=eps, window=window, scale=scale, segs=segs, gcfg=gcfg, wcfg=wcfg,
                **{n: node.inter[n] for n in ("o_w", "lse", "den", "sc", "zc")}, _keep=(y, leaves))


def _part(a: dict, b0: int, b1: int) -> dict:
    """a's tensors for batch rows b0..b1 ((B, H, ...) by batch, (B*H, ...) by rows)."""
    H = a["v"].shape[1]
    out = dict(a)
    for n in ("phi_q", "phi_k", "v", "log_g", "q_w", "k_w", "y", "dy", "o_w"):
        out[n] = a[n][b0:b1]
    for n in ("lse", "den", "sc", "zc"):
        out[n] = a[n][b0 * H:b1 * H]
    return out


def _plan(a: dict):
    return kgla.bwd_states(a["phi_q"], a["phi_k"], a["v"], a["log_g"], a["y"], a["den"], a["sc"], a["zc"], a["dy"],
                           None, None, False, True, False, a["eps"], a["segs"], a["gcfg"])


def _window(a: dict):
    return kwin._bwd(a["q_w"], a["k_w"], a["v"], a["sinks"], None, a["o_w"], a["lse"], a["alpha"], a["dy"],
                     a["window"], a["scale"], a["wcfg"])


def _gated(a: dict, plan, w):
    dv_w, dyo_w = w[2], w[5]
    return kgla.bwd_chunks(a["phi_q"], a["phi_k"], a["v"], a["log_g"], plan, True, False, a["eps"], a["gcfg"],
                           dv_into=dv_w, side=(dyo_w, a["alpha"].float().contiguous()))


def _split_backward(a: dict, parts: int, streams: list) -> tuple[list, list]:
    """The window kernel then the gated one for each batch part, part i on streams[i]; each kind
    queued for every part before the next kind (so the parts' kernels are in flight together)."""
    B = a["v"].shape[0]
    cuts = [B * i // parts for i in range(parts + 1)]
    sub = [_part(a, cuts[i], cuts[i + 1]) for i in range(parts)]
    main = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(main)
    plans, ws = [], []
    for i, p in enumerate(sub):
        with torch.cuda.stream(streams[i]):
            plans.append(_plan(p))
            ws.append(_window(p))
    outs = []
    for i, p in enumerate(sub):
        with torch.cuda.stream(streams[i]):
            outs.append(_gated(p, plans[i], ws[i]))
    for s in streams:
        main.wait_stream(s)
    return outs, ws


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shape", action="append", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--parts", default="2,4")
    args = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shape or ["16x2048"]]
    rows = []
    for B, T in shapes:
        a = _backward_inputs(B, T)
        main_stream = torch.cuda.current_stream()
        side = [torch.cuda.Stream() for _ in range(8)]
        low = [torch.cuda.Stream(priority=0) for _ in range(8)]
        high = torch.cuda.Stream(priority=-1)
        variants = {"one stream": lambda: _gated(a, _plan(a), _window(a))}
        for n in (int(v) for v in args.parts.split(",")):
            variants[f"{n} parts, {n} streams"] = lambda n=n: _split_backward(a, n, [main_stream] + side[:n - 1])
            variants[f"{n} parts, one stream"] = lambda n=n: _split_backward(a, n, [main_stream] * n)
            # the first part's stream ahead of the others' (its gated kernel, ready first, before their windows)
            variants[f"{n} parts, first high"] = lambda n=n: _split_backward(a, n, [high] + low[:n - 1])
        # the parts' gradients are the whole's (the same kernels on slices)
        w = _window(a)
        whole = _gated(a, _plan(a), w)
        outs, ws = _split_backward(a, 2, [main_stream, side[0]])
        torch.cuda.synchronize()
        for i, name in ((0, "dq"), (1, "dk"), (2, "dv"), (3, "dlog_g")):
            got = torch.cat([o[i] for o in outs])
            print(f"{name} parts vs whole: max abs diff {(got.float() - whole[i].float()).abs().max().item():.3e}")
        got = torch.cat([o[0] for o in ws])
        print(f"window dq parts vs whole: max abs diff {(got.float() - w[0].float()).abs().max().item():.3e}")
        times: dict = {k: [] for k in variants}
        for r in range(args.rounds):
            for name, fn in variants.items():
                times[name].append(do_bench(fn, warmup=25, rep=200, return_mode="median"))
        for name, ts in times.items():
            row = dict(B=B, T=T, variant=name, median_ms=statistics.median(ts), ms=ts)
            rows.append(row)
            print(f"B{B} T{T} {name:22s} {row['median_ms']:.4f} ms  {['%.4f' % t for t in ts]}", flush=True)
        del a
        torch.cuda.empty_cache()
    print(write_rows(args.out, "lizard-bwd-split.json", "scripts/lizard_bwd_split_probe.py", rows))


if __name__ == "__main__":
    main()
