"""The engine end to end on CPU: tokens against transformers, step traces, slot-step
accounting, preemption, chunked prefill, compilation count, sampling, abort."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import hf_greedy

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams

SMALL = dict(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256, warmup=False)


def make_llm(model: str = "tiny", **kw) -> LLM:
    return LLM(model, log=lambda *_: None, **{**SMALL, **kw})


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, rng.integers(lo, hi)).tolist() for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("family", ["llama2", "llama3", "mistral", "qwen2", "qwen3"])
def test_greedy_generate_equals_transformers(hf_checkpoint, family):
    path = hf_checkpoint(family)
    prompt = [5, 17, 42, 99, 7, 256, 31, 64, 11]
    ours = make_llm(path, max_model_len=128, max_num_batched_tokens=128).generate([prompt], greedy(32))[0]
    assert ours.token_ids == hf_greedy(path, prompt, 32)


def test_finished_request_leaves_in_that_step_and_queued_request_joins_the_next():
    # Synchronous scheduling: the host knows a step's tokens before it schedules the next.
    # (Async, it learns them a step later; see test_async_scheduling.py.)
    llm = make_llm(max_num_seqs=2, record_trace=True, async_scheduling=False)
    llm.generate(prompts(3), [greedy(3), greedy(10), greedy(4)])
    trace = llm.engine.trace
    left = next(t for t in trace if "offline-0" in t.released)
    assert "offline-0" in left.sampled  # its last token and its release are the same step
    joined = trace[left.step]  # the very next step
    assert joined.step == left.step + 1
    assert ("offline-2" in dict(joined.scheduled)) and all("offline-2" not in dict(t.scheduled) for t in trace[:left.step])
    assert all("offline-0" not in dict(t.scheduled) for t in trace[left.step:])


def test_mixed_batch_equals_each_request_alone_and_static_equals_continuous():
    ps = prompts(6, seed=1)
    params = [greedy(n) for n in (5, 17, 2, 9, 30, 12)]
    mixed = [o.token_ids for o in make_llm().generate(ps, params)]
    alone_llm = make_llm(max_num_seqs=1)
    alone = [alone_llm.generate([p], sp)[0].token_ids for p, sp in zip(ps, params)]
    static = [o.token_ids for o in make_llm(scheduling="static").generate(ps, params)]
    assert mixed == alone == static
    assert [len(t) for t in mixed] == [5, 17, 2, 9, 30, 12]


def test_static_slot_steps_follow_the_seed_arithmetic():
    """The seed's bus: output lengths [20, 25, 30, 40, 50, 60, 700, 800] in 8 slots run
    800 steps; 1725 of the 6400 slot-steps do useful work."""
    lengths = [20, 25, 30, 40, 50, 60, 700, 800]
    llm = make_llm(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=1024, scheduling="static")
    outs = llm.generate(prompts(8, seed=2, hi=16), [greedy(n) for n in lengths])
    assert [len(o.token_ids) for o in outs] == lengths
    st = llm.stats
    assert (st.useful_slot_steps, st.total_slot_steps, st.num_steps) == (1725, 6400, 800)
    # and every request's result came out at the end, with the longest
    assert len({o.finished_time for o in outs}) == 1


def test_too_few_kv_blocks_preempts_and_recomputes_to_the_same_tokens():
    ps = prompts(4, seed=3, lo=20, hi=40)
    params = [greedy(60)] * 4
    ample = [o.token_ids for o in make_llm().generate(ps, params)]
    # 4 sequences of up to ~100 tokens need ~28 blocks of 16; give 14 (one is the null block)
    tight = make_llm(num_kv_blocks=14, max_model_len=128, max_num_batched_tokens=128)
    outs = tight.generate(ps, params)
    assert tight.stats.num_preemptions > 0
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert [o.token_ids for o in outs] == ample
    assert tight.engine.scheduler.allocator.num_used == 0


def test_reserve_admission_never_preempts_and_gives_the_same_tokens():
    ps = prompts(4, seed=3, lo=20, hi=40)
    params = [greedy(60)] * 4
    on_demand = make_llm(num_kv_blocks=14, max_model_len=128, max_num_batched_tokens=128)
    reserve = make_llm(num_kv_blocks=14, max_model_len=128, max_num_batched_tokens=128, kv_admission="reserve")
    a, b = on_demand.generate(ps, params), reserve.generate(ps, params)
    assert on_demand.stats.num_preemptions > 0 and reserve.stats.num_preemptions == 0
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.mark.parametrize("prompt_len", [10, 32, 100])
def test_chunked_prefill_gives_the_same_greedy_tokens(prompt_len):
    """Budget 32: a prompt shorter than, equal to, and three times the budget."""
    ps = prompts(3, seed=4) + [list(range(3, 3 + prompt_len))]
    params = [greedy(8)] * 4
    whole = [o.token_ids for o in make_llm().generate(ps, params)]
    chunked_llm = make_llm(enable_chunked_prefill=True, max_num_batched_tokens=32, record_trace=True)
    chunked = [o.token_ids for o in chunked_llm.generate(ps, params)]
    assert chunked == whole
    assert all(t.num_prefill_tokens + t.num_decode_tokens <= 32 for t in chunked_llm.engine.trace)


def test_no_compilation_after_warmup_during_a_mixed_workload():
    llm = make_llm(warmup=True, max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=True)
    compiled = llm.stats.num_compilations
    assert compiled == len(llm.engine.config.decode_buckets) + len(llm.engine.config.token_buckets)
    ps = prompts(10, seed=5, lo=1, hi=120)
    params = [SamplingParams(max_tokens=int(n), temperature=t, top_p=0.9, top_k=k, seed=i, logprobs=lp, ignore_eos=True)
              for i, (n, t, k, lp) in enumerate(zip([1, 5, 20, 3, 40, 8, 2, 13, 6, 9], [0, 0.7, 1.0] * 4,
                                                    [-1, 5, 50] * 4, [None, 3, None, 1] * 3))]
    outs = llm.generate(ps, params)
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs, params))
    assert llm.stats.num_compilations == compiled


def test_seeded_sampling_does_not_depend_on_the_batch():
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    target = prompts(1, seed=6)[0]
    alone = make_llm().generate([target], sp)[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=0.8, ignore_eos=True) for n in (3, 20, 7)]
    batched = make_llm().generate(prompts(3, seed=7) + [target], others + [sp])[3].token_ids
    assert batched == alone
    other_seed = make_llm().generate([target], SamplingParams(max_tokens=12, temperature=1.0, seed=99,
                                                              ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_top_k_1_is_greedy_and_logprobs_are_consistent():
    llm = make_llm()
    p = prompts(2, seed=8)
    g = llm.generate(p, greedy(10))
    k1 = llm.generate(p, SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=3, logprobs=5, ignore_eos=True))
    assert [o.token_ids for o in k1] == [o.token_ids for o in g]
    for o in k1:
        assert len(o.logprobs) == 10
        for tok, lp in zip(o.token_ids, o.logprobs):
            assert lp.token_id == tok and len(lp.top) == 5
            assert lp.top[0][0] == tok and lp.top[0][1] == pytest.approx(lp.logprob)  # top-k=1: the argmax
            assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
            assert np.exp([v for _, v in lp.top]).sum() <= 1.0 + 1e-5


def test_stop_token_id_finishes_with_stop():
    llm = make_llm()
    p = prompts(1, seed=9)
    free = llm.generate(p, greedy(10))[0].token_ids
    stop = free[4]
    out = llm.generate(p, SamplingParams(max_tokens=10, stop_token_ids=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:free.index(stop) + 1]


def test_request_over_max_model_len_is_a_clear_error():
    llm = make_llm(max_model_len=64, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="over max_model_len"):
        llm.generate([[5] * 60], greedy(10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[100000]], greedy(1))


def test_async_engine_streams_and_abort_frees_slot_and_blocks():
    async def main():
        eng = AsyncEngine(EngineConfig(**SMALL), log=lambda *_: None)
        await eng.start()
        try:
            stream = eng.add_request("a", [5, 6, 7], greedy(200))
            got = []
            async for d in stream:
                got += d.new_token_ids
                if len(got) >= 3:
                    break
            await stream.aclose()  # a client going away: the stream aborts the request
            for _ in range(200):
                if eng.stats.num_requests_running == 0 and eng.stats.kv_cache_usage == 0:
                    break
                await asyncio.sleep(0.01)
            assert eng.stats.num_requests_running == 0 and eng.stats.kv_cache_usage == 0
            assert eng.stats.request_success["abort"] == 1
            done = [d async for d in eng.add_request("b", [5, 6, 7], greedy(5))]
            assert done[-1].finished and done[-1].finish_reason == "length"
            assert sum(len(d.new_token_ids) for d in done) == 5
        finally:
            await eng.shutdown()

    asyncio.run(main())


def test_pallas_backend_in_interpret_mode_gives_the_same_greedy_tokens():
    """--attention-backend pallas on CPU runs the kernels interpreted: slow, so a short
    mixed run (a prefill step with several prompts, a chunked prompt, decodes)."""
    ps = prompts(3, seed=10, lo=5, hi=30)
    params = [greedy(n) for n in (4, 6, 3)]
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=32)
    ref = make_llm(attention_backend="xla", **kw).generate(ps, params)
    pallas = make_llm(attention_backend="pallas", **kw)
    assert pallas.engine.runner.backend.name == "pallas"
    assert [o.token_ids for o in pallas.generate(ps, params)] == [o.token_ids for o in ref]
