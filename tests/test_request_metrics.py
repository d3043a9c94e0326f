"""Per-request metrics (RequestOutput.metrics, the response's `metrics` object) and the
recompute tax: each record agrees with itself (queue <= TTFT <= e2e) and with what the
scheduler did (its preemptions in the step trace, the tokens it computed again)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llm import LLM, SamplingParams
from metrics import RequestMetrics


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_each_request_s_metrics_are_ordered_and_count_its_preemptions_and_recomputed_tokens():
    """A KV cache too small for four ~100-token sequences, no chunking and no prefix cache:
    every re-admission recomputes exactly the tokens its preemption dropped."""
    lines: list[str] = []
    llm = LLM("tiny", log=lines.append, record_trace=True, async_scheduling=False, warmup=False, max_num_seqs=4,
              max_model_len=128, max_num_batched_tokens=128, num_kv_blocks=14, enable_chunked_prefill=False,
              enable_prefix_caching=False)
    rng = np.random.default_rng(3)
    ps = [rng.integers(3, 250, rng.integers(20, 40)).tolist() for _ in range(4)]
    outs = llm.generate(ps, greedy(60))
    preempted = [rid for t in llm.engine.trace for rid in t.preempted]
    assert preempted, "the cache is small enough to force preemptions"
    for o in outs:
        m = o.metrics
        assert 0 <= m.queue_time_ms <= m.time_to_first_token_ms <= m.e2e_latency_ms
        assert m.time_to_first_token_ms + m.generation_time_ms <= m.e2e_latency_ms + 1e-6
        assert 0 < m.mean_itl_ms <= m.max_itl_ms
        assert abs(m.tokens_per_second * m.generation_time_ms / 1e3 - (len(o.outputs[0].token_ids) - 1)) < 1e-6
        assert m.num_preemptions == o.num_preemptions == preempted.count(o.request_id)
        assert (m.num_recomputed_tokens > 0) == (m.num_preemptions > 0)
        assert m.num_cached_tokens == 0
    lost = {}  # computed tokens each request gave up, from the log lines
    assert len(lines_of := [x for x in lines if x.startswith("preempted ")]) == len(preempted)
    for line in lines_of:
        rid, n = line.split()[1], int(line.split(": ")[1].split()[0])
        lost[rid] = lost.get(rid, 0) + n
    assert {o.request_id: o.metrics.num_recomputed_tokens for o in outs if o.num_preemptions} == lost
    assert llm.stats.recomputed_tokens == sum(lost.values())
    # Prefill = the prompts + what was computed twice + per re-admission its newest token,
    # computed for the first time in the prefill instead of a decode.
    assert llm.stats.prefill_tokens == sum(map(len, ps)) + sum(lost.values()) + len(preempted)


def test_the_preemption_log_s_running_total_counts_each_preemption_and_the_step_in_flight():
    """Each "preempted" line's "N in all" is the preemptions so far, its own included: 1, 2,
    3, ... up to the counter, when one step preempts two sequences, and under async
    scheduling when a step is scheduled (and logged) while the step before it, with
    preemptions of its own, is still on the device."""
    two_in_a_step = in_a_row = False
    for seed in (2, 3):
        lines: list[str] = []
        llm = LLM("tiny", log=lines.append, record_trace=True, async_scheduling=True, warmup=False, max_num_seqs=8,
                  max_model_len=128, max_num_batched_tokens=64, num_kv_blocks=12, enable_prefix_caching=False)
        rng = np.random.default_rng(seed)
        llm.generate([rng.integers(3, 250, rng.integers(10, 30)).tolist() for _ in range(8)], greedy(40))
        totals = [int(x.split(", ")[-1].split()[0]) for x in lines if x.startswith("preempted ")]
        assert totals == list(range(1, llm.stats.num_preemptions + 1)), seed
        preempting = [i for i, t in enumerate(llm.engine.trace) if t.preempted]
        two_in_a_step |= any(len(llm.engine.trace[i].preempted) > 1 for i in preempting)
        in_a_row |= any(i - 1 in preempting for i in preempting)
    assert two_in_a_step and in_a_row, "the workloads cover both cases"


def test_prefix_cache_hits_are_not_recompute():
    """With the prefix cache, a preempted request gets back its named blocks that nobody
    evicted: only the rest is recomputed, and the counters agree."""
    llm = LLM("tiny", log=lambda *_: None, warmup=False, max_num_seqs=4, max_model_len=128,
              max_num_batched_tokens=128, num_kv_blocks=14)
    rng = np.random.default_rng(3)
    outs = llm.generate([rng.integers(3, 250, rng.integers(20, 40)).tolist() for _ in range(4)], greedy(60))
    assert llm.stats.num_preemptions > 0
    assert sum(o.metrics.num_recomputed_tokens for o in outs) == llm.stats.recomputed_tokens
    assert llm.stats.recomputed_tokens <= llm.stats.prefill_tokens - sum(len(o.prompt_token_ids) for o in outs)


def test_the_server_returns_metrics_only_when_enabled_and_asked_in_the_body_or_the_last_chunk():
    import asyncio
    import json

    from aiohttp.test_utils import TestClient, TestServer

    from async_engine import AsyncEngine
    from engine import EngineConfig
    from server import build_app

    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(model="tiny", max_num_seqs=2, max_model_len=128, warmup=False),
                             log=lambda *_: None)
        await engine.start()
        try:
            for enabled in (False, True):
                async with TestClient(TestServer(build_app(engine, ["tiny"], per_request_metrics=enabled))) as c:
                    plain = await (await c.post("/v1/completions", json=body)).json()
                    assert plain["metrics"] is None  # opt-in (null, as vLLM's whole response dumps it)
                    asked = await (await c.post("/v1/completions", json=body | {"include_metrics": True})).json()
                    assert (asked["metrics"] is not None) == enabled, asked
                    if enabled:
                        m = asked["metrics"]
                        assert 0 <= m["queue_time_ms"] <= m["time_to_first_token_ms"] <= m["e2e_latency_ms"]
                        assert m["num_preemptions"] == 0 and m["tokens_per_second"] > 0
                    for usage in (False, True):
                        extra = {"stream": True, "include_metrics": True,
                                 "stream_options": {"include_usage": True} if usage else None}
                        text = await (await c.post("/v1/completions", json=body | extra)).text()
                        events = [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]
                        with_metrics = [i for i, e in enumerate(events) if "metrics" in e]
                        assert with_metrics == ([len(events) - 1] if enabled else []), events
                    bad = await c.post("/v1/completions", json=body | {"include_metrics": 1})
                    assert bad.status == 400
            # A stop string ends the request in the server: the record still comes, taken
            # from the engine's last delta for it (greedy, so the text is known in advance).
            text_body = {"prompt": "hello", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
                         "include_metrics": True}
            async with TestClient(TestServer(build_app(engine, ["tiny"], per_request_metrics=True))) as c:
                whole = (await (await c.post("/v1/completions", json=text_body)).json())["choices"][0]["text"]
                stop = whole[3:5]
                assert stop and whole.index(stop) == 3, whole
                for stream in (False, True):
                    resp = await c.post("/v1/completions", json=text_body | {"stop": [stop], "stream": stream})
                    if stream:
                        text = await resp.text()
                        out = [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")][-1]
                    else:
                        out = await resp.json()
                        assert out["choices"][0]["text"] == whole[:3] and out["choices"][0]["finish_reason"] == "stop"
                    assert out["metrics"]["time_to_first_token_ms"] <= out["metrics"]["e2e_latency_ms"], out
            # Scheduling fields: `user` is OpenAI's and always accepted; an `slo` only under a
            # policy that reads it (this engine's is fcfs), and a malformed one never.
            async with TestClient(TestServer(build_app(engine, ["tiny"]))) as c:
                assert (await c.post("/v1/completions", json=body | {"user": "alice"})).status == 200
                for slo, words in (({"ttft_ms": 100}, "does not read it"), ({"ttft_ms": -1}, "must be a number > 0"),
                                   ({"ttft": 1}, "takes ttft_ms and tpot_ms"), (5, "must be an object")):
                    resp = await c.post("/v1/completions", json=body | {"slo": slo})
                    assert resp.status == 400 and words in (await resp.json())["error"]["message"], slo
                assert (await c.post("/v1/completions", json=body | {"user": 5})).status == 400
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_swap_preemption_gives_the_same_greedy_tokens_with_no_recompute_and_a_full_pool_falls_back():
    """The tight cache of the first test, where two requests are preempted: swapped out and in, the
    tokens equal recompute's and an ample cache's; with a pool of three blocks one of the
    two preemptions falls back to recompute, counted, and the tokens are still the same."""
    from kvcache import kv_cache_bytes_per_block

    rng = np.random.default_rng(3)
    ps = [rng.integers(3, 250, rng.integers(20, 40)).tolist() for _ in range(4)]
    kw = dict(log=lambda *_: None, warmup=False, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128)
    ample = [o.outputs[0].token_ids for o in LLM("tiny", **kw).generate(ps, greedy(60))]
    tight = dict(kw, num_kv_blocks=14)
    recompute = LLM("tiny", **tight)
    assert [o.outputs[0].token_ids for o in recompute.generate(ps, greedy(60))] == ample
    per_block = kv_cache_bytes_per_block(recompute.engine.model_config, 16, recompute.engine.loaded.dtype)
    for blocks, lines in ((None, []), (3, [])):
        space = {} if blocks is None else {"swap_space": blocks * per_block / 2**30}
        llm = LLM("tiny", **dict(tight, log=lines.append), preemption_mode="swap", **space)
        outs = llm.generate(ps, greedy(60))
        st = llm.stats
        assert [o.outputs[0].token_ids for o in outs] == ample
        assert st.num_preemptions > 0 and st.swapped_out_blocks > 0
        assert st.swapped_in_blocks == st.swapped_out_blocks  # every request finished: all came back
        assert st.swapped_out_bytes == st.swapped_out_blocks * per_block
        if blocks is None:
            assert st.recomputed_tokens == 0 and st.swap_fallbacks == 0
            assert all("(swap)" in x for x in lines if x.startswith("preempted "))
        else:
            assert st.swap_fallbacks > 0 and st.recomputed_tokens > 0
        assert llm.engine.scheduler.allocator.num_used == 0
        assert len(llm.engine.scheduler._host_free) == llm.engine.scheduler.num_swap_blocks


def test_the_swap_pool_is_counted_in_the_caches_own_bytes_and_swap_needs_an_admission_that_preempts():
    """--swap-space buys as many blocks as the KV dtype's real bytes allow (an 8-bit cache:
    ~4x those of float32); a reserving admission never preempts, so swap there is refused."""
    from config import EngineConfig
    from kvcache import kv_cache_bytes_per_block

    kw = dict(log=lambda *_: None, warmup=False, max_num_seqs=4, max_model_len=128, num_kv_blocks=14)
    llm = LLM("tiny", **kw, preemption_mode="swap", kv_cache_dtype="int8", swap_space=2**-10)  # 1 MiB
    cfg, dtype = llm.engine.model_config, llm.engine.loaded.dtype
    assert llm.engine.scheduler.num_swap_blocks == 2**20 // kv_cache_bytes_per_block(cfg, 16, dtype, "int8")
    assert llm.engine.scheduler.num_swap_blocks > 3 * (2**20 // kv_cache_bytes_per_block(cfg, 16, dtype))
    with pytest.raises(ValueError, match="never preempts"):
        EngineConfig(model="tiny", preemption_mode="swap", kv_admission="reserve")


def test_the_trace_shows_a_preemption_made_in_a_step_that_ran_nothing():
    """Static batching with a tight cache: a lone sequence gives up its blocks in a step
    that then runs nothing. The trace keeps that step, so its preemptions are the log's
    and the counter's, per request too."""
    lines: list[str] = []
    llm = LLM("tiny", log=lines.append, record_trace=True, warmup=False, scheduling="static", max_num_seqs=4,
              max_model_len=128, max_num_batched_tokens=64, num_kv_blocks=14)
    rng = np.random.default_rng(0)
    ps = [rng.integers(3, 250, int(rng.integers(10, 60))).tolist() for _ in range(6)]
    outs = llm.generate(ps, [greedy(int(m)) for m in rng.integers(5, 60, 6)])
    trace = llm.engine.trace
    assert any(t.preempted and not t.scheduled for t in trace), "the workload has a step that only preempted"
    logged = [x.split()[1] for x in lines if x.startswith("preempted ")]
    traced = [rid for t in trace for rid in t.preempted]
    assert traced == logged and len(traced) == llm.stats.num_preemptions
    assert {o.request_id: o.num_preemptions for o in outs} == {o.request_id: traced.count(o.request_id) for o in outs}


