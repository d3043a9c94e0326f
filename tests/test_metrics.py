"""What /metrics exports: every name, its type, HELP line and histogram buckets pinned
here (a dashboard breaks on any rename), and values that make sense after a workload
(a request's first token comes before its last; counters only grow). Rendered through
the collector the server registers and read back with Prometheus' own parser; the
server test checks /metrics itself carries the same families."""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llm import LLM, EngineConfig, SamplingParams
from metrics import ITL_BUCKETS, EngineStats, Histogram
from prometheus import EngineCollector

# name (as the parser reports a family: counters without _total) -> (type, HELP)
EXPORTED = {
    "taxirank:num_requests_running": ("gauge", "Requests in the running batch."),
    "taxirank:num_requests_waiting": ("gauge", "Requests waiting to be admitted."),
    "taxirank:kv_cache_usage_perc": ("gauge", "Fraction of usable KV cache blocks in use (0..1)."),
    "taxirank:slot_utilization": ("gauge", "Useful slot-steps / total slot-steps since start."),
    "taxirank:num_kv_blocks": ("gauge", "Usable KV cache blocks (the null block excluded)."),
    "taxirank:weight_bytes": ("gauge", "Device bytes of the weights, a draft model's included, from the arrays' "
                                       "shards (all local devices)."),
    "taxirank:kv_cache_bytes": ("gauge", "Device bytes of the KV cache, a draft model's included, from the "
                                         "arrays' shards (all local devices)."),
    "taxirank:cache_config_info": ("gauge", "KV cache configuration as labels (value 1)."),
    "taxirank:num_requests_waiting_by_reason": ("gauge", "Waiting requests by vLLM's reason: capacity or deferred."),
    "taxirank:num_requests_waiting_by_wait_reason": ("gauge", "Waiting requests by what they wait for."),
    "taxirank:num_preemptions": ("counter", "Sequences preempted (recompute or swap)."),
    "taxirank:recomputed_tokens": ("counter", "Tokens computed again after a preemption dropped them."),
    "taxirank:swapped_out_blocks": ("counter", "KV blocks copied to the host pool by swap preemption."),
    "taxirank:swapped_in_blocks": ("counter", "KV blocks copied back from the host pool."),
    "taxirank:swapped_out_bytes": ("counter", "Bytes of KV copied to the host pool."),
    "taxirank:swapped_in_bytes": ("counter", "Bytes of KV copied back from the host pool."),
    "taxirank:swap_fallbacks": ("counter", "Swap preemptions that recomputed: the host pool was full."),
    "taxirank:prompt_tokens": ("counter", "Prompt tokens of requests whose prefill completed (at their first token)."),
    "taxirank:prompt_tokens_cached": ("counter", "Prompt tokens of requests whose prefill completed that the prefix "
                                                  "cache served."),
    "taxirank:prompt_tokens_recomputed": ("counter", "Prompt tokens the prefix cache held that were computed again "
                                                      "(the last, for its logits)."),
    "taxirank:prompt_tokens_by_source": ("counter", "Prompt tokens of requests whose prefill completed, by source: "
                                                    "computed, or held by the prefix cache."),
    "taxirank:generation_tokens": ("counter", "Generated tokens."),
    "taxirank:prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix cache (first admissions)."),
    "taxirank:prefix_cache_hits": ("counter", "Prompt tokens served from the prefix cache (first admissions)."),
    "taxirank:prefix_cache_evictions": ("counter",
                                        "Cached KV blocks handed out again for other tokens (their prefix left the cache)."),
    "taxirank:num_compilations": ("counter", "XLA compilations of step functions."),
    "taxirank:num_steps": ("counter", "Engine steps."),
    "taxirank:num_decode_steps": ("counter", "Engine steps that carried no prompt tokens."),
    "taxirank:prefill_tokens": ("counter", "Prompt tokens computed, recompute after preemption included."),
    "taxirank:decode_tokens": ("counter", "Decode tokens computed."),
    "taxirank:padded_tokens": ("counter", "Token rows computed only to fill a shape bucket."),
    "taxirank:computed_tokens": ("counter", "Token rows computed by the model, bucket padding included."),
    "taxirank:useful_tokens": ("counter", "Token rows computed for a scheduled sequence's real token."),
    "taxirank:computed_logit_rows": ("counter", "Rows the LM head and sampler computed, padding included."),
    "taxirank:useful_logit_rows": ("counter", "LM-head rows whose token was sampled."),
    "taxirank:useful_slot_steps": ("counter", "Slot-steps whose sequence made progress."),
    "taxirank:total_slot_steps": ("counter", "Slot-steps run (max_num_seqs per step)."),
    "taxirank:structured_output_steps": ("counter", "Steps that sampled a row under a structured-output bitmask."),
    "taxirank:structured_output_bitmask_seconds": (
        "counter", "Host time filling structured-output bitmasks (it overlaps the step's forward)."),
    "taxirank:constrained_sample_steps": (
        "counter", "Steps whose sampling waited for the previous step's tokens (grammars, logits processors)."),
    "taxirank:request_success": ("counter", "Finished requests by finish reason."),
    "taxirank:time_to_first_token_seconds": ("histogram", "Time to first token."),
    "taxirank:inter_token_latency_seconds": ("histogram", "Time between consecutive output tokens."),
    "taxirank:e2e_request_latency_seconds": ("histogram", "Arrival to last token."),
    "taxirank:request_queue_time_seconds": ("histogram", "Arrival to first scheduled."),
    "taxirank:iteration_tokens_total": ("histogram", "Tokens per engine step: computed tokens of prompts completed, "
                                                     "and tokens generated."),
    "taxirank:request_prompt_tokens": ("histogram", "Prompt tokens per finished request."),
    "taxirank:request_generation_tokens": ("histogram", "Generated tokens per finished request."),
    "taxirank:request_params_max_tokens": ("histogram", "The max_tokens parameter per finished request."),
    "taxirank:request_prefill_kv_computed_tokens": ("histogram", "Prompt tokens computed per finished request (its "
                                                                 "prefix-cache hit excluded)."),
    "taxirank:request_params_n": ("histogram", "The n parameter per finished request."),
    "taxirank:request_max_num_generation_tokens": (
        "histogram", "Per finished request: the most tokens one of its n samples generated."),
    "taxirank:request_time_per_output_token_seconds": ("histogram",
                                                       "Per request: decode time / (generated tokens - 1)."),
    "taxirank:request_inference_time_seconds": ("histogram", "First scheduled to last token (RUNNING phase)."),
    "taxirank:request_prefill_time_seconds": ("histogram", "First scheduled to first token (PREFILL phase)."),
    "taxirank:request_decode_time_seconds": ("histogram", "First token to last token (DECODE phase)."),
}
# Only with a speculative config (vLLM's SpecDecodingProm): each is absent otherwise.
SPEC_EXPORTED = {
    "taxirank:spec_decode_num_drafts": ("counter", "Speculative proposals verified."),
    "taxirank:spec_decode_num_draft_tokens": ("counter", "Draft tokens verified."),
    "taxirank:spec_decode_num_accepted_tokens": ("counter", "Draft tokens accepted."),
    "taxirank:spec_decode_num_accepted_tokens_per_pos": ("counter", "Draft tokens accepted, by position in the "
                                                                    "proposal."),
}
# vLLM's bucket bounds for the same histograms, so its dashboards carry over.
E2E = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
       1920.0, 7680.0]
TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
BUCKETS = {
    "taxirank:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                             2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "taxirank:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                             5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "taxirank:e2e_request_latency_seconds": E2E,
    "taxirank:request_queue_time_seconds": E2E,
    "taxirank:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    # vLLM's build_1_2_5_buckets(max_model_len), here 2048 (the pin test's)
    "taxirank:request_prompt_tokens": TOKENS,
    "taxirank:request_generation_tokens": TOKENS,
    "taxirank:request_params_max_tokens": TOKENS,
    "taxirank:request_prefill_kv_computed_tokens": TOKENS,
    "taxirank:request_max_num_generation_tokens": TOKENS,
    "taxirank:request_params_n": [1, 2, 5, 10, 20],
    "taxirank:request_time_per_output_token_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                                       1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "taxirank:request_inference_time_seconds": E2E,
    "taxirank:request_prefill_time_seconds": E2E,
    "taxirank:request_decode_time_seconds": E2E,
}
# vLLM's reasons (its loggers.py WAITING_REASON_*); then the scheduler's and the static
# batching's (policy.Static.wait_reason)
LABELS = {"taxirank:num_requests_waiting_by_reason": ("reason", {"capacity", "deferred"}),
          "taxirank:num_requests_waiting_by_wait_reason": ("reason", {"kv_blocks", "max_num_seqs", "token_budget",
                                                                      "policy", "static_batch"}),
          "taxirank:request_success": ("finished_reason", {"stop", "length", "abort", "error"}),
          # vLLM's PromptTokenStats.ALL_SOURCES
          "taxirank:prompt_tokens_by_source": ("source", {"local_compute", "local_cache_hit", "external_kv_transfer"})}


