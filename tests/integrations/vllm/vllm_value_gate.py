"""A kvcert engine with the value gate (``certified:0.2:values=0.02``, validate mode), run as a script by
``test_value_gate_engine.py``: two prompts in one batch; prints each request's record as one JSON list."""

import json
import os
from dataclasses import asdict

PROMPTS = ["The capital of France is", "Water boils at a temperature of 100 degrees"]
MAX_TOKENS = 24  # > the write block (16) minus the prompt, so compressed entries are read
ENV = {
    "KVCERT_VLLM": "1",
    "KVCERT_VLLM_KEYS": "dither-int8",
    "KVCERT_VLLM_VALUES": "int4",
    "KVCERT_VLLM_GATE": "certified:0.2:values=0.02",
    "KVCERT_VLLM_VALIDATE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}

if __name__ == "__main__":
    os.environ.update(ENV)
    from vllm import SamplingParams
    from vllm_reference import engine

    llm = engine()
    from kvcert.integrations.vllm import backend  # after the engine starts (see test_engine.py)

    rt = backend.runtime()
    assert rt is not None, "the kvcert backend was not built: plugin not loaded"
    assert rt.gate.value_rel == 0.02
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    live = {**{rid: seq.record for rid, seq in rt.sequences.items()}, **rt.finished}
    found = [[r for rid, r in live.items() if rid == o.request_id or rid.startswith(o.request_id + "-")] for o in outs]
    assert all(len(f) == 1 for f in found), (sorted(live), [o.request_id for o in outs])
    print(json.dumps([asdict(f[0]) for f in found]))
