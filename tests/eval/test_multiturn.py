"""Multi-turn driver: questions split per key, the cache carried across turns, positions right after eviction."""

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

from kvcert import EvictionConfig, ValidationConfig
from kvcert.eval import Sample, prompt_ids
from kvcert.eval.multiturn import converse, dialogue_ids, split_queries
from kvcert.evict import H2O, StreamingLLM
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models import tiny_random

torch.set_num_threads(1)

QUESTION = "What are all the special magic numbers for red-fox, blue-owl, and tall-elm mentioned in the provided text?"
PREFIX = " The special magic numbers for red-fox, blue-owl, and tall-elm mentioned in the provided text are"


def _sample(prompt=f"Some text.\nMore text.\n{QUESTION}", prefix=PREFIX):
    return Sample("niah_multiquery", 0, prompt, prefix, ("111", "222", "333"), 100, 128)


def test_split_queries_asks_each_key_in_turn():
    turns = split_queries(_sample())
    assert [t.outputs for t in turns] == [("111",), ("222",), ("333",)]
    assert turns[0].prompt == (
        "Some text.\nMore text.\nWhat are all the special magic numbers for red-fox mentioned in the provided text?"
    )
    assert turns[2].prompt == "What are all the special magic numbers for tall-elm mentioned in the provided text?"
    assert turns[1].answer_prefix == " The special magic numbers for blue-owl mentioned in the provided text are"
    with pytest.raises(ValueError, match="NIAH question"):
        split_queries(_sample(prompt="Some text.\nWhat is this?"))
    with pytest.raises(ValueError, match="answer prefix"):
        split_queries(_sample(prefix=" The answer is"))


def test_dialogue_ids_continue_the_chat_template(smol_dir):
    tok = AutoTokenizer.from_pretrained(smol_dir, local_files_only=True)
    turns = split_queries(_sample())
    ids = dialogue_ids(tok, turns)
    assert torch.equal(ids[0], prompt_ids(tok, turns[0]))
    whole = tok.apply_chat_template(
        [
            {"role": "user", "content": turns[0].prompt},
            {"role": "assistant", "content": "X"},
            {"role": "user", "content": turns[1].prompt},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    second = tok.decode(ids[1][0])
    assert second.startswith(tok.eos_token) and second.endswith(turns[1].answer_prefix)
    assert second[: -len(turns[1].answer_prefix)] == whole[whole.rindex("X") + 1 :]


def _segments(model, lengths=(30, 6, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, model.config.vocab_size, (1, n), generator=g) for n in lengths]


def _replay_mask(lengths, generated, budget=None, sinks=0):
    """The full token order of the conversation and, per position, what the cache let it see: everything
    causal without eviction; with StreamingLLM(sinks) at ``budget``, a forward starting at ``a`` sees the
    sinks, the ``budget − sinks`` positions before ``a`` and its own tokens up to itself."""
    forwards, pos = [], 0
    for n, gen in zip(lengths, generated, strict=True):
        forwards.append((pos, n))
        pos += n
        for _ in gen:
            forwards.append((pos, 1))
            pos += 1
    total = pos
    visible = torch.zeros(total, total, dtype=torch.bool)
    for i, (a, n) in enumerate(forwards):
        for t in range(a, a + n):
            visible[t, : t + 1] = True
            if budget is not None and i > 0 and a > budget:
                visible[t, sinks : a - (budget - sinks)] = False
    return visible


def _reference_logits(model, segments, conv, visible):
    """Logits of a full forward over the whole conversation under ``visible``, at each generating position."""
    seq, rows, pos = [], [], 0
    for seg, gen in zip(segments, conv.tokens, strict=True):
        seq.append(seg[0])
        pos += seg.shape[1]
        rows += range(pos - 1, pos - 1 + len(gen))
        seq.append(torch.tensor(gen))
        pos += len(gen)
    ids = torch.cat(seq)[None]
    mask = torch.zeros(1, 1, *visible.shape).masked_fill(~visible[: ids.shape[1], : ids.shape[1]], float("-inf"))
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits[0, rows]


def test_cache_is_carried_across_turns_with_logical_positions():
    """Without eviction the conversation equals one causal forward over all turns and answers (positions
    keep counting across turns) and a plain DynamicCache; a budget above the conversation changes nothing."""
    model = tiny_random("llama", head_dim=32)
    segments = _segments(model)
    dense = converse(model, DynamicCache(config=model.config), segments, max_new_tokens=4)
    cache = CertifiedCache(model, keys="none", values="none", validation=ValidationConfig(certify=False))
    plain = converse(model, cache, segments, max_new_tokens=4)
    cache.detach()
    assert plain.tokens == dense.tokens and [len(t) for t in plain.tokens] == [4, 4, 4]
    assert cache.get_seq_length() == sum(s.shape[1] for s in segments) + 4 * 3 - 1  # the last token is not fed
    lengths = [s.shape[1] for s in segments]
    ref = _reference_logits(model, segments, plain, _replay_mask(lengths, plain.tokens))
    assert torch.allclose(torch.cat(plain.logits), ref, atol=1e-4, rtol=0)
    roomy = CertifiedCache(
        model,
        keys="none",
        values="none",
        validation=ValidationConfig(certify=False),
        eviction=EvictionConfig.decode_budget(H2O(recent=2), 200),
    )
    same = converse(model, roomy, segments, max_new_tokens=4)
    roomy.detach()
    assert same.tokens == plain.tokens
    assert all(torch.equal(a, b) for a, b in zip(same.logits, plain.logits, strict=True))


def test_eviction_at_turn_one_is_carried_into_later_turns():
    """StreamingLLM at a budget below the context: every later turn must see exactly the sinks, the most
    recent positions and its own tokens — one full forward with that mask gives the same logits."""
    model = tiny_random("llama", head_dim=32)
    segments = _segments(model, seed=1)
    budget, sinks = 12, 2
    cache = CertifiedCache(
        model,
        keys="none",
        values="none",
        validation=ValidationConfig(certify=False),
        eviction=EvictionConfig.decode_budget(StreamingLLM(sinks=sinks), budget),
    )
    conv = converse(model, cache, segments, max_new_tokens=3)
    cache.detach()
    lengths = [s.shape[1] for s in segments]
    visible = _replay_mask(lengths, conv.tokens, budget, sinks)
    causal = _replay_mask(lengths, conv.tokens)
    assert int((causal & ~visible).sum()) > 100  # eviction hides real positions from later turns
    ref = _reference_logits(model, segments, conv, visible)
    assert torch.allclose(torch.cat(conv.logits), ref, atol=1e-4, rtol=0)
    unevicted = _reference_logits(model, segments, conv, causal)
    assert not torch.allclose(torch.cat(conv.logits), unevicted, atol=1e-3, rtol=0)
    assert cache.telemetry().evicted_entries > 0
    kept = cache.kept_positions(0)
    assert kept.shape[-1] <= budget + 1 and int(kept[..., :sinks].max()) == sinks - 1


def test_converse_rejects_bad_segments():
    model = tiny_random("llama", head_dim=32)
    with pytest.raises(ValueError, match="segment"):
        converse(model, DynamicCache(config=model.config), [], max_new_tokens=2)
    with pytest.raises(ValueError, match="segment"):
        converse(model, DynamicCache(config=model.config), [torch.zeros(5, dtype=torch.long)], max_new_tokens=2)
