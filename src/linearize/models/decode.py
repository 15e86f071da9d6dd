"""Fast decoding: static state buffers, one fused step per layer, and CUDA-graph replay.

``model.generate`` decodes a converted model through HF's machinery: a Python-side cache object,
fresh state tensors every step, a mask built every step and dozens of tiny kernels per layer. That
is right but slow. ``fast_generate`` keeps the meaning and changes the mechanics:

1. **Prefill** runs the model's own forward (the chunk forms), optionally in pieces.
2. The state each layer ended with is moved into **static buffers** that the decode step updates
   in place: the recurrent state ``S, z`` (fp32) and, for a sliding window, a **ring buffer** of the
   last ``w`` keys/values, kept per KV head in the model's dtype (lossless: the window op's fp32
   cache holds values that came from that dtype, expanded over the query heads of each group).
   Slot ``p mod w`` holds the key of position ``p``; the visibility rule is the window op's.
3. Each **decode step** runs the HF model forward for one token with every linearized attention
   swapped (for that call only) for a step module that reads and writes those buffers. The
   position is a device tensor, the mask a constant, the next token is chosen on the device and
   written into the input buffer: nothing in the step reads a value back to the host.
4. On CUDA the step is **captured once in a CUDA graph** and replayed.

Step modules, from fast to general:
  ``fused``   Lizard-family layers (gated or plain linear global branch with Hedgehog features,
              standard window or none, sink logits or none, no soft-cap) run two Triton kernels per
              layer on CUDA: a "prep" kernel per (row, head) for RoPE, features, the sigmoid gate,
              ``z``, the ring write and the sink-softmax over the window; a "state" kernel per
              (row, head, block of value channels) for ``S = g S + k v^T`` and the readout, which
              reads the state once and writes it once, and the ``y_g + alpha * y_w`` combine
              (the kernels live in ``ops.lizard_attn.decode``; ``ops.lizard_attn.lizard_step_applies``
              says where they run). Elsewhere (CPU, no Triton) the ``torch`` step runs.
  ``torch``   the same layout, through the ops' own in-place torch steps (``ops.gla.gla_step_``,
              ``ops.window_attn.window_ring_step_``; any feature map, gate, sink kind, soft-cap).
  ``generic`` every other method: ``HybridAttention``'s own recurrent step on the static state,
              with the new state copied into the static buffers inside the step.
Models with kept softmax layers decode through HF's cache (eager, no graph). On CUDA, both
decoders also run HF's Llama-style RMSNorms as one Triton kernel each (eight kernels in HF).

``bench.teacher_decode.TeacherDecoder``, the matching baseline for an unconverted model, builds on
``StaticDecoder`` here: a preallocated static KV cache, each step writes its key/value at a device-side slot index and
attends with SDPA over the whole buffer under a validity mask, the query heads of each KV group
laid out as query rows (no repeated K/V is ever materialised), captured in a CUDA graph the same way.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.gates import SigmoidGate
from ..ops.common import gc_paused
from ..ops.gla import gla_step_
from ..ops.lizard_attn import fused_norms_ok, launch_rmsnorm, lizard_step_applies, lizard_step_launcher
from ..ops.window_attn import window_ring_step_
from .adapters import adapter_for
from .cache import StateLayer, iter_tensors

GRAPH_MODES = (True, False, "auto")
KERNELS = ("auto", "triton", "torch")


# ---------------------------------------------------------------------------------- helpers


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def decoder_layers(model: nn.Module):
    adapter = adapter_for(model)
    return adapter, adapter.layers(model)


_LLAMA_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm")
_NORM_ATTRS = ("input_layernorm", "post_attention_layernorm")


def _norm_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every Llama-style RMSNorm around the decoder layers (and the final one)."""
    adapter, layers = decoder_layers(model)
    slots = [(layer, name) for layer in layers for name in _NORM_ATTRS
             if type(getattr(layer, name, None)).__name__ in _LLAMA_NORMS]
    parent = model
    for part in adapter.layers_path.split(".")[:-1]:
        parent = getattr(parent, part)
    if type(getattr(parent, "norm", None)).__name__ in _LLAMA_NORMS:
        slots.append((parent, "norm"))
    return slots


