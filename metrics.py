"""What the engine measures about itself: plain counters, gauges and histograms.

The engine thread writes them; the server's /metrics, the benches and the tests read
`EngineStats.snapshot()`. No Prometheus here: prometheus.py renders a snapshot in the
Prometheus text format, so the engine stays usable offline with no client library.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from policy import BATCHING

if TYPE_CHECKING:  # scheduler.py imports this module: types only
    from config import EngineConfig
    from scheduler_output import SchedulerOutput
    from sequence import Sequence

# Buckets as vLLM uses for the same histograms (seconds), so dashboards carry over.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TPOT_BUCKETS = ITL_BUCKETS  # vLLM's request_time_per_output_token_seconds uses the ITL bounds
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's request_params_n


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's bounds for per-request token counts
    (its max_model_len), e.g. 100 -> (1, 2, 5, 10, 20, 50, 100)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10

# What a waiting request waits for this step (WaitingQueue.reason_of, the reason label of
# num_requests_waiting_by_wait_reason): the scheduler's own reasons, then those a registered
# batching declares (policy.py, `wait_reason`). policy: the scheduling policy holds its
# prompt back this step (fair's prefill share is used up).
SCHEDULER_WAIT_REASONS = ("kv_blocks", "max_num_seqs", "token_budget", "policy")


def wait_reasons() -> tuple[str, ...]:
    """Every wait reason, read when called, so a batching registered after import counts."""
    declared = (cls.wait_reason for cls in BATCHING.values() if cls.wait_reason is not None)
    return SCHEDULER_WAIT_REASONS + tuple(dict.fromkeys(r for r in declared if r not in SCHEDULER_WAIT_REASONS))


@dataclass
class Histogram:
    """Cumulative-bucket histogram, Prometheus semantics (le buckets, +Inf implied)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, NOT cumulative; last is +Inf
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def observe_many(self, values: list[float]) -> None:
        """observe() each value; vectorised (a decode step observes one ITL per sequence)."""
        if len(values) < 8:
            for v in values:
                self.observe(v)
            return
        v = np.asarray(values, np.float64)
        idx = np.searchsorted(np.asarray(self.buckets), v, side="left")  # = bisect_left
        for i, c in enumerate(np.bincount(idx, minlength=len(self.counts)).tolist()):
            self.counts[i] += c
        self.sum += float(v.sum())
        self.count += len(values)

    def cumulative(self) -> list[tuple[float, int]]:
        """[(upper bound, cumulative count)], ending with (inf, count)."""
        out, acc = [], 0
        for le, c in zip(list(self.buckets) + [float("inf")], self.counts):
            acc += c
            out.append((le, acc))
        return out

    def copy(self) -> "Histogram":
        return Histogram(self.buckets, list(self.counts), self.sum, self.count)


@dataclass
class StepTrace:
    """One step as the scheduler decided it: what tests and researchers read to see
    who was in the batch, who left, who joined (LLMEngine(record_trace=True) and
    bench/simulate.py keep one per step). A step that ran nothing but preempted (a lone
    sequence giving up its blocks) is kept too, numbered as the step before it."""

    step: int
    scheduled: list[tuple[str, int]]  # (request id, tokens computed for it this step)
    sampled: list[str]  # requests that got a token
    released: list[str]  # requests whose result was released (left the batch)
    preempted: list[str]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int

    @classmethod
    def of(cls, step: int, out: SchedulerOutput, sampled: dict[str, int], released: list[Sequence],
           num_running: int, num_waiting: int) -> "StepTrace":
        return cls(step, [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled], list(sampled),
                   [s.request_id for s in released], [s.request_id for s in out.preempted], out.num_prefill_tokens,
                   out.num_decode_tokens, num_running, num_waiting)


@dataclass(eq=False)
class ParentRequest:
    """vLLM's parallel-sampling parent, for the two histograms observed once per request rather
    than per sample (request_params_n, request_max_num_generation_tokens): the n samples of
    one request share it (engine.child_requests makes it), and the last to finish normally
    observes them. A sample aborted never finishes normally, so its request is not observed,
    as an abort is in no latency histogram."""

    n: int
    remaining: int = field(init=False)
    max_num_generation_tokens: int = 0

    def __post_init__(self) -> None:
        self.remaining = self.n


