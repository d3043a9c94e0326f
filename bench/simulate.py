"""The simulator: what would the scheduler do, and how long would it take, at scales this
machine cannot run? A workload through the real Scheduler, without the model, in seconds of CPU.

    python bench/simulate.py [--scheduling static --max-num-seqs 64 --num-kv-blocks 600]  # the short/long mix
    python bench/simulate.py --workload two-clients --scheduling-policy fair --cost-model gpu-like
    python bench/simulate.py --workload bench/results/X/results.json   # a request log bench/mixed.py recorded
    python bench/simulate.py --calibrate | --validate | --report  # fit the cost model here; engine vs simulator; scales
Each step is the engine's: `Scheduler.schedule()` decides it (any policy, batching, KV admission, preemption
mode; the policy reads the simulated clock), the cost model times it, `update()` records it (every token a
non-EOS: the benches run ignore_eos), `EngineStats.record_step` counts it. Only the synchronous loop is modelled:
    cost(step) = a + b * rows + c * context_tokens_read + d * prefill_tokens [+ s0 + s1 * tokens swapped]
rows: the token rows the step program computes (runner.py's padded buckets); context: the KV every scheduled
sequence attends over; one coefficient set per program (decode, ragged), fitted by non-negative least squares to
a calibration run of the real engine, the swap terms to timed KV copies (--calibrate, saved as JSON; --cost-model
reads one back); `GPU_LIKE` is written down. Workloads (--workload): `short-long` (bench/workload.py's
short/long mix), `exp`, `slo-mix`, `two-clients`, or a JSON list of {"arrival_s", "prompt_len" (or
"prompt_tokens", "prompt_token_ids"), "max_tokens", optional "n" (n requests of that prompt, as the engine
runs n samples), "priority", "class", "user", "slo_ttft_s", "slo_tpot_s"}, or bench/mixed.py's results.json.
docs/SIMULATION.md has the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root's modules first

from report import (checked, md_table, natural, positive, positive_float, positive_ints, pyplot,  # noqa: E402
                    read_json, results_dir, save_figure, summarize, timer, write_json, write_text)
from workload import arrival_times, exponential_mix, short_long_mix, token_ids  # noqa: E402
from config import EngineConfig  # noqa: E402
from metrics import EngineStats, StepTrace, wait_reasons  # noqa: E402
from sampling_params import SamplingParams, SLOTarget  # noqa: E402
from scheduler import Scheduler  # noqa: E402
from scheduler_output import SchedulerOutput  # noqa: E402
from sequence import Sequence  # noqa: E402

NOT_EOS = 7  # the token every simulated step samples: any id that is not an EOS
PROGRAMS = ("decode", "ragged")
SYNTHETIC = ("short-long", "exp", "slo-mix", "two-clients")  # the workloads synthetic() makes
# The flags each fixed run reads (it builds its own workloads and engines).
RUN_READS = {"validate": {"tiny", "out"}, "calibrate": {"tiny", "cost_model"}, "report": {"report_seqs", "cost_model", "out"}}
DEFAULT_COST_MODEL = results_dir("cost_model.json")


@dataclass
class SimRequest:
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0
    cls: str = "all"
    user: str | None = None  # the client, for the fair policy
    slo_ttft_s: float | None = None  # targets, for the slo policy (None: the config's defaults)
    slo_tpot_s: float | None = None


def synthetic(kind: str, num_requests: int, vocab_size: int, *, short: int = 16, long: int = 512,
              prompt_len: tuple[int, int] = (32, 256), rate: float | None = None, seed: int = 0,
              slo: dict[str, tuple[float, float]] | None = None) -> list[SimRequest]:
    """The benches' workloads (bench/workload.py), all at t=0 or as a Poisson process; slo-mix's short
    requests are class "interactive" (priority -1), its long ones "batch", each with the targets slo[class];
    two-clients: a "heavy" client's 5 of 6 requests at t=0, a "light" one's one every 1/rate s (default 10/s)."""
    if kind == "two-clients":
        n_light, rng = num_requests // 6, random.Random(seed)
        heavy = [SimRequest(0.0, token_ids(rng, vocab_size, rng.randint(*prompt_len)), long, cls="heavy", user="heavy")
                 for _ in range(num_requests - n_light)]
        return heavy + [SimRequest(0.1 + i / (rate or 10.0), token_ids(rng, vocab_size, rng.randint(16, 32)), short,
                                   cls="light", user="light") for i in range(n_light)]
    reqs = (exponential_mix(num_requests, vocab_size, prompt_len=prompt_len, seed=seed) if kind == "exp"
            else short_long_mix(num_requests, vocab_size, short=short, long=long, prompt_len=prompt_len, seed=seed))
    names = ("interactive", "batch") if kind == "slo-mix" else ("short", "long")
    classes = [names[r.max_tokens != short] if kind != "exp" else "all" for r in reqs]
    targets = [(slo or {}).get(c, (None, None)) for c in classes]
    return [SimRequest(t, r.prompt_token_ids, r.max_tokens, -(c == "interactive"), c, None, *g)
            for r, c, t, g in zip(reqs, classes, arrival_times(len(reqs), rate, seed), targets)]


# A request's keys in a --workload JSON; RECORDED: what bench/mixed.py's per_request log adds
# about how the request went on the server (read past: the simulator makes its own outcome).
REQUEST_KEYS = {"arrival_s", "start", "prompt_len", "prompt_tokens", "prompt_token_ids", "max_tokens", "n",
                "priority", "class", "cls", "user", "slo_ttft_s", "slo_tpot_s"}
RECORDED = {"ttft", "e2e", "tokens", "finish_reason", "text", "error"}


def parse_request(r: Any) -> dict[str, Any]:
    """One request of a --workload JSON, its fields checked as the engine's flags are: a
    ValueError naming the field and what it takes (an unknown key is refused, not ignored)."""
    if not isinstance(r, dict):
        raise ValueError(f"a request is a JSON object, got {r!r}"[:120])
    if unknown := sorted(r.keys() - REQUEST_KEYS - RECORDED):
        raise ValueError(f"unknown key(s) {', '.join(unknown)}: bench/simulate.py's docstring lists a request's")

    def get(key: str, ok: Callable[[Any], bool], what: str, default: Any = None) -> Any:
        v = r.get(key, default)
        if v is not default and not ok(v):
            raise ValueError(f"{key} must be {what}, got {v!r}"[:160])
        return v

    def integer(lo: int | None = None) -> Callable[[Any], bool]:
        return lambda v: isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo)

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    ids = get("prompt_token_ids", lambda v: isinstance(v, list) and v and all(integer(0)(t) for t in v),
              "a non-empty list of token ids >= 0")
    # usage's prompt_tokens where the server gave them (mixed.py records null where it did not): a
    # text prompt's prompt_len counts words
    n = get("prompt_tokens", integer(1), "an integer >= 1") or get("prompt_len", integer(1), "an integer >= 1")
    if ids is None and n is None:
        raise ValueError("no prompt: give prompt_len, prompt_tokens or prompt_token_ids")
    if "max_tokens" not in r:
        raise ValueError("no max_tokens")
    max_tokens = get("max_tokens", integer(1), "an integer >= 1")
    made = r.get("tokens")
    if r.get("finish_reason") == "stop" and integer(1)(made) and made < max_tokens:
        max_tokens = made  # a recorded request that stopped early (EOS, a stop string) ran this many steps
    return {"ids": ids, "prompt_len": n, "max_tokens": max_tokens,
            "n": get("n", integer(1), "an integer >= 1", 1),
            "arrival_s": float(get("arrival_s", number, "a finite number of seconds",
                                   get("start", number, "a finite number of seconds", 0.0))),
            "priority": get("priority", integer(), "an integer", 0),
            "cls": get("class" if "class" in r else "cls", lambda v: isinstance(v, str), "a string", "all"),
            "user": get("user", lambda v: isinstance(v, str), "a string"),
            "slo": [None if (v := get(k, lambda x: number(x) and x > 0, "a number of seconds > 0")) is None
                    else float(v) for k in ("slo_ttft_s", "slo_tpot_s")]}


def load_workload(path: str, vocab_size: int = 32000) -> list[SimRequest]:
    """A JSON list of requests, or bench/mixed.py's results.json (its first variant's log
    unless the file is one variant's summary). Prompts given by length get distinct random ids;
    a request with n > 1 is n requests of the same prompt, as the engine runs vLLM's n samples;
    a recorded one that stopped (finish_reason "stop") before max_tokens makes the tokens it made."""
    def parse(data: Any) -> list[SimRequest]:
        if isinstance(data, dict):
            if "per_request" not in data:
                data = next((v for v in data.get("variants", data).values()
                             if isinstance(v, dict) and "per_request" in v), None)
                if data is None:
                    raise ValueError("a JSON object without a variant's per_request log")
            data = data["per_request"]
        if not isinstance(data, list) or not data:
            raise ValueError("expected a non-empty list of requests")
        rng, out = random.Random(0), []
        for i, r in enumerate(data):
            try:
                q = parse_request(r)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
            ids = q["ids"] or [rng.randrange(vocab_size) for _ in range(q["prompt_len"])]
            out += [SimRequest(q["arrival_s"], list(ids), q["max_tokens"], q["priority"], q["cls"], q["user"], *q["slo"])
                    for _ in range(q["n"])]
        return out

    out = read_json(path, parse, "a JSON list of requests nor bench/mixed.py's results.json")
    t0 = min(r.arrival_s for r in out)
    return [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in out]


def step_features(out: SchedulerOutput, num_occupied: int, config: EngineConfig) -> tuple[str, int, int, int]:
    """(program, rows, context_tokens_read, prefill_tokens) of a step, read after
    schedule() (which advanced each sequence past its tokens): runner.execute's shapes."""
    decode = out.is_decode_only
    n = max(num_occupied, len(out.scheduled)) if decode else sum(s.num_new_tokens for s in out.scheduled)
    rows = next(b for b in (config.decode_buckets if decode else config.token_buckets) if b >= n)
    return "decode" if decode else "ragged", rows, sum(s.seq.num_computed_tokens for s in out.scheduled), \
        out.num_prefill_tokens


