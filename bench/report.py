"""What every bench measures and writes the same way: percentiles, a timed offline run with the
engine's own counters, side-by-side ratios, text and markdown tables, JSON, plots, the machine
the figures came from; and bench/mixed.py's reading of its results (report.md and plots).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from contextlib import suppress
from typing import Any, Callable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100), linear interpolation between ranks (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 and max of a latency list ({} if empty)."""
    if not values:
        return {}
    return {"mean": sum(values) / len(values)} | {f"p{q}": percentile(values, q) for q in (50, 90, 99)} | {
        "max": max(values)}


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing, NaN or the denominator is not positive."""
    ok = num is not None and den is not None and not math.isnan(num) and not math.isnan(den) and den > 0
    return num / den if ok else None


def side_by_side(name: str, measured: float, ideal: float | None = None, target: float | None = None) -> dict[str, Any]:
    """A ratio measured in one run, beside its ideal from step counts and its target."""
    return {"name": name, "measured": measured, "ideal": ideal, "target": target,
            "pass": None if target is None else bool(measured >= target)}


def ratio_rows(ratios: list[dict[str, Any]], label: str = "") -> list[list[str]]:
    """side_by_side() ratios as table rows: label, name, measured, ideal, target, verdict."""
    return [[label, r["name"], f"{r['measured']:.2f}x", "-" if r["ideal"] is None else f"{r['ideal']:.2f}x",
             "-" if r["target"] is None else f">= {r['target']:g}x",
             "" if r["pass"] is None else ("PASS" if r["pass"] else "MISS")] for r in ratios]


def text_table(rows: list[list[str]], left: int = 1) -> str:
    """Aligned columns under a rule; the first `left` columns (names) to the left, figures right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(x.ljust(n) if j < left else x.rjust(n) for j, (x, n) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def md_table(rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
                     + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def num(x: float | None, unit: str = "", fmt: str = "{:.3g}") -> str:
    """A figure for a table: '-' when not measured; 13744, not 1.37e+04."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return (f"{x:.0f}" if fmt == "{:.3g}" and abs(x) >= 1000 else fmt.format(x)) + unit


def write_text(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def write_json(path: str, data: Any) -> str:
    return write_text(path, json.dumps(data, indent=1))


def read_json(path: str, use: Callable[[Any], Any], what: str) -> Any:
    """use(the JSON in path); a file that is not JSON, or not the shape `use` reads (a redraw's
    `use` is the redraw itself), is a ValueError naming the file, the error's type and text."""
    with open(path) as f:
        text = f.read()
    try:
        return use(json.loads(text))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, StopIteration) as e:
        raise ValueError(f"{path}: not {what} ({type(e).__name__}: {e})"[:300]) from None


def redraw(flag: str, path: str, use: Callable[[Any], Any], what: str) -> Any:
    """read_json for a redraw from `flag`'s file: a bad file is argparse's error line and exit
    status 2, without the usage, which would bury the line."""
    try:
        return read_json(path, use, what)
    except ValueError as e:
        sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: {flag} {e}\n")
        raise SystemExit(2) from None


def results_dir(name: str) -> str:
    """bench/results/<name>: where a bench writes unless told (git-ignored)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)


def out_path(out: str | None, name: str) -> str | None:
    """--out, else $OUT/name when $OUT is set (the GPU machine's folder that comes back), else None."""
    return out or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)


def require_gpu(required: bool) -> bool:
    """Whether JAX runs on a GPU; exits at once when `required` (--require-gpu) and it does not."""
    import jax

    if required and jax.default_backend() != "gpu":
        raise SystemExit(f"--require-gpu: JAX sees no GPU ({jax.devices()})")
    return jax.default_backend() == "gpu"


def log(msg: str) -> None:
    """A progress line, shown at once (benches run for minutes, often piped)."""
    print(msg, flush=True)


def sections(parser: Any, text: str, choices: Sequence[str], flag: str = "--sections") -> list[str]:
    """A comma-separated list of `flag`, each one of `choices` (else a parser error)."""
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    if not chosen or not set(chosen) <= set(choices):
        parser.error(f"{flag} takes a comma-separated subset of {', '.join(choices)}, got {text!r}")
    return chosen


def checked(kind: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: kind(text) if ok, else an error naming the flag; kind list: ints a,b,c each ok."""
    def parse(text: str) -> Any:
        try:
            x = [int(v) for v in text.split(",") if v.strip()] if kind is list else kind(text)
            if (x and all(map(ok, x))) if kind is list else ok(x):
                return x
        except ValueError:
            pass
        raise argparse.ArgumentTypeError(f"wants {what}, got {text!r}")
    return parse


def model_name(text: str) -> str:
    """The argparse type of a bench's --model: what server.py's --model takes (a built-in
    model, a checkpoint directory or a .gguf file), refused before any engine is built."""
    from gguf_loader import BUILTIN_GGUF
    from model_loader import BUILTIN_MODELS

    if text in BUILTIN_MODELS or text in BUILTIN_GGUF or os.path.exists(text):
        return text
    raise argparse.ArgumentTypeError(f"wants one of {', '.join([*BUILTIN_MODELS, *BUILTIN_GGUF])}, a checkpoint "
                                     f"directory or a .gguf file, got {text!r}")


positive = checked(int, lambda x: x >= 1, "an integer >= 1")
natural = checked(int, lambda x: x >= 0, "an integer >= 0")
positive_float = checked(float, lambda x: 0 < x < math.inf, "a number > 0")
positive_ints = checked(list, lambda x: x >= 1, "comma-separated integers >= 1")


def size_defaults(args: Any, sizes: dict[str, tuple[Any, Any]]) -> Any:
    """Each option in `sizes` left unset (None) takes its (full run, --tiny) default."""
    for name, (full, tiny) in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    return args


def pyplot():
    """matplotlib's pyplot on the file-only backend (benches run on headless machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str, dpi: int = 110) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return os.path.basename(path)


def machine_info() -> dict[str, Any]:
    """CPU model, cores and the versions that matter, for the JSON and the table header."""
    cpu = platform.processor() or platform.machine()
    with suppress(OSError, StopIteration):
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}
    for mod in ("jax", "jaxlib", "flax", "transformers", "torch"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    if info["jax"]:
        import jax

        info["jax_backend"], info["jax_devices"] = jax.default_backend(), [str(d) for d in jax.devices()]
    return info


def timer(fn: Callable[[], Any], reps: int = 5, warmup: bool = False,
          stat: Callable[[list[float]], float] = min) -> float:
    """stat of reps timings of fn() in seconds; the best by default: the least disturbed on a shared machine."""
    if warmup:
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return stat(out)


# ---- a timed offline run -------------------------------------------------------------------

COUNTERS = ("num_steps", "num_decode_steps", "useful_slot_steps", "total_slot_steps", "prefill_tokens",
            "decode_tokens", "padded_tokens", "num_preemptions", "num_compilations", "generation_tokens",
            "prefix_cache_queries", "prefix_cache_hits")


def greedy(max_tokens: Sequence[int]) -> list[Any]:
    """Greedy, ignore_eos sampling params: output lengths are exactly max_tokens."""
    from sampling_params import SamplingParams

    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]


def warm(llm: Any) -> None:
    """One small untimed request: the first dispatches cost what compilation does not."""
    llm.generate([[1] * 8, [2] * 8], greedy([2, 3]), use_tqdm=False)


def timed_generate(llm: Any, prompts: list[list[int]], max_tokens: list[int],
                   classes: list[str] | None = None) -> dict[str, Any]:
    """One llm.generate of every request at once, timed by the wall clock and by this process's
    CPU time (which other work on a shared machine does not stretch), with the engine's counters
    and, per request, the step it finished at: the step-count ideal of a latency ratio.
    `classes` adds per-class latencies."""
    engine = llm.engine
    before = llm.stats.snapshot()
    finish_step: dict[str, int] = {}
    inner = engine.step

    def counting_step() -> Any:
        deltas = inner()
        for d in deltas:
            if d.finished:
                finish_step[d.request_id] = engine.stats.num_steps - before.num_steps
        return deltas

    engine.step = counting_step  # an instance attribute over the method, removed below
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        del engine.step
    after = llm.stats.snapshot()
    stats = {k: getattr(after, k) - getattr(before, k) for k in COUNTERS}
    bad = [o.request_id for o, n in zip(outs, max_tokens) if len(o.outputs[0].token_ids) != n]
    assert not bad, f"requests {bad[:5]} did not produce exactly max_tokens (ignore_eos)"
    completion = [o.finished_time - o.arrival_time for o in outs]
    steps = [finish_step[o.request_id] for o in outs]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    cfg = engine.config
    res: dict[str, Any] = {
        "scheduling": cfg.scheduling, "max_num_seqs": cfg.max_num_seqs, "max_model_len": cfg.max_model_len,
        "num_requests": len(prompts), "output_tokens": n_out, "prompt_tokens": sum(map(len, prompts)),
        "wall_s": wall, "cpu_s": cpu, "output_tok_s": n_out / wall, "tok_per_cpu_s": n_out / max(cpu, 1e-9),
        "stats": stats, "slot_utilization": stats["useful_slot_steps"] / max(stats["total_slot_steps"], 1),
        "ms_per_step": 1000 * wall / max(stats["num_steps"], 1),
        "hit_rate": stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1),
        "ttft_s": summarize([o.first_token_time - o.arrival_time for o in outs]),
        "completion_s": summarize(completion), "completion_s_all": completion, "finish_step_all": steps,
        "token_ids": [o.outputs[0].token_ids for o in outs], "loadavg": os.getloadavg()[0]}
    for cls in sorted(set(classes or ())):
        mine = [c == cls for c in classes]
        res[f"{cls}_completion_s"] = summarize([c for c, m in zip(completion, mine) if m])
        res[f"{cls}_finish_step"] = summarize([float(k) for k, m in zip(steps, mine) if m])
    return res


