"""Stutter bench: does a long prompt joining stall the streaming users, and does chunked
prefill stop it?

    python bench/stutter.py [--tiny] [--prompt-len 8192] [--users 16] [--budget 512]

How it is driven and what is measured: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import (log, machine_info, model_name, natural, positive, pyplot, redraw,  # noqa: E402
                    results_dir, save_figure, sections, size_defaults, summarize, text_table, write_json)
from workload import token_ids  # noqa: E402

TARGET_RATIO = 4.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=model_name, default=None, help="default: bench (tiny with --tiny)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    p.add_argument("--prompt-len", type=positive, help="the joiner's prompt (default 8192; 384 with --tiny)")
    p.add_argument("--users", type=positive, default=None, help="streaming users (default 16; 4 with --tiny)")
    p.add_argument("--budget", type=positive, default=None,
                   help="max_num_batched_tokens with chunked prefill (default 512; 64 with --tiny)")
    p.add_argument("--user-prompt-len", type=positive, default=32)
    p.add_argument("--steady-steps", type=positive, default=8, help="decode steps before the long prompt joins")
    p.add_argument("--after-tokens", type=natural, default=None,
                   help="run until the joiner has this many tokens after its first (default: --window)")
    p.add_argument("--window", type=positive, default=5, help="steps either side of the join measured (see above)")
    p.add_argument("--block-size", type=positive, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="off,on", help="comma separated: off (unchunked), on (chunked)")
    p.add_argument("--tiny", action="store_true", help="the tiny model and small sizes: a fast smoke run")
    p.add_argument("--out", default=None, help="output folder (default bench/results/stutter[-tiny])")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--plot-only", metavar="JSON", help="redraw the PNG from an earlier run's stutter.json; no run")
    a = size_defaults(p.parse_args(argv), {"model": ("bench", "tiny"), "prompt_len": (8192, 384), "users": (16, 4),
                                           "budget": (512, 64),
                                           "out": (results_dir("stutter"), results_dir("stutter-tiny"))})
    a.after_tokens = a.window if a.after_tokens is None else a.after_tokens
    if a.plot_only and not os.path.isfile(a.plot_only):
        p.error(f"--plot-only: no {a.plot_only}")
    a.modes = sections(p, a.modes, ("off", "on"), "--modes")
    if a.budget <= a.users:
        p.error(f"--budget ({a.budget}) must exceed --users ({a.users}): the decodes take one token each")
    return a


def sizes(a: argparse.Namespace) -> dict[str, int]:
    """Lengths shared by both runs, so both see the very same requests and cache."""
    steps_to_first = math.ceil(a.prompt_len / (a.budget - a.users))  # chunks once every user decodes
    # The users must outlive the run: their prefill, the steady steps, the joiner's chunks (at
    # worst), its remaining tokens, with a margin.
    user_max_tokens = (math.ceil(a.users * a.user_prompt_len / a.budget) + a.steady_steps + steps_to_first
                       + a.after_tokens + a.window + 16)
    long_max_tokens = a.after_tokens + 1
    blocks = (math.ceil((a.prompt_len + long_max_tokens) / a.block_size)
              + a.users * math.ceil((a.user_prompt_len + user_max_tokens) / a.block_size))
    return dict(user_max_tokens=user_max_tokens, long_max_tokens=long_max_tokens, num_kv_blocks=blocks + 1,
                max_model_len=max(a.prompt_len + long_max_tokens, a.user_prompt_len + user_max_tokens),
                expected_chunk_steps=steps_to_first)


def run_mode(a: argparse.Namespace, mode: str, sz: dict[str, int]) -> dict[str, Any]:
    """The users decode steadily, the long prompt joins, and every token is stamped when the step
    that made it returns (the synchronous loop: each step's tokens read as it returns)."""
    from compilation import clear_program_caches
    from engine import EngineConfig, LLMEngine, SamplingParams

    chunked = mode == "on"
    budget = a.budget if chunked else sz["max_model_len"]
    cfg = EngineConfig(model=a.model, dtype=a.dtype, seed=a.seed, max_num_seqs=a.users + 1,
                       max_model_len=sz["max_model_len"], block_size=a.block_size, num_kv_blocks=sz["num_kv_blocks"],
                       max_num_batched_tokens=budget, enable_chunked_prefill=chunked, warmup=True,
                       async_scheduling=False)
    clear_program_caches()  # the mode's start-up whole, as in a new process: not the other mode's programs
    t0 = time.perf_counter()
    eng = LLMEngine(cfg, log=lambda m: log(f"  [{mode}] {m}"), record_trace=True)
    startup_s = time.perf_counter() - t0
    rng = random.Random(a.seed)  # the same prompts in both runs
    users = [f"user-{i:02d}" for i in range(a.users)]
    prompts = [token_ids(rng, eng.model_config.vocab_size, n) for n in [a.user_prompt_len] * a.users + [a.prompt_len]]
    arrivals: dict[str, list[tuple[int, float]]] = {}  # request -> [(step, perf_counter at step return)]
    traces: list[Any] = []

    def step() -> None:
        deltas = eng.step()
        now, tr = time.perf_counter(), eng.trace[-1]
        traces.append(tr)
        for d in deltas:
            arrivals.setdefault(d.request_id, []).extend((tr.step, now) for _ in d.new_token_ids)

    def add(rid: str, prompt: list[int], max_tokens: int) -> None:
        eng.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    t_origin = time.perf_counter()
    for rid, prompt in zip(users, prompts):
        add(rid, prompt, sz["user_max_tokens"])
    compilations_before = eng.stats.num_compilations
    while not all(u in arrivals for u in users):  # the users' prefill (a few steps when chunked)
        step()
    for _ in range(a.steady_steps):
        step()
    assert all(set(users) <= set(t.sampled) for t in traces[-a.steady_steps:]), "steady: everyone decodes"
    join_step, t_join = eng.stats.num_steps + 1, time.perf_counter()
    add("long", prompts[-1], sz["long_max_tokens"])
    while len(arrivals.get("long", ())) < 1 + a.after_tokens:
        step()
    first_step, t_first = arrivals["long"][0]
    compilations = eng.stats.num_compilations - compilations_before
    for rid in users + ["long"]:
        eng.abort(rid)
    assert eng.stats.num_preemptions == 0, "the cache is sized for everyone: nothing should be preempted"
    lo, hi = join_step - a.window, first_step + a.window
    gaps = [(s, t - prev) for u in users for (_, prev), (s, t) in zip(arrivals[u], arrivals[u][1:])]
    window = [g for s, g in gaps if lo <= s <= hi]
    res = dict(mode=mode, chunked_prefill=chunked, max_num_batched_tokens=budget, startup_s=startup_s,
               num_compilations_warmup=compilations_before, compilations_during_run=compilations,
               join_step=join_step, first_token_step=first_step, window_steps=[lo, hi],
               prefill_step_tokens=[t.num_prefill_tokens for t in traces if join_step <= t.step <= first_step],
               stall_steps=[t.step for t in traces if t.step > 1 and t.num_decode_tokens == 0],
               ttft_s=t_first - t_join, itl_window=summarize(window), itl_window_count=len(window),
               itl_steady_before=summarize([g for s, g in gaps if s < lo]), max_gap_s=max(window),
               arrivals={rid: [(s, t - t_join) for s, t in toks] for rid, toks in arrivals.items()},
               run_s=time.perf_counter() - t_origin)
    del eng
    gc.collect()
    return res | {"prefill_steps": len(res["prefill_step_tokens"])}


def plot(results: dict[str, dict[str, Any]], a: argparse.Namespace, path: str) -> str:
    """Per mode, each user's tokens and the joiner's over time; below, every user's gap before
    each token in both runs."""
    plt = pyplot()
    modes = [m for m in ("off", "on") if m in results]
    fig, axes = plt.subplots(len(modes) + 1, 1, figsize=(12, 3.2 * len(modes) + 3.2), sharex=True, squeeze=False,
                             gridspec_kw=dict(height_ratios=[3] * len(modes) + [2.2]))
    users = sorted(r for r in results[modes[0]]["arrivals"] if r != "long")
    for ax, m in zip(axes[:-1, 0], modes):
        r = results[m]
        for i, u in enumerate(users + ["long"]):
            ts = [t for _, t in r["arrivals"][u]]
            ax.plot(ts, [i] * len(ts), "|", ms=9, mew=2 if u == "long" else 1.4,
                    color="tab:red" if u == "long" else "tab:blue")
        ax.axvline(r["ttft_s"], color="tab:red", ls=":", lw=1)
        ax.set_yticks(range(len(users) + 1), [u.replace("user-", "u") for u in users] + ["joiner"], fontsize=7)
        how = (f"budget {r['max_num_batched_tokens']} tokens/step" if r["chunked_prefill"]
               else "whole prompt in one step")
        ax.set_title(f"chunked prefill {m} ({how}): users' ITL around the join p50 {r['itl_window']['p50'] * 1e3:.0f} "
                     f"ms, max {r['max_gap_s'] * 1e3:.0f} ms; joiner TTFT {r['ttft_s']:.2f} s", fontsize=9)
    ax = axes[-1, 0]
    for m, color in (("off", "tab:orange"), ("on", "tab:green")):
        if m in results:
            pts = sorted((t, t - prev) for rid, toks in results[m]["arrivals"].items() if rid != "long"
                         for (_, prev), (_, t) in zip(toks, toks[1:]))
            ax.step([t for t, _ in pts], [g * 1e3 for _, g in pts], where="pre", color=color,
                    label=f"chunked prefill {m}: max {results[m]['max_gap_s'] * 1e3:.0f} ms")
            ax.axvline(results[m]["ttft_s"], color=color, ls=":", lw=1)
    ax.set(yscale="log", ylabel="users' inter-token gap (ms)")
    ax.legend(fontsize=8, loc="upper left")
    # from a few steady steps before the join to the later end
    t_lo = min(min(t for s, t in results[m]["arrivals"]["user-00"] if s >= results[m]["window_steps"][0])
               for m in modes)
    t_hi = max(t for m in modes for toks in results[m]["arrivals"].values() for _, t in toks)
    ax.set_xlim(t_lo - 0.03 * (t_hi - t_lo), t_hi + 0.03 * (t_hi - t_lo))
    ax.set_xlabel(f"time since the {a.prompt_len}-token prompt arrived (s); dashed: it arrives, "
                  "dotted: its first token")
    for ax in axes[:, 0]:
        ax.axvline(0.0, color="k", ls="--", lw=1)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Per-token arrival times of {len(users)} streaming users ({a.model} model) as a "
                 f"{a.prompt_len}-token prompt joins", fontsize=11)
    save_figure(fig, path, dpi=130)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.plot_only:
        png = os.path.join(os.path.dirname(os.path.abspath(a.plot_only)), "stutter.png")
        return redraw("--plot-only", a.plot_only, lambda out: log("wrote " + plot(
            out["results"], argparse.Namespace(**out["args"]), png)) or out, "an earlier run's stutter.json")
    sz = sizes(a)
    log(f"stutter: model {a.model}, {a.users} users (prompts of {a.user_prompt_len}), a {a.prompt_len}-token prompt "
        f"joins after {a.steady_steps} steady steps; chunked budget {a.budget}; max_model_len {sz['max_model_len']}, "
        f"{sz['num_kv_blocks'] - 1} KV blocks")
    results = {mode: run_mode(a, mode, sz) for mode in a.modes}
    log("\n" + text_table([["users' ITL in the window", "p50", "p99", "max", "joiner TTFT", "its steps"]] + [
        [f"chunked prefill {m}", *(f"{r['itl_window'][q] * 1e3:.0f}ms" for q in ("p50", "p99", "max")),
         f"{r['ttft_s']:.2f}s", str(r["prefill_steps"])] for m, r in results.items()]))
    summary: dict[str, Any] = {}
    if {"off", "on"} <= set(results):
        off, on = results["off"], results["on"]
        ratio = off["max_gap_s"] / on["max_gap_s"]
        summary = dict(max_gap_ratio=ratio, target_ratio=TARGET_RATIO, meets_target=ratio >= TARGET_RATIO,
                       p99_ratio=off["itl_window"]["p99"] / on["itl_window"]["p99"],
                       ttft_ratio_on_over_off=on["ttft_s"] / off["ttft_s"])
        log(f"max inter-token gap cut {ratio:.1f}x by chunked prefill (target >= {TARGET_RATIO:.0f}x: "
            f"{'met' if ratio >= TARGET_RATIO else 'NOT met'}); the joiner's TTFT is "
            f"{summary['ttft_ratio_on_over_off']:.2f}x the unchunked one")
    moved = {m: r["compilations_during_run"] for m, r in results.items() if r["compilations_during_run"]}
    if moved:
        log(f"WARNING: programs compiled during the measured run ({moved}): a compile is a false stutter")
    out = dict(bench="stutter", args=vars(a), sizes=sz, machine=machine_info(), summary=summary, results=results)
    log(f"wrote {write_json(os.path.join(a.out, 'stutter.json'), out)}")
    if not a.no_plot:
        log(f"wrote {plot(results, a, os.path.join(a.out, 'stutter.png'))}")
    return out


if __name__ == "__main__":
    main()
