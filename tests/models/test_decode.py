"""``fast_generate`` and the static-buffer decoders: token for token HF's greedy ``generate``.

CPU runs the eager step (torch ops; the generic ``HybridAttention`` step for other methods);
the fused Triton kernel is checked against the torch step in Triton's interpreter on CPU and
natively on CUDA; the CUDA-graph path runs only where CUDA is present. A ``TorchFunctionMode``
makes any host synchronisation in the step (``.item()``, ``bool(tensor)``, ``.tolist()``,
``nonzero``, boolean indexing) an error: such a step could not be captured in a CUDA graph.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fixtures
from helpers import NoHostSync, capturing
import linearize
from linearize.methods import AttentionConfig, method_config
from linearize.bench.teacher_decode import TeacherDecoder
from linearize.models.decode import StudentDecoder, fast_generate

SMALL = {"window": 4, "chunk_size": 8}
CUDA = torch.cuda.is_available()
def needs_cuda(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(fn))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tokens(B=2, L=12, seed=0):
    return torch.randint(3, fixtures.VOCAB, (B, L), generator=torch.Generator().manual_seed(seed))


def converted(arch="llama", method="lizard", **kw):
    return linearize.convert(fixtures.ARCHS[arch](), method, **{**SMALL, **kw})


def hf_greedy(model, ids, n, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


def padded_batch():
    """Two prompts of 9 and 4 tokens, left-padded to 12 (more padding than the window of 4)."""
    a, b = tokens(1, 9, seed=1), tokens(1, 4, seed=2)
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    for i, s in enumerate((a, b)):
        ids[i, 12 - s.shape[1]:], mask[i, 12 - s.shape[1]:] = s, 1
    return (a, b), ids, mask


# ------------------------------------------------------------------ greedy equality with HF generate

CAUSAL = sorted(m for m in linearize.methods() if isinstance(method_config(m), AttentionConfig))
CASES = ([("lizard", arch, {}) for arch in fixtures.ARCHS]
         + [(m, "llama", {}) for m in CAUSAL if m != "lizard"]
         + [("lizard", "llama", {"sink_kind": "kv"}), ("lizard", "llama", {"gate": "gla"}),
            ("lizard", "llama", {"rope_global": True}), ("lolcats", "llama", {"local_rule": "terraced"}),
            ("liza", "llama", {"delta_order": 2}), ("lizard", "gemma2", {"keep_native_sliding": True}),
            ("lizard", "llama", {"softmax_layers": [0]}), ("lizard", "llama", {"sparse_cache": 3}),
            ("lizard-gdn", "llama", {"sparse_cache": 3}), ("lizard-gdn", "llama", {"sparse_cache": 3, "sparse_distance": 5})])


@pytest.mark.parametrize("method,arch,kw", CASES,
                         ids=[f"{m}-{a}" + "".join(f"-{k}={v}" for k, v in kw.items()) for m, a, kw in CASES])
def test_fast_generate_equals_hf_greedy(method, arch, kw):
    model = converted(arch, method, **kw)
    ids = tokens()
    assert torch.equal(fast_generate(model, ids, max_new_tokens=10), hf_greedy(model, ids, 10))


@pytest.mark.parametrize("method", ["lizard", "lolcats", "hedgehog"])
def test_left_padded_batch_equals_hf_and_each_row_alone(method):
    model = converted("llama", method)
    seqs, ids, mask = padded_batch()
    out = fast_generate(model, ids, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(out, hf_greedy(model, ids, 8, attention_mask=mask))
    for i, s in enumerate(seqs):
        assert torch.equal(out[i, -8:], fast_generate(model, s, max_new_tokens=8)[0, -8:]), f"row {i}"


def test_eos_finishes_rows_and_stops_like_hf():
    model = converted("llama", "lizard")
    ids = tokens(B=3, seed=5)
    free = fast_generate(model, ids, max_new_tokens=20, eos_token_id=[])
    assert free.shape == (3, 32)
    # an EOS id that row 0 produces early: rows finish at different steps (pad afterwards) ...
    eos = int(free[0, 14])
    ref = hf_greedy(model, ids, 20, eos_token_id=eos)
    out = fast_generate(model, ids, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)
    # ... and with an EOS list that every row hits, generation stops at the last row's EOS
    eos_all = sorted({int(free[i, 12 + i]) for i in range(3)})
    ref = hf_greedy(model, ids, 20, eos_token_id=eos_all)
    out = fast_generate(model, ids, max_new_tokens=20, eos_token_id=eos_all, pad_token_id=0)
    assert torch.equal(out, ref)
    assert out.shape[1] < 32


def test_prefill_in_pieces_gives_the_same_tokens():
    model = converted("llama", "lizard")
    ids = tokens(L=30)
    whole = fast_generate(model, ids, max_new_tokens=6)
    assert torch.equal(fast_generate(model, ids, max_new_tokens=6, prefill_chunk_size=7), whole)


def test_sampling_is_reproducible_and_in_range():
    model = converted("llama", "lizard")
    ids = tokens()

    def sample(seed):
        torch.manual_seed(seed)
        return fast_generate(model, ids, max_new_tokens=12, temperature=1.0)

    a = sample(1)
    assert a.shape == (2, 24) and int(a.max()) < fixtures.VOCAB
    assert torch.equal(a, sample(1))
    assert not torch.equal(a, sample(2))


# ------------------------------------------------------------------ the step itself


@torch.no_grad()
def test_step_logits_equal_the_full_forward():
    """Each decode step's logits (the fast ring-buffer step) equal the full forward at that position."""
    model = converted("llama3", "lizard")
    ids = tokens(L=20)
    dec = StudentDecoder(model, 2, 20)
    dec.prefill(ids[:, :9])
    full = model(ids).logits
    seen = []
    dec._select = lambda logits: seen.append(logits.clone()) or logits.argmax(-1)  # record each step's logits
    for t in range(9, 20):
        dec.ids.copy_(ids[:, t:t + 1])  # teacher-force the next token
        dec.step()
        assert (seen[-1] - full[:, t]).abs().max() < 1e-4, f"position {t}"


