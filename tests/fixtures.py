"""Tiny random causal LMs, one per supported architecture, for conversion tests.

Every builder returns a fresh fp32 model in eval mode, built from transformers' own config
classes with a fixed seed: hidden 64, 4 heads, 2 KV heads (GQA), head_dim 16, vocab 128,
max_position_embeddings 8192 (long enough for the 4,096-token cache test). Only config fields
that transformers 5.17 also knows are used.
"""

from __future__ import annotations

import torch

VOCAB = 128
SLIDING_WINDOW = 8  # small, so native sliding layers actually slide in short tests

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,  # random models would stop at random; tests compare fixed-length continuations
    tie_word_embeddings=False,
    initializer_range=0.2,  # HF's 0.02 gives near-uniform attention, which hides position bugs
)


def _build(config_cls, model_cls, seed: int = 0, num_layers: int = 2, **kwargs):
    config = config_cls(num_hidden_layers=num_layers, **{**_COMMON, **kwargs})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _spread_norms(model, seed)
    return model


def _spread_norms(model, seed: int) -> None:
    """Give norm weights random values: the default ones (or zeros for Gemma's 1 + w) would hide
    a q_norm/k_norm applied in the wrong place."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5 - (1.0 if _zero_centred(model) else 0.0))


def _zero_centred(model) -> bool:
    return model.config.model_type.startswith("gemma")


def llama(seed: int = 0, num_layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM
    return _build(LlamaConfig, LlamaForCausalLM, seed, num_layers, head_dim=16)


def llama3(seed: int = 0, num_layers: int = 2):
    """Llama-3 shape: GQA and the "llama3" RoPE frequency scaling."""
    from transformers import LlamaConfig, LlamaForCausalLM
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    return _build(LlamaConfig, LlamaForCausalLM, seed, num_layers, head_dim=16, rope_parameters=rope)


def mistral(seed: int = 0, num_layers: int = 2):
    from transformers import MistralConfig, MistralForCausalLM
    return _build(MistralConfig, MistralForCausalLM, seed, num_layers, head_dim=16, sliding_window=SLIDING_WINDOW)


def qwen2(seed: int = 0, num_layers: int = 2):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    model = _build(Qwen2Config, Qwen2ForCausalLM, seed, num_layers)
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2 has q/k/v bias
    return model


def qwen3(seed: int = 0, num_layers: int = 2):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return _build(Qwen3Config, Qwen3ForCausalLM, seed, num_layers, head_dim=16)


def phi3(seed: int = 0, num_layers: int = 2, partial_rotary_factor: float = 1.0):
    from transformers import Phi3Config, Phi3ForCausalLM
    kwargs = {"partial_rotary_factor": partial_rotary_factor} if partial_rotary_factor != 1.0 else {}
    model = _build(Phi3Config, Phi3ForCausalLM, seed, num_layers, sliding_window=None, **kwargs)
    if partial_rotary_factor != 1.0:
        inv_freq = model.model.rotary_emb.inv_freq
        assert inv_freq.numel() * 2 == int(16 * partial_rotary_factor), "partial rotary not in effect"
    return model


def phi3_partial(seed: int = 0, num_layers: int = 2):
    return phi3(seed, num_layers, partial_rotary_factor=0.5)


def gemma2(seed: int = 0, num_layers: int = 2):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    types = ["sliding_attention", "full_attention"] * ((num_layers + 1) // 2)
    return _build(Gemma2Config, Gemma2ForCausalLM, seed, num_layers, head_dim=16,
                  sliding_window=SLIDING_WINDOW, layer_types=types[:num_layers],
                  attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=32)


def gemma3(seed: int = 0, num_layers: int = 2):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    types = ["sliding_attention", "full_attention"] * ((num_layers + 1) // 2)
    return _build(Gemma3TextConfig, Gemma3ForCausalLM, seed, num_layers, head_dim=16,
                  sliding_window=SLIDING_WINDOW, layer_types=types[:num_layers], query_pre_attn_scalar=32)  # scale != head_dim ** -0.5


def gemma3_5to1(seed: int = 0, num_layers: int = 6):
    """Gemma 3's own pattern: five sliding-window layers, then one global layer, each kind with its
    RoPE base (10K local, 1M global, as in the released models)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    types = (["sliding_attention"] * 5 + ["full_attention"]) * ((num_layers + 5) // 6)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}
    return _build(Gemma3TextConfig, Gemma3ForCausalLM, seed, num_layers, head_dim=16, sliding_window=SLIDING_WINDOW,
                  layer_types=types[:num_layers], query_pre_attn_scalar=32, rope_parameters=rope)


def gpt2(seed: int = 0):
    """An architecture linearize does not support."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


ARCHS = {
    "llama": llama,
    "llama3": llama3,
    "mistral": mistral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "phi3": phi3,
    "phi3_partial": phi3_partial,
    "gemma2": gemma2,
    "gemma3": gemma3,
}


def tiny_model_dir(directory, num_layers: int = 2, seed: int = 0):
    """A tiny random Llama saved with the bundled SmolLM2 tokenizer (vocab 49,152), so end-to-end
    runs (data -> training -> checkpoint -> CLI) take seconds: ``load_teacher(str(directory))``
    opens it like any local model."""
    from pathlib import Path

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from linearize.models.teacher import resolve_teacher_path

    directory = Path(directory)
    tokenizer = AutoTokenizer.from_pretrained(resolve_teacher_path("smollm2-135m"))
    config = LlamaConfig(num_hidden_layers=num_layers, **{**_COMMON, "vocab_size": len(tokenizer),
                                                         "pad_token_id": tokenizer.pad_token_id,
                                                         "eos_token_id": tokenizer.eos_token_id,
                                                         "initializer_range": 0.02}, head_dim=16)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_student_dir(directory, teacher_dir, seed: int = 0):
    """An untrained Lizard conversion (window 8) of the model in ``teacher_dir``, its new modules moved
    away from their initialisation (so that a load must read them), saved to ``directory``: a stand-in
    for a bundled student. Returns the model, in eval mode."""
    import linearize

    model, _ = linearize.load_teacher(str(teacher_dir))
    linearize.convert(model, "lizard", window=8)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".hybrid." in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    linearize.save(model, directory)
    return model.eval()