def render(stats: EngineStats) -> dict:
    """family name -> parsed family, from the text the server's collector renders."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats))
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def samples(families: dict) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}


def cumulative(families: dict, name: str) -> list[tuple[float, float]]:
    return [(float(s.labels["le"]), s.value) for s in families[name].samples if s.name == name + "_bucket"]


def test_every_exported_name_type_help_and_bucket_bound_is_pinned():
    fams = render(EngineStats(max_model_len=2048))
    assert {n: (f.type, f.documentation) for n, f in fams.items()} == EXPORTED
    for name, bounds in BUCKETS.items():
        assert [le for le, _ in cumulative(fams, name)] == [*bounds, math.inf], name
    for name, (label, values) in LABELS.items():
        assert {s.labels[label] for s in fams[name].samples} == values, name
    for name, (kind, _) in EXPORTED.items():
        suffixes = {"gauge": {""}, "counter": {"_total"}, "histogram": {"_bucket", "_sum", "_count"}}[kind]
        assert {s.name.removeprefix(name) for s in fams[name].samples} == suffixes, name


def test_waiting_by_reason_is_vllms_capacity_and_deferred_summing_to_waiting():
    """vLLM's num_requests_waiting_by_reason sums to num_requests_waiting over its two reasons;
    every request in the scheduler's queue waits for capacity, whatever the scheduler says it
    waits for (only a grammar compiling defers one: the next test)."""
    stats = EngineStats(max_model_len=2048)
    stats.num_requests_waiting = 5  # one just arrived: no schedule() has given it a wait reason yet
    stats.waiting_by_reason = dict.fromkeys(stats.waiting_by_reason, 0) | {"kv_blocks": 3, "policy": 1}
    got = samples(render(stats))
    assert {k[1]: v for k, v in got.items() if k[0] == "taxirank:num_requests_waiting_by_reason"} == \
        {(("reason", "capacity"),): 5, (("reason", "deferred"),): 0}
    assert got[("taxirank:num_requests_waiting_by_wait_reason", (("reason", "kv_blocks"),))] == 3


def test_requests_compiling_their_grammar_wait_deferred_as_vllms():
    """vLLM's engine keeps a request whose grammar compiles in its waiting queue
    (WAITING_FOR_FSM): in num_requests_waiting, by reason "deferred". Here the server
    compiles before the engine sees the request, and counts its engine requests so while it
    does: during the compile, not after, a grammar refused with a 400 included."""
    import asyncio
    from types import SimpleNamespace

    from protocol import ApiError
    from sampling_params import StructuredOutputsParams
    from serving import compile_grammar

    stats, during = EngineStats(max_model_len=2048), []
    stats.num_requests_waiting = 4  # in the scheduler's queue

    def waiting() -> tuple[float, float, float]:
        got = samples(render(stats))
        return (got[("taxirank:num_requests_waiting", ())],
                *(got[("taxirank:num_requests_waiting_by_reason", (("reason", r),))] for r in ("capacity", "deferred")))

    def compile_(spec: StructuredOutputsParams) -> str:
        during.append(waiting())
        if spec.regex == "(":
            raise ValueError("unbalanced")
        return "compiled"
    engine = SimpleNamespace(stats=stats, grammars=SimpleNamespace(compile=compile_))
    for regex in ("a+", "("):
        body = {"structured_outputs": {"regex": regex}}
        params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex))
        try:
            assert asyncio.run(compile_grammar(engine, params, body, None, 3)) == "compiled"
        except ApiError:
            assert regex == "("
        assert waiting() == (4, 4, 0)
    assert during == [(7, 4, 3)] * 2


def test_spec_decode_counters_are_served_only_with_a_speculative_config():
    """As vLLM's SpecDecodingProm: an engine without --speculative-config has no spec_decode_*
    series; one with it has them from the start, a per-position series for each of its k
    draft positions (at 0 before any proposal)."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from async_engine import AsyncEngine
    from server import build_app

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}

    async def scrape(speculative_config: dict | None) -> dict:
        engine = AsyncEngine(EngineConfig(model="tiny", max_num_seqs=2, max_model_len=64, num_kv_blocks=16,
                                          warmup=False, speculative_config=speculative_config), log=lambda *_: None)
        await engine.start()
        try:
            async with TestClient(TestServer(build_app(engine, ["tiny"]))) as c:
                text = await (await c.get("/metrics")).text()
                return {f.name: f for f in text_string_to_metric_families(text)}
        finally:
            await engine.shutdown()

    off, on = asyncio.run(scrape(None)), asyncio.run(scrape(ngram))
    assert {n: (f.type, f.documentation) for n, f in off.items()} == EXPORTED
    assert {n: (f.type, f.documentation) for n, f in on.items()} == EXPORTED | SPEC_EXPORTED
    per_pos = on["taxirank:spec_decode_num_accepted_tokens_per_pos"].samples
    assert sorted((s.labels["position"], s.value) for s in per_pos) == [("0", 0), ("1", 0), ("2", 0)]
    assert {s.value for n in SPEC_EXPORTED for s in on[n].samples} == {0}


