"""Prefix-caching bench: what does --enable-prefix-caching save when prompts share a prefix,
and what does it cost when they share nothing?

    python bench/prefix.py [--tiny] [--sections shared,multiturn,mix]

Sections, workloads and targets: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import (checked, log, machine_info, md_table, model_name, positive, ratio_rows,  # noqa: E402
                    results_dir, sections, side_by_side, size_defaults, timed_generate, warm, write_json, write_text)
from workload import Request, shared_prefix, short_long_mix, token_ids, vocab_size_of  # noqa: E402

SECTIONS = ("shared", "multiturn", "mix")
BLOCK = 16
SIZES = {  # flag: (full run, --tiny)
    "shared_requests": (64, 8), "system_len": (1024, 96), "shared_output": (64, 8), "conversations": (16, 4),
    "first_len": (512, 48), "turn_output": (64, 8), "mix_requests": (32, 8), "mix_long": (256, 24),
    "question_len": (32, 8), "mix_short": (16, 4)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny model and small sizes: a fast smoke run")
    p.add_argument("--model", type=model_name, default=None, help="default: bench (tiny with --tiny)")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--chunked-prefill", action="store_true", help="run every engine with chunked prefill")
    for name in SIZES:
        p.add_argument("--" + name.replace("_", "-"), type=positive, default=None)
    for name, kind, default in (("turns", checked(int, lambda x: x >= 2, "an integer >= 2"), 4),
                                ("mix_repeats", positive, 2), ("seed", int, 0)):
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default)
    p.add_argument("--out", default=None, help="output folder (default bench/results/prefix[-tiny])")
    a = size_defaults(p.parse_args(argv), SIZES | {"model": ("bench", "tiny"),
                                                   "out": (results_dir("prefix"), results_dir("prefix-tiny"))})
    a.sections = sections(p, a.sections, SECTIONS)
    return a


def shape(a: argparse.Namespace) -> dict[str, int]:
    """The one engine shape every section runs on, over all sections (even those not run: a
    rerun of one section finds its programs compiled)."""
    mix = short_long_mix(a.mix_requests, vocab_size_of(a.model), short=a.mix_short, long=a.mix_long, seed=a.seed)
    need = [(a.shared_requests, a.system_len + a.question_len + a.shared_output),  # (sequences, longest)
            (a.conversations, a.first_len + (a.turns - 1) * a.question_len + a.turns * a.turn_output),
            (a.mix_requests, max(len(r.prompt_token_ids) + r.max_tokens for r in mix))]
    return dict(max_num_seqs=max(n for n, _ in need), max_model_len=max(n for _, n in need),
                num_kv_blocks=max(n * math.ceil(length / BLOCK) for n, length in need) + 1)


def figures(r: dict[str, Any]) -> list[str]:
    """One timed run's cells: TTFT p50 and p99, tok/s, tok per CPU-s, hit rate, prompt tokens computed, load."""
    return [f"{r['ttft_s']['p50']:.2f} s", f"{r['ttft_s']['p99']:.2f} s", f"{r['output_tok_s']:.1f}",
            f"{r['tok_per_cpu_s']:.1f}", f"{r['hit_rate']:.1%}",
            f"{r['stats']['prefill_tokens']} / {r['prompt_tokens']}", f"{r['loadavg']:.1f}"]