@dataclass
class CostModel:
    """Seconds per step, per program: a + b*rows + c*context_tokens_read + d*prefill_tokens;
    a step that swaps adds swap[0] + swap[1] * tokens of KV copied (out and in)."""

    coef: dict[str, tuple[float, float, float, float]]  # program -> (a, b, c, d)
    source: str = ""
    fit: dict[str, Any] = field(default_factory=dict)  # residuals, step counts: how good the fit was
    swap: tuple[float, float] = (0.0, 0.0)  # (seconds per step that copies, seconds per token of KV copied)

    def cost(self, program: str, rows: int, context: int, prefill: int, swapped_tokens: int = 0) -> float:
        a, b, c, d = self.coef[program]
        return a + b * rows + c * context + d * prefill + (self.swap[0] + self.swap[1] * swapped_tokens
                                                            if swapped_tokens else 0.0)

    def save(self, path: str) -> None:
        write_json(path, {"coef": {k: dict(zip("abcd", v)) for k, v in self.coef.items()}, "source": self.source,
                          "fit": self.fit, "swap": list(self.swap)})

    @classmethod
    def load(cls, path: str) -> "CostModel":
        def parse(d: Any) -> "CostModel":
            if set(PROGRAMS) - d["coef"].keys():
                raise ValueError(f"no coefficients for {sorted(set(PROGRAMS) - d['coef'].keys())}")
            return cls({k: tuple(float(v[x]) for x in "abcd") for k, v in d["coef"].items()},
                       d.get("source", path), d.get("fit", {}), tuple(d.get("swap", (0.0, 0.0))))

        return read_json(path, parse, "a cost model (simulate.py --calibrate writes one)")