def test_values_after_a_workload_are_sane_and_counters_only_grow():
    # test_engine's SMALL shapes (their programs compiled once in a run): prompts of up to 39
    # tokens and 17 more fit 128; six requests queue for four seats; 33 blocks, none preempted
    llm = LLM("tiny", log=lambda *_: None, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128,
              warmup=False)
    rng = np.random.default_rng(0)
    lens = [3, 9, 17, 5, 12, 7]
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in rng.integers(4, 40, len(lens))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
    llm.generate(prompts[:3], params[:3])
    first = render(llm.stats.snapshot())
    llm.generate(prompts, params)
    second = render(llm.stats.snapshot())
    a, b = samples(first), samples(second)
    assert a.keys() == b.keys()
    grew = [k for k in a if not k[0].startswith(("taxirank:num_requests", "taxirank:kv_cache", "taxirank:slot", "taxirank:cache",
                                                 "taxirank:num_kv"))]
    assert [k for k in grew if b[k] < a[k]] == [], "a counter or histogram went down"

    def val(name: str, **labels: str) -> float:
        return b[(name, tuple(sorted(labels.items())))]
    n = 3 + len(lens)
    assert val("taxirank:generation_tokens_total") == 2 * sum(lens[:3]) + sum(lens[3:])
    assert val("taxirank:generation_tokens_total") - a[("taxirank:generation_tokens_total", ())] == sum(lens)
    assert val("taxirank:request_success_total", finished_reason="length") == n
    assert llm.engine.num_kv_blocks == 4 * 128 // 16 + 1  # the CPU default: every seat's whole length, and the null
    assert val("taxirank:num_kv_blocks") == 32 and val("taxirank:kv_cache_usage_perc") == 0
    assert llm.stats.num_preemptions == 0
    # memory, as the arrays hold it: the tiny model's parameters and the cache's blocks
    assert val("taxirank:weight_bytes") == 4 * sum(p.size for p in jax.tree.leaves(nnx.state(llm.engine.loaded.model,
                                                                                              nnx.Param)))
    assert val("taxirank:kv_cache_bytes") == 2 * 2 * 33 * 16 * 2 * 16 * 4  # K,V x layers x blocks x bs x heads x D x f32
    assert val("taxirank:num_requests_running") == val("taxirank:num_requests_waiting") == 0
    assert 0 < val("taxirank:slot_utilization") <= 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
              "request_time_per_output_token_seconds", "request_inference_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert val(f"taxirank:{h}_count") == n, h
    # every request's ITLs: one per token after its first
    assert val("taxirank:inter_token_latency_seconds_count") == 2 * sum(lens[:3]) + sum(lens[3:]) - n
    # Per request, queue time <= TTFT <= e2e: so at every bound, at least as many requests
    # had queued by then as had their first token, and at least as many of those as had finished.
    queue, ttft, e2e = (dict(cumulative(second, f"taxirank:{h}")) for h in
                        ("request_queue_time_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds"))
    for le in sorted(set(queue) & set(ttft) & set(e2e)):
        assert queue[le] >= ttft[le] >= e2e[le], le
    sums = [val(f"taxirank:{h}_sum") for h in ("request_queue_time_seconds", "time_to_first_token_seconds",
                                                "e2e_request_latency_seconds")]
    assert 0 <= sums[0] <= sums[1] <= sums[2]
    steps = val("taxirank:num_steps_total")
    assert val("taxirank:iteration_tokens_total_count") <= steps  # a step that emitted nothing is not observed
    computed = val("taxirank:prompt_tokens_by_source_total", source="local_compute")
    assert val("taxirank:iteration_tokens_total_sum") == computed + val("taxirank:generation_tokens_total")
    assert computed + val("taxirank:prompt_tokens_cached_total") == val("taxirank:prompt_tokens_total")
    assert val("taxirank:prompt_tokens_recomputed_total") == 0  # random prompts: no cache hit to compute again
    assert val("taxirank:total_slot_steps_total") == 4 * steps
    assert val("taxirank:num_decode_steps_total") < steps


