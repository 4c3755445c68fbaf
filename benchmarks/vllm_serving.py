"""Decode throughput of vLLM's CPU backend with and without the kvcert plugin, side by side in one run.

Question: what does serving every read through kvcert (codes in vLLM's blocks, certified decode reads) cost inside
vLLM?

In-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, SmolLM2-135M, fp32, eager) serve the same
``--requests`` prompts of ``--context`` tokens concurrently (one ``generate`` call) under the variants below, in
alternating rounds so that machine load hits every variant alike:

* ``vllm``: vLLM's own CPU backend, in a child process without the plugin (the plugin packs the blocks of every
  engine in its process, so the two cannot share one); the child runs a round whenever the parent asks;
* ``raw``: the plugin with ``--keys/--values`` and the gate off (certificates computed, nothing repaired);
* ``gated``: the plugin with ``certified:--tau``;
* ``ledger``: ``gated`` with the request ledger on (``--ledger``, the default): an account and a cache observer
  per request, every write and certified read as a ledger event, the event log written with group commits
  (:mod:`kvcert.integrations.vllm.ledger_feed`), into a fresh temporary directory.

Printed per variant: wall time, output tokens/s, decode time per output token (wall time minus a prefill-only
run of the same prompts, over the decoded tokens) and its ratio to ``vllm`` (empirical, this machine). With the
plugin, vLLM's kernel does not run on its layers: every row is kvcert's (prefill rows exact over the host tier).

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python benchmarks/vllm_serving.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any


def _engine(args: argparse.Namespace) -> tuple[Any, list[Any], Any, Any]:
    """The engine, the prompts, the full and the prefill-only sampling parameters (same in parent and child)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcert.models.zoo import converted_dir

    llm = LLM(
        str(converted_dir("smollm2-135m")),
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=args.context + args.tokens + 16,
        seed=0,
    )
    ids = llm.get_tokenizer()("The quick brown fox jumps over the lazy dog. " * args.context)["input_ids"]
    prompts = [TokensPrompt(prompt_token_ids=ids[i : i + args.context]) for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)  # prefill + first token only
    return llm, prompts, params, first


def _round(llm: Any, prompts: list[Any], params: Any, first: Any) -> tuple[float, float]:
    """``(prefill-only seconds, full generation seconds)`` of one round."""
    t0 = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return t1 - t0, time.perf_counter() - t1


#: prefix of the child's replies on its stdout (vLLM logs there too)
REPLY = "kvcert-bench "


def _child(args: argparse.Namespace) -> None:
    """The ``vllm`` variant: vLLM's own backend; one round per line on stdin, one :data:`REPLY` JSON line back."""
    engine = _engine(args)
    print(REPLY + "{}", flush=True)
    for _ in sys.stdin:
        prefill, wall = _round(*engine)
        print(REPLY + json.dumps({"prefill": prefill, "wall": wall}), flush=True)


def _reply(stdout: Any) -> dict[str, float]:
    """The child's next reply (log lines before it skipped); ``RuntimeError`` when it exits first."""
    for line in stdout:
        if line.startswith(REPLY):
            return json.loads(line[len(REPLY) :])
    raise RuntimeError("the vllm variant's child process exited (its engine failed; see its stderr)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--requests", type=int, default=2, help="concurrent requests")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per variant")
    p.add_argument("--keys", default="dither-int8")
    p.add_argument("--values", default="int4")
    p.add_argument("--tau", type=float, default=0.2)
    p.add_argument("--ledger", action=argparse.BooleanOptionalAction, default=True, help="add the ledger variant")
    p.add_argument("--variants", default=None, help="comma list of variants to run (default: all); keep vllm")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.child:
        os.environ.pop("KVCERT_VLLM", None)
        _child(args)
        return
    env = {k: v for k, v in os.environ.items() if k != "KVCERT_VLLM"}
    baseline = subprocess.Popen(  # started first: both engines load together
        [sys.executable, __file__, "--child", *sys.argv[1:]],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    os.environ.update(
        KVCERT_VLLM="1",
        KVCERT_VLLM_KEYS=args.keys,
        KVCERT_VLLM_VALUES=args.values,
        KVCERT_VLLM_GATE="off",
    )
    llm, prompts, params, first = _engine(args)
    from kvcert.integrations.vllm import backend  # after the engine starts (see tests/integrations/vllm)
    from kvcert.integrations.vllm.ledger_feed import ServingLedger
    from kvcert.integrations.vllm.settings import Settings

    rt = backend.runtime()
    assert rt is not None
    variants = {
        "vllm": None,
        "raw": Settings(args.keys, args.values, "off"),
        "gated": Settings(args.keys, args.values, f"certified:{args.tau}"),
    }
    ledger = None
    if args.ledger:
        variants["ledger"] = variants["gated"]
        ledger = ServingLedger(tempfile.mkdtemp(prefix="kvcert-bench-ledger-"))
    if args.variants is not None:
        keep = set(args.variants.split(",")) | {"vllm"}
        variants = {k: v for k, v in variants.items() if k in keep}
    assert baseline.stdin is not None and baseline.stdout is not None
    _reply(baseline.stdout)  # its engine is up
    wall = {name: 0.0 for name in variants}
    prefill = {name: 0.0 for name in variants}
    for _ in range(args.rounds):
        for name, settings in variants.items():
            if settings is None:  # vllm: the child's round
                baseline.stdin.write("round\n")
                baseline.stdin.flush()
                got = _reply(baseline.stdout)
                t_prefill, t_wall = got["prefill"], got["wall"]
            else:
                rt.ledger = ledger if name == "ledger" else None  # requests keep the ledger that leased them
                rt.configure(settings)
                t_prefill, t_wall = _round(llm, prompts, params, first)
            prefill[name] += t_prefill
            wall[name] += t_wall
    baseline.stdin.close()
    baseline.wait()
    out_tokens = args.rounds * args.requests * args.tokens
    decode_tokens = args.rounds * args.requests * (args.tokens - 1)
    print(
        f"context={args.context} tokens={args.tokens} requests={args.requests} rounds={args.rounds} "
        f"keys={args.keys} values={args.values} tau={args.tau}"
    )
    print(f"{'variant':8} {'wall s':>8} {'out tok/s':>10} {'decode ms/tok':>14} {'x vllm':>7}   (empirical)")
    ref = (wall["vllm"] - prefill["vllm"]) / decode_tokens
    for name, w in wall.items():
        per_tok = (w - prefill[name]) / decode_tokens  # decode steps only: minus a prefill-only run's time
        print(f"{name:8} {w:8.1f} {out_tokens / w:10.2f} {1000 * per_tok:14.1f} {per_tok / ref:7.2f}")
    if ledger is not None and {"gated", "ledger"} <= set(variants):
        gated = (wall["gated"] - prefill["gated"]) / decode_tokens
        led = (wall["ledger"] - prefill["ledger"]) / decode_tokens
        s = ledger.summary()
        print(
            f"ledger/gated decode time per token: {led / gated:.3f}  (ledger: {s['n_user_requests']} accounts, "
            f"{s['n_reads']} reads, {s['n_written']} writes, {len(ledger.log)} events, in {ledger.dir})"
        )


if __name__ == "__main__":
    main()
