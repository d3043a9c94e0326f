"""Prefix-caching bench: the same workloads with --enable-prefix-caching on and off.

    python bench/prefix.py              # the full run (bench model, fp32, CPU)
    python bench/prefix.py --tiny       # seconds: the tiny model, small sizes
    python bench/prefix.py --sections shared --shared-requests 16

One process, the same `bench` weights for both settings (load_model is deterministic from
the seed); offline API (LLM.generate), greedy, ignore_eos, so output lengths are exactly
max_tokens and only what is computed differs. Each section builds the engine with caching
off, runs, drops it, then the same with caching on: the two runs sit side by side in time.
TTFT is first_token_time - arrival_time of each request (all of a call arrive at once).
The hit rate (prefix_cache_hits / prefix_cache_queries, in prompt tokens) and the prompt
tokens actually computed are printed next to each figure.

Sections (--sections, comma separated; default all):
  shared     --shared-requests (64) requests: one --system-len (1,024)-token system prompt
             followed by a different --question-len (32)-token question each, --shared-output
             (64) tokens out. TTFT p50 / p99 and output tokens/s. Targets: TTFT p50 >= 5x lower,
             tokens/s >= 2x higher with caching.
  multiturn  --conversations (16) conversations of --turns (4) turns: turn 1 is a
             --first-len (512)-token message; each later turn resends the conversation so far
             (every earlier message and answer) plus a new --question-len-token message; answers
             are --turn-output (64) tokens. All conversations' turn k arrive together once turn
             k-1 is done. TTFT p50 of the last turn; target >= 3x lower.
  mix        no sharing: the seed's mix (common.seed_mix, random prompts of 32..256 tokens,
             half --mix-short, half --mix-long output tokens), --mix-requests requests.
             Off and on run alternately --mix-repeats times each (a fresh engine per run,
             so nothing is cached from the last); best output tokens/s of each, and output
             tokens per CPU-second of the process (less sensitive to other work on a shared
             machine). Target: on within 3% of off.

Every engine has one configuration (`shape()`): max_num_seqs, max_model_len and KV blocks
are the largest any section needs, so the step programs compile once (warm-up of the
first engine) and every later engine loads them from the compilation cache. KV holds all
of a section's requests at once *without* sharing: the run with caching off is never
short of KV and the comparison is compute only. Writes <out>/prefix.json and prefix.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_info, seed_mix, summarize  # noqa: E402

SECTIONS = ("shared", "multiturn", "mix")
TARGETS = {"shared_ttft_p50": 5.0, "shared_tok_s": 2.0, "multiturn_ttft_p50": 3.0, "mix_tok_s_loss": 0.03}
BLOCK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny model and small sizes: a fast smoke run")
    p.add_argument("--model", default=None, help="default: bench (tiny with --tiny)")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--chunked-prefill", action="store_true", help="run every engine with chunked prefill")
    p.add_argument("--shared-requests", type=int, default=None)
    p.add_argument("--system-len", type=int, default=None)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--shared-output", type=int, default=None)
    p.add_argument("--conversations", type=int, default=None)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=None)
    p.add_argument("--turn-output", type=int, default=None)
    p.add_argument("--mix-requests", type=int, default=None)
    p.add_argument("--mix-short", type=int, default=16)
    p.add_argument("--mix-long", type=int, default=None)
    p.add_argument("--mix-repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default bench/results/prefix[-tiny])")
    a = p.parse_args(argv)
    tiny = a.tiny
    a.model = a.model or ("tiny" if tiny else "bench")
    for name, full, small in (("shared_requests", 64, 8), ("system_len", 1024, 96), ("shared_output", 64, 8),
                              ("conversations", 16, 4), ("first_len", 512, 48), ("turn_output", 64, 8),
                              ("mix_requests", 32, 8), ("mix_long", 256, 24)):
        if getattr(a, name) is None:
            setattr(a, name, small if tiny else full)
    if tiny:
        a.question_len = min(a.question_len, 8)
        a.mix_short = min(a.mix_short, 4)
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    if not a.sections or not set(a.sections) <= set(SECTIONS):
        p.error(f"--sections takes {', '.join(SECTIONS)}")
    if a.turns < 2:
        p.error("--turns must be >= 2")
    a.out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                  "prefix-tiny" if tiny else "prefix")
    return a


def shape(a: argparse.Namespace) -> dict[str, int]:
    """The one engine shape every section runs on (see the module doc)."""
    mix = seed_mix(a.mix_requests, vocab(a), short=a.mix_short, long=a.mix_long, seed=a.seed)
    need = {  # section -> (sequences at once, longest sequence, all tokens at once)
        "shared": (a.shared_requests, a.system_len + a.question_len + a.shared_output),
        "multiturn": (a.conversations, multiturn_len(a)),
        "mix": (a.mix_requests, max(len(r.prompt_token_ids) + r.max_tokens for r in mix)),
    }
    # Over all sections, even those not run: a rerun of one section finds its programs compiled.
    seqs = max(n for n, _ in need.values())
    max_len = max(length for _, length in need.values())
    blocks = max(n * math.ceil(length / BLOCK) for n, length in need.values())
    return dict(max_num_seqs=seqs, max_model_len=max_len, num_kv_blocks=blocks + 1)


def multiturn_len(a: argparse.Namespace) -> int:
    return a.first_len + (a.turns - 1) * a.question_len + a.turns * a.turn_output


def build(a: argparse.Namespace, caching: bool, log):
    from engine import LLM

    llm = LLM(a.model, log=lambda s: log(f"    [engine] {s}"), dtype="float32", seed=a.seed, block_size=BLOCK,
              enable_chunked_prefill=a.chunked_prefill, enable_prefix_caching=caching, **a.shape)
    llm.generate([[1] * 8, [2] * 8], params([2, 2]), use_tqdm=False)  # first dispatches, untimed
    llm.reset_prefix_cache()
    return llm


def params(max_tokens: list[int]):
    from config import SamplingParams

    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]


def timed(llm, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
    """One llm.generate: every request arrives at once."""
    before = llm.stats.snapshot()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params(max_tokens), use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = llm.stats
    queries = st.prefix_cache_queries - before.prefix_cache_queries
    hits = st.prefix_cache_hits - before.prefix_cache_hits
    out_tokens = sum(len(o.token_ids) for o in outs)
    # CPU seconds of this process (all its threads) beside the wall clock: on a shared
    # machine other work stretches the wall clock far more than the CPU time.
    return dict(wall_s=wall, cpu_s=cpu, output_tokens=out_tokens, tok_s=out_tokens / wall, tok_per_cpu_s=out_tokens / cpu,
                ttft=summarize([o.first_token_time - o.arrival_time for o in outs]),
                hit_rate=hits / queries if queries else 0.0, cached_tokens=hits,
                prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
                prefill_tokens_computed=st.prefill_tokens - before.prefill_tokens,
                steps=st.num_steps - before.num_steps, preemptions=st.num_preemptions - before.num_preemptions,
                token_ids=[o.token_ids for o in outs], loadavg=os.getloadavg()[0])


def vocab(a: argparse.Namespace) -> int:
    from model import BUILTIN_MODELS

    return BUILTIN_MODELS[a.model].vocab_size if a.model in BUILTIN_MODELS else 32000


def section_shared(a: argparse.Namespace, log) -> dict[str, Any]:
    rng = random.Random(a.seed)
    v = vocab(a)
    system = [rng.randrange(3, v) for _ in range(a.system_len)]
    prompts = [system + [rng.randrange(3, v) for _ in range(a.question_len)] for _ in range(a.shared_requests)]
    runs = {}
    for mode in ("off", "on"):
        llm = build(a, mode == "on", log)
        runs[mode] = timed(llm, prompts, [a.shared_output] * len(prompts))
        del llm
        gc.collect()
        log(line(f"shared {mode}", runs[mode]))
    off, on = runs["off"], runs["on"]
    return dict(runs=runs, ratios=dict(
        ttft_p50=off["ttft"]["p50"] / on["ttft"]["p50"], ttft_p99=off["ttft"]["p99"] / on["ttft"]["p99"],
        tok_s=on["tok_s"] / off["tok_s"]), same_tokens=off["token_ids"] == on["token_ids"])


def section_multiturn(a: argparse.Namespace, log) -> dict[str, Any]:
    rng = random.Random(a.seed + 1)
    v = vocab(a)
    firsts = [[rng.randrange(3, v) for _ in range(a.first_len)] for _ in range(a.conversations)]
    news = [[[rng.randrange(3, v) for _ in range(a.question_len)] for _ in range(a.conversations)]
            for _ in range(a.turns - 1)]
    runs = {}
    for mode in ("off", "on"):
        llm = build(a, mode == "on", log)
        convs = [list(f) for f in firsts]
        turns = []
        for k in range(a.turns):
            r = timed(llm, convs, [a.turn_output] * len(convs))
            turns.append(r)
            if k + 1 < a.turns:  # the answer, then the next message, are resent with the history
                convs = [c + out + new for c, out, new in zip(convs, r["token_ids"], news[k])]
        runs[mode] = dict(turns=turns, last=turns[-1])
        del llm
        gc.collect()
        log(line(f"multiturn {mode}, turn {a.turns}", turns[-1]))
    off, on = runs["off"]["last"], runs["on"]["last"]
    same = [t["token_ids"] for t in runs["off"]["turns"]] == [t["token_ids"] for t in runs["on"]["turns"]]
    return dict(runs=runs, ratios=dict(last_turn_ttft_p50=off["ttft"]["p50"] / on["ttft"]["p50"]), same_tokens=same)


def section_mix(a: argparse.Namespace, log) -> dict[str, Any]:
    reqs = seed_mix(a.mix_requests, vocab(a), short=a.mix_short, long=a.mix_long, seed=a.seed)
    prompts, max_tokens = [r.prompt_token_ids for r in reqs], [r.max_tokens for r in reqs]
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for i in range(a.mix_repeats):
        for mode in ("off", "on"):  # one engine alive at a time: the KV cache is the largest section's
            llm = build(a, mode == "on", log)
            runs[mode].append(timed(llm, prompts, max_tokens))
            del llm
            gc.collect()
            log(line(f"mix {mode} #{i + 1}", runs[mode][-1]))
    best = {m: max(rs, key=lambda r: r["tok_s"]) for m, rs in runs.items()}
    best_cpu = {m: max(r["tok_per_cpu_s"] for r in rs) for m, rs in runs.items()}
    return dict(runs=runs, best=best, ratios=dict(tok_s=best["on"]["tok_s"] / best["off"]["tok_s"],
                                                  tok_per_cpu_s=best_cpu["on"] / best_cpu["off"]),
                same_tokens=all(r["token_ids"] == runs["off"][0]["token_ids"] for rs in runs.values() for r in rs))


def line(label: str, r: dict[str, Any]) -> str:
    return (f"  {label:24} TTFT p50 {r['ttft']['p50']:7.2f}s p99 {r['ttft']['p99']:7.2f}s  "
            f"{r['tok_s']:7.1f} tok/s ({r['tok_per_cpu_s']:6.1f}/CPU-s)  hit rate {r['hit_rate']:6.1%}  prefill computed "
            f"{r['prefill_tokens_computed']:6d} of {r['prompt_tokens']:6d} prompt tokens  {r['steps']:4d} steps  "
            f"load {r['loadavg']:.1f}")


def markdown(res: dict[str, Any]) -> str:
    a, out = res["args"], []
    out.append(f"# Prefix caching on vs off ({a['model']} model)\n")
    out.append(f"Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, JAX {res['machine']['jax']}; "
               f"load average at start {res['loadavg_start']:.1f}, at end {res['loadavg_end']:.1f}. "
               f"Chunked prefill {'on' if a['chunked_prefill'] else 'off'}.\n")
    out.append("| workload | caching | TTFT p50 | TTFT p99 | output tok/s | tok per CPU-s | hit rate | "
               "prompt tokens computed | load |")
    out.append("|---|---|---|---|---|---|---|---|---|")

    def row(name: str, mode: str, r: dict[str, Any]) -> None:
        out.append(f"| {name} | {mode} | {r['ttft']['p50']:.2f} s | {r['ttft']['p99']:.2f} s | {r['tok_s']:.1f} | {r['tok_per_cpu_s']:.1f} | "
                   f"{r['hit_rate']:.1%} | {r['prefill_tokens_computed']} / {r['prompt_tokens']} | "
                   f"{r['loadavg']:.1f} |")
    s = res["sections"]
    if "shared" in s:
        for m in ("off", "on"):
            row(f"shared system prompt ({a['shared_requests']} x {a['system_len']}+{a['question_len']})", m,
                s["shared"]["runs"][m])
    if "multiturn" in s:
        for m in ("off", "on"):
            row(f"multi-turn, turn {a['turns']} ({a['conversations']} conversations)", m, s["multiturn"]["runs"][m]["last"])
    if "mix" in s:
        for m in ("off", "on"):
            row(f"no sharing: seed mix ({a['mix_requests']} requests, best of {a['mix_repeats']})", m,
                s["mix"]["best"][m])
    out.append("\n| ratio (caching on vs off) | measured | target | met |")
    out.append("|---|---|---|---|")
    for name, (val, target, ok) in res["summary"].items():
        out.append(f"| {name} | {val:.3f} | {target} | {'yes' if ok else 'NO'} |")
    out.append("\nGreedy tokens identical on vs off: "
               + ", ".join(f"{k} {'yes' if v['same_tokens'] else 'NO'}" for k, v in s.items()) + ".")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    a.shape = shape(a)
    log(f"engine shape for every run: {a.shape}, block size {BLOCK}, chunked prefill "
        f"{'on' if a.chunked_prefill else 'off'}")
    res: dict[str, Any] = dict(bench="prefix", args=vars(a), machine=machine_info(),
                               loadavg_start=os.getloadavg()[0], sections={})
    run = {"shared": section_shared, "multiturn": section_multiturn, "mix": section_mix}
    for name in a.sections:
        log(f"section {name}")
        res["sections"][name] = run[name](a, log)
    res["loadavg_end"] = os.getloadavg()[0]
    summary: dict[str, tuple[float, str, bool]] = {}
    s = res["sections"]
    if "shared" in s:
        r = s["shared"]["ratios"]
        summary["shared: TTFT p50 off/on"] = (r["ttft_p50"], ">= 5", r["ttft_p50"] >= TARGETS["shared_ttft_p50"])
        summary["shared: TTFT p99 off/on"] = (r["ttft_p99"], "-", True)
        summary["shared: output tok/s on/off"] = (r["tok_s"], ">= 2", r["tok_s"] >= TARGETS["shared_tok_s"])
    if "multiturn" in s:
        r = s["multiturn"]["ratios"]
        summary[f"multi-turn: turn {a.turns} TTFT p50 off/on"] = (
            r["last_turn_ttft_p50"], ">= 3", r["last_turn_ttft_p50"] >= TARGETS["multiturn_ttft_p50"])
    if "mix" in s:
        r = s["mix"]["ratios"]
        summary["no sharing: output tok/s on/off"] = (r["tok_s"], ">= 0.97", r["tok_s"] >= 1 - TARGETS["mix_tok_s_loss"])
        summary["no sharing: output tok per CPU-s on/off"] = (r["tok_per_cpu_s"], "(>= 0.97)",
                                                             r["tok_per_cpu_s"] >= 1 - TARGETS["mix_tok_s_loss"])
    res["summary"] = summary
    for sec in s.values():  # token ids were for the comparison; keep the JSON small
        for r in _runs(sec):
            r.pop("token_ids", None)
    md = markdown(res)
    log("\n" + md)
    with open(os.path.join(a.out, "prefix.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "prefix.md"), "w") as f:
        f.write(md)
    log(f"wrote {a.out}/prefix.json and prefix.md")
    return res


def _runs(sec: dict[str, Any]):
    for v in sec["runs"].values():
        if isinstance(v, list):
            yield from v
        elif "turns" in v:
            yield from v["turns"]
        else:
            yield v


if __name__ == "__main__":
    main()
