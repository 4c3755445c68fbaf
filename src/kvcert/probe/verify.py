"""Acceptance gate for probe snapshots: registry labels, coverage, magnitude, soundness
(``docs/contracts.md#probe-verify``).

Every stage is evaluated and the verdict is their conjunction; any failure voids the whole run's
numbers. ``VerifyResult.stage`` names the first failing stage (``schema`` when the file could not be
parsed at all), or ``"pass"``; ``reasons`` lists every failure, each prefixed by its stage.

- **registry**: every reading's name is registered in the tier registry
  (:data:`kvcert.contracts.REGISTRY`; a name ``base/suffix`` is looked up as ``base``), its recorded tier
  equals the registered tier, and no ``bound`` is a quantity that needs the uncompressed reference.
  A snapshot whose numbers carry labels the library never gave them is void.
- **coverage**: the run triggered (``triggers > 0``), declares at least one layer and path, every
  declared layer and every declared path has at least one reading, and no reading is keyed by an
  undeclared layer or path (a probe attached where nothing was declared).
- **magnitude**: every value is finite and lies in its metric norm's physical range
  (:data:`kvcert.contracts.NORM_RANGES`: TV, probabilities, fractions, masses in [0, 1]; norms,
  ratios, counts, durations >= 0; logs any real). A TV-valued ``bound`` declared ``unclipped`` may
  exceed 1 (it is then saturated) but must still be >= 0.
- **soundness**: every self-check counter is zero (witness violations, flips inside certified rows,
  pooling floor violations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kvcert.contracts import REGISTRY, TierRegistry
from kvcert.probe.snapshot import SELF_CHECKS, ProbeSnapshot, ReadingRecord, SnapshotError

STAGES: tuple[str, ...] = ("schema", "registry", "coverage", "magnitude", "soundness")


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
    return out


def _coverage(snap: ProbeSnapshot) -> list[str]:
    out = []
    if snap.triggers <= 0:
        out.append(f"zero-trigger run: triggers={snap.triggers} (the probe never fired)")
    if not snap.declared.layers:
        out.append("no layers declared")
    if not snap.declared.paths:
        out.append("no paths declared")
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


def _soundness(snap: ProbeSnapshot) -> list[str]:
    counts = snap.self_checks.to_dict()
    return [f"self-check {key} = {counts[key]} (must be 0)" for key in SELF_CHECKS if counts[key] != 0]


def verify(snapshot: ProbeSnapshot, registry: TierRegistry = REGISTRY) -> VerifyResult:
    """Run registry, coverage, magnitude and soundness on a parsed snapshot (all four; verdict = conjunction).

    ``registry`` is the tier registry the labels are checked against (default: kvcert's).
    """
    if not isinstance(snapshot, ProbeSnapshot):
        raise ValueError(f"snapshot must be a ProbeSnapshot, got {type(snapshot).__name__}")
    if not isinstance(registry, TierRegistry):
        raise ValueError(f"registry must be a TierRegistry, got {type(registry).__name__}")
    reasons: list[str] = []
    first = "pass"
    checks = (("registry", lambda s: _registry(s, registry)), ("coverage", _coverage), ("magnitude", _magnitude),
              ("soundness", _soundness))
    for stage, check in checks:
        failures = check(snapshot)
        if failures and first == "pass":
            first = stage
        reasons.extend(f"{stage}: {msg}" for msg in failures)
    return VerifyResult(ok=not reasons, stage=first, reasons=tuple(reasons))


def verify_file(path: str | Path) -> VerifyResult:
    """Load and verify one snapshot file; unreadable or malformed files fail at stage ``schema``."""
    try:
        snapshot = ProbeSnapshot.load(path)
    except SnapshotError as exc:
        return VerifyResult(ok=False, stage="schema", reasons=(f"schema: {exc}",))
    return verify(snapshot)
