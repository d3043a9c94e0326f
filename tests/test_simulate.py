"""bench/simulate.py: the simulator's scheduler decisions are the real engine's."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from simulate import (UNIT_STEPS, CostModel, SimRequest, build_engine, fit_cost_model, request_kw,  # noqa: E402
                      run_engine, simulate)

from engine import LLMEngine, EngineConfig, SamplingParams  # noqa: E402


def workload() -> list[SimRequest]:
    """Arrival times are step numbers (the unit cost model: one step, one second); three
    clients (the fair policy reads them, the others ignore them)."""
    lens = [(5, 3), (30, 12), (12, 1), (40, 40), (7, 9), (22, 30), (3, 2), (50, 36), (33, 20), (9, 44)]
    return [SimRequest(float(2 * (i // 3)), [3 + (7 * i + j) % 250 for j in range(p)], n, user="abc"[i % 3])
            for i, (p, n) in enumerate(lens)]


# The shapes of test_engine.py's engines, so the persistent compilation cache serves them.
# Synchronous: the simulator replays the synchronous loop (bench/simulate.py's docstring).
SMALL = dict(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256, warmup=False, async_scheduling=False)
CASES = {"continuous": dict(scheduling="continuous"), "static": dict(scheduling="static"),
         "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=32),
         "tight-kv": dict(num_kv_blocks=14, max_model_len=128, max_num_batched_tokens=128),
         "tight-kv-swap": dict(num_kv_blocks=14, max_model_len=128, max_num_batched_tokens=128, preemption_mode="swap",
                               swap_space=0.01),
         "fair": dict(scheduling_policy="fair", max_num_seqs=2),
         "fair-chunked": dict(scheduling_policy="fair", max_num_seqs=4, enable_chunked_prefill=True, max_num_batched_tokens=32)}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_simulator_makes_the_real_engines_decisions_step_for_step(case):
    kw = SMALL | case
    engine = LLMEngine(EngineConfig(model="tiny", **kw), log=lambda *_: None, record_trace=True)
    work = workload()
    pending = list(enumerate(work))
    step = 0
    engine.scheduler.policy.clock = lambda: float(step)  # the simulator's clock: one step, one second (fair's window)
    while pending or engine.has_unfinished():
        while pending and pending[0][1].arrival_s <= step:
            i, r = pending.pop(0)
            engine.add_request(f"sim-{i}", r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                               arrival_time=r.arrival_s, **request_kw(r, engine.scheduler.policy))
        if not engine.has_unfinished():
            step = int(pending[0][1].arrival_s)
            continue
        engine.step()
        step += 1
    sim = simulate(engine.config, engine.num_kv_blocks, work, UNIT_STEPS, record_trace=True,
                   num_swap_blocks=engine.runner.num_swap_blocks)
    assert sim.trace == engine.trace
    assert sim.steps == engine.stats.num_steps and sim.preemptions == engine.stats.num_preemptions
    assert sim.recomputed_tokens == engine.stats.recomputed_tokens
    assert sim.swapped_blocks == engine.stats.swapped_out_blocks + engine.stats.swapped_in_blocks
    if "num_kv_blocks" in case:
        assert sim.preemptions > 0  # the tight cases do exercise preemption
        assert (sim.swapped_blocks > 0 and sim.recomputed_tokens == 0) if "preemption_mode" in case \
            else sim.recomputed_tokens > 0
    if case.get("enable_chunked_prefill"):
        assert any(len(t.scheduled) > 1 and t.num_prefill_tokens for t in sim.trace)  # chunks beside decodes
    assert sim.makespan_s == sim.steps  # every step cost one unit


def test_both_clocks_of_a_measured_run_count_the_wait_for_a_late_arrival():
    # --validate's measured side: the second request arrives 0.5 s after the first has
    # finished, so the engine idles meanwhile; the cpu clock (CPU time, which stands still
    # while the process sleeps) must still count that wait, or the late request ends before
    # it arrived and its latencies come out negative.
    engine = build_engine("tiny", SMALL)
    work = [SimRequest(0.0, [3, 4, 5, 6], 2), SimRequest(0.5, [7, 8, 9], 3)]
    run_engine(engine, work, "compile")  # so that the measured run is all steps and waits
    measured = run_engine(engine, work, "late")
    for clock, res in measured.items():
        assert res.makespan_s >= 0.5, clock
        for r in res.per_request:
            assert 0 <= r["queue_s"] <= r["ttft_s"] <= r["e2e_s"] <= res.makespan_s, (clock, r)


def test_the_cost_model_fit_recovers_known_coefficients_and_round_trips(tmp_path):
    truth = CostModel({"decode": (0.01, 0.002, 1e-5, 0.0), "ragged": (0.02, 0.001, 2e-5, 3e-4)})
    samples = [("decode", r, c, 0, truth.cost("decode", r, c, 0)) for r in (1, 2, 4, 8) for c in (10, 500, 3000)]
    samples += [("ragged", t, c, p, truth.cost("ragged", t, c, p)) for t, p in ((16, 10), (64, 60), (256, 200),
                                                                               (512, 500)) for c in (p, p + 900)]
    fit = fit_cost_model(samples, "synthetic")
    for prog in truth.coef:
        assert fit.coef[prog] == pytest.approx(truth.coef[prog], rel=1e-6, abs=1e-9)
    fit.save(str(tmp_path / "cm.json"))
    assert CostModel.load(str(tmp_path / "cm.json")).coef == fit.coef


def test_the_command_line_replays_a_recorded_log(tmp_path):
    """No model: a JSON request log (bench/mixed.py's per-request records, the outcome it
    recorded included) through the priority policy."""
    import json

    from simulate import load_workload, main

    log = {"variants": {"continuous": {"per_request": [
        {"class": "short" if i % 2 else "long", "max_tokens": 4 if i % 2 else 40, "prompt_len": 20 + i,
         "start": 1.5 + 0.01 * i} | ({"prompt_tokens": 30 + i} if i == 4 else {})
        | ({"tokens": 25, "finish_reason": "stop", "ttft": 0.1, "e2e": 2.0} if i == 6 else {}) for i in range(12)]}}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(log))
    work = load_workload(str(path))
    assert [r.arrival_s for r in work][:2] == [0.0, pytest.approx(0.01)] and len(work[3].prompt_token_ids) == 23
    assert len(work[4].prompt_token_ids) == 34  # usage's count, not a text prompt's words
    out = tmp_path / "sim"
    assert main(["--workload", str(path), "--cost-model", "gpu-like", "--scheduling-policy", "priority",
                 "--priority-fraction", "0.5", "--max-num-seqs", "4", "--out", str(out)]) == 0
    summary = json.loads((out / "simulate.json").read_text())
    # request 6 stopped (EOS) at 25 of its 40 tokens on the server: the engine ran it 25 steps
    assert summary["output_tokens"] == 6 * 4 + 5 * 40 + 25 and set(summary["per_class"]) == {"short", "long"}
    assert set(summary["per_priority"]) == {"-1", "0"}


@pytest.fixture(scope="module")
def gpu_like_report(tmp_path_factory) -> Path:
    """The command line's scale report at one slot count, GPU-like: its output directory
    (written once: both tests below read the same run)."""
    from simulate import main

    out = tmp_path_factory.mktemp("report")
    assert main(["--report", "--report-seqs", "8", "--cost-model", "gpu-like", "--out", str(out)]) == 0
    return out


def test_the_command_line_writes_the_scale_report_with_its_table_and_plot(gpu_like_report):
    """`--report` writes its plot, and its table holds three GPU-like rows at 8 slots."""
    assert (gpu_like_report / "simulate_scales.png").stat().st_size > 0
    assert (gpu_like_report / "simulate_report.md").read_text().count("| GPU-like | 8 |") == 3


def test_the_scale_report_reproduces_the_gpu_like_rows_of_docs_simulation(gpu_like_report):
    """docs/SIMULATION.md's table is `--report`'s (its setup: the short/long mix, no chunked
    prefill); the GPU-like cost model is written down, so its rows are deterministic. The
    8-slot rows, regenerated, equal the documented ones cell for cell."""
    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "SIMULATION.md")).read()
    want = [line for line in doc.splitlines() if line.startswith("| GPU-like | 8 |")]
    assert len(want) == 3
    got = [line for line in (gpu_like_report / "simulate_report.md").read_text().splitlines()
           if line.startswith("| GPU-like |")]
    assert got == want


def test_step_counts_match_a_hand_count_under_the_unit_cost_model():
    """No model, counted by hand: a request's first token comes from its prefill step, then one
    token a step. Two requests of 3 and 7 tokens in one slot run back to back: 3 + 7 steps,
    the second waiting 3; with two slots they share steps: 7, and the short one's e2e is 3."""
    from config import EngineConfig

    work = [SimRequest(0.0, [5] * 10, 3), SimRequest(0.0, [6] * 10, 7)]
    for seqs, steps, e2e in ((1, 10, [3, 10]), (2, 7, [3, 7])):
        cfg = EngineConfig(max_num_seqs=seqs, max_model_len=64, block_size=16).resolved(64)
        res = simulate(cfg, 9, work, UNIT_STEPS)
        assert (res.steps, res.makespan_s, res.output_tokens, res.preemptions) == (steps, steps, 10, 0)
        assert sorted(r["e2e_s"] for r in res.per_request) == e2e
        assert sorted(r["ttft_s"] for r in res.per_request) == ([1, 4] if seqs == 1 else [1, 1])


