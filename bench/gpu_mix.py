"""The seed's mix on a GPU: continuous vs static batching on a Llama-3-8B-shaped model
with random bf16 weights (the part of bench/gpu_check.sh that runs the whole engine).

    python bench/gpu_mix.py [--num-requests 200] [--max-num-seqs 32] [--out mix.json]
    python bench/gpu_mix.py --tiny      # the tiny model, a handful of requests (CPU dry run)

The workload is bench/offline.py's: half the requests max_tokens 16, half 512, shuffled,
prompts of 32..256 random tokens, all arriving at once, greedy with ignore_eos, so only
scheduling differs. Each engine is built (and warmed up: every step program compiled)
outside the timed region; the static engine reuses the continuous one's compiled
programs through the persistent compilation cache. The JSON is rewritten after each run,
so a timeout after the continuous run still leaves it. Figures: output tokens/s
continuous / static (target >= 1.8x) and short-request p99 completion static /
continuous, each beside its ideal from the engine's own step counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_info, seed_mix  # noqa: E402

MODEL = "llama3-8b-random"
TARGET = 1.8


def register_model(tiny: bool) -> str:
    """A built-in random model of Llama-3-8B's shape (config.json fields as in
    bench/kernels.py), registered for this process only."""
    import model as model_lib
    from kernels import LLAMA3_8B_HF

    if tiny:
        return "tiny"
    model_lib.BUILTIN_MODELS[MODEL] = model_lib.ModelConfig.from_hf(LLAMA3_8B_HF)
    return MODEL


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--max-num-seqs", type=int, default=32, help="32: the seed's mix32 section (bench/offline.py)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256,
                    help="with chunked prefill: fewer token buckets to compile than a whole-prompt budget")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--tiny", action="store_true", help="the tiny model and 8 requests (a CPU dry run)")
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/mix.json if $OUT is set)")
    ap.add_argument("--require-gpu", action="store_true", help="fail at once when JAX sees no GPU")
    args = ap.parse_args(argv)
    if args.require_gpu:
        import jax

        if jax.default_backend() != "gpu":
            sys.exit(f"--require-gpu: JAX sees no GPU ({jax.devices()})")
    short, long, prompt_len = 16, 512, (32, 256)
    dtype = "bfloat16"
    if args.tiny:
        args.num_requests, args.max_num_seqs, args.max_model_len = 8, 4, 64
        args.max_num_batched_tokens = 32
        short, long, prompt_len, dtype = 4, 24, (8, 24), "float32"
    out = args.out or (os.path.join(os.environ["OUT"], "mix.json") if os.environ.get("OUT") else None)

    from engine import LLM
    from model import BUILTIN_MODELS
    from offline import _params, _run_line, run_taxirank

    name = register_model(args.tiny)
    reqs = seed_mix(args.num_requests, BUILTIN_MODELS[name].vocab_size, short=short, long=long,
                    prompt_len=prompt_len)
    results: dict[str, Any] = {
        "machine": machine_info(), "model": name, "dtype": dtype, "args": vars(args),
        "workload": {"num_requests": len(reqs), "short": short, "long": long, "prompt_len": prompt_len},
        "runs": {}, "build_s": {}}

    def save() -> None:
        if out:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out, "w") as f:
                json.dump(results, f, indent=1)

    for scheduling in ("continuous", "static"):
        t0 = time.perf_counter()
        llm = LLM(name, log=lambda s: print(f"    [engine] {s}", flush=True), dtype=dtype, seed=0,
                  max_num_seqs=args.max_num_seqs, scheduling=scheduling, max_model_len=args.max_model_len,
                  block_size=16, enable_chunked_prefill=True,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  # KV never limits: every slot holds a whole max_model_len sequence (the +1: null block)
                  num_kv_blocks=args.max_num_seqs * -(-args.max_model_len // 16) + 1,
                  attention_backend=args.attention_backend)
        llm.generate([[1] * 8, [2] * 8], _params([2, 3]), use_tqdm=False)  # first dispatches, untimed
        results["build_s"][scheduling] = round(time.perf_counter() - t0, 1)
        results["attention_backend"] = llm.engine.runner.backend.name
        run = run_taxirank(llm, reqs, short)
        run.pop("token_ids")
        run.pop("completion_s_all")
        run.pop("finish_step_all")
        results["runs"][scheduling] = run
        print(_run_line(scheduling, run) + f" (built in {results['build_s'][scheduling]}s)", flush=True)
        save()
        del llm
        gc.collect()

    c, s = results["runs"]["continuous"], results["runs"]["static"]
    results["ratios"] = {
        "tok_s_continuous_over_static": c["output_tok_s"] / s["output_tok_s"],
        "tok_s_ideal_from_steps": s["stats"]["num_steps"] / c["stats"]["num_steps"],
        "short_p99_static_over_continuous": s["short_completion_s"]["p99"] / c["short_completion_s"]["p99"],
        "short_p99_ideal_from_steps": s["short_finish_step"]["p99"] / c["short_finish_step"]["p99"],
        "target_tok_s": TARGET,
    }
    save()
    r = results["ratios"]
    print(f"mix     continuous / static output tok/s: {r['tok_s_continuous_over_static']:.2f}x "
          f"(ideal from steps {r['tok_s_ideal_from_steps']:.2f}x, target {TARGET}x); short p99 "
          f"static / continuous {r['short_p99_static_over_continuous']:.2f}x "
          f"(ideal {r['short_p99_ideal_from_steps']:.2f}x)", flush=True)
    return results


if __name__ == "__main__":
    main()