def test_per_request_histograms_sum_the_known_totals_and_the_requests_metrics():
    """Each finished request is observed once: the token histograms sum the prompt lengths,
    outputs and max_tokens the test chose; the time histograms sum what each request's own
    RequestMetrics reports (prefill = TTFT - queue, decode = generation time, inference
    both, TPOT = mean ITL, or 0 for a one-token request)."""
    # tiny_async_engine's shapes (compiled once in a run); the longest request, 60 + 11
    # tokens, fits 128, and two of them fit the 16 usable blocks
    llm = LLM("tiny", log=lambda *_: None, max_num_seqs=2, max_model_len=128, warmup=False)
    rng = np.random.default_rng(1)
    lens, max_tokens = [5, 33, 12, 2, 60], [1, 7, 20, 3, 11]
    prompts = [rng.integers(3, 250, n).tolist() for n in lens]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                  for m in max_tokens])
    fams = render(llm.stats.snapshot())
    got = samples(fams)

    def count_sum(name: str) -> tuple[float, float]:
        return got[(f"taxirank:{name}_count", ())], got[(f"taxirank:{name}_sum", ())]
    assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens  # ignore_eos: each runs to its max_tokens
    assert count_sum("request_prompt_tokens") == (5, sum(lens))
    assert count_sum("request_generation_tokens") == (5, sum(max_tokens))
    assert count_sum("request_params_max_tokens") == (5, sum(max_tokens))
    # build_1_2_5_buckets(128); a prompt of 60 tokens is in the 100 bucket, not the 50
    assert [le for le, _ in cumulative(fams, "taxirank:request_prompt_tokens")] == [1, 2, 5, 10, 20, 50, 100, math.inf]
    assert dict(cumulative(fams, "taxirank:request_prompt_tokens"))[50] == 4
    ms = [o.metrics for o in outs]
    expected = {
        "request_prefill_time_seconds": [m.time_to_first_token_ms - m.queue_time_ms for m in ms],
        "request_decode_time_seconds": [m.generation_time_ms for m in ms],
        "request_inference_time_seconds": [m.time_to_first_token_ms - m.queue_time_ms + m.generation_time_ms
                                           for m in ms],
        "request_time_per_output_token_seconds": [m.mean_itl_ms or 0.0 for m in ms],
    }
    for name, per_request_ms in expected.items():
        count, total = count_sum(name)
        assert count == 5, name
        assert math.isclose(total, sum(per_request_ms) / 1e3, rel_tol=1e-6, abs_tol=1e-9), name
    assert ms[0].mean_itl_ms is None  # the one-token request: TPOT observed as 0, as vLLM



