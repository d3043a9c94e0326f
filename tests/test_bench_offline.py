"""The benches' shared workloads and figures, and bench/offline.py at its --tiny size (with a
smaller step budget), checked against what the workload alone says the run must report
(counts, step bounds, percentiles of the raw samples), not against the bench's own arithmetic."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
from conftest import load_bench


def test_short_long_mix_is_half_short_half_long_with_prompts_in_range_and_fixed_by_its_seed():
    workload = load_bench("workload")
    reqs = workload.short_long_mix(101, 32000)
    assert [sum(r.max_tokens == n for r in reqs) for n in (16, 512)] == [50, 51]  # the odd one out is long
    assert all(32 <= len(r.prompt_token_ids) <= 256 and max(r.prompt_token_ids) < 32000 for r in reqs)
    assert reqs == workload.short_long_mix(101, 32000) and reqs != workload.short_long_mix(101, 32000, seed=1)
    assert [r.max_tokens for r in reqs][:10] != sorted(r.max_tokens for r in reqs)[:10], "shuffled"


def test_exponential_lengths_have_the_asked_mean_and_respect_the_cap():
    workload = load_bench("workload")
    lens = [r.max_tokens for r in workload.exponential_mix(4000, 100, mean=50, cap=400)]
    assert min(lens) >= 1 and max(lens) <= 400
    assert abs(np.mean(lens) - 50.5) < 3  # ceil() adds half a token to Exponential(50)'s mean


def test_shared_prefix_requests_share_exactly_the_system_prompt():
    workload = load_bench("workload")
    reqs = workload.shared_prefix(5, 1000, prefix_len=40, suffix_len=6, max_tokens=3)
    assert all(len(r.prompt_token_ids) == 46 and r.max_tokens == 3 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:40]) for r in reqs}) == 1
    assert len({tuple(r.prompt_token_ids[40:]) for r in reqs}) == 5


def test_arrivals_are_a_burst_or_a_poisson_process_of_the_asked_rate():
    workload = load_bench("workload")
    assert workload.arrival_times(4, None) == [0.0] * 4
    t = workload.arrival_times(5000, 20.0)
    assert t[0] == 0.0 and all(b > a for a, b in zip(t, t[1:]))
    assert abs(len(t) / t[-1] - 20.0) < 1.0


def test_summaries_equal_numpys_percentiles_on_the_raw_samples():
    report = load_bench("report")
    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        s = report.summarize(xs)
        for q in (50, 90, 99):
            assert s[f"p{q}"] == pytest.approx(np.percentile(xs, q), rel=1e-12)
        assert s["mean"] == pytest.approx(np.mean(xs)) and s["max"] == max(xs)
    assert report.summarize([]) == {}


@pytest.mark.timeout(300)
def test_tiny_run_reports_what_its_workload_implies(tmp_path, monkeypatch):
    offline = load_bench("offline")
    workload = load_bench("workload")
    # The bench gives torch the bench machine's 2 cores; here the other test worker has one
    # of them, and torch's second thread would spin-wait (conftest's OMP_NUM_THREADS): the
    # transformers peer runs on this process's one thread, and keeps it for the tests after.
    monkeypatch.setattr(offline, "TORCH_THREADS", 1)
    # --tiny's sizes but a step budget of 16, the one token bucket: one ragged program per
    # engine shape where --tiny's 64 makes three (16, 32, 64). A step of more than 16 prompt
    # tokens is chunked; the transformers peer's max_batch_tokens is the same 16. No figure
    # checked below depends on the budget.
    monkeypatch.setattr(offline, "TINY", dataclasses.replace(offline.TINY, max_num_batched_tokens=16))
    out = tmp_path / "offline.json"
    offline.main(["--tiny", "--out", str(out)])
    res = json.loads(out.read_text())
    sz = offline.TINY
    assert set(res["sections"]) == set(offline.SECTIONS)
    assert all("error" not in sec for sec in res["sections"].values())
    mix = workload.short_long_mix(sz.num_requests, 512, short=sz.short, long=sz.long, prompt_len=sz.prompt_len)
    lens = [r.max_tokens for r in mix]
    runs = res["sections"]["mix32"]["runs"]
    for name, run in runs.items():
        # ignore_eos: every request makes exactly its max_tokens, and the engine counted them all
        assert run["output_tokens"] == run["stats"]["generation_tokens"] == sum(lens), name
        assert run["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in mix)
        assert run["stats"]["num_preemptions"] == 0, "KV is sized so that it never limits"
        # a request is done no earlier than its own length in steps, the run no earlier than the longest
        assert all(step >= n for step, n in zip(run["finish_step_all"], lens))
        assert run["stats"]["num_steps"] >= max(lens)
        short = [c for c, n in zip(run["completion_s_all"], lens) if n == sz.short]
        assert len(short) == sz.num_requests // 2
        assert run["short_completion_s"]["p99"] == pytest.approx(np.percentile(short, 99))
    # static rides each bus of max_num_seqs requests (in arrival order) until its longest member is done
    buses = [max(lens[i:i + sz.seqs_throughput]) for i in range(0, len(lens), sz.seqs_throughput)]
    assert runs["static"]["stats"]["num_steps"] >= sum(buses) > runs["continuous"]["stats"]["num_steps"]
    assert runs["static"]["slot_utilization"] < runs["continuous"]["slot_utilization"]
    tok_s = res["sections"]["mix32"]["ratios"][0]
    assert tok_s["ideal"] == runs["static"]["stats"]["num_steps"] / runs["continuous"]["stats"]["num_steps"]
    peers = res["sections"]["peers"]
    slice_lens = peers["workload"]["max_tokens"]
    assert sorted(slice_lens) == [sz.short] * (sz.peer_requests // 2) + [sz.peer_long] * (sz.peer_requests // 2)
    hf = peers["runs"]["hf_generate"]
    assert hf["output_tokens"] == sum(slice_lens)
    # padded generate: each batch decodes as many steps as its longest request
    assert hf["decode_steps"] == sum(max(slice_lens[i:i + sz.peer_seqs]) for i in range(0, len(slice_lens), sz.peer_seqs))
    assert all(v == 1.0 for v in peers["greedy_agreement"].values()), "taxirank and transformers run one model"
