"""How many tokens vLLM's KV pool holds with and without the kvcert plugin, at the same ``VLLM_CPU_KVCACHE_SPACE``.

Question: with kvcert's packed codes stored in vLLM's own blocks, how much more context fits in vLLM's KV memory?

Each variant builds one engine in its own process (SmolLM2-135M, eager, prefix caching off, ``max_model_len``
512) and reports what vLLM allocated: its block count and block size (``cache_config.num_gpu_blocks`` /
``block_size``, the figures behind vLLM's own "KV cache size: N tokens" log line) and the bytes of one layer's
block (the ``kv_cache`` view vLLM binds to the first attention layer), divided into (KV head, token) cells.
Variants: ``vllm`` (the plugin off) at each ``--dtypes`` entry, and ``kvcert`` (``--keys`` / ``--values``) at the
first one. Printed per variant: bytes per (token, KV head) cell, blocks, tokens, tokens per GiB of
``VLLM_CPU_KVCACHE_SPACE``, and tokens relative to ``vllm`` at the first dtype (measured: vLLM's own allocation,
no generation is run).

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python benchmarks/vllm_kv_capacity.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def child(variant: str, dtype: str, keys: str, values: str) -> None:
    """Build one engine and print ``{"blocks", "block_size", "cell", "heads", "layers"}`` as a JSON line."""
    os.environ.pop("KVCERT_VLLM", None)
    if variant == "kvcert":
        os.environ.update(KVCERT_VLLM="1", KVCERT_VLLM_KEYS=keys, KVCERT_VLLM_VALUES=values)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from kvcert.models.zoo import converted_dir

    llm = LLM(
        str(converted_dir("smollm2-135m")),
        dtype=dtype,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=512,
        seed=0,
    )
    vcfg = llm.llm_engine.vllm_config
    ctx = vcfg.compilation_config.static_forward_context
    kv = next(ctx[name].kv_cache for name in ctx if hasattr(ctx[name], "kv_cache"))
    heads, block_size = kv.shape[1], kv.shape[2]  # vLLM's [num_blocks, H, block_size, C] view of one layer
    cell = kv[0].numel() * kv.element_size() // (heads * block_size)
    out = {
        "blocks": vcfg.cache_config.num_gpu_blocks,
        "block_size": vcfg.cache_config.block_size,
        "cell": cell,
        "heads": heads,
        "layers": len([n for n in ctx if hasattr(ctx[n], "kv_cache")]),
    }
    print(json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma list of model dtypes for the vllm variant")
    p.add_argument("--keys", default="dither-int8")
    p.add_argument("--values", default="int4")
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "DTYPE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child[0], args.child[1], args.keys, args.values)
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    dtypes = args.dtypes.split(",")
    runs = [("vllm", d) for d in dtypes] + [("kvcert", dtypes[0])]
    space = float(os.environ["VLLM_CPU_KVCACHE_SPACE"])
    print(f"VLLM_CPU_KVCACHE_SPACE={space:g} GiB  keys={args.keys} values={args.values}  model=smollm2-135m")
    print(f"{'variant':8} {'dtype':9} {'B/cell':>7} {'blocks':>7} {'tokens':>8} {'tokens/GiB':>11} {'x vllm':>7}")
    first = None
    for variant, dtype in runs:
        cmd = [sys.executable, __file__, "--child", variant, dtype, "--keys", args.keys, "--values", args.values]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        tokens = r["blocks"] * r["block_size"]
        first = first or tokens
        print(
            f"{variant:8} {dtype:9} {r['cell']:7d} {r['blocks']:7d} {tokens:8d} {tokens / space:11.0f} "
            f"{tokens / first:7.2f}"
        )


if __name__ == "__main__":
    main()
