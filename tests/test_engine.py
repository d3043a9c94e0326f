"""The engine end to end on CPU: tokens against transformers, step traces, slot-step and
padding accounting, preemption, chunked prefill, sampling, abort. (Compilations are
counted in test_compilation.py, sampling distributions in test_sampling.py.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import hf_greedy

from async_engine import AsyncEngine
from engine import EngineConfig, EngineRequest, SamplingParams, child_requests
from llm import LLM
from sampling_params import StructuredOutputsParams

# The tiny model's shapes in test_sampling_controls', test_request_metrics' and test_kvcache's
# engines (with 14 KV blocks, test_fair_slo's): a cold run compiles each program once for them all.
SMALL = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128, warmup=False)


def make_llm(model: str = "tiny", **kw) -> LLM:
    return LLM(model, log=lambda *_: None, **{**SMALL, **kw})


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, rng.integers(lo, hi)).tolist() for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("family", ["llama2", "llama3", "mistral", "qwen2", "qwen3"])
def test_greedy_generate_equals_transformers(hf_checkpoint, family):
    path = hf_checkpoint(family)
    prompt = [5, 17, 42, 99, 7, 256, 31, 64, 11]
    llm = make_llm(path)
    ours = llm.generate([prompt], greedy(32))[0]
    assert ours.outputs[0].token_ids == hf_greedy(path, prompt, 32)
    assert ours.outputs[0].text == ""  # no tokenizer beside the checkpoint: vLLM's empty text, not None
    with pytest.raises(ValueError, match="this model has no tokenizer"):  # as vLLM's get_tokenizer without one
        llm.get_tokenizer()


def test_finished_request_leaves_in_that_step_and_queued_request_joins_the_next():
    # Synchronous scheduling: the host knows a step's tokens before it schedules the next.
    # (Async, it learns them a step later; see test_async_scheduling.py.)
    # (tiny_async_engine's shapes)
    llm = make_llm(max_num_seqs=2, max_num_batched_tokens=None, record_trace=True, async_scheduling=False)
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
    mixed = [o.outputs[0].token_ids for o in make_llm().generate(ps, params)]
    alone_llm = make_llm()  # the same shapes: one request per generate() has the batch to itself
    alone = [alone_llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(ps, params)]
    static = [o.outputs[0].token_ids for o in make_llm(scheduling="static").generate(ps, params)]
    assert mixed == alone == static
    assert [len(t) for t in mixed] == [5, 17, 2, 9, 30, 12]


@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_decode_rows_follow_the_occupied_slots_and_static_computes_its_empty_seats(scheduling):
    """Prompts of 5, 7 and 9 tokens, 2, 4 and 6 output tokens, 4 slots. Step 1 prefills all
    three: 21 tokens in the 32 bucket, 11 padding rows. Continuous then decodes 3, 2, 2, 1,
    1 rows (buckets 4, 2, 2, 1, 1: one padding row in all); static keeps its finished
    passengers seated, so it computes 3 rows (bucket 4) every step for 3, 2, 2, 1, 1 real
    tokens: 11 padding rows. (The slot-step arithmetic itself is test_scheduler's.)"""
    llm = make_llm(scheduling=scheduling)
    outs = llm.generate([list(range(3, 3 + n)) for n in (5, 7, 9)], [greedy(n) for n in (2, 4, 6)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 4, 6]
    st = llm.stats
    assert (st.num_steps, st.useful_slot_steps, st.total_slot_steps) == (6, 3 + 3 + 2 + 2 + 1 + 1, 6 * 4)
    assert (st.prefill_tokens, st.decode_tokens) == (21, 9)
    assert st.padded_tokens == {"continuous": 11 + 1, "static": 11 + 1 + 2 + 2 + 3 + 3}[scheduling]
    # the model's token rows: 32 for the prefill, then the decode buckets; its LM-head rows: 4
    # (min(32 tokens, 4 slots)) for the prefill, of which 3 sample, then every decode row
    decode_rows = {"continuous": 4 + 2 + 2 + 1 + 1, "static": 5 * 4}[scheduling]
    assert (st.computed_tokens, st.useful_tokens) == (32 + decode_rows, 21 + 9)
    assert st.computed_tokens - st.useful_tokens == st.padded_tokens
    assert (st.computed_logit_rows, st.useful_logit_rows) == (4 + decode_rows, 3 + 9)
    # the counters are Python ints, not numpy scalars: the benches write them to JSON
    assert all(type(v) is int for v in vars(st).values() if isinstance(v, (int, np.integer)) and type(v) is not bool)
    # static releases everyone with the last token; continuous each request as it finishes
    assert len({o.finished_time for o in outs}) == {"continuous": 3, "static": 1}[scheduling]


def test_a_ragged_step_runs_the_lm_head_on_at_most_its_token_count():
    """A 5-token prompt with 32 slots: the 16-token bucket, 16 LM-head rows (a step of 16
    tokens holds at most 16 sequences), not 32; one of them samples."""
    llm = make_llm(max_num_seqs=32, async_scheduling=False)
    llm.generate([[5, 6, 7, 8, 9]], [greedy(1)])
    st = llm.stats
    assert (st.computed_tokens, st.useful_tokens, st.computed_logit_rows, st.useful_logit_rows) == (16, 5, 16, 1)


def test_too_few_kv_blocks_preempts_and_recomputes_to_the_same_tokens():
    """Greedy and seeded requests alike: a seeded request's key is fold_in(seed, tokens
    generated), so after its recompute it resumes the same stream (sampler.py's claim)."""
    ps = prompts(4, seed=3, lo=20, hi=40)
    params = [greedy(60), SamplingParams(max_tokens=60, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)] * 2
    ample = [o.outputs[0].token_ids for o in make_llm().generate(ps, params)]
    # 4 sequences of up to ~100 tokens need ~28 blocks of 16; give 14 (one is the null block)
    tight = make_llm(num_kv_blocks=14)
    outs = tight.generate(ps, params)
    assert tight.stats.num_preemptions > 0
    assert any(o.num_preemptions for o, p in zip(outs, params) if not p.greedy), "a seeded request was preempted"
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 4
    assert [o.outputs[0].token_ids for o in outs] == ample
    assert tight.engine.scheduler.allocator.num_used == 0


def test_reserve_admission_never_preempts_and_gives_the_same_tokens():
    ps = prompts(4, seed=3, lo=20, hi=40)
    params = [greedy(60)] * 4
    on_demand = make_llm(num_kv_blocks=14)
    reserve = make_llm(num_kv_blocks=14, kv_admission="reserve")
    a, b = on_demand.generate(ps, params), reserve.generate(ps, params)
    assert on_demand.stats.num_preemptions > 0 and reserve.stats.num_preemptions == 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


@pytest.mark.parametrize("prompt_len", [10, 32, 100])
def test_chunked_prefill_gives_the_same_greedy_tokens(prompt_len):
    """Budget 32: a prompt shorter than, equal to, and three times the budget."""
    ps = prompts(3, seed=4) + [list(range(3, 3 + prompt_len))]
    params = [greedy(8)] * 4
    whole = [o.outputs[0].token_ids for o in make_llm(enable_chunked_prefill=False).generate(ps, params)]
    chunked_llm = make_llm(enable_chunked_prefill=True, max_num_batched_tokens=32, record_trace=True)
    chunked = [o.outputs[0].token_ids for o in chunked_llm.generate(ps, params)]
    assert chunked == whole
    assert all(t.num_prefill_tokens + t.num_decode_tokens <= 32 for t in chunked_llm.engine.trace)


def test_seeded_sampling_does_not_depend_on_the_batch():
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    target = prompts(1, seed=6)[0]
    alone = make_llm().generate([target], sp)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=0.8, ignore_eos=True) for n in (3, 20, 7)]
    batched = make_llm().generate(prompts(3, seed=7) + [target], others + [sp])[3].outputs[0].token_ids
    assert batched == alone
    other_seed = make_llm().generate([target], SamplingParams(max_tokens=12, temperature=1.0, seed=99,
                                                              ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


def test_top_k_1_is_greedy_and_logprobs_are_consistent():
    llm = make_llm()
    p = prompts(2, seed=8)
    g = llm.generate(p, greedy(10))
    k1 = llm.generate(p, SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=3, logprobs=5, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in k1] == [o.outputs[0].token_ids for o in g]
    for o in (r.outputs[0] for r in k1):
        assert len(o.logprobs) == 10
        for tok, lp in zip(o.token_ids, o.logprobs):
            assert lp.token_id == tok and len(lp.top) == 5
            assert lp.top[0][0] == tok and lp.top[0][1] == pytest.approx(lp.logprob)  # top-k=1: the argmax
            assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
            assert np.exp([v for _, v in lp.top]).sum() <= 1.0 + 1e-5


def test_stop_token_id_finishes_with_stop():
    llm = make_llm()
    p = prompts(1, seed=9)
    free = llm.generate(p, greedy(10))[0].outputs[0].token_ids
    stop = free[4]
    stopped = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop], ignore_eos=True)
    out = llm.generate(p, stopped)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:free.index(stop) + 1]


