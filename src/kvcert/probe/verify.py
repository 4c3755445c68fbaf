"""Acceptance gate for probe snapshots: registry labels, coverage, magnitude, soundness
(``docs/contracts.md#probe-verify``).

Every stage is evaluated and the verdict is their conjunction; any failure voids the whole run's
numbers. ``VerifyResult.stage`` names the first failing stage (``schema`` when the file could not be
parsed at all), or ``"pass"``; ``reasons`` lists every failure, each prefixed by its stage.

- **integrity** (files only, :func:`verify_file`): the file carries a ``digest`` and it equals the
  digest of its content (:meth:`ProbeSnapshot.digest`); a snapshot with a recorded digest is checked
  wherever it is verified. A file without a digest is void: its integrity cannot be verified.
- **registry**: every reading's name is registered in the tier registry
  (:data:`kvcert.contracts.REGISTRY`; a name ``base/suffix`` is looked up as ``base``), its recorded tier
  equals the registered tier, no ``bound`` is a quantity that needs the uncompressed reference, and a
  name the probe emits carries the metric it is emitted with (:data:`METRIC_CONTRACTS`: a certificate
  relabelled as another metric is void). A snapshot whose numbers carry labels the library never gave
  them is void.
- **coverage**: the run triggered (``triggers > 0``), declares at least one layer and path, declares
  every layer ``0 … n−1`` (a probe declares all of its model's layers; with a model of known depth,
  :data:`MODEL_LAYERS`, ``n`` must be that depth), every declared layer and every declared path has at
  least one reading, and no reading is keyed by an undeclared layer or path (a probe attached where
  nothing was declared).
- **magnitude**: every value is finite and lies in its metric norm's physical range
  (:data:`kvcert.contracts.NORM_RANGES`: TV, probabilities, fractions, masses in [0, 1]; norms,
  ratios, counts, durations >= 0; logs any real). A TV-valued ``bound`` declared ``unclipped`` may
  exceed 1 (it is then saturated) but must still be >= 0.
- **soundness**: every self-check counter is zero (witness violations, flips inside certified rows,
  pooling floor violations), and no certified ``bound`` lies below the measured truth of the same
  ``(layer, path)`` and quantity: a validate-mode reading that needs the reference (e.g. ``true_tv``,
  ``attn_dist:tv@offline``, the largest true TV over the cells of that layer) is a lower bound on every
  certified bound of the same ``object:norm`` there (each bounds every cell), up to
  ``TRUTH_ATOL``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kvcert.contracts import REGISTRY, Metric, Tier, TierRegistry
from kvcert.probe.snapshot import SELF_CHECKS, ProbeSnapshot, ReadingRecord, SnapshotError

STAGES: tuple[str, ...] = ("schema", "integrity", "registry", "coverage", "magnitude", "soundness")
TRUTH_ATOL = 1e-9
"""Slack of the bound-versus-truth comparison (the probe's own per-cell tolerance, ``RADIUS_ATOL``)."""

METRIC_CONTRACTS: dict[str, Metric] = {
    name: Metric.coerce(metric)
    for names, metric in (
        (("certificates", "chain_tv", "pool_chain_tv", "latent_tier_b", "sel_chain_tv"), "attn_dist:tv@consume"),
        (("band_witness", "latent_witness"), "kv_entry:l2@write"),
        (("true_tv",), "attn_dist:tv@offline"),
        (("logit_slack",), "attn_logit:linf@consume"),
        (("qnorm",), "query:l2@consume"),
        (("lost_mass", "gain_mass"), "selector_dist:mass@consume"),
        (("sel_bS",), "selector_dist:tv@consume"),
        (("sel_bridge_rho",), "selector_to_attention:ratio@consume"),
        (("topk_margin_cert_rate",), "selector_rows:frac@consume"),
        (("pool_coef_l2",), "pool_weights:l2@write"),
        (("pool_coef_linf",), "pool_weights:linf@write"),
        (("pool_top1_norm", "pool_entropy_n", "pool_eff_frac"), "pool_weights:frac@write"),
        (("gate_a_t",), "forget_gate:prob@consume"),
        (("gate_near_one_frac", "gate_non_contracting_frac"), "forget_gate:frac@consume"),
        (("gate_sum_log_a",), "forget_gate:log@consume"),
        (("gate_half_life",), "forget_gate:steps@consume"),
        (("gate_chain_product",), "recurrent_state:l2@consume"),
    )
    for name in names
}
"""The metric each registered name is emitted with by the probe (``kvcert.probe``); a reading under one of
these names with any other metric fails the registry stage."""

MODEL_LAYERS: dict[str, int] = {"smollm2-135m": 30, "gemma3-270m": 18}
"""Depth of the named zoo models (``kvcert.models.zoo``): a snapshot of one must declare exactly these
layers. Other models are held to ``0 … n−1`` without a known ``n`` (see docs/reliability.md)."""


@dataclass(frozen=True)
class VerifyResult:
    """Gate outcome: ``ok``, the first failing ``stage`` (or ``"pass"``), and every failure reason."""

    ok: bool
    stage: str
    reasons: tuple[str, ...]


def registered_name(name: str) -> str:
    """The registry key of a reading name: the part before the first ``/`` (``"gate_a_t/max"`` -> ``"gate_a_t"``)."""
    return name.split("/", 1)[0]


def _registry(snap: ProbeSnapshot, registry: TierRegistry) -> list[str]:
    out = []
    for i, r in enumerate(snap.readings):
        where = f"readings[{i}] {r.name!r} (layer {r.layer}, {r.path})"
        key = registered_name(r.name)
        if key not in registry:
            out.append(f"{where}: metric {key!r} is not in the tier registry")
            continue
        entry = registry.check_emittable(key)
        if r.tier is not entry.tier:
            out.append(f"{where}: metric {key!r} recorded as {r.tier.value}, registered as {entry.tier.value}")
        if r.kind == "bound" and entry.requires_reference:
            out.append(f"{where}: metric {key!r} needs the uncompressed reference and cannot be a bound")
        contract = METRIC_CONTRACTS.get(key)
        if contract is not None and r.metric != contract:
            out.append(f"{where}: {key!r} recorded as metric {r.metric}, emitted as {contract}")
    return out


def _coverage(snap: ProbeSnapshot) -> list[str]:
    out = []
    if snap.triggers <= 0:
        out.append(f"zero-trigger run: triggers={snap.triggers} (the probe never fired)")
    if not snap.declared.layers:
        out.append("no layers declared")
    if not snap.declared.paths:
        out.append("no paths declared")
    declared = sorted(snap.declared.layers)
    depth = MODEL_LAYERS.get(snap.model, len(declared))
    if declared and declared != list(range(depth)):
        gaps = sorted(set(range(depth)) - set(declared))
        extra = sorted(set(declared) - set(range(depth)))
        out.append(
            f"declared layers must be every layer 0 … {depth - 1} of {snap.model!r}"
            + (f"; missing {gaps}" if gaps else "")
            + (f"; outside or repeated {extra or declared}" if extra or len(set(declared)) < len(declared) else "")
        )
    seen_layers = {r.layer for r in snap.readings}
    seen_paths = {r.path for r in snap.readings}
    missing_layers = sorted(set(snap.declared.layers) - seen_layers)
    missing_paths = [p for p in snap.declared.paths if p not in seen_paths]
    if missing_layers:
        out.append(f"declared layer(s) without readings: {missing_layers}")
    if missing_paths:
        out.append(f"declared path(s) without readings: {missing_paths}")
    extra_layers = sorted(seen_layers - set(snap.declared.layers))
    extra_paths = sorted(seen_paths - set(snap.declared.paths))
    if extra_layers:
        out.append(f"readings on undeclared layer(s): {extra_layers}")
    if extra_paths:
        out.append(f"readings on undeclared path(s): {extra_paths}")
    return out


def allowed_range(r: ReadingRecord) -> tuple[float, float]:
    """Physical range of ``r.value``: its norm's range, widened to [0, inf) for an unclipped TV bound."""
    lo, hi = r.metric.physical_range
    if r.metric.norm == "tv" and r.kind == "bound" and r.unclipped:
        hi = math.inf
    return lo, hi


def _magnitude(snap: ProbeSnapshot) -> list[str]:
    out = []
    for i, r in enumerate(snap.readings):
        where = f"readings[{i}] {r.name!r} (layer {r.layer}, {r.path}, {r.metric}, {r.kind})"
        if not math.isfinite(r.value):
            out.append(f"{where}: non-finite value {r.value!r}")
            continue
        lo, hi = allowed_range(r)
        if not lo <= r.value <= hi:
            out.append(f"{where}: value {r.value!r} outside the physical range [{lo}, {hi}]")
    return out


def _soundness(snap: ProbeSnapshot, registry: TierRegistry) -> list[str]:
    counts = snap.self_checks.to_dict()
    out = [f"self-check {key} = {counts[key]} (must be 0)" for key in SELF_CHECKS if counts[key] != 0]
    truth: dict[tuple[int, str, str, str], float] = {}  # (layer, path, object, norm) -> largest measured value
    for r in snap.readings:
        key = registered_name(r.name)
        if r.kind == "reading" and key in registry and registry.check_emittable(key).requires_reference:
            cell = (r.layer, r.path, r.metric.obj, r.metric.norm)
            if math.isfinite(r.value):
                truth[cell] = max(truth.get(cell, -math.inf), r.value)
    for i, r in enumerate(snap.readings):
        measured = truth.get((r.layer, r.path, r.metric.obj, r.metric.norm))
        if r.kind == "bound" and r.tier is Tier.CERTIFIED and measured is not None and r.value < measured - TRUTH_ATOL:
            out.append(
                f"readings[{i}] {r.name!r} (layer {r.layer}, {r.path}): certified bound {r.value!r} is below the "
                f"measured {r.metric.obj}:{r.metric.norm} {measured!r} of the same layer"
            )
    return out


def _integrity(snap: ProbeSnapshot, require_digest: bool) -> list[str]:
    if snap.recorded_digest is None:
        return ["no digest: the snapshot's integrity cannot be verified (re-run the probe)"] if require_digest else []
    actual = snap.digest()
    if snap.recorded_digest != actual:
        return [
            f"digest {snap.recorded_digest[:19]}… does not match the content ({actual[:19]}…): "
            "edited after it was written"
        ]
    return []


def verify(snapshot: ProbeSnapshot, registry: TierRegistry = REGISTRY, require_digest: bool = False) -> VerifyResult:
    """Run integrity, registry, coverage, magnitude and soundness on a parsed snapshot (all five; verdict =
    conjunction).

    ``registry`` is the tier registry the labels are checked against (default: kvcert's).
    ``require_digest``: a snapshot without a recorded digest fails integrity (files; :func:`verify_file`).
    """
    if not isinstance(snapshot, ProbeSnapshot):
        raise ValueError(f"snapshot must be a ProbeSnapshot, got {type(snapshot).__name__}")
    if not isinstance(registry, TierRegistry):
        raise ValueError(f"registry must be a TierRegistry, got {type(registry).__name__}")
    reasons: list[str] = []
    first = "pass"
    checks = (
        ("integrity", lambda s: _integrity(s, require_digest)),
        ("registry", lambda s: _registry(s, registry)),
        ("coverage", _coverage),
        ("magnitude", _magnitude),
        ("soundness", lambda s: _soundness(s, registry)),
    )
    for stage, check in checks:
        failures = check(snapshot)
        if failures and first == "pass":
            first = stage
        reasons.extend(f"{stage}: {msg}" for msg in failures)
    return VerifyResult(ok=not reasons, stage=first, reasons=tuple(reasons))


def verify_file(path: str | Path) -> VerifyResult:
    """Load and verify one snapshot file (its digest required); unreadable or malformed files (bad JSON,
    duplicated keys, nesting too deep, schema violations) fail at stage ``schema``."""
    try:
        snapshot = ProbeSnapshot.load(path)
    except SnapshotError as exc:
        return VerifyResult(ok=False, stage="schema", reasons=(f"schema: {exc}",))
    return verify(snapshot, require_digest=True)
