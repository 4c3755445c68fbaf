"""Probe snapshots (schema ``kvcert.probe/1``) and their acceptance gate."""

from kvcert.probe.snapshot import (
    KINDS,
    PATHS,
    SCHEMA,
    SELF_CHECKS,
    Declared,
    ProbeSnapshot,
    ReadingRecord,
    SelfChecks,
    SnapshotError,
)
from kvcert.probe.verify import STAGES, VerifyResult, verify, verify_file

__all__ = [
    "KINDS",
    "PATHS",
    "SCHEMA",
    "SELF_CHECKS",
    "STAGES",
    "Declared",
    "ProbeSnapshot",
    "ReadingRecord",
    "SelfChecks",
    "SnapshotError",
    "VerifyResult",
    "verify",
    "verify_file",
]
