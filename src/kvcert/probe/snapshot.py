"""Probe snapshot: the JSON record one probe run leaves behind (schema ``kvcert.probe/1``).

```
{"schema": "kvcert.probe/1", "run_id": str, "model": str, "family": str,
 "declared": {"layers": [int, ...], "paths": [path, ...]},
 "triggers": int,
 "readings": [{"layer": int, "path": path, "metric": "obj:norm@site", "value": number,
               "tier": "certified"|"partial"|"empirical", "kind": "bound"|"reading", "name": str,
               "unclipped": bool (optional, default false)}],
 "self_checks": {"witness_violations": int, "certified_flips": int, "pooling_floor_violations": int},
 "digest": "sha256:<64 hex>" (written by ProbeSnapshot.write; optional when parsing)}
```

Integrity: :meth:`ProbeSnapshot.write` adds ``digest``, the SHA-256 of the canonical JSON of the content
(:meth:`ProbeSnapshot.digest`: keys sorted, no whitespace, everything but the digest itself), and
:func:`kvcert.probe.verify.verify_file` fails a file whose digest is absent or does not match its content.
Files are parsed with :func:`kvcert.strict_json.loads`: a duplicated key (``{"x": 5, "x": 0}`` would
otherwise keep the last value and hide the first) or nesting deeper than
:data:`kvcert.strict_json.MAX_DEPTH` is a :class:`SnapshotError`, never a silent overwrite or a
``RecursionError``.

Parsing is strict and fails closed (:class:`SnapshotError`, naming the field): missing or unknown
keys, wrong types, unknown paths/tiers/kinds, malformed metrics, and a ``bound`` with tier
``empirical`` (an empirical number is never a bound). Value *ranges* (NaN, out-of-range values,
zero triggers, non-zero self-checks) are not schema errors: the acceptance gate
(:mod:`kvcert.probe.verify`) judges them. ``unclipped: true`` declares a TV bound that was not
clipped at 1 (so it may exceed 1; it is then saturated). NaN/inf are written as the JSON
extensions ``NaN``/``Infinity`` so that they survive to the gate.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcert.contracts import Metric, Tier
from kvcert.strict_json import StrictJSONError
from kvcert.strict_json import loads as strict_loads

SCHEMA = "kvcert.probe/1"
PATHS: tuple[str, ...] = ("dense_kv", "latent_kv", "sparse_selector", "recurrent", "pooling")
KINDS: tuple[str, ...] = ("bound", "reading")
READING_FIELDS: tuple[str, ...] = ("layer", "path", "metric", "value", "tier", "kind", "name")
SELF_CHECKS: tuple[str, ...] = ("witness_violations", "certified_flips", "pooling_floor_violations")
TOP_FIELDS: tuple[str, ...] = ("schema", "run_id", "model", "family", "declared", "triggers", "readings", "self_checks")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


class SnapshotError(ValueError):
    """A snapshot is malformed (bad JSON, missing/unknown field, wrong type or label)."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _fields(obj: object, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    if not isinstance(obj, dict):
        raise SnapshotError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise SnapshotError(f"{where}: missing field(s) {missing}")
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        raise SnapshotError(f"{where}: unknown field(s) {unknown}")
    return obj


def _typed(value: object, ok: bool, where: str, expected: str) -> Any:
    if not ok:
        raise SnapshotError(f"{where}: expected {expected}, got {value!r}")
    return value


@dataclass(frozen=True)
class Declared:
    """What the run promised to observe: layer indices and memory paths."""

    layers: tuple[int, ...]
    paths: tuple[str, ...]

    def __post_init__(self) -> None:
        for i, layer in enumerate(self.layers):
            _typed(layer, _is_int(layer) and layer >= 0, f"declared.layers[{i}]", "an int >= 0")
        for i, path in enumerate(self.paths):
            _typed(path, path in PATHS, f"declared.paths[{i}]", f"one of {list(PATHS)}")


