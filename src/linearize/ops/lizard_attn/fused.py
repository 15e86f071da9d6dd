"""The whole Lizard attention in one call: gated linear attention + sliding window with sinks.

    y = gla(phi_q, phi_k, v, log_g) + alpha_h * window(q_w, k_w, v; sink_logits)

Shapes: phi_q, phi_k (B, H, T, F) features (what the Lizard layer passes: Hedgehog's, rounded
once from fp32), or log-features with ``log_space_features``; v (B, H, T, Dv); log_g (B, H, T);
q_w, k_w (B, H, T, D) the window's queries/keys (RoPE already applied by the caller); alpha (H,);
sink_logits (H, m) or None. Returns y (B, H, T, Dv) in the dtype of v, the gated branch's state
and the window's.

On CUDA with the kernels enabled this is one autograd op (``_LizardFunction``), its passes
spread over two CUDA streams where that pays (``KernelSettings.side_streams``). Forward, gated first:
the gated passes, then the window kernel with the combine in its epilogue. Forward, window
first (where the gated passes before the main pass walk long): the window kernel writes its
output o_w while those gated passes (segment pre-pass and scan, normaliser), which need nothing
from it, run beside it on the second stream; then the gated main pass adds alpha_h * o_w in its
epilogue. Backward: the gated reverse state passes on the second stream beside the window's
backward, then the gated chunk pass adding its dv into the window's. The sequential passes walk
their chunks one after another in few programs, and the window's many short programs fill the
rest of the GPU. On Hopper, where their scope holds, the passes are hand-written Gluon kernels
instead (unless ``KernelSettings.gluon`` is off): the whole forward is one (``lizard_gluon``, in
inference and in training, where it also stores what the backward reads; either way it writes
the window's decode state from its key/value ring), and so are the
window's backward (``window_gluon``) and the gated chunk pass (``gla_gluon``). Elsewhere
the torch ops and a torch combine, the same computation ``layers.hybrid.HybridAttention`` runs for
Lizard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import common
from ..gla import GLAState
from ..window_attn import WindowState
from ..gla import gla_applies, gla_chunk
from ..window_attn import window_applies, window_attn_sum
from ..window_attn.chunk import window_attn_chunk as _window_chunk_torch
from ..backend.settings import KernelSettings, resolve as resolve_settings
from ..backend.dispatch import fork_stream, fused_segment_count, gluon_kernels, join_stream, unit_last


@dataclass(frozen=True)
class LizardPlan:
    """Test and benchmark hooks of ``lizard_attention``: force a path the rules below would not
    pick. Not a user setting (those are ``KernelSettings``); ``plan=None`` is what every caller gets.

    ``gla`` / ``window``: launch variants of the branches' passes (``GLALaunch``, ``WindowLaunch``;
    None: their ``LAUNCH``; ``chunk`` and ``gluon`` come from the settings either way).
    ``window_first``: the forward runs the window kernel first and combines in the gated main pass's
    epilogue (so that the gated passes before it can run beside the window on a side stream), or
    gated first with the combine in the window kernel's epilogue. None: the rule of
    ``_window_first`` (window first where the gated forward is cut into segments or its normaliser
    has fewer (batch x head) programs than there are multiprocessors).
    ``fused_fwd`` / ``fused_train``: False runs the Triton passes instead of the fused Gluon forward,
    in inference / in training, where ``KernelSettings.gluon`` would have run it.
    ``fused_segments``: the fused forward's sequence segments (None: ``fused_segment_count``)."""

    gla: Optional[object] = None
    window: Optional[object] = None
    window_first: Optional[bool] = None
    fused_fwd: bool = True
    fused_train: bool = True
    fused_segments: Optional[int] = None


@dataclass(frozen=True)
class _Run:
    """Everything ``_LizardFunction`` reads about how to run, resolved once from the settings and the plan."""

    gla: object  # GLALaunch
    window: object  # WindowLaunch
    window_first: Optional[bool]
    side_streams: bool
    fused_fwd: bool
    fused_train: bool
    fused_segments: Optional[int]
    og_from_y: bool
    ow_from_scores: bool
    paired_states: bool


