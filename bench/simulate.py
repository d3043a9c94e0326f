"""The simulator: what would the scheduler do, and how long would it take, at scales this
machine cannot run? A workload through the real Scheduler, without the model, in seconds of CPU.

    python bench/simulate.py                                    # the seed's mix, this machine's cost model
    python bench/simulate.py --scheduling static --max-num-seqs 64 --num-kv-blocks 600
    python bench/simulate.py --workload exp --scheduling-policy priority
    python bench/simulate.py --workload bench/results/X/results.json   # a request log bench/mixed.py recorded
    python bench/simulate.py --calibrate                        # fit the cost model on this machine, save it
    python bench/simulate.py --validate                         # real engine vs simulator -> validation.json
    python bench/simulate.py --report                           # the seed's question at 8..256 slots

Each step is the engine's: `Scheduler.schedule()` decides it, the cost model says how long it
takes, `Scheduler.update()` records it (every sampled token is a non-EOS token: the benches run
ignore_eos) and `EngineStats.record_step` counts it on the simulated clock. Only the model's
time is modelled, for the synchronous loop (async scheduling's overlap is not):

    cost(step) = a + b * rows + c * context_tokens_read + d * prefill_tokens

rows: the token rows the step program computes (runner.py's padded buckets); context: the KV
every scheduled sequence attends over; one coefficient set per program (decode, ragged),
fitted by non-negative least squares to a calibration run of the real engine and saved as
JSON (--cost-model reads one back). `GPU_LIKE` is written down, not measured.

Workloads (--workload): `seed`, `exp`, or a JSON file: a list of {"arrival_s", "prompt_len"
(or "prompt_token_ids"), "max_tokens", optional "priority", "class"}, or bench/mixed.py's
results.json. --rate spreads the synthetic ones as a Poisson process. docs/SIMULATION.md
has the validation and the report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root first: its modules win over bench/structured.py

from report import md_table, pyplot, results_dir, save_figure, summarize, write_json  # noqa: E402
from workload import arrival_times, exponential_mix, seed_mix  # noqa: E402
from config import EngineConfig, SamplingParams  # noqa: E402
from metrics import WAIT_REASONS, EngineStats, StepTrace  # noqa: E402
from scheduler import Scheduler, SchedulerOutput, Sequence  # noqa: E402

NOT_EOS = 7  # the token every simulated step samples: any id that is not an EOS
PROGRAMS = ("decode", "ragged")
DEFAULT_COST_MODEL = results_dir("cost_model.json")


# ---- workload --------------------------------------------------------------------------

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
              prompt_len: tuple[int, int] = (32, 256), rate: float | None = None, seed: int = 0) -> list[SimRequest]:
    """The benches' workloads (bench/workload.py), all at t=0 or as a Poisson process."""
    if kind == "seed":
        reqs = seed_mix(num_requests, vocab_size, short=short, long=long, prompt_len=prompt_len, seed=seed)
        classes = ["short" if r.max_tokens == short else "long" for r in reqs]
    elif kind == "exp":
        reqs = exponential_mix(num_requests, vocab_size, prompt_len=prompt_len, seed=seed)
        classes = ["all"] * len(reqs)
    else:
        raise ValueError(f"unknown workload {kind!r}: seed, exp or a JSON file")
    return [SimRequest(t, r.prompt_token_ids, r.max_tokens, cls=c)
            for r, c, t in zip(reqs, classes, arrival_times(len(reqs), rate, seed))]