def both(a: argparse.Namespace, label: str, run: Callable[[Any], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """run(llm) with caching off, then on, each on a fresh engine (one alive at a time)."""
    from llm import LLM

    out = {}
    for mode in ("off", "on"):
        llm = LLM(a.model, log=lambda s: log(f"    [engine] {s}"), dtype="float32", seed=a.seed, block_size=BLOCK,
                  enable_chunked_prefill=a.chunked_prefill, enable_prefix_caching=mode == "on", **a.shape)
        warm(llm)
        llm.reset_prefix_cache()
        out[mode] = run(llm)
        del llm
        gc.collect()
        log(f"  {label} {mode}: " + " | ".join(figures(out[mode].get("last", out[mode]))))
    return out


def generate_all(reqs: list[Request]) -> Callable[[Any], dict[str, Any]]:
    return lambda llm: timed_generate(llm, [r.prompt_token_ids for r in reqs], [r.max_tokens for r in reqs])


def section_shared(a: argparse.Namespace) -> dict[str, Any]:
    reqs = shared_prefix(a.shared_requests, vocab_size_of(a.model), prefix_len=a.system_len,
                         suffix_len=a.question_len, max_tokens=a.shared_output, seed=a.seed)
    runs = both(a, "shared", generate_all(reqs))
    off, on = runs["off"], runs["on"]
    return dict(runs=runs, same_tokens=off["token_ids"] == on["token_ids"], ratios=dict(
        ttft_p50=off["ttft_s"]["p50"] / on["ttft_s"]["p50"], ttft_p99=off["ttft_s"]["p99"] / on["ttft_s"]["p99"],
        tok_s=on["output_tok_s"] / off["output_tok_s"]))


def section_multiturn(a: argparse.Namespace) -> dict[str, Any]:
    rng, v = random.Random(a.seed + 1), vocab_size_of(a.model)
    firsts = [token_ids(rng, v, a.first_len) for _ in range(a.conversations)]
    news = [[token_ids(rng, v, a.question_len) for _ in range(a.conversations)] for _ in range(a.turns - 1)]

    def conversation(llm: Any) -> dict[str, Any]:
        convs, turns = [list(f) for f in firsts], []
        for k in range(a.turns):
            turns.append(timed_generate(llm, convs, [a.turn_output] * len(convs)))
            if k + 1 < a.turns:  # the answer, then the next message, are resent with the history
                convs = [c + out + new for c, out, new in zip(convs, turns[-1]["token_ids"], news[k])]
        return dict(turns=turns, last=turns[-1])

    runs = both(a, f"multiturn, turn {a.turns}", conversation)
    off, on = runs["off"]["last"], runs["on"]["last"]
    same = [t["token_ids"] for t in runs["off"]["turns"]] == [t["token_ids"] for t in runs["on"]["turns"]]
    return dict(runs=runs, ratios=dict(last_turn_ttft_p50=off["ttft_s"]["p50"] / on["ttft_s"]["p50"]), same_tokens=same)


def section_mix(a: argparse.Namespace) -> dict[str, Any]:
    reqs = short_long_mix(a.mix_requests, vocab_size_of(a.model), short=a.mix_short, long=a.mix_long, seed=a.seed)
    repeats = [both(a, f"mix #{i + 1}", generate_all(reqs)) for i in range(a.mix_repeats)]
    runs = {mode: [r[mode] for r in repeats] for mode in ("off", "on")}
    best = {m: max(rs, key=lambda r: r["output_tok_s"]) for m, rs in runs.items()}
    best_cpu = {m: max(r["tok_per_cpu_s"] for r in rs) for m, rs in runs.items()}
    return dict(runs=runs, best=best, ratios=dict(tok_s=best["on"]["output_tok_s"] / best["off"]["output_tok_s"],
                                                  tok_per_cpu_s=best_cpu["on"] / best_cpu["off"]),
                same_tokens=all(r["token_ids"] == runs["off"][0]["token_ids"] for rs in runs.values() for r in rs))


RATIOS = [  # (section, ratio, name, target)
    ("shared", "ttft_p50", "shared: TTFT p50 off/on", 5), ("shared", "ttft_p99", "shared: TTFT p99 off/on", None),
    ("shared", "tok_s", "shared: output tok/s on/off", 2),
    ("multiturn", "last_turn_ttft_p50", "multi-turn: last turn TTFT p50 off/on", 3),
    ("mix", "tok_s", "no sharing: output tok/s on/off", 0.97),
    ("mix", "tok_per_cpu_s", "no sharing: output tok per CPU-s on/off", 0.97)]


def markdown(res: dict[str, Any]) -> str:
    a, s, m = res["args"], res["sections"], res["machine"]
    rows = [["workload", "caching", "TTFT p50", "TTFT p99", "output tok/s", "tok per CPU-s", "hit rate",
             "prompt tokens computed", "load"]]
    shown = {"shared": (f"shared system prompt ({a['shared_requests']} x {a['system_len']}+{a['question_len']})",
                        lambda sec, mode: sec["runs"][mode]),
             "multiturn": (f"multi-turn, turn {a['turns']} ({a['conversations']} conversations)",
                           lambda sec, mode: sec["runs"][mode]["last"]),
             "mix": (f"no sharing: short/long mix ({a['mix_requests']} requests, best of {a['mix_repeats']})",
                     lambda sec, mode: sec["best"][mode])}
    rows += [[label, mode] + figures(pick(s[name], mode)) for name, (label, pick) in shown.items() if name in s
             for mode in ("off", "on")]
    ratios = [["ratio (caching on vs off)", "measured", "target", "met"]] + [  # no label, no ideal column
        r[1:3] + r[4:] for r in ratio_rows(res["summary"])]
    return (f"# Prefix caching on vs off ({a['model']} model)\n\nMachine: {m['cpu']}, {m['cores']} cores, JAX "
            f"{m['jax']}; load average at start {res['loadavg_start']:.1f}, at end {res['loadavg_end']:.1f}. Chunked "
            f"prefill {'on' if a['chunked_prefill'] else 'off'}.\n\n{md_table(rows)}\n\n{md_table(ratios)}\n\n"
            "Greedy tokens identical on vs off: "
            + ", ".join(f"{k} {'yes' if v['same_tokens'] else 'NO'}" for k, v in s.items()) + ".\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    a.shape = shape(a)
    log(f"engine shape for every run: {a.shape}, block size {BLOCK}, chunked prefill "
        f"{'on' if a.chunked_prefill else 'off'}")
    res: dict[str, Any] = dict(bench="prefix", args=vars(a), machine=machine_info(), loadavg_start=os.getloadavg()[0],
                               sections={})
    run = {"shared": section_shared, "multiturn": section_multiturn, "mix": section_mix}
    for name in a.sections:
        log(f"section {name}")
        res["sections"][name] = run[name](a)
    res["loadavg_end"] = os.getloadavg()[0]
    res["summary"] = [side_by_side(name, res["sections"][sec]["ratios"][key], target=target)
                      for sec, key, name, target in RATIOS if sec in res["sections"]]
    for sec in res["sections"].values():  # token ids were for the comparison; keep the JSON small
        for mode in sec["runs"].values():
            for r in mode if isinstance(mode, list) else mode.get("turns", [mode]):
                for k in ("token_ids", "completion_s_all", "finish_step_all"):
                    r.pop(k, None)
    md = markdown(res)
    print("\n" + md)
    write_json(os.path.join(a.out, "prefix.json"), res)
    print(f"wrote {a.out}/prefix.json and {write_text(os.path.join(a.out, 'prefix.md'), md)}")
    return res


if __name__ == "__main__":
    main()
