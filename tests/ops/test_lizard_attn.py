"""Lizard's fused op (linearize.ops.lizard_attn: the gated and the window attention as one op,
and its fused Gluon forward) and the hybrid layer on the kernels, against the torch reference.

- CPU, Triton interpreter: the lizard, hybrid and model cases of ``kernel_cases.INTERPRETER_CASES``
  in one subprocess (tests/ops/conftest.py, interpreter_results).
- CPU, host side: the fused forward's launcher up to its launch.
- CUDA, when a GPU is present: the one op in both orders, the fused Gluon forward and backward,
  its dispatch, the side streams, and the hybrid layer with kernels on vs off.
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import CASE_TOL, INTERPRETER_CASES, KTOL, cases_of, hybrid_case, lizard_case, rel_rms
from kernel_checks import assert_interpreter_case, _LaunchRecorder, _needs_hopper_gluon, _spy, assert_errors, needs_cuda, needs_triton


# ----------------------------------------------------------------------------- Lizard's one op: the kernels

# CPU, Triton interpreter: this op's cases of kernel_cases.INTERPRETER_CASES, in one subprocess
# (tests/ops/conftest.py, interpreter_results)
INTERPRETER_OP = "lizard"


@needs_triton
@pytest.mark.parametrize("name", cases_of(INTERPRETER_OP))
def test_interpreter_kernels_match_reference(interpreter_results, name):
    assert_interpreter_case(interpreter_results, name)


@needs_cuda
@pytest.mark.parametrize("variant, dtype", [("plain", torch.bfloat16), ("plain first", torch.bfloat16),
                                            ("plain state first", torch.float32),
                                            ("log segments padded first", torch.bfloat16),
                                            ("log segments padded", torch.bfloat16),
                                            ("plain state segments first one stream", torch.bfloat16),
                                            ("short first", torch.bfloat16)])
def test_gpu_lizard_one_op_matches_reference(variant, dtype):
    """lizard_attention as one op, in both orders ("first": the window kernel first, the gated
    main pass combining, the other gated passes on a second stream; else the gated forward first),
    the backwards on two streams unless "one stream", at Lizard's widths: 128 features, head dim
    128, window 128, 4 sink logits."""
    kw = dict(T=1000, DK=128, DV=128, D=128, W=128, nsink=4, chunk=None, B=2, H=3,
              log_space="log" in variant, state="state" in variant, overlap="one stream" not in variant,
              first="first" in variant)
    if "segments" in variant:
        kw["seg_chunks"] = 3
    if "padded" in variant:
        kw["pad"] = 17
    if variant.startswith("short"):
        kw["T"] = 50
    err = lizard_case("cuda", dtype, **kw)
    assert_errors(err, KTOL[dtype], f"lizard {variant} {dtype}")


@needs_cuda
@pytest.mark.parametrize("variant", ["plain", "segments 4", "segments 8", "state", "no sinks", "window 100",
                                     "T=64", "fp16", "model layout", "model layout segments 4"])
def test_gpu_lizard_fused_forward_matches_reference(variant):
    """The fused Gluon forward (kernels/lizard_gluon.py), as lizard_attention runs it in inference
    on Hopper, against the fp64 reference: y, the gated state and the window state, at Lizard's
    widths (128 features, head dim 128, window 128 with 4 sink logits unless the variant says),
    with sequence segments (each one's entering state from the pre-pass and scan), an initial
    state, no sinks, a window of 100, one chunk, fp16, and q_w, k_w, v in a model's layout
    ((B, T, H, D) projections seen as (B, H, T, D): no copy, read in place)."""
    from kernel_cases import lizard_fused_case

    _needs_hopper_gluon()
    kw = dict(T=1024, W=128, nsink=4)
    dtype = torch.float16 if variant == "fp16" else torch.bfloat16
    if "segments" in variant:
        kw["segments"] = int(variant.split()[-1])
    kw["bthd"] = variant.startswith("model layout")
    kw.update(state=variant == "state", nsink=0 if variant == "no sinks" else 4,
              W=100 if variant == "window 100" else 128, T=64 if variant == "T=64" else kw["T"])
    err = lizard_fused_case(dtype, **kw)
    assert_errors(err, KTOL[dtype], f"lizard fused {variant}")


@needs_cuda
@pytest.mark.parametrize("variant", ["plain", "state", "segments", "fp16", "walk", "walk segments",
                                     "walk one segment", "walk one segment state fp16", "walk one segment og kept",
                                     "walk one segment ow from scores", "walk segments ow from scores",
                                     "walk one segment paired states"])
def test_gpu_lizard_one_op_gluon_fused_backward_matches_reference(variant, gluon_fused_calls, gluon_window_calls,
                                                                  monkeypatch):
    """Lizard's one op in training on Hopper with the gated backward as the one fused Gluon kernel
    (adding its dv into the window's) after the Gluon window backward: y, both states and every
    gradient against the fp64 reference; also from an initial state, with the backward's own
    sequence segments (one (batch x head) pair: four segments), fp16, and with the window's
    backward as the walking kernel too. With the walking kernel and the gated backward in one
    segment the forward keeps no o_g (the gated backward takes dy . o_g from y and the window's
    dy . o_w: KernelSettings.og_from_y), unless told not to ("og kept"); told to, no o_w
    either (the walking kernel forms dy . o_w from its scores: ow_from_scores), also in segments.
    Told to ("paired states"), with the gated backward in one segment, the forward keeps the gated
    state of even chunks only (KernelSettings.paired_states). The backward reads the gates'
    sums within chunks that the fused forward kept (``bl``)."""
    from linearize.ops.gla import gluon as gla_gluon
    from linearize.ops.window_attn import triton as kwin

    sides = _spy(monkeypatch, gla_gluon, "bwd_fused", "side_dot")
    paired = _spy(monkeypatch, gla_gluon, "bwd_fused", "paired")
    bls = _spy(monkeypatch, gla_gluon, "bwd_fused", "bl")
    from linearize.ops.window_attn import gluon as window_gluon

    walk_kw, wbwd = [], window_gluon.bwd
    monkeypatch.setattr(window_gluon, "bwd", lambda *a, **k: (walk_kw.append(k) if k.get("walk") else None,
                                                              wbwd(*a, **k))[1])
    kw = dict(T=1024, DK=128, DV=128, D=128, W=128, nsink=4, chunk=None, B=2, H=3, state="state" in variant,
              gla_cfg=dict(gluon_fused_bwd=True), lizard_cfg={})
    if "walk segments" in variant or variant == "segments":
        kw.update(T=2048, B=1, H=2)
    if "one segment" in variant:  # (B x H = 6 pairs would walk two segments each)
        kw["seg_chunks"] = 16
    if variant.endswith("og kept"):
        kw["lizard_cfg"] = dict(og_from_y=False)
    if variant.endswith("ow from scores"):
        kw["lizard_cfg"] = dict(ow_from_scores=True)
    if variant.endswith("paired states"):
        kw["lizard_cfg"] = dict(paired_states=True)
    dtype = torch.float16 if "fp16" in variant else torch.bfloat16
    kw["lizard_cfg"]["window"] = kwin.WindowLaunch(gluon_bwd_walk=variant.startswith("walk"))
    err = lizard_case("cuda", dtype, **kw)
    assert len(gluon_fused_calls) == 1 and gluon_window_calls == [128], (gluon_fused_calls, gluon_window_calls)
    og_from_y = "one segment" in variant and not variant.endswith("og kept")
    assert [x is not None for x in sides] == [og_from_y], variant
    assert paired == [variant.endswith("paired states")], (variant, paired)
    assert len(bls) == 1 and bls[0] is not None  # the gates' sums the fused forward read, not formed again
    walk_o = [k["o"] is not None for k in walk_kw]
    assert walk_o == ([not variant.endswith("ow from scores")] if variant.startswith("walk") else []), (variant, walk_o)
    if variant == "segments":
        assert gluon_fused_calls[0] < 32, gluon_fused_calls
    assert_errors(err, KTOL[dtype], f"lizard gluon fused backward {variant}")


@needs_cuda
@pytest.mark.parametrize("variant", ["plain", "state", "segments 4", "no sinks", "window 100", "triton forward",
                                     "fp16"])
def test_gpu_lizard_one_op_gluon_training_matches_reference(variant, gluon_chunk_calls, gluon_window_calls,
                                                            monkeypatch):
    """Lizard's one op in training on Hopper, every kernel in Gluon: the fused forward storing what
    the backward reads, the window's backward, and the gated chunk pass adding its dv into the
    window's (T a multiple of 64, Lizard's widths); y, both states and every gradient against the
    fp64 reference. Also from an initial state, with the forward in sequence segments, without
    sinks, a window of 100, fp16, and with the Triton forward passes before the Gluon backward."""
    from linearize.ops.lizard_attn import gluon as lizard_gluon
    from linearize.ops.window_attn import triton as kwin

    calls = _spy(monkeypatch, lizard_gluon, "lizard_fwd_fused", "store")
    W = 100 if variant == "window 100" else 128
    kw = dict(T=1024, DK=128, DV=128, D=128, W=W, nsink=0 if variant == "no sinks" else 4, chunk=None, B=2, H=3,
              state=variant == "state")
    if variant.startswith("segments"):
        kw.update(T=2048, B=1, H=2, lizard_cfg=dict(fused_segments=int(variant.split()[1])))
    if variant == "triton forward":
        kw["lizard_cfg"] = dict(fused_train=False)
    dtype = torch.float16 if variant == "fp16" else torch.bfloat16
    # the gated chunk pass and the window kernel of one program per chunk, not the defaults (the
    # fused gated backward and the walking window backward: test_gpu_lizard_one_op_gluon_fused_backward_*)
    kw["gla_cfg"] = dict(gluon_fused_bwd=False)
    kw["lizard_cfg"] = {**kw.get("lizard_cfg", {}), "window": kwin.WindowLaunch(gluon_bwd_walk=False)}
    err = lizard_case("cuda", dtype, **kw)
    assert calls == ([] if variant == "triton forward" else [True]), calls
    assert gluon_chunk_calls == [True] and gluon_window_calls == [W], (gluon_chunk_calls, gluon_window_calls)
    assert_errors(err, KTOL[dtype], f"lizard gluon training {variant}")


def _lizard_gpu_inputs(B: int, H: int, T: int, D: int):
    """Lizard's inputs on CUDA in bf16 (softmax features, gates near 1), and the generator that made them."""
    g = torch.Generator(device="cuda").manual_seed(0)
    fq, fk = (torch.softmax(torch.randn(B, H, T, D, generator=g, device="cuda"), -1).bfloat16() for _ in range(2))
    v, qw, kw = (torch.randn(B, H, T, D, generator=g, device="cuda").bfloat16() for _ in range(3))
    lg = torch.nn.functional.logsigmoid(torch.randn(B, H, T, generator=g, device="cuda") + 4)
    return fq, fk, v, qw, kw, lg, g


@needs_cuda
def test_gpu_lizard_fused_forward_dispatch(monkeypatch):
    """On Hopper the fused kernel runs the forward in inference (store=False) and, within the one
    autograd op, in training (store=True: the backward's intermediates); each setting turns its
    use off, and the Triton forward agrees."""
    from linearize.ops.lizard_attn import fused as kliz
    from linearize.ops.lizard_attn import gluon as lizard_gluon

    _needs_hopper_gluon()
    B, H, T, D = 1, 2, 512, 128
    fq, fk, v, qw, kw, lg, g = _lizard_gpu_inputs(B, H, T, D)
    alpha = torch.ones(H, device="cuda")
    calls = _spy(monkeypatch, lizard_gluon, "lizard_fwd_fused", "store")
    with torch.no_grad():
        y_fused = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha)[0]
        assert calls == [False]
        y_passes = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha, plan=kliz.LizardPlan(fused_fwd=False))[0]
        assert calls == [False]
    assert rel_rms(y_fused, y_passes) < 1e-2
    v.requires_grad_()
    y_train = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha)[0]
    assert calls == [False, True] and y_train.requires_grad
    y_train2 = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha, plan=kliz.LizardPlan(fused_train=False))[0]
    assert calls == [False, True] and y_train2.requires_grad
    assert rel_rms(y_train.detach(), y_train2.detach()) < 1e-2