def lean(run: dict[str, Any], per_request: bool = False) -> dict[str, Any]:
    """A timed_generate result for the JSON: no token ids and, unless `per_request`, no
    per-request completion times and finish steps."""
    drop = {"token_ids"} | (set() if per_request else {"completion_s_all", "finish_step_all"})
    return {k: v for k, v in run.items() if k not in drop}


def run_line(label: str, r: dict[str, Any]) -> str:
    """One timed_generate run in a line: throughput, steps and what they cost."""
    st = r["stats"]
    line = (f"  {label:<28} {r['output_tok_s']:8.1f} tok/s  {r['wall_s']:7.1f}s  steps {st['num_steps']:5d} "
            f"(decode-only {st['num_decode_steps']}) {r['ms_per_step']:.0f} ms/step, "
            f"slot util {r['slot_utilization']:.2f}, preemptions {st['num_preemptions']}")
    if "short_completion_s" in r:
        line += (f", short p50/p99 {r['short_completion_s']['p50']:.2f}/{r['short_completion_s']['p99']:.2f}s, "
                 f"long p99 {r['long_completion_s']['p99']:.2f}s")
    return line


def continuous_vs_static(c: dict[str, Any], s: dict[str, Any], target_tok_s: float | None = None,
                         target_p99: float | None = None, what: str = "") -> list[dict[str, Any]]:
    """Output tok/s continuous / static, and (with classes) short p99 completion static / continuous,
    from a timed_generate of each on the same requests, each beside its ideal from step counts."""
    out = [side_by_side(f"output tok/s, continuous / static{what}", c["output_tok_s"] / s["output_tok_s"],
                        s["stats"]["num_steps"] / c["stats"]["num_steps"], target_tok_s)]
    if "short_completion_s" in c:
        out.append(side_by_side(f"short p99 completion, static / continuous{what}",
                                s["short_completion_s"]["p99"] / c["short_completion_s"]["p99"],
                                s["short_finish_step"]["p99"] / c["short_finish_step"]["p99"], target_p99))
    return out


