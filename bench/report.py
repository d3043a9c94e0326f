"""What every bench measures and writes the same way: percentiles, a timed offline run with the
engine's own counters, side-by-side ratios, text and markdown tables, JSON, plots, and the
machine the figures came from.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from typing import Any, Callable, Sequence

Q = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100), linear interpolation between ranks (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 and max: the figures the benches print for a latency list ({} if empty)."""
    if not values:
        return {}
    return {"mean": sum(values) / len(values)} | {f"p{q}": percentile(values, q) for q in Q} | {"max": max(values)}


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
    """Aligned columns, a rule under the header; the first `left` columns (the names) to the
    left, the figures to the right."""
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


def write_json(path: str, data: Any) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path


def results_dir(name: str) -> str:
    """bench/results/<name>: where a bench writes unless told (git-ignored)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)


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
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}
    for mod in ("jax", "jaxlib", "flax", "transformers", "torch"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    try:
        import jax

        info["jax_backend"], info["jax_devices"] = jax.default_backend(), [str(d) for d in jax.devices()]
    except ImportError:
        pass
    return info


# ---- a timed offline run -------------------------------------------------------------------

COUNTERS = ("num_steps", "num_decode_steps", "useful_slot_steps", "total_slot_steps", "prefill_tokens",
            "decode_tokens", "padded_tokens", "num_preemptions", "num_compilations", "generation_tokens",
            "prefix_cache_queries", "prefix_cache_hits")


def greedy(max_tokens: Sequence[int]) -> list[Any]:
    """Greedy, ignore_eos sampling params: output lengths are exactly max_tokens."""
    from config import SamplingParams

    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]


def warm(llm: Any) -> None:
    """One small untimed request: the first dispatches cost what compilation does not."""
    llm.generate([[1] * 8, [2] * 8], greedy([2, 3]), use_tqdm=False)


def timed_generate(llm: Any, prompts: list[list[int]], max_tokens: list[int],
                   classes: list[str] | None = None) -> dict[str, Any]:
    """One llm.generate of every request at once, timed by the wall clock and by this
    process's CPU time (on a shared machine other work stretches the first, not the second),
    with the engine's counters over the run and, per request, the step at which it
    finished: the step-count ideal of a latency ratio. `classes` adds per-class latencies."""
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
    bad = [o.request_id for o, n in zip(outs, max_tokens) if len(o.token_ids) != n]
    assert not bad, f"requests {bad[:5]} did not produce exactly max_tokens (ignore_eos)"
    completion = [o.finished_time - o.arrival_time for o in outs]
    steps = [finish_step[o.request_id] for o in outs]
    n_out = sum(len(o.token_ids) for o in outs)
    cfg = engine.config
    res: dict[str, Any] = {
        "scheduling": cfg.scheduling, "max_num_seqs": cfg.max_num_seqs, "max_model_len": cfg.max_model_len,
        "num_requests": len(prompts), "output_tokens": n_out, "prompt_tokens": sum(map(len, prompts)),
        "wall_s": wall, "cpu_s": cpu, "output_tok_s": n_out / wall, "tok_per_cpu_s": n_out / max(cpu, 1e-9),
        "stats": stats, "slot_utilization": stats["useful_slot_steps"] / max(stats["total_slot_steps"], 1),
        "ms_per_step": 1000 * wall / max(stats["num_steps"], 1),
        "hit_rate": stats["prefix_cache_hits"] / stats["prefix_cache_queries"] if stats["prefix_cache_queries"] else 0.0,
        "ttft_s": summarize([o.first_token_time - o.arrival_time for o in outs]),
        "completion_s": summarize(completion), "completion_s_all": completion, "finish_step_all": steps,
        "token_ids": [o.token_ids for o in outs], "loadavg": os.getloadavg()[0]}
    for cls in sorted(set(classes or ())):
        mine = [c == cls for c in classes]
        res[f"{cls}_completion_s"] = summarize([c for c, m in zip(completion, mine) if m])
        res[f"{cls}_finish_step"] = summarize([float(k) for k, m in zip(steps, mine) if m])
    return res


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
    """The seed's two ratios from a continuous and a static timed_generate of the same requests,
    each beside its ideal from the engine's step counts (what it would be if every step cost
    the same): output tok/s continuous / static, and short p99 completion static / continuous."""
    out = [side_by_side(f"output tok/s, continuous / static{what}", c["output_tok_s"] / s["output_tok_s"],
                        s["stats"]["num_steps"] / c["stats"]["num_steps"], target_tok_s)]
    if "short_completion_s" in c:
        out.append(side_by_side(f"short p99 completion, static / continuous{what}",
                                s["short_completion_s"]["p99"] / c["short_completion_s"]["p99"],
                                s["short_finish_step"]["p99"] / c["short_finish_step"]["p99"], target_p99))
    return out


def timer(fn: Callable[[], Any], reps: int = 5) -> float:
    """Best of reps timings of fn() in seconds: on a shared machine the least disturbed."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)
