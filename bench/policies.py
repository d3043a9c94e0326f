"""Every scheduling policy on the same three workloads, side by side, on the real engine
(in-process, the synchronous loop: one engine, compiled once, a fresh scheduler per run).

    python bench/policies.py                  # the tiny model (CPU: minutes)
    python bench/policies.py --model bench --scale 2

1. fairness: a heavy client floods `long`-token requests at t=0, a light client sends short
   ones at a steady rate. The light client's p99 TTFT alone, then beside the flood per policy.
2. overload: 1.5x the capacity FCFS measured (a burst's completions/s), Poisson arrivals,
   each request a tight interactive or a loose batch SLO: goodput (requests meeting both).
3. a KV budget that forces preemption: recompute vs swap (recomputed tokens, tok/s).

Every run must finish every request (run_engine checks each one's token count) and leave
no slot, device block or host block held. Writes results.json, policies.md, policies.png.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root first

from report import machine_info, md_table, pyplot, results_dir, save_figure, summarize, write_json  # noqa: E402
from simulate import SimRequest, build_engine, fresh_scheduler, run_engine  # noqa: E402
from workload import arrival_times, seed_mix, token_ids, vocab_size_of  # noqa: E402

POLICIES = ("fcfs", "priority", "fair", "slo")


def run(engine, work: list[SimRequest], tag: str, num_kv_blocks: int, **config: Any) -> dict[str, Any]:
    """One run on a fresh scheduler; the SLO and client fields go only to a policy that reads them."""
    engine.scheduler = fresh_scheduler(engine, num_kv_blocks, **config)
    policy = engine.scheduler.policy
    sent = [SimRequest(r.arrival_s, r.prompt_token_ids, r.max_tokens, cls=r.cls,
                       user=r.user if policy.name == "fair" else None,
                       slo_ttft_s=r.slo_ttft_s if policy.uses_slo else None,
                       slo_tpot_s=r.slo_tpot_s if policy.uses_slo else None) for r in work]
    stats = engine.stats
    before = (stats.recomputed_tokens, stats.swapped_out_blocks, stats.swapped_in_blocks, stats.swap_fallbacks)
    res = run_engine(engine, sent, tag)["wall"]
    s = engine.scheduler
    s.check_invariants()
    assert s.allocator.num_used == 0 and len(s._host_free) == s.num_swap_blocks, f"{tag}: blocks leaked"
    after = (stats.recomputed_tokens, stats.swapped_out_blocks, stats.swapped_in_blocks, stats.swap_fallbacks)
    moved = dict(zip(("recomputed_tokens", "swapped_out_blocks", "swapped_in_blocks", "swap_fallbacks"),
                     (a - b for a, b in zip(after, before))))
    out = {"tok_s": res.tok_s, "makespan_s": res.makespan_s, "steps": res.steps, "preemptions": res.preemptions,
           "finished": len(res.per_request), "requests": len(work), **moved,
           "ttft_s": {c: summarize([r["ttft_s"] for r in res.per_request if r["class"] == c])
                      for c in sorted({r.cls for r in work})}}
    out["per_request"] = res.per_request
    print(f"[{tag}] {res.tok_s:.1f} tok/s, {res.preemptions} preemptions, {moved}, p99 TTFT "
          + ", ".join(f"{c} {v['p99']:.3f}s" for c, v in out["ttft_s"].items()), flush=True)
    return out


def met_slo(r: dict[str, Any], ttft: float, tpot: float) -> bool:
    n = r["tokens"]
    return r["ttft_s"] <= ttft and (n < 2 or (r["e2e_s"] - r["ttft_s"]) / (n - 1) <= tpot)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every workload's request count")
    p.add_argument("--long", type=int, default=512, help="the heavy client's max_tokens (the seed's long class)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    out_dir = a.out or results_dir(time.strftime("policies-%Y%m%d-%H%M%S"))
    vocab, rng, n = vocab_size_of(a.model), random.Random(0), lambda k: max(2, round(k * a.scale))
    mml = 256 + max(a.long, 128)
    blocks = a.max_num_seqs * (mml // 16) + 1
    engine = build_engine(a.model, dict(max_num_seqs=a.max_num_seqs, max_model_len=mml, num_kv_blocks=blocks,
                                        dtype="float32", preemption_mode="swap", swap_space=0.25), print)
    load = [os.getloadavg()]
    results: dict[str, Any] = {"machine": machine_info(), "args": vars(a)}

    # 1. fairness: the light client alone, then beside the heavy flood.
    heavy = [SimRequest(0.0, token_ids(rng, vocab, rng.randint(32, 256)), a.long, cls="heavy", user="heavy")
             for _ in range(n(2 * a.max_num_seqs))]
    light = [SimRequest(0.5 + 0.25 * i, token_ids(rng, vocab, rng.randint(16, 32)), 16, cls="light", user="light")
             for i in range(n(24))]
    w1 = {"alone": run(engine, light, "w1-alone", blocks)}
    for pol in POLICIES:
        w1[pol] = run(engine, heavy + light, f"w1-{pol}", blocks, scheduling_policy=pol)
    results["fairness"] = w1

    # 2. overload at 1.5x FCFS's measured capacity, SLOs from the measured step time.
    mix = seed_mix(n(48), vocab, short=16, long=128, prompt_len=(32, 256), seed=3)
    burst = [SimRequest(0.0, r.prompt_token_ids, r.max_tokens) for r in mix]
    cap = run(engine, burst, "w2-capacity", blocks)
    capacity, step_s = len(burst) / cap["makespan_s"], cap["makespan_s"] / cap["steps"]
    targets = {"interactive": (20 * step_s, 2 * step_s), "batch": (400 * step_s, 8 * step_s)}
    times = arrival_times(len(mix), 1.5 * capacity, seed=4)
    w2work = []
    for r, t in zip(mix, times):
        cls = "interactive" if r.max_tokens == 16 else "batch"
        w2work.append(SimRequest(t, r.prompt_token_ids, r.max_tokens, cls=cls, slo_ttft_s=targets[cls][0],
                                 slo_tpot_s=targets[cls][1]))
    w2 = {"capacity_req_s": capacity, "rate_req_s": 1.5 * capacity, "step_s": step_s, "targets_s": targets}
    for pol in POLICIES:
        r = run(engine, w2work, f"w2-{pol}", blocks, scheduling_policy=pol)
        r["goodput"] = sum(met_slo(x, *targets[x["class"]]) for x in r["per_request"])
        r["goodput_by_class"] = {c: sum(met_slo(x, *targets[c]) for x in r["per_request"] if x["class"] == c)
                                 for c in targets}
        w2[pol] = r
    results["overload"] = w2

    # 3. a tight KV budget: blocks for a third of the seats' worst case.
    tight = a.max_num_seqs * (mml // 16) // 3 + 1
    w3work = [SimRequest(0.0, r.prompt_token_ids, r.max_tokens)
              for r in seed_mix(n(2 * a.max_num_seqs), vocab, short=16, long=a.long // 2, seed=5)]
    run(engine, w3work[:a.max_num_seqs], "w3-warmup", tight, preemption_mode="swap")  # compiles the copy programs
    w3: dict[str, Any] = {"num_kv_blocks": tight}
    for mode in ("recompute", "swap"):
        w3[mode] = run(engine, w3work, f"w3-{mode}", tight, scheduling_policy="fcfs", preemption_mode=mode)
    results["preemption"] = w3
    load.append(os.getloadavg())
    results["loadavg"] = load
    for w in (w1, w2, w3):
        for v in w.values():
            if isinstance(v, dict):
                v.pop("per_request", None)
    write_json(os.path.join(out_dir, "results.json"), results)
    report(results, out_dir)
    return 0


def report(res: dict[str, Any], out_dir: str) -> None:
    """The table (policies.md, printed) and the plot (policies.png)."""
    w1, w2, w3 = res["fairness"], res["overload"], res["preemption"]
    alone = w1["alone"]["ttft_s"]["light"]["p99"]
    rows = [["workload", "run", "output tok/s", "preemptions", "figure", "target", "verdict"]]
    for pol in POLICIES:
        x = w1[pol]["ttft_s"]["light"]["p99"]
        target = "<= 2x alone" if pol == "fair" else ""
        rows.append(["1 fairness", pol, f"{w1[pol]['tok_s']:.1f}", str(w1[pol]["preemptions"]),
                     f"light p99 TTFT {x:.3f}s = {x / alone:.1f}x alone ({alone:.3f}s)", target,
                     ("PASS" if x <= 2 * alone else "MISS") if target else ""])
    base = w2["fcfs"]["goodput"]
    for pol in POLICIES:
        g = w2[pol]["goodput"]
        target = ">= 1.3x fcfs" if pol == "slo" else ""
        rows.append(["2 overload", pol, f"{w2[pol]['tok_s']:.1f}", str(w2[pol]["preemptions"]),
                     f"goodput {g}/{w2[pol]['requests']} ({g / max(base, 1):.2f}x fcfs; "
                     + ", ".join(f"{c} {k}" for c, k in w2[pol]["goodput_by_class"].items()) + ")", target,
                     ("PASS" if g >= 1.3 * base else "MISS") if target else ""])
    for mode in ("recompute", "swap"):
        m = w3[mode]
        ok = m["recomputed_tokens"] == 0 and m["tok_s"] >= w3["recompute"]["tok_s"]
        rows.append(["3 tight KV", mode, f"{m['tok_s']:.1f}", str(m["preemptions"]),
                     f"recomputed {m['recomputed_tokens']} tokens, swapped out/in {m['swapped_out_blocks']}/"
                     f"{m['swapped_in_blocks']} blocks, fallbacks {m['swap_fallbacks']}",
                     "0 recomputed, tok/s >= recompute" if mode == "swap" else "",
                     ("PASS" if ok else "MISS") if mode == "swap" else ""])
    table = md_table(rows)
    head = (f"{res['args']['model']} model; workload 2 at {w2['rate_req_s']:.2f} req/s (capacity "
            f"{w2['capacity_req_s']:.2f}); load average {res['loadavg'][0][0]:.1f} -> {res['loadavg'][-1][0]:.1f}")
    with open(os.path.join(out_dir, "policies.md"), "w") as f:
        f.write(head + "\n\n" + table + "\n")
    print(head + "\n" + table)
    plt = pyplot()
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].bar(["alone", *POLICIES], [w1[k]["ttft_s"]["light"]["p99"] for k in ("alone", *POLICIES)])
    ax[0].set_title("1: light client's p99 TTFT (s) under the flood")
    ax[1].bar(POLICIES, [w2[k]["goodput"] for k in POLICIES])
    ax[1].set_title(f"2: goodput at 1.5x capacity (of {w2['fcfs']['requests']})")
    ax[2].bar(["recompute", "swap"], [w3[k]["tok_s"] for k in ("recompute", "swap")])
    ax[2].set_title("3: output tok/s under a tight KV budget")
    for i, k in enumerate(("recompute", "swap")):
        ax[2].annotate(f"{w3[k]['recomputed_tokens']} recomputed", (i, w3[k]["tok_s"]), ha="center", va="bottom")
    save_figure(fig, os.path.join(out_dir, "policies.png"), dpi=90)


if __name__ == "__main__":
    sys.exit(main())
