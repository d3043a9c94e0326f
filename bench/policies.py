"""Every scheduling policy on the same three workloads, side by side: on the real engine
(in-process, synchronous loop: one engine compiled once, a fresh scheduler per run), or with
--simulate gpu-like (or a cost-model JSON) in the simulator (bench/simulate.py):
    python bench/policies.py [--model bench] [--scale 2] [--simulate gpu-like] [--repeats 3]

1. fairness: a heavy client floods `long`-token requests at t=0, a light client sends short
   ones at a steady rate: the light client's p99 TTFT alone, then beside the flood.
2. overload: 1.5x the capacity FCFS measured (a burst's completions/s) just before, Poisson
   arrivals, the short/long mix as a tight interactive and a loose batch SLO class: goodput (both
   targets met); --repeats of (capacity, every policy), interleaved: the median and the spread.
3. a KV budget that forces preemption: recompute vs swap (recomputed tokens, tok/s); this
   machine's measured copy rate, and the simulator's GPU-like recompute/swap crossover.
Every run must finish every request (each one's token count is checked) and leave no slot,
device block or host block held. Writes results.json and policies.md (the table, also printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root first

from report import (machine_info, md_table, model_name, positive, positive_float, results_dir,  # noqa: E402
                    write_json, write_text)
from simulate import (GPU_KV_TOKEN_BYTES, GPU_LIKE, GPU_LINK_BYTES_S, SimRequest, load_cost_model,  # noqa: E402
                      build_engine, fresh_scheduler, measure_swap, run_engine, simulate, synthetic)
from workload import token_ids, vocab_size_of  # noqa: E402

from config import EngineConfig  # noqa: E402

POLICIES = ("fcfs", "priority", "fair", "slo")


def figures(res: Any, tag: str) -> dict[str, Any]:
    classes = sorted({r["class"] for r in res.per_request})
    out = {k: getattr(res, k) for k in ("tok_s", "makespan_s", "steps", "preemptions", "recomputed_tokens",
                                        "swapped_blocks", "goodput")} | {
        "requests": len(res.per_request), "ttft_s": {c: res.latency(c, "ttft_s") for c in classes},
        "goodput_by_class": {c: sum(bool(r["slo_met"]) for r in res.per_request if r["class"] == c) for c in classes}}
    print(f"[{tag}] {res.tok_s:.1f} tok/s, {res.preemptions} preemptions, {res.recomputed_tokens} recomputed, "
          f"{res.swapped_blocks} blocks swapped, goodput {res.goodput}, p99 TTFT "
          + ", ".join(f"{c} {v['p99']:.4f}s" for c, v in out["ttft_s"].items()), flush=True)
    return out


def gpu_crossover(config: EngineConfig, num_kv_blocks: int, work: list[SimRequest]) -> dict[str, Any]:
    """The simulator's GPU-like prediction for workload 3: tok/s by recompute and by swap at
    the stated PCIe figure, and the host link bandwidth below which recomputing wins."""
    def tok_s(mode: str, bandwidth: float = GPU_LINK_BYTES_S) -> float:
        cm = dataclasses.replace(GPU_LIKE, swap=(GPU_LIKE.swap[0], GPU_KV_TOKEN_BYTES / bandwidth))
        return simulate(dataclasses.replace(config, preemption_mode=mode), num_kv_blocks, work, cm,
                        num_swap_blocks=1 << 20).tok_s

    recompute, lo, hi = tok_s("recompute"), 1e8, 1e12
    for _ in range(20):  # bisect on a log scale: swap's tok/s grows with the bandwidth
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if tok_s("swap", mid) >= recompute else (mid, hi)
    return {"recompute_tok_s": recompute, "swap_tok_s": tok_s("swap"), "link_bytes_s": GPU_LINK_BYTES_S,
            "crossover_bytes_s": hi}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, kind, default, what in (("model", model_name, "tiny", None),
                                      ("scale", positive_float, 1.0, "multiplies request counts"),
                                      ("long", positive, 512, "the heavy client's max_tokens"),
                                      ("out", str, None, None),
                                      ("max-num-seqs", positive, 8, None),
                                      ("repeats", positive, None,
                                       "workload 2's runs of every policy (engine only; default 3)"),
                                      ("simulate", str, None, "gpu-like or a cost-model JSON: no engine")):
        p.add_argument(f"--{flag}", type=kind, default=default, help=what)
    a = p.parse_args(argv)
    if a.simulate and a.repeats:
        p.error("--repeats repeats the engine's runs; the simulator's (--simulate) are deterministic")
    out_dir = a.out or results_dir(time.strftime("policies-%Y%m%d-%H%M%S"))
    vocab, rng, n = vocab_size_of(a.model), random.Random(0), lambda k: max(2, round(k * a.scale))
    mml = 256 + max(a.long, 128)
    blocks = a.max_num_seqs * (mml // 16) + 1
    kw = dict(max_num_seqs=a.max_num_seqs, max_model_len=mml, num_kv_blocks=blocks, dtype="float32")
    try:
        cm = load_cost_model(a.simulate) if a.simulate else None
    except ValueError as e:
        p.error(f"--simulate {e}")
    engine = None if cm else build_engine(a.model, kw | dict(preemption_mode="swap", swap_space=0.25), print)
    base = EngineConfig(**kw).resolved(mml) if cm else engine.config

    def run(work: list[SimRequest], tag: str, num_kv_blocks: int, **config: Any) -> dict[str, Any]:
        config = {"scheduling_policy": "fcfs", "preemption_mode": "recompute"} | config
        if cm:
            return figures(simulate(dataclasses.replace(base, **config), num_kv_blocks, work, cm,
                                    num_swap_blocks=1 << 20), tag)
        engine.scheduler = s = fresh_scheduler(engine, num_kv_blocks, **config)
        res = run_engine(engine, work, tag)["wall"]  # asserts every request made all its tokens
        s.check_invariants()  # with nobody left: every slot, device block and host block free
        assert not s.has_unfinished() and s.allocator.num_used == 0, f"{tag}: blocks leaked"
        return figures(res, tag)

    results: dict[str, Any] = {"machine": machine_info(), "args": vars(a), "loadavg": [os.getloadavg()],
                               "engine": cm.source if cm else "measured, wall clock"}
    heavy = [SimRequest(0.0, token_ids(rng, vocab, rng.randint(32, 256)), a.long, cls="heavy", user="heavy")
             for _ in range(n(2 * a.max_num_seqs))]
    gap = 0.25 if engine else 0.1  # the light client's period: about one request of its in flight at a time
    light = [SimRequest(0.5 * gap + gap * i, token_ids(rng, vocab, rng.randint(16, 32)), 16, cls="light",
                        user="light") for i in range(n(40))]
    results["fairness"] = {"alone": run(light, "w1-alone", blocks)} | {  # 1. alone, then beside the flood
        pol: run(heavy + light, f"w1-{pol}", blocks, scheduling_policy=pol) for pol in POLICIES}

    def overload(i: int) -> dict[str, Any]:  # one repeat: the capacity now, then every policy at 1.5x it
        cap = run(synthetic("short-long", n(144), vocab, long=128, seed=3), f"w2-capacity-{i}", blocks)
        capacity, step_s = cap["requests"] / cap["makespan_s"], cap["makespan_s"] / cap["steps"]
        targets = {"interactive": (20 * step_s, 3 * step_s), "batch": (200 * step_s, 8 * step_s)}
        work = synthetic("slo-mix", n(144), vocab, long=128, rate=1.5 * capacity, seed=3, slo=targets)
        return {"capacity_req_s": capacity, "rate_req_s": 1.5 * capacity, "targets_s": targets} | {
            pol: run(work, f"w2-{pol}-{i}", blocks, scheduling_policy=pol) for pol in POLICIES}
    runs = [overload(i) for i in range(1 if cm else a.repeats or 3)]  # 2. interleaved repeats: a rate follows the speed
    keys = ("capacity_req_s", "rate_req_s")
    w2 = results["overload"] = {"repeats": [{k: r[k] for k in keys} for r in runs]} | {
        k: sorted(r[k] for r in runs)[len(runs) // 2] for k in keys}
    for pol in POLICIES:  # the median run by goodput; the spread of the goodput ratio over the repeats
        w2[pol] = sorted((r[pol] for r in runs), key=lambda m: m["goodput"])[len(runs) // 2]
        w2[pol]["vs_fcfs"] = sorted(r[pol]["goodput"] / max(r["fcfs"]["goodput"], 1) for r in runs)
    # 3. a tight KV budget: blocks for a third of the seats' worst case.
    tight = a.max_num_seqs * (mml // 16) // 3 + 1
    w3work = synthetic("short-long", n(2 * a.max_num_seqs), vocab, long=a.long // 2, seed=5)
    w3 = results["preemption"] = {"num_kv_blocks": tight, "gpu": gpu_crossover(base, tight, w3work)} | {
        mode: run(w3work, f"w3-{mode}", tight, preemption_mode=mode) for mode in ("recompute", "swap")}
    w3 |= {"copy": measure_swap(engine)} if engine else {}  # this machine's host<->device copy rate
    results["loadavg"].append(os.getloadavg())
    write_json(os.path.join(out_dir, "results.json"), results)
    report(results, out_dir)
    return 0


def report(res: dict[str, Any], out_dir: str) -> None:
    """The table, printed and written to policies.md."""
    w1, w2, w3 = res["fairness"], res["overload"], res["preemption"]
    alone = w1["alone"]["ttft_s"]["light"]["p99"]

    def row(name: str, k: str, m: dict[str, Any], figure: str, target: str, ok: bool | None) -> list[str]:
        verdict = ("n/a" if ok is None else "PASS" if ok else "MISS") if target else ""
        return [name, k, f"{m['tok_s']:.1f}", str(m["preemptions"]), figure, target, verdict]

    rows = []
    for k in POLICIES:
        x = w1[k]["ttft_s"]["light"]["p99"]
        rows.append(row("1 fairness", k, w1[k], f"light p99 TTFT {x:.4f}s = {x / alone:.2f}x alone",
                        "<= 2x alone" * (k == "fair"), x <= 2 * alone))
    for k in POLICIES:
        m, v = w2[k], w2[k]["vs_fcfs"]
        rows.append(row("2 overload", k, m, f"goodput {m['goodput']}/{m['requests']}, {v[len(v) // 2]:.2f}x fcfs "
                        f"(median of {len(v)}: {v[0]:.2f}-{v[-1]:.2f}); {str(m['goodput_by_class'])[1:-1]}",
                        ">= 1.3x fcfs" * (k == "slo"), v[len(v) // 2] >= 1.3))
    for k in ("recompute", "swap"):
        m = w3[k]
        rows.append(row("3 tight KV", k, m, f"recomputed {m['recomputed_tokens']} tokens, {m['swapped_blocks']} "
                        "blocks swapped out and in", "0 recomputed, tok/s >= recompute" * (k == "swap"),
                        # at sizes where recompute never preempts, swap has nothing to save
                        None if not w3["recompute"]["preemptions"] else
                        m["recomputed_tokens"] == 0 and m["tok_s"] >= w3["recompute"]["tok_s"]))
    g, c = w3["gpu"], w3.get("copy")
    copy = f"KV copy here {c['bandwidth_bytes_s'] / 1e9:.2f} GB/s + {1e3 * c['coef'][0]:.2f} ms a step; " if c else ""
    head = (f"{res['args']['model']} model, {res['engine']}; light client alone: p99 TTFT {alone:.4f}s; workload 2 "
            f"at {w2['rate_req_s']:.2f} req/s (capacity {w2['capacity_req_s']:.2f}); {copy}GPU-like prediction for "
            f"workload 3: recompute {g['recompute_tok_s']:.0f} tok/s, swap {g['swap_tok_s']:.0f} at "
            f"{g['link_bytes_s'] / 1e9:.0f} GB/s, recompute wins below {g['crossover_bytes_s'] / 1e9:.2f} GB/s; "
            f"load average {res['loadavg'][0][0]:.1f} -> {res['loadavg'][-1][0]:.1f}")
    table = md_table([["workload", "run", "output tok/s", "preemptions", "figure", "target", "verdict"], *rows])
    write_text(os.path.join(out_dir, "policies.md"), head + "\n\n" + table + "\n")
    print(head + "\n" + table)


if __name__ == "__main__":
    sys.exit(main())