@dataclass(frozen=True)
class ReadingRecord:
    """One emitted number, keyed by (layer, path), with its metric, tier and kind."""

    layer: int
    path: str
    metric: Metric
    value: float
    tier: Tier
    kind: str
    name: str
    unclipped: bool = False

    def __post_init__(self) -> None:
        _typed(self.layer, _is_int(self.layer) and self.layer >= 0, "layer", "an int >= 0")
        _typed(self.path, self.path in PATHS, "path", f"one of {list(PATHS)}")
        _typed(self.value, _is_number(self.value), "value", "a number")
        _typed(self.kind, self.kind in KINDS, "kind", f"one of {list(KINDS)}")
        _typed(self.name, isinstance(self.name, str) and bool(self.name.strip()), "name", "a non-empty str")
        _typed(self.unclipped, isinstance(self.unclipped, bool), "unclipped", "a bool")
        try:
            metric, tier = Metric.coerce(self.metric), Tier.parse(self.tier)
        except ValueError as exc:
            raise SnapshotError(str(exc)) from None
        if self.kind == "bound" and tier is Tier.EMPIRICAL:
            raise SnapshotError(f"reading {self.name!r}: a 'bound' cannot have tier 'empirical'")
        object.__setattr__(self, "metric", metric)
        object.__setattr__(self, "tier", tier)
        object.__setattr__(self, "value", float(self.value))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``unclipped`` only when true)."""
        out: dict[str, Any] = {
            "layer": self.layer,
            "path": self.path,
            "metric": str(self.metric),
            "value": self.value,
            "tier": self.tier.value,
            "kind": self.kind,
            "name": self.name,
        }
        if self.unclipped:
            out["unclipped"] = True
        return out


@dataclass(frozen=True)
class SelfChecks:
    """Implementation self-check counters; every one must be 0 for the run to be sound."""

    witness_violations: int
    certified_flips: int
    pooling_floor_violations: int

    def __post_init__(self) -> None:
        for key in SELF_CHECKS:
            value = getattr(self, key)
            _typed(value, _is_int(value), f"self_checks.{key}", "an int")

    def to_dict(self) -> dict[str, int]:
        """JSON-ready dict."""
        return {key: getattr(self, key) for key in SELF_CHECKS}


@dataclass(frozen=True)
class ProbeSnapshot:
    """A probe run's snapshot (schema ``kvcert.probe/1``)."""

    run_id: str
    model: str
    family: str
    declared: Declared
    triggers: int
    readings: tuple[ReadingRecord, ...]
    self_checks: SelfChecks
    schema: str = SCHEMA
    recorded_digest: str | None = field(default=None, compare=False)
    """The ``digest`` a parsed file carried (None: none, e.g. built in memory); see :meth:`digest`."""

    def __post_init__(self) -> None:
        _typed(self.schema, self.schema == SCHEMA, "schema", repr(SCHEMA))
        if self.recorded_digest is not None:
            _typed(
                self.recorded_digest,
                isinstance(self.recorded_digest, str) and _DIGEST.fullmatch(self.recorded_digest) is not None,
                "digest",
                "'sha256:' + 64 hex digits",
            )
        for key in ("run_id", "model", "family"):
            value = getattr(self, key)
            _typed(value, isinstance(value, str) and bool(value.strip()), key, "a non-empty str")
        _typed(self.triggers, _is_int(self.triggers), "triggers", "an int")
        object.__setattr__(self, "readings", tuple(self.readings))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict in schema order."""
        return {
            "schema": self.schema,
            "run_id": self.run_id,
            "model": self.model,
            "family": self.family,
            "declared": {"layers": list(self.declared.layers), "paths": list(self.declared.paths)},
            "triggers": self.triggers,
            "readings": [r.to_dict() for r in self.readings],
            "self_checks": self.self_checks.to_dict(),
        }

    def digest(self) -> str:
        """``sha256:`` + SHA-256 of the canonical JSON of :meth:`to_dict` (keys sorted, no whitespace): equal
        for equal content however the file is laid out, different after any edit of a field."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=True)
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()

    def to_json(self, indent: int | None = None) -> str:
        """JSON text (NaN/inf written as ``NaN``/``Infinity`` so the gate can see them)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=True)

    @classmethod
    def from_dict(cls, data: object) -> ProbeSnapshot:
        """Parse a decoded JSON object; :class:`SnapshotError` naming the first problem."""
        top = _fields(data, "snapshot", TOP_FIELDS, ("digest",))
        _typed(top["schema"], top["schema"] == SCHEMA, "schema", repr(SCHEMA))
        dec = _fields(top["declared"], "declared", ("layers", "paths"))
        layers = _typed(dec["layers"], isinstance(dec["layers"], list), "declared.layers", "a list")
        paths = _typed(dec["paths"], isinstance(dec["paths"], list), "declared.paths", "a list")
        rows = _typed(top["readings"], isinstance(top["readings"], list), "readings", "a list")
        readings = []
        for i, row in enumerate(rows):
            fields = _fields(row, f"readings[{i}]", READING_FIELDS, ("unclipped",))
            _typed(fields["metric"], isinstance(fields["metric"], str), f"readings[{i}].metric", "a str")
            _typed(fields["tier"], isinstance(fields["tier"], str), f"readings[{i}].tier", "a str")
            try:
                readings.append(ReadingRecord(**fields))
            except SnapshotError as exc:
                raise SnapshotError(f"readings[{i}]: {exc}") from None
        checks = _fields(top["self_checks"], "self_checks", SELF_CHECKS)
        return cls(
            run_id=top["run_id"],
            model=top["model"],
            family=top["family"],
            declared=Declared(tuple(layers), tuple(paths)),
            triggers=top["triggers"],
            readings=tuple(readings),
            self_checks=SelfChecks(**checks),
            schema=top["schema"],
            recorded_digest=top.get("digest"),
        )

    @classmethod
    def from_json(cls, text: str) -> ProbeSnapshot:
        """Parse JSON text strictly (duplicate keys and deep nesting refused); :class:`SnapshotError` on
        malformed JSON or schema violations."""
        try:
            data = strict_loads(text)
        except StrictJSONError as exc:
            raise SnapshotError(str(exc)) from None
        return cls.from_dict(data)

    def write(self, path: str | Path) -> Path:
        """Write the snapshot as JSON with its :meth:`digest` to ``path`` and return it."""
        out = Path(path)
        data = {**self.to_dict(), "digest": self.digest()}
        out.write_text(json.dumps(data, indent=1, allow_nan=True) + "\n", encoding="utf-8")
        return out

    @classmethod
    def load(cls, path: str | Path) -> ProbeSnapshot:
        """Read and parse a snapshot file; :class:`SnapshotError` if it is unreadable or malformed."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SnapshotError(f"cannot read {path}: {exc}") from None
        return cls.from_json(text)