# Llama-3-8B in bf16 on one H200, by the roofline (written down, not measured): every step reads
# the 16.1 GB of weights at ~80% of 4.8 TB/s (4.2 ms), each context token's K/V (128 KiB) at the
# same rate (27 ns), and each prompt token costs its 16 GFLOP at ~60% of 989 TFLOP/s (27 us). Flat
# in rows (true up to a few hundred rows, where decode turns compute-bound). A swap copies each
# token's 128 KiB over PCIe Gen5 x16 at the ~50 GB/s a pinned copy achieves (2.6 us a token, 10x
# less than recomputing it), after ~20 us of launch.
GPU_KV_TOKEN_BYTES, GPU_LINK_BYTES_S = 131072, 50e9
_GPU_A, _GPU_C, _GPU_D = 16.06e9 / (0.8 * 4.8e12), GPU_KV_TOKEN_BYTES / (0.8 * 4.8e12), 16.06e9 / (0.6 * 989e12)
GPU_LIKE = CostModel({p: (_GPU_A, 0.0, _GPU_C, _GPU_D) for p in PROGRAMS},
                     "GPU-like (weight-bound roofline: Llama-3-8B bf16 on H200, PCIe Gen5 swap; written down)",
                     swap=(20e-6, GPU_KV_TOKEN_BYTES / GPU_LINK_BYTES_S))
UNIT_STEPS = CostModel({p: (1.0, 0.0, 0.0, 0.0) for p in PROGRAMS}, "one unit per step (time = step count)")


def fit_cost_model(samples: list[tuple[str, int, int, int, float]], source: str,
                   swap: dict[str, Any] | None = None) -> CostModel:
    """Non-negative least squares per program over (program, rows, context, prefill, seconds);
    swap: measure_swap's fit of the KV copies, kept as it is."""
    import numpy as np
    from scipy.optimize import nnls

    coef, fit = {}, {}
    for program in PROGRAMS:
        rows = [s for s in samples if s[0] == program]
        if len(rows) < 4:
            raise ValueError(f"calibration ran {len(rows)} {program} steps; need at least 4")
        X, y = np.array([[1.0, r, c, p] for _, r, c, p, _ in rows]), np.array([t for *_, t in rows])
        coef[program] = tuple(float(v) for v in nnls(X, y)[0])
        pred = X @ np.array(coef[program])
        fit[program] = {"steps": len(rows), "seconds": float(y.sum()), "predicted_seconds": float(pred.sum()),
                        "median_abs_rel_err": float(np.median(np.abs(pred - y) / y))}
    return CostModel(coef, source, fit | {"swap": swap}, tuple(swap["coef"])) if swap else CostModel(coef, source, fit)


@dataclass
class SimResult:
    """What the benches report, from one simulated (or measured) run."""

    makespan_s: float
    output_tokens: int
    steps: int
    preemptions: int
    slot_utilization: float
    waiting_mean: dict[str, float]  # time-weighted mean number of waiting requests, per reason
    waiting_max: dict[str, int]
    per_request: list[dict[str, Any]]  # class, priority, arrival_s, ttft_s, e2e_s, queue_s, itl_s
    trace: list[StepTrace] = field(default_factory=list)
    recomputed_tokens: int = 0  # the recompute tax
    swapped_blocks: int = 0  # KV blocks copied out and in (--preemption-mode swap)
    prefix_cache_hit_rate: float = 0.0  # prompt tokens served from the prefix cache / looked up (vLLM's)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else float("inf")

    @property
    def goodput(self) -> int:
        """Requests that met their SLO."""
        return sum(bool(r["slo_met"]) for r in self.per_request)

    def latency(self, cls: str | None = None, key: str = "e2e_s", by: str = "class") -> dict[str, float]:
        """key's summary over the requests of cls; TPOT over those with 2 tokens or more (vLLM's
        (e2e - TTFT) / (tokens - 1), as bench/mixed.py reports it: one token has no TPOT)."""
        rs = [r for r in self.per_request if (cls is None or r[by] == cls) and (key != "tpot_s" or r["tokens"] > 1)]
        return summarize([x for r in rs for x in r["itl_s"]] if key == "itl_s" else [r[key] for r in rs])

    def summary(self) -> dict[str, Any]:
        keys = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")
        return {k: getattr(self, k) for k in ("tok_s", "makespan_s", "output_tokens", "steps", "preemptions",
                                              "slot_utilization", "recomputed_tokens", "swapped_blocks",
                                              "prefix_cache_hit_rate", "goodput", "waiting_mean", "waiting_max")} | {
            f"per_{by}": {c: {k: self.latency(c, k, by) for k in keys} for c in sorted({r[by] for r in self.per_request})}
            for by in ("class", "priority")}


