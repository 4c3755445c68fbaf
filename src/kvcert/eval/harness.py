"""Generation and perplexity harness: run a model over RULER samples or a text with a caller-built cache.

``cache_factory(model)`` returns a fresh transformers ``Cache`` (or ``None`` for a plain
``DynamicCache``) per sample / per text, so a compressed cache can be compared with the uncompressed one
on exactly the same inputs. Scores follow RULER's protocol: the model's chat template (when it has one)
wraps the task text, RULER's answer prefix follows the assistant turn, decoding is greedy, and the number
of new tokens is the task's ``tokens_to_generate``. All numbers produced here are empirical-tier.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import Cache, DynamicCache, GenerationMixin, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from kvcert.eval.ruler import Sample, score

CacheFactory = Callable[[PreTrainedModel], Cache | None]


@dataclass(frozen=True)
class Prediction:
    """One generated answer with its RULER score in [0, 1]."""

    task: str
    index: int
    text: str
    score: float
    prompt_tokens: int
    new_tokens: int
    seconds: float
    tier: str = "empirical"


@dataclass(frozen=True)
class PerplexityResult:
    """Teacher-forced perplexity ``exp(mean NLL)`` over ``tokens_scored`` tokens read through the cache."""

    ppl: float
    mean_nll: float
    tokens_scored: int
    context: int
    prefix: int
    stride: int
    tier: str = "empirical"


def _fresh_cache(model: PreTrainedModel, cache_factory: CacheFactory | None) -> Cache:
    cache = cache_factory(model) if cache_factory is not None else None
    if cache is None:
        return DynamicCache(config=model.config)
    if not isinstance(cache, Cache):
        raise ValueError(f"cache_factory must return a transformers Cache or None, not {type(cache).__name__}")
    return cache


def chat_text(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    """``messages`` through ``tok``'s chat template with the generation prompt, as text (``TypeError`` if the
    template does not return text)."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):
        raise TypeError(f"the chat template returned {type(text).__name__}, not text")
    return text


def decode_text(tok: PreTrainedTokenizerBase, ids: list[int] | torch.Tensor, skip_special: bool = True) -> str:
    """The text of one sequence of token ids (special tokens skipped unless ``skip_special=False``;
    ``TypeError`` if ``tok`` returns a batch: ``ids`` must be one sequence)."""
    text = tok.decode(ids, skip_special_tokens=skip_special)
    if not isinstance(text, str):
        raise TypeError(f"decode returned {type(text).__name__}: pass one sequence of token ids")
    return text


def prompt_ids(tok: PreTrainedTokenizerBase, sample: Sample) -> torch.Tensor:
    """Token ids ``[1, T]`` of ``sample`` under RULER's protocol.

    With a chat template: ``template(user: prompt, generation prompt) + answer_prefix`` (the template
    already holds its special tokens, so none are added); without one: the tokenizer's encoding of
    ``prompt + answer_prefix`` with its default special tokens.
    """
    if getattr(tok, "chat_template", None):
        text = chat_text(tok, [{"role": "user", "content": sample.prompt}])
        ids = tok(text + sample.answer_prefix, add_special_tokens=False, return_tensors="pt").input_ids
    else:
        ids = tok(sample.input, return_tensors="pt").input_ids
    return ids


@torch.inference_mode()
def generate_answers(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    samples: Sequence[Sample],
    cache_factory: CacheFactory | None = None,
    max_new_tokens: int | None = None,
    progress: bool = True,
    on_sample: Callable[[Cache], None] | None = None,
) -> list[Prediction]:
    """Greedy answers to ``samples``, each decoded with a fresh cache from ``cache_factory``.

    ``max_new_tokens`` overrides the per-task RULER budget when given. ``on_sample(cache)`` is called
    after each sample with the cache that served it (for telemetry).
    """
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not isinstance(model, GenerationMixin):
        raise ValueError(f"{type(model).__name__} cannot generate (no GenerationMixin): load a causal LM")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out: list[Prediction] = []
    for sample in tqdm(samples, desc="generate", disable=not progress):
        ids = prompt_ids(tok, sample).to(model.device)
        cache = _fresh_cache(model, cache_factory)
        start = time.perf_counter()
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=max_new_tokens or sample.max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
        )
        seconds = time.perf_counter() - start
        new = gen[0, ids.shape[1] :]
        text = decode_text(tok, new)
        out.append(
            Prediction(
                task=sample.task,
                index=sample.index,
                text=text,
                score=score(sample, text),
                prompt_tokens=int(ids.shape[1]),
                new_tokens=int(new.numel()),
                seconds=seconds,
            )
        )
        if on_sample is not None:
            on_sample(cache)
    return out


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(-logp.gather(-1, targets.unsqueeze(-1)).double().sum())


@torch.inference_mode()
def perplexity(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    text: str,
    context: int,
    cache_factory: CacheFactory | None = None,
    stride: int | None = None,
    prefix: int | None = None,
) -> PerplexityResult:
    """Teacher-forced perplexity of the first ``context`` tokens of ``text`` with the cache in the loop.

    The first ``prefix`` tokens (default ``context // 2``) are prefilled into a fresh cache; the remaining
    ``context - prefix`` tokens are then fed in chunks of ``stride`` (default 1: one decode step per
    token) through that cache, so each scored logit is computed by attention over the cache's stored
    keys/values. Token ``t`` (``prefix <= t < context``) is scored by the logit at position ``t - 1``.
    Returns ``exp(mean NLL)`` over those ``context - prefix`` tokens.
    """
    ids = tok(text, return_tensors="pt").input_ids
    if context < 2:
        raise ValueError(f"context must be >= 2, got {context}")
    if ids.shape[1] < context:
        raise ValueError(f"text has {ids.shape[1]} tokens, fewer than context={context}")
    prefix = context // 2 if prefix is None else prefix
    if not 1 <= prefix < context:
        raise ValueError(f"prefix must be in [1, context), got {prefix}")
    stride = 1 if stride is None else stride
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    ids = ids[:, :context].to(model.device)
    cache = _fresh_cache(model, cache_factory)
    logits = model(ids[:, :prefix], cache=cache, use_cache=True).logits
    last = logits[:, -1]
    total = 0.0
    for start in range(prefix, context, stride):
        chunk = ids[:, start : min(start + stride, context)]
        out = model(chunk, cache=cache, use_cache=True).logits
        preds = torch.cat([last.unsqueeze(1), out[:, :-1]], dim=1)
        total += _nll_sum(preds, chunk)
        last = out[:, -1]
    n = context - prefix
    mean = total / n
    return PerplexityResult(
        ppl=math.exp(mean), mean_nll=mean, tokens_scored=n, context=context, prefix=prefix, stride=stride
    )
