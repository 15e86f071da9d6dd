"""The Triton kernels compile for Hopper (sm_90a) on a machine without a GPU.

The interpreter (the kernel tests of tests/ops/test_gla.py, test_window_attn.py and
test_lizard_attn.py) checks what the kernels compute, but it never compiles them: a kernel can be
right under the interpreter and still fail Triton's type checks or ptxas on a GPU (a dummy pointer
of the wrong dtype in a branch that the launch never takes did exactly that once). Here every
launch the host code makes, forward and backward, is captured instead of run, and compiled for
sm_90a with Triton's own ptxas, so CI sees such a failure.
No kernel runs: the tensors stay on the CPU and their contents are never read.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

triton = pytest.importorskip("triton")

from linearize.bench.kernels import WINDOW_CANDIDATES  # noqa: E402

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
HOPPER_SMEM = 232448  # bytes of shared memory one block may use on an H100 / H200 (227 KiB)
PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
       torch.int32: "*i32"}


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return PTR[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if abs(value) >= 2 ** 31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {value!r}")


def _aligned(value) -> bool:
    """What a launch on a GPU specialises as divisible by 16 (a pointer or an int): the compiler then
    vectorises and pipelines those loads (cp.async into shared memory), which can need more shared
    memory than the same kernel compiled without the hint."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


class _Compiled(list):
    def __init__(self):
        super().__init__()
        self.ptx: list[str] = []


