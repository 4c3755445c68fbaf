import math

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

from kvcert.eval import generate_answers, load_corpus, load_task, perplexity, prompt_ids, score
from kvcert.eval.harness import decode_text
from kvcert.models import tiny_random


@pytest.fixture(scope="module")
def smol_tok(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir, local_files_only=True)


def test_generate_answers_smoke(smol_dir, smol_tok, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCERT_CACHE", str(tmp_path))
    samples = load_task("fwe", 512, 2, 0, smol_dir)
    model = tiny_random("llama", vocab_size=len(smol_tok))
    built, seen = [], []

    def factory(m):
        assert m is model
        built.append(DynamicCache(config=m.config))
        return built[-1]

    preds = generate_answers(
        model, smol_tok, samples, cache_factory=factory, max_new_tokens=3, progress=False, on_sample=seen.append
    )
    assert len(preds) == 2 and len(built) == 2 and built[0] is not built[1]
    assert seen == built
    for s, p, cache in zip(samples, preds, built, strict=True):
        assert (p.task, p.index) == (s.task, s.index)
        assert 1 <= p.new_tokens <= 3
        assert p.prompt_tokens == prompt_ids(smol_tok, s).shape[1]
        assert cache.get_seq_length() == p.prompt_tokens + p.new_tokens - 1
        assert p.score == score(s, p.text) and 0.0 <= p.score <= 1.0
    # None from the factory (or no factory) means a plain DynamicCache
    got = []
    generate_answers(
        model,
        smol_tok,
        samples[:1],
        cache_factory=lambda m: None,
        max_new_tokens=1,
        progress=False,
        on_sample=got.append,
    )
    assert type(got[0]) is DynamicCache


def test_prompt_follows_ruler_chat_protocol(smol_dir, smol_tok, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCERT_CACHE", str(tmp_path))
    s = load_task("fwe", 512, 1, 0, smol_dir)[0]
    text = smol_tok.decode(prompt_ids(smol_tok, s)[0])
    assert text.count("<|im_start|>user\n") == 1 and s.prompt in text
    assert text.endswith("<|im_start|>assistant\n" + s.answer_prefix)


def test_harness_rejects_bad_cache_and_budget(smol_tok):
    model = tiny_random("llama", vocab_size=len(smol_tok))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_answers(model, smol_tok, [], max_new_tokens=0)
    with pytest.raises(ValueError, match="cache_factory"):
        perplexity(model, smol_tok, "a b c d e f g h", 4, cache_factory=lambda m: object())


def test_generate_answers_refuses_a_model_that_cannot_generate(smol_tok):
    """A base model without a language-model head (no ``generate``) is refused up front, by name; it used to
    pass silently when there was nothing to answer and fail inside transformers otherwise."""
    base = tiny_random("llama", vocab_size=len(smol_tok)).model
    with pytest.raises(ValueError, match="LlamaModel cannot generate"):
        generate_answers(base, smol_tok, [])


def test_decode_text_is_one_string_or_a_clear_error(smol_tok):
    ids = smol_tok("hello world", add_special_tokens=False).input_ids
    assert decode_text(smol_tok, ids) == "hello world"
    assert decode_text(smol_tok, torch.tensor(ids)) == "hello world"
    with pytest.raises(TypeError, match="one sequence"):
        decode_text(smol_tok, [ids, ids])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize(("stride", "prefix"), [(1, None), (7, 10), (64, 1)])
def test_perplexity_through_cache_equals_direct_nll(smol_tok, family, stride, prefix):
    text = load_corpus("pg-essays")[:4000]
    context = 48
    model = tiny_random(family, vocab_size=len(smol_tok))
    res = perplexity(model, smol_tok, text, context, cache_factory=None, stride=stride, prefix=prefix)
    p = context // 2 if prefix is None else prefix
    ids = smol_tok(text, return_tensors="pt").input_ids[:, :context]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.double(), dim=-1)
    nll = -logp[0, p - 1 : context - 1].gather(-1, ids[0, p:].unsqueeze(-1)).mean().item()
    assert res.tokens_scored == context - p and res.tier == "empirical"
    assert res.mean_nll == pytest.approx(nll, abs=1e-5)
    assert res.ppl == pytest.approx(math.exp(nll), rel=1e-5)


def test_perplexity_argument_errors(smol_tok):
    model = tiny_random("llama", vocab_size=len(smol_tok))
    with pytest.raises(ValueError, match="context"):
        perplexity(model, smol_tok, "short text", 500)
    with pytest.raises(ValueError, match="prefix"):
        perplexity(model, smol_tok, "a b c d e f g h i j", 4, prefix=4)
    with pytest.raises(ValueError, match="stride"):
        perplexity(model, smol_tok, "a b c d e f g h i j", 4, stride=0)