def _run_for(settings: KernelSettings, plan: Optional[LizardPlan]) -> _Run:
    from ..gla import triton as kgla
    from ..window_attn import triton as kwin

    plan = plan or LizardPlan()
    return _Run(gla=kgla.launch_for(settings, plan.gla), window=kwin.launch_for(settings, plan.window),
                window_first=plan.window_first, side_streams=settings.side_streams,
                fused_fwd=settings.gluon and plan.fused_fwd, fused_train=settings.gluon and plan.fused_train,
                fused_segments=plan.fused_segments, og_from_y=settings.og_from_y,
                ow_from_scores=settings.ow_from_scores, paired_states=settings.paired_states)


# the side streams' priority (lower is higher; CUDA clamps it to its range): their sequential programs
# must start before the window's many short ones queue up, or the overlap gains nothing
_SIDE_PRIORITY = -1
_SIDE_STREAMS: dict = {}
_SUMS_EVENTS: dict = {}


def _side_stream(x: torch.Tensor, wanted: bool, priority: int, name: str = "side") -> Optional["torch.cuda.Stream"]:
    """The device's stream of that name and priority (made once), or None off CUDA or when not wanted."""
    if not (wanted and x.is_cuda):
        return None
    key = (x.device.index if x.device.index is not None else torch.cuda.current_device(), priority, name)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key[0], priority=priority)
    return _SIDE_STREAMS[key]


def _window_first(cfg: _Run, gcfg, phi_q: torch.Tensor, v: torch.Tensor) -> bool:
    """``cfg.window_first``, or when None: whether ``gla._fwd`` would cut the sequence into
    segments, or give the normaliser fewer (batch x head) programs than there are multiprocessors."""
    if cfg.window_first is not None:
        return cfg.window_first
    from ..gla import triton as kgla

    B, H = phi_q.shape[:2]
    nseg = kgla.fwd_blocks(phi_q, v, gcfg, gcfg.fwd_bv)[3]
    return nseg > 1 or B * H < kgla.device_sms(phi_q)


def _fwd(phi_q, phi_k, v, log_g, q_w, k_w, sinks, kmin, alpha, S0, z0, normalize: bool, log_space: bool,
         eps: float, window: int, scale: float, store: bool, cfg: _Run):
    """Returns y, o_g, o_w, lse, den, S_T, z_T, segs, sc, zc; o_g, o_w, lse, den, sc and zc are what a
    backward reads, complete only with ``store``."""
    from ..gla import triton as kgla
    from ..window_attn import triton as kwin

    gcfg, wcfg = cfg.gla, cfg.window
    if _window_first(cfg, gcfg, phi_q, v):
        side = _side_stream(v, cfg.side_streams, _SIDE_PRIORITY)
        z_side = _side_stream(v, cfg.side_streams, _SIDE_PRIORITY, "normaliser")
        with fork_stream(side):
            p = kgla.fwd_prologue(phi_q, phi_k, v, log_g, S0, z0, normalize, log_space, gcfg, store, gcfg.fwd_bv,
                                  split_normaliser=True, z_stream=z_side)
        o_w, _, lse = kwin._fwd(q_w, k_w, v, sinks, kmin, None, None, window, scale, True, wcfg)
        join_stream(side, *vars(p).values())
        o_g, y = kgla.fwd_main(phi_q, phi_k, v, log_g, p, normalize, log_space, eps, gcfg, store, ow=o_w,
                               alpha=alpha, store_o=store)
    else:
        p = kgla.fwd_prologue(phi_q, phi_k, v, log_g, S0, z0, normalize, log_space, gcfg, store, gcfg.fwd_bv)
        o_g, _ = kgla.fwd_main(phi_q, phi_k, v, log_g, p, normalize, log_space, eps, gcfg, store)
        o_w, y, lse = kwin._fwd(q_w, k_w, v, sinks, kmin, o_g, alpha, window, scale, store, wcfg)
    return y, o_g, o_w, lse, p.den, p.S_T, p.z_T, (p.nseg, p.seg_len), p.sc, p.zc