def load_workload(path: str, vocab_size: int = 32000) -> list[SimRequest]:
    """A JSON list of requests, or bench/mixed.py's results.json (its first variant's log
    unless the file is one variant's summary). Prompts given by length get distinct
    random ids (no shared prefix)."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):
        if "per_request" not in data:
            variants = data.get("variants", data)
            data = next(v for v in variants.values() if isinstance(v, dict) and "per_request" in v)
        data = data["per_request"]
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty list of requests")
    rng, out = random.Random(0), []
    for i, r in enumerate(data):
        ids = r.get("prompt_token_ids") or [rng.randrange(vocab_size) for _ in range(int(r["prompt_len"]))]
        arrival = float(r.get("arrival_s", r.get("start", 0.0)))
        out.append(SimRequest(arrival, list(ids), int(r["max_tokens"]), int(r.get("priority", 0)),
                              str(r.get("class", r.get("cls", "all")))))
    t0 = min(r.arrival_s for r in out)
    for r in out:
        r.arrival_s -= t0
    return out


# ---- the step-cost model ---------------------------------------------------------------

def _bucket(buckets: tuple[int, ...], n: int) -> int:
    return next(b for b in buckets if b >= n)


def step_features(out: SchedulerOutput, num_occupied: int, config: EngineConfig) -> tuple[str, int, int, int]:
    """(program, rows, context_tokens_read, prefill_tokens) of a step, read after
    schedule() (which advanced each sequence past its tokens): runner.execute's shapes."""
    if out.is_decode_only:
        program, rows = "decode", _bucket(config.decode_buckets, max(num_occupied, len(out.scheduled)))
    else:
        program, rows = "ragged", _bucket(config.token_buckets, sum(s.num_new_tokens for s in out.scheduled))
    context = sum(s.seq.num_computed_tokens for s in out.scheduled)
    return program, rows, context, out.num_prefill_tokens


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
        copy = self.swap[0] + self.swap[1] * swapped_tokens if swapped_tokens else 0.0
        return a + b * rows + c * context + d * prefill + copy

    def save(self, path: str) -> None:
        write_json(path, {"coef": {k: dict(zip("abcd", v)) for k, v in self.coef.items()}, "source": self.source,
                          "fit": self.fit, "swap": list(self.swap)})

    @classmethod
    def load(cls, path: str) -> "CostModel":
        with open(path) as f:
            d = json.load(f)
        coef = {k: tuple(float(v[x]) for x in "abcd") for k, v in d["coef"].items()}
        missing = set(PROGRAMS) - coef.keys()
        if missing:
            raise ValueError(f"{path}: no coefficients for {sorted(missing)}")
        return cls(coef, d.get("source", path), d.get("fit", {}), tuple(d.get("swap", (0.0, 0.0))))


# Llama-3-8B in bf16 on one H200, by the roofline (written down, not measured): every step
# reads the 16.1 GB of weights at ~80% of 4.8 TB/s (4.2 ms), each context token's K/V
# (128 KiB) at the same rate (27 ns), and each prompt token costs its 16 GFLOP at ~60%
# of 989 TFLOP/s (27 us). Flat in rows: a decode step of 256 rows costs what one of 8
# does (true up to a few hundred rows, where decode turns compute-bound). A swap copies
# each token's 128 KiB over PCIe Gen5 x16 at the ~50 GB/s a pinned copy achieves of its
# 64 GB/s (2.6 us a token, 10x less than recomputing it), after ~20 us of launch.
GPU_KV_TOKEN_BYTES, GPU_LINK_BYTES_S = 131072, 50e9
_GPU_A, _GPU_C, _GPU_D = 16.06e9 / (0.8 * 4.8e12), GPU_KV_TOKEN_BYTES / (0.8 * 4.8e12), 16.06e9 / (0.6 * 989e12)
GPU_LIKE = CostModel({p: (_GPU_A, 0.0, _GPU_C, _GPU_D) for p in PROGRAMS},
                     "GPU-like (weight-bound roofline: Llama-3-8B bf16 on H200, PCIe Gen5 swap; written down)",
                     swap=(20e-6, GPU_KV_TOKEN_BYTES / GPU_LINK_BYTES_S))
UNIT_STEPS = CostModel({p: (1.0, 0.0, 0.0, 0.0) for p in PROGRAMS}, "one unit per step (time = step count)")


def fit_cost_model(samples: list[tuple[str, int, int, int, float]], source: str) -> CostModel:
    """Non-negative least squares per program over (program, rows, context, prefill, seconds)."""
    import numpy as np
    from scipy.optimize import nnls

    coef, fit = {}, {}
    for program in PROGRAMS:
        rows = [s for s in samples if s[0] == program]
        if len(rows) < 4:
            raise ValueError(f"calibration ran {len(rows)} {program} steps; need at least 4")
        X = np.array([[1.0, r, c, p] for _, r, c, p, _ in rows])
        y = np.array([t for *_, t in rows])
        x, _ = nnls(X, y)
        pred = X @ x
        coef[program] = tuple(float(v) for v in x)
        fit[program] = {"steps": len(rows), "seconds": float(y.sum()), "predicted_seconds": float(pred.sum()),
                        "median_abs_rel_err": float(np.median(np.abs(pred - y) / y))}
    return CostModel(coef, source, fit)


# ---- the simulation --------------------------------------------------------------------

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

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else float("inf")

    def latency(self, cls: str | None = None, key: str = "e2e_s") -> dict[str, float]:
        rs = [r for r in self.per_request if cls is None or r["class"] == cls]
        if key == "itl_s":
            return summarize([x for r in rs for x in r["itl_s"]])
        return summarize([r[key] for r in rs])

    def summary(self) -> dict[str, Any]:
        classes = sorted({r["class"] for r in self.per_request})
        return {"tok_s": self.tok_s, "makespan_s": self.makespan_s, "output_tokens": self.output_tokens,
                "steps": self.steps, "preemptions": self.preemptions, "slot_utilization": self.slot_utilization,
                "recomputed_tokens": self.recomputed_tokens, "swapped_blocks": self.swapped_blocks,
                "waiting_mean": self.waiting_mean, "waiting_max": self.waiting_max,
                "per_class": {c: {k: self.latency(c, k) for k in ("ttft_s", "itl_s", "e2e_s", "queue_s")}
                              for c in classes},
                "per_priority": {p: {k: summarize([r[k] for r in self.per_request if r["priority"] == p])
                                     for k in ("ttft_s", "e2e_s", "queue_s")}
                                 for p in sorted({r["priority"] for r in self.per_request})}}


