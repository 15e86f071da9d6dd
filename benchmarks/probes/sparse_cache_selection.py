"""Does LoLA's sparse cache hold what the question needs? For a student with the cache, the classic
pass key (or, with --haystack, a needle in natural text among distractors) at one length: after the
prompt's prefill, the share of the answer's tokens each (layer, head) holds in its cache, and the
tokens the caches hold most. Splits a miss into "not selected" (the score rule) and "selected but
not read" (the student).

    PYTHONPATH=src python3 benchmarks/probes/sparse_cache_selection.py STUDENT [--cache 256]
        [--length 2048] [--depths 0.1,0.5] [--score relative|error] [--haystack BOOKS --kind number]
        [--teacher-far W] [--surprise] [--window W]

--teacher-far W: STUDENT names a teacher instead; each head "keeps" the --cache keys that the
teacher's queries more than W tokens later attend to most (the question's last 40 tokens left out):
how well a rule trained on the teacher's attention beyond the window could do.

--surprise: each head keeps the --cache pairs (of those that left the window) whose tokens the model
predicted worst, by its own next-token loss on the prompt: a score that marks numbers and names
before any question comes.

STUDENT is a checkpoint folder or a bundled student's name; the cache is set to ``--cache`` pairs
scored by ``--score`` (``checkpoint.load(overrides=...)``, no training), replacing any it has.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter

import torch


def cached_positions(cache) -> list[torch.Tensor]:
    """Per layer: the cached positions (B, H, M) of a prefilled cache (-1: an empty slot)."""
    return [layer.state["local"].cache_pos for layer in cache.layers]


def key_share(positions: list[torch.Tensor], key: list[int]) -> torch.Tensor:
    """(layers, H): the share of the ``key`` positions each head of row 0 holds."""
    wanted = torch.tensor(key)
    return torch.stack([(p[0][:, :, None] == wanted).any(1).float().mean(-1) for p in positions])


def far_attention_positions(model, ids: list[int], size: int, window: int, queries_end: int) -> list[torch.Tensor]:
    """Per layer: (1, H, size) the keys with the most attention from queries more than ``window``
    tokens after them and before ``queries_end`` (eager attention, row 0)."""
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        attentions = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    t = torch.arange(len(ids))
    far = (t[:, None] > t[None, :] + window) & (t[:, None] < queries_end)  # (query, key)
    return [(a[0] * far).sum(1).topk(size, dim=-1).indices[None] for a in attentions]


def surprise_positions(model, ids: list[int], size: int, window: int, layers: int) -> list[torch.Tensor]:
    """Per layer: (1, 1, size) the positions s <= T - 1 - window whose token had the largest next-token
    loss under ``model`` (its logits at s - 1; the first token is never kept)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
    left = len(ids) - window  # positions 1 .. T - 1 - window have left the window
    top = loss[: max(left - 1, 0)].topk(min(size, max(left - 1, 0))).indices + 1
    return [top[None, None]] * layers


def find(ids: list[int], pattern: list[int], start: int = 0) -> list[int]:
    """The positions of the first occurrence of ``pattern`` in ``ids`` at or after ``start`` (empty if none)."""
    for i in range(start, len(ids) - len(pattern) + 1):
        if ids[i:i + len(pattern)] == pattern:
            return list(range(i, i + len(pattern)))
    return []


def main() -> None:
    from linearize.data.passkey import make_classic_passkey_example
    from linearize.models.checkpoint import load
    from linearize.models.decode import prefill_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("student")
    p.add_argument("--cache", type=int, default=256)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--depths", default="0.1,0.5")
    p.add_argument("--score", default="relative", help="the cache's sparse_score: relative | error (LoLA's)")
    p.add_argument("--haystack", help="natural text: score a needle among 3 distractors instead of the pass key")
    p.add_argument("--kind", default="number", help="the needle's kind: number, word or sentence")
    p.add_argument("--teacher-far", type=int, metavar="W", help="rank by a teacher's attention from W+ tokens later")
    p.add_argument("--surprise", action="store_true", help="keep the pairs the model predicted worst")
    p.add_argument("--window", type=int, help="another window (pairs are scored when they leave it)")
    args = p.parse_args()
    if args.teacher_far:
        from linearize.models.teacher import load_teacher
        model, tok = load_teacher(args.student)
    else:
        extra = {"window": args.window} if args.window else {}
        model, tok = load(args.student, overrides={"sparse_cache": args.cache, "sparse_score": args.score, **extra})
    model.eval()
    rng = random.Random(5)
    if args.haystack:
        from linearize.data.needle import load_haystack, make_needle_example
        hay = load_haystack(args.haystack, tok, max_tokens=max(4 * args.length, 65536))
    for depth in (float(d) for d in args.depths.split(",")):
        if args.haystack:
            ex = make_needle_example(hay, tok, args.length, depth, rng, kind=args.kind)
            ids = tok(ex.prompt)["input_ids"]
            start = max(0, ex.positions[ex.asked] - 2)  # the prompt may gain a BOS token here
        else:
            ex = make_classic_passkey_example(rng, tok, args.length, depth=depth)
            ids, start = tok(ex.prompt)["input_ids"], 0
        key = find(ids, tok(" " + ex.answer, add_special_tokens=False)["input_ids"], start) or \
            find(ids, tok(ex.answer, add_special_tokens=False)["input_ids"], start)
        if not key:
            print(f"depth {depth}: the answer {ex.answer!r} is not a token run of the prompt; skipped")
            continue
        if args.teacher_far:
            positions = far_attention_positions(model, ids, args.cache, args.teacher_far, len(ids) - 40)
        elif args.surprise:
            from linearize.models.convert import linearized_layers
            blocks = linearized_layers(model)
            positions = surprise_positions(model, ids, args.cache, blocks[0].hybrid.config.window, len(blocks))
        else:
            with torch.no_grad():
                _, cache, _ = prefill_model(model, torch.tensor([ids]), None, None)
            positions = cached_positions(cache)
        share = key_share(positions, key)
        held = Counter(tok.decode([ids[q]]) for p_ in positions for q in p_[p_ >= 0].tolist())
        total = sum(held.values())
        print(f"depth {depth}: {len(ids)} tokens, key {ex.answer} at {key[0]}..{key[-1]}; share of its tokens "
              f"cached, mean over heads {share.mean():.2f}, heads with all {(share == 1).float().mean():.2f}")
        print("  by layer (mean over heads): " + " ".join(f"{s:.2f}" for s in share.mean(1).tolist()))
        print("  tokens held most: " + ", ".join(f"{t!r} {c / total:.3f}" for t, c in held.most_common(10)))


if __name__ == "__main__":
    main()