def test_the_stop_token_rule_is_eos_first_unless_ignored_then_stop_token_ids():
    eos = (2, 3)
    p = SamplingParams(stop_token_ids=[3, 7])
    assert [p.stop_token(t, eos) for t in (2, 3, 7, 5)] == ["eos", "eos", "stop_token_id", None]
    p = SamplingParams(stop_token_ids=[3, 7], ignore_eos=True)
    assert [p.stop_token(t, eos) for t in (2, 3, 7, 5)] == [None, "stop_token_id", "stop_token_id", None]
    assert SamplingParams().stop_token(2, ()) is None


def test_request_over_max_model_len_is_a_clear_error():
    llm = make_llm(max_model_len=64, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="over max_model_len"):
        llm.generate([[5] * 60], greedy(10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[100000]], greedy(1))


def test_async_engine_streams_and_abort_frees_slot_and_blocks():
    async def main():
        eng = AsyncEngine(EngineConfig(model="tiny", **SMALL), log=lambda *_: None)
        await eng.start()
        try:
            stream = eng.add_request(EngineRequest("a", [5, 6, 7], greedy(120)))
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
            done = [d async for d in eng.add_request(EngineRequest("b", [5, 6, 7], greedy(5)))]
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
    assert [o.outputs[0].token_ids for o in pallas.generate(ps, params)] == [o.outputs[0].token_ids for o in ref]