def simulate(config: EngineConfig, num_kv_blocks: int, workload: list[SimRequest], cost_model: CostModel,
             record_trace: bool = False, num_swap_blocks: int = 0) -> SimResult:
    """Replay `workload` through the real Scheduler with simulated time; `config` resolved (EngineConfig.resolved),
    num_swap_blocks: the host pool under --preemption-mode swap, its copies costed by cost_model.swap."""
    sched = Scheduler(config, num_kv_blocks, eos_token_ids=(), num_swap_blocks=num_swap_blocks)
    sched.policy.clock = lambda: t  # a policy that reads the time (slo, fair) reads the simulated one
    stats, trace, t, swapped = EngineStats(max_model_len=config.max_model_len), [], 0.0, 0
    pending = sorted(enumerate(workload), key=lambda p: (p[1].arrival_s, p[0]))[::-1]  # pop() = next
    seqs: dict[str, tuple[Sequence, SimRequest]] = {}
    token_times: dict[str, list[float]] = {}
    wait_area, wait_max = dict.fromkeys(wait_reasons(), 0.0), dict.fromkeys(wait_reasons(), 0)
    while pending or sched.has_unfinished():
        while pending and pending[-1][1].arrival_s <= t:
            i, r = pending.pop()
            pol, slo = sched.policy, (r.slo_ttft_s, r.slo_tpot_s) if sched.policy.uses_slo else (None, None)
            seqs[f"sim-{i}"] = (Sequence(f"sim-{i}", r.prompt_token_ids, SamplingParams(
                max_tokens=r.max_tokens, ignore_eos=True), arrival_time=r.arrival_s, priority=r.priority *
                pol.uses_priority, user=r.user, slo_ttft=slo[0], slo_tpot=slo[1]), r)
            sched.add(seqs[f"sim-{i}"][0])
        if not sched.has_unfinished():
            t = pending[-1][1].arrival_s
            continue
        out = sched.schedule()
        copied = sum(len(d) for d, _ in out.swap_out + out.swap_in)
        swapped += copied
        dt = cost_model.cost(*step_features(out, sched.num_running, config), copied * config.block_size) \
            if out.scheduled else 0.0
        start, t = t, t + dt
        outcome = sched.update(out, [NOT_EOS] * len(out.scheduled))
        sampled, released = outcome.accepted, outcome.finished
        stats.record_step(out, sampled, released, start, t, config)
        for rid in sampled:
            token_times.setdefault(rid, []).append(t)
        for reason, n in sched.waiting_by_reason().items():
            wait_area[reason] += n * dt
            wait_max[reason] = max(wait_max[reason], n)
        if record_trace and (out.scheduled or out.preempted):  # as LLMEngine: every preemption shows
            trace.append(StepTrace.of(stats.num_steps, out, sampled, released, sched.num_running, sched.num_waiting))
        if not out.scheduled and not released:
            assert pending, "the scheduler made no progress with nothing left to arrive"
            t = max(t, pending[-1][1].arrival_s)
    per_request = [record(r, seq, r.arrival_s, seq.first_scheduled_time, token_times[rid], seq.finished_time)
                   for rid, (seq, r) in seqs.items()]
    makespan = t - min((r.arrival_s for r in workload), default=0.0)
    return SimResult(makespan, stats.generation_tokens, stats.num_steps, stats.num_preemptions,
                     stats.slot_utilization, {k: v / makespan if makespan else 0.0 for k, v in wait_area.items()},
                     wait_max, per_request, trace, stats.recomputed_tokens, swapped,
                     stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1))


def record(r: SimRequest, seq: Sequence, arrived: float, scheduled: float, tokens: list[float], done: float
           ) -> dict[str, Any]:
    """One request's figures, from the times (on one clock) it arrived, was first scheduled,
    got each token, finished; slo_met: whether it met its targets (None: it has none). A target
    the request leaves unset is the --slo-ttft-ms/--slo-tpot-ms default the scheduler gave
    its sequence (under the slo policy), the target that policy worked to."""
    ttft, n = tokens[0] - arrived, len(tokens)
    tpot = (tokens[-1] - tokens[0]) / (n - 1) if n > 1 else 0.0
    want = [x if x is not None else y for x, y in ((r.slo_ttft_s, seq.slo_ttft), (r.slo_tpot_s, seq.slo_tpot))]
    met = None if want == [None, None] else ttft <= (want[0] or math.inf) and tpot <= (want[1] or math.inf)
    return {"class": r.cls, "priority": r.priority, "user": r.user, "arrival_s": r.arrival_s, "slo_met": met,
            "queue_s": scheduled - arrived, "ttft_s": ttft, "e2e_s": done - arrived, "tpot_s": tpot,
            "itl_s": [b - a for a, b in zip(tokens, tokens[1:])], "tokens": seq.num_output_tokens,
            "preemptions": seq.num_preemptions}


def build_engine(model: str, config_kw: dict[str, Any], log: Callable[[str], None] = lambda s: None):
    """The real engine, synchronous as the simulator (async scheduling shifts boarding by a
    step and overlaps steps, which the cost model does not model)."""
    from engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, **{"async_scheduling": False, **config_kw}), log=log)


CLOCKS = ("wall", "cpu")