@needs_cuda
@pytest.mark.parametrize("fused, B, H, T", [(True, 2, 3, 1024), (True, 4, 17, 256), (False, 2, 3, 1024)])
def test_gpu_lizard_without_state(fused, B, H, T, monkeypatch):
    """lizard_attention(return_state=False), as a training step or attention transfer calls it:
    (y, None, None), y and every gradient bit for bit those of the call that returns the states. On
    the fused kernel (``fused``) the inference forward is asked for no final state, nor is the
    training forward where the gated backward walks one segment (4 x 17 pairs fill half of an H100's
    multiprocessors): its backward then reads no state leaving the last chunk, which the kernel
    skips (the allocator's memory is NaN first, so a read of it would show); with segments (2 x 3)
    the training forward keeps it. On the Triton passes (fused off) the same answers."""
    from linearize.ops.gla import triton as kgla
    from linearize.ops.lizard_attn import fused as kliz
    from linearize.ops.lizard_attn import gluon as lizard_gluon

    if fused:
        _needs_hopper_gluon()
    D = 128
    fq, fk, v, qw, kw, lg, g = _lizard_gpu_inputs(B, H, T, D)
    alpha, sinks = torch.rand(H, generator=g, device="cuda") + 0.5, torch.randn(H, 4, generator=g, device="cuda")
    cfg = dict(plan=kliz.LizardPlan() if fused else kliz.LizardPlan(fused_fwd=False, fused_train=False))
    calls = _spy(monkeypatch, lizard_gluon, "lizard_fwd_fused", "final_state")
    with torch.no_grad():
        y_a, s_a, w_a = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha, sink_logits=sinks, **cfg)
        y_b, s_b, w_b = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha, sink_logits=sinks, **cfg,
                                              return_state=False)
    assert s_a is not None and w_a is not None and (s_b, w_b) == (None, None)
    assert torch.equal(y_a, y_b)
    assert calls == ([True, False] if fused else [])
    one_segment = kgla.fused_bwd_segments(fq, fk, v, False, kgla.LAUNCH) == 1
    leaves = [x.detach().requires_grad_() for x in (fq, fk, v, lg, qw, kw, alpha, sinks)]
    dy = torch.randn(B, H, T, D, generator=g, device="cuda").bfloat16()
    out = []
    for keep in (True, False):
        torch.cuda.synchronize()
        junk = torch.full((1 << 28,), float("nan"), device="cuda")  # 1 GiB of NaN, handed back to the allocator
        del junk
        y, s, w = kliz.lizard_attention(*leaves[:7], sink_logits=leaves[7], **cfg, return_state=keep)
        assert (s is None) == (w is None) == (not keep)
        y.backward(dy)
        out.append([y.detach()] + [x.grad for x in leaves])
        for x in leaves:
            x.grad = None
    for a, b in zip(*out):
        assert torch.equal(a, b)
    assert calls == ([True, False, True, not one_segment] if fused else [])


