"""LION encoders: the layer, conversion of BERT-family models, save/load, positions, stage-1 transfer."""

import copy
import json

import pytest
import torch

import linearize
from helpers import assert_rel_close
from linearize.layers.lion import LionAttention, LionConfig
from linearize.methods import method_config
from linearize.models.encoder import (
    embed, lion_layers, lion_parameters, mean_pool, sentence_embeddings,
)

H, D, HIDDEN = 4, 16, 64


def tiny_bert(seed=0, max_positions=64):
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=128, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=H,
                        intermediate_size=128, max_position_embeddings=max_positions, pad_token_id=0)
    torch.manual_seed(seed)
    return BertModel(config).eval()


def batch(B=3, T=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 128, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 13:] = 0
    mask[2, 5:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


VARIANTS = ["lit", "d", "s", "d-asym", "s-asym"]  # -asym: separate decays for keys right of the query


def lion_config(variant: str, **kw) -> LionConfig:
    name, _, asym = variant.partition("-")
    return LionConfig(variant=name, asymmetric=bool(asym), **kw)


@pytest.mark.parametrize("variant, feature_map",
                         [(v, "hedgehog") for v in VARIANTS] + [("s-asym", "taylor"), ("s-asym", "taylor+hedgehog")])
@pytest.mark.parametrize("form", ["chunk", "parallel", "recurrent"])
@pytest.mark.parametrize("exact", [{}, {"sinks": 1, "window": 2}])
def test_gradients_reach_every_lion_parameter(variant, feature_map, form, exact):
    torch.manual_seed(0)
    layer = LionAttention(lion_config(variant, chunk_size=4, feature_map=feature_map, **exact), H, D, HIDDEN)
    q, k, v = (torch.randn(2, H, 11, D) for _ in range(3))
    x = torch.randn(2, 11, HIDDEN)
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, 8:] = False
    layer(q, k, v, x, valid, form=form).pow(2).sum().backward()
    names = {n for n, _ in layer.named_parameters()}
    assert ({"gate.weight", "gate.bias"} <= names) == variant.startswith("s")
    assert ("decay_logit" in names) == variant.startswith("d")
    assert ({"gate_back.weight", "gate_back.bias"} <= names) == (variant == "s-asym")
    assert ("decay_logit_back" in names) == (variant == "d-asym")
    assert ({"rest_logit.weight", "rest_logit.bias", "rest_count_scale"} <= names) == bool(exact)
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} gets no gradient"


@pytest.mark.parametrize("variant, feature_map",
                         [(v, "hedgehog") for v in VARIANTS] + [("s-asym", "taylor"), ("s-asym", "taylor+hedgehog")])
@pytest.mark.parametrize("sinks, window", [(1, 2), (2, 0), (0, 1)])
def test_exact_sinks_and_window_mix_with_lion_as_one_softmax(variant, feature_map, sinks, window):
    """Every form against the definition, written out per query i: softmax over the exact keys'
    teacher scores and the rest's logit r_i (a linear map of the token + γ_h log of LION's row
    sum over the rest); the rest's weight goes to scaled LION (mask M, the layer's features)
    over the other valid keys; padded keys are no keys, padded queries read 0."""
    import math

    from linearize.ops.lion.naive import lion_mask

    torch.manual_seed(0)
    B, T = 2, 11
    layer = LionAttention(lion_config(variant, sinks=sinks, window=window, chunk_size=4, feature_map=feature_map),
                          H, D, HIDDEN).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))
    x = torch.randn(B, T, HIDDEN, dtype=torch.float64)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 7:] = False
    with torch.no_grad():
        fq, fk = layer.phi_q(q), layer.phi_k(k)
        M = lion_mask(layer.log_decay(x), T, valid, batch_size=B, dtype=torch.float64,
                      log_a_back=layer.log_decay_back(x)).expand(B, H, T, T)
        r = layer.rest_logit(x).transpose(1, 2)
        ref = torch.zeros(B, H, T, D, dtype=torch.float64)
        for b in range(B):
            for i in range(T):
                if not valid[b, i]:
                    continue
                near = range(i - window, i + window + 1) if window else ()  # window 0: none, not the token
                exact = sorted({j for j in range(sinks) if valid[b, j]}
                               | {j for j in near if sinks <= j < T and valid[b, j]})
                others = [j for j in range(sinks, T) if valid[b, j] and j not in exact]
                for h in range(H):
                    a = torch.stack([M[b, h, i, j] * (fq[b, h, i] @ fk[b, h, j]) for j in others])
                    rest = (a[:, None] * v[b, h, others]).sum(0) / (a.sum() + 1e-6)
                    r_i = r[b, h, i] + layer.rest_count_scale[h] * torch.log(a.sum() + 1e-6)
                    logits = [q[b, h, i] @ k[b, h, j] / math.sqrt(D) for j in exact] + [r_i]
                    pi = torch.stack(logits).softmax(0)
                    ref[b, h, i] = sum(pi[e] * v[b, h, j] for e, j in enumerate(exact)) + pi[-1] * rest
        # the chunk and recurrent forms subtract the window keys' LION terms from the whole row; the
        # Taylor kernel's terms are larger (1 + u + u^2/2 for u of several units here), so more digits go
        tol = 1e-10 if feature_map.startswith("taylor") else 1e-12
        for form in ("parallel", "chunk", "recurrent"):
            assert_rel_close(layer(q, k, v, x, valid, form=form), ref, tol, form)


