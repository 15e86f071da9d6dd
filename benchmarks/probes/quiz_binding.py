"""Does training on quiz documents (every fact asked, in shuffled order) teach a student to bind a
value to its key among look-alikes? Fine-tunes a student's LoRA and attention modules on
``retrieval:quiz`` documents from a training haystack, then scores it on held-out text: needles at
1K (``linearize eval needle``'s examples and scorer, 3 distractors, 5 depths x 3 kinds), one fact
among 3 distractors in the training formats' phrasing, and the answer NLL of held-out quizzes.

    PYTHONPATH=src python3 benchmarks/probes/quiz_binding.py --train BOOKS --heldout BOOKS
        [--model smollm2-135m-lizard] [--steps 50] [--lr 1e-3] [--length 1024] [--skip-before]

One document per step (CPU: about 40 s a step at 1K for SmolLM2-135M with a 256-pair cache).
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", required=True, help="training haystack (file or folder of natural text)")
    p.add_argument("--heldout", required=True, help="held-out haystack (other authors)")
    p.add_argument("--model", default="smollm2-135m-lizard")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--skip-before", action="store_true", help="score after training only")
    args = p.parse_args()

    import linearize
    from linearize.data.needle import load_haystack, make_needle_example, needle_correct
    from linearize.data.retrieval import make_fact_example, retrieval_documents
    from linearize.eval.needle import greedy_continuation
    from linearize.models.lora import lora_parameters
    from linearize.train.transfer import freeze_all_but, trainable_attention_parameters

    torch.manual_seed(0)
    model, tok = linearize.load(args.model)
    held = load_haystack(args.heldout, tok, max_tokens=100_000)
    train = load_haystack(args.train, tok, max_tokens=400_000)
    docs = retrieval_documents(tok, "quiz", length=args.length, count=args.steps, seed=1, haystack=train)
    val = retrieval_documents(tok, "quiz", length=args.length, count=6, seed=99, haystack=held)

    def answer_loss(d) -> tuple[torch.Tensor, int]:
        """The summed next-token NLL of a document's trained tokens, and their count."""
        ids, mask = torch.tensor([list(d)]), torch.tensor(d.loss_mask)[1:]
        logits = model(input_ids=ids).logits[0, :-1]
        return torch.nn.functional.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum"), int(mask.sum())

    def answer_nll() -> float:
        with torch.no_grad():
            sums, counts = zip(*(answer_loss(d) for d in val))
        return sum(x.item() for x in sums) / sum(counts)

    def score(tag: str) -> None:
        model.eval()
        start, rng, needles = time.time(), random.Random(5), 0
        for kind in ("number", "word", "sentence"):
            for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
                ex = make_needle_example(held, tok, 1024, depth, rng, kind=kind, distractors=3)
                needles += needle_correct(greedy_continuation(model, tok, ex.prompt, 16), ex.answer, ex.distractors, kind)
        rng, facts = random.Random(7), 0
        for i in range(9):
            ex = make_fact_example(rng, tok, held, 1024, asked=1, distractors=3, depth=(0.1, 0.5, 0.9)[i % 3])
            facts += ex.answer in greedy_continuation(model, tok, ex.prompt, 12)
        print(f"{tag}: needles at 1K {needles}/15; one fact among 3 distractors {facts}/9; "
              f"held-out quiz answer NLL {answer_nll():.3f} ({time.time() - start:.0f} s)", flush=True)

    if not args.skip_before:
        score("before")
    params = lora_parameters(model) + trainable_attention_parameters(model)
    freeze_all_but(model, params)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    model.train()
    start, losses = time.time(), []
    for step, d in enumerate(docs):
        total, count = answer_loss(d)
        loss = total / count
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 10 == 0:
            print(f"step {step + 1}: answer loss {sum(losses[-10:]) / 10:.3f} "
                  f"({(time.time() - start) / (step + 1):.1f} s/step)", flush=True)
    score("after")


if __name__ == "__main__":
    main()