def simulate(config: EngineConfig, num_kv_blocks: int, workload: list[SimRequest], cost_model: CostModel,
             record_trace: bool = False, num_swap_blocks: int = 0) -> SimResult:
    """Replay `workload` through the real Scheduler with simulated time. `config` must be
    resolved (config.resolved(max_model_len)); num_swap_blocks: the host pool under
    --preemption-mode swap, each step's copies costed by cost_model.swap."""
    sched = Scheduler(config, num_kv_blocks, eos_token_ids=(), num_swap_blocks=num_swap_blocks)
    sched.policy.clock = lambda: t  # a policy that reads the time (slo) reads the simulated one
    stats = EngineStats()
    pending = sorted(enumerate(workload), key=lambda p: (p[1].arrival_s, p[0]))[::-1]  # pop() = next
    seqs: dict[str, tuple[Sequence, SimRequest]] = {}
    token_times: dict[str, list[float]] = {}
    wait_area = dict.fromkeys(WAIT_REASONS, 0.0)
    wait_max = dict.fromkeys(WAIT_REASONS, 0)
    trace: list[StepTrace] = []
    t, swapped = 0.0, 0
    while pending or sched.has_unfinished():
        while pending and pending[-1][1].arrival_s <= t:
            i, r = pending.pop()
            seq = Sequence(f"sim-{i}", r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                           arrival_time=r.arrival_s)
            seq.priority, seq.user, seq.slo_ttft, seq.slo_tpot = r.priority, r.user, r.slo_ttft_s, r.slo_tpot_s
            sched.add(seq)
            seqs[seq.request_id] = (seq, r)
        if not sched.has_unfinished():
            t = pending[-1][1].arrival_s
            continue
        out = sched.schedule()
        copied = sum(len(d) for d, _ in out.swap_out + out.swap_in)
        swapped += copied
        copied *= config.block_size
        dt = cost_model.cost(*step_features(out, sched.num_running, config), copied) if out.scheduled else 0.0
        start, t = t, t + dt
        outcome = sched.update(out, [NOT_EOS] * len(out.scheduled))
        sampled, released = outcome.accepted, outcome.finished
        stats.record_step(out, sampled, released, start, t, config)
        for rid in sampled:
            token_times.setdefault(rid, []).append(t)
        for reason, n in sched.waiting_by_reason().items():
            wait_area[reason] += n * dt
            wait_max[reason] = max(wait_max[reason], n)
        if record_trace and out.scheduled:
            trace.append(StepTrace.of(stats.num_steps, out, sampled, released, sched.num_running, sched.num_waiting))
        if not out.scheduled and not released:
            if not pending:
                raise RuntimeError("the scheduler made no progress with nothing left to arrive")
            t = max(t, pending[-1][1].arrival_s)
    per_request = []
    for rid, (seq, r) in seqs.items():
        times = token_times[rid]
        per_request.append({"class": r.cls, "priority": r.priority, "arrival_s": r.arrival_s,
                            "queue_s": seq.first_scheduled_time - r.arrival_s, "ttft_s": seq.first_token_time - r.arrival_s,
                            "e2e_s": seq.finished_time - r.arrival_s, "itl_s": [b - a for a, b in zip(times, times[1:])],
                            "tokens": seq.num_output_tokens, "preemptions": seq.num_preemptions})
    makespan = t - min((r.arrival_s for r in workload), default=0.0)
    return SimResult(makespan, stats.generation_tokens, stats.num_steps, stats.num_preemptions,
                     stats.slot_utilization, {k: v / makespan if makespan else 0.0 for k, v in wait_area.items()},
                     wait_max, per_request, trace, stats.recomputed_tokens, swapped)


# ---- the real engine: calibration and measurement ---------------------------------------

def build_engine(model: str, config_kw: dict[str, Any], log: Callable[[str], None] = lambda s: None):
    """The real engine, synchronous: the simulator replays the synchronous loop (one
    step's tokens known before the next is scheduled). Async scheduling shifts boarding
    by one step and overlaps steps, which the cost model does not model."""
    from engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, **{"async_scheduling": False, **config_kw}), log=log)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.monotonic, "cpu": time.process_time}


