"""Per-cell telemetry of a certified cache: certificates, coverage, fallback, bytes, violations.

A *cell* is (forward step, layer, batch row, query head). Only reads that touched at least one compressed
entry are recorded: a read over exact entries only has nothing to certify. Within one forward call with
several queries (chunked prefill), the recorded value is the worst (max) over its queries.

Tiers: ``certificates`` / ``served`` are **certified** (Tier A, adaptive-safe); ``tier_b`` is **partially
certified** (sound only for queries independent of the dither, i.e. non-adaptive); ``true_tv`` and
``true_out_err`` are **measured** in validate mode against the exact host tier.

A Tier-B gate (``Gate.certified(tau, box=True, tier_b=True)``) serves some KV-head reads unrepaired on a partially
certified bound: ``tier_b_reads`` ``[steps, layers, B, Hkv]`` marks them, ``served_partial`` is the partially
certified bound of what was served (the partial bound on those reads, ``served`` elsewhere), ``tier_b_cells`` the
cells charged ``δ_loc`` each against the request's Tier-B budget (``tier_b_delta_spent``: the most any row spent,
at most ``tier_b_delta``), and in validate mode ``partial_violations`` the cells of those reads whose true TV
exceeded the partial bound. On such reads ``served`` keeps the certified bound, which may exceed ``tau``.

Live chain readings (per cell, the inputs of the per-layer dense contract chain
``store_witness(W) -> score_bridge -> logit_rounding(φ) -> softmax_uniform``, all **certified**):
``witness`` is the largest band witness ``W_t = Σ_b ρ_tb`` (rounded up) over the tokens the KV head holds,
``qnorm`` the score-bridge coefficient ``sc·max‖q‖₂`` over the read's queries, ``logit_slack`` the largest
float32 rounding slack ``φ_t`` of the read's logits. Recorded by the meter-gated read path (not the ladder).

``uncompressed_layers``: layers that can never hold one encodable write block (a sliding window, or the model's
``max_position_embeddings``, shorter than the codecs' block), so they stay exact and contribute no cell (the cache
warns at construction). With zero recorded cells every rate is NaN from its property and ``None`` in
:meth:`Telemetry.summary` (whose key set never depends on what was read).

Eviction (a selection operator): ``evicted_mass`` is the exact attention mass on evicted entries,
``TV(exact full attention, exact attention renormalised over the kept set)``, **measured** in validate
mode from the evicted archive; ``evicted_mass_serving`` is the mass the evicted entries held on the last
served read before their eviction, an **empirical** reading (no bound claimed). The quantization
certificate of a read is relative to exact attention over the *kept* set; by the triangle inequality
``TV(full, served) <= evicted_mass + certificate`` per cell. ``belady_overlap`` (``belady=True``) is the share
of Belady's kept set (computed on the run's own exact trace) that the policy held at each read, **empirical**.

Resident set (``EvictionConfig.resident_set(R)``, ``kvcert.attention.resident``): every certificate above is then
relative to exact attention over *every* token (resident and omitted). ``omitted_mass_bound`` is the per-cell
bound on the attention mass of the omitted tokens before recall (**certified**), ``omitted_mass`` its exact value
(**measured**, validate mode); ``pages_recalled`` / ``bytes_recalled`` count what recall paged in from the host
tier (in the host tier's dtype; key-first recall pages in the keys of every recalled page and the values of those
whose mass it serves: ``bytes_recalled_keys`` + ``bytes_recalled_values`` = ``bytes_recalled``; a page held on the
device by persistent recall counts once, when paged in; they are part of ``bytes_paged``, which adds the dense
fallbacks), ``bytes_summary`` the device bytes of the
page summaries (not in ``bytes_stored``), ``bytes_held`` those of the recalled pages held at the end (both in
``bytes_device``), ``resident_fraction`` the share of written tokens held resident (``layer_resident_fractions``
per layer; their extremes in the summary), ``bytes_fp16_context`` what an fp16 cache would hold for every written
token, resident and omitted (``bytes_fp16`` counts the resident ones only). On a model with sliding-window layers
the resident set is kept by the full-attention layers only: ``resident_fraction`` is over those layers, a sliding
layer's entry of ``layer_resident_fractions`` is NaN (left out of the extremes), and ``bytes_fp16_context`` counts
a sliding layer's fp16 K/V of the tokens it holds (its window, what a ``DynamicCache`` holds for it), not every
token written (the model itself drops the older ones); ``bytes_device_sliding`` is the part of ``bytes_device`` the
sliding layers hold (their windows in the cache's codecs), which no resident fraction shrinks, so the capacity
``bytes_fp16_context / bytes_device`` of any resident setting is at most ``bytes_fp16_context / bytes_device_sliding``;
``recall_violations`` (validate) counts cells whose exact omitted mass exceeded its bound (before recall, and of
what recall left omitted) or whose true TV after recall exceeded the served certificate; ``bytes_recall_floor``
(validate, gate on; **measured**) sums, read by read, the K/V bytes of the fewest omitted tokens that any sound
page-granular recall would have paged in (``kvcert.attention.recall_floor``): the part of ``bytes_recalled`` that no
tighter bound could save. With ``reselect=N``
(:class:`ReselectStats`, **measured**) ``reselections``
counts the (layer, step) re-selections of the resident set, ``reselect_promoted`` / ``reselect_demoted`` the tokens
(per row and KV head) moved into / out of it, ``reselect_bytes_paged`` the page-in bytes of the promoted tokens
(K and V in the host tier's dtype; a token already held on the device by persistent recall costs none), which
``bytes_paged`` includes.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Protocol

import torch

from kvcert.bounds.rc import gamma_f32
from kvcert.cache.store import LayerStore

TIERS: dict[str, str] = {
    "certificates": "certified",
    "raw": "certified (unclipped meter; values >= 1 only rank risk)",
    "served": "certified",
    "tanh": "certified",
    "out_bound": "certified",
    "value_term": "certified (the output bound's value term Σ_t p̃_t‖Δv_t‖ of what was served)",
    "tier_b": "partially certified (non-adaptive queries only)",
    "served_partial": "partially certified (Tier-B gate: the box over min(Tier A, Tier B) radii on the reads it "
    "served unrepaired or after an upgrade repair, w.p. >= 1 - δ_loc per charged cell for non-adaptive queries; "
    "certified elsewhere)",
    "tier_b_reads": "measured (KV-head reads a Tier-B gate served on the partial bound alone, unrepaired or after an "
    "upgrade repair; tier_b_read_share their share of the recorded KV-head reads)",
    "tier_b_cells": "measured (cells a Tier-B gate charged δ_loc each; tier_b_delta_spent the most δ a row spent)",
    "partial_violations": "measured (validate mode; cells of Tier-B reads whose served TV is above the partial bound)",
    "true_tv": "measured (validate mode)",
    "true_out_err": "measured (validate mode)",
    "true_tv_served": "measured (validate mode; the TV of what was served, after any repair)",
    "evicted_mass": "measured (validate mode; exact TV of eviction = attention mass on evicted entries)",
    "evicted_mass_serving": "empirical (serving mode; last served mass of entries at their eviction)",
    "belady_overlap": "empirical (validate mode; kept-set overlap |P ∩ R| / |R| with Belady(next use) on the run's "
    "own exact attention trace)",
    "witness": "certified (band witness W_t >= ‖Δk_t‖, max over the KV head's tokens)",
    "qnorm": "certified (score-bridge coefficient sc·max‖q‖₂, exact per read)",
    "logit_slack": "certified (float32 logit rounding bound, max over the read)",
    "bytes_device": "measured (Σ nbytes of every tensor resident on the device tier at the end: codes, scales, "
    "witnesses, exact entries at 16 bits)",
    "bytes_host": "measured (exact host-tier copy)",
    "bytes_paged": "measured (host -> device page-in traffic over the request)",
    "capacity": "measured (bytes_fp16 / bytes_device)",
    "transient_page_ins": "measured (persistent repairs the device budget served for their read only)",
    "upgraded_entries": "measured (entries, K and V apart, upgrade repairs re-encoded in the upgrade codecs)",
    "heavy_entries": "measured (entries, K and V apart, token tiers stored in the heavy codecs)",
    "reselect": "measured (re-selections of the resident set; tokens promoted / demoted; page-in bytes of the "
    "promoted tokens, included in bytes_paged)",
    "fallback_rate": "measured (share of recorded KV-head reads served partly from an exact copy: paged in at the "
    "read or kept by an earlier persistent repair)",
    "omitted_mass_bound": "certified (resident set: bound on the exact attention mass of the omitted tokens)",
    "omitted_mass": "measured (validate mode; exact attention mass of the omitted tokens)",
    "bytes_recall_floor": "measured (validate mode; K/V bytes of the fewest omitted tokens any sound page-granular "
    "recall pages in, read by read, from the exact attention)",
}


def _warn_deprecated(name: str, use: str) -> None:
    warnings.warn(f"Telemetry.{name} is deprecated; use {use}", DeprecationWarning, stacklevel=3)


@dataclass(frozen=True)
class ChainInputs:
    """What one certified read measured for the dense contract chain; turned into the chain readings only
    when telemetry is assembled (so serving pays for none of it).

    ``witness``: ``max_t W_t`` with the store's write-time ``W_t ≥ Σ_b ρ_tb ≥ ‖k̂_t − k_t‖``;
    ``qnorm``: ``sc·max_Q ‖q‖₂`` of the float32 query the read path uses;
    ``logit_slack``: ``sc·γ_{D+1}·max‖q‖·max_t(2‖k̂_t‖ + W_t)``, which bounds the float32 rounding of both
    logit dot products. The max runs over every token the KV head holds (a superset of the visible ones);
    non-finite entries are zeroed as in the read path (their cells fail closed there).
    """

    q_norm: torch.Tensor  # [B, Hq, Q] ‖q‖₂ per query
    witness_max: torch.Tensor  # [B, Hkv] max_t W_t
    key_norm_max: torch.Tensor  # [B, Hkv] max_t (2‖k̂_t‖ + W_t)
    scaling: float
    head_dim: int

    def readings(self) -> dict[str, torch.Tensor]:
        """``{"witness", "qnorm", "logit_slack"}``, each ``[B, Hq]`` (float64)."""
        g = self.q_norm.shape[1] // self.witness_max.shape[1]
        qn = self.q_norm.amax(-1)
        k_max = self.key_norm_max.repeat_interleave(g, dim=1)
        return {
            "witness": self.witness_max.repeat_interleave(g, dim=1),
            "qnorm": self.scaling * qn,
            "logit_slack": self.scaling * gamma_f32(self.head_dim + 1) * qn * k_max,
        }


def _worst(x: torch.Tensor | None) -> torch.Tensor | None:
    """Max over the read's queries (last axis) in float64; a view when the read had one query."""
    if x is None:
        return None
    y = x[..., 0] if x.shape[-1] == 1 else x.amax(-1)
    return y if y.dtype == torch.float64 else y.to(torch.float64)