# ---- bench/mixed.py's results: the answer, the side by side, report.md, plots ----------

SHARP = 1.5  # "short-request p99 fell sharply": at least this many times lower at half length
METRICS = (("ttft", " s", 1), ("itl", " ms", 1000), ("tpot", " ms", 1000), ("e2e", " s", 1))
TIMING_TEXT = {"text": "one chunk per token, from the stream's text chunks",
               "logprobs": "each token's chunk (logprobs=0 asked for, as some tokens decode to no text)",
               "chunks": "per SSE chunk (approximate: a chunk may hold several tokens)",
               "none": "none (--no-stream: one response per request, so e2e and usage only; TTFT and ITL not measured)"}


def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    """EngineConfig fields as server.py's flags."""
    argv = []
    for k, v in flags.items():
        opt = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            argv.append(opt if v else "--no-" + k.replace("_", "-"))
        elif v is not None:
            argv += [opt, str(v)]
    return argv


def _ok(v: dict | None) -> bool:
    return bool(v) and "error" not in v and "short" in v


def _p(v: dict, cls: str, metric: str, q: str) -> float | None:
    return v[cls].get(metric, {}).get(q)


def _times(r: float) -> str:
    """old/new in words: '2.50x lower' or '1.20x higher'."""
    return f"{r:.2f}x lower" if r >= 1 else f"{1 / r:.2f}x higher"


