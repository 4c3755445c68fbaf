"""The calibration pass of a certificate-driven bit allocation (:mod:`kvcert.quant.bit_allocation`,
``docs/codecs.md#bit-allocation``).

Calibration prompts are windows of a natural-text corpus (:mod:`kvcert.eval.corpora`; ``kjv`` by default, not
RULER's haystack, so an allocation never sees the evaluation text) at seeded offsets. Each prompt is prefilled
once, exactly, and decoded greedily for ``steps`` tokens by one branch per candidate (:func:`run_branches`, gate
off, so every read's certificate is recorded and none is repaired):

* keys: one branch per dithered width ``b`` (values ``int8``, which a key certificate does not depend on); the
  coverage ``C_b[l, h]`` is the share of reads of KV head ``h`` of layer ``l`` whose certified meter is ``≤ τ`` in
  all its query heads, over every decode read of every prompt;
* values (with ``value_tol``): one branch per candidate value codec (keys ``dither-int8``); the share
  ``V_v[l, h]`` of the reads of KV head ``h`` of layer ``l`` whose certified value term is ``≤ value_tol`` in all
  its query heads.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvcert.cache.telemetry import Telemetry
from kvcert.eval.branching import Scheme, run_branches
from kvcert.eval.corpora import load_corpus
from kvcert.quant.bit_allocation import VALUE_CANDIDATES, Allocation, choose_key_bits, choose_values
from kvcert.quant.dither import DITHER_BITS

#: characters of corpus text taken per wanted token (the tokenizer then cuts the window to its exact length)
CHARS_PER_TOKEN = 8
KEY_BRANCH_VALUES = "int8"  # values of the key branches (a key certificate does not depend on them)
VALUE_BRANCH_KEYS = "dither-int8"  # keys of the value branches


@dataclass(frozen=True)
class Calibration:
    """What a calibration measured: ``key_coverage[b]`` ``[L, Hkv]`` per dithered width, ``value_share[v]``
    ``[L, Hkv]`` per value codec (empty without ``value_tol``), and the number of decode reads per KV head behind
    them."""

    key_coverage: dict[int, torch.Tensor]
    value_share: dict[str, torch.Tensor]
    reads: int


def calibration_ids(
    tokenizer: PreTrainedTokenizerBase, corpus: str, tokens: int, prompts: int, seed: int
) -> list[torch.Tensor]:
    """``prompts`` windows of ``tokens`` token ids ``[1, tokens]`` of ``corpus`` at offsets drawn from ``seed``;
    ``ValueError`` when the corpus is too short for one."""
    if tokens < 16 or prompts < 1:
        raise ValueError(f"tokens must be >= 16 and prompts >= 1, got tokens={tokens}, prompts={prompts}")
    text = load_corpus(corpus)
    span = tokens * CHARS_PER_TOKEN
    if len(text) <= span:
        raise ValueError(f"corpus {corpus!r} has {len(text)} characters, need more than {span} for --tokens")
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        start = rng.randrange(0, len(text) - span)
        ids = tokenizer(text[start : start + span], return_tensors="pt").input_ids[:, :tokens]
        if ids.shape[1] < tokens:
            raise ValueError(f"a window of {span} characters of {corpus!r} gave {ids.shape[1]} < {tokens} tokens")
        out.append(ids)
    return out


def _kv_head_within(tel: Telemetry, per_cell: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(reads within, recorded reads)`` per KV head ``[L, Hkv]``: a read of a KV head is within when
    ``per_cell[step, layer, row, query head] ≤ limit`` in every one of its query heads."""
    s, n_layers, b, hq = per_cell.shape
    g = tel.group_size
    rec = tel.recorded.reshape(s, n_layers, b, hq // g, g).all(-1)
    ok = (per_cell.reshape(s, n_layers, b, hq // g, g) <= limit).all(-1) & rec
    return ok.sum((0, 2)).to(torch.float64), rec.sum((0, 2)).to(torch.float64)


def kv_head_certified(tel: Telemetry, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(certified, recorded)`` read counts ``[L, Hkv]`` of a telemetry: a read of a KV head is certified when every
    one of its query heads' certificate is ``≤ tau`` (what ``Gate.certified(tau)`` serves without paging in)."""
    return _kv_head_within(tel, tel.certificates, tau)


def kv_head_value_share(tel: Telemetry, value_tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(reads with value term ≤ value_tol in every query head, recorded reads)`` per KV head ``[L, Hkv]`` (what a
    gate with ``value_tol`` serves without promoting that head's values)."""
    assert tel.value_term is not None  # every certified read records it
    return _kv_head_within(tel, tel.value_term, value_tol)


def check_calibration(steps: int, tau: float, widths: Sequence[int], value_tol: float | None) -> None:
    """``ValueError`` naming the argument unless ``steps ≥ 2`` (the first token comes from the exact prefill, so
    ``steps`` greedy tokens make ``steps − 1`` reads of the compressed cache, and a calibration needs one),
    ``0 ≤ tau ≤ 1`` (a bound on a total variation: at ``tau = 1`` every width already certifies every read),
    ``value_tol`` (when given) is finite and ``≥ 0``, and ``widths`` are dithered widths."""
    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the first token comes from the exact prefill), got {steps}")
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau must be in [0, 1] (a bound on a total variation, as a certified gate's), got {tau}")
    if not widths or any(b not in DITHER_BITS for b in widths):
        raise ValueError(f"widths must be dithered widths {DITHER_BITS}, got {tuple(widths)}")
    if value_tol is not None and not 0.0 <= value_tol < float("inf"):
        raise ValueError(f"value_tol must be a finite number >= 0, got {value_tol}")


def calibrate(
    model: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    *,
    steps: int,
    tau: float,
    widths: Sequence[int] = DITHER_BITS,
    values: Sequence[str] = VALUE_CANDIDATES,
    value_tol: float | None = None,
    seed: int = 0,
    tick: Callable[[int], None] | None = None,
) -> Calibration:
    """Measure the coverages of the module doc on ``prompts`` (``tick`` is called once per prompt)."""
    check_calibration(steps, tau, widths, value_tol)
    key_schemes = [Scheme(f"keys:{b}", f"dither-int{b}", KEY_BRANCH_VALUES) for b in widths]
    value_schemes = [] if value_tol is None else [Scheme(f"values:{v}", VALUE_BRANCH_KEYS, v) for v in values]
    sums: dict[str, list[torch.Tensor]] = {}
    for i, ids in enumerate(prompts):
        for r in run_branches(model, ids, key_schemes + value_schemes, steps, [], seed):
            tel = r.telemetry
            assert tel is not None  # every branch is a kvcert scheme
            if value_tol is not None and r.scheme.name.startswith("values:"):
                got = kv_head_value_share(tel, value_tol)
            else:
                got = kv_head_certified(tel, tau)
            prev = sums.get(r.scheme.name)
            sums[r.scheme.name] = list(got) if prev is None else [prev[0] + got[0], prev[1] + got[1]]
        if tick is not None:
            tick(i)

    def share(name: str) -> torch.Tensor:
        ok, rec = sums[name]
        if not bool((rec > 0).all()):
            raise ValueError("a layer or KV head recorded no read: calibrate with more --steps or --tokens")
        return ok / rec

    reads = int(sums[key_schemes[0].name][1].min())
    return Calibration(
        key_coverage={b: share(f"keys:{b}") for b in widths},
        value_share={v: share(f"values:{v}") for v in values} if value_tol is not None else {},
        reads=reads,
    )


def allocate(
    cal: Calibration,
    *,
    tau: float,
    max_loss: float,
    value_tol: float | None,
    fixed_values: str,
    head_dim: int,
    provenance: dict[str, object],
) -> Allocation:
    """The allocation of a calibration: keys by :func:`choose_key_bits`; values by :func:`choose_values` with
    ``value_tol``, else ``fixed_values`` on every KV head."""
    key_bits = choose_key_bits(cal.key_coverage, max_loss)
    vals = (
        choose_values(cal.value_share, max_loss, head_dim)
        if cal.value_share
        else tuple((fixed_values,) * len(row) for row in key_bits)
    )

    def rounded(shares: torch.Tensor) -> list[list[float]]:
        return [[round(float(x), 4) for x in row] for row in shares]

    coverage = {str(b): rounded(c) for b, c in cal.key_coverage.items()}
    shares = {v: rounded(c) for v, c in cal.value_share.items()}
    return Allocation(
        key_bits,
        vals,
        tau=tau,
        max_loss=max_loss,
        value_tol=value_tol,
        provenance={**provenance, "reads_per_kv_head": cal.reads, "key_coverage": coverage, "value_share": shares},
    )