@pytest.mark.parametrize("method,kw", [("lizard", {}), ("lizard", {"sink_kind": "kv", "gate": "gla"}),
                                       ("lolcats", {}), ("liza", {}), ("hedgehog", {}),
                                       ("lizard-gdn", {}),
                                       ("lizard", {"sparse_cache": 3})])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_decode_step_has_no_host_sync(arch, method, kw):
    model = converted(arch, method, **kw)
    dec = StudentDecoder(model, 2, 4)
    dec.start(dec.prefill(tokens()).argmax(-1), dec.pos)
    with torch.no_grad(), capturing(), NoHostSync():  # (the step runs inside a graph's capture)
        dec._step_body()


def test_teacher_step_has_no_host_sync():
    dec = TeacherDecoder(fixtures.llama(), 2, 4, 32)
    dec.start(dec.prefill(tokens()).argmax(-1), dec.pos)
    with torch.no_grad(), NoHostSync():
        dec._step_body()


def test_host_sync_detector_catches_hf_mask_check():
    """The detector sees through HF: without the decoder's constant mask HF's packed-sequence check syncs."""
    model = fixtures.llama()
    with torch.no_grad(), NoHostSync(), pytest.raises(AssertionError, match="host synchronisation"):
        model(input_ids=tokens()[:, :1], position_ids=torch.zeros(2, 1, dtype=torch.long), use_cache=False)


