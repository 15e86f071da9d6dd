"""Issue 6: the fused Gluon Lizard forward (kernels/lizard_gluon.py) against the torch reference
and the Triton one-op forward, then timed side by side with it (inference, no gradient).

    python3 scripts/lizard_gluon_probe.py --out lizard-gluon.json   # on an H100/H200
    python3 scripts/lizard_gluon_probe.py --compile-only            # anywhere: sm_90a resources

Rounds alternate the two forwards; the figures are medians of triton.testing.do_bench.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

SHAPES = [(16, 2048, (1,)), (4, 8192, (1, 2)), (1, 32768, (4, 8))]  # (B, T, segment counts to try)


def compile_only(has_init=False, nsink=4, nprof=0) -> dict:
    """Compile the kernel for sm_90a without a GPU: shared memory, registers and spills (ptxas -v)."""
    import triton

    from linearize.ops.lizard_attn import gluon as L

    k = L.compile_for_hopper(has_init=has_init, nsink=nsink, nprof=nprof)
    out = {"shared_bytes": k.metadata.shared}
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if os.path.exists(ptxas):
        path = "/tmp/lizard_gluon.ptx"
        with open(path, "w") as f:
            f.write(k.asm["ptx"])
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", "/dev/null"], capture_output=True, text=True)
        out["ptxas"] = [ln.strip() for ln in r.stderr.splitlines() if "spill" in ln or "Used" in ln]
    return out


def inputs(B, T, H=32, D=128, sinks=4, seed=0):
    from linearize.bench.kernels import _shape_inputs
    x = _shape_inputs(B, T, H, D, D, sinks, torch.bfloat16, torch.device("cuda"), seed)
    return dict(phi_q=x["lq"], phi_k=x["lk"], v=x["v"], log_g=x["log_g"], q_w=x["q"], k_w=x["k"],
                alpha=x["alpha"], sinks=x["sinks"] if sinks else None)


def triton_fwd(x, window=128):
    from linearize.ops.lizard_attn.fused import lizard_attention
    return lizard_attention(x["phi_q"], x["phi_k"], x["v"], x["log_g"], x["q_w"], x["k_w"], x["alpha"],
                            window=window, sink_logits=x["sinks"])


def fused_fwd(x, nseg=1, window=128, prof=None, store=False, store_og=False):
    from linearize.ops.gla import gluon as G
    from linearize.ops.lizard_attn import gluon as L
    nseg, seg_len = G.segment_plan(x["v"].shape[2], nseg)
    s_in = z_in = None
    if nseg > 1:
        s_in, z_in = G.segment_states(x["phi_k"], x["v"], x["log_g"], seg_len, nseg)
    return L.lizard_fwd_fused(x["phi_q"], x["phi_k"], x["v"], x["log_g"], x["q_w"], x["k_w"], x["alpha"],
                              x["sinks"], window=window, scale=x["q_w"].shape[-1] ** -0.5, eps=1e-6, nseg=nseg,
                              S_in=s_in, z_in=z_in, prof=prof, store=store, store_og=store_og)


def reference(x, window=128):
    """The torch path in fp32 (LINEARIZE_KERNELS=0)."""
    from linearize.ops.lizard_attn.fused import lizard_attention
    old = os.environ.get("LINEARIZE_KERNELS")
    os.environ["LINEARIZE_KERNELS"] = "0"
    try:
        f = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in x.items()}
        y, g, _ = lizard_attention(f["phi_q"], f["phi_k"], f["v"], f["log_g"], f["q_w"], f["k_w"], f["alpha"],
                                   window=window, sink_logits=f["sinks"])
    finally:
        if old is None:
            del os.environ["LINEARIZE_KERNELS"]
        else:
            os.environ["LINEARIZE_KERNELS"] = old
    return y, g


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(rows):
    for (B, H, T, nseg, sinks, window) in [(2, 4, 256, 1, 4, 128), (1, 3, 640, 1, 0, 128), (2, 2, 1024, 4, 4, 128),
                                          (1, 2, 4096, 8, 2, 128), (2, 4, 384, 1, 4, 100)]:
        x = inputs(B, T, H, sinks=sinks, seed=B * T + nseg)
        with torch.no_grad():
            y_ref, st_ref = reference(x, window)
            y_tri = triton_fwd(x, window)[0]
            y, S, z, _ = fused_fwd(x, nseg, window)
        torch.cuda.synchronize()
        row = {"check": True, "B": B, "H": H, "T": T, "nseg": nseg, "sinks": sinks, "window": window,
               "rel_fused": rel(y, y_ref), "rel_triton": rel(y_tri, y_ref), "rel_S": rel(S, st_ref.S),
               "rel_z": rel(z, st_ref.z), "finite": bool(torch.isfinite(y).all())}
        rows.append(row)
        print(json.dumps(row), flush=True)


def bench(rows, rounds=5):
    import triton
    for B, T, segs in SHAPES:
        x = inputs(B, T)
        fns = {"triton lizard fwd": lambda: triton_fwd(x)}
        for n in segs:
            fns[f"gluon fused fwd nseg={n}"] = (lambda n=n: fused_fwd(x, n))
        with torch.no_grad():
            y_tri = triton_fwd(x)[0]
            for name, fn in fns.items():
                fn()
            for r in range(rounds):
                for name, fn in fns.items():
                    ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
                    row = {"B": B, "T": T, "H": 32, "method": name, "round": r, "ms": ms}
                    if r == 0 and name != "triton lizard fwd":
                        row["rel_vs_triton"] = rel(fn()[0], y_tri)
                    rows.append(row)
                    print(json.dumps(row), flush=True)


def _timed_rounds(rows, fns, key, B, T, rounds):
    """Median ms of each function, the functions alternating, ``rounds`` times; one row each."""
    import triton
    with torch.no_grad():
        for r in range(rounds):
            for name, fn in fns.items():
                ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
                rows.append({key: name, "B": B, "T": T, "H": 32, "round": r, "ms": ms})
                print(json.dumps(rows[-1]), flush=True)


def sweep_segments(rows, rounds=3):
    """The fused forward's time against its segment count where batch x heads leave SMs idle."""
    for B, T, segs in [(1, 32768, (4, 8, 16, 32)), (2, 16384, (1, 2, 4, 8, 16))]:
        x = inputs(B, T)
        _timed_rounds(rows, {n: (lambda n=n: fused_fwd(x, n)) for n in segs}, "segments", B, T, rounds)