def cores_used(v: dict) -> float | None:
    """CPU cores the server process got during the run (its CPU seconds / wall seconds)."""
    cpu = (v.get("load") or {}).get("server_cpu_s")
    return cpu / v["duration_s"] if cpu is not None and v.get("duration_s") else None


def analyze(results: dict[str, Any]) -> dict[str, Any]:
    """The comparisons the report states, computed from the variants' figures."""
    vs = results["variants"]
    out: dict[str, Any] = {"sharp_fall_threshold": SHARP, "halving": {}, "answer": []}
    c, s = vs.get("continuous"), vs.get("static")
    if _ok(c) and _ok(s) and s["output_tokens_per_s"] > 0:
        cs = {"output_tokens_per_s_ratio": c["output_tokens_per_s"] / s["output_tokens_per_s"],
              "short_p99_e2e_ratio": _p(s, "short", "e2e", "p99") / _p(c, "short", "e2e", "p99"),
              "short_p50_ttft_ratio": _p(s, "short", "ttft", "p50") / _p(c, "short", "ttft", "p50")}
        out["continuous_vs_static"] = cs
        out["answer"].append(f"Continuous vs static: {cs['output_tokens_per_s_ratio']:.2f}x the output tokens/s; "
                             f"short-request p99 e2e {_times(cs['short_p99_e2e_ratio'])} under continuous.")
    for mode in sorted({v["admission"] for v in vs.values() if v.get("admission")}):
        full, half = vs.get(f"{mode}/full"), vs.get(f"{mode}/half")
        if not (_ok(full) and _ok(half)):
            continue
        p_half = _p(half, "short", "e2e", "p99")
        fall = _p(full, "short", "e2e", "p99") / p_half if p_half else math.inf
        reason, sharp = full["metrics"]["dominant_wait_reason"], fall >= SHARP
        # the rule of thumb: a sharp fall at half max_model_len means requests queued on KV blocks at full length
        h = {"fall": fall, "fell_sharply": sharp, "queued_on": reason,
             "kv_rule_holds": sharp == (reason == "kv_blocks")}
        out["halving"][mode] = h
        run = f"{full['metrics']['max_running']:.0f} -> {half['metrics']['max_running']:.0f}"
        cores = [cores_used(v) for v in (full, half)]
        out["answer"].append(
            f"{mode}: short-request p99 e2e {_times(fall)} at max_model_len {half['flags']['max_model_len']} than at "
            f"{full['flags']['max_model_len']} ({'fell sharply' if sharp else 'no sharp fall'}; max running {run}); "
            f"at full length requests waited mostly on {reason or 'nothing'}, so the rule of thumb (a sharp fall means "
            f"KV blocks) {'holds' if h['kv_rule_holds'] else 'does not hold'}."
            + (f" Caution: the server got {cores[0]:.1f} cores at full length and {cores[1]:.1f} at half: not "
               "comparable." if None not in cores and min(cores) < 0.75 * max(cores) else ""))
    targets = [t["name"] for t in results["settings"].get("targets") or []]
    for name in targets:
        v = vs.get(name)
        out["answer"].append(f"{name}: {v['output_tokens_per_s']:.1f} output tokens/s; {v['errors']} of "
                             f"{v['requests']} requests failed." if _ok(v) else
                             f"{name}: not measured ({(v or {}).get('error', 'no figures')}).")
    ok = [n for n in targets if _ok(vs.get(n))]
    if len(ok) >= 2:
        out["comparison"] = compare(vs, ok)
        for name, c in out["comparison"]["vs"].items():
            tps, p99, g = c["output_tokens_per_s"]["ratio"], c["short"]["e2e"]["p99"]["ratio"], c["greedy_texts"]
            out["answer"].append(f"{ok[0]} vs {name}: {num(tps, 'x', '{:.2f}')} the output tokens/s; short-request p99 "
                                 f"e2e {_times(p99) if p99 else 'not comparable'} under {ok[0]}; greedy texts "
                                 f"identical in {g['identical']} of {g['compared']} requests.")
    return out