@torch.no_grad()
def test_state_sizes_constant_in_context_and_synthetic_matches_real():
    model = linearize.convert(fixtures.llama(), "lizard")  # the defaults: window 128, 4 sinks
    sizes = []
    for L in (16, 300):
        dec = StudentDecoder(model, 2, 4)
        dec.prefill(tokens(L=L))
        sizes.append(({k: (tuple(v.shape), v.dtype) for st in dec.states for k, v in st.items()}, dec.state_bytes()))
    syn = StudentDecoder(model, 2, 4)
    syn.load_synthetic(100_000)
    sizes.append(({k: (tuple(v.shape), v.dtype) for st in syn.states for k, v in st.items()}, syn.state_bytes()))
    assert sizes[0] == sizes[1] == sizes[2]
    shapes = sizes[0][0]
    assert shapes["ring_k"] == ((2, 2, 128, 16), torch.float32)  # per KV head, the window's 128 keys
    assert shapes["S"] == ((2, 4, 16, 16), torch.float32)


@torch.no_grad()
def test_teacher_decoder_equals_hf_greedy_and_padding():
    model = fixtures.llama3()
    for ids, mask in ((tokens(), None), padded_batch()[1:]):
        dec = TeacherDecoder(model, 2, 8, 12 + 8)
        dec.start(dec.prefill(ids, mask).float().argmax(-1), dec.pos)
        for _ in range(7):
            dec.step()
        ref = hf_greedy(model, ids, 8, attention_mask=mask)
        assert torch.equal(torch.cat([ids, dec.tokens()], 1), ref)
    # sliced attention (unpadded only) gives the same tokens
    dec = TeacherDecoder(model, 2, 8, 20, attention="sliced")
    dec.start(dec.prefill(tokens()).float().argmax(-1), dec.pos)
    for _ in range(7):
        dec.step()
    assert torch.equal(torch.cat([tokens(), dec.tokens()], 1), hf_greedy(model, tokens(), 8))
    assert dec.cache_bytes() > 0 and dec.context_cache_bytes(10) * 2 == dec.context_cache_bytes(20)