class _LizardFunction(torch.autograd.Function):
    """y = gla(phi_q, phi_k, v, log_g; S0, z0) + alpha * window(q_w, k_w, v; sinks), and the gated
    branch's final state; the backward is the two branches' own backward kernels."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, log_g, q_w, k_w, sinks, alpha, S0, z0, kmin, normalize, log_space, eps,
                window, scale, cfg, grad_mode, state_len, state_dtype, keep_state):
        from ..gla import triton as kgla
        from ..window_attn import triton as kwin

        store = grad_mode and any(ctx.needs_input_grad[:10])
        fused = None
        # the backward's gated kernel can take dy . o_g from y and the window's dy . o_w (see og_from_y)
        window_dyo = store and kwin.forms_dyo(cfg.window, q_w, k_w, v, window, kmin)
        one_segment = store and kgla.fused_bwd_segments(phi_q, phi_k, v, log_space, cfg.gla) == 1
        og_from_y = window_dyo and normalize and cfg.og_from_y and one_segment
        paired = one_segment and cfg.fused_train and cfg.paired_states
        ow_from_scores = window_dyo and cfg.ow_from_scores
        # the window's fresh state (its last keys and values): written by the fused kernel from its ring,
        # else copied from the inputs beside the passes; none where the caller keeps no state
        w_state = _window_state_buffers(k_w, v, state_len, state_dtype) if keep_state else None
        kernel_writes_state = state_dtype == torch.float32  # (the kernel writes fp32)
        if store and cfg.fused_train:
            fused = _fused_forward(phi_q, phi_k, v, log_g, q_w, k_w, alpha, sinks, S0, z0, kmin, normalize, log_space,
                                   window, scale, eps, cfg, store=True, store_og=not og_from_y,
                                   store_ow=not ow_from_scores, window_state=w_state if kernel_writes_state else None,
                                   # (no state out, no gradient for it: a backward of one segment then
                                   # reads no state leaving the last chunk, which the kernel skips too)
                                   paired_states=paired, final_state=keep_state or not one_segment)
        if fused is not None:
            if w_state is not None and not kernel_writes_state:
                _fill_window_state(w_state, k_w, v)
            y, S_T, z_T, inter, segs = fused
            o_g, o_w, lse, den, sc, zc, bl = (inter[n] for n in ("o_g", "o_w", "lse", "den", "sc", "zc", "bl"))
        else:
            paired = False  # (the Triton passes keep every chunk's state)
            bl = None
            copier = _side_stream(v, cfg.side_streams and w_state is not None, 0, "copy")
            with fork_stream(copier):
                if w_state is not None:
                    _fill_window_state(w_state, k_w, v)
            y, o_g, o_w, lse, den, S_T, z_T, segs, sc, zc = _fwd(
                phi_q, phi_k, v, log_g, q_w, k_w, sinks, kmin, alpha, S0, z0, normalize, log_space, eps, window,
                scale, store, cfg)
            join_stream(copier)
        if og_from_y:
            o_g = None  # (the Triton passes wrote it: not kept)
        if ow_from_scores:
            o_w = None
        ctx.save_for_backward(phi_q, phi_k, v, log_g, q_w, k_w, sinks, alpha, kmin, y if og_from_y else None)
        # the op's own intermediates live on ctx, so that the backward can drop each one as soon
        # as its last reader is queued (saved tensors would all live until the backward returns)
        # (bl: the gates' sums within chunks that the fused forward read, read again by the fused backward)
        ctx.inter = dict(o_g=o_g, o_w=o_w, lse=lse, den=den, sc=sc, zc=zc, paired=paired, bl=bl) if store else None
        # the backward runs with the settings of its forward (a later kernel_settings block changes nothing)
        ctx.args = (normalize, log_space, eps, window, scale, segs, S0 is not None, cfg, cfg.gla, cfg.window)
        ctx.state_len = state_len
        ctx.one_segment = one_segment
        ctx.window_dyo = window_dyo  # (the window's backward, with the configs kept above, forms dy . o_w)
        ctx.set_materialize_grads(False)
        if not keep_state:  # (the Triton passes formed S_T and z_T anyway: dropped)
            return y, None, None, None, None
        return y, S_T, z_T, *w_state

    @staticmethod
    def backward(ctx, dy, dS_T, dz_T, dw_k, dw_v):
        from ..gla import triton as kgla
        from ..window_attn import triton as kwin

        phi_q, phi_k, v, log_g, q_w, k_w, sinks, alpha, kmin, y = ctx.saved_tensors
        inter, ctx.inter = ctx.inter, None
        if inter is None:
            raise RuntimeError("lizard_attention's backward can run once per forward: it frees its intermediates "
                               "as it goes, so a second backward through the same graph (retain_graph=True) has "
                               "nothing to read; run the forward again")
        normalize, log_space, eps, window, scale, segs, has_state, cfg, gcfg, wcfg = ctx.args
        if dy is None:
            dy = torch.zeros_like(v)
        need_dstate = has_state and (ctx.needs_input_grad[8] or ctx.needs_input_grad[9])
        # (the fused gated backward in one segment has no reverse passes to run beside the window's: no
        # side stream, whose fork and join cost the host more than they could save)
        side = _side_stream(v, cfg.side_streams and not ctx.one_segment, _SIDE_PRIORITY)
        o_g = inter.pop("o_g")  # None where y stands in (og_from_y)
        with fork_stream(side):  # the reverse state passes walk their chunks in order: beside the window's
            gp = kgla.bwd_states(phi_q, phi_k, v, log_g, (y if o_g is None else o_g) if normalize else None,
                                 inter["den"], inter["sc"], inter["zc"], dy, dS_T, dz_T, need_dstate, normalize,
                                 log_space, eps, segs, gcfg, paired=inter.pop("paired"))
        # o_w is freed as this returns (its readers are queued on this stream, before anything that
        # could take its memory); lse too, unless the sums below read it on their own stream
        lse = inter.pop("lse")
        later = cfg.side_streams and ctx.window_dyo
        dq_w, dk_w, dv_w, d_sinks, d_alpha, dyo_w = kwin._bwd(q_w, k_w, v, sinks, kmin, inter.pop("o_w"), lse,
                                                              alpha, dy, window, scale, wcfg, sums=not later)
        if not later:
            del lse
        if y is not None and dyo_w is None:
            raise RuntimeError("lizard_attention: the forward kept y for the window's dy . o_w, which its backward "
                               "did not form")
        events = _sums_events(v) if later and v.is_cuda else None
        if events is not None:
            events[0].record()  # (the window's backward is queued)
        join_stream(side, *vars(gp).values())
        del o_g  # read on the side stream: freed only once this stream has waited for it
        # the chunk pass adds its dv to the window's in place: no third tensor, no sum kernel
        dq, dk, dv, dlog_g, dS0, dz0 = kgla.bwd_chunks(
            phi_q, phi_k, v, log_g, gp, normalize, log_space, eps, gcfg, dv_into=dv_w,
            side=(dyo_w, alpha.float().contiguous()) if y is not None else None, bl=inter.pop("bl"))
        if later:  # queued after the gated chunk pass, so that its programs take the GPU first
            d_sinks, d_alpha = _sums_beside(events, dyo_w, lse, sinks, alpha)
        # the window's state holds the last keys and values: their gradients where it was used
        T, L = v.shape[2], ctx.state_len
        take = min(T, L)
        for grad, d_state in ((dk_w, dw_k), (dv, dw_v)):
            if d_state is not None:
                grad[:, :, T - take:] += d_state[:, :, L - take:].to(grad.dtype)
        return (dq, dk, dv, dlog_g, dq_w, dk_w, d_sinks, d_alpha, dS0, dz0,
                None, None, None, None, None, None, None, None, None, None, None)


def _sums_events(x: torch.Tensor) -> tuple["torch.cuda.Event", "torch.cuda.Event"]:
    """The device's two events for ``_sums_beside`` (made once: a new event a call cost the host more;
    a wait takes an event's last record as it is queued, so reusing them is safe)."""
    key = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if key not in _SUMS_EVENTS:
        _SUMS_EVENTS[key] = (torch.cuda.Event(), torch.cuda.Event())
    return _SUMS_EVENTS[key]