@needs_cuda
@pytest.mark.parametrize("nseg", [1, 4])
def test_gpu_lizard_fused_training_forward(nseg, monkeypatch):
    """In training the fused forward writes, beside the state entering every chunk, the one leaving
    the last (slot NC of sc and zc: S_T rounded to sc's dtype, z_T), also in segments (the last
    one's program writes it), and the window's decode state (the last window - 1 keys and values
    in fp32), which lizard_attention hands it buffers for; with paired_states, the same states of
    even chunks and the last one only. The allocator's memory is filled with NaN first, so a slot
    left unwritten shows."""
    from linearize.ops.lizard_attn import fused as kliz
    from linearize.ops.lizard_attn import gluon as lizard_gluon

    _needs_hopper_gluon()
    B, H, T, D = 2, 3, 1024, 128
    fq, fk, v, qw, kw, lg, g = _lizard_gpu_inputs(B, H, T, D)
    alpha, sinks = torch.ones(H, device="cuda"), torch.randn(H, 4, generator=g, device="cuda")
    from linearize.ops.backend import KernelSettings

    plan = kliz.LizardPlan(fused_segments=nseg)
    cfg = kliz._run_for(KernelSettings(), plan)
    torch.cuda.synchronize()
    junk = torch.full((1 << 28,), float("nan"), device="cuda")  # 1 GiB of NaN, handed back to the allocator
    del junk
    w_state = tuple(torch.empty(B, H, 127, D, device="cuda") for _ in range(2))
    y, S_T, z_T, inter, (segs, _) = kliz._fused_forward(fq, fk, v, lg, qw, kw, alpha, sinks, None, None, None, True,
                                                       False, 128, D ** -0.5, 1e-6, cfg, store=True,
                                                       window_state=w_state)
    torch.cuda.synchronize()
    NC = T // 64
    assert segs == nseg
    assert not any(inter[n].isnan().any() for n in ("sc", "zc", "den", "lse"))
    assert torch.equal(inter["sc"][:, NC], S_T.view(B * H, D, D).bfloat16())
    assert torch.equal(inter["zc"][:, NC], z_T.view(B * H, D))
    assert torch.equal(w_state[0], kw[:, :, T - 127:].float()) and torch.equal(w_state[1], v[:, :, T - 127:].float())
    # paired: the same states, of even chunks and the last only
    _, _, _, inter2, _ = kliz._fused_forward(fq, fk, v, lg, qw, kw, alpha, sinks, None, None, None, True, False, 128,
                                             D ** -0.5, 1e-6, cfg, store=True, paired_states=True)
    torch.cuda.synchronize()
    assert inter2["sc"].shape[1] == NC // 2 + 1 and not inter2["sc"].isnan().any()
    assert torch.equal(inter2["sc"], inter["sc"][:, 0::2]) and torch.equal(inter2["zc"], inter["zc"])
    # lizard_attention in training: the kernel writes the window's state it returns
    seen = _spy(monkeypatch, lizard_gluon, "lizard_fwd_fused", "window_state")
    v.requires_grad_()
    _, _, w = kliz.lizard_attention(fq, fk, v, lg, qw, kw, alpha, sink_logits=sinks, plan=plan)
    assert len(seen) == 1 and seen[0] is not None and w.k.data_ptr() == seen[0][0].data_ptr()
    assert torch.equal(w.k, kw[:, :, T - 127:].float()) and torch.equal(w.v.detach(), v[:, :, T - 127:].float())
    assert w.v.requires_grad and torch.equal(w.pos.cpu(), torch.full((B,), T))


