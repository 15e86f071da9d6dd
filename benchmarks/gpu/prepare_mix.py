"""Cut ../shared/data/mix into what a GPU study carries (64 MiB a call): the front of each training
source, and the held-out books, whose authors appear in no training file.

    python3 benchmarks/gpu/prepare_mix.py OUT_DIR [--tokens-scale 1.0]

Writes OUT_DIR/{sharegpt,chitchat,gpteacher,books_train,books_heldout}.jsonl.xz. Token counts are the
mix README's estimate (4 characters a token); each training file gets a little more than the share
of an 8M-token run needs, so `mix_documents` never repeats one.
"""

from __future__ import annotations

import argparse
import json
import lzma
from pathlib import Path

MIX = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mix"

# Authors kept out of every training file: the held-out books for perplexity and the needle haystack.
HELDOUT_AUTHORS = ("Voltaire", "Swift, Jonathan", "Thoreau, Henry David", "Conrad, Joseph",
                   "Christie, Agatha", "Hesse, Hermann", "Carroll, Lewis", "Wilde, Oscar",
                   "Goethe, Johann Wolfgang von", "Defoe, Daniel")

# Millions of tokens of each training file (at scale 1).
BUDGET_M = {"sharegpt": 3.6, "chitchat": 0.9, "gpteacher": 1.4, "books_train": 3.0}
SOURCE = {"sharegpt": "sharegpt_en.jsonl.xz", "chitchat": "chitchat.jsonl.xz",
          "gpteacher": "gpteacher.jsonl.xz", "books_train": "gutenberg_books.jsonl.xz"}


def chars(record: dict) -> int:
    if "messages" in record:
        return sum(len(m.get("content") or "") for m in record["messages"])
    return sum(len(str(v)) for v in record.values())


def cut(name: str, src: Path, dst: Path, max_tokens: float) -> float:
    n = 0.0
    with lzma.open(src, "rt") as f, lzma.open(dst, "wt", preset=6) as out:
        for line in f:
            record = json.loads(line)
            if name == "books_train" and record.get("author") in HELDOUT_AUTHORS:
                continue
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += chars(record) / 4
            if n >= max_tokens:
                break
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tokens-scale", type=float, default=1.0)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for name, budget in BUDGET_M.items():
        n = cut(name, MIX / SOURCE[name], a.out / f"{name}.jsonl.xz", budget * 1e6 * a.tokens_scale)
        print(f"{name}: ~{n / 1e6:.2f}M tokens, {(a.out / f'{name}.jsonl.xz').stat().st_size / 2**20:.1f} MiB")
    n = 0.0
    with lzma.open(MIX / SOURCE["books_train"], "rt") as f, \
            lzma.open(a.out / "books_heldout.jsonl.xz", "wt", preset=6) as out:
        for line in f:
            record = json.loads(line)
            if record.get("author") in HELDOUT_AUTHORS:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                n += len(record["text"]) / 4
    print(f"books_heldout: ~{n / 1e6:.2f}M tokens, {(a.out / 'books_heldout.jsonl.xz').stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
