"""The kernels' backend (linearize.ops.backend) and what every op's kernels share: the env switch
and dispatch (CPU tensors take the torch path), the Triton launchers' input checks, TMA
descriptors and tiles, the Gluon launchers' scope checks and import guard, the fused forward's
segment rule, the kernel settings; on CUDA, the dispatch of GPU tensors."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from kernel_checks import needs_cuda, needs_triton


def test_env_switch_and_cpu_tensors_take_the_torch_path(monkeypatch):
    from linearize.ops import gla as gla_op
    from linearize.ops import window_attn as window_op
    from linearize.ops.backend import dispatch
    from linearize.ops.gla.chunk import gla_chunk
    from linearize.ops.window_attn.chunk import window_attn_chunk

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for off in ("0", "false", "off"):
        monkeypatch.setenv("LINEARIZE_KERNELS", off)
        assert not dispatch.kernels_enabled()
    monkeypatch.setenv("LINEARIZE_KERNELS", "1")
    assert dispatch.kernels_enabled() == dispatch.triton_available()
    g = torch.Generator().manual_seed(0)
    q, k = torch.rand(2, 1, 2, 9, 8, generator=g)
    v = torch.randn(1, 2, 9, 5, generator=g)
    log_g = -torch.rand(1, 2, 9, generator=g)
    assert not gla_op.gla_applies(q, k, v, log_g)  # CPU tensors, no interpreter
    o, st = gla_op.gla_chunk(q, k, v, log_g, chunk_size=4)
    ref, ref_st = gla_chunk(q, k, v, log_g, chunk_size=4)
    assert torch.equal(o, ref) and torch.equal(st.S, ref_st.S)
    w, ws = window_op.window_attn_chunk(q, k, q, window=3, sink_logits=torch.zeros(2, 4))
    ref_w, _ = window_attn_chunk(q, k, q, window=3, sink_logits=torch.zeros(2, 4))
    assert torch.equal(w, ref_w)
    assert window_op.window_attn_sum(q, k, q, q, torch.ones(2), window=3) is None


@needs_triton
def test_bad_inputs_raise_naming_the_value():
    from linearize.ops.gla.triton import gla_chunk_triton
    from linearize.ops.window_attn.triton import window_attn_triton

    q = torch.rand(1, 2, 9, 8)
    v = torch.randn(1, 2, 9, 5)
    with pytest.raises(ValueError, match=r"scalar log_g \(B, H, T\).*got log_g \(1, 2, 9, 8\)"):
        gla_chunk_triton(q, q, v, -torch.rand(1, 2, 9, 8))
    with pytest.raises(ValueError, match=r"log_g must have shape \(1, 2, 9\) or \(1, 2, 9, 8\), got \(1, 2, 8\)"):
        gla_chunk_triton(q, q, v, -torch.rand(1, 2, 8))
    with pytest.raises(ValueError, match=r"one dtype among bf16/fp16/fp32.*q torch.float64"):
        gla_chunk_triton(q.double(), q.double(), v.double(), -torch.rand(1, 2, 9))
    with pytest.raises(ValueError, match=r"Dk, Dv <= 128.*Dk=200"):
        gla_chunk_triton(torch.rand(1, 2, 9, 200), torch.rand(1, 2, 9, 200), v, -torch.rand(1, 2, 9))
    with pytest.raises(ValueError, match=r"eps must be a non-negative number, got -1"):
        gla_chunk_triton(q, q, v, -torch.rand(1, 2, 9), eps=-1)
    with pytest.raises(ValueError, match=r"alpha must have shape \(2,\), got \(3,\)"):
        window_attn_triton(q, q, v, window=4, y_global=torch.zeros(1, 2, 9, 5), alpha=torch.ones(3))
    with pytest.raises(ValueError, match=r"y_global and alpha must be given together"):
        window_attn_triton(q, q, v, window=4, y_global=torch.zeros(1, 2, 9, 5))
    with pytest.raises(ValueError, match=r"window must be a positive int, got 0"):
        window_attn_triton(q, q, v, window=0)
    with pytest.raises(ValueError, match=r"sink_logits must have shape \(H, m\) = \(2, m\), got \(3, 4\)"):
        window_attn_triton(q, q, v, window=4, sink_logits=torch.zeros(3, 4))


@needs_triton
def test_tensor_descriptors_only_where_tma_allows_them():
    """TMA needs 16-byte row strides and bases and a unit last stride; anything else keeps the
    pointer loads (the interpreter cases run both paths against the reference)."""
    from linearize.ops.gla.triton import GLALaunch, _tma

    on, off = GLALaunch(), GLALaunch(tma=False)
    x = torch.zeros(2, 3, 64, 128, dtype=torch.bfloat16)
    assert _tma(on, x, x) and not _tma(off, x, x)
    assert not _tma(on, x, torch.zeros(2, 3, 64, 20, dtype=torch.bfloat16))  # 40-byte rows
    assert _tma(on, torch.zeros(2, 3, 64, 20))  # 80-byte fp32 rows
    assert not _tma(on, x.flatten()[1:1 + 2 * 3 * 64 * 64].view(2, 3, 64, 64))  # base 2 bytes past 16
    assert not _tma(on, x.transpose(2, 3))  # last stride not 1


@pytest.mark.parametrize("grad_mode", [True, False])
def test_forwards_store_for_a_backward_only_when_one_can_run(monkeypatch, grad_mode):
    """The per-chunk states (GLA) and the window's own output (fused into y_g + alpha y_w) exist only
    for a backward; under torch.no_grad none runs, even for inputs that require grad (what autograd's
    needs_input_grad reports). Checked at the point where the kernels' drivers get the flag."""
    from linearize.ops.gla import triton as kgla
    from linearize.ops.window_attn import triton as kwin

    seen = {}

    class Stop(Exception):
        pass

    def record(name, position):
        def fake(*args):
            seen[name] = args[position]
            raise Stop
        return fake

    monkeypatch.setattr(kgla, "_fwd", record("gla", 10))
    monkeypatch.setattr(kwin, "_fwd", record("window", 9))
    q, k, v = (torch.rand(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    log_g = torch.full((1, 2, 8), -0.1, requires_grad=True)
    with torch.set_grad_enabled(grad_mode):
        with pytest.raises(Stop):
            kgla.gla_chunk_triton(q, k, v, log_g)
        with pytest.raises(Stop):
            kwin.window_attn_triton(q, k, v, window=4, y_global=torch.zeros_like(v), alpha=torch.ones(2))
    assert seen == {"gla": grad_mode, "window": grad_mode}


@needs_cuda
def test_gpu_dispatch():
    from linearize.ops import gla as gla_op
    from linearize.ops import window_attn as window_op

    q = torch.rand(1, 2, 64, 16, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 64, 16, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(1, 2, 64, device="cuda")
    assert gla_op.gla_applies(q, q, v, g)
    assert not gla_op.gla_applies(q, q, v, -torch.rand(1, 2, 64, 16, device="cuda"))  # per-channel gates
    assert not gla_op.gla_applies(q.double(), q.double(), v.double(), g)
    assert window_op.window_applies(q, q, v, sink_logits=torch.zeros(2, 4, device="cuda"))
    assert not window_op.window_applies(q, q, v, terraced=True)
    assert not window_op.window_applies(q, q, v, softcap=30.0)
    os.environ["LINEARIZE_KERNELS"] = "0"
    try:
        assert not gla_op.gla_applies(q, q, v, g)
        assert window_op.window_attn_sum(q, q, v, v, torch.ones(2, device="cuda"), window=8) is None
    finally:
        del os.environ["LINEARIZE_KERNELS"]


def test_gluon_scope_checks_host_side(monkeypatch):
    """The Gluon launchers' scope checks, on CPU: off Hopper (here no CUDA device: sm_major 0) every
    one says no; told the device is Hopper, each takes in-scope inputs (bf16, widths 128, T a
    multiple of 64, contiguous or a model's (B, T, H, D) transposed) and refuses a width, a T, a
    dtype or a layout outside it."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.backend import dispatch
    from linearize.ops.gla import gluon as gla_gluon
    from linearize.ops.lizard_attn import gluon as lizard_gluon
    from linearize.ops.window_attn import gluon as window_gluon

    B, H, T, D = 2, 3, 128, 128
    x = torch.zeros(B, H, T, D, dtype=torch.bfloat16)
    model = torch.zeros(B, T, H, D, dtype=torch.bfloat16).transpose(1, 2)
    lg, sinks = torch.zeros(B, H, T), torch.zeros(H, 4)

    def checks(q, k=None, v=None, log_g=lg):
        k, v = k if k is not None else q, v if v is not None else q
        return [gla_gluon.supports_bwd_chunks(q, k, v, 64, False), gla_gluon.supports_fwd_fused(q, k, v, log_g),
                window_gluon.supports_bwd(q, k, v, 128, None),
                lizard_gluon.supports(q, k, v, log_g, q, k, 128, sinks, None)]

    assert dispatch.sm_major(x) == 0 and checks(x) == [False] * 4
    for mod in (gla_gluon, lizard_gluon, window_gluon):
        monkeypatch.setattr(mod, "sm_major", lambda t: 9)
    assert checks(x) == [True] * 4 and checks(model, x, x) == [True] * 4
    assert checks(x[..., :64]) == [False] * 4  # width 64
    assert checks(x[:, :, :100]) == [False] * 4  # T not a multiple of 64
    assert checks(x.half(), x, x) == [False] * 4  # dtypes differ
    assert checks(x.transpose(0, 1).contiguous().transpose(0, 1)) == [False] * 4  # neither layout
    assert checks(x, log_g=lg.bfloat16())[1] is False and checks(x, log_g=lg.bfloat16())[3] is False


def test_gluon_tma_tiles_host_side():
    """gla_gluon.tma_tiles on CPU: a descriptor per tensor over its 2-D view (rows b*sb + h*sh + t),
    sharing one remembered shared-memory layout; None where a tensor is in neither layout or its
    base is not 16-byte aligned."""
    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.gla import gluon as gla_gluon

    B, H, T, D = 2, 3, 128, 128
    x = torch.zeros(B, H, T, D, dtype=torch.bfloat16)
    model = torch.zeros(B, T, H, D, dtype=torch.bfloat16).transpose(1, 2)
    descs, views = gla_gluon.tma_tiles([x, model], [64, 128])
    assert [tuple(d.shape) for d in descs] == [(B * H * T, D), (B * T, H * D)]
    assert [spec for _, spec in views] == [(H * T, T, 0), (T, 0, D)]
    assert all(list(d.block_shape) == [64, 128] for d in descs)
    assert descs[0].layout is descs[1].layout is gla_gluon.smem_layout((64, 128), torch.bfloat16)
    assert descs[0].layout == gla_gluon.gl.NVMMASharedLayout.get_default_for([64, 128], gla_gluon.gl.bfloat16)
    assert gla_gluon.tma_tiles([x, x.transpose(0, 1).contiguous().transpose(0, 1)], [64, 128]) is None
    unaligned = torch.zeros(B * H * T * D + 1, dtype=torch.bfloat16)[1:].view(B, H, T, D)
    assert gla_gluon.tma_readable([unaligned]) is False and gla_gluon.tma_tiles([x, unaligned], [64, 128]) is None


def test_fused_forward_segment_rule():
    """fused_segment_count: no split where batch x heads keep half the SMs busy; else powers of two
    up to two programs per SM, segments at least 16 chunks of 64 long (the H200 sweep's optima)."""
    from linearize.ops.backend.dispatch import fused_segment_count

    assert [fused_segment_count(B, 32, T, 132) for B, T in ((16, 2048), (4, 8192), (2, 16384), (1, 32768))] \
        == [1, 1, 4, 8]
    assert fused_segment_count(1, 1, 1 << 20, 132) == 256  # 2 * 132 // 1 rounded down to a power of two
    assert fused_segment_count(1, 32, 4096, 132) == 4  # 64 chunks: at most 4 segments of 16
    assert fused_segment_count(1, 32, 1024, 132) == 1


def test_gluon_kernels_import_guard(monkeypatch):
    """dispatch.gluon_kernels: the module itself; None only where Triton lacks Gluon; a misspelt
    module name raises rather than quietly turning the Gluon kernels off."""
    import builtins

    pytest.importorskip("triton.experimental.gluon")
    from linearize.ops.backend import dispatch
    from linearize.ops.gla import gluon as gla_gluon

    # (its answers are remembered per name: start from none, and leave the module's own as they were)
    monkeypatch.setattr(dispatch, "_GLUON_MODULES", {})
    assert dispatch.gluon_kernels("gla.gluon") is gla_gluon
    with pytest.raises(ImportError):
        dispatch.gluon_kernels("gla.gluon_misspelt")
    monkeypatch.delitem(sys.modules, "linearize.ops.window_attn.gluon", raising=False)
    real_import = builtins.__import__

    def no_gluon(name, *a, **k):
        if name.startswith("triton.experimental"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_gluon)
    assert dispatch.gluon_kernels("window_attn.gluon") is None


def test_kernel_settings_block_sets_and_restores():
    """One context manager sets the kernels' user settings for a block (nested blocks too) and puts
    them back, also after an error; bad names and values are refused by name; the backends' launch
    tables take chunk and gluon from the settings in force."""
    from linearize.ops.backend import KernelSettings, current_settings, kernel_settings
    from linearize.ops.backend.settings import resolve

    assert current_settings() == KernelSettings()
    with kernel_settings(gluon=False) as outer:
        assert current_settings() is outer and outer.gluon is False
        with kernel_settings(chunk=32, paired_states=True):
            assert current_settings() == KernelSettings(chunk=32, gluon=False, paired_states=True)
        assert current_settings() is outer
        with pytest.raises(RuntimeError):
            with kernel_settings(side_streams=False):
                raise RuntimeError("inside")
        assert current_settings() is outer
    assert current_settings() == KernelSettings()
    with pytest.raises(ValueError, match="unknown kernel settings.*one_op"):
        with kernel_settings(one_op=False):
            pass
    with pytest.raises(ValueError, match="chunk"):
        KernelSettings(chunk=48)
    with pytest.raises(ValueError, match="gluon"):
        KernelSettings(gluon=1)
    with pytest.raises(TypeError, match="settings"):
        resolve({"chunk": 64})
    if not _triton_importable():
        return
    from linearize.ops.gla import triton as kgla
    from linearize.ops.window_attn import triton as kwin

    with kernel_settings(chunk=32, gluon=False):
        assert (kgla.launch_for().chunk, kgla.launch_for().gluon, kwin.launch_for().gluon) == (32, False, False)
    assert kgla.launch_for() == kgla.LAUNCH and kwin.launch_for(KernelSettings(gluon=False)).gluon is False


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True