def _sums_beside(events: Optional[tuple], dyo: torch.Tensor, lse: torch.Tensor, sinks: Optional[torch.Tensor],
                 alpha: torch.Tensor):
    """d sink_logits and d alpha (``window.sink_alpha_sums``, in the dtypes of sinks and alpha) on a
    stream of their own, after the window's backward (the first of ``events``, recorded after it)
    and beside whatever the caller queued since; the caller's stream waits for them (the second)
    before it goes on. Off CUDA, or without events: inline. Their kernels are small (B16 T2048:
    0.015 ms and two launches) and would run alone between the window's backward and the gated one;
    queued after the gated one, at the same priority, they take the multiprocessors its last wave
    leaves idle."""
    from ..window_attn import triton as kwin

    side = _side_stream(dyo, events is not None, 0, "sums")
    d_sinks, d_alpha = kwin.sink_alpha_sums(dyo, lse, sinks, alpha,
                                            beside=(side, *events) if side is not None else None)
    # (dyo and lse are the caller's, referenced until it returns: after the wait)
    return kwin.in_dtypes(d_sinks, d_alpha, sinks, alpha)


def one_op_applies(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor,
                   q_w: torch.Tensor, k_w: torch.Tensor, alpha: torch.Tensor, sink_logits: Optional[torch.Tensor],
                   state: Optional[GLAState], window_state: Optional[WindowState] = None) -> bool:
    """Whether ``lizard_attention`` runs as one op (``_LizardFunction``) for these inputs: both
    branches' kernels apply, and q_w, k_w, v share a dtype."""
    return (gla_applies(phi_q, phi_k, v, log_g, state)
            and window_applies(q_w, k_w, v, sink_logits=sink_logits, state=window_state, fresh_state=True)
            and isinstance(alpha, torch.Tensor) and alpha.is_cuda == v.is_cuda
            and q_w.dtype == v.dtype and q_w.shape[:3] == v.shape[:3])


