"""The engine's numbers in Prometheus's text format, for GET /metrics (vLLM's
metrics/prometheus layer): one collector that renders EngineStats.snapshot() at scrape
time, under vLLM's metric names where vLLM has the number."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from metrics import EngineStats

PREFIX = "taxirank:"
ENGINE = "0"  # vLLM's engine label (its data-parallel rank): one engine per server
_GAUGES = [  # (metric, EngineStats attribute, help)
    ("num_requests_running", "num_requests_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_requests_waiting_all", "Requests waiting to be admitted."),
    ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of usable KV cache blocks in use (0..1)."),
    ("slot_utilization", "slot_utilization", "Useful slot-steps / total slot-steps since start."),
    ("num_kv_blocks", "num_kv_blocks", "Usable KV cache blocks (the null block excluded)."),
    ("weight_bytes", "weight_bytes", "Device bytes of the weights, a draft model's included, from the arrays' "
     "shards (all local devices)."),
    ("kv_cache_bytes", "kv_cache_bytes", "Device bytes of the KV cache, a draft model's included, from the arrays' "
     "shards (all local devices)."),
]
_COUNTERS = [  # vLLM's names first; the rest have no vLLM counterpart
    ("num_preemptions", "num_preemptions", "Sequences preempted (recompute or swap)."),
    ("recomputed_tokens", "recomputed_tokens", "Tokens computed again after a preemption dropped them."),
    ("swapped_out_blocks", "swapped_out_blocks", "KV blocks copied to the host pool by swap preemption."),
    ("swapped_in_blocks", "swapped_in_blocks", "KV blocks copied back from the host pool."),
    ("swapped_out_bytes", "swapped_out_bytes", "Bytes of KV copied to the host pool."),
    ("swapped_in_bytes", "swapped_in_bytes", "Bytes of KV copied back from the host pool."),
    ("swap_fallbacks", "swap_fallbacks", "Swap preemptions that recomputed: the host pool was full."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of requests whose prefill completed (at their first token)."),
    ("prompt_tokens_cached", "prompt_tokens_cached",
     "Prompt tokens of requests whose prefill completed that the prefix cache served."),
    ("prompt_tokens_recomputed", "prompt_tokens_recomputed",
     "Prompt tokens the prefix cache held that were computed again (the last, for its logits)."),
    ("generation_tokens", "generation_tokens", "Generated tokens."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache (first admissions)."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens served from the prefix cache (first admissions)."),
    ("prefix_cache_evictions", "prefix_cache_evictions",
     "Cached KV blocks handed out again for other tokens (their prefix left the cache)."),
    ("num_compilations", "num_compilations", "XLA compilations of step functions."),
    ("num_steps", "num_steps", "Engine steps."),
    ("num_decode_steps", "num_decode_steps", "Engine steps that carried no prompt tokens."),
    ("prefill_tokens", "prefill_tokens", "Prompt tokens computed, recompute after preemption included."),
    ("decode_tokens", "decode_tokens", "Decode tokens computed."),
    ("padded_tokens", "padded_tokens", "Token rows computed only to fill a shape bucket."),
    ("computed_tokens", "computed_tokens", "Token rows computed by the model, bucket padding included."),
    ("useful_tokens", "useful_tokens", "Token rows computed for a scheduled sequence's real token."),
    ("computed_logit_rows", "computed_logit_rows", "Rows the LM head and sampler computed, padding included."),
    ("useful_logit_rows", "useful_logit_rows", "LM-head rows whose token was sampled."),
    ("useful_slot_steps", "useful_slot_steps", "Slot-steps whose sequence made progress."),
    ("total_slot_steps", "total_slot_steps", "Slot-steps run (max_num_seqs per step)."),
    ("structured_output_steps", "structured_output_steps",
     "Steps that sampled a row under a structured-output bitmask."),
    ("structured_output_bitmask_seconds", "structured_output_bitmask_seconds",
     "Host time filling structured-output bitmasks (it overlaps the step's forward)."),
    ("constrained_sample_steps", "constrained_sample_steps",
     "Steps whose sampling waited for the previous step's tokens (grammars, logits processors)."),
]
# vLLM's SpecDecodingProm: exported only by an engine with a speculative config
_SPEC_COUNTERS = [
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Speculative proposals verified."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted."),
]
_HISTOGRAMS = [
    ("time_to_first_token_seconds", "time_to_first_token", "Time to first token."),
    ("inter_token_latency_seconds", "inter_token_latency", "Time between consecutive output tokens."),
    ("e2e_request_latency_seconds", "e2e_request_latency", "Arrival to last token."),
    ("request_queue_time_seconds", "request_queue_time", "Arrival to first scheduled."),
    ("iteration_tokens_total", "iteration_tokens",
     "Tokens per engine step: computed tokens of prompts completed, and tokens generated."),
    # per finished request (aborts not observed, as e2e)
    ("request_prompt_tokens", "request_prompt_tokens", "Prompt tokens per finished request."),
    ("request_generation_tokens", "request_generation_tokens", "Generated tokens per finished request."),
    ("request_params_max_tokens", "request_params_max_tokens", "The max_tokens parameter per finished request."),
    ("request_prefill_kv_computed_tokens", "request_prefill_kv_computed_tokens",
     "Prompt tokens computed per finished request (its prefix-cache hit excluded)."),
    # per request of n samples, once its last sample has finished
    ("request_params_n", "request_params_n", "The n parameter per finished request."),
    ("request_max_num_generation_tokens", "request_max_num_generation_tokens",
     "Per finished request: the most tokens one of its n samples generated."),
    ("request_time_per_output_token_seconds", "request_time_per_output_token",
     "Per request: decode time / (generated tokens - 1)."),
    ("request_inference_time_seconds", "request_inference_time", "First scheduled to last token (RUNNING phase)."),
    ("request_prefill_time_seconds", "request_prefill_time", "First scheduled to first token (PREFILL phase)."),
    ("request_decode_time_seconds", "request_decode_time", "First token to last token (DECODE phase)."),
]


class EngineCollector:
    """Renders EngineStats.snapshot() at scrape time, so there is one set of numbers: the engine's.

    `labels` go on every sample (the server's: vLLM's model_name and engine, and which replica
    of a fleet), so one scrape of several engines keeps their series apart. `spec_decode`:
    the engine has a speculative config, so the spec_decode_* counters are exported (as
    vLLM's SpecDecodingProm, not otherwise), one per-position series per draft position."""

    def __init__(self, stats: EngineStats, labels: dict[str, str] | None = None, spec_decode: bool = False) -> None:
        self.stats, self.labels, self.spec_decode = stats, labels or {}, spec_decode

    def collect(self) -> Iterator[Metric]:
        # vLLM's cache_config_info is labelled by its config and engine, without model_name
        info = {k: v for k, v in self.labels.items() if k != "model_name"}
        for family in self._families():
            labels = info if family.name == PREFIX + "cache_config_info" else self.labels
            family.samples = [s._replace(labels=labels | s.labels) for s in family.samples]
            yield family

    def _families(self) -> Iterator[Metric]:
        s = self.stats.snapshot()
        for name, attr, doc in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=getattr(s, attr))
        for name, attr, doc in _COUNTERS + (_SPEC_COUNTERS if self.spec_decode else []):
            yield CounterMetricFamily(PREFIX + name, doc, value=getattr(s, attr))
        # vLLM's info gauge: its CacheConfig's fields and the engine's index as labels, value 1
        info_labels = s.cache_config | {"engine": ENGINE}
        info = GaugeMetricFamily(PREFIX + "cache_config_info", "KV cache configuration as labels (value 1).",
                                 labels=list(info_labels))
        info.add_metric(list(info_labels.values()), 1)
        yield info
        # vLLM's breakdown, which sums to num_requests_waiting: "capacity" (waiting for room) and
        # "deferred" (held by a transient constraint: LoRA budget, remote KV, a grammar compiling).
        # Here only a grammar compiling defers a request.
        vllm_reasons = GaugeMetricFamily(PREFIX + "num_requests_waiting_by_reason",
                                         "Waiting requests by vLLM's reason: capacity or deferred.", labels=["reason"])
        vllm_reasons.add_metric(["capacity"], s.num_requests_waiting)
        vllm_reasons.add_metric(["deferred"], s.num_requests_deferred)
        yield vllm_reasons
        by_reason = GaugeMetricFamily(PREFIX + "num_requests_waiting_by_wait_reason",
                                      "Waiting requests by what they wait for.", labels=["reason"])
        for reason, n in s.waiting_by_reason.items():
            by_reason.add_metric([reason], n)
        yield by_reason
        if self.spec_decode:  # startup sized the list: one series per draft position from the start
            per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the proposal.", labels=["position"])
            for pos, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([str(pos)], n)
            yield per_pos
        # vLLM's sources; external_kv_transfer stays 0: no KV connector here
        by_source = CounterMetricFamily(PREFIX + "prompt_tokens_by_source",
                                        "Prompt tokens of requests whose prefill completed, by source: computed, or "
                                        "held by the prefix cache.", labels=["source"])
        by_source.add_metric(["local_compute"], s.prompt_tokens_local_compute)
        by_source.add_metric(["local_cache_hit"], s.prompt_tokens_local_cache_hit)
        by_source.add_metric(["external_kv_transfer"], 0)
        yield by_source
        success = CounterMetricFamily(PREFIX + "request_success", "Finished requests by finish reason.",
                                      labels=["finished_reason"])
        for reason, n in s.request_success.items():
            success.add_metric([reason], n)
        yield success
        for name, attr, doc in _HISTOGRAMS:
            h = getattr(s, attr)
            yield HistogramMetricFamily(PREFIX + name, doc, sum_value=h.sum,
                                        buckets=[(floatToGoString(le), n) for le, n in h.cumulative()])