@contextlib.contextmanager
def _swapped_attention(model: nn.Module, modules: dict[int, nn.Module], fuse_norms: bool = False):
    """Replace layer i's attention module with ``modules[i]`` (and, with ``fuse_norms``, each
    Llama-style RMSNorm with the one-kernel version) for the duration of the block."""
    adapter, layers = decoder_layers(model)
    originals = []
    try:
        for i, module in modules.items():
            originals.append((layers[i], adapter.attention_attr, getattr(layers[i], adapter.attention_attr)))
            setattr(layers[i], adapter.attention_attr, module)
        if fuse_norms:
            for parent, name in _norm_slots(model):
                norm = getattr(parent, name)
                originals.append((parent, name, norm))
                setattr(parent, name, _FusedRMSNorm(norm))
        yield
    finally:
        for parent, name, module in reversed(originals):
            setattr(parent, name, module)


class _FusedRMSNorm(nn.Module):
    """HF's Llama RMSNorm (eight kernels) as one Triton kernel, same rounding steps."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        object.__setattr__(self, "norm", norm)

    def forward(self, x):
        return launch_rmsnorm(x, self.norm.weight, self.norm.variance_epsilon)


def _check_graph_mode(use_cuda_graph) -> None:
    if not (use_cuda_graph is True or use_cuda_graph is False or use_cuda_graph == "auto"):
        raise ValueError(f"use_cuda_graph must be True, False or 'auto', got {use_cuda_graph!r}")


def _eos_list(eos) -> list[int]:
    if eos is None:
        return []
    if isinstance(eos, int) and not isinstance(eos, bool):
        return [eos]
    if isinstance(eos, torch.Tensor):
        eos = eos.flatten().tolist()
    try:
        out = [int(e) for e in eos]
    except (TypeError, ValueError):
        raise ValueError(f"eos_token_id must be an int, a list of ints or None, got {eos!r}") from None
    return out


_STREAMS: dict = {}


def _capture_stream(device: torch.device):
    """One side stream per device for every capture: each new stream would get (and keep) its own
    cuBLAS workspace, so capturing on fresh streams leaks memory capture after capture."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device)
    return _STREAMS[key]


def _is_capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def static_sdpa(q, k, v, mask, scale, enable_gqa=False):
    """SDPA restricted to the fused kernels on CUDA (the math backend would upcast and materialise);
    all backends where none of those can run."""
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        except RuntimeError as e:
            if "no available kernel" not in str(e).lower():
                raise
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------------- step modules


def _fast_kind(hybrid) -> str | None:
    """'torch' when the ring-buffer step applies to this layer's config (else None)."""
    c = hybrid.config
    if (c.global_rule not in ("gated", "linear") or c.feature_map not in ("hedgehog", "t2r")
            or c.sparse_cache):
        return None
    if c.local_rule == "none":
        return "torch"
    if c.local_rule == "window" and c.combine == "sum":
        return "torch"
    return None