def test_iteration_tokens_are_vllm_v1s_computed_prompts_plus_generated_tokens():
    """vLLM V1's iteration_tokens_total: per step that emitted a token, the computed prompt
    tokens (a prefix-cache hit left out) of the requests whose first token came in it plus
    every token emitted; prompt chunks that emit nothing are not observed. Counts known from
    the workload: a 20-token prompt in chunks of 8, 8, 4 (the last with its first token),
    then two decodes -> 21, 1, 1; then prompts of 3 and 4 tokens prefilled together -> 3 + 4
    + 2 = 9, then 2, 2; then the 20-token prompt again, its first block (16 tokens) cached ->
    4 + 1 = 5, then 1, 1. vLLM's prompt-token counters and prefill histogram say the same."""
    llm = LLM("tiny", log=lambda *_: None, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=8,
              num_kv_blocks=16, warmup=False)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(3, 23))], params)
    llm.generate([[5, 6, 7], [8, 9, 10, 11]], params)
    llm.generate([list(range(3, 23))], params)
    s = llm.stats.snapshot()
    h = s.iteration_tokens
    observed = [21, 1, 1, 9, 2, 2, 5, 1, 1]
    assert (h.count, h.sum) == (len(observed), sum(observed))
    cum = dict(h.cumulative())
    assert (cum[1], cum[8], cum[16], cum[32]) == (4, 7, 8, 9)
    computed = 20 + 3 + 4 + (20 - 16)
    assert (s.prompt_tokens, s.prompt_tokens_cached) == (47, 16)
    assert (s.prompt_tokens_local_compute, s.prompt_tokens_local_cache_hit) == (computed, 16)
    k = s.request_prefill_kv_computed_tokens
    assert (k.count, k.sum) == (4, computed)
    # A 17-token prompt, then again with all but its last token cached (one block of 16): the
    # last is computed again for its logits, and local_cache_hit counts it too, as vLLM's.
    llm.generate([list(range(30, 47))], params)
    llm.generate([list(range(30, 47))], params)
    t = llm.stats.snapshot()
    assert t.prompt_tokens_cached - s.prompt_tokens_cached == 16
    assert t.prompt_tokens_local_compute - s.prompt_tokens_local_compute == 17 + 1
    assert t.prompt_tokens_local_cache_hit - s.prompt_tokens_local_cache_hit == 16 + 1
    # vLLM's prompt_tokens_recomputed: that one token, and so its invariant
    # local_compute + local_cache_hit - recomputed == prompt tokens
    got = samples(render(t))
    assert (s.prompt_tokens_recomputed, got[("taxirank:prompt_tokens_recomputed_total", ())]) == (0, 1)
    assert t.prompt_tokens_local_compute + t.prompt_tokens_local_cache_hit - 1 == t.prompt_tokens == 47 + 2 * 17

# Values on and around the bucket bounds (Prometheus' `le`: a value equal to a bound
# belongs to that bucket), far outside them, and anything in between.
values = st.one_of(st.sampled_from([*ITL_BUCKETS, 0.0, 1e9]),
                   st.floats(min_value=0.0, max_value=200.0, allow_nan=False))


