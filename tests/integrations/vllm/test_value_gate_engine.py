"""The value gate inside a real vLLM engine (SmolLM2-135M, fp32, CPU, in this process): ``certified:0.2:values=NU``
in validate mode. A paged store has no upgrade codecs, so a head whose value term is above ``NU`` times its value
spread is served its exact values from the host blocks for the read: the records count those reads and their page-in,
and no cell is above its certificate or above the output bound of what was served."""

import pytest
from vllm_reference import engine

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


@pytest.fixture(scope="module")
def records():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENV.items():
            mp.setenv(k, v)
        from vllm import SamplingParams

        llm = engine()
        from kvcert.integrations.vllm import backend  # after the engine starts (see test_engine.py)

        rt = backend.runtime()
        assert rt is not None, "the kvcert backend was not built: plugin not loaded"
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        assert rt.gate.value_rel == 0.02
        live = {**{rid: seq.record for rid, seq in rt.sequences.items()}, **rt.finished}
        found = [
            [r for rid, r in live.items() if rid == o.request_id or rid.startswith(o.request_id + "-")] for o in outs
        ]
        assert all(len(f) == 1 for f in found), (sorted(live), [o.request_id for o in outs])
        return [f[0] for f in found]


def test_the_value_gate_serves_exact_values_and_every_cell_stays_within_its_bounds(records):
    for rec in records:
        assert rec.validated_cells == rec.cells > 0
        assert rec.violations == 0 and rec.out_violations == 0  # per cell, TV and output error
        assert rec.value_repaired_reads > 0 and rec.bytes_paged > 0
        assert rec.summary()["tiers"]["out_violations"] == "measured (validate mode)"
