"""Async scheduling (--async-scheduling): the host schedules step N+1 while the device
runs step N and learns step N's tokens one step later. Everything a user sees must be
what synchronous scheduling gives: the same tokens, the same finishes, nothing after a
stop, every block back."""

from __future__ import annotations

import asyncio

import numpy as np

from async_engine import AsyncEngine
from conftest import fresh_step_programs
from engine import EngineConfig, EngineRequest, SamplingParams
from generation import Generation
from llm import LLM

# The benches' short/long mix (bench/workload.py) scaled down: short and long outputs,
# chunked prefill under a small token budget, and a KV cache too small for everyone
# (on-demand preemption).
TIGHT = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, enable_chunked_prefill=True,
             num_kv_blocks=10)


def mix_prompts(n: int = 10, seed: int = 11) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, rng.integers(4, 60)).tolist() for _ in range(n)]


def mix_params(stops: dict[int, int] | None = None) -> list[SamplingParams]:
    """Half short (4 tokens), half long (40); greedy and seeded sampling alternate; a
    few ask for logprobs; `stops` gives request i a stop token id."""
    stops = stops or {}
    return [SamplingParams(max_tokens=4 if i % 2 else 40, temperature=0.0 if i % 3 else 0.9, top_p=0.95, seed=100 + i,
                           ignore_eos=True, logprobs=2 if i % 4 == 0 else None,
                           stop_token_ids=[stops[i]] if i in stops else None) for i in range(10)]


def run(async_scheduling: bool, params: list[SamplingParams], **kw) -> tuple[LLM, list, dict[str, list]]:
    """Generate by stepping the engine by hand, keeping every delta."""
    if kw.get("warmup"):
        fresh_step_programs()  # warm-up's own compiles, not those of the runs before (same programs)
    llm = LLM("tiny", log=lambda *_: None, async_scheduling=async_scheduling, **{**TIGHT, **kw})
    compiled = llm.stats.num_compilations
    eng = llm.engine
    ids = [f"r{i}" for i in range(len(params))]
    for rid, p, sp in zip(ids, mix_prompts(), params):
        eng.add_request(rid, p, sp)
    deltas: dict[str, list] = {rid: [] for rid in ids}
    while eng.has_unfinished():
        for d in eng.step():
            deltas[d.request_id].append(d)
    seqs = [eng.scheduler._seqs.get(rid) for rid in ids]
    assert seqs == [None] * len(ids), "every request was released"
    if kw.get("warmup"):
        assert llm.stats.num_compilations == compiled, "a step compiled after warm-up"
    return llm, [(sum((d.new_token_ids for d in deltas[r]), []), deltas[r][-1].finish_reason) for r in ids], deltas


def test_async_gives_the_same_tokens_finishes_and_logprobs_as_sync_and_nothing_after_a_stop():
    # Stop tokens taken from a run without them, so several requests stop early.
    _, free, _ = run(False, mix_params())
    stops = {i: toks[k] for i, (toks, _) in enumerate(free) if i % 2 == 0 and len(toks) > (k := 2 + i % 5)}
    assert len(stops) >= 3
    sync_llm, sync, sync_deltas = run(False, mix_params(stops))
    async_llm, asyn, async_deltas = run(True, mix_params(stops), warmup=True)
    assert asyn == sync
    for i, stop in stops.items():  # the stop token is the last one delivered: the extra one is dropped
        toks, reason = asyn[i]
        assert reason == "stop" and toks[-1] == stop and stop not in toks[:-1]
    for rid, ds in async_deltas.items():
        assert [d.finished for d in ds] == [False] * (len(ds) - 1) + [True], rid  # nothing after the end
        assert [d.num_output_tokens for d in ds if d.new_token_ids] == list(range(1, len(asyn[int(rid[1:])][0]) + 1))
        lp = [x for d in ds for x in (d.new_logprobs or [])]
        ref = [x for d in sync_deltas[rid] for x in (d.new_logprobs or [])]
        # the same ids; values equal up to float noise (the batches differ in shape)
        assert [(x.token_id, [i for i, _ in x.top]) for x in lp] == [(x.token_id, [i for i, _ in x.top]) for x in ref]
        np.testing.assert_allclose([v for x in lp for _, v in x.top], [v for x in ref for _, v in x.top], atol=1e-5)
    for llm, outs in ((sync_llm, sync), (async_llm, asyn)):
        st = llm.stats
        assert st.num_preemptions > 0, "the tight cache must preempt"
        assert st.generation_tokens == sum(len(t) for t, _ in outs)  # dropped tokens are counted nowhere
        assert llm.engine.scheduler.allocator.num_used == 0 and st.kv_cache_usage == 0
        assert st.num_requests_running == 0 and st.num_requests_waiting == 0