def text_agreement(a: dict, b: dict) -> dict[str, Any]:
    """Do two servers' greedy completions of the same requests match, text for text? And did the
    same prompt make as many tokens on both (from usage; None: not reported)?"""
    pairs = [(i, x["text"], y["text"]) for i, (x, y) in enumerate(zip(a["per_request"], b["per_request"]))
             if not x["error"] and not y["error"] and x.get("text") is not None and y.get("text") is not None]
    diff = [(i, x, y) for i, x, y in pairs if x != y]
    first = None
    if diff:
        i, x, y = diff[0]
        k = len(os.path.commonprefix([x, y]))
        first = {"request": i, "common_prefix_chars": k, "a": x[max(0, k - 20):k + 40], "b": y[max(0, k - 20):k + 40]}
    known = [(x["prompt_tokens"], y["prompt_tokens"]) for x, y in zip(a["per_request"], b["per_request"])
             if x.get("prompt_tokens") is not None and y.get("prompt_tokens") is not None]
    return {"compared": len(pairs), "identical": len(pairs) - len(diff), "first_difference": first,
            "prompt_tokens_equal": sum(x == y for x, y in known) if known else None,
            "prompt_tokens_compared": len(known)}


def compare(vs: dict[str, dict], names: list[str]) -> dict[str, Any]:
    """Each server against the first: output tokens/s, and TTFT / ITL / TPOT / e2e p50 and p99 per
    class, as both values and a ratio (> 1: the first is better); and the texts."""
    ref, a = names[0], vs[names[0]]
    out: dict[str, Any] = {"reference": ref, "vs": {}}
    for name in names[1:]:
        b = vs[name]
        tps = (a["output_tokens_per_s"], b["output_tokens_per_s"])
        c: dict[str, Any] = {"output_tokens_per_s": {ref: tps[0], name: tps[1], "ratio": ratio(*tps)}}
        for cls in ("short", "long"):
            c[cls] = {m: {q: {ref: a[cls][m].get(q), name: b[cls][m].get(q),
                              "ratio": ratio(b[cls][m].get(q), a[cls][m].get(q))} for q in ("p50", "p99")}
                      for m, _, _ in METRICS}
        out["vs"][name] = c | {"greedy_texts": text_agreement(a, b)}
    return out


def _q(cls: str, metric: str, qs: tuple[str, ...], scale: float = 1.0) -> Any:
    return lambda v: tuple(scale * x if x is not None else None for x in (_p(v, cls, metric, q) for q in qs))


COLUMNS = [  # (header, figures of a variant, format)
    ("tok/s", lambda v: (v["output_tokens_per_s"],), "{:.0f}"),
    ("failed", lambda v: (v["errors"], v["requests"]), "{} of {}"),
    ("short TTFT p50/p99 s", _q("short", "ttft", ("p50", "p99")), "{:.2f}/{:.2f}"),
    ("short ITL mean/p50/p99 ms", _q("short", "itl", ("mean", "p50", "p99"), 1000), "{:.0f}/{:.0f}/{:.0f}"),
    ("short e2e p50/p90/p99 s", _q("short", "e2e", ("p50", "p90", "p99")), "{:.1f}/{:.1f}/{:.1f}"),
    ("out tok short/long", lambda v: (_p(v, "short", "output_tokens", "mean"), _p(v, "long", "output_tokens", "mean")),
     "{:.0f}/{:.0f}"),
    ("long TTFT p50 s", _q("long", "ttft", ("p50",)), "{:.2f}"),
    ("long ITL mean ms", _q("long", "itl", ("mean",), 1000), "{:.0f}"),
    ("long e2e p50/p90/p99 s", _q("long", "e2e", ("p50", "p90", "p99")), "{:.1f}/{:.1f}/{:.1f}"),
    ("KV blocks", lambda v: (v["metrics"]["num_kv_blocks"],), "{:.0f}"),
    ("max run", lambda v: (v["metrics"]["max_running"],), "{:.0f}"),
    ("KV max", lambda v: (100 * v["metrics"]["max_kv_usage"],), "{:.0f}%"),
    ("preempt", lambda v: (v["metrics"]["preemptions"],), "{:.0f}"),
    ("waited on", lambda v: (v["metrics"]["dominant_wait_reason"] or "-",), "{}"),
    ("server cores", lambda v: (cores_used(v),), "{:.1f}"),
]


