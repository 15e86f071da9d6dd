"""Fixtures the training tests share: a tiny local model and a folder of real prose."""

from __future__ import annotations

import pytest

from fixtures import tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama of three layers, saved with the bundled tokenizer."""
    return str(tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", num_layers=3))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """Real prose in several documents (a folder of .txt files)."""
    folder = tmp_path_factory.mktemp("text")
    from linearize.data.sources import shakespeare_plays

    for i, body in enumerate(shakespeare_plays()[:4]):
        (folder / f"{i}.txt").write_text(body[:6000])
    return str(folder)