@dataclass
class StepRecord:
    """What one layer's read produced in one forward call.

    The read's cell tensors are kept as they came (``[B, Hq, Q]``, references, no copies) and reduced to the
    worst query only when read — telemetry is assembled rarely, reads happen every step. ``reading(name)``
    gives ``[B, Hq]`` for the names in ``cells`` and the dense-chain readings ``witness`` / ``qnorm`` /
    ``logit_slack`` (:class:`ChainInputs`), and ``[B, Hkv]`` for ``repaired`` (head repair, any block paged,
    or values promoted) and ``blocks``.
    """

    step: int
    layer: int
    cells: dict[str, torch.Tensor | None]  # cert (before gating), raw, served, tanh, out_bound, tier_b, true_tv,
    # true_tv_served, true_out_err
    heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # repaired, blocks, values promoted ([B, Hkv])
    queries: int
    violations: int = 0
    out_violations: int = 0
    chain: ChainInputs | None = None  # the dense chain's inputs (certified reads of the default path)
    held: torch.Tensor | None = None  # [B, Hkv] entries kept exact by an earlier persistent repair
    tier_b_heads: torch.Tensor | None = None  # [B, Hkv] Tier-B gate: reads served on the partial bound
    tier_b_charged: torch.Tensor | None = None  # [B] Tier-B gate: cells charged δ_loc each
    partial_violations: int = 0  # validate, Tier-B gate: cells of tier_b_heads with true TV above the partial bound

    @cached_property
    def _chain_readings(self) -> dict[str, torch.Tensor]:
        return {} if self.chain is None else self.chain.readings()

    def repaired_heads(self) -> torch.Tensor:
        """``[B, Hkv]``: head repaired, any block paged in, or values promoted."""
        rep, blocks, promoted = self.heads
        return rep | (blocks > 0) | promoted

    def reading(self, name: str) -> torch.Tensor | None:
        """The reading ``name`` of this read (see the class doc); None where the read did not produce it."""
        if name in self.cells:
            return _worst(self.cells[name])
        if name == "repaired":
            return self.repaired_heads()
        if name == "blocks":
            return self.heads[1]
        if name == "tier_b_heads":
            return self.tier_b_heads
        if name == "fallback":  # served partly from an exact copy: paged in now or held from an earlier repair
            rep = self.repaired_heads()
            return rep if self.held is None else rep | self.held
        if name in ("witness", "qnorm", "logit_slack"):
            return self._chain_readings.get(name)
        raise ValueError(f"unknown step reading {name!r}")