def _cell(v: dict, fn: Any, fmt: str) -> str:
    try:
        return fmt.format(*fn(v))
    except (TypeError, KeyError, ValueError):
        return "-"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = [["variant"] + [h for h, _, _ in COLUMNS]]
    for name, v in results["variants"].items():
        rows.append([name] + [_cell(v, fn, fmt) for _, fn, fmt in COLUMNS] if _ok(v) else
                    [name, f"error: {v.get('error', 'no figures')}"[:80]] + [""] * (len(COLUMNS) - 1))
    return rows


# ---- report.md ---------------------------------------------------------------------------

def server_text(v: dict) -> str:
    """In words: how the bench talked to this server, and what it could not measure there."""
    if "capabilities" not in v:
        return f"not measured: {v.get('error', 'no figures')}"
    caps = v["capabilities"]
    said = [f"model `{caps['model']}`" if caps["model"] else "no model name from /v1/models",
            f"{caps['prompts']} prompts"]
    said += [f"refused {dict(include_usage='stream_options.include_usage', logprobs='logprobs=0').get(f, f)} "
             f"({answer[:120]})" for f, answer in caps["refused"].items()]
    if not caps["ignore_eos"]:
        said.append("no ignore_eos sent, so output lengths follow the model")
    elif not v["exact_lengths"]:
        said.append("ignore_eos sent, but output lengths were not exact")
    missing = [text for cond, text in (
        (not caps["usage"], "usage: prompt tokens not known, output tokens counted from the streamed chunks"),
        (caps["timing"] == "chunks", "per-token ITL (timed per streamed chunk)"),
        (caps["timing"] == "none", "TTFT, ITL and TPOT (--no-stream: each request's one response gives e2e and usage)"),
        (not caps["metrics"], "running / waiting / KV usage / preemptions (no /metrics with a series the bench knows)"),
        (caps["metrics"] and not v["metrics"]["waiting_by_reason_s"], "why requests waited (no waiting-by-reason)"))
        if cond]
    return "; ".join(said) + ". Not measured: " + ("; ".join(missing) or "nothing") + "."


def side_by_side_md(results: dict[str, Any]) -> list[str]:
    """One table per server against the first: values, and ratios (> 1: the first is better)."""
    comp = results["analysis"]["comparison"]
    ref, lines = comp["reference"], ["## Side by side", ""]
    for name, c in comp["vs"].items():
        def row(label: str, d: dict, unit: str = "", scale: float = 1.0, fmt: str = "{:.3g}") -> list[str]:
            val = [None if d[k] is None else d[k] * scale for k in (ref, name)]
            return [label, num(val[0], unit, fmt), num(val[1], unit, fmt), num(d["ratio"], "x", "{:.2f}")]

        rows = [["", ref, name, f"{ref} better by"], row("output tokens/s", c["output_tokens_per_s"], fmt="{:.1f}")]
        rows += [row(f"{cls} {m.upper()} {q}", c[cls][m][q], unit, scale)
                 for cls in ("short", "long") for m, unit, scale in METRICS for q in ("p50", "p99")]
        g, d = c["greedy_texts"], c["greedy_texts"]["first_difference"]
        lines += [f"### {ref} vs {name}", "", md_table(rows), "",
                  f"Greedy texts: {g['identical']} of {g['compared']} requests identical"
                  + (f"; the first difference in request {d['request']} after {d['common_prefix_chars']} characters: "
                     f"{d['a']!r} vs {d['b']!r}" if d else "") + ". Prompt tokens (usage) equal on both: "
                  + ("not reported by both." if g["prompt_tokens_equal"] is None else
                     f"{g['prompt_tokens_equal']} of {g['prompt_tokens_compared']} requests."), ""]
    return lines