@settings(max_examples=200, deadline=None)
@given(st.lists(values, max_size=300))
def test_observe_many_equals_observe_one_by_one(vals):
    one, many = Histogram(ITL_BUCKETS), Histogram(ITL_BUCKETS)
    for v in vals:
        one.observe(v)
    many.observe_many(vals)
    assert many.counts == one.counts and many.count == one.count
    assert abs(many.sum - one.sum) <= 1e-9 * max(1.0, abs(one.sum))


@given(st.lists(values, max_size=50))
def test_a_bucket_counts_the_values_at_or_below_its_bound(vals):
    h = Histogram(ITL_BUCKETS)
    h.observe_many(vals)
    assert h.cumulative() == [(le, sum(v <= le for v in vals)) for le in [*ITL_BUCKETS, math.inf]]


def test_request_params_n_and_max_generation_tokens_are_observed_once_per_request_offline():
    """vLLM's request_params_n and request_max_num_generation_tokens: one observation per
    request (not per sample), when its last sample finishes, of its n and of the longest of
    its samples, read here off the RequestOutputs themselves."""
    llm = LLM("tiny", log=lambda *_: None, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128,
              warmup=False)  # test_engine's SMALL: 4 seats of 34 tokens at most take 12 of its 32 blocks
    ns = [3, 1, 6, 2]
    params = [SamplingParams(n=n, max_tokens=m, temperature=1.0, seed=i)
              for i, (n, m) in enumerate(zip(ns, [9, 4, 30, 12]))]
    outs = llm.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], params)
    s = llm.stats.snapshot()
    longest = [max(len(o.token_ids) for o in out.outputs) for out in outs]
    assert [len(out.outputs) for out in outs] == ns
    assert (s.request_params_n.count, s.request_params_n.sum) == (4, sum(ns))
    assert dict(s.request_params_n.cumulative()) == {1: 1, 2: 2, 5: 3, 10: 4, 20: 4, math.inf: 4}
    assert (s.request_max_num_generation_tokens.count, s.request_max_num_generation_tokens.sum) == (4, sum(longest))
    assert s.request_generation_tokens.count == sum(ns)  # the per-sample histograms still see every sample