_ROPE_MODULES = tuple(f"transformers.models.{m}.modeling_{m}" for m in
                      ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"))


def _standard_rope(attn) -> bool:
    """HF's ``q * cos + rotate_half(q) * sin`` (fused into the kernel when cos covers the whole head)."""
    fn = attn.rotary
    return (attn.adapter.rotary is None and getattr(fn, "__name__", "") == "apply_rotary_pos_emb"
            and getattr(fn, "__module__", "") in _ROPE_MODULES)


def _triton_ok(hybrid, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the op says its fused decode step runs this layer (``lizard_step_applies``)."""
    sinks = getattr(hybrid, "sinks", None)
    return lizard_step_applies(device, dtype, feature_map=hybrid.config.feature_map, softcap=hybrid.softcap,
                               sink_kind=sinks.kind if sinks is not None else None)


class StaticLayer(nn.Module):
    """Base for the step modules: holds the wrapped attention without registering it."""

    def __init__(self, attn: nn.Module, decoder):
        super().__init__()
        object.__setattr__(self, "attn", attn)
        object.__setattr__(self, "decoder", decoder)


class _FastStudentAttention(StaticLayer):
    """One linearized layer's decode step on static buffers (ring-buffer window)."""

    def __init__(self, attn, decoder, state: dict, use_triton: bool):
        super().__init__(attn, decoder)
        object.__setattr__(self, "state", state)
        self.use_triton = use_triton
        self.fuse_rope = _standard_rope(attn)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        attn = self.attn
        x = hidden_states
        q, k, v = attn.adapter.project(attn, x, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        cos, sin = position_embeddings
        y = None
        if self.use_triton:
            try:
                y = self._triton(x, q, k, v, cos, sin)
            except Exception as e:  # noqa: BLE001 - a kernel that cannot build here: torch ops in "auto"
                if self.decoder.kernel_request != "auto" or _is_capturing(x):
                    raise
                warnings.warn(f"the fused Triton decode step failed ({type(e).__name__}: {e}); using torch ops")
                self.decoder._drop_triton()
        if y is None:
            q_rope, k_rope = attn.rotary(q, k, cos, sin)
            y = self._torch(x, q, k, v, q_rope, k_rope)
        return attn._output(y, x.dtype), None

    # -- the ops' own torch steps (ops.gla.gla_step_, ops.window_attn.window_ring_step_)
    def _torch(self, x, q, k, v, q_rope, k_rope):
        attn, hy, st = self.attn, self.attn.hybrid, self.state
        c = hy.config
        B, H, _, d = q.shape
        G = H // k.shape[1]
        k_e = _repeat_kv(k, G)
        gq, gk = (q_rope, _repeat_kv(k_rope, G)) if c.rope_global else (q, k_e)
        fq, fk = hy._global_features(gq, gk, x, None)
        S, z = st["S"], st["z"]
        dt = S.dtype
        qt, kt = fq[:, :, 0].to(dt), fk[:, :, 0].to(dt)
        vt = _repeat_kv(v, G)[:, :, 0].to(dt)
        log_g = hy._log_gates(k_e, x, None)[:, :, 0] if c.global_rule == "gated" else None
        y_g = gla_step_(qt, kt, vt, log_g, S, z, eps=1e-6).to(v.dtype).unsqueeze(2)  # (B, H, 1, d)
        if c.local_rule == "none":
            return y_g
        lq, lk = (q_rope, k_rope) if c.rope_window else (q, k)
        sinks = getattr(hy, "sinks", None)
        kv_sinks = sinks is not None and sinks.kind == "kv"
        y_w = window_ring_step_(lq, lk, v, st["ring_k"], st["ring_v"], self.decoder.pos, scale=hy.scale,
                                sink_logits=sinks.logits if sinks is not None and not kv_sinks else None,
                                sink_k=sinks.keys if kv_sinks else None, sink_v=sinks.values if kv_sinks else None,
                                softcap=hy.softcap, dtype=dt)
        return (y_g + hy.alpha[:, None, None].to(y_g.dtype) * y_w).to(v.dtype)

    # -- one fused kernel on CUDA
    def _triton(self, x, q, k, v, cos, sin):
        attn, hy, st = self.attn, self.attn.hybrid, self.state
        c = hy.config
        B, H, _, d = q.shape
        Hkv = k.shape[1]
        G = H // Hkv
        fuse_rope = self.fuse_rope and cos.shape[-1] == d
        if fuse_rope:
            q_rope = k_rope = q
            cos2, sin2 = cos.reshape(B, d).contiguous(), sin.reshape(B, d).contiguous()
        else:
            q_rope, k_rope = attn.rotary(q, k, cos, sin)
            q_rope, k_rope = q_rope.reshape(B, H, d).contiguous(), k_rope.reshape(B, Hkv, d).contiguous()
            cos2 = sin2 = q_rope
        y = torch.empty(B, H, d, dtype=v.dtype, device=v.device)
        x2 = x.reshape(B, -1).contiguous()
        gate_w = gate_b = log_g = y
        if c.global_rule != "gated":
            gate = 0
        elif isinstance(hy.gate, SigmoidGate):
            gate, gate_w, gate_b = 3, hy.gate.weight, hy.gate.bias
        else:
            log_g = hy._log_gates(_repeat_kv(k, G) if c.gate == "pool" else k, x, None)
            gate = 2 if log_g.dim() == 4 else 1
            log_g = log_g.reshape(B, H, -1).float().contiguous()
        has_window = c.local_rule == "window"
        sinks = getattr(hy, "sinks", None)
        ring_k, ring_v = st.get("ring_k", y), st.get("ring_v", y)
        lizard_step_launcher()(
            q.reshape(B, H, d).contiguous(), k.reshape(B, Hkv, d).contiguous(), q_rope, k_rope, cos2, sin2,
            v.reshape(B, Hkv, d).contiguous(), x2, gate_w, gate_b, log_g,
            hy.phi_q.weight, hy.phi_k.weight, st["S"], st["z"], ring_k, ring_v, self.decoder.pos,
            sinks.logits if sinks is not None else y, hy.alpha if has_window else y, y,
            scale=hy.scale if hy.scale is not None else d ** -0.5, eps=1e-6, H=H, G=G, D=d,
            F2=hy.phi_q.weight.shape[-1], W=ring_k.shape[2] if has_window else 1,
            M=sinks.logits.shape[1] if sinks is not None else 0, HID=x2.shape[1], gate=gate,
            fuse_rope=fuse_rope,
            rope_global=c.rope_global, rope_window=c.rope_window, has_window=has_window, has_sinks=sinks is not None)
        return y.unsqueeze(2)


class _GenericStudentAttention(StaticLayer):
    """``HybridAttention``'s own recurrent step on a static state, copied back in place."""

    def __init__(self, attn, decoder, state: dict):
        super().__init__(attn, decoder)
        object.__setattr__(self, "state", state)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        attn = self.attn
        q, k, v, q_rope, k_rope, q_far = attn.heads(hidden_states, position_embeddings)
        y, new = attn.hybrid(q, k, v, q_rope, k_rope, hidden_states, self.state, None, q_far=q_far)
        old_flat, new_flat = list(iter_tensors(self.state)), list(iter_tensors(new))
        if len(old_flat) != len(new_flat):
            raise RuntimeError("the layer's state changed structure during decoding")
        for dst, src in zip(old_flat, new_flat):
            if src is dst:
                continue
            if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
                src = src.clone()  # a view of the buffer itself: copy out first
            dst.copy_(src)
        return attn._output(y, hidden_states.dtype), None


class StaticDecoder:
    """Static token/position buffers and the step that feeds the model one token per sequence."""

    def __init__(self, model: nn.Module, batch_size: int, max_steps: int, *, temperature: float = 0.0,
                 eos_token_id=None, pad_token_id: int | None = 0, device=None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps <= 0:
            raise ValueError(f"max_steps must be a positive int, got {max_steps!r}")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
        self.model = model
        self.adapter = adapter_for(model)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.batch_size, self.max_steps, self.temperature = batch_size, max_steps, float(temperature)
        eos = _eos_list(eos_token_id)
        if eos and pad_token_id is None:
            pad_token_id = eos[0]
        self.pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        dev, B = self.device, batch_size
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, dtype=torch.long, device=dev)  # position of the token in self.ids
        self.mask4d = torch.ones(B, 1, 1, 1, dtype=torch.bool, device=dev)  # a constant: layers here ignore it
        self.eos = torch.tensor(eos, dtype=torch.long, device=dev) if eos else None
        self.unfinished = torch.ones(B, dtype=torch.bool, device=dev)
        self.out = torch.zeros(B, max_steps, dtype=torch.long, device=dev)
        self.n_out = torch.zeros(1, dtype=torch.long, device=dev)
        self.graph = None
        self.mode = "eager"
        self.steps_done = 0  # host-side count of tokens written into self.out
        # one-kernel RMSNorms on CUDA (both decoders alike, so timings compare the attention)
        self.fuse_norms = fused_norms_ok(self.device) and bool(_norm_slots(model))

    # -- subclasses
    def _modules(self) -> dict[int, nn.Module]:
        raise NotImplementedError

    def _advance(self) -> None:
        """Device-side bookkeeping after a step (beyond ids/pos)."""

    # -- the step
    def _select(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.temperature == 0:
            return logits.argmax(-1)
        # sampling by the exponential race: argmax p_i / E_i ~ Categorical(p), no host sync
        probs = torch.softmax(logits / self.temperature, dim=-1)
        return (probs / torch.empty_like(probs).exponential_()).argmax(-1)

    def _push(self, nxt: torch.Tensor) -> None:
        """Record a chosen token (B,), finishing rows that hit EOS, and feed it as the next input."""
        if self.eos is not None:
            nxt = torch.where(self.unfinished, nxt, torch.full_like(nxt, self.pad_token_id))
            self.unfinished &= ~(nxt[:, None] == self.eos[None, :]).any(-1)
        self.out.index_copy_(1, self.n_out, nxt[:, None])
        self.n_out.add_(1)
        self.ids.copy_(nxt[:, None])

    def _step_body(self) -> None:
        with _swapped_attention(self.model, self._modules(), self.fuse_norms):
            out = self.model(input_ids=self.ids, position_ids=self.pos[:, None], attention_mask=self.mask4d,
                             use_cache=False)
        self._push(self._select(out.logits[:, -1]))
        self.pos.add_(1)
        self._advance()

    @torch.no_grad()
    def step(self) -> None:
        """One decode step: feed ``ids`` at ``pos``, choose the next token (graph replay when captured)."""
        if self.steps_done >= self.max_steps:
            raise RuntimeError(f"the decoder's token buffer is full ({self.max_steps} tokens)")
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step_body()
        self.steps_done += 1

    @torch.no_grad()
    def capture(self) -> None:
        """Run one real step eagerly on a side stream (warm-up: kernel compilation, library
        handles), then capture the next step in a CUDA graph; later ``step`` calls replay it."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this decoder is on {self.device}")
        if self.graph is not None:
            return
        stream = _capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with gc_paused(), torch.cuda.graph(graph, stream=stream):
            self._step_body()
        self.graph, self.mode = graph, "cuda_graph"

    def release(self) -> None:
        self.graph = None

    def tokens(self) -> torch.Tensor:
        """The tokens chosen so far, (B, n)."""
        return self.out[:, :self.steps_done]

    def all_finished(self) -> bool:
        return self.eos is not None and not bool(self.unfinished.any())

    def start(self, first: torch.Tensor, pos: torch.Tensor) -> None:
        """Seed the step: ``first`` (B,) the token chosen from the prefill, ``pos`` (B,) its position."""
        self._push(first.to(self.device).long())
        self.pos.copy_(pos)
        self.steps_done += 1


class StudentDecoder(StaticDecoder):
    """Decode a converted model (every attention layer linearized) from static state buffers.

    ``kernel``: "auto" (the fused Triton step where the layer config and device allow it, else
    torch ops), "triton" (required; an error where it cannot run) or "torch".
    """

    def __init__(self, model, batch_size: int, max_steps: int, *, kernel: str = "auto", **kwargs):
        super().__init__(model, batch_size, max_steps, **kwargs)
        if getattr(model, "linearize_spec", None) is None:
            raise ValueError("StudentDecoder needs a converted model (linearize.convert); got an unconverted one")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        from .attention import LinearizedAttention

        adapter, layers = decoder_layers(model)
        attns = [getattr(layer, adapter.attention_attr) for layer in layers]
        kept = [i for i, a in enumerate(attns) if not isinstance(a, LinearizedAttention)]
        if kept:
            raise ValueError(f"layers {kept} are kept softmax attention; StudentDecoder needs every layer "
                             "linearized (fast_generate decodes such models through HF's cache)")
        self.attns = attns
        self.kernel_request = kernel
        self.kinds = []
        for a in attns:
            kind = _fast_kind(a.hybrid) or "generic"
            if (kind == "torch" and kernel != "torch"
                    and (kernel == "triton" or os.environ.get("LINEARIZE_DECODE_KERNEL", "auto") != "torch")
                    and _triton_ok(a.hybrid, self.device, self.dtype)):
                kind = "fused"
            if kernel == "triton" and kind != "fused":
                raise ValueError(f"kernel='triton': layer {a.layer_idx} cannot use the fused Triton step "
                                 f"(device {self.device}, method config {a.hybrid.config}); use kernel='auto'")
            self.kinds.append(kind)
        self.states: list[dict] | None = None
        self._mods: dict[int, nn.Module] | None = None

    def _drop_triton(self) -> None:
        self.kinds = ["torch" if k == "fused" else k for k in self.kinds]
        for m in (self._mods or {}).values():
            if isinstance(m, _FastStudentAttention):
                m.use_triton = False

    @property
    def kernel(self) -> str:
        kinds = sorted(set(self.kinds))
        return kinds[0] if len(kinds) == 1 else "+".join(kinds)

    def _modules(self):
        if self._mods is None:
            if self.states is None:
                raise RuntimeError("no state loaded: call prefill() or load_synthetic() first")
            mods = {}
            for i, (a, kind, st) in enumerate(zip(self.attns, self.kinds, self.states)):
                if kind == "generic":
                    mods[i] = _GenericStudentAttention(a, self, st)
                else:
                    mods[i] = _FastStudentAttention(a, self, st, use_triton=kind == "fused")
            self._mods = mods
        return self._mods

    # -- state
    def _fast_state_from(self, attn, state: dict) -> dict:
        c = attn.hybrid.config
        S, z = state["global"]
        out = {"S": S.clone().contiguous(), "z": z.clone().contiguous()}
        if c.local_rule == "window":
            k, v, pos = state["local"]
            B, H, L, d = k.shape
            G = H // attn.num_kv_heads
            w = c.window
            ring_k = torch.zeros(B, attn.num_kv_heads, w, d, dtype=self.dtype, device=k.device)
            ring_v = torch.zeros_like(ring_k)
            if L:
                idx = torch.remainder(pos[:, None] - L + torch.arange(L, device=k.device), w)
                idx = idx[:, None, :, None].expand(B, attn.num_kv_heads, L, d)
                ring_k.scatter_(2, idx, k[:, ::G].to(self.dtype))
                ring_v.scatter_(2, idx, v[:, ::G].to(self.dtype))
            out["ring_k"], out["ring_v"] = ring_k, ring_v
        return out

    def load_states(self, states: list[dict], pos: torch.Tensor) -> None:
        """Take the layers' op states after a prefill (``StateLayer.state`` of each layer)."""
        loaded = []
        for a, kind, st in zip(self.attns, self.kinds, states):
            if kind == "generic":
                loaded.append(_clone_state(st))
            else:
                loaded.append(self._fast_state_from(a, st))
        self.states, self._mods, self.graph, self.mode = loaded, None, None, "eager"
        self.pos.copy_(pos)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                chunk_size: int | None = None) -> torch.Tensor:
        """Run the prompt through the model's chunk forms; load the state; returns the last logits (B, V)."""
        logits, cache, pos = prefill_model(self.model, input_ids, attention_mask, chunk_size)
        states = []
        for i, layer in enumerate(cache.layers):
            if not isinstance(layer, StateLayer):
                raise ValueError(f"layer {i} left a key/value cache: not a fully linearized model")
            states.append(layer.state)
        self.load_states(states, pos)
        return logits

    @torch.no_grad()
    def load_synthetic(self, context: int, seed: int = 0) -> None:
        """Random state of a model that has seen ``context`` tokens (for timing: decode cost does
        not depend on the values, only on the sizes, which are those a real prefill leaves)."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        B, states = self.batch_size, []
        for a, kind in zip(self.attns, self.kinds):
            hy = a.hybrid
            c = hy.config
            if kind == "generic":
                raise ValueError(f"load_synthetic supports the ring-buffer step only; layer {a.layer_idx} "
                                 f"({c.global_rule}/{c.local_rule}/{c.combine}) uses the generic step")
            Fd = c.feature_dim or a.head_dim
            sdt = torch.float64 if self.dtype == torch.float64 else torch.float32
            st = {"S": torch.rand(B, a.num_heads, Fd, a.head_dim, generator=gen, device=self.device, dtype=sdt) * 1e-2,
                  "z": torch.rand(B, a.num_heads, Fd, generator=gen, device=self.device, dtype=sdt) + 1.0}
            if c.local_rule == "window":
                shape = (B, a.num_kv_heads, c.window, a.head_dim)
                st["ring_k"] = torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype)
                st["ring_v"] = torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype)
            states.append(st)
        self.states, self._mods, self.graph, self.mode = states, None, None, "eager"
        self.pos.fill_(int(context))
        self.ids.random_(0, int(self.model.config.vocab_size), generator=gen)

    def state_bytes(self) -> int:
        return nbytes(t for st in (self.states or []) for t in iter_tensors(st)) + nbytes([self.pos])

    def step_bytes(self) -> int:
        """Bytes of state one step must move at least: S and z read and written, the ring read."""
        total = 0
        for st in self.states or []:
            total += 2 * nbytes([st["S"], st["z"]]) if "S" in st else 2 * nbytes(iter_tensors(st))
            total += nbytes([st[k] for k in ("ring_k", "ring_v") if k in st])
        return total


def _clone_state(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone_state(v) for k, v in state.items()}
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(_clone_state(v) for v in state))
    if isinstance(state, (tuple, list)):
        return type(state)(_clone_state(v) for v in state)
    return state


def prefill_model(model, input_ids, attention_mask, chunk_size):
    """The model's own forward over the prompt (in pieces of ``chunk_size``): (last logits, cache, next positions)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a 2-D LongTensor (B, T), got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} of shape {tuple(getattr(input_ids, 'shape', ()))}")
    B, T = input_ids.shape
    if T == 0:
        raise ValueError("input_ids has no tokens; give at least one prompt token")
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"attention_mask must have the shape of input_ids {(B, T)}, got {tuple(attention_mask.shape)}")
        empty = (attention_mask.sum(-1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"rows {empty} of attention_mask have no tokens")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    position_ids = mask.cumsum(-1) - 1
    position_ids = position_ids.masked_fill(mask == 0, 1)  # as HF generate does
    step = chunk_size or T
    cache, logits = None, None
    for s in range(0, T, step):
        e = min(s + step, T)
        out = model(input_ids=input_ids[:, s:e], attention_mask=mask[:, :e] if attention_mask is not None else None,
                    position_ids=position_ids[:, s:e], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache, logits = out.past_key_values, out.logits[:, -1]
    return logits, cache, mask.sum(-1)


# ---------------------------------------------------------------------------------- fast_generate


def _all_linearized(model) -> bool:
    from .attention import LinearizedAttention

    adapter, layers = decoder_layers(model)
    return all(isinstance(getattr(layer, adapter.attention_attr), LinearizedAttention) for layer in layers)


@torch.no_grad()
def fast_generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  max_new_tokens: int = 32, temperature: float = 0.0, eos_token_id=None,
                  pad_token_id: int | None = None, use_cuda_graph="auto", kernel: str = "auto",
                  prefill_chunk_size: int | None = None) -> torch.LongTensor:
    """Generate from a converted model: ``(B, T + n)`` tokens, prompt included, like ``model.generate``.

    Greedy when ``temperature == 0`` (the default): token for token what
    ``model.generate(input_ids, attention_mask=..., do_sample=False, max_new_tokens=...)`` returns
    (no logits processors: no repetition penalty, no min length). ``temperature > 0`` samples from
    softmax(logits / temperature) (no top-k/top-p). ``eos_token_id`` None means the model's
    ``generation_config.eos_token_id``; pass ``[]`` to never stop. Rows that finished get
    ``pad_token_id`` (default: the generation config's, else the first EOS id), and generation
    stops once every row has finished. ``attention_mask`` marks left padding.

    ``use_cuda_graph``: "auto" captures the decode step in a CUDA graph on CUDA when every layer is
    linearized (falling back to eager steps, with a warning, if capture fails); True requires it;
    False never. ``kernel``: see ``StudentDecoder``. ``prefill_chunk_size`` prefills in pieces
    (bounded activation memory for long prompts; same result).
    """
    if getattr(model, "linearize_spec", None) is None:
        raise ValueError("fast_generate needs a converted model (linearize.convert or a linearize checkpoint)")
    _check_graph_mode(use_cuda_graph)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    gen = getattr(model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(gen, "eos_token_id", None)
    eos = _eos_list(eos_token_id)
    if pad_token_id is None:
        pad_token_id = getattr(gen, "pad_token_id", None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a 2-D LongTensor (B, T), got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} of shape {tuple(getattr(input_ids, 'shape', ()))}")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
    B = input_ids.shape[0]

    if not _all_linearized(model):
        if use_cuda_graph is True:
            raise ValueError("use_cuda_graph=True needs every layer linearized; this model keeps softmax layers")
        return _hf_loop(model, input_ids, attention_mask, max_new_tokens, temperature, eos, pad_token_id,
                        prefill_chunk_size)

    dec = StudentDecoder(model, B, max_new_tokens, kernel=kernel, temperature=temperature,
                         eos_token_id=eos, pad_token_id=pad_token_id, device=device)
    logits = dec.prefill(input_ids, attention_mask, prefill_chunk_size)
    dec.start(dec._select(logits), dec.pos)
    want_graph = use_cuda_graph is True or (use_cuda_graph == "auto" and device.type == "cuda")
    if use_cuda_graph is True and device.type != "cuda":
        raise ValueError(f"use_cuda_graph=True needs a CUDA device; the model is on {device}")
    check_every = 16
    try:
        while dec.steps_done < max_new_tokens:
            if eos and dec.steps_done % check_every == 0 and dec.all_finished():
                break
            if want_graph and dec.graph is None and dec.steps_done + 1 < max_new_tokens:
                try:
                    dec.capture()  # runs one real step eagerly, then captures
                    continue
                except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager
                    if use_cuda_graph is True:
                        raise
                    warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly")
                    want_graph = False
                    dec.graph = None
                    if dec.steps_done >= max_new_tokens:
                        break
            dec.step()
        new = dec.tokens()
    finally:
        dec.release()  # now, not whenever the collector finds the decoder: see ops.common.gc_paused
    return torch.cat([input_ids, _cut_after_all_finished(new, eos)], dim=1)


def _cut_after_all_finished(new: torch.Tensor, eos: list[int]) -> torch.Tensor:
    """HF stops once every row has produced EOS: keep the tokens up to that step."""
    if not eos or new.shape[1] == 0:
        return new
    hit = torch.zeros_like(new, dtype=torch.bool)
    for e in eos:
        hit |= new == e
    if not bool(hit.any(-1).all()):
        return new
    first = hit.float().argmax(-1)  # first EOS per row
    return new[:, :int(first.max()) + 1]


def _hf_loop(model, input_ids, attention_mask, max_new_tokens, temperature, eos, pad_token_id, chunk_size):
    """Models with kept softmax layers: HF's cache, one eager step at a time."""
    B = input_ids.shape[0]
    dec = StaticDecoder(model, B, max_new_tokens, temperature=temperature, eos_token_id=eos,
                         pad_token_id=pad_token_id, device=input_ids.device)
    logits, cache, pos = prefill_model(model, input_ids, attention_mask, chunk_size)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    dec.start(dec._select(logits), pos)
    while dec.steps_done < max_new_tokens and not dec.all_finished():
        mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
        out = model(input_ids=dec.ids, attention_mask=mask, position_ids=dec.pos[:, None],
                    past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        dec._push(dec._select(out.logits[:, -1]))
        dec.pos.add_(1)
        dec.steps_done += 1
    return torch.cat([input_ids, _cut_after_all_finished(dec.tokens(), eos)], dim=1)