def test_features_combined_give_each_request_its_tokens_alone_stream_them_whole_and_drain_clean():
    """Speculation (ngram), swap preemption under a cache two long requests overflow, chunked
    prefill with a small budget, prefix caching with shared prompts, the fair policy and
    async scheduling, all at once, over greedy, n = 2, seeded, stop-string, logprob and
    choice-constrained requests, one of them aborted mid-way. Each request's tokens are its
    tokens alone on a plain engine (seeded too: ngram verification draws what plain sampling
    draws); its deltas concatenate to its output with one final delta; the stats count what
    ran; every device block, host swap block and slot is free after the drain."""
    kw = dict(max_model_len=128, block_size=8, max_num_seqs=3)
    llm = make_llm(**kw, num_kv_blocks=20, enable_chunked_prefill=True, max_num_batched_tokens=16,
                   preemption_mode="swap", swap_space=0.0005, scheduling_policy="fair", async_scheduling=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                       "prompt_lookup_max": 2})
    # (the file's SMALL shapes, not llm's KV layout; every prompt whole in one step)
    plain = make_llm(enable_prefix_caching=False, async_scheduling=False)
    shared = list(range(40, 56))  # two blocks every prompt below starts with
    ps = [shared + p for p in prompts(6, seed=11, lo=3, hi=20)]
    stop = plain.tokenizer.decode(ps[2][-2:])
    params = [SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True),  # these two overflow the cache
              SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=30, temperature=1.0, seed=7, stop=[stop], n=2),
              SamplingParams(max_tokens=25, temperature=1.0, top_k=20, seed=5, logprobs=1, n=2),
              SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(
                  choice=("yes", "no", "maybe"))),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)]  # aborted after 4 steps
    e = llm.engine
    added = {}
    for i, (p, sp) in enumerate(zip(ps, params)):
        for rid, one, parent in child_requests(f"c{i}", sp):
            added[rid] = (e.add_request(rid, p, one, parent=parent, user=f"u{i % 2}"), p, one)
    streamed = {rid: [] for rid in added}
    finals = {rid: 0 for rid in added}
    steps = 0
    while e.has_unfinished():
        for d in e.step():
            streamed[d.request_id] += d.new_token_ids
            finals[d.request_id] += d.finished
        steps += 1
        if steps == 4:
            e.abort("c5")
    aborted = added.pop("c5")[0]
    assert aborted.finish_reason == "abort" and streamed["c5"] == aborted.output_token_ids[:len(streamed["c5"])]
    for rid, (seq, p, one) in added.items():
        alone = plain.generate([p], one)[0].outputs[0]
        assert seq.output_token_ids == alone.token_ids, rid
        assert streamed[rid] == seq.output_token_ids and finals[rid] == 1, rid
        assert seq.finish_reason == alone.finish_reason, rid
    assert all(stop not in added[f"{i}_c2"][0].stop_matcher.text for i in range(2))
    constrained = added["c4"][0]
    assert constrained.finish_reason == "stop"
    assert plain.tokenizer.decode(constrained.output_token_ids) in ("yes", "no", "maybe")
    st = llm.stats
    assert st.num_preemptions > 0 and st.swapped_out_blocks > 0 and st.recomputed_tokens == 0
    assert st.spec_decode_num_accepted_tokens <= st.spec_decode_num_draft_tokens and st.spec_decode_num_drafts > 0
    assert st.prefix_cache_hits > 0
    assert st.generation_tokens == sum(len(s.output_token_ids) for s, _, _ in added.values()) + len(
        aborted.output_token_ids)
    assert st.request_success == {"stop": sum(s.finish_reason == "stop" for s, _, _ in added.values()),
                                  "length": sum(s.finish_reason == "length" for s, _, _ in added.values()),
                                  "abort": 1, "error": 0}
    # n = 2 requests are observed once each, when their last sample finishes; the aborted one never
    assert st.request_params_n.count == 5 and st.request_params_n.sum == 7
    sch = e.scheduler
    sch.check_invariants()
    assert sch.allocator.num_used == 0 and len(sch._free_slots) == 3
    assert len(sch._host_free) == sch.num_swap_blocks > 0
    assert e.reset_prefix_cache()