def write_report(results: dict[str, Any], out_dir: str) -> str:
    st, m, an, vs = results["settings"], results["machine"], results["analysis"], results["variants"]
    targets = st.get("targets") or []
    lines = ["# Mixed short/long online bench", "",
             f"{results['started']}, {results['total_s'] / 60:.1f} minutes. Generated by `python bench/mixed.py`"
             + (" from a run that did not finish." if results.get("partial") else "."), "", "## Answer", ""]
    lines += [f"- {a}" for a in an["answer"]] + [""] + (side_by_side_md(results) if an.get("comparison") else [])
    lines += ["## Results", "", md_table(table_rows(results)), "",
              "Client-side TTFT, ITL and e2e; tok/s: output tokens from the first request sent to the last token. "
              "`failed`: requests answered with an error, left out of every figure. `server cores`: the server's CPU "
              "seconds over the run's wall time. `-`: not measured. A sharp fall of short-request p99 at half "
              f"max_model_len: >= {SHARP}x; waits from `taxirank:num_requests_waiting_by_wait_reason`.",
              ""]
    lo_hi = st["prompt_len"].replace(",", "..")
    prompts = (f"{lo_hi} words of generated prose" if st.get("prompt_kind") == "text"
               else f"{lo_hi} random token ids (vocabulary {st['vocab_size']})")
    timings = sorted({v["token_timing"] for v in vs.values() if v.get("token_timing")})
    lines += ["## Settings", "",
              f"- Workload: {st['num_requests']} requests, half max_tokens={st['short']} and half {st['long']}, "
              f"shuffled (seed {st['seed']}); prompts of {prompts}; temperature 0, "
              f"{'not ' * (timings == ['none'])}streamed; "
              + (f"Poisson arrivals at {st['rate']} requests/s." if st["rate"] else "all sent at once."),
              "- Token timing: " + ("; ".join(TIMING_TEXT[t] for t in timings) or "none") + "."]
    if targets:
        lines += [f"- {t['name']}: " + (f"`{t['command']}`" if t.get("command") else t["url"]) + ": "
                  + server_text(vs.get(t["name"]) or {}) for t in targets]
    else:
        blocks, bs, full = st["kv_budget_blocks"] - 1, st["block_size"], st["max_model_len"]
        lines += [f"- ignore_eos on every request. Model `{st['model']}`; max_num_seqs {st['max_num_seqs']}, block "
                  f"size {bs}, max_model_len {full} (full) or {full // 2} (half)"
                  + (f", extra server flags `{st['server_args']}`" if st["server_args"] else "") + ".",
                  f"- The admission variants' KV budget: {blocks} blocks = {st['kv_budget_seqs']} sequences of {full} "
                  f"tokens; under reserve-max-len {blocks // math.ceil(full / bs)} requests fit at {full}, "
                  f"{blocks // math.ceil(full // 2 / bs)} at {full // 2}; under reserve a request holds prompt + "
                  "max_tokens and under on-demand the tokens computed so far: max_model_len changes neither.", "",
                  "| variant | server flags |", "|---|---|"]
        lines += [f"| {n} | `{' '.join(flags_to_argv(v['flags']))}` |" for n, v in vs.items()]
    la = ["/".join(f"{x:.1f}" for x in results[k]) for k in ("loadavg_start", "loadavg_end")]
    lines += ["", "## Machine", "", f"- {m.get('cpu')}, {m.get('cores')} cores; Python {m.get('python')}, JAX "
              f"{m.get('jax')} ({m.get('jax_backend')}); load average {la[0]} at start, {la[1]} at the end.", "",
              "## Plots", ""] + [f"![{p}]({p})" for p in results.get("plots", [])]
    return write_text(os.path.join(out_dir, "report.md"), "\n".join(lines) + "\n")


# ---- plots -------------------------------------------------------------------------------

def client_view(v: dict, points: int = 300) -> dict[str, Any] | None:
    """Requests in flight over time as the client saw them (no server metrics needed): waiting
    for their first token (or, not streamed, their one response), and streaming."""
    reqs = [r for r in v.get("per_request") or [] if r["e2e"] is not None]
    if not reqs:
        return None
    ts = [max(r["start"] + r["e2e"] for r in reqs) * i / points for i in range(points + 1)]
    first = [r["start"] + (r["ttft"] if r["ttft"] is not None else r["e2e"]) for r in reqs]
    return {"t": ts, "awaiting": [sum(r["start"] <= t < f for r, f in zip(reqs, first)) for t in ts],
            "streaming": [sum(f <= t < r["start"] + r["e2e"] for r, f in zip(reqs, first)) for t in ts],
            "streamed": any(r["ttft"] is not None for r in reqs)}