def test_bad_arguments_are_rejected():
    model = converted("llama", "lizard")
    with pytest.raises(ValueError, match="converted model"):
        fast_generate(fixtures.llama(), tokens())
    with pytest.raises(ValueError, match="use_cuda_graph"):
        fast_generate(model, tokens(), use_cuda_graph="yes")
    with pytest.raises(ValueError, match="max_new_tokens"):
        fast_generate(model, tokens(), max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        fast_generate(model, tokens(), temperature=-1.0)
    with pytest.raises(ValueError, match="input_ids"):
        fast_generate(model, tokens().float())
    with pytest.raises(ValueError, match="no tokens"):
        fast_generate(model, tokens(), attention_mask=torch.zeros(2, 12, dtype=torch.long))
    with pytest.raises(ValueError, match="kernel"):
        fast_generate(model, tokens(), kernel="cuda")
    with pytest.raises(ValueError, match="every layer linearized"):
        fast_generate(converted("llama", "lizard", softmax_layers=[0]), tokens(), use_cuda_graph=True)
    if not CUDA:
        with pytest.raises(ValueError, match="CUDA"):
            fast_generate(model, tokens(), use_cuda_graph=True)
        with pytest.raises(ValueError, match="triton"):
            StudentDecoder(model, 2, 4, kernel="triton")


# ------------------------------------------------------------------ the fused Triton kernel

_INTERPRET = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import fixtures, linearize
    from linearize.ops.lizard_attn import decode as decode_step
    from linearize.models.decode import StudentDecoder
    torch.set_num_threads(1)
    # the one-kernel RMSNorm against HF's
    norm = fixtures.llama().model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(3, 1, 64)
        err = (decode_step.launch_rmsnorm(x, norm.weight, norm.variance_epsilon) - norm(x)).abs().max().item()
    assert err < 1e-5, err
    # the fused step (RoPE and the sigmoid gate inside; precomputed per-channel gates) against torch ops
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    for arch, method, kw in [("llama3", "lizard", {{}}), ("qwen3", "lizard", {{"gate": "gla", "sinks": 0}})]:
        model = linearize.convert(fixtures.ARCHS[arch](num_layers=1), method, window=4, chunk_size=8, **kw)
        runs = []
        for kind in ("torch", "fused"):
            dec = StudentDecoder(model, 2, 4, kernel="torch")
            dec.kinds = [kind] * len(dec.kinds)  # the interpreter runs the kernel on CPU tensors
            dec.start(dec.prefill(ids).argmax(-1), dec.pos)
            dec.step(); dec.step()
            runs.append((dec.tokens().clone(), dec.states[0]))
        assert torch.equal(runs[0][0], runs[1][0]), method
        for key in runs[0][1]:
            a, b = runs[1][1][key], runs[0][1][key]
            err = ((a - b).norm() / b.norm()).item()
            assert err < 1e-5, (method, kw, key, err)
    print("ok")
""")


def test_fused_kernel_matches_torch_step_in_triton_interpreter():
    pytest.importorskip("triton")
    code = _INTERPRET.format(tests=str(Path(__file__).resolve().parents[1]))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


# ------------------------------------------------------------------ CUDA: fused kernel and CUDA graph


@needs_cuda
@pytest.mark.parametrize("method,arch,kw", [("lizard", "llama", {}), ("lizard", "llama3", {"gate": "gla"}),
                                            ("hedgehog", "llama", {}), ("lizard", "qwen3", {"sink_kind": "kv"}),
                                            ("lolcats", "llama", {}), ("lizard", "gemma2", {}),
                                            ("lizard", "llama", {"sparse_cache": 3})])
def test_cuda_graph_generate_equals_hf_greedy(method, arch, kw):
    model = converted(arch, method, **kw).cuda()
    seqs, ids, mask = padded_batch()
    ids, mask = ids.cuda(), mask.cuda()
    ref = hf_greedy(model, ids, 12, attention_mask=mask)
    out = fast_generate(model, ids, attention_mask=mask, max_new_tokens=12, use_cuda_graph=True)
    assert torch.equal(out, ref)


@needs_cuda
def test_cuda_graph_decoder_really_replays_a_graph_with_the_fused_kernel():
    model = converted("llama", "lizard").cuda()
    dec = StudentDecoder(model, 2, 16, kernel="triton")
    ids = tokens().cuda()
    dec.start(dec.prefill(ids).argmax(-1), dec.pos)
    dec.capture()
    assert dec.mode == "cuda_graph" and dec.kernel == "fused"
    pos0 = dec.pos.clone()
    for _ in range(10):
        dec.step()
    assert torch.equal(dec.pos, pos0 + 10)  # positions advance inside the graph
    assert torch.equal(torch.cat([ids, dec.tokens()], 1), hf_greedy(model, ids, 12))


@needs_cuda
@torch.no_grad()
def test_fused_kernel_matches_torch_step_bf16_cuda():
    model = linearize.convert(fixtures.llama(num_layers=1), "lizard").cuda().to(torch.bfloat16)
    ids = tokens(L=200).cuda()
    states = []
    for kernel in ("torch", "triton"):
        dec = StudentDecoder(model, 2, 4, kernel=kernel)
        dec.start(dec.prefill(ids).float().argmax(-1), dec.pos)
        dec.step()
        states.append(dec.states[0])
    for key in states[0]:
        a, b = states[1][key].float(), states[0][key].float()
        assert ((a - b).norm() / b.norm()).item() < 2e-2, key


@needs_cuda
def test_teacher_decoder_cuda_graph_equals_hf_greedy():
    model = fixtures.llama().cuda()
    ids = tokens().cuda()
    dec = TeacherDecoder(model, 2, 12, 32)
    dec.start(dec.prefill(ids).float().argmax(-1), dec.pos)
    dec.capture()
    while dec.steps_done < 12:
        dec.step()
    assert dec.mode == "cuda_graph"
    assert torch.equal(torch.cat([ids, dec.tokens()], 1), hf_greedy(model, ids, 12))