def lizard_attention(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor,
    q_w: torch.Tensor, k_w: torch.Tensor, alpha: torch.Tensor, *, window: int = 128,
    sink_logits: Optional[torch.Tensor] = None, scale: Optional[float] = None, normalize: bool = True,
    log_space_features: bool = False, state: Optional[GLAState] = None, chunk_size: int = 64,
    eps: float = 1e-6, window_state: Optional[WindowState] = None, return_state: bool = True,
    settings: Optional[KernelSettings] = None, plan: Optional[LizardPlan] = None,
) -> tuple[torch.Tensor, Optional[GLAState], Optional[WindowState]]:
    """Lizard's attention output and the two branch states (see the module docstring).

    ``window_state``: None, or a fresh window state (``pos <= 0`` in every row: its cache is never
    seen, and a row at -p starts with p tokens of left padding, invisible to the window; the
    caller zeroes the padding's features and gates for the gated branch).
    ``return_state``: False returns (y, None, None), for a caller that keeps no state (a training
    step, attention transfer): the fused kernel then writes neither the window's state nor the gated
    branch's final one (100 MB at B16 T2048 and 32 heads, fp32); y and every gradient are the same.
    ``settings``: the kernels' user settings (default ``current_settings()``); ``plan``: tests and
    benchmarks only (``LizardPlan``). Where the one op does not apply, the branches' own ops run
    (each on its kernels where they apply) and a torch combine."""
    settings = resolve_settings(settings)
    fused = lizard_attention_fused(phi_q, phi_k, v, log_g, q_w, k_w, alpha, window=window, sink_logits=sink_logits,
                                   scale=scale, normalize=normalize, log_space_features=log_space_features,
                                   state=state, eps=eps, window_state=window_state, return_state=return_state,
                                   settings=settings, plan=plan)
    if fused is not None:
        return fused
    y_g, g_state = gla_chunk(phi_q, phi_k, v, log_g, normalize=normalize, log_space_features=log_space_features,
                             state=state, chunk_size=chunk_size, eps=eps, settings=settings)
    fused = window_attn_sum(q_w, k_w, v, y_g, alpha, window=window, scale=scale, sink_logits=sink_logits,
                            state=window_state, chunk_size=chunk_size, fresh_state=True, settings=settings)
    if fused is not None:
        y, w_state = fused
        return (y, g_state, w_state) if return_state else (y, None, None)
    H = q_w.shape[1] if q_w.dim() == 4 else None
    if not isinstance(alpha, torch.Tensor) or tuple(alpha.shape) != (H,):
        got = tuple(alpha.shape) if isinstance(alpha, torch.Tensor) else type(alpha).__name__
        raise ValueError(f"alpha must have shape ({H},), got {got}")
    y_w, w_state = _window_chunk_torch(q_w, k_w, v, window=window, scale=scale, sink_logits=sink_logits,
                                       state=window_state, chunk_size=chunk_size)
    y = (y_g + alpha[:, None, None].to(y_g.dtype) * y_w).to(v.dtype)
    return (y, g_state, w_state) if return_state else (y, None, None)


