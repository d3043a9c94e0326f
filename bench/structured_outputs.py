"""Structured outputs bench: what does constraining half the batch by a JSON schema cost?

    python bench/structured_outputs.py [--max-tokens 24]

What is reported, and how constrained steps keep async scheduling: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import TYPE_CHECKING, Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from report import (machine_info, model_name, positive, ratio_rows, results_dir, side_by_side, summarize,  # noqa: E402
                    text_table, write_json)
from sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from workload import text_prompt  # noqa: E402

if TYPE_CHECKING:
    from llm import LLM


def schema(i: int) -> dict:
    """A distinct small schema per request: nested object, enum, bounded integers, array."""
    return {"type": "object", "additionalProperties": False, "required": [f"name{i}", "age", "tags", "home"],
            "properties": {f"name{i}": {"type": "string", "maxLength": 16},
                           "age": {"type": "integer", "minimum": 0, "maximum": 120 + i},
                           "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
                           "home": {"type": "object", "additionalProperties": False, "required": ["city"],
                                    "properties": {"city": {"type": "string", "maxLength": 12}}}}}


def host_clock(llm: LLM) -> list[float]:
    """The list each LLMEngine.step appends its host time to: its wall time minus the time it
    spent waiting for the device (InFlightStep.result)."""
    import runner as runner_module

    host, wait = [], [0.0]
    result, step = runner_module.InFlightStep.result, llm.engine.step

    def timed_result(in_flight):
        t0 = time.perf_counter()
        try:
            return result(in_flight)
        finally:
            wait[0] += time.perf_counter() - t0

    def timed_step():
        wait[0], t0 = 0.0, time.perf_counter()
        out = step()
        host.append(time.perf_counter() - t0 - wait[0])
        return out

    runner_module.InFlightStep.result, llm.engine.step = timed_result, timed_step
    return host


def run(llm: LLM, host: list[float], prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    host.clear()
    fill0, t0 = llm.stats.structured_output_bitmask_seconds, time.perf_counter()
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    wall, tokens, steps = time.perf_counter() - t0, sum(len(o.token_ids) for o in outs), max(len(host), 1)
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall, "steps": len(host),
            "host_ms_per_step": 1e3 * sum(host) / steps,
            "mask_fill_ms_per_step": 1e3 * (llm.stats.structured_output_bitmask_seconds - fill0) / steps,
            "finish": {r: sum(o.finish_reason == r for o in outs) for r in ("stop", "length", "abort")}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_name, default="smollm2")
    p.add_argument("--num-requests", type=positive, default=32)
    p.add_argument("--max-tokens", type=positive, default=64)
    p.add_argument("--repeats", type=positive, default=2, help="runs of each, alternated; the best is reported")
    p.add_argument("--out", default=results_dir("structured"))
    args = p.parse_args(argv)
    from llm import LLM  # JAX: seconds to import, once the flags are known good

    n = args.num_requests
    llm = LLM(args.model, log=lambda *_: None, max_num_seqs=n, max_model_len=256, max_num_batched_tokens=max(256, n))
    tok, rng = llm.tokenizer, random.Random(0)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON: "
                                                    + text_prompt(rng, 12)}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for _ in range(n)]
    free = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]
    constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i,
                                  structured_outputs=StructuredOutputsParams(json=schema(i))) if i % 2 else free[i]
                   for i in range(n)]
    clock = host_clock(llm)
    run(llm, clock, prompts[:2], free[:2])  # the first steps pay one-off costs (allocations, caches)
    compiles_before = llm.stats.num_compilations
    # Alternated, best of --repeats each: a loaded machine's noise hits both alike.
    runs: dict[str, list[dict[str, Any]]] = {"free": [], "constrained": []}
    for _ in range(args.repeats):
        runs["free"].append(run(llm, clock, prompts, free))
        runs["constrained"].append(run(llm, clock, prompts, constrained))
    best = {k: max(v, key=lambda r: r["tok_s"]) for k, v in runs.items()}
    results = {"machine": machine_info(), "args": vars(args), "runs": runs} | best
    results["compile_s"] = summarize(llm.engine.grammars.compile_seconds)
    results["compilations_during_runs"] = llm.stats.num_compilations - compiles_before
    ratio = results["constrained"]["tok_s"] / results["free"]["tok_s"]
    results["ratios"] = [side_by_side("constrained / free output tok/s", ratio, target=0.9)]
    rows = [["run", "tok/s", "tokens", "steps", "host ms/step", "mask fill ms/step", "stop/length"]] + [
        [name, f"{r['tok_s']:.1f}", str(r["output_tokens"]), str(r["steps"]), f"{r['host_ms_per_step']:.2f}",
         f"{r['mask_fill_ms_per_step']:.2f}", f"{r['finish']['stop']}/{r['finish']['length']}"]
        for name, r in best.items()]
    c = results["compile_s"]
    print(f"{n} requests, max_tokens {args.max_tokens}, {args.model}; half constrained by a JSON schema each; "
          f"best of {args.repeats}")
    print(text_table(rows))
    print(f"grammar compile: p50 {1e3 * c['p50']:.1f} ms, p99 {1e3 * c['p99']:.1f} ms over "
          f"{len(llm.engine.grammars.compile_seconds)} schemas; step programs compiled during the runs: "
          f"{results['compilations_during_runs']}")
    print(text_table([["", "ratio", "measured", "ideal", "target", ""]] + ratio_rows(results["ratios"])))
    print("wrote", write_json(os.path.join(args.out, "structured.json"), results))
    return results


if __name__ == "__main__":
    main()