def recomputed_in_trace(trace) -> int:
    """The recompute tax read off a trace (no prefix cache, no speculation): each request's
    positions are computed in order from 0 again after each preemption; a position below the
    highest one reached before is computed again."""
    pos: dict[str, int] = {}
    high: dict[str, int] = {}
    again = 0
    for t in trace:
        for rid in t.preempted:
            high[rid], pos[rid] = max(high.get(rid, 0), pos.get(rid, 0)), 0
        for rid, n in t.scheduled:
            p = pos.get(rid, 0)
            again += max(0, min(p + n, high.get(rid, 0)) - p)
            pos[rid] = p + n
    return again


def test_a_recompute_aborted_while_its_step_is_in_flight_is_counted_nowhere():
    """Async scheduling: a request is aborted while the step recomputing its prompt is on
    the device. That row is discarded (in no trace, no prefill count), so the recompute
    counter leaves it out too: it equals the tax read off the trace."""
    from engine import EngineConfig, LLMEngine

    eng = LLMEngine(EngineConfig(model="tiny", warmup=False, max_num_seqs=4, max_model_len=128, num_kv_blocks=14,
                                 max_num_batched_tokens=16, enable_prefix_caching=False),
                    log=lambda *_: None, record_trace=True)
    rng = np.random.default_rng(0)
    for i in range(4):
        eng.add_request(f"r{i}", rng.integers(3, 250, int(rng.integers(20, 40))).tolist(), greedy(60))
    aborted = None
    while eng.has_unfinished():
        eng.step()
        in_flight = eng._in_flight[-1][0] if eng._in_flight else None
        if aborted is None and in_flight is not None and in_flight.num_recomputed_tokens:
            aborted = next(s.seq.request_id for s in in_flight.scheduled if not s.is_decode and s.seq.num_preemptions)
            eng.abort(aborted)
    assert aborted is not None, "a recompute was in flight"
    assert eng.stats.recomputed_tokens == recomputed_in_trace(eng.trace) > 0
    assert eng.stats.recomputed_tokens <= eng.stats.prefill_tokens