@pytest.fixture()
def compiled(monkeypatch):
    """Replaces kernel launches by compilation for sm_90a; yields the list of (kernel, constexprs,
    shared memory in bytes), whose ``ptx`` holds each compiled kernel's PTX in the same order."""
    done = _Compiled()
    seen: set = set()

    def compile_instead(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        params = list(self.params)
        bound = {p.name: a for p, a in zip(params, args)}
        bound.update(kwargs)
        sig, consts, attrs = {}, {}, {}
        for i, p in enumerate(params):
            value = bound[p.name] if p.name in bound else p.default
            if p.is_constexpr:
                sig[p.name] = "constexpr"
                consts[(i,)] = value
            else:
                sig[p.name] = _arg_type(value)
                if _aligned(value) and not p.do_not_specialize:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        key = (self.fn.__name__, tuple(sorted(sig.items())), tuple(sorted(consts.items())),
               tuple(sorted(options.items())))
        if key not in seen:
            seen.add(key)
            kernel = triton.compile(ASTSource(self, sig, constexprs=consts, attrs=attrs), target=HOPPER,
                                    options=options)
            done.append((self.fn.__name__, {params[i[0]].name: v for i, v in consts.items()}, kernel.metadata.shared))
            done.ptx.append(kernel.asm["ptx"])

    monkeypatch.setattr(JITFunction, "run", compile_instead)
    yield done


def _backward(out: torch.Tensor, *leaves: torch.Tensor) -> None:
    torch.autograd.grad(out.float().sum(), [x for x in leaves if x.requires_grad], allow_unused=True)


@pytest.mark.parametrize("log_space,normalize", [(False, False), (True, True)])
@pytest.mark.parametrize("segments", [False, True])
def test_gla_kernels_compile_for_hopper(compiled, log_space, normalize, segments):
    from linearize.ops.gla import triton as kgla
    from linearize.ops.gla import GLAState

    B, H, T, D = 1, 2, 256, 128
    q, k, v = (torch.zeros(B, H, T, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    log_g = torch.zeros(B, H, T, requires_grad=True)
    state = GLAState(torch.zeros(B, H, D, D, requires_grad=True), torch.zeros(B, H, D, requires_grad=True))
    cfg = dataclasses.replace(kgla.LAUNCH, seg_chunks=1) if segments else kgla.LAUNCH
    o, s = kgla.gla_chunk_triton(q, k, v, log_g, normalize=normalize, log_space_features=log_space,
                                 state=state if segments else None, launch=cfg)
    _backward(o + s.S.sum() + s.z.sum(), q, k, v, log_g, *state)
    with torch.no_grad():  # the inference forward: no chunk states stored
        kgla.gla_chunk_triton(q, k, v, log_g, normalize=normalize, log_space_features=log_space,
                              state=state if segments else None, launch=cfg)
    names = {name for name, *_ in compiled}
    assert all(smem <= HOPPER_SMEM for _, _, smem in compiled), [(n, smem) for n, _, smem in compiled]
    expected = {"_gla_fwd_kernel", "_gla_bwd_dstate_kernel", "_gla_bwd_chunk_kernel"}
    expected |= {"_gla_den_kernel"} if normalize else set()
    expected |= {"_gla_fwd_state_kernel", "_gla_scan_kernel", "_gla_bwd_state_kernel"} if segments else set()
    assert expected <= names, f"launched and compiled: {sorted(names)}"


@pytest.mark.parametrize("L, DK, DV, gated", [(64, 128, 128, True), (128, 64, 64, True), (128, 128, 128, False),
                                           (64, 100, 72, True)])
def test_delta_scan_kernels_compile_for_hopper(compiled, L, DK, DV, gated):
    """The delta rule's scan, forward and backward (with and without the decay; chunks of 64
    tokens, or 128 virtual ones of DeltaProduct order 2; widths that are not powers of two)."""
    from linearize.ops.delta.triton import delta_scan_triton

    B, H, NC = 1, 2, 4
    W, U0, Kd = (torch.zeros(B, H, NC, L, D, requires_grad=True) for D in (DK, DV, DK))
    total = torch.zeros(B, H, NC, requires_grad=True) if gated else None
    S0 = torch.zeros(B, H, DK, DV, requires_grad=True)
    U, states, S = delta_scan_triton(W, U0, Kd, total, S0)
    _backward(U.sum() + states.sum() + S, W, U0, Kd, S0, *([total] if gated else []))
    assert {name for name, *_ in compiled} == {"_delta_scan_fwd_kernel", "_delta_scan_bwd_kernel"}


@pytest.mark.parametrize("DK, DV, gated, dtype", [(64, 64, True, torch.bfloat16), (128, 128, False, torch.float32),
                                                  (128, 128, True, torch.bfloat16), (100, 72, True, torch.bfloat16),
                                                  (100, 72, True, torch.float32)])
def test_delta_chunk_kernels_compile_for_hopper(compiled, DK, DV, gated, dtype, tmp_path):
    """The delta rule's whole chunk form (prep, scan, read and their backwards; chunks of 64;
    liza's widths, the widest, widths that are not powers of two): compiled for sm_90a within the
    shared memory, and at liza's widths (bf16 inputs: tf32 products) ptxas assembles the chunk
    kernels with at most 256 bytes of spills a thread (the prep's backward holds the most tiles)."""
    from linearize.ops.delta.triton import delta_chunk_triton

    B, H, T = 1, 2, 200
    q, k = (torch.zeros(B, H, T, DK, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.zeros(B, H, T, DV, dtype=dtype, requires_grad=True)
    beta = torch.zeros(B, H, T, dtype=dtype, requires_grad=True)
    la = torch.zeros(B, H, T, dtype=dtype, requires_grad=True) if gated else None
    S0 = torch.zeros(B, H, DK, DV, requires_grad=True)
    o, S, _ = delta_chunk_triton(q, k, v, beta, la, S0, 64)
    _backward(o.float().sum() + S.sum(), q, k, v, beta, S0, *([la] if gated else []))
    names = [name for name, *_ in compiled]
    assert set(names) == {"_chunk_prep_kernel", "_chunk_read_kernel", "_chunk_read_bwd_kernel",
                          "_chunk_prep_bwd_kernel", "_delta_scan_fwd_kernel", "_delta_scan_bwd_kernel"}, names
    assert all(smem <= HOPPER_SMEM for _, _, smem in compiled), [(n, smem) for n, _, smem in compiled]
    if DK == DV == 64:
        for name, ptx in zip(names, compiled.ptx):
            if name.startswith("_chunk"):
                assert _spill_bytes(_ptxas(ptx, tmp_path)) <= 256, name


@pytest.mark.parametrize("L", [64, 126])
def test_delta_inverse_kernel_compiles_for_hopper(compiled, L):
    """The chunks' (I + N)^-1 (delta rule: chunks of 64; DeltaProduct of order 3: 126 virtual tokens)."""
    from linearize.ops.delta.triton import unit_lower_inverse_triton

    unit_lower_inverse_triton(torch.zeros(2, 3, L, L))
    assert [name for name, *_ in compiled] == ["_unit_lower_inverse_kernel"]
    assert all(smem <= HOPPER_SMEM for _, _, smem in compiled), [(n, smem) for n, _, smem in compiled]
    assert all(smem <= HOPPER_SMEM for _, _, smem in compiled), [(n, smem) for n, _, smem in compiled]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("candidate", [None] + [i for i, c in enumerate(WINDOW_CANDIDATES) if "kv_bn" in c])
def test_window_kernels_compile_for_hopper(compiled, fused, candidate, monkeypatch):
    """The default config and every tune candidate with its own dk/dv blocks compile for sm_90a
    within the shared memory a block may have there."""
    from linearize.ops.window_attn import triton as kwin

    launch = kwin.LAUNCH if candidate is None else dataclasses.replace(kwin.LAUNCH, **WINDOW_CANDIDATES[candidate])

    B, H, T, D = 1, 2, 256, 128
    q, k, v = (torch.zeros(B, H, T, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    sinks = torch.zeros(H, 4, requires_grad=True)
    extra = {}
    if fused:
        extra = dict(y_global=torch.zeros(B, H, T, D, dtype=torch.bfloat16, requires_grad=True),
                     alpha=torch.ones(H, requires_grad=True))
    y, _ = kwin.window_attn_triton(q, k, v, window=128, sink_logits=sinks, launch=launch, **extra)
    _backward(y, q, k, v, sinks, *extra.values())
    assert {name for name, _, _ in compiled} == {"_win_fwd_kernel", "_win_bwd_dq_kernel", "_win_bwd_dkdv_kernel",
                                                 "_win_head_sums_kernel"}
    assert all(smem <= HOPPER_SMEM for _, _, smem in compiled), [(n, smem) for n, _, smem in compiled]


@pytest.mark.parametrize("window_first", [False, True])
def test_lizard_one_op_compiles_for_hopper(compiled, window_first):
    """Lizard's one op in either order (window first: the gated main pass with the combine in its
    epilogue), training and inference forwards, and its backward."""
    from linearize.ops.lizard_attn import fused as kliz

    B, H, T, D = 1, 2, 256, 128
    fq, fk, v, qw, kw = (torch.zeros(B, H, T, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(5))
    log_g = torch.zeros(B, H, T, requires_grad=True)
    alpha, sinks = torch.ones(H, requires_grad=True), torch.zeros(H, 4, requires_grad=True)
    from linearize.ops.backend import KernelSettings

    cfg = kliz._run_for(KernelSettings(), kliz.LizardPlan(window_first=window_first))
    kw_ = dict(window=128, sink_logits=sinks, scale=None, normalize=True, log_space_features=False, state=None,
               eps=1e-6, window_state=None, config=cfg)
    y, _, _ = kliz._lizard_one_op(fq, fk, v, log_g, qw, kw, alpha, **kw_)
    _backward(y, fq, fk, v, log_g, qw, kw, alpha, sinks)
    with torch.no_grad():
        kliz._lizard_one_op(fq, fk, v, log_g, qw, kw, alpha, **kw_)
    names = {name for name, *_ in compiled}
    combined = [c for name, c, _ in compiled if name == "_gla_fwd_kernel" and c["COMBINE"]]
    assert bool(combined) == window_first, [c for name, c, _ in compiled if name == "_gla_fwd_kernel"]
    assert {"_gla_fwd_kernel", "_gla_den_kernel", "_win_fwd_kernel", "_gla_bwd_chunk_kernel",
            "_win_bwd_dkdv_kernel"} <= names, names
    assert all(smem <= HOPPER_SMEM for _, _, smem in compiled), [(n, smem) for n, _, smem in compiled]


def test_compile_check_catches_a_type_error(compiled):
    """The check has teeth: a kernel whose branches disagree on a type fails to compile."""
    import triton.language as tl

    @triton.jit
    def bad(X, FLAG: tl.constexpr):
        i = tl.program_id(0)
        if i > 0:
            y = tl.load(X)
        else:
            y = tl.zeros([1], dtype=tl.float32).sum(0)
        tl.store(X, y)

    with pytest.raises(Exception, match="Mismatched type"):
        bad[(1,)](torch.zeros(1, dtype=torch.bfloat16), FLAG=True)
    assert inspect.isfunction(bad.fn)


@pytest.mark.parametrize("arch,method,kw", [("llama3", "lizard", {}), ("qwen3", "lizard", {"gate": "gla", "sinks": 0})])
def test_decode_step_kernels_compile_for_hopper(compiled, arch, method, kw):
    """The fused decode step (prep and state kernels) and the one-kernel RMSNorm, in bf16 as
    generation runs them on a GPU: the decoder's own launches, captured and compiled."""
    import fixtures
    import linearize
    from linearize.ops.lizard_attn.decode import launch_rmsnorm
    from linearize.models.decode import StudentDecoder

    model = linearize.convert(fixtures.ARCHS[arch](num_layers=1), method, window=4, chunk_size=8, **kw)
    model = model.to(torch.bfloat16)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dec = StudentDecoder(model, 2, 2, kernel="torch")
        dec.kinds = ["fused"] * len(dec.kinds)  # what kernel="auto" picks on a GPU
        dec.start(dec.prefill(ids).argmax(-1), dec.pos)
        dec.step()
        norm = model.model.layers[0].input_layernorm
        launch_rmsnorm(torch.zeros(2, 1, norm.weight.shape[0], dtype=torch.bfloat16), norm.weight, 1e-6)
    names = {name for name, *_ in compiled}
    assert {"_lizard_prep_kernel", "_lizard_state_kernel", "_rmsnorm_kernel"} <= names, names


def _ptxas(ptx: str, tmp_path):
    """Triton's ptxas on ``ptx`` for sm_90a with -v (skips where it is not installed); asserts it assembles."""
    import os
    import subprocess

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton's ptxas is not installed")
    path = tmp_path / "k.ptx"
    path.write_text(ptx)
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(path), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def _assemble_warp_specialised(k, tmp_path, shared_min: int, max_spill: int) -> None:
    """A compiled two-partition Gluon kernel: shared memory within [shared_min, one block's], its
    partitions' register limits, warpgroup MMAs and TMA in the PTX, and ptxas assembles it
    spilling at most ``max_spill`` bytes a thread."""
    assert shared_min <= k.metadata.shared <= HOPPER_SMEM, k.metadata.shared
    ptx = k.asm["ptx"]
    assert "setmaxnreg" in ptx and "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    r = _ptxas(ptx, tmp_path)
    assert _spill_bytes(r) <= max_spill, r.stderr[-2000:]


def _spill_bytes(r) -> int:
    """The most bytes of spill stores ptxas -v reports for any function (fails if it reports none)."""
    import re

    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert spills, r.stderr[-2000:]
    return max(spills)


@pytest.mark.parametrize("has_init, nsink, model_layout, train, store_og, store_ow, window_state, paired", [
    (False, 4, 0, False, True, True, True, False), (True, 0, 7, False, True, True, False, False),
    (False, 4, 7, True, True, True, False, False), (False, 4, 0, True, False, False, False, False),
    (False, 4, 0, True, False, True, False, True)])
def test_gluon_lizard_forward_compiles_for_hopper(has_init, nsink, model_layout, train, store_og, store_ow,
                                                  window_state, paired, tmp_path):
    """kernels/lizard_gluon.py, the fused Lizard forward the dispatch runs on Hopper in inference
    (writing the window's decode state, or not) and (train) in training, with or without o_g and
    o_w among what it stores, compiles for sm_90a within
    one block's shared memory, and Triton's ptxas assembles it (its two warp-specialised
    partitions, their register limits included) without spilling in inference, and at most 4
    words a thread in training: its MMAs read single tiles through ``gla_gluon.tile_at_step``, else their
    hoisted descriptors spilled (up to 47 words a thread in inference, 71 in training, reloaded
    every chunk), also keeping the gated states of even chunks only (``paired``). What it computes is
    checked on a GPU (tests/ops/test_lizard_attn.py, test_gpu_lizard_fused_forward_*, test_gpu_lizard_one_op_gluon_*,
    test_gpu_lizard_fused_training_forward)."""
    from linearize.ops.lizard_attn import gluon as lizard_gluon

    k = lizard_gluon.compile_for_hopper(has_init=has_init, nsink=nsink, model_layout=model_layout, train=train,
                                        store_og=store_og, store_ow=store_ow, window_state=window_state,
                                        paired=paired)
    assert 200_000 <= k.metadata.shared <= HOPPER_SMEM, k.metadata.shared
    ptx = k.asm["ptx"]
    assert "setmaxnreg" in ptx and "wgmma.mma_async" in ptx
    r = _ptxas(ptx, tmp_path)
    assert _spill_bytes(r) <= (16 if train else 0), r.stderr[-2000:]


def test_gluon_lizard_training_forward_without_final_state(tmp_path):
    """The fused training forward of a caller that keeps no state (``final=False``: a training step,
    ``lizard_attention(return_state=False)``) compiles as the one that does, in no more shared
    memory, less the final state's global stores (S_T in two halves and z_T), and spills no more."""
    from linearize.ops.lizard_attn import gluon as lizard_gluon

    kw = dict(train=True, store_og=False, store_ow=True)
    with_final, without = (lizard_gluon.compile_for_hopper(final=f, **kw) for f in (True, False))
    stores = [k.asm["ptx"].count("st.global") for k in (with_final, without)]
    assert stores[1] < stores[0], stores
    assert without.metadata.shared <= with_final.metadata.shared
    assert _spill_bytes(_ptxas(without.asm["ptx"], tmp_path)) <= 16


@pytest.mark.parametrize("normalize, has_init, model_layout", [(False, False, 0), (True, True, 7)])
def test_gluon_gla_fused_forward_compiles_for_hopper(normalize, has_init, model_layout, tmp_path):
    """kernels/gla_gluon.py, GLA's forward as one kernel (KernelSettings.gluon): compiled for
    sm_90a within one block's shared memory, its two warp-specialised partitions (the state one
    shared with Lizard's fused forward) assembled by ptxas without spilling (``gla_gluon.tile_at_step``;
    10 words a thread before).
    What it computes is checked on a GPU (test_gpu_gla_fused_forward_matches_reference)."""
    from linearize.ops.gla import gluon as gla_gluon

    k = gla_gluon.compile_fwd_fused_for_hopper(normalize=normalize, has_init=has_init, model_layout=model_layout)
    assert k.metadata.shared <= HOPPER_SMEM, k.metadata.shared
    ptx = k.asm["ptx"]
    assert "setmaxnreg" in ptx and "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    r = _ptxas(ptx, tmp_path)
    assert _spill_bytes(r) == 0, r.stderr[-2000:]


@pytest.mark.parametrize("normalize, dv_add, model_layout", [(False, False, 0), (True, True, 7)])
def test_gluon_gla_chunk_pass_compiles_two_per_sm_without_spills(normalize, dv_add, model_layout, tmp_path):
    """kernels/gla_gluon.py, the backward's chunk pass the dispatch runs on Hopper: compiled for
    sm_90a, its shared memory leaves room for two programs per multiprocessor (228 KB each, 1 KB
    reserved per block), and ptxas assembles it without spilling registers (the Triton pass it
    replaces spills). What it computes is checked on a GPU (test_gpu_gla_gluon_chunk_pass_*)."""
    from linearize.ops.gla import gluon as gla_gluon

    k = gla_gluon.compile_for_hopper(normalize=normalize, dv_add=dv_add, model_layout=model_layout)
    assert 2 * (k.metadata.shared + 1024) <= 228 * 1024, k.metadata.shared
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    r = _ptxas(ptx, tmp_path)
    assert _spill_bytes(r) == 0, r.stderr[-2000:]


@pytest.mark.parametrize("normalize, dv_add, has_ds, store_ds0, model_layout, side, paired, max_spill",
                         [(False, False, False, False, 0, False, False, 0), (True, True, True, True, 7, False, False, 80),
                          (True, True, False, False, 0, True, False, 68), (True, True, False, False, 0, True, True, 128),
                          (False, False, False, False, 0, False, True, 8)])
def test_gluon_gla_fused_backward_compiles_for_hopper(normalize, dv_add, has_ds, store_ds0, model_layout, side, paired,
                                                      max_spill, tmp_path):
    """kernels/gla_gluon.py, the whole gated backward as one kernel (GLALaunch.gluon_fused_bwd):
    compiled for sm_90a within one block's shared memory (two slots of the four chunk tiles, S,
    dS's copy, M and o), its two warp-specialised partitions assembled by ptxas, spilling at most
    ``max_spill`` bytes a thread as a launch compiles it (pointers known 16-byte aligned): 0
    unnormalised, 80 with segments, dS0 and a model's layout, 68 in Lizard's case, 128 with
    Lizard's paired states. Both partitions spill a few values around their products; since dq
    and dk leave by TMA through k's and v's slots the chunk partition spills more (Lizard's case:
    44 -> 68 bytes) and the kernel is 10% faster.
    ``side``: o read as y with the other branch's part of do . o subtracted (Lizard, og_from_y);
    ``paired``: the states of even chunks only (KernelSettings.paired_states). What it
    computes is checked on a GPU (test_gpu_gla_gluon_fused_backward_*, test_gpu_lizard_one_op_*)."""
    from linearize.ops.gla import gluon as gla_gluon

    k = gla_gluon.compile_fused_for_hopper(normalize=normalize, dv_add=dv_add, has_ds=has_ds, store_ds0=store_ds0,
                                           model_layout=model_layout, side=side, paired=paired)
    _assemble_warp_specialised(k, tmp_path, 8 * 64 * 128 * 2 + 2 * 128 * 128 * 2, max_spill=max_spill)


@pytest.mark.parametrize("window, model_layout, own_delta, scores", [
    (128, 0, True, False), (100, 7, True, False), (128, 0, False, False), (128, 7, True, True)])
def test_gluon_window_walk_backward_compiles_for_hopper(window, model_layout, own_delta, scores, tmp_path):
    """kernels/window_gluon.py, the walking window backward (WindowLaunch.gluon_bwd_walk),
    forming D itself (from o or from its scores) or reading it: compiled for sm_90a within one block's shared memory (two
    rings of six 64 x 128 tiles, two staging tiles for dk and dv, and two rings of row vectors), its two
    warp-specialised partitions assembled by ptxas (the dk/dv partition, with 256 registers a
    thread, spills a few values: 44, 100, 20 and 68 bytes in these cases as a launch compiles
    them; 116, 120, 20 and 124 with the 248 it had before 2026-11-26). What it computes is checked
    on a GPU (test_gpu_window_gluon_walk_backward_*)."""
    from linearize.ops.window_attn import gluon as window_gluon

    k = window_gluon.compile_for_hopper(window=window, model_layout=model_layout, walk=True, own_delta=own_delta,
                                        scores_delta=scores)
    _assemble_warp_specialised(k, tmp_path, 14 * 64 * 128 * 2, max_spill=100)


@pytest.mark.parametrize("window, model_layout", [(128, 0), (100, 7)])
def test_gluon_window_backward_compiles_without_spills(window, model_layout, tmp_path):
    """kernels/window_gluon.py, the window's backward the dispatch runs on Hopper: compiled for
    sm_90a within one block's shared memory (twelve 64 x 128 tiles), its two warp-specialised
    partitions assembled by ptxas without spilling registers. What it computes is checked on a
    GPU (test_gpu_window_gluon_backward_*)."""
    from linearize.ops.window_attn import gluon as window_gluon

    k = window_gluon.compile_for_hopper(window=window, model_layout=model_layout)
    _assemble_warp_specialised(k, tmp_path, 12 * 64 * 128 * 2, max_spill=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_sparse_live_kernels_compile_for_hopper(compiled, dtype):
    """The sparse window's live form (lizard-recall's shapes: window 128, 256 cached pairs read with
    their own q and k, 4 sink logits, the largest query blocks the chunk op gives them), forward and
    backward, and the selection (every pair's j_s by either kernel, the blocks' slot lists)."""
    from linearize.ops.sparse_window.chunk import kernel_block
    from linearize.ops.sparse_window.triton import cache_until_triton, old_slots_triton, sparse_live_triton

    B, H, T, D, W, M, C = 1, 2, 512, 64, 128, 256, kernel_block(1024, dtype)
    q, k, v, cq, lk = (torch.zeros(B, H, T, D, dtype=dtype, requires_grad=True) for _ in range(5))
    sinks = torch.zeros(H, 4, requires_grad=True)
    until = cache_until_triton(torch.zeros(B, H, T - W), torch.ones(B, T - W, dtype=torch.bool), M)
    cache_until_triton(torch.zeros(B, H, T - W), torch.ones(B, T - W, dtype=torch.bool), M, scan=True)
    pick = old_slots_triton(until, T, W, M, C)
    o = sparse_live_triton(q, k, v, cq, lk[:, :, W:], sinks, until, pick, torch.zeros(B, dtype=torch.int32),
                           window=W, cache_size=M, scale=D ** -0.5, block=C)
    _backward(o, q, k, v, cq, lk, sinks)
    assert {name for name, *_ in compiled} == {"_sparse_fwd_kernel", "_sparse_bwd_kernel", "_sparse_bwd_window_kernel",
                                               "_sparse_bwd_cache_kernel", "_cache_until_kernel", "_old_slots_kernel",
                                               "_cache_until_scan_kernel"}
    assert all(smem <= HOPPER_SMEM for _, _, smem in compiled), [(n, smem) for n, _, smem in compiled]


def test_selection_scan_kernel_assembles_without_spills(compiled, tmp_path):
    """The selection's scan (256 kept pairs, blocks of 128, its int8 products and a sort of 512
    ranks in registers) assembles for sm_90a without spilling: it is one chain per batch*head, and a
    spill would sit on that chain's every step."""
    from linearize.ops.sparse_window.triton import cache_until_triton

    P = 600
    cache_until_triton(torch.zeros(1, 2, P), torch.ones(1, P, dtype=torch.bool), 256, scan=True)
    (name, *_), = compiled
    assert name == "_cache_until_scan_kernel"
    assert _spill_bytes(_ptxas(compiled.ptx[0], tmp_path)) == 0


def test_lolcats_band_kernels_compile_for_hopper(compiled):
    """LoLCATs' bands (window 64, chunks of 64, Hedgehog features of 128), forward and backward, fp32
    (the chunk form's compute dtype)."""
    from linearize.ops.lolcats_attn.triton import lolcats_band_triton

    B, H, T, D, F, W, C = 1, 2, 256, 64, 128, 64, 64
    L, NC = W - 1, T // C
    q, fq = torch.zeros(B, H, T, D, requires_grad=True), torch.zeros(B, H, T, F, requires_grad=True)
    keys, fkeys, values = (torch.zeros(B, H, L + T, d, requires_grad=True) for d in (D, F, D))
    S_j, z_j = torch.zeros(B, H, NC, F, D, requires_grad=True), torch.zeros(B, H, NC, F, requires_grad=True)
    f = torch.zeros(H, requires_grad=True)
    k_pos = torch.arange(-L, T)[None].expand(B, -1)
    y = lolcats_band_triton(q, fq, keys, fkeys, values, k_pos, S_j, z_j, f, window=W, L=L, C=C, scale=D ** -0.5,
                            eps=1e-6)
    _backward(y, q, fq, keys, fkeys, values, S_j, z_j, f)
    assert {name for name, *_ in compiled} == {"_lolcats_fwd_kernel", "_lolcats_bwd_kernel"}
    assert all(smem <= HOPPER_SMEM for _, _, smem in compiled), [(n, smem) for n, _, smem in compiled]
