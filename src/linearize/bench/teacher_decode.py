"""A static-cache decoder for an unconverted (softmax) teacher, used by ``linearize bench generate``
to time the teacher beside its linearized student on the same static buffers and CUDA graphs.

It lives with the bench: the library's own decoding (``models.decode``) never runs a teacher.
"""

from __future__ import annotations

import torch

from ..models.decode import StaticDecoder, StaticLayer, decoder_layers, nbytes, prefill_model, static_sdpa


class _TeacherAttention(StaticLayer):
    """Softmax attention over a preallocated KV cache: write at the slot index, attend under a mask."""

    def __init__(self, attn, decoder, k_cache: torch.Tensor, v_cache: torch.Tensor, config):
        super().__init__(attn, decoder)
        object.__setattr__(self, "k_cache", k_cache)
        object.__setattr__(self, "v_cache", v_cache)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = k_cache.shape[-1]
        object.__setattr__(self, "rotary", decoder.adapter.rotary_fn(attn))

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        attn, dec = self.attn, self.decoder
        B = hidden_states.shape[0]
        H, Hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = dec.adapter.project(attn, hidden_states, H, Hkv, d)
        cos, sin = position_embeddings
        q, k = self.rotary(q, k, cos, sin)
        self.k_cache.index_copy_(2, dec.slot, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, dec.slot, v.to(self.v_cache.dtype))
        if dec.attention == "sliced":  # eager only: the filled slots, no mask (flash), GQA in the kernel
            n = dec.host_slot + 1
            y = static_sdpa(q, self.k_cache[:, :, :n], self.v_cache[:, :, :n], None, attn.scaling, enable_gqa=H != Hkv)
        else:
            G = H // Hkv
            qg = q.reshape(B, Hkv, G, d)  # the G query heads of a KV head as G query rows
            y = static_sdpa(qg, self.k_cache, self.v_cache, dec.valid[:, None, None, :], attn.scaling)
        y = y.reshape(B, 1, H * d)
        return attn.o_proj(y), None


# ---------------------------------------------------------------------------------- decoders


class TeacherDecoder(StaticDecoder):
    """Decode an unconverted model from a preallocated KV cache of ``max_len`` slots per layer.

    All rows share one slot index (the number of tokens fed so far); left padding is kept out by
    a per-row validity mask; RoPE positions are per row. Full-attention models only (no sliding
    window, no soft-capping, no kept state layers).

    ``attention``: "masked" (SDPA over the whole buffer under the validity mask, the query heads
    of a KV group as query rows; capturable in a CUDA graph) or "sliced" (SDPA over the filled
    slots only, no mask, so flash attention with GQA can run; the length is a host-side count, so
    eager only, and every row must be unpadded).
    """

    def __init__(self, model, batch_size: int, max_steps: int, max_len: int, *, attention: str = "masked",
                 **kwargs):
        super().__init__(model, batch_size, max_steps, **kwargs)
        self.attention = attention
        if attention not in ("masked", "sliced"):
            raise ValueError(f"attention must be 'masked' or 'sliced', got {attention!r}")
        if getattr(model, "linearize_spec", None) is not None:
            raise ValueError("TeacherDecoder decodes an unconverted model; this one is converted")
        cfg = model.config
        if getattr(cfg, "sliding_window", None) is not None or getattr(cfg, "attn_logit_softcapping", None):
            raise ValueError("TeacherDecoder supports full causal attention only (no sliding window, no soft-cap)")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len <= 0:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        _, layers = decoder_layers(model)
        attn0 = getattr(layers[0], self.adapter.attention_attr)
        H = cfg.num_attention_heads
        Hkv = getattr(cfg, "num_key_value_heads", None) or H
        d = getattr(attn0, "head_dim", cfg.hidden_size // H)
        self.max_len = max_len = -(-max_len // 16) * 16  # SDPA kernels like aligned mask rows
        shape = (batch_size, Hkv, max_len, d)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers]
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=self.device)
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)
        self.host_slot = 0  # the same count on the host, for "sliced" attention
        self.padded = False
        self._mods = {i: _TeacherAttention(getattr(layer, self.adapter.attention_attr), self, kc, vc, cfg)
                      for i, (layer, kc, vc) in enumerate(zip(layers, self.k_cache, self.v_cache))}

    def _modules(self):
        return self._mods

    def _advance(self) -> None:
        self.slot.add_(1)
        self.host_slot += 1

    def _step_body(self) -> None:
        if self.attention == "sliced" and self.padded:
            raise ValueError("attention='sliced' needs unpadded rows (it attends to every filled slot)")
        self.valid.index_fill_(1, self.slot, True)  # the token fed now is visible to itself
        StaticDecoder._step_body(self)

    @torch.no_grad()
    def capture(self) -> None:
        if self.attention != "masked":
            raise ValueError("only attention='masked' can be captured in a CUDA graph (sliced shapes change every step)")
        super().capture()

    @torch.no_grad()
    def prefill(self, input_ids, attention_mask=None, chunk_size=None) -> torch.Tensor:
        logits, cache, pos = prefill_model(self.model, input_ids, attention_mask, chunk_size)
        T = input_ids.shape[1]
        if T + self.max_steps > self.max_len:
            raise ValueError(f"prompt ({T}) + steps ({self.max_steps}) exceed the cache ({self.max_len} slots)")
        for layer, kc, vc in zip(cache.layers, self.k_cache, self.v_cache):
            kc[:, :, :T].copy_(layer.keys)
            vc[:, :, :T].copy_(layer.values)
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        self.valid.zero_()
        self.valid[:, :T] = mask.to(self.device)
        self.padded = not bool(mask.all())
        self.slot.fill_(T)
        self.host_slot = T
        self.pos.copy_(pos)
        self.graph, self.mode = None, "eager"
        return logits

    @torch.no_grad()
    def load_synthetic(self, context: int, seed: int = 0) -> None:
        """Random keys/values for ``context`` tokens in every row (timing only)."""
        if context + self.max_steps > self.max_len:
            raise ValueError(f"context ({context}) + steps ({self.max_steps}) exceed the cache ({self.max_len} slots)")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for kc, vc in zip(self.k_cache, self.v_cache):
            kc.normal_(generator=gen)
            vc.normal_(generator=gen)
        self.valid.zero_()
        self.valid[:, :context] = True
        self.padded = False
        self.slot.fill_(int(context))
        self.host_slot = int(context)
        self.pos.fill_(int(context))
        self.ids.random_(0, int(self.model.config.vocab_size), generator=gen)
        self.graph, self.mode = None, "eager"

    def cache_bytes(self) -> int:
        return nbytes(self.k_cache) + nbytes(self.v_cache) + nbytes([self.valid])

    def context_cache_bytes(self, context: int) -> int:
        """Bytes of keys and values for ``context`` tokens (what a cache of exactly that length holds)."""
        per_slot = sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache) // self.max_len
        return per_slot * int(context)