def run_engine(engine, workload: list[SimRequest], tag: str,
               on_step: Callable[[tuple[str, int, int, int], dict[str, float]], None] | None = None
               ) -> dict[str, SimResult]:
    """Run `workload` on the real engine (arrivals honoured by wall clock; at t=0 they all
    go in before the first step), timed by two clocks at once: "wall" and "cpu" (this
    process's CPU time, all threads: on a shared machine it moves only while the engine
    runs, so it is what a quiet machine's wall clock would show, up to the thread
    parallelism). on_step(features, {clock: seconds}) sees every step that ran."""
    sched, cfg = engine.scheduler, engine.config
    pending = sorted(enumerate(workload), key=lambda p: (p[1].arrival_s, p[0]))[::-1]
    feats: list[tuple[str, int, int, int] | None] = []
    inner = sched.schedule
    t0 = {k: c() for k, c in CLOCKS.items()}
    seqs: dict[str, tuple[Sequence, SimRequest]] = {}
    times: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in CLOCKS}  # clock -> rid -> queue/first/tokens/done

    def schedule():  # the step's features, read as schedule() returns it
        out = inner()
        feats.append(step_features(out, sched.num_running, cfg) if out.scheduled else None)
        for k, c in CLOCKS.items():
            for x in out.scheduled:
                times[k].setdefault(x.seq.request_id, {"tokens": []}).setdefault("queue", c() - t0[k])
        return out

    sched.schedule = schedule  # an instance attribute over the method, removed below
    before = engine.stats.snapshot()
    try:
        while pending or engine.has_unfinished():
            now = time.monotonic() - t0["wall"]
            while pending and pending[-1][1].arrival_s <= now:
                i, r = pending.pop()
                seq = engine.add_request(f"{tag}-{i}", r.prompt_token_ids,
                                         SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                                         arrival_time=t0["wall"] + r.arrival_s, **request_kw(r))
                seqs[seq.request_id] = (seq, r)
            if not engine.has_unfinished():
                time.sleep(max(0.0, min(0.01, pending[-1][1].arrival_s - now)))
                continue
            s0 = {k: c() for k, c in CLOCKS.items()}
            deltas = engine.step()
            s1 = {k: c() for k, c in CLOCKS.items()}
            if on_step is not None and feats[-1] is not None:
                on_step(feats[-1], {k: s1[k] - s0[k] for k in CLOCKS})
            for k in CLOCKS:
                for d in deltas:
                    rec = times[k].setdefault(d.request_id, {"tokens": []})
                    if d.new_token_ids:
                        rec["tokens"].append(s1[k] - t0[k])
                    if d.finished:
                        rec["done"] = s1[k] - t0[k]
    finally:
        del sched.schedule
    end = {k: c() - t0[k] for k, c in CLOCKS.items()}
    after = engine.stats.snapshot()
    steps = after.num_steps - before.num_steps
    useful = after.useful_slot_steps - before.useful_slot_steps
    total = after.total_slot_steps - before.total_slot_steps
    results = {}
    for k in CLOCKS:
        per_request = []
        for rid, (seq, r) in seqs.items():
            assert seq.num_output_tokens == r.max_tokens, f"{rid} made {seq.num_output_tokens} of {r.max_tokens} tokens"
            rec = times[k][rid]
            toks = rec["tokens"]
            per_request.append({"class": r.cls, "priority": r.priority, "arrival_s": r.arrival_s,
                                "queue_s": rec["queue"] - r.arrival_s, "ttft_s": toks[0] - r.arrival_s,
                                "e2e_s": rec["done"] - r.arrival_s, "itl_s": [b - a for a, b in zip(toks, toks[1:])],
                                "tokens": seq.num_output_tokens, "preemptions": seq.num_preemptions})
        results[k] = SimResult(end[k], after.generation_tokens - before.generation_tokens, steps,
                               after.num_preemptions - before.num_preemptions, useful / total if total else 0.0,
                               {}, {}, per_request)
    return results


def request_kw(r: SimRequest) -> dict[str, Any]:
    """The request's priority, client and SLO, as add_request takes them (only those set:
    a policy refuses a field it does not read)."""
    from config import SLOTarget

    kw: dict[str, Any] = {"priority": r.priority} if r.priority else {}
    if r.user is not None:
        kw["user"] = r.user
    if r.slo_ttft_s is not None or r.slo_tpot_s is not None:
        kw["slo"] = SLOTarget(ttft_ms=None if r.slo_ttft_s is None else 1e3 * r.slo_ttft_s,
                              tpot_ms=None if r.slo_tpot_s is None else 1e3 * r.slo_tpot_s)
    return kw


