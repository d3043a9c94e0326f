"""The short/long mix on a GPU: how much does continuous batching beat static on a Llama-3-8B-shaped
model with random bf16 weights? (bench/gpu_check.sh's stage that runs the whole engine.)

    python bench/gpu_mix.py [--tiny] [--num-requests 200] [--max-num-seqs 32] [--out mix.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline import Engines  # noqa: E402
from report import (continuous_vs_static, lean, log, machine_info, out_path, positive, ratio_rows,  # noqa: E402
                    require_gpu, run_line, size_defaults, text_table, timed_generate, write_json)
from workload import short_long_mix  # noqa: E402

MODEL = "llama3-8b-random"
TARGET = 1.8
# flag: (default, with --tiny). 32 seqs: as bench/offline.py's mix32 section; 256 batched tokens with
# chunked prefill: fewer token buckets to compile than a whole-prompt budget.
SIZES = {"num_requests": (200, 8), "max_num_seqs": (32, 4), "max_model_len": (1024, 64),
         "max_num_batched_tokens": (256, 32)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, (full, tiny) in SIZES.items():
        ap.add_argument("--" + name.replace("_", "-"), type=positive, help=f"default {full} ({tiny} with --tiny)")
    ap.add_argument("--attention-backend", default="auto", choices=("auto", "xla", "pallas"))
    ap.add_argument("--tiny", action="store_true", help="the tiny model and 8 requests (a CPU dry run)")
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/mix.json if $OUT is set)")
    ap.add_argument("--require-gpu", action="store_true", help="fail at once when JAX sees no GPU")
    args = size_defaults(ap.parse_args(argv), SIZES)
    short, long, prompt_len, dtype, name = (4, 24, (8, 24), "float32", "tiny") if args.tiny else (
        16, 512, (32, 256), "bfloat16", MODEL)
    if args.num_requests < 2 or args.max_model_len < prompt_len[1] + long:  # else a traceback after the engines' build
        ap.error(f"the mix wants --num-requests >= 2 (a short and a long half) and --max-model-len >= "
                 f"{prompt_len[1] + long} (its longest request), got {args.num_requests} and {args.max_model_len}")
    require_gpu(args.require_gpu)
    from model import ModelConfig
    from model_loader import BUILTIN_MODELS

    if not args.tiny:  # registered for this process only
        from attention_kernels import LLAMA3_8B_HF

        BUILTIN_MODELS[MODEL] = ModelConfig.from_hf(LLAMA3_8B_HF)
    out = out_path(args.out, "mix.json")
    reqs = short_long_mix(args.num_requests, BUILTIN_MODELS[name].vocab_size, short=short, long=long,
                          prompt_len=prompt_len)
    # KV never limits (Engines: every slot holds a whole max_model_len sequence); one engine at a time
    engines = Engines(name, log, dtype=dtype, seed=0, enable_chunked_prefill=True,
                      max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend)
    results: dict[str, Any] = {
        "machine": machine_info(), "model": name, "dtype": dtype, "args": vars(args),
        "workload": {"num_requests": len(reqs), "short": short, "long": long, "prompt_len": prompt_len},
        "runs": {}, "build_s": {}}
    for scheduling in ("continuous", "static"):
        engines.keep_only(set())
        llm = engines.get(args.max_num_seqs, scheduling, args.max_model_len)
        results["build_s"][scheduling] = engines.build_s[f"{scheduling}-{args.max_num_seqs}-{args.max_model_len}"]
        results["attention_backend"] = llm.engine.runner.backend.name
        results["runs"][scheduling] = run = lean(timed_generate(
            llm, [r.prompt_token_ids for r in reqs], [r.max_tokens for r in reqs],
            ["short" if r.max_tokens == short else "long" for r in reqs]))
        log(run_line(scheduling, run) + f" (built in {results['build_s'][scheduling]}s)")
        if out:  # what finished, should the stage's time limit cut the next run off
            write_json(out, results)
    engines.keep_only(set())
    ratios = continuous_vs_static(results["runs"]["continuous"], results["runs"]["static"], TARGET)
    results["ratios"] = {"tok_s_continuous_over_static": ratios[0]["measured"], "tok_s_ideal_from_steps":
                         ratios[0]["ideal"], "short_p99_static_over_continuous": ratios[1]["measured"],
                         "short_p99_ideal_from_steps": ratios[1]["ideal"], "target_tok_s": TARGET}
    if out:
        write_json(out, results)
    log(text_table([["", "ratio", "measured", "ideal (steps)", "target", ""]] + ratio_rows(ratios, "mix"), left=2))
    return results


if __name__ == "__main__":
    main()
