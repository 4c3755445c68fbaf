"""Run as a script (not a test module): vLLM's own CPU backend, the kvcert plugin off, in its own process.

``python vllm_reference.py MAX_TOKENS PROMPT...`` builds :func:`engine`, the engine ``test_engine.py`` builds
with the kvcert plugin (``VLLM_CPU_KVCACHE_SPACE`` from the environment), generates the prompts greedily and
prints one JSON line: ``{"tokens": [[...], ...], "num_blocks": N, "block_size": B}``. The kvcert plugin
registers itself in every vLLM process it is loaded in, so the reference needs a process without
``KVCERT_VLLM=1``."""

import json
import os
import sys


def engine():
    """The engine of both sides of the comparison: SmolLM2 in float32, eager, no prefix caching, ``max_model_len``
    512, seed 0 (vLLM is imported here, after the caller has set the environment)."""
    from vllm import LLM

    from kvcert.models.zoo import converted_dir

    return LLM(
        str(converted_dir("smollm2-135m")),
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=512,
        seed=0,
    )


if __name__ == "__main__":
    os.environ.pop("KVCERT_VLLM", None)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    llm = engine()
    outs = llm.generate(sys.argv[2:], SamplingParams(temperature=0, max_tokens=int(sys.argv[1])))
    cache = llm.llm_engine.vllm_config.cache_config
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    print(json.dumps({"tokens": tokens, "num_blocks": cache.num_gpu_blocks, "block_size": cache.block_size}))