def test_a_request_aborted_while_its_first_step_is_in_flight_was_scheduled():
    """Async scheduling: the abort lands while the request's first step is on the device.
    That step's row is discarded, but the request left the queue when it was scheduled:
    its queue time ends there (not at the abort), the queue-time histogram and the
    prefix-cache lookup count it, and its usage's cached tokens are the hits."""
    from engine import EngineConfig, LLMEngine

    eng = LLMEngine(EngineConfig(model="tiny", warmup=False, max_num_seqs=4, max_model_len=128, num_kv_blocks=14,
                                 max_num_batched_tokens=64), log=lambda *_: None)
    prompt = list(range(3, 40))
    eng.add_request("warm", prompt, greedy(2))
    while eng.has_unfinished():
        eng.step()
    before = eng.stats.snapshot()
    seq = eng.add_request("gone", prompt, greedy(8))
    eng.step()
    assert [s.seq.request_id for o, _, _ in eng._in_flight for s in o.scheduled] == ["gone"]
    last = eng.abort("gone")
    while eng.has_unfinished():
        eng.step()
    m = last.metrics
    assert m.time_to_first_token_ms is None and 0 <= m.queue_time_ms < m.e2e_latency_ms
    s = eng.stats
    assert s.request_queue_time.count - before.request_queue_time.count == 1
    assert s.prefix_cache_queries - before.prefix_cache_queries == len(prompt)
    assert s.prefix_cache_hits - before.prefix_cache_hits == seq.num_cached_tokens == 32