@dataclass(frozen=True)
class RequestMetrics:
    """One request's timings and scheduling history: `RequestOutput.metrics` offline, the
    response's `metrics` object online (`--enable-per-request-metrics` and the body's
    `"include_metrics": true`, vLLM's two gates). The first five are vLLM's names; the rest
    have no vLLM counterpart. Times in milliseconds, measured by the engine's clock:

      queue_time_ms           arrival -> first scheduled (arrival -> end if never scheduled)
      time_to_first_token_ms  arrival -> first output token (None: it produced none)
      generation_time_ms      first -> last output token: the decode phase
      mean_itl_ms, max_itl_ms the gaps between consecutive output tokens (None: < 2 tokens)
      tokens_per_second       decode tokens/s: (output tokens - 1) / generation time
      e2e_latency_ms          arrival -> finished
      num_preemptions         times it was preempted
      num_recomputed_tokens   tokens it computed again after preemptions (its recompute tax)
      num_cached_tokens       prompt tokens the prefix cache served at its first admission
      spec_acceptance_rate    speculative decoding: its accepted / proposed draft tokens (None: none proposed)
    """

    queue_time_ms: float
    time_to_first_token_ms: float | None
    generation_time_ms: float
    mean_itl_ms: float | None
    tokens_per_second: float | None
    max_itl_ms: float | None
    e2e_latency_ms: float
    num_preemptions: int
    num_recomputed_tokens: int
    num_cached_tokens: int
    spec_acceptance_rate: float | None = None

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        """From a finished sequence (finished_time set)."""
        end = seq.finished_time
        assert end is not None, "a request's metrics are taken when it has finished"
        queued_until = seq.first_scheduled_time if seq.first_scheduled_time is not None else end
        first, last, n = seq.first_token_time, seq.last_token_time, seq.num_output_tokens
        gen = (last - first) if first is not None and last is not None else 0.0
        gaps = n >= 2 and gen > 0
        return cls(queue_time_ms=1e3 * (queued_until - seq.arrival_time),
                   time_to_first_token_ms=None if first is None else 1e3 * (first - seq.arrival_time),
                   generation_time_ms=1e3 * gen,
                   mean_itl_ms=1e3 * gen / (n - 1) if gaps else None,
                   tokens_per_second=(n - 1) / gen if gaps else None,
                   max_itl_ms=1e3 * seq.max_itl if gaps else None,
                   e2e_latency_ms=1e3 * (end - seq.arrival_time),
                   num_preemptions=seq.num_preemptions,
                   num_recomputed_tokens=seq.num_recomputed_tokens,
                   num_cached_tokens=seq.num_cached_prompt_tokens,
                   spec_acceptance_rate=seq.num_accepted_tokens / seq.num_draft_tokens if seq.num_draft_tokens
                   else None)