def calibrate(engine, workload: list[SimRequest], source: str) -> dict[str, CostModel]:
    """Fit the cost model to every step of one run of `workload` on the real engine: one
    model per clock (see run_engine)."""
    samples: dict[str, list[tuple[str, int, int, int, float]]] = {k: [] for k in CLOCKS}
    seen: set[tuple[str, int]] = set()

    def on_step(f: tuple[str, int, int, int], seconds: dict[str, float]) -> None:
        # The first run of each compiled shape pays one-off costs (buffer allocation,
        # first dispatch): not what its later steps cost.
        if (f[0], f[1]) in seen:
            for k, v in seconds.items():
                samples[k].append((*f, v))
        seen.add((f[0], f[1]))

    run_engine(engine, workload, "calib", on_step=on_step)
    models = {k: fit_cost_model(v, f"{source} ({k} clock)") for k, v in samples.items()}
    if engine.runner.num_swap_blocks:
        swap = measure_swap(engine)
        for cm in models.values():
            cm.swap, cm.fit["swap"] = swap["coef"], swap
    return models


def measure_swap(engine, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), reps: int = 5) -> dict[str, Any]:
    """The runner's KV copy on this machine, wall clock: blocks 1..n copied to the host pool
    and back (the engine idle: they hold nothing), fitted as seconds = a + b * tokens copied;
    the bandwidth is the KV bytes per token over b."""
    import jax
    import numpy as np

    runner, bs = engine.runner, engine.config.block_size
    assert not engine.has_unfinished() and runner.num_swap_blocks >= max(sizes)
    xs, ys = [], []
    for n in sizes:
        pair = [(list(range(1, n + 1)), list(range(n)))]
        for rep in range(reps + 1):  # the first compiles this bucket's copy programs
            t = time.perf_counter()
            runner.swap(pair, pair)
            jax.block_until_ready(runner.kv_caches)
            if rep:
                xs.append(2 * n * bs)
                ys.append(time.perf_counter() - t)
    b, a = np.polyfit(xs, ys, 1)
    token_bytes = sum(x.nbytes // x.shape[1] for x in jax.tree.leaves(runner.kv_caches)) / bs
    return {"coef": (max(float(a), 0.0), float(b)), "kv_bytes_per_token": token_bytes,
            "bandwidth_bytes_s": token_bytes / b, "max_tokens_timed": 2 * max(sizes) * bs}


# ---- sizes -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Sizes:
    model: str
    vocab_size: int
    num_requests: int
    short: int
    long: int
    prompt_len: tuple[int, int]
    max_num_seqs: int
    max_model_len: int
    tight_kv_seqs: int  # the tight-KV case: blocks for this many max_model_len sequences
    calib_prompt_len: tuple[int, int]
    calib_mean: float
    calib_cap: int


FULL = Sizes("bench", 32000, 100, 16, 512, (32, 256), 32, 1024, 6, (16, 512), 48, 384)
TINY = Sizes("tiny", 512, 12, 4, 24, (8, 24), 4, 64, 1, (4, 16), 16, 40)  # calibration long enough for decode-only steps


def engine_kw(s: Sizes, scheduling: str = "continuous", kv_seqs: float | None = None) -> dict[str, Any]:
    kv_seqs = s.max_num_seqs if kv_seqs is None else kv_seqs
    return dict(max_num_seqs=s.max_num_seqs, max_model_len=s.max_model_len, block_size=16, dtype="float32",
                scheduling=scheduling, num_kv_blocks=int(kv_seqs * math.ceil(s.max_model_len / 16)) + 1)


def calibration_workload(s: Sizes) -> list[SimRequest]:
    """Not the validation workloads: 3 x max_num_seqs requests at t=0 with exponential
    output lengths and a wide prompt range. The first max_num_seqs board in a few large
    prefill steps; the rest join one or two at a time as seats free (small prefill steps
    of many sizes), and the tail drains through every decode row bucket."""
    reqs = exponential_mix(3 * s.max_num_seqs, s.vocab_size, mean=s.calib_mean, cap=s.calib_cap,
                           prompt_len=s.calib_prompt_len, seed=7)
    return [SimRequest(0.0, r.prompt_token_ids, r.max_tokens) for r in reqs]


# ---- --validate --------------------------------------------------------------------------

def validate(s: Sizes, out_dir: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The real engine and the simulator on the same workloads: the seed's mix under
    continuous and static, and a tight KV budget that preempts. The cost model is fitted
    to a separate calibration run first. Each case is measured by both clocks in the one
    run; "wall" is the headline (the fields the issue names), "cpu" sits beside it."""
    seed = synthetic("seed", s.num_requests, s.vocab_size, short=s.short, long=s.long, prompt_len=s.prompt_len)
    cases = [("seed-continuous", engine_kw(s, "continuous")), ("seed-tight-kv", engine_kw(s, "continuous", s.tight_kv_seqs)),
             ("seed-static", engine_kw(s, "static"))]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    # One engine for every case: its KV arrays hold the ample budget, and the tight case's
    # scheduler is handed fewer blocks (the runner reads only the blocks it is given; a
    # step's cost follows the context, not the array): no second compilation.
    log("[validate] building the engine ...")
    engine = build_engine(s.model, {k: v for k, v in engine_kw(s).items() if k != "scheduling"})
    log("[validate] calibrating the cost model on the real engine ...")
    engine.scheduler = fresh_scheduler(engine, engine.num_kv_blocks, scheduling="continuous")
    cost_models = calibrate(engine, calibration_workload(s), f"calibrated on {s.model}, {os.uname().nodename}")
    for k, cm in cost_models.items():
        cm.save(os.path.join(out_dir, f"cost_model_{k}.json"))
        log(f"[validate] cost model ({k} clock): {cm.coef}; fit {cm.fit}")
    results = []
    for name, kw in cases:
        engine.scheduler = fresh_scheduler(engine, kw["num_kv_blocks"], scheduling=kw["scheduling"])
        log(f"[validate] {name}: real engine ...")
        measured = run_engine(engine, seed, name)
        row: dict[str, Any] = {"case": name, "scheduling": kw["scheduling"], "num_kv_blocks": kw["num_kv_blocks"],
                               "max_num_seqs": kw["max_num_seqs"], "loadavg": os.getloadavg()}
        for clock in CLOCKS:
            m, p = measured[clock], simulate(engine.config, kw["num_kv_blocks"], seed, cost_models[clock])
            fig = {"measured_tok_s": m.tok_s, "predicted_tok_s": p.tok_s,
                   "measured_short_p99_s": m.latency("short")["p99"], "predicted_short_p99_s": p.latency("short")["p99"],
                   "measured_steps": m.steps, "predicted_steps": p.steps,
                   "measured_preemptions": m.preemptions, "predicted_preemptions": p.preemptions}
            fig["tok_s_err"] = fig["predicted_tok_s"] / fig["measured_tok_s"] - 1
            fig["short_p99_err"] = fig["predicted_short_p99_s"] / fig["measured_short_p99_s"] - 1
            fig["within_15pct"] = abs(fig["tok_s_err"]) <= 0.15 and abs(fig["short_p99_err"]) <= 0.15
            if clock == "wall":
                row |= fig
            else:
                row[f"{clock}_clock"] = fig
            log(f"[validate] {name} ({clock} clock): tok/s {fig['measured_tok_s']:.1f} measured, "
                f"{fig['predicted_tok_s']:.1f} predicted ({100 * fig['tok_s_err']:+.1f}%); short p99 "
                f"{fig['measured_short_p99_s']:.2f}s measured, {fig['predicted_short_p99_s']:.2f}s predicted "
                f"({100 * fig['short_p99_err']:+.1f}%); steps {fig['measured_steps']} / {fig['predicted_steps']}; "
                f"preemptions {fig['measured_preemptions']} / {fig['predicted_preemptions']}")
        results.append(row)
        _write_validation(out_dir, s, cost_models, results, t0, load_before)
    return _write_validation(out_dir, s, cost_models, results, t0, load_before)


def _write_validation(out_dir: str, s: Sizes, cost_models: dict[str, CostModel], results: list[dict[str, Any]],
                      t0: float, load_before: tuple[float, ...]) -> dict[str, Any]:
    """After every case, so a run cut short still leaves what it measured."""
    report = {"sizes": asdict(s), "cost_models": {k: {"coef": v.coef, "fit": v.fit} for k, v in cost_models.items()},
              "cases": results, "wall_s": time.perf_counter() - t0, "loadavg_before": load_before,
              "loadavg_after": os.getloadavg(), "cores": os.cpu_count()}
    write_json(os.path.join(out_dir, "validation.json"), report)
    return report


def fresh_scheduler(engine, num_kv_blocks: int, **config: Any) -> Scheduler:
    """A new scheduler on the same engine (same compiled programs, KV arrays and host swap
    pool), with `num_kv_blocks` of them (at most the arrays' own) and `config` changed
    (scheduling, scheduling_policy, preemption_mode): continuous, static, every policy and a
    tight KV budget run without compiling twice."""
    import dataclasses

    assert not engine.has_unfinished() and num_kv_blocks <= engine.num_kv_blocks
    engine.config = dataclasses.replace(engine.config, **config)
    engine.runner.config = engine.config
    return Scheduler(engine.config, num_kv_blocks, engine.model_config.eos_token_ids,
                     num_swap_blocks=engine.runner.num_swap_blocks)


# ---- --report: the seed's question at scale ---------------------------------------------

REPORT_SEQS = (8, 16, 32, 64, 128, 256)
REPORT_KV = (("tight", 0.25), ("half", 0.5), ("ample", 1.0))  # KV budget: this fraction of max_num_seqs x max_model_len


def report(cost_models: dict[str, CostModel], out_dir: str, seqs: tuple[int, ...] = REPORT_SEQS,
           log: Callable[[str], None] = print, max_model_len: int = 1024) -> dict[str, Any]:
    """continuous/static tokens/s and short-request p99 for each max_num_seqs, KV budget and
    cost model, on the seed's mix scaled to the slots: 2 x max_num_seqs requests (at least
    100), all at t=0."""
    rows = []
    for cm_name, cm in cost_models.items():
        for n in seqs:
            work = synthetic("seed", max(100, 2 * n), 32000)
            for kv_name, frac in REPORT_KV:
                blocks = max(int(frac * n) * math.ceil(max_model_len / 16), math.ceil(max_model_len / 16)) + 1
                r = {"cost_model": cm_name, "max_num_seqs": n, "kv": kv_name, "num_kv_blocks": blocks}
                for sched in ("continuous", "static"):
                    cfg = EngineConfig(max_num_seqs=n, max_model_len=max_model_len, block_size=16,
                                       scheduling=sched).resolved(max_model_len)
                    res = simulate(cfg, blocks, work, cm)
                    r[sched] = {"tok_s": res.tok_s, "short_p99_s": res.latency("short")["p99"],
                                "preemptions": res.preemptions, "slot_utilization": res.slot_utilization}
                r["tok_s_ratio"] = r["continuous"]["tok_s"] / r["static"]["tok_s"]
                r["short_p99_ratio"] = r["static"]["short_p99_s"] / r["continuous"]["short_p99_s"]
                log(f"[report] {cm_name:>12} seqs {n:>3} kv {kv_name:>5}: tok/s x{r['tok_s_ratio']:.2f}, "
                    f"short p99 /{r['short_p99_ratio']:.1f}")
                rows.append(r)
    plt = pyplot()
    fig, axes = plt.subplots(2, len(cost_models), figsize=(5.5 * len(cost_models), 7), squeeze=False)
    for j, cm in enumerate(cost_models):
        for kv_name, _ in REPORT_KV:
            rs = [r for r in rows if r["cost_model"] == cm and r["kv"] == kv_name]
            for ax, key in zip(axes[:, j], ("tok_s_ratio", "short_p99_ratio")):
                ax.plot([r["max_num_seqs"] for r in rs], [r[key] for r in rs], marker="o", label=f"KV {kv_name}")
        axes[0][j].set_title(f"{cm}: output tok/s, continuous / static")
        axes[1][j].set_title(f"{cm}: short p99 e2e, static / continuous")
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("max_num_seqs")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.grid(alpha=0.3)
            ax.legend()
    save_figure(fig, os.path.join(out_dir, "simulate_scales.png"), dpi=90)
    table = md_table([["cost model", "max_num_seqs", "KV budget (blocks)", "continuous tok/s", "static tok/s", "ratio",
                       "short p99 cont. (s)", "short p99 static (s)", "ratio", "preemptions cont./static"]] + [
        [r["cost_model"], str(r["max_num_seqs"]), f"{r['kv']} ({r['num_kv_blocks']})", f"{c['tok_s']:.0f}",
         f"{st['tok_s']:.0f}", f"{r['tok_s_ratio']:.2f}", f"{c['short_p99_s']:.2f}", f"{st['short_p99_s']:.2f}",
         f"{r['short_p99_ratio']:.1f}", f"{c['preemptions']}/{st['preemptions']}"]
        for r in rows for c, st in [(r["continuous"], r["static"])]])
    models = "\n".join(f"- **{k}**: {v.source}; per step (a, b, c, d) = " + "; ".join(
        f"{p} ({', '.join(f'{x:.3g}' for x in v.coef[p])})" for p in PROGRAMS) for k, v in cost_models.items())
    with open(os.path.join(out_dir, "simulate_report.md"), "w") as f:
        f.write(f"Cost models:\n\n{models}\n\n{table}\n")
    write_json(os.path.join(out_dir, "simulate_report.json"), {
        "rows": rows, "cost_models": {k: {"coef": v.coef, "source": v.source} for k, v in cost_models.items()}})
    return {"rows": rows}


# ---- main --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, what in (("tiny", "the tiny model and a handful of requests (seconds)"),
                       ("validate", "real engine vs simulator: writes validation.json"),
                       ("calibrate", "fit the cost model on this machine and save it"),
                       ("report", "the seed's question at max_num_seqs 8..256"), ("enable-chunked-prefill", None)):
        p.add_argument(f"--{flag}", action="store_true", help=what)
    p.add_argument("--report-seqs", default=",".join(map(str, REPORT_SEQS)))
    p.add_argument("--cost-model", default=None,
                   help=f"a cost-model JSON (default {os.path.relpath(DEFAULT_COST_MODEL)}), or 'gpu-like'")
    p.add_argument("--out", default=None, help="output directory (default bench/results/simulate-<time>)")
    p.add_argument("--workload", default="seed", help="seed | exp | a JSON file (see the docstring)")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (synthetic workloads)")
    p.add_argument("--priority-fraction", type=float, default=0.0,
                   help="this fraction of requests (every k-th) gets priority -1, the rest 0")
    for name, kind, default in (("max-num-seqs", int, None), ("max-model-len", int, None),
                                ("num-kv-blocks", int, None), ("max-num-batched-tokens", int, None),
                                ("block-size", int, 16)):
        p.add_argument(f"--{name}", type=kind, default=default)
    p.add_argument("--scheduling", default="continuous", choices=["continuous", "static"])
    p.add_argument("--scheduling-policy", default="fcfs")
    p.add_argument("--kv-admission", default="on-demand", choices=["on-demand", "reserve", "reserve-max-len"])
    args = p.parse_args(argv)
    sizes = TINY if args.tiny else FULL
    out_dir = args.out or results_dir(time.strftime("simulate-%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)

    if args.validate:
        rep = validate(sizes, out_dir)
        ok = all(c["within_15pct"] for c in rep["cases"])
        print(f"validation: {'every case within 15%' if ok else 'MISSED 15% on some case'}; "
              f"{os.path.join(out_dir, 'validation.json')}")
        return 0
    if args.calibrate:
        engine = build_engine(sizes.model, {k: v for k, v in engine_kw(sizes).items() if k != "scheduling"}, print)
        cm = calibrate(engine, calibration_workload(sizes), f"calibrated on {sizes.model}, {os.uname().nodename}")
        path = args.cost_model or DEFAULT_COST_MODEL
        cm["wall"].save(path)  # the wall clock's: what a run on this machine, alone, takes
        cm["cpu"].save(path.replace(".json", "_cpu.json"))
        print(f"cost model -> {path}: {cm['wall'].coef}\nfit: {cm['wall'].fit}")
        return 0

    cm = _cost_model(args.cost_model)
    if args.report:
        seqs = tuple(int(x) for x in args.report_seqs.split(","))
        report({"this machine": cm, "GPU-like": GPU_LIKE}, out_dir, seqs)
        print(f"report -> {out_dir}")
        return 0
    if args.workload in ("seed", "exp"):
        work = synthetic(args.workload, args.num_requests or sizes.num_requests, sizes.vocab_size, short=sizes.short,
                         long=sizes.long, prompt_len=sizes.prompt_len, rate=args.rate)
    else:
        work = load_workload(args.workload, sizes.vocab_size)
    if args.priority_fraction:
        k = max(1, round(1 / args.priority_fraction))
        for i, r in enumerate(work):
            r.priority = -1 if i % k == 0 else 0
    max_model_len = args.max_model_len or sizes.max_model_len
    kw: dict[str, Any] = dict(max_num_seqs=args.max_num_seqs or sizes.max_num_seqs, max_model_len=max_model_len,
                              block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                              enable_chunked_prefill=args.enable_chunked_prefill, scheduling=args.scheduling,
                              kv_admission=args.kv_admission)
    if args.scheduling_policy != "fcfs":
        kw["scheduling_policy"] = args.scheduling_policy
    cfg = EngineConfig(**kw).resolved(max_model_len)
    blocks = args.num_kv_blocks or cfg.max_num_seqs * cfg.max_blocks_per_seq + 1
    t0 = time.process_time()
    res = simulate(cfg, blocks, work, cm)
    summary = res.summary() | {"cpu_s": time.process_time() - t0, "config": kw, "num_kv_blocks": blocks,
                               "cost_model": cm.source}
    write_json(os.path.join(out_dir, "simulate.json"), summary)
    print(f"{len(work)} requests, {res.steps} steps, {res.preemptions} preemptions, {res.tok_s:.1f} output tok/s, "
          f"slot utilisation {res.slot_utilization:.2f} ({summary['cpu_s']:.2f} s of CPU)")
    print("waiting (time-weighted mean / max): " + ", ".join(
        f"{k} {res.waiting_mean[k]:.1f}/{res.waiting_max[k]}" for k in WAIT_REASONS))
    groups = list(summary["per_class"].items())
    if len(summary["per_priority"]) > 1:
        groups += [(f"prio {p}", lat) for p, lat in summary["per_priority"].items()]
    for c, lat in groups:
        print(f"  {c:>6}: " + "  ".join(f"{k[:-2]} p50 {v.get('p50', math.nan):.3f} p99 {v.get('p99', math.nan):.3f}"
                                         for k, v in lat.items()))
    return 0


def _cost_model(arg: str | None) -> CostModel:
    if arg == "gpu-like":
        return GPU_LIKE
    path = arg or DEFAULT_COST_MODEL
    if not os.path.exists(path):
        raise SystemExit(f"no cost model at {path}: run `python bench/simulate.py --calibrate` first "
                         "(or pass --cost-model gpu-like)")
    return CostModel.load(path)


if __name__ == "__main__":
    sys.exit(main())