def test_a_request_that_fails_alone_in_its_first_step_was_scheduled_and_is_in_no_latency_histogram():
    """A request whose step inputs fail (the step runs without it) in its first step: it
    finishes "error" once, and in no latency histogram, but it left the queue when it was
    scheduled, as a request aborted in its first step did: the queue-time histogram and the
    prefix-cache lookup count it (its prompt's 32 cached tokens are hits)."""
    from engine import EngineConfig, LLMEngine

    eng = LLMEngine(EngineConfig(model="tiny", warmup=False, max_num_seqs=4, max_model_len=128, num_kv_blocks=14,
                                 max_num_batched_tokens=64), log=lambda *_: None)
    prompt, other = list(range(3, 40)), list(range(100, 110))
    eng.add_request("warm", prompt, greedy(2))
    while eng.has_unfinished():
        eng.step()
    before = eng.stats.snapshot()
    real = eng.runner.execute

    def execute(out):  # a fault in one request's inputs, before the device runs
        if any(s.seq.request_id == "bad" for s in out.scheduled):
            raise OverflowError("bad input")
        return real(out)
    eng.runner.execute = execute
    bad, ok = eng.add_request("bad", prompt, greedy(8)), eng.add_request("ok", other, greedy(3))
    failed = []
    while eng.has_unfinished():
        failed += [d.request_id for d in eng.step() if d.finish_reason == "error"]
    assert failed == ["bad"] and ok.num_output_tokens == 3 and bad.num_output_tokens == 0
    s = eng.stats.snapshot()
    assert {k: s.request_success[k] - before.request_success[k] for k in s.request_success} == \
        {"stop": 0, "length": 1, "abort": 0, "error": 1}
    for h in ("time_to_first_token", "e2e_request_latency", "request_prefill_time", "request_generation_tokens",
              "request_params_n"):
        assert getattr(s, h).count - getattr(before, h).count == 1, h  # "ok" alone
    assert s.request_queue_time.count - before.request_queue_time.count == 2
    assert s.prefix_cache_queries - before.prefix_cache_queries == len(prompt) + len(other)
    assert s.prefix_cache_hits - before.prefix_cache_hits == bad.num_cached_tokens == 32
    m = RequestMetrics.of(bad)
    assert m.time_to_first_token_ms is None and 0 <= m.queue_time_ms < m.e2e_latency_ms