@dataclass
class EngineStats:
    """Everything a researcher asks about the scheduler, without a profiler."""

    # gauges (set every step)
    num_requests_running: int = 0
    num_requests_waiting: int = 0  # in the scheduler's queue
    # Requests whose structured-output grammar the server is compiling (deferred): vLLM's
    # engine holds them in its waiting queue meanwhile (WAITING_FOR_FSM), so its
    # num_requests_waiting counts them and its waiting-by-reason says "deferred"; here
    # they reach the engine once compiled, and the server counts them (deferred()).
    num_requests_deferred: int = 0
    waiting_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(wait_reasons(), 0))
    kv_cache_usage: float = 0.0  # fraction of usable KV blocks in use, 0..1
    num_kv_blocks: int = 0  # usable blocks (the null block excluded)
    # device bytes, measured from the live arrays' shards on this process's devices (all of them)
    weight_bytes: int = 0
    kv_cache_bytes: int = 0
    # counters
    num_preemptions: int = 0
    recomputed_tokens: int = 0  # the recompute tax: tokens computed again after a preemption dropped them
    swapped_out_blocks: int = 0  # KV blocks copied to the host pool (--preemption-mode swap)
    swapped_in_blocks: int = 0  # KV blocks copied back
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    swap_fallbacks: int = 0  # preemptions under swap that recomputed: the host pool was full
    prompt_tokens: int = 0  # prompt tokens of requests whose prefill completed (recompute after preemption not counted)
    # vLLM's PromptTokenStats of the same prompts: the tokens the prefix cache served, and by
    # source those computed (prompt_tokens_local_compute) and those the cache held (the cached
    # ones, plus the last prompt token when the cache held all the others: it is computed
    # again for its logits: prompt_tokens_recomputed). vLLM also adds that one token to a
    # one-token prompt with no hit, counting it twice; not here.
    prompt_tokens_cached: int = 0
    prompt_tokens_local_cache_hit: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (first admissions)
    prefix_cache_hits: int = 0  # of those, tokens served from cached blocks
    prefix_cache_requests: int = 0  # the requests those lookups were for (the stats log's window counts them)
    prefix_cache_resets: int = 0  # reset_prefix_cache calls that emptied it (the stats log's window restarts)
    prefix_cache_evictions: int = 0  # cached blocks whose memory was handed out again (their prefix is gone)
    # vLLM's FinishReason but "repetition" (no repetition detection here): "error" is a request
    # that failed alone, answered with a 500
    request_success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0})
    num_compilations: int = 0
    num_steps: int = 0
    num_decode_steps: int = 0  # steps that carried no prompt tokens
    useful_slot_steps: int = 0  # slots whose sequence made progress in the step
    total_slot_steps: int = 0  # max_num_seqs per step
    prefill_tokens: int = 0  # prompt tokens computed (recompute included)
    decode_tokens: int = 0
    padded_tokens: int = 0  # token rows computed only to fill a shape bucket
    # Speculative decoding, vLLM's spec_decode_* counters: verified proposals, their draft
    # tokens, the accepted ones, and accepted ones by draft position (0 = the first draft).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Every step's token rows through the model (its bucket, padding included) vs the real ones,
    # and its LM-head rows vs the rows that sample: computed - useful is the padding's FLOPs.
    computed_tokens: int = 0
    useful_tokens: int = 0
    computed_logit_rows: int = 0
    useful_logit_rows: int = 0
    structured_output_steps: int = 0  # steps that sampled a row under a structured-output bitmask
    structured_output_bitmask_seconds: float = 0.0  # host time filling those bitmasks
    # Steps whose sample program waited for the steps before it (a row under a grammar or a
    # logits processor reads its previous token): each gives up async scheduling's overlap.
    constrained_sample_steps: int = 0
    # histograms
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    request_queue_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKEN_BUCKETS))
    # Per finished request, as vLLM's (observed with e2e_request_latency: a normal finish, not an
    # abort); per sample, since each of n samples is an engine request of its own.
    request_time_per_output_token: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    request_inference_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    request_prefill_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    request_decode_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    # The token-count histograms' largest bound (build_1_2_5_buckets): the engine's resolved
    # max_model_len; 0 (a stats object with no engine) leaves them the +Inf bucket alone.
    max_model_len: int = 0
    request_prompt_tokens: Histogram = field(init=False)
    request_generation_tokens: Histogram = field(init=False)
    request_params_max_tokens: Histogram = field(init=False)
    request_prefill_kv_computed_tokens: Histogram = field(init=False)  # prompt tokens minus its cache hit
    # Per request of n samples (ParentRequest), when its last sample finishes: its n, and the
    # most tokens one of its samples generated.
    request_params_n: Histogram = field(default_factory=lambda: Histogram(N_BUCKETS))
    request_max_num_generation_tokens: Histogram = field(init=False)
    # vLLM's cache_config_info labels (its CacheConfig's fields, as str()), set at start-up
    cache_config: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self) -> None:
        assert self.max_model_len >= 0, self.max_model_len
        token_buckets = build_1_2_5_buckets(self.max_model_len)
        self.request_prompt_tokens = Histogram(token_buckets)
        self.request_generation_tokens = Histogram(token_buckets)
        self.request_params_max_tokens = Histogram(token_buckets)
        self.request_prefill_kv_computed_tokens = Histogram(token_buckets)
        self.request_max_num_generation_tokens = Histogram(token_buckets)

    @property
    def prompt_tokens_local_compute(self) -> int:
        return self.prompt_tokens - self.prompt_tokens_cached

    @property
    def prompt_tokens_recomputed(self) -> int:
        """vLLM's PromptTokenStats.recomputed_tokens: the last prompt token of each prompt the
        cache held all but, counted in local_cache_hit and computed again for its logits."""
        return self.prompt_tokens_local_cache_hit - self.prompt_tokens_cached

    @property
    def num_requests_waiting_all(self) -> int:
        """vLLM's num_requests_waiting: the queue's and those deferred."""
        return self.num_requests_waiting + self.num_requests_deferred

    @contextlib.contextmanager
    def deferred(self, n: int) -> Iterator[None]:
        """n requests deferred for the block's length (their grammar compiling)."""
        with self.lock:
            self.num_requests_deferred += n
        try:
            yield
        finally:
            with self.lock:
                self.num_requests_deferred -= n

    @property
    def slot_utilization(self) -> float:
        return self.useful_slot_steps / self.total_slot_steps if self.total_slot_steps else 0.0

    def record_step(self, out: SchedulerOutput, sampled: dict[str, int], released: list[Sequence],
                    scheduled_at: float, now: float, config: EngineConfig, extra_tokens: int = 0) -> None:
        """All of one step's bookkeeping, after scheduler.update(): counters, each
        request's timestamps (first scheduled, first and last token, finished) and the
        latency histograms. The engine passes wall-clock times; bench/simulate.py passes
        simulated ones, so both count the same way. extra_tokens: the tokens verified rows
        emitted beyond one each (speculative decoding; `sampled` has one per row)."""
        with self.lock:
            computed_before = self.prompt_tokens_local_compute
            # A step that only preempted (the lone running sequence giving up its blocks) still
            # counts its preemptions.
            self.num_preemptions += len(out.preempted)
            self.swap_fallbacks += out.num_swap_fallbacks
            if out.scheduled:  # an empty step (a static batch released after an abort) ran nothing
                self.num_steps += 1
                # No prompt tokens, as the counter says: a step verifying drafts is a decode
                # step too (is_decode_only, the runner's program choice, excludes it).
                self.num_decode_steps += out.num_prefill_tokens == 0
                self.useful_slot_steps += len(out.scheduled)
                self.total_slot_steps += config.max_num_seqs
                self.prefill_tokens += out.num_prefill_tokens
                self.decode_tokens += out.num_decode_tokens
                self.recomputed_tokens += out.num_recomputed_tokens
                self.generation_tokens += len(sampled) + extra_tokens
            itl: list[float] = []  # one inter-token latency per sequence that got a later token
            add_itl = itl.append  # a local: read per row
            for sch in out.scheduled:  # once per running sequence in a decode step: kept lean
                seq = sch.seq
                if seq.first_scheduled_time is None:
                    self._first_scheduled(seq, scheduled_at, config)
                if not sch.samples:
                    continue
                if seq.first_token_time is None:
                    seq.first_token_time = now
                    self.time_to_first_token.observe(now - seq.arrival_time)
                    self._prompt_done(seq)
                else:
                    gap = now - seq.last_token_time
                    add_itl(gap)
                    if gap > seq.max_itl:
                        seq.max_itl = gap
                seq.last_token_time = now
            self.inter_token_latency.observe_many(itl)
            if sampled:
                # vLLM V1's iteration tokens: the computed prompt tokens (the cache's hit left
                # out) of the requests whose first token came this step and every token
                # emitted; a step that emitted nothing (a prompt chunk alone) is not observed.
                computed = self.prompt_tokens_local_compute - computed_before
                self.iteration_tokens.observe(computed + len(sampled) + extra_tokens)
            for seq in released:
                self._finished(seq, now, latency=True)

    def _prompt_done(self, seq: Sequence) -> None:
        """Its prefill completed (its first token came): its prompt counts once, as vLLM V1's
        PromptTokenStats.update_from_output counts it."""
        n, cached = seq.num_prompt_tokens, seq.num_cached_prompt_tokens
        self.prompt_tokens += n
        self.prompt_tokens_cached += cached
        self.prompt_tokens_local_cache_hit += cached + (0 < cached == n - 1)

    def record_first_scheduled(self, seq: Sequence, scheduled_at: float, config: EngineConfig) -> None:
        """A request aborted while its first step was in flight, or that failed alone in it:
        that step is discarded for it (record_step never sees it), but the request was
        scheduled and its prefix looked up."""
        with self.lock:
            self._first_scheduled(seq, scheduled_at, config)

    def _first_scheduled(self, seq: Sequence, scheduled_at: float, config: EngineConfig) -> None:
        """Its first step: it stops queueing."""
        seq.first_scheduled_time = scheduled_at
        self.request_queue_time.observe(scheduled_at - seq.arrival_time)
        # As vLLM: a request's first admission only, and never one asking prompt_logprobs
        # (it may not read the cache: every prompt position's logits are computed), whose
        # lookup would count as a miss.
        if config.enable_prefix_caching and seq.params.prompt_logprobs is None:
            self.prefix_cache_queries += seq.num_prompt_tokens
            self.prefix_cache_hits += seq.num_cached_tokens
            self.prefix_cache_requests += 1

    def record_spec_decode(self, drafts: list[tuple[int, int]]) -> None:
        """One step's verified rows, (draft tokens, accepted) each (the tokens they emit
        are counted by record_step)."""
        with self.lock:
            per_pos = self.spec_decode_num_accepted_tokens_per_pos
            for num_draft, num_accepted in drafts:
                self.spec_decode_num_drafts += 1
                self.spec_decode_num_draft_tokens += num_draft
                self.spec_decode_num_accepted_tokens += num_accepted
                if len(per_pos) < num_draft:
                    per_pos.extend([0] * (num_draft - len(per_pos)))
                for j in range(num_accepted):
                    per_pos[j] += 1

    def record_finished(self, seq: Sequence, now: float) -> None:
        """A request that ended outside a step (an abort, a request failed alone): counted
        in request_success, but in no latency histogram, as vLLM leaves aborts out."""
        with self.lock:
            self._finished(seq, now, latency=False)

    def _finished(self, seq: Sequence, now: float, latency: bool) -> None:
        seq.finished_time = now
        if latency:
            self.e2e_request_latency.observe(now - seq.arrival_time)
            self._observe_request(seq, now)
        self.request_success[seq.finish_reason] += 1

    def _observe_request(self, seq: Sequence, now: float) -> None:
        """vLLM's per-request histograms, from the timestamps RequestMetrics reads: prefill is
        first scheduled -> first token, decode first -> last token, inference both (any
        preemption inside them included); TPOT is decode time over the tokens after the
        first (0 with fewer than two). A phase never reached ends at the finish."""
        scheduled = seq.first_scheduled_time if seq.first_scheduled_time is not None else now
        first = seq.first_token_time if seq.first_token_time is not None else now
        last = seq.last_token_time if seq.last_token_time is not None else now
        n = seq.num_output_tokens
        self.request_prefill_time.observe(first - scheduled)
        self.request_decode_time.observe(last - first)
        self.request_inference_time.observe(last - scheduled)
        self.request_time_per_output_token.observe((last - first) / (n - 1) if n > 1 else 0.0)
        self.request_prompt_tokens.observe(seq.num_prompt_tokens)
        self.request_prefill_kv_computed_tokens.observe(seq.num_prompt_tokens - seq.num_cached_prompt_tokens)
        self.request_generation_tokens.observe(n)
        self.request_params_max_tokens.observe(seq.params.max_tokens)
        n_param, tokens, parent = 1, n, seq.parent
        if parent is not None:  # one of n samples: the request is observed when its last one finishes
            parent.remaining -= 1
            parent.max_num_generation_tokens = max(parent.max_num_generation_tokens, tokens)
            if parent.remaining:
                return
            n_param, tokens = parent.n, parent.max_num_generation_tokens
        self.request_params_n.observe(n_param)
        self.request_max_num_generation_tokens.observe(tokens)

    def snapshot(self) -> "EngineStats":
        """A consistent copy, safe to read from another thread."""
        with self.lock:
            snap = EngineStats(**{k: v for k, v in self.__dict__.items()
                                  if k not in ("waiting_by_reason", "request_success", "cache_config", "lock")
                                  and not isinstance(v, Histogram)})
            snap.waiting_by_reason = dict(self.waiting_by_reason)
            snap.spec_decode_num_accepted_tokens_per_pos = list(self.spec_decode_num_accepted_tokens_per_pos)
            snap.request_success = dict(self.request_success)
            snap.cache_config = dict(self.cache_config)
            for k, v in self.__dict__.items():
                if isinstance(v, Histogram):
                    setattr(snap, k, v.copy())
            return snap


