"""RULER workload shared by ``kvcert run`` and ``kvcert eval``: paired branches per sample, then statistics.

Every sample is prefilled once exactly and each variant (dense, each scheme raw, each scheme gated)
decodes greedily from that prefill (:func:`kvcert.eval.branching.run_branches`), so all variants are
scored on identical prompts and the comparison is paired. With ``gate=None`` (auto) the gate of each
scheme is chosen from its ungated meter on the first sample (:func:`kvcert.cli.common.auto_gate`). A
:class:`~kvcert.cli.common.ResidentPlan` adds one resident variant (``<scheme>+resident``) per scheme it lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcert.cache.gate import Gate
from kvcert.cache.telemetry import Telemetry
from kvcert.cli.common import LoadedModel, ResidentPlan, SchemeSpec, auto_gate
from kvcert.eval.branching import BranchResult, Scheme, run_branches
from kvcert.eval.harness import decode_text, prompt_ids
from kvcert.eval.ruler import Sample, score

DENSE = "dense"
GATED_SUFFIX = "+gate"
RESIDENT_SUFFIX = "+resident"


@dataclass
class VariantRecord:
    """Everything measured for one variant over the samples (telemetry is ``None`` for dense)."""

    label: str
    spec: SchemeSpec | None
    gate: Gate
    scores: list[float] = field(default_factory=list)
    predictions: list[str] = field(default_factory=list)
    telemetry: list[Telemetry] = field(default_factory=list)
    resident: ResidentPlan | None = None  # set for a resident variant

    @property
    def gated(self) -> bool:
        """True when this variant repairs from the exact tier."""
        return self.gate.mode != "off"


@dataclass
class WorkloadResult:
    """Per-variant records (dense first, then raw/gated per scheme) and the auto-gate decisions."""

    samples: list[Sample]
    variants: list[VariantRecord]
    gate_choice: dict[str, dict[str, float | str]]

    def variant(self, label: str) -> VariantRecord:
        """The record called ``label``; ``KeyError`` if absent."""
        for v in self.variants:
            if v.label == label:
                return v
        raise KeyError(label)

    @property
    def violations(self) -> int:
        """Cells whose exact TV exceeded the certificate, over every variant and sample (validate mode; 0 without
        it, where nothing was checked)."""
        return sum(t.violations or 0 for v in self.variants for t in v.telemetry)


def _scheme(spec: SchemeSpec, gate: Gate, label: str, validate: bool) -> Scheme:
    return Scheme(
        label,
        keys=spec.keys,
        values=spec.values,
        gate=gate,
        validate=validate,
        witness=spec.witness,
        device_budget=spec.device_budget,
        allocation=spec.allocation,
        exact_sinks=spec.exact_sinks,
        upgrade=spec.upgrade,
        heavy_share=spec.heavy_share,
        heavy_values=spec.heavy_values,
        bands=spec.bands,
    )


def _record(
    variants: dict[str, VariantRecord], results: Sequence[BranchResult], sample: Sample, loaded: LoadedModel
) -> None:
    for res in results:
        rec = variants[res.scheme.name]
        text = decode_text(loaded.tokenizer, res.tokens)
        rec.predictions.append(text)
        rec.scores.append(score(sample, text))
        if res.telemetry is not None:
            rec.telemetry.append(res.telemetry)


def run_workload(
    loaded: LoadedModel,
    samples: Sequence[Sample],
    specs: Sequence[SchemeSpec],
    gate: Gate | None,
    seed: int,
    max_new_tokens: int | None = None,
    validate: bool = False,
    on_sample: Callable[[int], None] | None = None,
    resident: ResidentPlan | None = None,
) -> WorkloadResult:
    """Decode every sample under dense + each scheme raw (+ gated unless ``gate`` is ``Gate.off()``), plus one
    resident variant per scheme of ``resident`` (its own fixed gate).

    ``gate=None`` chooses each scheme's gate from its ungated informative fraction on the first sample
    (one extra prefill). ``max_new_tokens`` caps RULER's per-task generation budget. Raises ``ValueError``
    naming ``samples`` if it is empty.
    """
    if not samples:
        raise ValueError("samples must not be empty")
    raw = [_scheme(s, Gate.off(), s.label, validate) for s in specs]
    variants = {DENSE: VariantRecord(DENSE, None, Gate.off())}
    variants.update({s.label: VariantRecord(s.label, s, Gate.off()) for s in specs})
    gate_choice: dict[str, dict[str, float | str]] = {}
    want_gated = gate is None or gate.mode != "off"
    gated: list[Scheme] = []
    kept: list[Scheme] = []
    if resident is not None:
        kept = [
            Scheme(
                s.label + RESIDENT_SUFFIX,
                keys=s.keys,
                values=s.values,
                gate=resident.gate,
                validate=validate,
                resident=resident.fraction,
                select=resident.policy,
                reselect=resident.reselect,
                summary=resident.summary,
                resident_alloc=resident.alloc,
                recall=resident.recall,
                witness=s.witness,
                device_budget=s.device_budget,
                exact_sinks=s.exact_sinks,
                bands=s.bands,
            )
            for s in resident.specs
        ]
        variants.update(
            {
                k.name: VariantRecord(k.name, s, k.gate, resident=resident)
                for k, s in zip(kept, resident.specs, strict=True)
            }
        )

    def budget(sample: Sample) -> int:
        return sample.max_new_tokens if max_new_tokens is None else min(max_new_tokens, sample.max_new_tokens)

    for i, sample in enumerate(samples):
        ids = prompt_ids(loaded.tokenizer, sample)
        if i == 0 and gate is None and want_gated:
            first = run_branches(loaded.model, ids, [Scheme(DENSE), *raw], budget(sample), loaded.eos_ids, seed)
            _record(variants, first, sample, loaded)
            for spec, res in zip(specs, first[1:], strict=True):
                assert res.telemetry is not None
                frac = res.telemetry.informative_fraction
                chosen = auto_gate(frac)
                gate_choice[spec.label] = {
                    "informative_fraction": frac,
                    "gate": chosen.describe(),
                    "rule": "certified(0.2) if informative_fraction >= 0.5 else risk_ranked(5)"
                    + ("" if frac == frac else "; no compressed read on the first sample: fraction n/a"),
                }
            gated = [
                _scheme(
                    s,
                    auto_gate(float(gate_choice[s.label]["informative_fraction"])),
                    s.label + GATED_SUFFIX,
                    validate,
                )
                for s in specs
            ]
            variants.update({g.name: VariantRecord(g.name, s, g.gate) for g, s in zip(gated, specs, strict=True)})
            _record(
                variants,
                run_branches(loaded.model, ids, [*gated, *kept], budget(sample), loaded.eos_ids, seed),
                sample,
                loaded,
            )
        else:
            if i == 0 and want_gated:
                assert gate is not None
                gated = [_scheme(s, gate, s.label + GATED_SUFFIX, validate) for s in specs]
                variants.update({g.name: VariantRecord(g.name, s, g.gate) for g, s in zip(gated, specs, strict=True)})
                gate_choice = {s.label: {"gate": gate.describe(), "rule": "fixed by --gate"} for s in specs}
            branches = run_branches(
                loaded.model, ids, [Scheme(DENSE), *raw, *gated, *kept], budget(sample), loaded.eos_ids, seed
            )
            _record(variants, branches, sample, loaded)
        if on_sample is not None:
            on_sample(i)
    suffixes = ("", GATED_SUFFIX, RESIDENT_SUFFIX)
    order = [DENSE] + [s.label + x for s in specs for x in suffixes if s.label + x in variants]
    order += [k.name for k in kept if k.name not in order]  # resident schemes not among the plain ones
    return WorkloadResult(list(samples), [variants[k] for k in order], gate_choice)