def run_engine(engine, workload: list[SimRequest], tag: str,
               on_step: Callable[[tuple[str, int, int, int], dict[str, float]], None] | None = None
               ) -> dict[str, SimResult]:
    """Run `workload` on the real engine (arrivals by wall clock), timed by two clocks at once: "wall" and
    "cpu" (this process's CPU time plus its idle waits for arrivals: what a quiet machine's wall clock would
    show; a request arrives on it when added, less the wall time the running step kept it waiting).
    on_step(features, {clock: seconds}) sees every step that ran."""
    sched, cfg, inner = engine.scheduler, engine.config, engine.scheduler.schedule
    pending = sorted(enumerate(workload), key=lambda p: (p[1].arrival_s, p[0]))[::-1]
    feats: list[tuple[str, int, int, int] | None] = []
    idle = [0.0]
    clocks = {"wall": time.monotonic, "cpu": lambda: time.process_time() + idle[0]}
    t0 = {k: c() for k, c in clocks.items()}
    seqs: dict[str, tuple[Sequence, SimRequest]] = {}
    times: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in clocks}  # clock -> rid -> scheduled/tokens/done

    def schedule():  # the step's features, read as schedule() returns it
        out = inner()
        feats.append(step_features(out, sched.num_running, cfg) if out.scheduled else None)
        for k, c in clocks.items():
            for x in out.scheduled:
                times[k][x.seq.request_id].setdefault("scheduled", c() - t0[k])
        return out

    sched.schedule, before = schedule, engine.stats.snapshot()  # an instance attribute, removed below
    try:
        while pending or engine.has_unfinished():
            now = time.monotonic() - t0["wall"]
            while pending and pending[-1][1].arrival_s <= now:
                i, r = pending.pop()
                late = time.monotonic() - t0["wall"] - r.arrival_s
                times["wall"][f"{tag}-{i}"] = {"tokens": [], "arrived": r.arrival_s}
                times["cpu"][f"{tag}-{i}"] = {"tokens": [], "arrived": max(0.0, clocks["cpu"]() - t0["cpu"] - late)}
                seq = engine.add_request(f"{tag}-{i}", r.prompt_token_ids, SamplingParams(
                    max_tokens=r.max_tokens, ignore_eos=True), arrival_time=t0["wall"] + r.arrival_s,
                    **request_kw(r, sched.policy))
                seqs[seq.request_id] = (seq, r)
            if not engine.has_unfinished():
                waited = time.monotonic()
                time.sleep(max(0.0, min(0.01, pending[-1][1].arrival_s - now)))
                idle[0] += time.monotonic() - waited
                continue
            s0 = {k: c() for k, c in clocks.items()}
            deltas = engine.step()
            s1 = {k: c() - t0[k] for k, c in clocks.items()}
            if on_step is not None and feats[-1] is not None:
                on_step(feats[-1], {k: s1[k] + t0[k] - s0[k] for k in clocks})
            for k, d in itertools.product(clocks, deltas):
                rec = times[k][d.request_id]
                rec["tokens"] += [s1[k]] * bool(d.new_token_ids)
                rec["done"] = s1[k] if d.finished else rec.get("done")
    finally:
        del sched.schedule
    end, after = {k: c() - t0[k] for k, c in clocks.items()}, engine.stats.snapshot()
    for rid, (seq, r) in seqs.items():
        assert seq.num_output_tokens == r.max_tokens, f"{rid} made {seq.num_output_tokens} of {r.max_tokens} tokens"
    d = {k: getattr(after, k) - getattr(before, k) for k in ("generation_tokens", "num_steps", "num_preemptions",
         "useful_slot_steps", "total_slot_steps", "recomputed_tokens", "swapped_out_blocks", "swapped_in_blocks",
         "prefix_cache_hits", "prefix_cache_queries")}
    return {k: SimResult(end[k], d["generation_tokens"], d["num_steps"], d["num_preemptions"],
                         d["useful_slot_steps"] / max(d["total_slot_steps"], 1), waiting_mean={}, waiting_max={},
                         per_request=[record(r, seq, **times[k][rid]) for rid, (seq, r) in seqs.items()],
                         recomputed_tokens=d["recomputed_tokens"],
                         swapped_blocks=d["swapped_out_blocks"] + d["swapped_in_blocks"],
                         prefix_cache_hit_rate=d["prefix_cache_hits"] / max(d["prefix_cache_queries"], 1))
            for k in clocks}


def request_kw(r: SimRequest, policy: Any) -> dict[str, Any]:
    """The request's priority, client and SLO as add_request takes them, each only to a
    policy that reads it (the others refuse them; the SLO is still what goodput is scored on)."""
    ms = [None if x is None else 1e3 * x for x in (r.slo_ttft_s, r.slo_tpot_s)]
    kw = {"priority": r.priority if policy.uses_priority else 0, "user": r.user,
          "slo": SLOTarget(*ms) if policy.uses_slo and ms != [None, None] else None}
    return {k: v for k, v in kw.items() if v}


def calibrate(engine, s: "Sizes") -> dict[str, CostModel]:
    """Fit the cost model to every step of one run on the real engine, one model per clock (see
    run_engine): 3 x max_num_seqs requests at t=0, exponential output lengths, wide prompts (a
    few large prefill steps, then small ones of many sizes as seats free, then every decode bucket)."""
    prompt_len, mean, cap = s.calib
    work = [SimRequest(0.0, r.prompt_token_ids, r.max_tokens) for r in exponential_mix(
        3 * s.max_num_seqs, s.vocab_size, mean=mean, cap=cap, prompt_len=prompt_len, seed=7)]
    samples: dict[str, list[tuple[str, int, int, int, float]]] = {k: [] for k in CLOCKS}
    seen: set[tuple[str, int]] = set()

    def on_step(f: tuple[str, int, int, int], seconds: dict[str, float]) -> None:
        # The first run of each compiled shape pays one-off costs (buffer allocation, first dispatch).
        for k, v in seconds.items() if f[:2] in seen else ():
            samples[k].append((*f, v))
        seen.add(f[:2])

    run_engine(engine, work, "calib", on_step=on_step)
    swap = measure_swap(engine) if engine.runner.num_swap_blocks else {"coef": (0.0, 0.0)}
    source = f"calibrated on {s.model}, {os.uname().nodename}"
    return {k: fit_cost_model(v, f"{source} ({k} clock)", swap) for k, v in samples.items()}