def run_main_on(tmp_path: Path, doc: Any, *flags: str) -> dict[str, Any]:
    """The command line on a --workload JSON (doc), GPU-like: its simulate.json."""
    import json

    from simulate import main

    (tmp_path / "w.json").write_text(json.dumps(doc))
    assert main(["--workload", str(tmp_path / "w.json"), "--cost-model", "gpu-like", "--out", str(tmp_path / "o"),
                 *flags]) == 0
    return json.loads((tmp_path / "o" / "simulate.json").read_text())


# A --workload JSON the simulator cannot run as written, and the word its error names.
BAD_WORKLOADS = {
    "empty list": ([], "non-empty"),
    "object without a log": ({}, "per_request"),
    "no max_tokens": ([{"prompt_len": 10}], "max_tokens"),
    "no prompt": ([{"max_tokens": 5}], "prompt_len"),
    "negative prompt_len": ([{"prompt_len": -3, "max_tokens": 5}], "prompt_len"),
    "zero max_tokens": ([{"prompt_len": 10, "max_tokens": 0}], "max_tokens"),
    "fractional max_tokens": ([{"prompt_len": 10, "max_tokens": 5.7}], "max_tokens"),
    "fractional priority": ([{"prompt_len": 10, "max_tokens": 5, "priority": 0.5}], "priority"),
    "unknown key": ([{"prompt_len": 10, "max_tokens": 5, "best_of": 2}], "best_of"),
    "negative SLO": ([{"prompt_len": 10, "max_tokens": 5, "slo_ttft_s": -1}], "slo_ttft_s"),
    "zero n": ([{"prompt_len": 10, "max_tokens": 5, "n": 0}], "n must"),
    "NaN arrival": ([{"prompt_len": 10, "max_tokens": 5, "arrival_s": math.nan}], "arrival_s"),  # it looped forever
}