def _plot_client_view(ax: Any, cv: dict) -> None:
    ax.stackplot(cv["t"], cv["streaming"], cv["awaiting"], step="post", alpha=0.6, labels=[
        "streaming tokens", "waiting for the first token" if cv["streamed"] else "waiting for the response"])
    ax.set_ylabel("requests")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")


def _plot_timeline(plt: Any, name: str, v: dict, path: str) -> str | None:
    """The server's view from /metrics (running, waiting by reason, KV usage), else the client's."""
    tl = v.get("timeline")
    if not tl or not tl["t"]:
        cv = client_view(v)
        if not cv:
            return None
        fig, ax = plt.subplots(figsize=(9, 4))
        _plot_client_view(ax, cv)
        ax.set(title=f"{name}: no /metrics, the client's view", xlabel="seconds since the first request")
        return save_figure(fig, path)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(2, 1))
    t, reasons = tl["t"], {r: col for r, col in tl["waiting_by_reason"].items() if any(col)}
    if reasons:
        top.stackplot(t, *reasons.values(), labels=[f"waiting: {r}" for r in reasons], alpha=0.5, step="post")
    elif any(x is not None for x in tl["waiting"]):
        top.step(t, [x or 0 for x in tl["waiting"]], where="post", label="waiting")
    top.step(t, [x or 0 for x in tl["running"]], where="post", color="black", label="running")
    f = v.get("flags") or {}
    keys = ("scheduling", "kv_admission", "max_model_len", "num_kv_blocks", "max_num_seqs")
    top.set(ylabel="requests", title=f"{name}\n" + (", ".join(f"{k} {f[k]}" for k in keys if k in f) or "as it runs"))
    top.legend(fontsize=8, loc="upper right")
    top.grid(True, alpha=0.3)
    bottom.step(t, [100 * x if x is not None else math.nan for x in tl["kv_usage"]], where="post", color="tab:red")
    pre = [x for x in tl["preemptions"] if x is not None]
    bottom.set(ylabel="KV usage %", xlabel="seconds since the first request", ylim=(0, 105),
               title=f"preemptions: {pre[-1]:.0f}" if pre else None)
    bottom.grid(True, alpha=0.3)
    return save_figure(fig, path)


def write_plots(results: dict[str, Any], out_dir: str) -> list[str]:
    """cdf_short_e2e.png (all variants), timeline-<variant>.png, and with two or more servers
    timeline_side_by_side.png; the file names written."""
    plt, vs = pyplot(), results["variants"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, v in vs.items():
        xs = sorted(r["e2e"] for r in v.get("per_request", []) if r["class"] == "short" and r["e2e"] is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set(xscale="log", xlabel="short-request end-to-end latency (s, log)", ylabel="fraction of short requests",
           title=f"CDF of short-request (max_tokens={results['settings']['short']}) e2e latency")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    written = [save_figure(fig, os.path.join(out_dir, "cdf_short_e2e.png"))]
    written += [p for p in (_plot_timeline(plt, n, v, os.path.join(out_dir, f"timeline-{n.replace('/', '-')}.png"))
                            for n, v in vs.items()) if p]
    side = [t["name"] for t in results["settings"].get("targets") or [] if client_view(vs[t["name"]])]
    if len(side) >= 2:
        fig, axes = plt.subplots(len(side), 1, figsize=(9, 2.6 * len(side)), sharex=True, sharey=True, squeeze=False)
        for ax, name in zip(axes[:, 0], side):
            _plot_client_view(ax, client_view(vs[name]))
            ax.set_title(f"{name}: {vs[name]['output_tokens_per_s']:.1f} output tok/s", fontsize=10)
        axes[-1, 0].set_xlabel("seconds since the first request")
        fig.suptitle("The same workload, one server after the other (client's view)", fontsize=11)
        written.append(save_figure(fig, os.path.join(out_dir, "timeline_side_by_side.png")))
    return written


def mixed_report(results: dict[str, Any], out_dir: str) -> None:
    """bench/mixed.py's analysis, plots, results.json, report.md and terminal table, from its
    figures alone (so --report can redraw them without a run)."""
    results["analysis"] = analyze(results)
    results["plots"] = write_plots(results, out_dir)
    write_json(os.path.join(out_dir, "results.json"), results)
    write_report(results, out_dir)
    print(text_table(table_rows(results)) + "\n\n" + "\n".join("- " + a for a in results["analysis"]["answer"]))
    print(f"\nresults: {out_dir}")