def _stop_at_the_last_token(tokenizer, tokens: list[int]) -> tuple[int, str]:
    """(n, s): a 2-character stop string s that first appears in the whole decode of the
    first n output tokens, ending in the text the n-th one adds."""
    for n in range(3, len(tokens) + 1):
        before, text = tokenizer.decode(tokens[:n - 1]), tokenizer.decode(tokens[:n])
        s = text[-2:]
        if len(text) > len(before) and text.startswith(before) and s.isascii() and s.isprintable() and s not in text[:-1]:
            return n, s
    raise AssertionError("no output ends a stop string at one of its tokens")


def test_a_stop_string_completed_by_the_token_that_reaches_max_tokens_is_a_stop_everywhere():
    """vLLM checks stop strings before the length: the request ends "stop", offline and
    served, and request_success counts it as a stop, never as a length cut; its per-request
    histograms are observed once. The tokens come from a greedy run of the random model;
    the stop string is the text its n-th token completes, and max_tokens is n."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer
    from prometheus_client.parser import text_string_to_metric_families

    from async_engine import AsyncEngine
    from engine import EngineConfig
    from server import build_app

    kw = dict(model="tiny", max_num_seqs=2, max_model_len=128, warmup=False)
    llm = LLM(log=lambda *_: None, **kw)
    tokens = llm.generate(["hello"], greedy(48))[0].outputs[0].token_ids
    n, stop = _stop_at_the_last_token(llm.tokenizer, tokens)
    expected = llm.tokenizer.decode(tokens[:n])[:-2]

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, stop=[stop])
    before = llm.stats.snapshot()
    [out] = llm.generate(["hello"], params)[0].outputs
    after = llm.stats.snapshot()
    assert (out.finish_reason, out.token_ids, out.text) == ("stop", tokens[:n], expected)
    assert after.request_success["stop"] - before.request_success["stop"] == 1
    assert after.request_success["length"] == before.request_success["length"]
    for h in ("e2e_request_latency", "request_generation_tokens", "request_time_per_output_token"):
        assert getattr(after, h).count - getattr(before, h).count == 1, h
    assert after.request_generation_tokens.sum - before.request_generation_tokens.sum == n

    def success(metrics_text: str) -> dict[str, float]:
        return {s.labels["finished_reason"]: s.value for f in text_string_to_metric_families(metrics_text)
                for s in f.samples if s.name == "taxirank:request_success_total"}

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(**kw), log=lambda *_: None)
        await engine.start()
        try:
            async with TestClient(TestServer(build_app(engine, ["tiny"]))) as c:
                body = {"prompt": "hello", "max_tokens": n, "temperature": 0.0, "ignore_eos": True, "stop": [stop]}
                for stream in (False, True):
                    first = success(await (await c.get("/metrics")).text())
                    resp = await c.post("/v1/completions", json=body | {"stream": stream})
                    if stream:
                        events = [json.loads(x[6:]) for x in (await resp.text()).split("\n\n") if x.startswith("data: {")]
                        choice = {"text": "".join(e["choices"][0]["text"] for e in events),
                                  "finish_reason": events[-1]["choices"][0]["finish_reason"],
                                  "stop_reason": events[-1]["choices"][0]["stop_reason"]}
                    else:
                        choice = (await resp.json())["choices"][0]
                    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (expected, "stop", stop)
                    last = success(await (await c.get("/metrics")).text())
                    assert (last["stop"] - first["stop"], last["length"] - first["length"]) == (1, 0), stream
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_offline_requests_arrive_before_their_grammars_compile_so_their_ttft_counts_the_compiles():
    """LLM.generate compiles every prompt's grammar before it queues any (a bad one leaves
    nothing queued), and nothing runs meanwhile: as in vLLM, where the engine compiles them
    after the requests arrived, each request's TTFT counts the compiles it waited for."""
    import time

    from sampling_params import StructuredOutputsParams

    llm = LLM("tiny", log=lambda *_: None, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128,
              warmup=False)
    compiles: list[tuple[float, float]] = []
    arrivals: list[float] = []
    compile_, enqueue = llm.engine.grammars.compile, llm.engine.enqueue

    def timed_compile(spec):
        start = time.monotonic()
        grammar = compile_(spec)
        compiles.append((start, time.monotonic()))
        return grammar

    def kept_enqueue(request, *args, **kwargs):
        seq = enqueue(request, *args, **kwargs)
        arrivals.append(seq.arrival_time)
        return seq
    llm.engine.grammars.compile, llm.engine.enqueue = timed_compile, kept_enqueue
    params = [SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(regex=rx))
              for rx in ("[ab]{3}", "[cd]{3}")]
    outs = llm.generate([[5, 6, 7], [8, 9]], params)
    assert len(compiles) == len(arrivals) == 2
    assert max(arrivals) <= min(start for start, _ in compiles)
    waited = max(end for _, end in compiles) - min(start for start, _ in compiles)
    assert all(o.metrics.time_to_first_token_ms >= 1e3 * waited for o in outs)
