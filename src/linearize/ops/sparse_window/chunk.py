"""Chunked sparse window: ``chunk_size`` queries per span, the state carried between spans.

Each span gathers its own copies of the cached keys and values and a (C, M + w + C) softmax, and
autograd would keep all of them: O(T (M + w) (D + C)) bytes a layer, which outgrows a GPU at
training shapes (a 30-layer model, 8 x 2K rows, M = 256). With gradients on, the spans therefore
run under activation checkpointing: autograd keeps the inputs and recomputes the spans in the
backward pass, one layer at a time (one more forward of this op; the selection is exact, so the
recomputation is the same). The live form's batched torch runs the same way; its kernels keep only
the inputs, the output and the rows' log-sum-exp.

From a fresh state (no state, or ``fresh_state``) the spans can also run all at once (``live``:
each pair's stay in the cache is an interval, found by a scan of rank comparisons), the same outputs
and state with no loop over query spans. ``form`` picks: "spans", "live", or None: live where it
pays, on a GPU (one batch of kernels for the whole input instead of a few dozen small ones a span):
on its kernels at any length, in batched torch up to ``TORCH_LIVE_MAX`` tokens; a CPU loops, where
the batched form is no faster. Where the kernels run, the live form's attention is one Triton kernel
forward and three backward (``triton.py``) and its selection (every pair's interval, each block's
slots) two more, else batched torch.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from .. import common
from ..window_attn.naive import check_softcap
from ..backend.dispatch import kernels_enabled, on_kernel_device
from .live import cache_until, final_state, live_attend, pair_keys
from .naive import SparseWindowState, check_inputs, span_step, stored

# beyond, the live form's batched torch (scores of (T / C) blocks x C x (M + w + 2C)) outgrows the span loop's
TORCH_LIVE_MAX = 16384
FORMS = ("spans", "live")


def run_spans(q, k, v, score, state, sink_logits, sink_k, sink_v, cache_q, leave_k, *, window, scale, softcap,
           chunk_size, dt):
    outs = []
    for s0, s1 in common.chunk_spans(q.shape[2], chunk_size):
        part = lambda x: None if x is None else x[:, :, s0:s1].to(dt)  # noqa: E731
        o, state = span_step(part(q), part(k), part(v), part(score), state, window=window, scale=scale,
                             sink_logits=sink_logits, sink_k=sink_k, sink_v=sink_v, softcap=softcap,
                             cache_q=part(cache_q), leave_k=part(leave_k))
        outs.append(o)
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape, dtype=dt)
    return o, state


def on_gpu(x: torch.Tensor) -> bool:
    """Where the live form is picked by default (tests point it elsewhere)."""
    return x.device.type != "cpu"


def kernel_block(chunk_size: int, dtype: torch.dtype) -> int:
    """The kernels' query block: the chunk size up to a tile an H100's shared memory holds (fp32 64
    rows, 16-bit 128; an fp32 block of 256 asked 213 KB at one stage). The live form is exact for
    any block: it sets only how many queries share one list of cached slots."""
    return min(chunk_size, 64 if dtype == torch.float32 else 128)


def live_kernel_applies(q, k, v, cache_q, leave_k, sink_logits, sink_k, softcap, block: int) -> bool:
    """The live form's Triton kernels (``triton.py``) run where the kernels run (``backend.dispatch``),
    for one float dtype of q, k, v and the cache's q and k, without soft-cap or key/value sinks, in
    query blocks of a power of two >= 16 (a tile's rows) and widths <= 256."""
    xs = [x for x in (q, k, v, cache_q, leave_k) if x is not None]
    extra = [sink_logits] if sink_logits is not None else []
    return (softcap is None and sink_k is None and max(q.shape[-1], v.shape[-1]) <= 256
            and block >= 16 and block & (block - 1) == 0
            and len({x.dtype for x in xs}) == 1 and kernels_enabled() and on_kernel_device(*xs, *extra))


def live_pays(q: torch.Tensor, kernels: bool) -> bool:
    """Where ``form=None`` takes the live form from a fresh state: on a GPU, on its kernels
    (``kernels``: ``live_kernel_applies``) at any length, in batched torch up to ``TORCH_LIVE_MAX``
    tokens."""
    return on_gpu(q) and (q.shape[2] <= TORCH_LIVE_MAX or kernels)


def sparse_window_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score: torch.Tensor, *, window: int, cache_size: int,
    scale: Optional[float] = None, sink_logits: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None, sink_v: Optional[torch.Tensor] = None,
    state: Optional[SparseWindowState] = None, softcap: Optional[float] = None, chunk_size: int = 64,
    recompute: bool = True, cache_q: Optional[torch.Tensor] = None, leave_k: Optional[torch.Tensor] = None,
    fresh_state: bool = False, form: Optional[str] = None,
) -> tuple[torch.Tensor, SparseWindowState]:
    """``recompute``: with gradients on, keep only the inputs and recompute the spans in backward
    (see the module); False keeps every span's tensors (faster backward, far more memory).
    ``fresh_state``: the caller vouches that ``state`` has seen nothing (an empty cache, its window
    before the first position, as ``fresh_state()`` makes it), so the live form may run.
    ``form``: "spans", "live" (needs a fresh state) or None (see the module)."""
    fresh = state is None or fresh_state
    if form is not None and form not in FORMS:
        raise ValueError(f"form must be one of {FORMS} or None, got {form!r}")
    if form == "live" and not fresh:
        raise ValueError("form='live' needs a fresh state: state=None, or fresh_state=True for one that has "
                         "seen nothing")
    dt, state = check_inputs(q, k, v, score, window, cache_size, sink_logits, sink_k, sink_v, state, cache_q, leave_k)
    scale, softcap = common.softmax_scale(scale, q.shape[-1]), check_softcap(softcap)
    grad = recompute and torch.is_grad_enabled()
    kernels = fresh and form != "spans" and live_kernel_applies(q, k, v, cache_q, leave_k, sink_logits, sink_k,
                                                                softcap, chunk_size)
    live = form == "live" or (form is None and fresh and live_pays(q, kernels))
    if live:
        P = max(q.shape[2] - window, 0)
        score = score.to(dt)
        pair_pos = state.pos[:, None] + torch.arange(P, device=q.device)
        if kernels:
            # the kernels read the inputs as they come
            from .triton import cache_until_triton, old_slots_triton, sparse_live_triton

            until = cache_until_triton(score[:, :, window:], pair_pos >= 0, cache_size)
            block = kernel_block(chunk_size, q.dtype)
            slots = old_slots_triton(until, q.shape[2], window, cache_size, block)
            o = sparse_live_triton(q, k, v, q if cache_q is None else cache_q, pair_keys(k, leave_k, window),
                                   sink_logits, until, slots, (-state.pos).clamp_min(0).int(), window=window,
                                   cache_size=cache_size, scale=scale, block=block)
        else:
            until = cache_until(score[:, :, window:], pair_pos >= 0, cache_size)
            cast = lambda x: None if x is None else x.to(dt)  # noqa: E731
            args = (*(cast(x) for x in (q, k, v, cache_q, leave_k)), until, state.pos, sink_logits, sink_k, sink_v)
            kw = dict(window=window, cache_size=cache_size, scale=scale, softcap=softcap, block=chunk_size)
            if grad:
                o = checkpoint(live_attend, *args, use_reentrant=False, preserve_rng_state=False, **kw)
            else:
                o = live_attend(*args, **kw)
        # the state's pairs are copies of the inputs: taken as they come, kept in their dtypes
        new = final_state(k, v, pair_keys(k, leave_k, window), score, until, state, window)
        return o.to(v.dtype), stored(new, k, v, leave_k)
    args = (q, k, v, score, state, sink_logits, sink_k, sink_v, cache_q, leave_k)
    kw = dict(window=window, scale=scale, softcap=softcap, chunk_size=chunk_size, dt=dt)
    if grad:
        # no randomness inside, so no RNG state to save (and none to query while a CUDA graph captures)
        o, new = checkpoint(run_spans, *args, use_reentrant=False, preserve_rng_state=False, **kw)
    else:
        o, new = run_spans(*args, **kw)
    return o.to(v.dtype), stored(new, k, v, leave_k)