def lizard_attention_fused(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor,
    q_w: torch.Tensor, k_w: torch.Tensor, alpha: torch.Tensor, *, window: int = 128,
    sink_logits: Optional[torch.Tensor] = None, scale: Optional[float] = None, normalize: bool = True,
    log_space_features: bool = False, state: Optional[GLAState] = None, eps: float = 1e-6,
    window_state: Optional[WindowState] = None, return_state: bool = True,
    settings: Optional[KernelSettings] = None, plan: Optional[LizardPlan] = None,
) -> Optional[tuple[torch.Tensor, Optional[GLAState], Optional[WindowState]]]:
    """``lizard_attention`` as its one op on the kernels (``_LizardFunction``: both branches and the
    combine, the passes spread over streams), or None where that op does not apply (``one_op_applies``);
    a caller with its own torch path (``layers.hybrid``) then runs it. Same arguments and result."""
    if not one_op_applies(phi_q, phi_k, v, log_g, q_w, k_w, alpha, sink_logits, state, window_state):
        return None
    return _lizard_one_op(phi_q, phi_k, v, log_g, q_w, k_w, alpha, window=window, sink_logits=sink_logits,
                          scale=scale, normalize=normalize, log_space_features=log_space_features, state=state,
                          eps=eps, window_state=window_state, config=_run_for(resolve_settings(settings), plan),
                          return_state=return_state)


def _lizard_one_op(phi_q, phi_k, v, log_g, q_w, k_w, alpha, *, window, sink_logits, scale, normalize,
                   log_space_features, state, eps, window_state, config,
                   return_state: bool = True) -> tuple[torch.Tensor, Optional[GLAState], Optional[WindowState]]:
    """The checks of both branches, then ``_LizardFunction``."""
    from ..window_attn import triton as kwin
    from ..gla.triton import gla_chunk_checks

    S0, z0 = gla_chunk_checks(phi_q, phi_k, v, log_g, eps, state)  # checks phi_q, phi_k, v too
    B, H = phi_q.shape[:2]
    DV = v.shape[-1]
    common.check_qkv(q_w, k_w, v)
    L = kwin.check_window(window, False)
    kwin.check_sinks(H, q_w.shape[-1], DV, sink_logits, None, None)
    if tuple(alpha.shape) != (H,):
        raise ValueError(f"alpha must have shape ({H},), got {tuple(alpha.shape)}")
    kmin = None
    if window_state is not None:
        common.check_state_tensor("k", window_state.k, (B, H, L, q_w.shape[-1]))
        common.check_state_tensor("v", window_state.v, (B, H, L, DV))
        kwin.check_pos(window_state.pos, B)
        kmin = (-window_state.pos).clamp_min(0).to(torch.int32).contiguous()
    scale = common.softmax_scale(scale, q_w.shape[-1])
    sinks = sink_logits.contiguous() if sink_logits is not None and sink_logits.shape[1] > 0 else None
    phi_q, phi_k, v, q_w, k_w = (unit_last(x) for x in (phi_q, phi_k, v, q_w, k_w))
    dt = common.compute_dtype(q_w, k_w, v, *([sink_logits] if sink_logits is not None else []))
    inference = config.fused_fwd and not _records_grad(phi_q, phi_k, v, log_g, q_w, k_w, alpha, sinks, S0, z0)

    def fused_forward(w_out=None, final_state=True):
        return _fused_forward(phi_q, phi_k, v, log_g, q_w, k_w, alpha, sinks, S0, z0, kmin, normalize,
                              log_space_features, window, scale, eps, config, window_state=w_out,
                              final_state=final_state)

    if inference and not return_state:  # the fused kernel writes y alone
        fused = fused_forward(final_state=False)
        if fused is not None:
            return fused[0], None, None
    kernel_state = inference and return_state and window_state is None and dt == torch.float32 and v.is_cuda
    if kernel_state:
        # the fused kernel writes the window's state from its ring, instead of a copy of the inputs'
        # last keys and values (a little faster: docs/results/lizard-launch-overhead-h100.md)
        w_out = _window_state_buffers(k_w, v, L, dt)
        fused = fused_forward(w_out)
        if fused is not None:
            pos = torch.full((B,), q_w.shape[2], dtype=torch.int64, device=v.device)
            return fused[0], GLAState(fused[1], fused[2]), WindowState(*w_out, pos)
    # otherwise the op returns the window's fresh state too (an output of its own, so that a
    # gradient through it reaches k_w and v), and a given state continues from it
    y, S, z, w_k, w_v = _LizardFunction.apply(
        phi_q, phi_k, v, log_g, q_w, k_w, sinks, alpha.contiguous(), S0, z0, kmin, bool(normalize),
        bool(log_space_features), float(eps), int(window), float(scale), config, torch.is_grad_enabled(), L, dt,
        bool(return_state))
    if not return_state:
        return y, None, None
    T = v.shape[2]
    if window_state is None:
        return y, GLAState(S, z), WindowState(w_k, w_v, torch.full((B,), T, dtype=torch.int64, device=v.device))
    take = min(T, L)
    return y, GLAState(S, z), kwin._continue_state(window_state, w_k[:, :, L - take:], w_v[:, :, L - take:], T, L)


