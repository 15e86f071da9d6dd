"""The two stages on the bundled SmolLM2-135M (slow: a few CPU minutes): stage 1 lowers every
layer's attention-transfer MSE on held-out text, stage 2 lowers the validation loss."""

from __future__ import annotations

import json

import pytest
import torch

from linearize.train import TrainConfig, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_both_stages_improve_on_the_bundled_teacher(tmp_path):
    # One thread, as every other test: make test's two xdist workers share two cores, and a second
    # OpenMP thread there spins while it waits for a core (several times the CPU time for no speed-up).
    torch.set_num_threads(1)
    out = run(TrainConfig(method="lizard", data="shakespeare", out=str(tmp_path / "run"), seq_len=128,
                          batch_size=2, stage1_tokens=128 * 2 * 6, stage2_tokens=128 * 2 * 3, stage2_lr=1e-3,
                          eval_every=100, val_rows=4, progress=False))
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    s1 = [r for r in records if r.get("stage") == "stage1" and r.get("split") == "val"]
    before, after = s1[0]["layer_mse"], s1[-1]["layer_mse"]
    assert len(before) == 30
    worse = [i for i, (b, a) in enumerate(zip(before, after)) if not a < b]
    assert not worse, f"layers whose held-out MSE did not fall: {worse}"
    s2 = [r for r in records if r.get("stage") == "stage2" and r.get("split") == "val"]
    assert s2[-1]["loss"] < s2[0]["loss"]
    print(f"\nstage-1 held-out MSE, summed over layers: {sum(before):.3f} -> {sum(after):.3f}; "
          f"stage-2 validation loss {s2[0]['loss']:.3f} -> {s2[-1]['loss']:.3f}")
