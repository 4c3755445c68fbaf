"""Streaming multi-turn question answering over one long context, with the cache carried across turns.

A RULER ``niah_multiquery`` / ``niah_multikey`` style sample asks for several needles at once. Here its
final question is split into one question per key, asked in turn in one conversation: turn 1 is the
context followed by the first question, every later turn only its question, and the generated answers stay
in the conversation. The KV cache is never reset, so whatever an eviction policy dropped while answering
turn 1 is gone for turn 3 — the regime where arrival-time eviction decisions hurt (``docs/eviction.md#policies``).

Questions and answer prefixes are RULER's own template with a single key (``What are all the special
magic numbers for <key> mentioned in the provided text?`` / ``The special magic numbers for <key>
mentioned in the provided text are``), i.e. the wording of RULER's single-needle tasks; each turn is
scored with RULER's metric against its own needle value. Every number is **empirical**.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import Cache, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from kvcert.eval.harness import chat_text, prompt_ids
from kvcert.eval.ruler import Sample
from kvcert.integrations.transformers import CertifiedCache

_QUESTION = re.compile(r"^(?P<head>.* for )(?P<keys>.+?)(?P<tail> mentioned in the provided text\?)$")
_KEY_SEP = re.compile(r",\s*(?:and\s+)?|\s+and\s+")
_MARK = "\u0000kvcert-answer\u0000"


def split_queries(sample: Sample) -> list[Sample]:
    """One single-key turn per key of ``sample``'s final question (in the question's order).

    Turn 1's prompt is the context plus its question; later turns hold only their question. Each turn's
    ``outputs`` is the one needle value of its key. ``ValueError`` if the last line is not a RULER NIAH
    question over as many keys as ``outputs`` has values.
    """
    context, _, question = sample.prompt.rpartition("\n")
    match = _QUESTION.match(question)
    keys = _KEY_SEP.split(match["keys"]) if match else []
    if match is None or not context or len(keys) != len(sample.outputs) or len(keys) < 2:
        raise ValueError(
            f"{sample.task}#{sample.index}: the last line is not a NIAH question over "
            f"{len(sample.outputs)} keys: {question!r}"
        )
    if match["keys"] not in sample.answer_prefix:
        raise ValueError(f"{sample.task}#{sample.index}: answer prefix does not name the keys")
    turns = []
    for j, (key, value) in enumerate(zip(keys, sample.outputs, strict=True)):
        ask = f"{match['head']}{key}{match['tail']}"
        turns.append(
            dataclasses.replace(
                sample,
                prompt=f"{context}\n{ask}" if j == 0 else ask,
                outputs=(value,),
                answer_prefix=sample.answer_prefix.replace(match["keys"], key),
            )
        )
    return turns


def dialogue_ids(tok: PreTrainedTokenizerBase, turns: Sequence[Sample]) -> list[torch.Tensor]:
    """Token ids ``[1, n_j]`` to feed at the start of each turn (the answers are generated in between).

    Turn 1 is RULER's protocol prompt (``prompt_ids``). A later turn is what the chat template puts between
    the previous assistant answer and this turn's generation prompt (the end of the assistant turn, the user
    turn), then the turn's answer prefix; without a chat template, a blank line, the question and the prefix.
    """
    out = [prompt_ids(tok, turns[0])]
    for j in range(1, len(turns)):
        if getattr(tok, "chat_template", None):
            messages = []
            for t in turns[:j]:  # earlier answers are generated, not templated: only the text after the last one
                messages += [{"role": "user", "content": t.prompt}, {"role": "assistant", "content": _MARK}]
            messages.append({"role": "user", "content": turns[j].prompt})
            text = chat_text(tok, messages)
            text = text[text.rindex(_MARK) + len(_MARK) :] + turns[j].answer_prefix
        else:
            text = "\n\n" + turns[j].prompt + turns[j].answer_prefix
        out.append(tok(text, add_special_tokens=False, return_tensors="pt").input_ids)
    return out


@dataclass(frozen=True)
class Conversation:
    """Per turn: the greedy tokens generated and the logits ``[n, V]`` that chose each of them."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]


@torch.inference_mode()
def converse(
    model: PreTrainedModel,
    cache: Cache,
    segments: Sequence[torch.Tensor],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    first_logits: torch.Tensor | None = None,
) -> Conversation:
    """Feed each turn's ``segments[j]`` ``[1, n_j]`` through ``cache`` in one forward, then decode greedily
    (up to ``max_new_tokens``, stopping before an EOS id); the generated tokens stay in the cache and the
    next turn continues after them (logical positions keep counting, whatever was evicted).

    ``first_logits[1, V]``: ``segments[0]`` is already in ``cache`` (e.g. ingested from a shared exact
    prefill) and these are its last-position logits. A ``CertifiedCache`` with decode-budget eviction gets
    ``set_kappa`` after every forward with the emitted-token probability (kind ``"emitted"``, greedy).
    """
    if not segments or max_new_tokens < 1 or any(s.dim() != 2 or s.shape[0] != 1 for s in segments):
        raise ValueError("need at least one [1, n] segment and max_new_tokens >= 1")
    kappa_to = (
        cache if isinstance(cache, CertifiedCache) and cache.evict is not None and cache.budget is not None else None
    )
    tokens: list[list[int]] = []
    chosen: list[torch.Tensor] = []

    def step(ids: torch.Tensor | None, logits: torch.Tensor | None = None) -> torch.Tensor:
        if ids is not None:
            logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        assert logits is not None
        if kappa_to is not None:
            kappa_to.set_kappa(torch.softmax(logits.to(torch.float64), -1).amax(-1))
        return logits

    for j, segment in enumerate(segments):
        logits = step(None, first_logits) if j == 0 and first_logits is not None else step(segment)
        toks: list[int] = []
        rows: list[torch.Tensor] = []
        while len(toks) < max_new_tokens:
            nxt = int(logits[0].argmax())
            if nxt in eos_ids:
                break
            toks.append(nxt)
            rows.append(logits[0])
            if len(toks) < max_new_tokens or j + 1 < len(segments):
                logits = step(torch.tensor([[nxt]]))
        tokens.append(toks)
        chosen.append(torch.stack(rows) if rows else torch.empty(0, logits.shape[-1]))
    return Conversation(tokens, chosen)
