"""A resumable journal of a paired RULER run: one JSON line per finished sample, its telemetry beside it.

A long measurement (tens of samples × several cache variants on a shared CPU) must survive an interruption
without redoing finished samples and without mixing results of different runs. A journal directory holds:

* ``config.json`` — every input that determines a sample's results (model, context, seed, tasks, variants
  with their gates, validate mode, ...), written when the journal is created;
* ``samples.jsonl`` — one line per finished sample: its task and index, and per variant the RULER score and
  the decoded text;
* ``telemetry/<task>-<index>.pt`` — that sample's per-variant :class:`~kvcert.cache.telemetry.Telemetry`
  (``torch.save`` of a dict label -> Telemetry; variants without telemetry, e.g. dense, are absent).

Contract (crash consistency): :meth:`Journal.append` writes the telemetry file under a temporary name,
renames it into place, and only then appends the sample's line (flushed and ``fsync``-ed). So at any
interruption every line in ``samples.jsonl`` has its complete telemetry file; a sample without a line is
simply redone. A torn last line (the process died inside the write) is dropped when the journal is reopened.

Several processes may share one journal. A worker :meth:`Journal.claim` s a sample before decoding it: the
claim is a file ``claims/<key>`` created exclusively (``O_EXCL``) holding the worker's pid, so two live workers
never decode the same sample; a claim whose pid is no longer running (a killed worker) is taken over. Workers
can therefore join or leave a run at any time. An append holds an exclusive ``flock`` on ``samples.jsonl`` while
it checks the key and writes its line, so even a duplicated decode is journaled once.

Reopening a journal with a different config raises ``ValueError`` naming the keys that differ: results
of different runs never mix. The number of samples per task is deliberately *not* part of the config:
RULER's generators are sequential (the first ``k`` samples of a set of ``n >= k`` are the set of ``k``,
:mod:`kvcert.eval.ruler`), so a rerun with more samples extends the same set.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvcert.cache.telemetry import Telemetry

CONFIG_FILE = "config.json"
SAMPLES_FILE = "samples.jsonl"
TELEMETRY_DIR = "telemetry"
CLAIMS_DIR = "claims"


@dataclass(frozen=True)
class JournalRow:
    """One finished sample: per variant label its RULER score (in [0, 1], empirical) and decoded text."""

    task: str
    index: int
    scores: dict[str, float]
    predictions: dict[str, str]

    @property
    def key(self) -> str:
        """``<task>-<index>``: the sample's identity within a run (RULER indices are unique per task)."""
        return sample_key(self.task, self.index)


def sample_key(task: str, index: int) -> str:
    """The journal key of sample ``index`` of ``task``."""
    return f"{task}-{index}"


def _canonical(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` through a JSON round trip (tuples become lists), so a reopened config compares equal."""
    return json.loads(json.dumps(dict(config), sort_keys=True, allow_nan=False))


class Journal:
    """The journal directory ``path`` for a run with inputs ``config`` (created if absent).

    Raises ``ValueError`` if ``path`` holds a journal of a different config (naming the differing keys) or
    ``config`` is not JSON-serialisable.
    """

    def __init__(self, path: Path, config: Mapping[str, Any]) -> None:
        self.path = Path(path)
        self.config = _canonical(config)
        cfg_file = self.path / CONFIG_FILE
        if cfg_file.is_file():
            stored = json.loads(cfg_file.read_text(encoding="utf-8"))
            differ = sorted(k for k in set(stored) | set(self.config) if stored.get(k) != self.config.get(k))
            if differ:
                raise ValueError(
                    f"journal {self.path} was started with a different config (keys {differ}); "
                    "use a new --out directory or the same inputs"
                )
        else:
            (self.path / TELEMETRY_DIR).mkdir(parents=True, exist_ok=True)
            tmp = cfg_file.with_name(f".{CONFIG_FILE}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, cfg_file)
        (self.path / CLAIMS_DIR).mkdir(exist_ok=True)
        self._drop_torn_tail()

    @property
    def samples_file(self) -> Path:
        """The JSONL file of finished samples."""
        return self.path / SAMPLES_FILE

    def _telemetry_file(self, key: str) -> Path:
        return self.path / TELEMETRY_DIR / f"{key}.pt"

    def _drop_torn_tail(self) -> None:
        """Truncate a last line that is not complete JSON (an interrupted write); earlier lines are intact."""
        f = self.samples_file
        if not f.is_file():
            return
        with open(f, "r+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # not while another process appends
            data = fh.read()
            keep = data.rfind(b"\n") + 1  # every complete line ends with a newline
            if keep < len(data):
                fh.truncate(keep)

    def rows(self) -> list[JournalRow]:
        """Finished samples in the order they were appended (a key appended twice keeps its first line)."""
        if not self.samples_file.is_file():
            return []
        out: dict[str, JournalRow] = {}
        lines = self.samples_file.read_text(encoding="utf-8").split("\n")[:-1]  # last: "" or a line being written
        for line in lines:
            if not line.strip():
                continue
            d = json.loads(line)
            row = JournalRow(
                d["task"], int(d["index"]), {k: float(v) for k, v in d["scores"].items()}, dict(d["predictions"])
            )
            out.setdefault(row.key, row)
        return list(out.values())

    def done(self) -> set[str]:
        """Keys (:func:`sample_key`) of the finished samples."""
        return {r.key for r in self.rows()}

    def claim(self, key: str) -> bool:
        """Claim sample ``key`` for this process: True if it is not journaled and no other live process holds it.

        The claim file is created exclusively; an existing claim of a process that is no longer running (or of
        this process) is taken over. A claim is never released: a journaled sample needs none.
        """
        if key in self.done():
            return False
        path = self.path / CLAIMS_DIR / key
        mine = str(os.getpid()).encode()
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                holder = int(path.read_bytes() or b"0")
            except (OSError, ValueError):
                holder = 0
            if holder == os.getpid():
                return True
            if holder and _alive(holder):
                return False
            tmp = path.with_name(f".{key}.{os.getpid()}.tmp")  # take over a dead worker's claim
            tmp.write_bytes(mine)
            os.replace(tmp, path)
            return path.read_bytes() == mine  # two takers at once: the last rename wins, the other backs off
        with os.fdopen(fd, "wb") as fh:
            fh.write(mine)
        return True

    def telemetry(self, row: JournalRow) -> dict[str, Telemetry]:
        """The per-variant telemetry saved with ``row`` (our own files: full unpickling is intended)."""
        loaded: dict[str, Telemetry] = torch.load(self._telemetry_file(row.key), weights_only=False)
        return loaded

    def append(self, row: JournalRow, telemetry: Mapping[str, Telemetry]) -> None:
        """Record a finished sample: its telemetry file first (atomically), then its line (flushed, fsynced).

        Raises ``ValueError`` if the sample is already recorded or ``telemetry`` names a variant that has no
        score in ``row``.
        """
        extra = sorted(set(telemetry) - set(row.scores))
        if extra:
            raise ValueError(f"telemetry for variants without a score: {extra}")
        target = self._telemetry_file(row.key)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        torch.save(dict(telemetry), tmp)
        line = json.dumps(
            {"task": row.task, "index": row.index, "scores": row.scores, "predictions": row.predictions},
            sort_keys=True,
            allow_nan=False,
        )
        with open(self.samples_file, "a", encoding="utf-8") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes
            if row.key in self.done():
                tmp.unlink()
                raise ValueError(f"sample {row.key} is already in journal {self.path}")
            os.replace(tmp, target)
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def _alive(pid: int) -> bool:
    """True if a process ``pid`` exists (signal 0 probes without signalling)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