class LoggingStatLogger:
    """vLLM's periodic stats log (its LoggingStatLogger), read from EngineStats' counters: each
    log() reports the interval since the one before. The server calls it every
    LOG_STATS_INTERVAL seconds unless --disable-log-stats; an idle interval after an idle one
    logs at DEBUG, as vLLM's, so a quiet server stays quiet.

    Its line, vLLM's fields in vLLM's order: "Engine 000: Avg prompt throughput: X tokens/s,
    Avg generation throughput: Y tokens/s, Running: N reqs, Waiting: M reqs[, Preemptions: P],
    GPU KV cache usage: Z%, Prefix cache hit rate: W%". Prompt tokens are those computed,
    counted when a request's prefill completes (prompt_tokens_by_source's local_compute, as
    vLLM's: a prefix-cache hit is no throughput); Preemptions appears when the interval had
    some; the hit rate covers the lookups of about the last `max_recent_requests` requests
    (vLLM's CachingMetrics window, kept here by interval). With speculative decoding, an
    interval that verified drafts adds vLLM's "SpecDecoding metrics: ..." line."""

    def __init__(self, stats: EngineStats, logger: logging.Logger, clock: Callable[[], float] = time.monotonic,
                 engine_index: int = 0, max_recent_requests: int = 1000) -> None:
        self.stats, self.logger, self.clock, self.engine_index = stats, logger, clock, engine_index
        self.last, self.last_log_time = stats.snapshot(), clock()
        self.last_prompt_throughput = self.last_generation_throughput = 0.0
        self.max_recent_requests = max_recent_requests
        self.prefix_window: deque[tuple[int, int, int]] = deque()  # (requests, queries, hits) per interval
        self.window_requests = self.window_queries = self.window_hits = 0

    def log(self) -> None:
        now, s, last = self.clock(), self.stats.snapshot(), self.last
        elapsed = now - self.last_log_time

        def per_second(n: int) -> float:
            return n / elapsed if elapsed > 0 else 0.0

        prompt = per_second(s.prompt_tokens_local_compute - last.prompt_tokens_local_compute)  # vLLM's: computed
        generation = per_second(s.generation_tokens - last.generation_tokens)
        idle = not any((prompt, generation, self.last_prompt_throughput, self.last_generation_throughput))
        level = logging.DEBUG if idle else logging.INFO
        self.last_prompt_throughput, self.last_generation_throughput = prompt, generation
        if s.prefix_cache_resets != last.prefix_cache_resets:  # as vLLM's: the window restarts
            self.prefix_window.clear()
            self.window_requests = self.window_queries = self.window_hits = 0
        self._observe_prefix_cache(s.prefix_cache_requests - last.prefix_cache_requests,
                                   s.prefix_cache_queries - last.prefix_cache_queries,
                                   s.prefix_cache_hits - last.prefix_cache_hits)
        parts = ["Avg prompt throughput: %.1f tokens/s", "Avg generation throughput: %.1f tokens/s",
                 "Running: %d reqs", "Waiting: %d reqs"]
        args: list[float] = [prompt, generation, s.num_requests_running, s.num_requests_waiting_all]
        if preempted := s.num_preemptions - last.num_preemptions:
            parts.append("Preemptions: %d")
            args.append(preempted)
        parts += ["GPU KV cache usage: %.1f%%", "Prefix cache hit rate: %.1f%%"]
        hit_rate = self.window_hits / self.window_queries if self.window_queries else 0.0
        args += [s.kv_cache_usage * 100, hit_rate * 100]
        self.logger.log(level, "Engine %03d: " + ", ".join(parts), self.engine_index, *args)
        self._log_spec_decode(level, s, last, per_second)
        self.last, self.last_log_time = s, now

    def _observe_prefix_cache(self, requests: int, queries: int, hits: int) -> None:
        """vLLM's CachingMetrics.observe: an interval with no lookups is not kept (it would push
        useful ones out), and the oldest intervals leave while the window holds more than
        max_recent_requests requests, the newest always kept."""
        if not requests:
            return
        self.prefix_window.append((requests, queries, hits))
        self.window_requests += requests
        self.window_queries += queries
        self.window_hits += hits
        while len(self.prefix_window) > 1 and self.window_requests > self.max_recent_requests:
            r, q, h = self.prefix_window.popleft()
            self.window_requests -= r
            self.window_queries -= q
            self.window_hits -= h

    def _log_spec_decode(self, level: int, s: EngineStats, last: EngineStats,
                         per_second: Callable[[int], float]) -> None:
        """vLLM's SpecDecodingLogging line, for an interval that verified drafts."""
        drafts = s.spec_decode_num_drafts - last.spec_decode_num_drafts
        if not drafts:
            return
        drafted = s.spec_decode_num_draft_tokens - last.spec_decode_num_draft_tokens
        accepted = s.spec_decode_num_accepted_tokens - last.spec_decode_num_accepted_tokens
        before = last.spec_decode_num_accepted_tokens_per_pos
        per_pos = [n - (before[i] if i < len(before) else 0)
                   for i, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos)]
        self.logger.log(level, "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f "
                        "tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
                        "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                        1 + accepted / drafts,  # the bonus token counted, as vLLM's
                        per_second(accepted), per_second(drafted), accepted, drafted,
                        ", ".join(f"{n / drafts:.3f}" for n in per_pos),
                        accepted / drafted * 100 if drafted else float("nan"))