@pytest.mark.parametrize("doc,named", BAD_WORKLOADS.values(), ids=BAD_WORKLOADS.keys())
def test_a_bad_workload_json_is_one_usage_error_naming_the_field(tmp_path, capsys, doc, named):
    """argparse's exit 2 and one line naming what is wrong, not a traceback, an assertion
    or a field silently truncated, defaulted or ignored."""
    with pytest.raises(SystemExit) as e:
        run_main_on(tmp_path, doc)
    assert e.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--rate", "--num-requests"])
def test_a_synthetic_workloads_flag_beside_a_workload_file_is_refused(tmp_path, capsys, flag):
    """A file's requests carry their own arrivals and count: --rate or --num-requests would do
    nothing, so it is an error (exit 2) naming the flag, not a no-op."""
    with pytest.raises(SystemExit) as e:
        run_main_on(tmp_path, [{"prompt_len": 10, "max_tokens": 5}], flag, "3")
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_a_request_its_kv_admission_cannot_hold_is_a_usage_error(tmp_path, capsys):
    """The engine's refusal, not the simulator's AssertionError (no progress, nothing to
    arrive): under reserve-max-len a 48-token request still holds max_model_len's 256 / 16 =
    16 blocks, and 5 blocks are 4 usable."""
    with pytest.raises(SystemExit) as e:
        run_main_on(tmp_path, [{"prompt_len": 40, "max_tokens": 8}], "--kv-admission", "reserve-max-len",
                    "--max-model-len", "256", "--num-kv-blocks", "5")
    assert e.value.code == 2 and "needs 16 KV blocks" in capsys.readouterr().err