def window_state_copy(rows, rounds=3):
    """lizard_attention in inference (fused forward + the window's state for decoding): the state's
    copy on a stream of its own (overlap_fwd) or after the kernel on the same stream."""
    from linearize.ops.lizard_attn.fused import LizardKernelConfig, lizard_attention
    from linearize.ops.window_attn.triton import _new_state
    for B, T in [(16, 2048), (1, 32768)]:
        x = inputs(B, T)
        args = (x["phi_q"], x["phi_k"], x["v"], x["log_g"], x["q_w"], x["k_w"], x["alpha"])
        fns = {f"overlap_fwd={o}": (lambda o=o: lizard_attention(*args, sink_logits=x["sinks"],
                                                                 config=LizardKernelConfig(overlap_fwd=o)))
               for o in (True, False)}
        fns["fused kernel alone"] = lambda: fused_fwd(x, 1 if B * 32 >= 66 else 8)
        fns["state copy alone"] = lambda: _new_state(None, x["k_w"], x["v"], 127, torch.float32)
        _timed_rounds(rows, fns, "copy", B, T, rounds)


def model_layout(rows, rounds=3):
    """lizard_attention in inference with q_w, k_w, v contiguous or as a model gives them ((B, T, H, D)
    projections seen as (B, H, T, D)), read in place by the fused forward either way."""
    from linearize.ops.lizard_attn.fused import lizard_attention
    for B, T in [(16, 2048), (1, 32768)]:
        x = inputs(B, T)
        bthd = {n: x[n].transpose(1, 2).contiguous().transpose(1, 2) for n in ("q_w", "k_w", "v")}
        fns = {}
        for name, src in (("contiguous", x), ("model layout", {**x, **bthd})):
            fns[name] = (lambda a=src: lizard_attention(a["phi_q"], a["phi_k"], a["v"], a["log_g"], a["q_w"],
                                                        a["k_w"], a["alpha"], sink_logits=a["sinks"]))
        with torch.no_grad():
            ys = [fn()[0].float() for fn in fns.values()]
            rows.append({"layout_check": True, "B": B, "T": T, "rel": rel(ys[1], ys[0])})
            print(json.dumps(rows[-1]), flush=True)
        _timed_rounds(rows, fns, "layout", B, T, rounds)


PHASES = {"output": ["wait q_w, k/v", "window scores", "softmax, P V issued", "wait phi_q, copies",
                     "P V wait, phi_q S", "A V", "next loads", "combine, y out"],
          "state": ["wait phi_q, phi_k", "A, den, K~, S and z update", "to the next chunk",
                    "wait copies read, phi_k load",
                    "", "", "", ""]}


def profile(rows, B=16, T=2048, store=False):
    """Cycles per chunk in each phase of both partitions' loops (clock64 between marks; program
    means), and the kernel's time without counters; ``store``: the training kernel (TRAIN, storing
    what the backward reads, without o_g as the default ``LizardKernelConfig.og_from_y`` has it)."""
    from triton.testing import do_bench

    x = inputs(B, T)
    prof = torch.zeros(B * 32, 16, dtype=torch.int64, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            fused_fwd(x, 1, prof=prof, store=store)
        torch.cuda.synchronize()
        ms = statistics.median(do_bench(lambda: fused_fwd(x, 1, store=store), warmup=10, rep=100, return_mode="all"))
    per = (prof.double().mean(0) / (T // 64)).tolist()
    row = {"profile": True, "train": store, "B": B, "T": T, "median_ms": ms,
           "note": "cycles per chunk, accumulated over 3 calls",
           "output": dict(zip(PHASES["output"], per[:8])), "state": dict(zip(PHASES["state"][:4], per[8:12]))}
    rows.append(row)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--train", action="store_true", help="with --profile: the training kernel's profile too")
    p.add_argument("--segments", action="store_true")
    p.add_argument("--copy", action="store_true")
    p.add_argument("--layout", action="store_true")
    a = p.parse_args()
    if a.compile_only:
        print(json.dumps(compile_only()))
        sys.exit(0)
    rows = []
    t0 = time.time()
    try:
        if not a.no_check:
            check(rows)
        if a.profile:
            profile(rows)
            if a.train:
                profile(rows, store=True)
        if a.segments:
            sweep_segments(rows)
        if a.copy:
            window_state_copy(rows)
        if a.layout:
            model_layout(rows)
        if not a.no_bench:
            bench(rows)
    finally:
        if a.out:
            import triton
            import hashlib
            # (the device copy's git HEAD can be stale: the kernel source's hash says what ran)
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
            src = os.path.join(os.path.dirname(__file__), "..", "src", "linearize", "ops", "lizard_attn", "gluon.py")
            kernel_sha = hashlib.sha256(open(src, "rb").read()).hexdigest()[:16]
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "commit": commit, "lizard_gluon_sha256": kernel_sha, "command": " ".join(sys.argv),
                       "wall_s": time.time() - t0, "rows": rows},
                      open(a.out, "w"), indent=1)