def _window_state_buffers(k_w: torch.Tensor, v: torch.Tensor, L: int, dt: torch.dtype) -> tuple:
    """Empty (B, H, L, .) buffers for the window's fresh state: its keys' and its values'."""
    return tuple(torch.empty(*v.shape[:2], L, x.shape[-1], dtype=dt, device=v.device) for x in (k_w, v))


def _fill_window_state(w_state: tuple[torch.Tensor, torch.Tensor], k_w: torch.Tensor, v: torch.Tensor) -> None:
    """The window's fresh state into its buffers ((B, H, L, .) each): the last L keys and values,
    zeros first where T is shorter (``window._new_state``'s, in place)."""
    T, L = v.shape[2], w_state[0].shape[2]
    take = min(T, L)
    for buf, x in zip(w_state, (k_w, v)):
        buf[:, :, L - take:].copy_(x[:, :, T - take:])
        buf[:, :, :L - take].zero_()


def _records_grad(*xs: Optional[torch.Tensor]) -> bool:
    """Whether autograd records this call for any of xs (then the fused forward, which keeps
    nothing for a backward, must not run)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def _fused_forward(phi_q, phi_k, v, log_g, q_w, k_w, alpha, sinks, S0, z0, kmin, normalize: bool, log_space: bool,
                   window, scale, eps, cfg, store: bool = False, store_og: bool = True, store_ow: bool = True,
                   window_state: Optional[tuple[torch.Tensor, torch.Tensor]] = None, paired_states: bool = False,
                   final_state: bool = True):
    """(y, S_T, z_T, what the backward reads (with ``store``, else None), (segments, their length))
    from ``lizard_gluon.lizard_fwd_fused``, or None where it does not apply (left padding (kmin),
    unnormalised or log-space features, or outside ``lizard_gluon.supports``). ``window_state``:
    buffers the kernel fills with the window's decode state (``lizard_fwd_fused``); ``paired_states``:
    the gated states kept for even chunks only (``lizard_fwd_fused``); ``final_state`` False: no final
    gated state (S_T, z_T None)."""
    if kmin is not None or not normalize or log_space:
        return None
    lizard_gluon = gluon_kernels("lizard_attn.gluon")
    if lizard_gluon is None or not lizard_gluon.supports(phi_q, phi_k, v, log_g, q_w, k_w, window, sinks, S0):
        return None
    from ..backend.dispatch import device_sms

    B, H, T, _ = v.shape
    nseg = 1 if S0 is not None else (cfg.fused_segments or fused_segment_count(B, H, T, device_sms(v)))
    gla_gluon = gluon_kernels("gla.gluon")
    nseg, seg_len = gla_gluon.segment_plan(T, nseg)
    s_in = z_in = None
    if S0 is not None:
        s_in = S0.float().reshape(B * H, 1, *S0.shape[2:]).contiguous()
        z_in = z0.float().reshape(B * H, 1, z0.shape[-1]).contiguous()
    elif nseg > 1:
        s_in, z_in = gla_gluon.segment_states(phi_k, v, log_g, seg_len, nseg, cfg.gla)
    out = lizard_gluon.lizard_fwd_fused(phi_q, phi_k, v, log_g, q_w, k_w, alpha, sinks, window=window, scale=scale,
                                        eps=eps, nseg=nseg, S_in=s_in, z_in=z_in, store=store, store_og=store_og,
                                        store_ow=store_ow, window_state=window_state, paired_states=paired_states,
                                        final_state=final_state)
    return (*out, (nseg, seg_len))