@dataclass
class EvictRecord:
    """Eviction readings of one layer in one forward step.

    ``evicted_mass`` ``[B, Hq]``: validate-mode exact evicted mass of this step's read (worst over its
    queries); ``serving_mass`` ``[B, Hkv]``: empirical mass (mean over each KV head's query heads) that the
    entries evicted at this step held on the last read before; ``evicted``: entries evicted at this step.
    """

    step: int
    layer: int
    evicted_mass: torch.Tensor | None = None
    serving_mass: torch.Tensor | None = None
    evicted: int = 0

    def reading(self, name: str) -> torch.Tensor | None:
        """The field ``name`` (``evicted_mass`` or ``serving_mass``), as :func:`stack_records` reads records."""
        return getattr(self, name)


@dataclass
class Telemetry:
    """Snapshot of a cache's telemetry; tensors are ``[steps, layers, B, Hq]`` (NaN where not recorded)."""

    certificates: torch.Tensor
    raw: torch.Tensor
    served: torch.Tensor
    tanh: torch.Tensor
    out_bound: torch.Tensor
    tier_b: torch.Tensor | None
    true_tv: torch.Tensor | None
    true_out_err: torch.Tensor | None
    repaired: torch.Tensor  # [steps, layers, B, Hkv] bool (head repair or any block paged)
    group_size: int
    violations: int | None  # validate: cells with true TV > certificate (None without validate: nothing checked)
    out_violations: int | None  # validate: cells with true output error > output bound (None without validate)
    bytes_stored: int  # device K/V: codes + exact entries (witnesses excluded; see bytes_device)
    bytes_fp16: int
    bytes_paged: int
    bytes_host: int
    bytes_witness: int
    head_dim: int
    nonfinite: int
    fail_closed: int
    tier_b_delta: float | None
    gate: str
    evicted_mass: torch.Tensor | None = None  # [steps, layers, B, Hq], all forward steps (NaN: none)
    evicted_mass_serving: torch.Tensor | None = None  # [steps, layers, B, Hkv], all forward steps
    evicted_entries: int = 0  # entries evicted over all layers, rows and KV heads
    belady_overlap: torch.Tensor | None = None  # [steps, layers, B, Hkv] (belady=True; NaN: nothing evicted)
    witness: torch.Tensor | None = None  # [steps, layers, B, Hq] live chain readings (see module doc)
    value_term: torch.Tensor | None = None  # [steps, layers, B, Hq] the output bound's value term (None: no read)
    qnorm: torch.Tensor | None = None
    logit_slack: torch.Tensor | None = None
    uncompressed_layers: tuple[int, ...] = ()  # layers that never hold a write block (window or context)
    bytes_device: int = 0  # everything resident on the device tier at the end
    fallback: torch.Tensor | None = None  # [steps, layers, B, Hkv] bool (see fallback_rate)
    transient_page_ins: int = 0  # persistent repairs the device budget served transient
    bytes_transient: int = 0  # their page-in bytes (included in bytes_paged)
    released_entries: int = 0  # held or upgraded entries released back to their codes by the budget
    upgraded_entries: int = 0  # entries (K and V apart) upgrade repairs re-encoded in the upgrade codecs
    heavy_entries: int = 0  # entries (K and V apart) token tiers stored in the heavy (upgrade) codecs
    device_budget: float | None = None  # fraction of bytes_fp16 the repair path may fill
    omitted_mass_bound: torch.Tensor | None = None  # [steps, layers, B, Hq] resident set, all forward steps
    omitted_mass: torch.Tensor | None = None  # (as evicted_mass; NaN: no resident read), validate mode
    resident_fraction: float | None = None  # resident slots / written tokens (None: no resident set)
    layer_resident_fractions: tuple[float, ...] | None = None  # the same per layer (None: no resident set)
    pages_recalled: int = 0
    bytes_recalled: int = 0  # = bytes_recalled_keys + bytes_recalled_values
    bytes_recalled_keys: int = 0
    bytes_recalled_values: int = 0
    bytes_summary: int = 0
    bytes_held: int = 0  # resident set: device bytes of persistently recalled pages at the end
    recall_violations: int = 0
    bytes_recall_floor: int | None = None  # resident set, validate mode: the recall floor (see module doc)
    bytes_fp16_context: int = 0  # resident set: fp16 K/V of every written token (0: none)
    bytes_device_sliding: int = 0  # resident set: device bytes of the sliding-window layers (part of bytes_device)
    reselect: ReselectStats | None = None  # resident set with reselect=N (None: no re-selection configured)
    served_partial: torch.Tensor | None = None  # [steps, layers, B, Hq] Tier-B gate (None: no such gate)
    true_tv_served: torch.Tensor | None = None  # [steps, layers, B, Hq] validate: TV(exact, served after any repair)
    tier_b_reads: torch.Tensor | None = None  # [steps, layers, B, Hkv] bool, Tier-B gate
    tier_b_cells: int = 0  # cells a Tier-B gate charged δ_loc each, over every row and layer
    tier_b_delta_spent: float | None = None  # Tier-B gate: the most δ any row spent (cells · δ_loc)
    partial_violations: int = 0
    tiers: dict[str, str] = field(default_factory=lambda: dict(TIERS))

    @property
    def recorded(self) -> torch.Tensor:
        """Boolean mask of recorded cells ``[steps, layers, B, Hq]``."""
        return ~torch.isnan(self.certificates)

    @property
    def cells(self) -> int:
        """Number of recorded (step, layer, row, query head) cells."""
        return int(self.recorded.sum())

    def coverage(
        self,
        tau: float = 0.2,
        per: Literal["q_head", "kv_head"] = "q_head",
        which: Literal["certificates", "tier_b", "tanh", "true_tv"] = "certificates",
    ) -> float:
        """Fraction of cells with certificate ``<= tau``.

        ``per="kv_head"`` uses KV-head any-of-G: a KV-head cell counts only if all G query heads are certified.
        ``which="true_tv"`` (validate mode) counts the exact TV instead: a sound certificate is never below it, so no
        certificate of this cache's codecs covers more at ``tau`` (the exact-TV ceiling, docs/math.md#p-weighted-form).
        """
        if per not in ("q_head", "kv_head"):
            raise ValueError(f"per must be 'q_head' or 'kv_head', got {per!r}")
        if math.isnan(tau):  # NaN compares false with every certificate: the share would read 0 without a word
            raise ValueError(f"tau must be a number, got {tau}")
        named = {"certificates": self.certificates, "tier_b": self.tier_b, "tanh": self.tanh, "true_tv": self.true_tv}
        if which not in named:
            raise ValueError(f"which must be one of {', '.join(named)}, got {which!r}")
        vals = named[which]
        if vals is None:
            need = "validate mode" if which == "true_tv" else "a dithered key codec"
            raise ValueError(f"no {which} recorded ({which} needs {need})")
        rec = self.recorded
        if not rec.any():
            return float("nan")
        if per == "q_head":
            return float((vals[rec] <= tau).double().mean())
        s, l_, b, hq = vals.shape
        grouped = vals.reshape(s, l_, b, hq // self.group_size, self.group_size)
        rec_kv = rec.reshape(s, l_, b, hq // self.group_size, self.group_size).all(-1)
        ok = (grouped <= tau).all(-1)
        return float(ok[rec_kv].double().mean())

    @property
    def informative_fraction(self) -> float:
        """Fraction of cells whose raw (unclipped) meter is < 1."""
        rec = self.recorded
        return float((self.raw[rec] < 1).double().mean()) if rec.any() else float("nan")

    def value_term_quantile(self, q: float) -> float:
        """The ``q``-quantile (``torch.quantile``, linear) over the recorded cells of the output bound's value term
        ``Σ_t p̃_t‖Δv_t‖`` (certified, in output units): how far the compressed values may move a read's output.
        A gate's TV threshold bounds the key side only; the value side is gated only with ``value_tol``
        (``docs/read-path.md#value-term``). NaN with no recorded cell; ``ValueError`` unless ``0 <= q <= 1``."""
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be a quantile in [0, 1], got {q!r}")
        rec = self.recorded
        if self.value_term is None or not rec.any():
            return float("nan")
        return float(torch.quantile(self.value_term[rec].double(), q))

    def _kv_share(self, flags: torch.Tensor) -> float:
        """Share of recorded KV-head reads (any of the G query heads recorded) that ``flags`` ``[steps, layers, B,
        Hkv]`` marks (NaN: none recorded)."""
        rec = self.recorded
        s, l_, b, hq = rec.shape
        rec_kv = rec.reshape(s, l_, b, hq // self.group_size, self.group_size).any(-1)
        return float(flags[rec_kv].double().mean()) if rec_kv.any() else float("nan")

    @property
    def fallback_rate(self) -> float:
        """Per read: the fraction of recorded KV-head reads that served at least one entry from an exact copy —
        paged in from the host tier at that read (head / block repair, value promotion) or kept on the device
        by an earlier persistent repair. A persistent gate that made a head exact at its first read therefore
        counts on every later read of that head, not once."""
        return self._kv_share(self.repaired if self.fallback is None else self.fallback)

    @property
    def tier_b_read_share(self) -> float:
        """Share of recorded KV-head reads a Tier-B gate served on the partially certified bound alone (NaN: no
        such gate, or nothing recorded)."""
        return float("nan") if self.tier_b_reads is None else self._kv_share(self.tier_b_reads)

    @property
    def capacity(self) -> float:
        """``bytes_fp16 / bytes_device``: how many times more tokens than an fp16 cache fit in the same device
        memory (measured, at the end of the request)."""
        return self.bytes_fp16 / self.bytes_device if self.bytes_device else float("nan")

    @property
    def page_in_ratio(self) -> float:
        """``bytes_paged / bytes_fp16``: page-in traffic over the request relative to its fp16 K/V (bandwidth,
        measured; reported apart from capacity)."""
        return self.bytes_paged / self.bytes_fp16 if self.bytes_fp16 else float("nan")

    @property
    def effective_bits(self) -> float:
        """Deprecated (folds page-in traffic into a storage figure): use :attr:`capacity` (device bytes) and
        :attr:`page_in_ratio` (bandwidth). Value unchanged: ``(1 − f_fb)·16·bytes_stored/bytes_fp16 + 16·f_fb``."""
        _warn_deprecated("effective_bits", "capacity and page_in_ratio")
        if self.bytes_fp16 == 0:
            return float("nan")
        b_stored = 16.0 * self.bytes_stored / self.bytes_fp16
        f = self.fallback_rate
        f = 0.0 if f != f else f
        return (1 - f) * b_stored + 16.0 * f

    @property
    def max_certificate(self) -> float:
        """Worst recorded certificate."""
        rec = self.recorded
        return float(self.certificates[rec].max()) if rec.any() else float("nan")

    def summary(self) -> dict[str, float | int | str | None]:
        """Flat dictionary of headline numbers, each key suffixed by nothing; tiers are in ``self.tiers``.

        The key set depends only on the cache's configuration, never on what was read: with zero recorded
        cells (e.g. a decode that ended at its first token) ``cells`` is 0 and every rate or maximum over
        cells (coverage, informative fraction, fallback rate, maximum certificate, ...) is ``None`` ("n/a":
        nothing to count), where the properties themselves return NaN.

        Bytes are measured: ``bytes_device`` (capacity) and ``bytes_paged`` (bandwidth) are separate numbers;
        ``effective_bits`` (deprecated) is no longer listed."""
        out: dict[str, float | int | str | None] = {
            "cells": self.cells,
            "coverage_q@0.2": self.coverage(0.2, "q_head"),
            "coverage_kv@0.2": self.coverage(0.2, "kv_head"),
            "informative_fraction": self.informative_fraction,
            "max_certificate": self.max_certificate,
            "fallback_rate": self.fallback_rate,
            "value_term_p50": self.value_term_quantile(0.5),
            "value_term_p90": self.value_term_quantile(0.9),
            "violations": self.violations if self.true_tv is not None else None,
            "out_violations": self.out_violations if self.true_out_err is not None else None,
            "bytes_device": self.bytes_device,
            "bytes_fp16": self.bytes_fp16,
            "capacity": self.capacity,
            "bytes_host": self.bytes_host,
            "bytes_paged": self.bytes_paged,
            "page_in_ratio": self.page_in_ratio,
            "transient_page_ins": self.transient_page_ins,
            "upgraded_entries": self.upgraded_entries,
            "heavy_entries": self.heavy_entries,
            "bytes_stored": self.bytes_stored,
            "nonfinite": self.nonfinite,
            "fail_closed": self.fail_closed,
            "gate": self.gate,
            "uncompressed_layers": len(self.uncompressed_layers),
        }
        if self.tier_b is not None:
            out["coverage_tier_b_kv@0.2"] = self.coverage(0.2, "kv_head", which="tier_b")
        if self.tier_b_reads is not None:
            out.update(
                tier_b_read_share=self.tier_b_read_share,
                tier_b_cells=self.tier_b_cells,
                tier_b_delta_spent=self.tier_b_delta_spent,
                partial_violations=self.partial_violations if self.true_tv is not None else None,
            )
        for name in ("evicted_mass", "evicted_mass_serving"):
            vals = getattr(self, name)
            if vals is not None:
                live = vals[~torch.isnan(vals)]
                out[f"max_{name}"] = float(live.max()) if live.numel() else float("nan")
        if self.evicted_entries:
            out["evicted_entries"] = self.evicted_entries
        if self.belady_overlap is not None:
            live = self.belady_overlap[~torch.isnan(self.belady_overlap)]
            out["mean_belady_overlap"] = float(live.mean()) if live.numel() else float("nan")
        if self.resident_fraction is not None:
            managed = tuple(f for f in self.layer_resident_fractions or () if not math.isnan(f))
            out.update(
                resident_fraction=self.resident_fraction,
                min_layer_resident_fraction=min(managed or (math.nan,)),
                max_layer_resident_fraction=max(managed or (math.nan,)),
                pages_recalled=self.pages_recalled,
                bytes_recalled=self.bytes_recalled,
                bytes_recalled_keys=self.bytes_recalled_keys,
                bytes_recalled_values=self.bytes_recalled_values,
                bytes_summary=self.bytes_summary,
                bytes_held=self.bytes_held,
                bytes_fp16_context=self.bytes_fp16_context,
                bytes_device_sliding=self.bytes_device_sliding,
                recall_violations=self.recall_violations if self.omitted_mass is not None else None,
                bytes_recall_floor=self.bytes_recall_floor,
            )
            for name in ("omitted_mass_bound", "omitted_mass"):
                vals = getattr(self, name)
                live = vals[~torch.isnan(vals)] if vals is not None else torch.zeros(0)
                out[f"max_{name}"] = float(live.max()) if live.numel() else float("nan")
                out[f"mean_{name}"] = float(live.mean()) if live.numel() else float("nan")
        if self.reselect is not None:
            out.update(
                reselections=self.reselect.reselections,
                reselect_promoted=self.reselect.promoted,
                reselect_demoted=self.reselect.demoted,
                reselect_bytes_paged=self.reselect.bytes_paged,
            )
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in out.items()}


class Reading(Protocol):
    """A per-(step, layer) record :func:`stack_records` can stack."""

    step: int
    layer: int

    def reading(self, name: str) -> torch.Tensor | None:
        """The reading ``name`` of this record (``None``: not produced)."""


class ResidentReading(Reading, Protocol):
    """A resident read's record (``kvcert.attention.resident.ResidentRecord``): readings plus recall counts."""

    pages: int
    bytes: int
    bytes_keys: int
    bytes_values: int
    violations: int
    bytes_floor: int | None


def stack_records(records: Sequence[Reading], layers: int, steps: int, attr: str) -> torch.Tensor | None:
    """Assemble ``[steps, layers, B, H]`` from per-(step, layer) records (NaN / False where absent)."""
    have = [(r, v) for r in records if (v := r.reading(attr)) is not None]
    if not have:
        return None
    sample = have[0][1]
    fill = False if sample.dtype == torch.bool else float("nan")
    dtype = torch.bool if sample.dtype == torch.bool else torch.float64
    out = torch.full((steps, layers, *sample.shape), fill, dtype=dtype, device=sample.device)
    for r, val in have:
        if val.shape == sample.shape:
            out[r.step, r.layer] = val.to(dtype)
    return out


@dataclass
class ReselectStats:
    """What periodic re-selection of a resident set, or its swaps (``recall="swap"``), moved (**measured**):
    ``reselections`` (one per layer and re-selecting or swapping step), ``promoted`` / ``demoted`` tokens (per row
    and KV head) into / out of the resident set and ``bytes_paged``, the page-in bytes of the promoted tokens not
    already on the device (held, or paged in for the read a swap follows) plus those of the omitted tokens paged in
    to complete a page of carried held tokens (``HeldPages.carry``)."""

    reselections: int = 0
    promoted: int = 0
    demoted: int = 0
    bytes_paged: int = 0


@dataclass(frozen=True)
class CacheReadings:
    """What a cache recorded, for :func:`assemble`: its reads (``records``), evictions and resident reads (``None``:
    no resident set), its stores, and the constants of its configuration."""

    records: Sequence[StepRecord]
    stores: Sequence[LayerStore]
    steps: int  # forward steps so far (0: none)
    num_heads: int
    num_kv_heads: int
    bytes_paged: int
    tier_b: bool  # the key codec produces a Tier-B certificate
    validate: bool
    tier_b_delta: float | None
    gate: str
    evict_records: Sequence[EvictRecord] = ()
    belady_overlap: torch.Tensor | None = None
    uncompressed_layers: tuple[int, ...] = ()
    bytes_summary: int = 0  # device bytes of the resident set's page summaries
    bytes_held: int = 0  # device bytes of the resident set's persistently recalled pages
    resident_records: Sequence[ResidentReading] | None = None
    reselect: ReselectStats | None = None  # resident set with reselect=N
    sliding_layers: tuple[int, ...] = ()  # sliding-window layers (a resident set does not manage them)
    delta_loc: float | None = None  # a Tier-B gate's per-cell share (None: no Tier-B gate)


#: cell fields every read produces (an empty cell tensor, not ``None``, when nothing was read)
_ALWAYS = ("raw", "served", "tanh", "out_bound")


def _cell_fields(src: CacheReadings) -> dict[str, Any]:
    """The ``[steps, layers, B, H]`` fields, restricted to the forward steps that recorded a cell."""
    n_layers, steps = len(src.stores), max(src.steps, 1)
    certs = stack_records(src.records, n_layers, steps, "cert")
    no_reads = certs is None  # e.g. a decode that ended at once (EOS first): zero cells, same fields
    if certs is None:
        certs = torch.full((0, n_layers, 1, src.num_heads), float("nan"), dtype=torch.float64)
    keep = ~torch.isnan(certs).flatten(1).all(1)
    produced = {
        "tier_b": src.tier_b,
        "true_tv": src.validate,
        "true_tv_served": src.validate,
        "true_out_err": src.validate,
    }
    empty = certs.clone()

    def sel(name: str) -> torch.Tensor | None:
        x = stack_records(src.records, n_layers, steps, name)
        if x is None and no_reads and produced.get(name, name in _ALWAYS):
            return empty.clone()  # an empty [0, L, 1, Hq] cell tensor: no cell, not "not recorded"
        return None if x is None else x[keep]

    names = (
        *_ALWAYS,
        "value_term",
        "tier_b",
        "true_tv",
        "true_tv_served",
        "true_out_err",
        "witness",
        "qnorm",
        "logit_slack",
        "fallback",
        "served_partial",
    )
    fields = {name: sel(name) for name in names}

    def head_flags(name: str) -> torch.Tensor:  # [steps kept, L, B, Hkv] bool
        x = stack_records(src.records, n_layers, steps, name)
        return x[keep] if x is not None else torch.zeros(0, dtype=torch.bool)

    fields["repaired"] = head_flags("repaired")
    if src.delta_loc is not None:  # a Tier-B gate
        fields["tier_b_reads"] = head_flags("tier_b_heads")
    fields["certificates"] = certs[keep]
    return fields


def _byte_fields(stores: Sequence[LayerStore]) -> dict[str, Any]:
    """The byte and fail-closed counters summed over the layers' stores."""
    first = stores[0]
    return {
        "bytes_stored": sum(s.bytes_stored() for s in stores),
        "bytes_fp16": sum(s.bytes_fp16() for s in stores),
        "bytes_host": sum(s.bytes_host() for s in stores),
        "bytes_witness": sum(s.bytes_witness() for s in stores),
        "head_dim": first.k.host.view().shape[-1] if first.k is not None else 0,
        "nonfinite": sum(s.nonfinite for s in stores),
        "fail_closed": sum(s.fail_closed for s in stores),
        "transient_page_ins": sum(s.transient_repairs for s in stores),
        "bytes_transient": sum(s.bytes_transient for s in stores),
        "released_entries": sum(s.released for s in stores),
        "upgraded_entries": sum(s.upgraded for s in stores),
        "heavy_entries": sum(s.heavy_entries for s in stores),
        "device_budget": first.device_budget,
    }


def _resident_fields(src: CacheReadings) -> dict[str, Any]:
    """The resident-set fields (none without a resident set)."""
    recs = src.resident_records
    if recs is None:
        return {}
    stores, steps = src.stores, max(src.steps, 1)
    managed = [i for i in range(len(stores)) if i not in src.sliding_layers]
    held_per_layer = [s.n for s in stores]
    omitted_per_layer = [s.evicted["k"].view().shape[2] if s.evicted else 0 for s in stores]
    held, omitted = sum(held_per_layer[i] for i in managed), sum(omitted_per_layer[i] for i in managed)
    omitted_fp16 = sum(2 * (s.evicted["k"].view().numel() + s.evicted["v"].view().numel()) for s in stores if s.evicted)
    floors = [r.bytes_floor for r in recs if r.bytes_floor is not None]  # validate mode with the gate on
    return {
        "omitted_mass_bound": stack_records(recs, len(stores), steps, "mass_bound"),
        "omitted_mass": stack_records(recs, len(stores), steps, "true_mass"),
        "resident_fraction": held / (held + omitted) if held + omitted else float("nan"),
        "layer_resident_fractions": tuple(
            h / (h + o) if h + o and i in managed else float("nan")
            for i, (h, o) in enumerate(zip(held_per_layer, omitted_per_layer, strict=True))
        ),
        "pages_recalled": sum(r.pages for r in recs),
        "bytes_recalled": sum(r.bytes for r in recs),
        "bytes_recalled_keys": sum(r.bytes_keys for r in recs),
        "bytes_recalled_values": sum(r.bytes_values for r in recs),
        "bytes_summary": src.bytes_summary,
        "bytes_held": src.bytes_held,
        "recall_violations": sum(r.violations for r in recs),
        "bytes_recall_floor": sum(floors) if floors else None,
        "bytes_fp16_context": sum(s.bytes_fp16() for s in stores) + omitted_fp16,
        "bytes_device_sliding": sum(stores[i].bytes_device() for i in src.sliding_layers),
    }


def assemble(src: CacheReadings) -> Telemetry:
    """The :class:`Telemetry` snapshot of everything a cache recorded."""
    n_layers, steps = len(src.stores), max(src.steps, 1)
    return Telemetry(
        **_cell_fields(src),
        **_byte_fields(src.stores),
        group_size=src.num_heads // src.num_kv_heads,
        violations=sum(r.violations for r in src.records) if src.validate else None,
        out_violations=sum(r.out_violations for r in src.records) if src.validate else None,
        bytes_paged=src.bytes_paged + (src.reselect.bytes_paged if src.reselect is not None else 0),
        tier_b_delta=src.tier_b_delta,
        gate=src.gate,
        evicted_mass=stack_records(src.evict_records, n_layers, steps, "evicted_mass"),
        evicted_mass_serving=stack_records(src.evict_records, n_layers, steps, "serving_mass"),
        evicted_entries=sum(r.evicted for r in src.evict_records),
        belady_overlap=src.belady_overlap,
        uncompressed_layers=src.uncompressed_layers,
        bytes_device=sum(s.bytes_device() for s in src.stores) + src.bytes_summary + src.bytes_held,
        **_resident_fields(src),
        **_tier_b_gate_fields(src),
        reselect=src.reselect,
    )


def _tier_b_gate_fields(src: CacheReadings) -> dict[str, Any]:
    """A Tier-B gate's counts (none without one; its reads are stacked with the cell fields): the cells charged and
    the most δ a row spent (cells summed over the layers, times ``δ_loc``)."""
    if src.delta_loc is None:
        return {}
    per_row: dict[int, int] = {}
    for r in src.records:
        for row, n in enumerate([] if r.tier_b_charged is None else r.tier_b_charged.tolist()):
            per_row[row] = per_row.get(row, 0) + n
    return {
        "tier_b_cells": sum(per_row.values()),
        "tier_b_delta_spent": max(per_row.values(), default=0) * src.delta_loc,
        "partial_violations": sum(r.partial_violations for r in src.records),
    }