def test_static_scheduling_under_async_releases_the_batch_together_with_the_same_tokens():
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 9, 5, 12)]
    prompts = mix_prompts(4)
    outs = {}
    for on in (False, True):  # test_engine.py's shapes: its static programs, compiled once in a run
        llm = LLM("tiny", log=lambda *_: None, async_scheduling=on, scheduling="static", max_num_seqs=4,
                  max_model_len=256, max_num_batched_tokens=256, warmup=False)
        res = llm.generate(prompts, params)
        assert len({o.finished_time for o in res}) == 1  # the bus: released together
        outs[on] = [o.outputs[0].token_ids for o in res]
        assert llm.engine.scheduler.allocator.num_used == 0
    assert outs[True] == outs[False] and [len(t) for t in outs[True]] == [3, 9, 5, 12]


def test_async_server_path_stop_strings_and_clients_leaving_mid_stream():
    """Through the server's Generation (stop strings, client hang-ups) on AsyncEngine:
    the same text with async on and off, and afterwards nothing runs, waits or holds KV."""

    async def serve(async_scheduling: bool, stops: dict[int, list[str]]) -> list[tuple[str, str | None]]:
        eng = AsyncEngine(EngineConfig(model="tiny", async_scheduling=async_scheduling, warmup=False, **TIGHT), log=lambda *_: None)
        await eng.start()
        try:
            prompts = mix_prompts()

            async def one(i: int) -> tuple[str, str | None]:
                gen = Generation(eng, EngineRequest(f"s{i}", prompts[i], SamplingParams(
                    max_tokens=24, ignore_eos=True, stop=tuple(stops.get(i, [])))))
                text, reason = "", None
                async for chunk in gen.chunks():
                    text += chunk.text
                    reason = chunk.finish_reason
                    if i == 4 and chunk.num_output_tokens >= 3:  # a client that hangs up
                        break
                return text, reason

            return await asyncio.gather(*(one(i) for i in range(len(prompts))))
        finally:
            for _ in range(300):
                if eng.stats.num_requests_running == 0 and eng.stats.kv_cache_usage == 0:
                    break
                await asyncio.sleep(0.01)
            assert eng.stats.num_requests_running == eng.stats.num_requests_waiting == 0
            assert eng.stats.kv_cache_usage == 0 and eng.engine.scheduler.allocator.num_used == 0
            await eng.shutdown()

    free = asyncio.run(serve(False, {}))
    # tiny's byte tokenizer: a 2-character stop string spans two tokens
    stops = {i: [text[k:k + 2]] for i, (text, _) in enumerate(free) if i != 4
             for k in [next((k for k in range(2, len(text) - 2) if "\ufffd" not in text[k:k + 2]), None)]
             if k is not None}
    assert len(stops) >= 3
    off, on = asyncio.run(serve(False, stops)), asyncio.run(serve(True, stops))
    assert on == off
    assert on[4][1] is None  # the client that left
    for i, stop in stops.items():
        text, reason = on[i]
        assert reason == "stop" and stop[0] not in text and text == free[i][0][:free[i][0].find(stop[0])]


def test_async_scheduling_is_the_default_of_the_engine_and_of_the_server_flags():
    from cli_args import build_parser

    assert EngineConfig().async_scheduling is True
    assert build_parser().parse_args([]).async_scheduling is True
    assert build_parser().parse_args(["--no-async-scheduling"]).async_scheduling is False


def test_by_default_a_queued_request_takes_a_freed_seat_one_step_later():
    """No async_scheduling argument: what LLM() does by default is what async scheduling
    does (the synchronous loop would seat it one step earlier)."""
    # tiny_async_engine's shapes: two seats; prompts of < 60 tokens fit 128, and the default
    # 512-token budget takes them whole
    llm = LLM("tiny", log=lambda *_: None, max_num_seqs=2, max_model_len=128, warmup=False, record_trace=True)
    llm.generate(mix_prompts(3), [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 10, 4)])
    trace = llm.engine.trace
    left = next(t for t in trace if "offline-0" in t.released)
    joined = next(t for t in trace if "offline-2" in dict(t.scheduled))
    # Steps are traced as their results come back. The release of offline-0 is learnt
    # while the next step (already dispatched without it: its last token was known by
    # length) runs; offline-2 boards the one after. Synchronous: left.step + 1.
    assert joined.step == left.step + 2
    assert all("offline-0" not in dict(t.scheduled) for t in trace[left.step:])