def test_served_n_cache_config_info_and_their_exported_families():
    """Through the server's /metrics, every series labelled with vLLM's model_name (the
    served name) and engine (cache_config_info, as vLLM's, with engine alone): an n=3
    request and a streamed n=2 one are two observations of request_params_n (buckets 2
    and 5), their longest samples' lengths (max_tokens, each running to it) those of
    request_max_num_generation_tokens; an n=2 request whose client leaves after its first
    chunk (its samples aborted) is neither.
    cache_config_info's labels are the config's, as vLLM's CacheConfig writes them."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from async_engine import AsyncEngine
    from server import build_app

    config = EngineConfig(model="tiny", max_num_seqs=4, max_model_len=256, num_kv_blocks=64, warmup=False)

    def scrape(text: str) -> dict:
        return {f.name: f for f in text_string_to_metric_families(text)}

    async def main() -> tuple[dict, dict]:
        engine = AsyncEngine(config, log=lambda *_: None)
        await engine.start()
        try:
            async with TestClient(TestServer(build_app(engine, ["tiny"]))) as c:
                before = scrape(await (await c.get("/metrics")).text())
                body = {"prompt": "hello", "temperature": 1.0, "ignore_eos": True}
                whole = await (await c.post("/v1/completions", json=body | {"n": 3, "max_tokens": 5})).json()
                assert [ch["finish_reason"] for ch in whole["choices"]] == ["length"] * 3
                streamed = await (await c.post("/v1/completions", json=body | {"n": 2, "max_tokens": 7,
                                                                                 "stream": True})).text()
                assert streamed.count('"finish_reason": "length"') == 2
                resp = await c.post("/v1/completions", json=body | {"n": 2, "max_tokens": 200, "stream": True})
                await resp.content.readline()  # its first event: then the client leaves
                resp.close()
                while engine.stats.snapshot().request_success["abort"] < 2:
                    await asyncio.sleep(0.01)
                return before, scrape(await (await c.get("/metrics")).text())
        finally:
            await engine.shutdown()

    before, after = asyncio.run(main())

    def delta(name: str) -> dict[float, float]:
        a, b = dict(cumulative(before, name)), dict(cumulative(after, name))
        return {le: b[le] - a[le] for le in b}
    assert delta("taxirank:request_params_n") == {1: 0, 2: 1, 5: 2, 10: 2, 20: 2, math.inf: 2}
    vllm_labels = (("engine", "0"), ("model_name", "tiny"))  # on every series, as vLLM's
    got = samples(after)
    assert got[("taxirank:request_params_n_sum", vllm_labels)] == 3 + 2
    assert got[("taxirank:request_max_num_generation_tokens_count", vllm_labels)] == 2
    assert got[("taxirank:request_max_num_generation_tokens_sum", vllm_labels)] == 5 + 7
    assert delta("taxirank:request_max_num_generation_tokens")[5] == 1
    [info] = after["taxirank:cache_config_info"].samples
    assert info.value == 1 and info.labels == {"engine": "0"} | {  # vLLM's: no model_name on it
        "block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9",
        "swap_space": "4.0", "num_gpu_blocks_override": "64", "kv_cache_memory_bytes": "None",
        "num_gpu_blocks": "64", "num_cpu_blocks": "0"}
    assert {n: (f.type, f.documentation) for n, f in after.items()} == EXPORTED
    own = {"le", "reason", "finished_reason", "source"}  # a family's own label
    assert {k for f in after.values() for s in f.samples for k in s.labels} - own == {"model_name", "engine"} | \
        set(info.labels)
    assert all(s.labels.get("model_name", "tiny") == "tiny" and s.labels["engine"] == "0"
               for f in after.values() for s in f.samples)
    assert [n for n, f in after.items() if any("model_name" not in s.labels for s in f.samples)] == \
        ["taxirank:cache_config_info"]


def test_a_served_request_arrives_before_its_grammar_compiles_so_its_latencies_count_the_compile():
    """As vLLM's: a request arrives once tokenized, and its grammar compiles while it waits
    (vLLM's scheduler holds it WAITING_FOR_FSM), so its queue time, TTFT and e2e include the
    compile. The server compiles it before handing the request to the engine: the arrival
    the engine keeps is the one taken before the compile began."""
    import asyncio
    import time

    from aiohttp.test_utils import TestClient, TestServer

    from async_engine import AsyncEngine
    from server import build_app

    compiles: list[tuple[float, float]] = []
    arrivals: list[float] = []

    async def main() -> tuple[EngineStats, EngineStats]:
        engine = AsyncEngine(EngineConfig(model="tiny", max_num_seqs=2, max_model_len=64, num_kv_blocks=16,
                                          warmup=False), log=lambda *_: None)
        compile_, enqueue = engine.grammars.compile, engine.engine.enqueue

        def timed_compile(spec):  # (on the server's executor)
            start = time.monotonic()
            grammar = compile_(spec)
            compiles.append((start, time.monotonic()))
            return grammar

        def kept_enqueue(request, *args, **kwargs):  # (on the engine's thread)
            seq = enqueue(request, *args, **kwargs)
            arrivals.append(seq.arrival_time)
            return seq
        engine.grammars.compile, engine.engine.enqueue = timed_compile, kept_enqueue
        await engine.start()
        try:
            async with TestClient(TestServer(build_app(engine, ["tiny"]))) as c:
                body = {"prompt": [5, 6, 7], "max_tokens": 3, "structured_outputs": {"regex": "[ab]{3}"}}
                before = engine.stats.snapshot()
                assert (await c.post("/v1/completions", json=body)).status == 200
                return before, engine.stats.snapshot()
        finally:
            await engine.shutdown()

    before, after = asyncio.run(main())
    [(start, end)], [arrival] = compiles, arrivals
    assert arrival <= start
    for h in ("time_to_first_token", "request_queue_time", "e2e_request_latency"):
        b, a = getattr(before, h), getattr(after, h)
        assert a.count - b.count == 1 and a.sum - b.sum >= end - start, h
