"""Builders of good and deliberately broken probe snapshots (shared by the probe and CLI tests)."""

import copy
import json
from pathlib import Path

from kvcert.probe import PATHS, ProbeSnapshot, SnapshotError

LAYERS = [0, 1, 2]
METRICS = {  # path -> (metric, kind, tier, value, registered name)
    "dense_kv": ("attn_dist:tv@consume", "bound", "certified", 0.031, "certificates"),
    "latent_kv": ("kv_entry:l2@write", "bound", "certified", 0.42, "latent_witness"),
    "sparse_selector": ("selector_dist:tv@consume", "bound", "partial", 0.002, "sel_bS"),
    "recurrent": ("forget_gate:log@consume", "reading", "empirical", -3.2, "gate_sum_log_a/max_channel"),
    "pooling": ("pool_weights:frac@write", "reading", "empirical", 0.55, "pool_top1_norm/max"),
}


def good_dict() -> dict:
    readings = [
        {
            "layer": layer,
            "path": path,
            "metric": METRICS[path][0],
            "value": METRICS[path][3] * (1 + layer / 10),
            "tier": METRICS[path][2],
            "kind": METRICS[path][1],
            "name": METRICS[path][4],
        }
        for layer in LAYERS
        for path in PATHS
    ]
    return {
        "schema": "kvcert.probe/1",
        "run_id": "run-1",
        "model": "tiny-llama",
        "family": "llama",
        "declared": {"layers": list(LAYERS), "paths": list(PATHS)},
        "triggers": 123,
        "readings": readings,
        "self_checks": {"witness_violations": 0, "certified_flips": 0, "pooling_floor_violations": 0},
    }


def broken(mode: str) -> dict:
    """A copy of :func:`good_dict` with exactly one failure ``mode``."""
    d = copy.deepcopy(good_dict())
    if mode == "missing_layer":
        d["readings"] = [r for r in d["readings"] if r["layer"] != 1]
    elif mode == "missing_path":
        d["readings"] = [r for r in d["readings"] if r["path"] != "recurrent"]
    elif mode == "zero_triggers":
        d["triggers"] = 0
    elif mode == "nan":
        d["readings"][3]["value"] = float("nan")
    elif mode == "inf":
        d["readings"][1]["value"] = float("inf")
    elif mode == "tv_above_one":
        d["readings"][0]["value"] = 1.2
    elif mode == "negative_norm":
        d["readings"][1]["value"] = -0.01
    elif mode == "witness_violation":
        d["self_checks"]["witness_violations"] = 1
    elif mode == "certified_flip":
        d["self_checks"]["certified_flips"] = 2
    elif mode == "pooling_floor":
        d["self_checks"]["pooling_floor_violations"] = 1
    elif mode == "unregistered_metric":
        d["readings"][2]["name"] = "made_up_meter"
    elif mode == "wrong_tier":
        d["readings"][1]["tier"] = "partial"  # latent_witness is registered certified
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return d


def with_digest(data: dict) -> dict:
    """``data`` with the digest :meth:`ProbeSnapshot.write` would record (unchanged if it does not parse)."""
    try:
        return {**data, "digest": ProbeSnapshot.from_dict(data).digest()}
    except SnapshotError:
        return data


def write(path: Path, data: dict, digest: bool = True) -> Path:
    """Write ``data`` as a probe run would (with its digest), or without one (``digest=False``)."""
    path.write_text(json.dumps(with_digest(data) if digest else data))
    return path
