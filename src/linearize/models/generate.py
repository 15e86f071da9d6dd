"""``generate_text``: prompts in, completions out, for a teacher or a linearized model.

The one generation path of ``linearize generate``, the demo and the passkey evaluation: prompts
are tokenized (optionally through the tokenizer's chat template), batched with left padding, and
completed greedily (``temperature == 0``) or by sampling. A linearized model on CUDA decodes
through ``models.decode.fast_generate`` (static state buffers, a CUDA graph per step) when the
sampling asks nothing it lacks (top-p, top-k); everything else goes through HF's ``generate``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


class EmptyPromptError(ValueError):
    """Some prompts hold no tokens; ``positions`` are their 1-based positions in the list."""

    def __init__(self, positions: list[int]):
        self.positions = positions
        super().__init__(f"prompt {', '.join(map(str, positions))}: empty prompt (no tokens); give some text")


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    """Raise ValueError naming a bad generation setting."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")


def prompt_texts(tokenizer, prompts: Sequence[str], chat: bool) -> tuple[list[str], bool]:
    """The texts to tokenize and whether the tokenizer should add its special tokens: with ``chat``
    each prompt is wrapped in the chat template as a user turn (which holds the special tokens)."""
    if not chat:
        return list(prompts), True
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat: the tokenizer has no chat template")
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts], False


@torch.no_grad()
def generate_text(model, tokenizer, prompts: str | Sequence[str], *, max_new_tokens: int = 64,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                  chat: bool = False, add_special_tokens: bool = True) -> str | list[str]:
    """Complete ``prompts`` (one string, or a list, batched with left padding) and return only the
    new text of each (special tokens dropped): a string for a string, a list for a list.

    Greedy when ``temperature == 0``; otherwise sampled with ``temperature``, ``top_p`` and
    ``top_k`` (0 = off), seeded by ``seed`` when given. ``chat``: wrap each prompt in the
    tokenizer's chat template (an error if it has none). ``add_special_tokens``: for plain prompts,
    whether the tokenizer adds its BOS and the like. Generation stops at the model's EOS (its
    generation config's, else the tokenizer's). The tokenizer is left as it was.
    """
    from transformers import GenerationConfig

    check_sampling(max_new_tokens, temperature, top_p, top_k)
    single = isinstance(prompts, str)
    texts, special = prompt_texts(tokenizer, [prompts] if single else list(prompts), chat)
    special = special and add_special_tokens
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token; cannot batch prompts")

    saved = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=special)
    finally:
        tokenizer.padding_side = saved[0]
        if saved[1] is None:
            tokenizer.pad_token = None
    empty = [i + 1 for i, n in enumerate(batch["attention_mask"].sum(dim=1).tolist()) if n == 0]
    if empty:
        raise EmptyPromptError(empty)
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}

    defaults = model.generation_config
    eos = defaults.eos_token_id if defaults.eos_token_id is not None else tokenizer.eos_token_id
    sample = temperature > 0
    if seed is not None:
        torch.manual_seed(seed)
    if device.type == "cuda" and getattr(model, "linearize_spec", None) is not None \
            and (not sample or (top_p == 1.0 and top_k == 0)):
        from .decode import fast_generate  # static state buffers + a CUDA graph per step

        out = fast_generate(model, batch["input_ids"], batch["attention_mask"], max_new_tokens=max_new_tokens,
                            temperature=temperature, eos_token_id=eos, pad_token_id=pad_id)
    else:
        gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=pad_id,
                               eos_token_id=eos, bos_token_id=defaults.bos_token_id)
        if sample:
            gen.temperature, gen.top_p, gen.top_k = temperature, top_p, top_k
        out = model.generate(**batch, generation_config=gen)
    new = out[:, batch["input_ids"].shape[1]:].cpu()
    completions = [tokenizer.decode(row, skip_special_tokens=True) for row in new]
    return completions[0] if single else completions