@needs_cuda
@pytest.mark.parametrize("B, H, T, one_segment", [(2, 33, 256, True), (1, 2, 2048, False)])
def test_gpu_lizard_backward_side_stream_only_for_reverse_passes(B, H, T, one_segment, monkeypatch):
    """The backward forks its side stream (KernelSettings.side_streams) only where the gated
    backward has reverse passes to run beside the window's: not where the fused gated kernel walks
    one segment (66 (batch x head) programs), where the fork and join cost host time alone; yes
    where it walks segments (2 programs: a segment pre-pass and scan). Gradients flow either way."""
    from linearize.ops.lizard_attn import fused as kliz

    _needs_hopper_gluon()
    fq, fk, v, qw, kw, lg, g = _lizard_gpu_inputs(B, H, T, 128)
    leaves = [x.requires_grad_() for x in (fq, fk, v, lg, qw, kw)]
    alpha = torch.ones(H, device="cuda", requires_grad=True)
    wanted, run = [], kliz._side_stream

    def spy(x, w, priority, name="side"):
        if name == "side":  # (the reverse passes' stream; streams of other names are not this test's)
            wanted.append(w)
        return run(x, w, priority, name)

    monkeypatch.setattr(kliz, "_side_stream", spy)
    y = kliz.lizard_attention(*leaves, alpha, sink_logits=torch.zeros(H, 4, device="cuda"))[0]
    forward_calls = len(wanted)
    y.float().sum().backward()
    torch.cuda.synchronize()
    assert wanted[forward_calls:] == [not one_segment], wanted
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves + [alpha])