@pytest.mark.parametrize("exact", [{}, {"sinks": 1, "window": 2}])
def test_auto_form_runs_parallel_on_short_inputs_and_chunks_long_ones(exact, monkeypatch):
    """The default form, "auto", takes the parallel form up to AUTO_PARALLEL_MAX tokens (faster for
    sentences) and the chunk form beyond (linear memory), with the result of either."""
    from linearize.layers import lion as lion_mod

    calls = []

    def spy(name, real):
        def run(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return run

    for name in ("lion_chunk", "lion_parallel"):
        monkeypatch.setattr(lion_mod, name, spy(name, getattr(lion_mod, name)))
    # with exact keys the parallel form is the layer's own (B, H, T, T) mix
    monkeypatch.setattr(LionAttention, "_with_exact_parallel",
                        spy("lion_parallel", LionAttention._with_exact_parallel))
    assert LionConfig().form == "auto"
    torch.manual_seed(0)
    layer = LionAttention(LionConfig(variant="s", chunk_size=16, **exact), H, D, HIDDEN).double()
    limit = lion_mod.AUTO_PARALLEL_MAX
    for T, picked in ((limit, "lion_parallel"), (limit + 1, "lion_chunk")):
        q, k, v = (torch.randn(1, H, T, D, dtype=torch.float64) for _ in range(3))
        x = torch.randn(1, T, HIDDEN, dtype=torch.float64)
        calls.clear()
        y = layer(q, k, v, x)
        assert calls == [picked], (T, calls)
        other = "chunk" if picked == "lion_parallel" else "parallel"
        assert_rel_close(y, layer(q, k, v, x, form=other), 1e-12, f"T={T}")


@pytest.mark.parametrize("feature_map", ["hedgehog", "taylor", "taylor+hedgehog"])
@pytest.mark.parametrize("exact", [{}, {"sinks": 1, "window": 2}])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_long_inputs_never_hold_the_whole_inputs_features(form, exact, feature_map):
    """Without autograd the chunk and recurrent forms apply the feature maps a chunk (block) at a
    time, the window's pair terms included (a chunk of keys and its halo of w on each side): their
    extra memory does not grow with T by the F-wide features (561 per head for Taylor at d = 32)."""
    from linearize.ops.lion.recurrent import FEATURE_BLOCK

    torch.manual_seed(0)
    C, T = 16, 150
    layer = LionAttention(lion_config("s-asym", chunk_size=C, feature_map=feature_map, **exact), H, D, HIDDEN).double()
    seen = []
    for phi in (layer.phi_q, layer.phi_k):
        phi.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[2]))
    q, k, v = (torch.randn(2, H, T, D, dtype=torch.float64) for _ in range(3))
    x = torch.randn(2, T, HIDDEN, dtype=torch.float64)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, 130:] = False
    with torch.no_grad():
        y = layer(q, k, v, x, valid, form=form)
        window_terms = C + 2 * exact.get("window", 0)  # in either form, chunk by chunk
        most = window_terms if form == "chunk" else max(FEATURE_BLOCK, window_terms)
        assert seen and max(seen) <= most, seen
        assert_rel_close(y, layer(q, k, v, x, valid, form="parallel"), 1e-10, form)


