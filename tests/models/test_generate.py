"""``linearize.models.generate.generate_text``: the one generation path of the CLI, the demo and passkey."""

from __future__ import annotations

import pytest

import fixtures
import linearize
from linearize.models.generate import EmptyPromptError, check_sampling, generate_text

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog, and then"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return linearize.load_teacher(str(fixtures.tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")))


def test_a_string_gives_a_string_and_a_batch_matches_each_prompt_alone(teacher):
    model, tokenizer = teacher
    alone = [generate_text(model, tokenizer, p, max_new_tokens=6) for p in PROMPTS]
    assert all(isinstance(text, str) and text for text in alone)
    assert generate_text(model, tokenizer, PROMPTS, max_new_tokens=6) == alone  # left padding changes nothing


def test_the_tokenizer_is_left_as_it_was(teacher):
    model, tokenizer = teacher
    before = tokenizer.padding_side, tokenizer.pad_token
    generate_text(model, tokenizer, PROMPTS, max_new_tokens=2)
    assert (tokenizer.padding_side, tokenizer.pad_token) == before


def test_sampling_is_seeded(teacher):
    model, tokenizer = teacher
    kw = dict(max_new_tokens=6, temperature=1.0, top_p=0.9)
    assert generate_text(model, tokenizer, PROMPTS, seed=1, **kw) == generate_text(model, tokenizer, PROMPTS, seed=1, **kw)


@pytest.mark.parametrize("kwargs, named", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"),
])
def test_bad_settings_are_named(kwargs, named):
    settings = {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, **kwargs}
    with pytest.raises(ValueError, match=named):
        check_sampling(**settings)


def test_empty_prompt_is_named_by_position(teacher):
    model, tokenizer = teacher
    with pytest.raises(EmptyPromptError, match="prompt 2") as info:
        generate_text(model, tokenizer, ["Hello", ""], max_new_tokens=2)
    assert info.value.positions == [2]