@needs_cuda
@pytest.mark.parametrize("window_first", [False, True])
def test_gpu_lizard_one_op_streams_raise_no_warning(window_first, monkeypatch):
    """The second and third streams stay out of autograd's way: no warning of a gradient
    accumulator on another stream (which would also sync every backward), training or not; and a
    second backward through one forward says why it cannot run."""
    import warnings

    from linearize.ops.lizard_attn import fused as kliz
    from linearize.ops.lizard_attn.fused import LizardPlan, lizard_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, T, D = 1, 2, 300, 64
    fq, fk = (torch.softmax(torch.randn(B, H, T, D, generator=g, device="cuda"), -1).bfloat16() for _ in range(2))
    v, qw, kw = (torch.randn(B, H, T, D, generator=g, device="cuda").bfloat16() for _ in range(3))
    lg = torch.nn.functional.logsigmoid(torch.randn(B, H, T, generator=g, device="cuda") + 4)
    for x in (fq, fk, v, qw, kw, lg):
        x.requires_grad_()
    alpha = torch.ones(H, device="cuda", requires_grad=True)
    plan = LizardPlan(window_first=window_first)
    calls = []
    apply = kliz._LizardFunction.apply
    monkeypatch.setattr(kliz._LizardFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            y, _, w_state = lizard_attention(fq, fk, v, lg, qw, kw, alpha, window=64, plan=plan)
            y.float().sum().backward()
        with torch.no_grad():
            y2, _, w_state2 = lizard_attention(fq, fk, v, lg, qw, kw, alpha, window=64, plan=plan)
        torch.cuda.synchronize()
    assert len(calls) == 3, "lizard_attention did not run as one op"
    assert torch.equal(y.detach(), y2) and torch.equal(w_state.k.detach(), w_state2.k)
    y, _, _ = lizard_attention(fq, fk, v, lg, qw, kw, alpha, window=64, plan=plan)
    y.float().sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward can run once per forward"):
        y.float().sum().backward()


@needs_cuda
@pytest.mark.parametrize("padded, dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_gpu_hybrid_layer_kernels_match_torch_path(padded, dtype):
    # kernels on vs off in the same dtype: the torch path is the reference
    err = hybrid_case("cuda", dtype, padded=padded, T=300)
    assert_errors(err, KTOL[dtype], f"hybrid padded={padded} {dtype}")


@pytest.mark.parametrize("bthd", [False, True])
def test_fused_forward_launch_host_side(bthd, monkeypatch):
    """lizard_gluon.lizard_fwd_fused up to its launch, on CPU: the grid, b (the gates' cumulative
    sum within each chunk), the layout bits, the descriptors' views, y into a caller's buffer
    (``out``; one of another shape refused), and the window's state into the caller's buffers
    (WSTATE; a buffer of another dtype refused). (A name the launcher lost
    in a cleanup, 1bac744, went unnoticed until a GPU ran it: this runs every line of it in CI.)"""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.lizard_attn import gluon as lizard_gluon

    rec = _LaunchRecorder()
    monkeypatch.setattr(lizard_gluon, "_lizard_fwd_kernel", rec)
    B, H, T, D = 2, 3, 256, 128
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(5)]
    if bthd:  # q_w, k_w, v as a model's (B, T, H, D) projections
        xs[:3] = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in xs[:3]]
    log_g = -torch.rand(B, H, T, generator=g)
    fq, fk, v, qw, kw = xs[3], xs[4], xs[2], xs[0], xs[1]
    y, S_T, z_T, inter = lizard_gluon.lizard_fwd_fused(fq, fk, v, log_g, qw, kw, torch.ones(H), torch.zeros(H, 4),
                                                       window=128, scale=0.1, eps=1e-6, nseg=2, store=bthd)
    (grid, args, kw_), = rec.calls
    assert grid == (2, B * H) and kw_["MODEL_LAYOUT"] == (0b111 if bthd else 0) and kw_["TRAIN"] == bthd
    if bthd:  # training: the backward's intermediates, their shapes as the Triton forward's
        NC = T // 64
        assert {n: tuple(t.shape) for n, t in inter.items()} == dict(
            o_g=(B, H, T, D), o_w=(B, H, T, D), lse=(B * H, T), den=(B * H, T), sc=(B * H, NC + 1, D, D),
            zc=(B * H, NC + 1, D), bl=(B * H * T,))
        assert inter["bl"] is args[9]  # the gates' sums the kernel read, kept for the backward
        # (the state leaving the last chunk, slot NC, is the kernel's to write: test_gpu_lizard_fused_training_forward)
        assert list(args[6].shape) == [B * H * (NC + 1) * D, D] and list(args[6].block_shape) == [D, D]
        assert kw_["PAIRED"] is False
        # paired: the states of even chunks and the last one
        inter = lizard_gluon.lizard_fwd_fused(fq, fk, v, log_g, qw, kw, torch.ones(H), torch.zeros(H, 4), window=128,
                                              scale=0.1, eps=1e-6, nseg=2, store=True, paired_states=True)[3]
        assert inter["sc"].shape == (B * H, NC // 2 + 1, D, D) and inter["zc"].shape == (B * H, NC + 1, D)
        assert rec.calls[-1][2]["PAIRED"] is True and list(rec.calls[-1][1][6].shape) == [B * H * 3 * D, D]
        rec.calls.pop()
    else:
        assert inter is None
    b = args[9].view(B, H, T // 64, 64)
    torch.testing.assert_close(b, log_g.view(B, H, T // 64, 64).cumsum(-1))
    assert y.shape == v.shape and y.is_contiguous() and S_T.shape == (B, H, D, D) and z_T.shape == (B, H, D)
    for desc, x in zip(args[:5], xs):
        assert desc.base.data_ptr() == x.data_ptr() and list(desc.block_shape) == [64, 128]
    # y into a caller's buffer (a contiguous view at an offset of a larger one), or refused by name
    buf = torch.empty(y.numel() + 64, dtype=torch.bfloat16)
    out = buf[64:].view(y.shape)
    call = dict(window=128, scale=0.1, eps=1e-6)
    y2 = lizard_gluon.lizard_fwd_fused(fq, fk, v, log_g, qw, kw, torch.ones(H), None, **call, out=out)[0]
    assert y2 is out and rec.calls[-1][1][5].base.data_ptr() == out.data_ptr()
    with pytest.raises(ValueError, match=r"out must be contiguous \(2, 3, 256, 128\) torch.bfloat16"):
        lizard_gluon.lizard_fwd_fused(fq, fk, v, log_g, qw, kw, torch.ones(H), None, **call, out=out.transpose(2, 3))
    # the window's decode state into the caller's fp32 buffers (the last window - 1 keys, values)
    ws = (torch.empty(B, H, 127, D), torch.empty(B, H, 127, D))
    lizard_gluon.lizard_fwd_fused(fq, fk, v, log_g, qw, kw, torch.ones(H), None, **call, window_state=ws)
    grid_, args_, kw_ = rec.calls[-1]
    assert kw_["WSTATE"] is True and args_[20] is ws[0] and args_[21] is ws[1]
    assert rec.calls[-2][2]["WSTATE"] is False
    with pytest.raises(ValueError, match=r"window_state's v must be contiguous \(2, 3, 127, 128\) float32"):
        lizard_gluon.lizard_fwd_fused(fq, fk, v, log_g, qw, kw, torch.ones(H), None, **call,
                                      window_state=(ws[0], ws[1].bfloat16()))
