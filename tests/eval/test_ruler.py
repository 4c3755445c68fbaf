import ast
import json
import random
import re

import numpy as np
import pytest

from kvcert.eval import ruler
from kvcert.eval.ruler import MIN_CONTEXT, TASK_NAMES, Sample, generate_jsonl, load_task, score

WRONG = "zzqx"


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generation_is_deterministic_and_leaves_global_rng_alone(smol_dir, tmp_path):
    # first run executes niah.py unmodified (and keeps its word list); later runs reuse the kept list
    ruler._GENERATOR_MEMO.clear()
    random.seed(123)
    np.random.seed(123)
    expect_py, expect_np = random.Random(123).random(), np.random.RandomState(123).random_sample()
    a = generate_jsonl("niah_single_1", 512, 2, 7, smol_dir, tmp_path / "a.jsonl")
    assert (random.random(), np.random.random_sample()) == (expect_py, expect_np)
    assert "niah" in ruler._GENERATOR_MEMO
    b = generate_jsonl("niah_single_1", 512, 2, 7, smol_dir, tmp_path / "b.jsonl")
    c = generate_jsonl("niah_single_1", 512, 2, 8, smol_dir, tmp_path / "c.jsonl")
    assert a.read_bytes() == b.read_bytes()
    assert [r["outputs"] for r in _read(a)] != [r["outputs"] for r in _read(c)]


@pytest.mark.parametrize("task", TASK_NAMES)
def test_every_task_generates_offline_and_scores_its_reference(task, smol_dir, tmp_path):
    path = generate_jsonl(task, MIN_CONTEXT[task], 2, 42, smol_dir, tmp_path / f"{task}.jsonl")
    raw = _read(path)
    samples = ruler._samples_from_jsonl(task, path, 2)
    cfg = ruler.task_config(task)
    assert len(samples) == 2
    for row, s in zip(raw, samples, strict=True):
        assert s.prompt + s.answer_prefix == row["input"] == s.input
        assert s.answer_prefix.startswith(cfg["answer_prefix"].split("{", 1)[0])
        assert s.max_new_tokens == cfg["tokens_to_generate"]
        assert len(s.outputs) >= 1 and all(s.outputs)
        assert score(s, " ".join(s.outputs)) == 1.0
        assert score(s, WRONG) < 1.0
        if cfg["task"] != "qa" and len(s.outputs) > 1:  # string_match_all: partial credit
            assert score(s, s.outputs[0]) < 1.0


def test_load_task_caches_and_slices(smol_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCERT_CACHE", str(tmp_path / "one"))
    two = load_task("fwe", 512, 2, 3, smol_dir)
    cached = ruler.cache_file("fwe", 512, 3, smol_dir)
    assert cached.is_file() and cached.is_relative_to(tmp_path / "one" / "ruler")

    def _no_regeneration(*args, **kwargs):
        raise AssertionError("cached set should have been reused")

    monkeypatch.setattr(ruler, "generate_jsonl", _no_regeneration)
    assert load_task("fwe", 512, 1, 3, smol_dir) == two[:1]
    monkeypatch.undo()
    # the generators are sequential: a fresh 1-sample set equals the first sample of the 2-sample set
    monkeypatch.setenv("KVCERT_CACHE", str(tmp_path / "two"))
    assert load_task("fwe", 512, 1, 3, smol_dir) == two[:1]


def test_bad_arguments_are_named(smol_dir, tmp_path):
    with pytest.raises(ValueError, match="task"):
        load_task("niah_single_9", 512, 1, 0, smol_dir)
    with pytest.raises(ValueError, match="context"):
        load_task("qa_1", 1024, 1, 0, smol_dir)
    with pytest.raises(ValueError, match="samples"):
        load_task("fwe", 512, 0, 0, smol_dir)
    with pytest.raises(ValueError, match="tokenizer_dir"):
        load_task("fwe", 512, 1, 0, tmp_path)


def test_postprocess_matches_package_definition():
    src = (ruler._package_dir() / "eval" / "evaluate.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "postprocess_pred")
    env = {"re": re}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "evaluate.py", "exec"), env)
    for text in ["  42\n", "a\tb\x01c ", "\x00", "", None, " The answer is 7\x1f"]:
        assert ruler.postprocess_prediction(text) == env["postprocess_pred"](text, {})


def _sample(task, outputs):
    return Sample(task=task, index=0, prompt="p", answer_prefix="", outputs=tuple(outputs), length=1, max_new_tokens=1)


def test_metrics_are_rulers_all_vs_part():
    multi = _sample("niah_multivalue", ["1111", "2222", "3333", "4444"])
    assert score(multi, "2222 and 4444") == 0.5
    assert score(multi, "1111 2222 3333 4444.") == 1.0
    qa = _sample("qa_1", ["Paris", "the city of Paris"])
    assert score(qa, "paris") == 1.0  # case-insensitive, any reference suffices
    assert score(qa, "Lyon") == 0.0
