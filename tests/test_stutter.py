"""A long prompt's prefill stalling the decodes that run beside it, as an engine trace
(tiny model, CPU): a long prompt joins while others decode. Without chunked prefill the
join is one whole-prompt step in which no decoder gets a token; with it the prompt is
split over several steps within the token budget, every decoder gets a token every step,
and the joiner decodes the step after its last chunk. Plus: why requests wait, at the
engine level (EngineStats.waiting_by_reason)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams, StepTrace

USERS = [f"user-{i}" for i in range(4)]
LONG = "long"
LONG_LEN, BUDGET = 300, 64  # the long prompt is ~4.7 budgets
STEADY_STEPS = 3  # decode steps before the long prompt joins
# Synchronous scheduling: the traces number steps as their results come back, and these
# tests read the scheduler's decisions step by step (async shifts them by one step).
BASE = dict(model="tiny", max_num_seqs=8, max_model_len=512, warmup=False, async_scheduling=False)


@functools.cache  # each run once per session: the tests below read the same two runs
def run(chunked: bool) -> tuple[list[StepTrace], int, dict[str, list[int]], LLMEngine]:
    """Users decode, the long prompt joins after STEADY_STEPS steps, run to the end.
    Returns the trace, the number of the first step the long prompt could be in, every
    request's tokens, and the engine."""
    budget = dict(enable_chunked_prefill=True, max_num_batched_tokens=BUDGET) if chunked else \
        dict(enable_chunked_prefill=False, max_num_batched_tokens=512)
    eng = LLMEngine(EngineConfig(**BASE, **budget), log=lambda *_: None, record_trace=True)
    rng = np.random.default_rng(0)
    tokens: dict[str, list[int]] = {}
    for rid in USERS:
        eng.add_request(rid, rng.integers(3, 500, 10).tolist(), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(1 + STEADY_STEPS):  # the users' prefill, then steady decoding
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    join_step = eng.stats.num_steps + 1
    eng.add_request(LONG, rng.integers(3, 500, LONG_LEN).tolist(), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert eng.stats.num_preemptions == 0
    return eng.trace, join_step, tokens, eng


def users_stalled(t: StepTrace) -> bool:
    return not any(u in t.sampled for u in USERS)


def test_without_chunking_the_join_is_one_whole_prompt_step_that_stalls_every_decoder():
    trace, join, _, _ = run(chunked=False)
    joined = [t for t in trace if LONG in dict(t.scheduled)]
    prefill = joined[0]
    assert prefill.step == join  # it joins at once ...
    assert prefill.scheduled == [(LONG, LONG_LEN)]  # ... as one whole-prompt step, alone
    assert prefill.num_prefill_tokens == LONG_LEN and prefill.num_decode_tokens == 0
    assert LONG in prefill.sampled  # its first token comes out of that step
    # While the users stream, exactly one step gives them nothing: the stutter.
    users_done = max(t.step for t in trace if any(u in t.sampled for u in USERS))
    stalls = [t.step for t in trace if 1 < t.step <= users_done and users_stalled(t)]
    assert stalls == [prefill.step]


def test_with_chunking_the_long_prompt_is_split_within_the_budget_and_nobody_stalls():
    trace, join, _, _ = run(chunked=True)
    assert all(t.num_prefill_tokens + t.num_decode_tokens <= BUDGET for t in trace)
    chunk_steps = [t for t in trace if LONG in dict(t.scheduled) and dict(t.scheduled)[LONG] > 1]
    assert chunk_steps[0].step == join  # it starts at once ...
    # ... in chunks of what the decoders leave of the budget: 300 = 5 x (64 - 4)
    assert [dict(t.scheduled)[LONG] for t in chunk_steps] == [BUDGET - len(USERS)] * 5
    assert [t.step for t in chunk_steps] == list(range(join, join + len(chunk_steps)))  # back to back
    assert sum(dict(t.scheduled)[LONG] for t in chunk_steps) == LONG_LEN
    for t in chunk_steps:
        # the decoders come first and every one of them gets its token in every chunk step
        assert [rid for rid, _ in t.scheduled[:len(USERS)]] == USERS
        assert all(n == 1 for _, n in t.scheduled[:len(USERS)]) and set(USERS) <= set(t.sampled)
        assert t.num_decode_tokens == len(USERS) and t.num_prefill_tokens == dict(t.scheduled)[LONG]
    # a chunk samples nothing until the last one, whose token is the joiner's first
    assert [LONG in t.sampled for t in chunk_steps] == [False] * (len(chunk_steps) - 1) + [True]
    after = trace[chunk_steps[-1].step]  # the next step: it decodes, one token like everyone
    assert after.step == chunk_steps[-1].step + 1
    assert dict(after.scheduled)[LONG] == 1 and LONG in after.sampled and after.num_prefill_tokens == 0
    users_done = max(t.step for t in trace if any(u in t.sampled for u in USERS))
    assert not [t.step for t in trace if 1 < t.step <= users_done and users_stalled(t)]


def test_chunked_and_unchunked_give_the_same_greedy_tokens_for_everyone():
    _, _, whole, _ = run(chunked=False)
    _, _, chunked, _ = run(chunked=True)
    assert chunked == whole
    assert sorted(whole) == sorted(USERS + [LONG]) and len(whole[LONG]) == 4


# ---- why requests wait, as the engine reports it ------------------------------------------
@pytest.mark.parametrize("admission", ["reserve", "on-demand"])
def test_engine_reports_kv_blocks_when_blocks_not_slots_hold_a_request_back(admission):
    """4 slots, 8 usable blocks of 16 tokens. reserve: "a" holds prompt + max_tokens =
    128 tokens, all 8 blocks. on-demand: "a"'s 100-token prompt takes 7, "b"'s 40 needs 3.
    Either way "b" waits for blocks while 3 slots are free."""
    eng = LLMEngine(EngineConfig(**{**BASE, "max_num_seqs": 4, "max_model_len": 128}, max_num_batched_tokens=256,
                                 num_kv_blocks=9, kv_admission=admission), log=lambda *_: None)
    a_len, b_len = (4, 40) if admission == "reserve" else (100, 40)
    eng.add_request("a", list(range(3, 3 + a_len)), SamplingParams(max_tokens=128 - a_len if admission == "reserve"
                                                                    else 8, ignore_eos=True))
    # A prompt of its own: one starting like "a"'s would share a's cached blocks (prefix caching).
    eng.add_request("b", list(range(300, 300 + b_len)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    eng.step()
    st = eng.stats
    assert (st.num_requests_running, st.num_requests_waiting) == (1, 1)
    assert st.waiting_by_reason == {"kv_blocks": 1, "max_num_seqs": 0, "token_budget": 0, "static_batch": 0, "policy": 0}
    while eng.has_unfinished():  # once "a" leaves, "b" gets its blocks and completes
        eng.step()
    assert st.request_success["length"] == 2 and st.waiting_by_reason["kv_blocks"] == 0 and st.num_preemptions == 0


# ---- bench/stutter.py, at a smoke size -------------------------------------------------------
@pytest.mark.timeout(300)
def test_stutter_bench_tiny_run_counts_the_chunks_stalls_and_gaps_its_sizes_imply(tmp_path):
    """2 users (8-token prompts, prefilled in step 1), 2 steady steps, so the 56-token joiner
    arrives for step 4. Off: step 4 is the whole prompt and stalls both users; the window is
    steps 2..6 (4 +- 2), 4 steps with user tokens. On: a budget of 16 leaves 14 tokens a step,
    so 4 chunks (steps 4..7), the first token at step 7, the window steps 2..9, no stall.
    (The sizes make few programs: the budget of 16 is one token bucket, and off's budget,
    max_model_len 59, three.)"""
    import json

    from conftest import load_bench

    bench = load_bench("stutter")
    bench.main(["--tiny", "--users", "2", "--prompt-len", "56", "--budget", "16", "--user-prompt-len", "8",
                "--steady-steps", "2", "--window", "2", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "stutter.json").read_text())
    off, on = res["results"]["off"], res["results"]["on"]
    assert (tmp_path / "stutter.png").stat().st_size > 0
    (tmp_path / "stutter.png").unlink()
    assert bench.main(["--plot-only", str(tmp_path / "stutter.json")]) == res  # redrawn from the file alone
    assert (tmp_path / "stutter.png").stat().st_size > 0
    assert (off["join_step"], off["first_token_step"], off["window_steps"]) == (4, 4, [2, 6])
    assert off["prefill_step_tokens"] == [56] and off["stall_steps"] == [4]
    assert (on["join_step"], on["first_token_step"], on["window_steps"]) == (4, 7, [2, 9])
    assert on["prefill_step_tokens"] == [14, 14, 14, 14] and on["stall_steps"] == []
    for r, steps_with_tokens in ((off, 4), (on, 8)):
        assert r["compilations_during_run"] == 0  # warm-up compiled everything: no false stutter
        assert r["itl_window_count"] == 2 * steps_with_tokens
        lo, hi = r["window_steps"]
        gaps = [t - prev for u in ("user-00", "user-01") for (_, prev), (s, t) in
                zip(r["arrivals"][u], r["arrivals"][u][1:]) if lo <= s <= hi]
        assert len(gaps) == r["itl_window_count"]
        for q in (50, 99):
            assert r["itl_window"][f"p{q}"] == pytest.approx(np.percentile(gaps, q))
        assert r["max_gap_s"] == pytest.approx(max(gaps))
        assert len(r["arrivals"]["long"]) == 1 + 2  # its first token and --after-tokens (the window) more
