"""``bench generate`` end to end on CPU: a tiny model, tiny contexts, real and synthetic prefill.

Checks that the JSON holds what it claims (every cell of every side, sizes that follow from the
shapes, an emulated device too small for the longest teacher cache recorded as "does not fit"),
that the PNG and Markdown are written from it, and that the synthetic state has exactly the sizes
a real prefill leaves (what lets the GPU run skip the prefill).
"""

from __future__ import annotations

import json

import pytest
import torch

from linearize.bench.generate import SHAPES, build_model, resolve_model_name, run_generate_bench

CONTEXTS = (32, 128, 512)  # the student's window is 128 tokens: its state outweighs a short cache
B = 2


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_kv_bytes(context: int, steps_slack: int = 0) -> int:
    s = SHAPES["tiny"]
    return 2 * s["num_hidden_layers"] * B * s["num_key_value_heads"] * (context + steps_slack) * s["head_dim"] * 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    # the real-prefill run on a device that holds the weights and the 128-token cache, not the 512-token one
    weights = build_model("tiny", torch.float32, "cpu")[1]["weight_bytes"]
    budget = weights + 300_000
    assert weights + tiny_kv_bytes(128, 16) < budget < weights + tiny_kv_bytes(512), "budget no longer splits the cells"
    for prefill in ("real", "synthetic"):
        d = tmp_path_factory.mktemp(prefill)
        data = run_generate_bench(d, models=("tiny",), contexts=CONTEXTS, batch_size=B, new_tokens=2, dtype="fp32",
                                  device="cpu", prefill=prefill, eager_steps=1, warmup_steps=1,
                                  device_memory_bytes=budget if prefill == "real" else None, command="pytest bench")
        out[prefill] = (d, data)
    out["budget"] = budget
    return out


def test_outputs_written_from_the_json(runs):
    for prefill in ("real", "synthetic"):
        d, data = runs[prefill]
        saved = json.loads((d / "generate.json").read_text())
        assert saved["settings"]["prefill"] == prefill and saved["settings"]["contexts"] == list(CONTEXTS)
        assert saved["environment"]["command"] == "pytest bench"
        assert (d / "generate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        md = (d / "generate.md").read_text()
        assert "| context |" in md and "## tiny" in md and f"prefill: {prefill}" in md
        assert any("prefill" in n for n in saved["notes"])


def test_cells_hold_what_they_claim(runs):
    _, data = runs["synthetic"]
    m = data["models"][0]
    assert m["name"] == "tiny" and m["weights"] == "random"
    s = SHAPES["tiny"]
    assert m["config"]["num_hidden_layers"] == s["num_hidden_layers"] and m["head_dim"] == s["head_dim"]
    assert m["weight_bytes"] == 4 * m["parameters"] > 0  # fp32
    for side in ("teacher", "student"):
        cells = m[side]["cells"]
        assert [c["context"] for c in cells] == list(CONTEXTS)
        for c in cells:
            assert c["status"] == "ok" and c["mode"] == "eager"
            assert c["tokens_per_s"] == pytest.approx(B / (c["step_ms_median"] / 1e3))
            assert c["step_ms_min"] <= c["step_ms_median"] <= c["step_ms_max"]
            assert c["steps_timed"] == 2
    teacher, student = m["teacher"]["cells"], m["student"]["cells"]
    # the teacher's cache holds exactly `context` tokens of keys and values; the student's state is constant
    assert [c["context_cache_bytes"] for c in teacher] == [tiny_kv_bytes(L) for L in CONTEXTS]
    assert len({c["cache_bytes"] for c in student}) == 1
    assert student[0]["kernel"] == "torch"
    for t in teacher:
        assert t["best_tokens_per_s"] == max(t["tokens_per_s"], t["sliced_tokens_per_s"])
    for r, t, s in zip(m["ratios"], teacher, student):
        assert r["student_over_teacher"] == pytest.approx(s["tokens_per_s"] / t["best_tokens_per_s"])
    assert data["targets"]["tiny"]["student_state_bytes_constant"] is True


def test_synthetic_state_has_the_sizes_of_a_real_prefill(runs):
    real = runs["real"][1]["models"][0]
    syn = runs["synthetic"][1]["models"][0]
    for side in ("teacher", "student"):
        for a, b in zip(real[side]["cells"], syn[side]["cells"]):
            if a["status"] == "ok":
                assert a["cache_bytes"] == b["cache_bytes"], (side, a["context"])


def test_cache_that_does_not_fit_is_recorded_with_the_bytes_it_needs(runs):
    _, data = runs["real"]
    m = data["models"][0]
    teacher = {c["context"]: c for c in m["teacher"]["cells"]}
    assert teacher[32]["status"] == teacher[128]["status"] == "ok"
    big = teacher[512]
    assert big["status"] == "does_not_fit" and big["needed_bytes"] > runs["budget"]
    assert big["needed_bytes"] == m["weight_bytes"] + big["cache_bytes"]
    # the student runs at every context on the same device
    assert all(c["status"] == "ok" for c in m["student"]["cells"])
    assert "student_over_teacher" not in m["ratios"][2]


def test_model_names_and_bad_arguments(tmp_path):
    assert resolve_model_name("smollm2-135m") == ("smollm2-135m", "bundled")
    assert resolve_model_name("smollm2-135m-random") == ("smollm2-135m", "random")
    assert resolve_model_name("llama3-8b") == ("llama3-8b", "random")
    with pytest.raises(ValueError, match="allowed"):
        resolve_model_name("gpt2")
    with pytest.raises(ValueError, match="dtype"):
        run_generate_bench(tmp_path, models=("tiny",), contexts=(8,), dtype="int8", device="cpu")
    with pytest.raises(ValueError, match="contexts"):
        run_generate_bench(tmp_path, models=("tiny",), contexts=(0,), device="cpu")
    with pytest.raises(ValueError, match="prefill"):
        run_generate_bench(tmp_path, models=("tiny",), contexts=(8,), device="cpu", prefill="none")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            run_generate_bench(tmp_path, models=("tiny",), contexts=(8,), device="cuda")
    assert not list(tmp_path.iterdir()), "a rejected run wrote files"