def measure_swap(engine, reps: int = 9) -> dict[str, Any]:
    """This machine's host<->device copy bandwidth (a 64 MiB array each way), and the fixed cost of a
    step's copies: the runner's swap of one block out and back (the engine idle), beyond its bytes."""
    import jax
    import numpy as np

    def best_s(fn: Callable[[], Any]) -> float:
        return timer(lambda: jax.block_until_ready(fn()), reps)

    host = np.ones(16 << 20, np.float32)
    dev = jax.device_put(host)
    bandwidth = 2 * host.nbytes / (best_s(lambda: jax.device_put(host)) + best_s(lambda: np.array(dev, copy=True)))
    runner, bs = engine.runner, engine.config.block_size
    assert not engine.has_unfinished() and runner.num_swap_blocks >= 1
    token_bytes = sum(x.nbytes // x.shape[1] for x in jax.tree.leaves(runner.kv_caches)) / bs
    one = best_s(lambda: (runner.swap([([1], [0])], [([1], [0])]), runner.kv_caches)[1])
    return {"coef": (max(0.0, one - 2 * bs * token_bytes / bandwidth), token_bytes / bandwidth),
            "bandwidth_bytes_s": bandwidth, "kv_bytes_per_token": token_bytes, "one_block_out_and_in_s": one}


# The validation's and calibration's sizes: tight_kv_seqs: the tight-KV cases' blocks, in max_model_len
# sequences; calib: the calibration's (prompt lengths, mean and cap of its outputs).
Sizes = NamedTuple("Sizes", [("model", str), ("vocab_size", int), ("num_requests", int), ("short", int),
                             ("long", int), ("prompt_len", tuple[int, int]), ("max_num_seqs", int),
                             ("max_model_len", int), ("tight_kv_seqs", int), ("calib", tuple[tuple[int, int], float, int])])


FULL = Sizes("bench", 32000, 100, 16, 512, (32, 256), 32, 1024, 6, ((16, 512), 48, 384))
TINY = Sizes("tiny", 512, 12, 4, 24, (8, 24), 4, 64, 1, ((4, 16), 16, 40))  # calibrates decode-only steps too


def kv_blocks(s: Sizes, kv_seqs: float) -> int:
    return int(kv_seqs * math.ceil(s.max_model_len / 16)) + 1


def build_sized(s: Sizes, log: Callable[[str], None] = lambda s: None):
    """The engine of the validation and calibration: KV arrays for the ample budget (a tight case's scheduler
    gets fewer blocks; a step's cost follows the context, not the array) and a host swap pool; without
    chunked prefill, as the simulator's runs default to and docs/SIMULATION.md's figures were measured."""
    return build_engine(s.model, dict(max_num_seqs=s.max_num_seqs, max_model_len=s.max_model_len, block_size=16,
                                      dtype="float32", num_kv_blocks=kv_blocks(s, s.max_num_seqs),
                                      enable_chunked_prefill=False, preemption_mode="swap", swap_space=0.25), log)


def validate(s: Sizes, out_dir: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The real engine and the simulator on the same workloads (`cases`), the cost model fitted to a
    calibration run first; each case measured by both clocks, "wall" the headline, "cpu" beside it."""
    mix, clients = (synthetic(k, s.num_requests, s.vocab_size, short=s.short, long=s.long, prompt_len=s.prompt_len)
                    for k in ("short-long", "two-clients"))
    full, tight = kv_blocks(s, s.max_num_seqs), kv_blocks(s, s.tight_kv_seqs)
    cases = [("short-long-continuous", mix, full, {}), ("short-long-tight-kv", mix, tight, {}),
             ("short-long-tight-kv-swap", mix, tight, {"preemption_mode": "swap"}),
             ("short-long-static", mix, full, {"scheduling": "static"}),
             ("two-clients-fair", clients, full, {"scheduling_policy": "fair"})]
    rep: dict[str, Any] = {"sizes": s._asdict(), "loadavg_before": os.getloadavg(), "cores": os.cpu_count(), "cases": []}
    t0 = time.perf_counter()
    log("[validate] building the engine, calibrating the cost model on it ...")
    engine = build_sized(s)
    engine.scheduler = fresh_scheduler(engine, full)
    cost_models = calibrate(engine, s)
    rep["cost_models"] = {k: {"coef": v.coef, "fit": v.fit, "swap": v.swap} for k, v in cost_models.items()}
    for k, cm in cost_models.items():
        cm.save(os.path.join(out_dir, f"cost_model_{k}.json"))
    for name, work, blocks, kw in cases:
        kw = {"scheduling": "continuous", "scheduling_policy": "fcfs", "preemption_mode": "recompute"} | kw
        engine.scheduler = fresh_scheduler(engine, blocks, **kw)
        measured, cls = run_engine(engine, work, name), "light" if work is clients else "short"
        row: dict[str, Any] = {"case": name, "num_kv_blocks": blocks, **kw, "loadavg": os.getloadavg()}
        for clock in CLOCKS:
            m = measured[clock]
            p = simulate(engine.config, blocks, work, cost_models[clock], num_swap_blocks=engine.runner.num_swap_blocks)
            fig = {f"{w}_{k}": getattr(x, k) for w, x in (("measured", m), ("predicted", p))
                   for k in ("tok_s", "steps", "preemptions", "recomputed_tokens", "swapped_blocks",
                             "prefix_cache_hit_rate")}
            fig |= {f"{w}_{cls}_p99_s": x.latency(cls)["p99"] for w, x in (("measured", m), ("predicted", p))}
            fig["tok_s_err"] = fig["predicted_tok_s"] / fig["measured_tok_s"] - 1
            fig["p99_err"] = fig[f"predicted_{cls}_p99_s"] / fig[f"measured_{cls}_p99_s"] - 1
            fig["within_15pct"] = abs(fig["tok_s_err"]) <= 0.15 and abs(fig["p99_err"]) <= 0.15
            row |= fig if clock == "wall" else {f"{clock}_clock": fig}
            log(f"[validate] {name} ({clock} clock): tok/s {m.tok_s:.1f} measured, {p.tok_s:.1f} predicted "
                f"({100 * fig['tok_s_err']:+.1f}%); {cls} p99 {100 * fig['p99_err']:+.1f}%; steps {m.steps} / "
                f"{p.steps}; preemptions {m.preemptions} / {p.preemptions}; swapped blocks {m.swapped_blocks} / "
                f"{p.swapped_blocks}")
        rep["cases"].append(row)
        write_json(os.path.join(out_dir, "validation.json"),
                   rep | {"wall_s": time.perf_counter() - t0, "loadavg_after": os.getloadavg()})
    return rep


def fresh_scheduler(engine, num_kv_blocks: int, **config: Any) -> Scheduler:
    """A new scheduler on the same engine (compiled programs, KV arrays, host swap pool) with
    num_kv_blocks (at most the arrays') and `config` changed (scheduling, policy, preemption)."""
    assert not engine.has_unfinished() and num_kv_blocks <= engine.num_kv_blocks
    engine.config = engine.runner.config = dataclasses.replace(engine.config, **config)
    return Scheduler(engine.config, num_kv_blocks, engine.model_config.eos_token_ids,
                     num_swap_blocks=engine.runner.num_swap_blocks)


REPORT_SEQS = (8, 16, 32, 64, 128, 256)
REPORT_KV = (("tight", 0.25), ("half", 0.5), ("ample", 1.0))  # KV budget: this fraction of max_num_seqs x max_model_len


def report(cost_models: dict[str, CostModel], out_dir: str, seqs: tuple[int, ...] = REPORT_SEQS,
           log: Callable[[str], None] = print, max_model_len: int = 1024) -> None:
    """continuous/static tokens/s and short-request p99 per max_num_seqs, KV budget and cost model, on the
    short/long mix scaled to the slots, all at t=0, without chunked prefill (docs/SIMULATION.md's setup)."""
    rows, per_seq = [], math.ceil(max_model_len / 16)
    for (cm_name, cm), n, (kv_name, frac) in itertools.product(cost_models.items(), seqs, REPORT_KV):
        r = {"cost_model": cm_name, "max_num_seqs": n, "kv": kv_name, "num_kv_blocks": max(int(frac * n), 1) * per_seq + 1}
        for sched in ("continuous", "static"):
            cfg = EngineConfig(max_num_seqs=n, max_model_len=max_model_len, scheduling=sched,
                               enable_chunked_prefill=False).resolved(max_model_len)
            res = simulate(cfg, r["num_kv_blocks"], synthetic("short-long", max(100, 2 * n), 32000), cm)
            r[sched] = {"tok_s": res.tok_s, "short_p99_s": res.latency("short")["p99"],
                        "preemptions": res.preemptions, "slot_utilization": res.slot_utilization}
        c, st = r["continuous"], r["static"]
        r["tok_s_ratio"], r["short_p99_ratio"] = c["tok_s"] / st["tok_s"], st["short_p99_s"] / c["short_p99_s"]
        log(f"[report] {cm_name:>12} seqs {n:>3} kv {kv_name:>5}: tok/s x{r['tok_s_ratio']:.2f}, "
            f"short p99 /{r['short_p99_ratio']:.1f}")
        rows.append(r)
    fig, axes = pyplot().subplots(2, len(cost_models), figsize=(5.5 * len(cost_models), 7), squeeze=False)
    panels = (("tok_s_ratio", "output tok/s, continuous / static"), ("short_p99_ratio", "short p99 e2e, static / continuous"))
    for (j, cm), (kv_name, _), (i, (key, title)) in itertools.product(enumerate(cost_models), REPORT_KV, enumerate(panels)):
        rs = [r for r in rows if r["cost_model"] == cm and r["kv"] == kv_name]
        axes[i][j].plot([r["max_num_seqs"] for r in rs], [r[key] for r in rs], marker="o", label=f"KV {kv_name}")
        axes[i][j].set(xscale="log", xlabel="max_num_seqs", title=f"{cm}: {title}")
        axes[i][j].legend()
    save_figure(fig, os.path.join(out_dir, "simulate_scales.png"), dpi=90)
    table = md_table([["cost model", "max_num_seqs", "KV budget (blocks)", "continuous tok/s", "static tok/s", "ratio",
                       "short p99 cont. (s)", "short p99 static (s)", "ratio", "preemptions cont./static"]] + [
        [r["cost_model"], str(r["max_num_seqs"]), f"{r['kv']} ({r['num_kv_blocks']})", f"{c['tok_s']:.0f}",
         f"{st['tok_s']:.0f}", f"{r['tok_s_ratio']:.2f}", f"{c['short_p99_s']:.2f}", f"{st['short_p99_s']:.2f}",
         f"{r['short_p99_ratio']:.1f}", f"{c['preemptions']}/{st['preemptions']}"]
        for r in rows for c, st in [(r["continuous"], r["static"])]])
    models = "\n".join(f"- **{k}**: {v.source}; per step (a, b, c, d) = " + "; ".join(
        f"{p} ({', '.join(f'{x:.3g}' for x in v.coef[p])})" for p in PROGRAMS) for k, v in cost_models.items())
    write_text(os.path.join(out_dir, "simulate_report.md"), f"Cost models:\n\n{models}\n\n{table}\n")
    write_json(os.path.join(out_dir, "simulate_report.json"), {
        "rows": rows, "cost_models": {k: {"coef": v.coef, "source": v.source} for k, v in cost_models.items()}})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, what in (("tiny", "the tiny model and a handful of requests (seconds)"),
                       ("validate", "real engine vs simulator: writes validation.json"),
                       ("calibrate", "fit the cost model on this machine and save it"),
                       ("report", "continuous vs static batching at max_num_seqs 8..256"),
                       ("enable-chunked-prefill", None)):
        p.add_argument(f"--{flag}", action="store_true", help=what)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's (on by default, vLLM V1's): requests that share a prompt prefix "
                        "(prompt_token_ids in a --workload JSON, a request's n samples) reuse its KV blocks")
    for flag, kind, default, what in (
            ("report-seqs", positive_ints, list(REPORT_SEQS), None),
            ("cost-model", str, None, f"a cost-model JSON (default {os.path.relpath(DEFAULT_COST_MODEL)}) or gpu-like"),
            ("out", str, None, "output directory (default bench/results/simulate-<time>)"),
            ("workload", str, "short-long",
             "short-long (the short/long mix) | exp | slo-mix | two-clients | a JSON file (see the docstring)"),
            ("num-requests", positive, None, None),
            ("rate", positive_float, None, "arrivals per second (synthetic workloads)"),
            ("priority-fraction", checked(float, lambda x: 0 <= x <= 1, "a fraction in [0, 1]"), 0.0,
             "this fraction of requests (every k-th) gets priority -1, the rest 0"),
            ("max-num-seqs", positive, None, None), ("max-model-len", positive, None, None),
            ("num-kv-blocks", checked(int, lambda x: x >= 2, "an integer >= 2 (block 0 is the null block)"), None, None),
            ("max-num-batched-tokens", positive, None, None), ("block-size", positive, 16, None),
            ("scheduling", str, "continuous", None), ("scheduling-policy", str, "fcfs", None),
            ("kv-admission", str, "on-demand", None), ("preemption-mode", str, "recompute", None),
            ("num-swap-blocks", natural, 1 << 20, "the host pool under --preemption-mode swap, in KV blocks"),
            ("slo-ttft-ms", positive_float, None, None), ("slo-tpot-ms", positive_float, None, None)):
        p.add_argument(f"--{flag}", type=kind, default=default, help=what)
    args = p.parse_args(argv)
    if args.validate + args.calibrate + args.report > 1:
        p.error("--validate, --calibrate and --report are three runs: give one")
    # Each of the three runs has its own fixed workloads and engines: a flag it does not read is refused.
    run = next((r for r in RUN_READS if getattr(args, r)), None)
    reads = RUN_READS.get(run, set(vars(args)) - {"report_seqs"})
    if ignored := [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
                   if k not in reads and k not in RUN_READS and v != p.get_default(k)]:
        p.error(f"{' '.join(ignored)}: not read by {f'--{run}' if run else 'a simulation run (only by --report)'}")
    if args.workload not in SYNTHETIC and not os.path.isfile(args.workload):
        p.error(f"--workload takes {', '.join(SYNTHETIC)} or a JSON file, got {args.workload!r}")
    if args.workload not in SYNTHETIC and (given := [f for f in ("rate", "num_requests") if getattr(args, f)]):
        p.error(f"{' '.join('--' + f.replace('_', '-') for f in given)}: not read with a --workload file "
                "(its requests carry their own arrivals and count; only synthetic workloads take them)")
    sizes = TINY if args.tiny else FULL
    out_dir = args.out or results_dir(time.strftime("simulate-%Y%m%d-%H%M%S"))
    if args.validate:
        ok = all(c["within_15pct"] for c in validate(sizes, out_dir)["cases"])
        print(f"validation: {'every case within 15%' if ok else 'MISSED 15% on some case'}; {out_dir}/validation.json")
        return 0
    if args.calibrate:
        cm = calibrate(build_sized(sizes, print), sizes)
        path = args.cost_model or DEFAULT_COST_MODEL
        cm["wall"].save(path)  # the wall clock's: what a run on this machine, alone, takes
        cm["cpu"].save(path.replace(".json", "_cpu.json"))
        print(f"cost model -> {path}: {cm['wall'].coef}, swap {cm['wall'].swap}\nfit: {cm['wall'].fit}")
        return 0
    try:
        cm = load_cost_model(args.cost_model)
    except ValueError as e:
        p.error(str(e))
    try:
        work = None if args.workload in SYNTHETIC else load_workload(args.workload, sizes.vocab_size)
    except ValueError as e:
        p.error(f"--workload {e}")
    if args.report:
        os.makedirs(out_dir, exist_ok=True)
        report({"this machine": cm, "GPU-like": GPU_LIKE}, out_dir, tuple(args.report_seqs))
        return 0
    work = synthetic(args.workload, args.num_requests or sizes.num_requests, sizes.vocab_size, short=sizes.short,
                     long=sizes.long, prompt_len=sizes.prompt_len, rate=args.rate) if work is None else work
    k = max(1, round(1 / args.priority_fraction)) if args.priority_fraction else 0
    for i, r in enumerate(work):
        r.priority = -1 if k and i % k == 0 else r.priority
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in work)
    if longest > (mml := args.max_model_len or max(sizes.max_model_len, longest)):
        p.error(f"--max-model-len {mml} cannot hold the workload's longest request ({longest} tokens)")
    kw: dict[str, Any] = {f: getattr(args, f) for f in (
        "max_num_seqs", "block_size", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
        "scheduling", "scheduling_policy", "kv_admission", "preemption_mode", "slo_ttft_ms", "slo_tpot_ms")} | {
        "max_model_len": mml}
    kw["max_num_seqs"] = kw["max_num_seqs"] or sizes.max_num_seqs
    try:
        cfg = EngineConfig(**kw).resolved(mml)  # validates every field, as the engine's flags are
    except ValueError as e:
        p.error(str(e))
    blocks = args.num_kv_blocks or cfg.max_num_seqs * cfg.max_blocks_per_seq + 1
    if (blocks - 1) * cfg.block_size < longest:
        p.error(f"--num-kv-blocks {blocks} (one the null block) cannot hold the longest request ({longest} tokens)")
    admission = Scheduler(cfg, blocks, eos_token_ids=())  # its own check, as the engine refuses a request
    for i, r in enumerate(work):  # (reserve-max-len: every request holds max_model_len's blocks, however short)
        try:
            admission.validate(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True), 0, None)
        except ValueError as e:
            p.error(f"--num-kv-blocks {blocks} (one the null block), --kv-admission {cfg.kv_admission}: request {i}: {e}")
    t0 = time.process_time()
    res = simulate(cfg, blocks, work, cm, num_swap_blocks=args.num_swap_blocks)
    summary = res.summary()
    s = write_json(os.path.join(out_dir, "simulate.json"), summary | {
        "cpu_s": time.process_time() - t0, "config": kw, "num_kv_blocks": blocks, "cost_model": cm.source})
    print(f"{len(work)} requests, {res.steps} steps, {res.preemptions} preemptions ({res.recomputed_tokens} tokens "
          f"recomputed, {res.swapped_blocks} blocks swapped), {res.tok_s:.1f} output tok/s, goodput {res.goodput}, "
          f"slot utilisation {res.slot_utilization:.2f}; waiting (time-weighted mean / max): " + ", ".join(
              f"{k} {res.waiting_mean[k]:.1f}/{res.waiting_max[k]}" for k in wait_reasons()) + f"; {s}")
    for c, lat in summary["per_class"].items():
        print(f"  {c:>6}: " + "  ".join(f"{k[:-2]} p50 {v.get('p50', math.nan):.3f} p99 {v.get('p99', math.nan):.3f}"
                                         for k, v in lat.items()))
    return 0


def load_cost_model(arg: str | None) -> CostModel:
    if arg == "gpu-like":
        return GPU_LIKE
    if not os.path.exists(path := arg or DEFAULT_COST_MODEL):
        raise SystemExit(f"no cost model at {path}: run `python bench/simulate.py --calibrate` first "
                         "(or pass --cost-model gpu-like)")
    return CostModel.load(path)


if __name__ == "__main__":
    sys.exit(main())