def test_exact_keys_covering_a_short_sentence_leave_plain_softmax():
    """When every key of a query is exact (a 5-token sentence, window 4), LION has nothing left:
    the output is the teacher's softmax attention over the valid keys, and gradients stay finite
    (the subtraction's rounding noise is not read, no softmax row is all -inf)."""
    import math

    torch.manual_seed(0)
    B, T = 2, 5
    layer = LionAttention(LionConfig(variant="s", sinks=1, window=4, chunk_size=4), H, D, HIDDEN).double()
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 3:] = False
    y = layer(q, k, v, torch.randn(B, T, HIDDEN, dtype=torch.float64), valid, form="chunk")
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~valid[:, None, None, :], float("-inf"))
    ref = (scores.softmax(-1) @ v) * valid[:, None, :, None]
    assert_rel_close(y, ref, 1e-12, "short")
    y.pow(2).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("variant", ["d", "s"])
@pytest.mark.parametrize("exact", [{}, {"sinks": 1, "window": 2}])
def test_asymmetric_decays_start_as_the_symmetric_layer_and_then_look_one_way(variant, exact):
    """The right-side decays start equal to the left ones (the same layer as LION's symmetric
    mask); set apart, the layer is LION with the two-sided mask (ops tests check that mask)."""
    torch.manual_seed(0)
    sym = LionAttention(LionConfig(variant=variant, chunk_size=4, **exact), H, D, HIDDEN).double()
    asym = LionAttention(LionConfig(variant=variant, chunk_size=4, asymmetric=True, **exact), H, D, HIDDEN).double()
    missing, unexpected = asym.load_state_dict(sym.state_dict(), strict=False)
    assert not unexpected and set(missing) == ({"gate_back.weight", "gate_back.bias"} if variant == "s"
                                               else {"decay_logit_back"})
    q, k, v = (torch.rand(2, H, 13, D, dtype=torch.float64) for _ in range(3))
    x = torch.randn(2, 13, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        assert_rel_close(asym(q, k, v, x), sym(q, k, v, x), 1e-14, "at init")
        back = asym.gate_back.bias if variant == "s" else asym.decay_logit_back
        back.fill_(-6.0)  # right-side decay about 0.0025: the keys right of a query fade at once
        y = asym(q, k, v, x, form="parallel")
        assert (y - sym(q, k, v, x)).abs().max() > 1e-3
        for form in ("chunk", "recurrent"):
            assert_rel_close(asym(q, k, v, x, form=form), y, 1e-12, form)
    with pytest.raises(ValueError, match="asymmetric decays need a decay: variant 'd' or 's', not 'lit'"):
        LionConfig(variant="lit", asymmetric=True).validate()
    with pytest.raises(ValueError, match="asymmetric must be a bool, got 1"):
        LionConfig(asymmetric=1).validate()


def test_layer_forms_agree_and_decay_starts_in_range():
    torch.manual_seed(0)
    layer = LionAttention(LionConfig(variant="s", chunk_size=4), H, D, HIDDEN).double()
    q, k, v = (torch.randn(2, H, 13, D, dtype=torch.float64) for _ in range(3))
    x = torch.randn(2, 13, HIDDEN, dtype=torch.float64)
    ref = layer(q, k, v, x, form="parallel")
    for form in ("chunk", "recurrent"):
        assert_rel_close(layer(q, k, v, x, form=form), ref, 1e-12, form)
    gates = layer.log_decay(x).exp()
    assert gates.min() >= 0.95 - 1e-6 and gates.max() <= 0.99 + 1e-6
    d = LionAttention(LionConfig(variant="d"), H, D, HIDDEN)
    assert torch.allclose(d.log_decay(x).exp(), torch.linspace(0.95, 0.99, H), atol=1e-6)


def test_convert_reuses_the_projections_and_keeps_parameter_names():
    model = tiny_bert()
    before = dict(model.named_parameters())
    teacher_query = model.encoder.layer[0].attention.self.query
    linearize.convert(model, "lion-s")
    assert model.encoder.layer[0].attention.self.query is teacher_query
    assert len(lion_layers(model)) == 2
    after = dict(model.named_parameters())
    assert set(before) <= set(after)
    assert all(".lion." in n for n in set(after) - set(before))
    assert model.linearize_spec["method"] == "lion-s"
    assert model.linearize_spec["config"]["variant"] == "s"
    assert "lion-s" in linearize.methods() and "lion-d" in linearize.methods() and "lion-lit" in linearize.methods()


def test_padded_batch_gives_each_sentence_its_own_embedding():
    model = linearize.convert(tiny_bert(), "lion-s", chunk_size=4)
    b = batch()
    with torch.no_grad():
        together = sentence_embeddings(model, b)
        for i in range(3):
            n = int(b["attention_mask"][i].sum())
            alone = sentence_embeddings(model, {k: v[i:i + 1, :n] for k, v in b.items()})
            assert_rel_close(together[i:i + 1], alone, 1e-5, f"sentence {i}")


@pytest.mark.parametrize("method", ["lion-lit", "lion-d", "lion-s"])
def test_the_three_forms_give_one_model(method):
    b = batch()
    outs = {}
    for form in ("parallel", "chunk", "recurrent"):
        model = linearize.convert(tiny_bert().double(), method, form=form, chunk_size=3)
        with torch.no_grad():
            outs[form] = model(**b).last_hidden_state
    for form in ("chunk", "recurrent"):
        assert_rel_close(outs[form], outs["parallel"], 1e-10, form)


def test_kept_softmax_layers_are_the_teachers_bidirectional_attention():
    teacher = tiny_bert()
    model = linearize.convert(copy.deepcopy(teacher), "lion-d", softmax_layers=[0, 1])
    assert not lion_layers(model)
    b = batch()
    with torch.no_grad():
        assert_rel_close(model(**b).last_hidden_state, teacher(**b).last_hidden_state, 1e-5)
    half = linearize.convert(copy.deepcopy(teacher), "lion-d", softmax_layers=0.5)
    assert [m.layer_idx for m in lion_layers(half)] == [0] and half.linearize_spec["softmax_layers"] == [1]


def test_transfer_mode_passes_the_teachers_output_and_trains_only_lion():
    from linearize.train.encoder import transfer_losses

    teacher = tiny_bert()
    model = linearize.convert(copy.deepcopy(teacher), "lion-s")
    for p in model.parameters():
        p.requires_grad_(False)
    for p in lion_parameters(model):
        p.requires_grad_(True)
    b = batch()
    losses = transfer_losses(model, b)
    assert sorted(losses) == [0, 1] and all(x.item() > 0 for x in losses.values())
    sum(losses.values()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lion_parameters(model))
    # teacher forcing: with the recorder in place, the model computes the teacher's hidden states
    from linearize.models.attention import TransferRecorder

    recorder = TransferRecorder("heads")
    for m in lion_layers(model):
        m.transfer = recorder
    with torch.no_grad():
        forced = model(**b).last_hidden_state
    for m in lion_layers(model):
        m.transfer = None
    with torch.no_grad():
        assert_rel_close(forced, teacher(**b).last_hidden_state, 1e-5)


def test_positions_beyond_the_table_are_clamped_or_refused():
    model = linearize.convert(tiny_bert(max_positions=64), "lion-s")
    ids = torch.randint(2, 128, (1, 100))
    with torch.no_grad():
        long = model.embeddings(input_ids=ids)  # through the hook: ids 0..63 then 63, 63, ...
        short = model.embeddings(input_ids=ids[:, :64])
        assert torch.equal(long[:, :64], short)
        explicit = model.embeddings(input_ids=ids, position_ids=torch.arange(100).clamp(max=63)[None])
        assert torch.equal(long, explicit)
        assert model(input_ids=ids).last_hidden_state.shape == (1, 100, HIDDEN)
    strict = linearize.convert(tiny_bert(max_positions=64), "lion-s", positions="error")
    with pytest.raises(ValueError, match="100 tokens is longer than the encoder's 64 absolute positions"):
        strict(input_ids=ids)


def test_unknown_variant_method_or_model_is_named():
    with pytest.raises(ValueError, match=r"unknown method 'lion-x'"):
        linearize.convert(tiny_bert(), "lion-x")
    with pytest.raises(ValueError, match=r"variant must be one of \('lit', 'd', 's'\), got 'q'"):
        LionConfig(variant="q").validate()
    with pytest.raises(ValueError, match=r"variant 's' contradicts method 'lion-d'"):
        linearize.convert(tiny_bert(), "lion-d", variant="s")
    with pytest.raises(ValueError, match=r"method 'lizard' is for causal LMs; an encoder converts with one of"):
        linearize.convert(tiny_bert(), "lizard")
    with pytest.raises(ValueError, match=r"unknown override\(s\) \['sink_kind'\]"):
        method_config("lion-s", sink_kind="kv")
    with pytest.raises(ValueError, match=r"sinks must be an int >= 0 .* got -1"):
        method_config("lion-s", sinks=-1)
    with pytest.raises(ValueError, match=r"window must be an int >= 0 .* got True"):
        method_config("lion-s", window=True)
    with pytest.raises(ValueError, match=r"form must be one of .* got 'fast'"):
        method_config("lion-s", form="fast")
    from fixtures import llama

    with pytest.raises(ValueError, match=r"LION methods convert encoders; LlamaForCausalLM .* 'llama'"):
        linearize.convert(llama(), "lion-s")


def test_bad_mask_reaching_a_lion_layer_is_named():
    model = linearize.convert(tiny_bert(), "lion-lit")
    layer = lion_layers(model)[0]
    x = torch.randn(2, 7, HIDDEN)
    with pytest.raises(ValueError, match=r"2-D padding mask \(B, 7\), got shape \(2, 1, 7, 7\)"):
        layer(x, attention_mask=torch.ones(2, 1, 7, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"valid must hold only 0 and 1, got \[3\]"):
        layer(x, attention_mask=torch.full((2, 7), 3))


def test_mean_pool_ignores_padding():
    h = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert torch.allclose(mean_pool(h, mask)[0], h[0, :2].mean(0))


# ------------------------------------------------------------------------- the bundled MiniLM


@pytest.fixture(scope="module")
def minilm():
    return linearize.load_teacher("minilm-l6")


def test_minilm_is_the_bundled_fp32_bert(minilm):
    model, tokenizer = minilm
    assert type(model).__name__ == "BertModel" and model.linearize_base == "minilm-l6"
    assert sum(p.numel() for p in model.parameters()) == 22_713_216
    assert next(model.parameters()).dtype == torch.float32 and tokenizer is not None
    e = embed(model, tokenizer, ["A man is playing a guitar.", "Someone plays an instrument.", "The stock fell."])
    assert torch.allclose(e.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert e[0] @ e[1] > e[0] @ e[2]  # the teacher is a real sentence encoder


def test_stage2_targets_pooled_from_the_teachers_hidden_states_are_its_embeddings(minilm):
    """Stage 2 pools its targets from the teacher's forward on each trimmed, length-bucketed batch
    (the hidden-state term runs it anyway) instead of embedding every training sentence first: that
    must be the embedding the evaluation compares against."""
    from linearize.train.encoder import BucketedRows, length_buckets, tokenize_sentences

    model, tokenizer = minilm
    sents = ["A man is playing a guitar on the street.", "Someone plays an instrument.", "The stock fell.",
             "Rain is expected over the northern hills by the end of the week, the forecast says.",
             "She wrote three books.", "The committee met again on Tuesday to discuss the budget."]
    rows = tokenize_sentences(tokenizer, sents, 64)
    buckets = BucketedRows(rows, length_buckets(rows, 3, seed=0))
    reference = embed(model, tokenizer, sents)
    for j in range(len(buckets)):
        b = buckets.batch([j])
        assert b["input_ids"].shape[1] < 64  # trimmed to its longest sentence
        with torch.no_grad():
            hidden = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                           output_hidden_states=True).hidden_states
        pooled = torch.nn.functional.normalize(mean_pool(hidden[-1], b["attention_mask"]), dim=-1)
        assert_rel_close(pooled, reference[b["index"]], 1e-5)


@pytest.mark.parametrize("exact", [{}, {"sinks": 1, "window": 2, "asymmetric": True},
                                   {"sinks": 1, "window": 2, "asymmetric": True, "feature_map": "taylor"},
                                   {"sinks": 1, "window": 2, "feature_map": "taylor+hedgehog", "feature_dim": 16}])
def test_converted_minilm_round_trips_exactly(minilm, tmp_path, exact):
    from linearize.models.lora import add_lora

    model = linearize.convert(copy.deepcopy(minilm[0]), "lion-s", chunk_size=16, **exact)
    add_lora(model, rank=2, targets=["query", "value", "dense"])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # move every added weight off its initial value, so the test sees them
        for name, p in model.named_parameters():
            if ".lion." in name or "lora_" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    linearize.save(model, tmp_path / "ckpt")
    loaded, tokenizer = linearize.load(tmp_path / "ckpt")
    assert tokenizer is not None
    assert loaded.linearize_spec == model.linearize_spec and loaded.linearize_lora == model.linearize_lora
    a, b = model.state_dict(), loaded.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    sents = ["LION reads the whole sentence in both directions.", "Short one."]
    assert torch.equal(embed(model, tokenizer, sents), embed(loaded, tokenizer, sents))


def test_merged_minilm_export_loads_without_the_base(minilm, tmp_path):
    from linearize.models.lora import add_lora

    model = linearize.convert(copy.deepcopy(minilm[0]), "lion-d")
    add_lora(model, rank=2, targets=["query", "dense"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    linearize.save(model, tmp_path / "merged", merged=True)
    loaded, tokenizer = linearize.load(tmp_path / "merged")
    assert type(loaded).__name__ == "BertModel" and getattr(loaded, "linearize_lora", None) is None
    sents = ["Merged weights fold LoRA into the projections.", "Two sentences."]
    assert_rel_close(embed(loaded, tokenizer, sents), embed(model, tokenizer, sents), 1e-5)


def _tiny_encoder_dir(tmp_path):
    """A 2-layer BERT with MiniLM's tokenizer, saved as a local model directory (a teacher by path)."""
    import shutil

    from transformers import BertConfig, BertModel

    from linearize.models.teacher import BUNDLED_TEACHERS

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=H,
                        intermediate_size=128, max_position_embeddings=128)
    path = tmp_path / "tiny-bert"
    BertModel(config).eval().save_pretrained(path)
    asset = BUNDLED_TEACHERS["minilm-l6"].asset_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(asset / name, path / name)
    return path


@pytest.mark.slow
def test_encoder_training_runs_both_stages_saves_and_resumes(tmp_path):
    from linearize.train import TrainConfig
    from linearize.train.encoder import run_encoder

    words = ["red", "green", "old", "new", "small", "large", "quiet", "busy", "warm", "cold"]
    things = ["house", "river", "garden", "station", "bridge", "market", "school", "harbour"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"The {a} {b} near the {c} {d} was closed today."
                               for a in words for b in things for c in words[:4] for d in things[:3]))
    config = TrainConfig(method="lion-s", model=str(_tiny_encoder_dir(tmp_path)), data=str(corpus),
                         out=str(tmp_path / "run"), seq_len=24, val_rows=8, batch_size=4, stage1_tokens=150,
                         stage2_tokens=150, lora_rank=2, distill=0.5, relational=0.5, relational_bank=16, eval_every=1,
                         save_every=1, device="cpu", progress=False)
    out = run_encoder(config)
    summary = json.loads((out / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == ["stage1", "stage2"]
    assert summary["stages"][0]["steps"] == summary["stages"][1]["steps"] >= 2  # same token budget
    assert 0 < summary["val"]["mean_cosine"] <= 1 and (out / "stage1_layer_mse.png").is_file()
    assert summary["relational_bank"] == 16
    stage2 = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"stage2"' in line]
    assert all(r["relational"] > -1e-6 for r in stage2 if r["split"] == "train"), [r.get("relational") for r in stage2]
    model, tokenizer = linearize.load(out)
    assert model.linearize_lora["targets"] == ["query", "key", "value", "dense"]
    before = (out / "adapter.safetensors").read_bytes()
    run_encoder(config, resume=True)  # a finished run resumes to the same checkpoint
    assert (out / "adapter.safetensors").read_bytes() == before
    changed = TrainConfig(**{**config.to_dict(), "stage2_lr": 1.0})
    with pytest.raises(ValueError, match=r"settings \['stage2_lr'\] differ"):
        run_encoder(changed, resume=True)
    with pytest.raises(ValueError, match="trains the LION methods"):
        run_encoder(TrainConfig(**{**config.to_dict(), "method": "lizard", "out": str(tmp_path / "x")}))


def _unit(n, d=16, seed=0):
    return torch.nn.functional.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed),
                                                     dtype=torch.float64), dim=-1)


@pytest.mark.parametrize("temperature", [0.02, 0.05, 1.0])
def test_relational_loss_is_zero_only_when_the_student_matches_and_its_gradient_flows(temperature):
    from linearize.train.encoder import relational_loss

    teacher, bank = _unit(6), _unit(40, seed=1)
    own = torch.zeros(6, 40, dtype=torch.bool)
    own[0, 3] = own[2, 7] = True  # rows 0 and 2 are themselves in the bank
    for exclude in (None, own):
        assert float(relational_loss(teacher, teacher, bank, temperature, exclude=exclude)) == pytest.approx(0, abs=1e-12)
    student = torch.nn.functional.normalize(teacher + 0.1 * _unit(6, seed=2), dim=-1).requires_grad_(True)
    loss = relational_loss(student, teacher, bank, temperature, exclude=own)
    assert loss.item() > 0
    loss.backward()
    assert torch.isfinite(student.grad).all() and student.grad.abs().sum() > 0
    # a smaller temperature weighs the same error more (the ranking near the top matters more)
    if temperature < 1.0:
        assert loss.item() > float(relational_loss(student.detach(), teacher, bank, 1.0, exclude=own))


def test_relational_loss_ignores_excluded_bank_entries():
    from linearize.train.encoder import relational_loss

    teacher, bank = _unit(4), _unit(30, seed=1)
    student = torch.nn.functional.normalize(teacher + 0.2 * _unit(4, seed=2), dim=-1)
    own = torch.zeros(4, 30, dtype=torch.bool)
    own[:, 5] = True
    moved = bank.clone()
    moved[5] = _unit(1, seed=9)[0]  # what an excluded entry holds cannot matter
    assert float(relational_loss(student, teacher, bank, 0.05, exclude=own)) == pytest.approx(
        float(relational_loss(student, teacher, moved, 0.05, exclude=own)), rel=1e-5)
    keep = [i for i in range(30) if i != 5]
    assert float(relational_loss(student, teacher, bank, 0.05, exclude=own)) == pytest.approx(
        float(relational_loss(student, teacher, bank[keep], 0.05)), rel=1e-5)


def test_relational_bank_takes_training_sentences_only():
    from linearize.data.sentences import load_sentences, sentence_split
    from linearize.train.encoder import relational_bank

    source = ("The weather was cold and the harbour stayed closed all week. " * 1 + " ".join(
        f"Sentence number {i} talks about the {w} garden near the old station." for i in range(300)
        for w in ["green"]))
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.txt"
        path.write_text(source)
        train = load_sentences(str(path), split="train")
        held = load_sentences(str(path), split="val") + load_sentences(str(path), split="test")
    assert train and held and {sentence_split(s) for s in train} == {"train"}
    targets = _unit(len(train), seed=3)
    bank = relational_bank(train, targets, 10)
    assert torch.equal(bank, targets[:10]) and not bank.requires_grad
    with pytest.raises(ValueError, match="training sentences only"):
        relational_bank([held[0], *train], torch.cat([_unit(1), targets]), 5)
    with pytest.raises(ValueError, match="needs as many"):
        relational_bank(train, targets, len(train) + 1)


def test_length_buckets_cover_every_row_once_and_cut_padding():
    from linearize.train.encoder import BucketedRows, SentenceRows, length_buckets

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 60, (500,), generator=g)
    mask = (torch.arange(64).unsqueeze(0) < lengths.unsqueeze(1)).long()
    rows = SentenceRows(torch.randint(2, 100, (500, 64), generator=g) * mask, mask, torch.randn(500, 8))
    buckets = length_buckets(rows, 32, seed=0, pool=8)
    assert sorted(i for b in buckets for i in b) == list(range(500))
    assert all(len(b) == 32 for b in buckets[:-1]) and buckets == length_buckets(rows, 32, seed=0, pool=8)
    served = BucketedRows(rows, buckets)
    assert len(served) == len(buckets)
    batch = served.batch([3])
    assert batch["index"].tolist() == buckets[3] and torch.equal(batch["targets"], rows.targets[buckets[3]])
    assert torch.equal(batch["input_ids"], rows.input_ids[buckets[3], :batch["input_ids"].shape[1]])

    def padding(bs):
        return sum(int(lengths[b].max()) * len(b) for b in bs) / int(lengths.sum())

    random_batches = [list(range(i, min(i + 32, 500))) for i in range(0, 500, 32)]
    assert padding(buckets) < 1.2 < 1.5 < padding(random_batches)