@pytest.mark.parametrize("ttft_ms,met", [(1000, 3), (1, 0)])
def test_n_samples_run_as_n_requests_scored_on_the_default_slo(tmp_path, ttft_ms, met):
    """A request with n = 3 is three sequences, as the engine runs vLLM's n (15 output tokens,
    not 5); a prompt given by its ids alone needs no prompt_len. Under the slo policy a request
    with no targets of its own is scheduled to --slo-ttft-ms/--slo-tpot-ms, so goodput scores
    it on them: a GPU-like step takes over 4 ms, so every first token meets 1 s and none 1 ms."""
    summary = run_main_on(tmp_path, [{"prompt_token_ids": list(range(5, 45)), "max_tokens": 5, "n": 3}],
                          "--scheduling-policy", "slo", "--slo-ttft-ms", str(ttft_ms), "--slo-tpot-ms", "1000")
    assert summary["output_tokens"] == 15 and summary["goodput"] == met


@pytest.mark.parametrize("flags,rate", [((), 32 / 80), (("--no-enable-prefix-caching",), 0.0)])
def test_a_shared_prompt_hits_the_prefix_cache_unless_it_is_off(tmp_path, flags, rate):
    """The engine's --[no-]enable-prefix-caching, and vLLM's hit rate (hits over queries, in
    prompt tokens): two 40-token prompts alike, the second arriving after the first's prefill,
    find its two full 16-token blocks cached: 32 of 80 tokens; none with the cache off."""
    work = [{"prompt_token_ids": list(range(5, 45)), "max_tokens": 2, "arrival_s": t} for t in (0, 1)]
    assert run_main_on(tmp_path, work, *flags)["prefix_cache_hit_rate"] == pytest.approx(rate)


def test_tpot_is_vllms_over_the_requests_with_a_second_token():
    """TPOT as bench/mixed.py and vLLM's benchmark report it, (e2e - TTFT) / (tokens - 1) over
    the requests of 2 tokens or more: by hand, the 4-token request's tokens come at steps 1-4
    behind the 1-token one's (one seat): (5 - 2) / 3 = 1 step; the 1-token request has none."""
    from config import EngineConfig
    from report import summarize

    work = [SimRequest(0.0, [5] * 10, 1), SimRequest(0.0, [6] * 10, 4)]
    res = simulate(EngineConfig(max_num_seqs=1, max_model_len=64, block_size=16).resolved(64), 9, work, UNIT_STEPS)
    assert sorted(r["e2e_s"] for r in res.per_request) == [1, 5]
    assert res.latency(key="tpot_s") == summarize([1.0]) == res.summary()["per_class"]["all"]["tpot_s"]
