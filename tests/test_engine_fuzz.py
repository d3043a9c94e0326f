"""A property test of the engine's bookkeeping under adversarial operation sequences.

tests/test_scheduler_drive.py fuzzes the scheduler alone, with fake tokens and a model of
the KV pools. This drives a real LLMEngine on the built-in tiny model (a cache small enough
that requests preempt each other, chunked prefill with a small budget) through operation
lists hypothesis draws: requests added (shared prompt prefixes, n > 1 as child requests of
a sampled request, greedy / seeded / unseeded sampling, stop strings and stop token ids
picked from the request's own output so that they do end it, EOS, min_tokens, logprobs,
prompt_logprobs, a choice grammar, priorities, an id reused from a request just aborted),
requests aborted (just added, waiting, preempted or swapped out, mid-prefill, with a step
in flight), prefix cache resets (some that preempt every running request) and steps; then it drains. Over a few configurations (async
scheduling on and off, prefix caching on and off, preemption by recompute and by swap into
a small host pool, ngram and draft-model speculation, the priority and fair policies,
static batching, chunked prefill on and off, long_prefill_token_threshold) it checks, after
every step:

- the scheduler's own invariants (check_invariants), and, from the running sequences' block
  tables, that every KV block in use is held by a live sequence and every other one is free;
- every live request's streamed tokens are its output tokens, no delta names a request that
  is not live, and a request's last delta is the one that says it finished;

and at the end:

- every device block, host swap block and slot is free, nothing is in flight, no request
  is left in the engine's, the scheduler's or a draft model's tables;
- each request's finish reason fits its tokens (length: max_tokens of them; stop: an end
  token, a stop token id or a matched stop string, and nothing earlier that would have ended
  it; abort: only the aborted);
- each greedy or seeded request that was never aborted has the tokens, finish reason and
  logprobs (sampled and prompt) of the same request run alone on a plain engine (no caching,
  synchronous, a cache for one request whole): the tiny model's float32 steps are batch invariant (as
  test_engine.py's mixed-batch test asserts); a draft model's seeded draws are not plain
  sampling's, so there only greedy requests are compared;
- the stats count what happened: generated tokens, finish reasons, preemptions, prompt
  tokens, prefix-cache hits, and (synchronous, nothing aborted: no row is discarded) the
  computed tokens and recomputed tokens.

TAXIRANK_FUZZ_EXAMPLES=200 with --hypothesis-profile=explore searches further (about 3
minutes on one core).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine import LLMEngine, EngineConfig, PreemptionRefusedError, SamplingParams, child_requests
from sampling_params import StructuredOutputsParams
from sequence import RUNNING, WAITING

EOS = 257  # the tiny model's (its byte tokenizer's)
BASE = dict(model="tiny", warmup=False, max_num_seqs=4, max_model_len=40, block_size=4, seed=0)
SHARED = [40 + (7 * i) % 200 for i in range(24)]  # the prefix some prompts share
LOOP = 180  # the tiny model's greedy continuation of a short prompt settles on repeating this token
MAX_PROMPT, MAX_TOKENS = 24, 14
# 13 usable blocks of 4 tokens: one request of 24 + 14 tokens takes 10, so two running
# requests preempt each other. Swap: a host pool of 8 blocks (2 KiB each), so a few victims
# swap and the rest fall back to recompute.
FUZZED = dict(num_kv_blocks=14, enable_chunked_prefill=True, max_num_batched_tokens=16)
SWAP = dict(preemption_mode="swap", swap_space=8 * 2048 / 2**30)
NGRAM = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                 "prompt_lookup_max": 2})
CONFIGS = {
    "async-caching-recompute": dict(async_scheduling=True, enable_prefix_caching=True),
    "sync-nocaching-swap": dict(async_scheduling=False, enable_prefix_caching=False, **SWAP),
    "async-caching-swap-priority": dict(async_scheduling=True, enable_prefix_caching=True, scheduling_policy="priority",
                                        **SWAP),
    "async-caching-ngram-priority": dict(async_scheduling=True, enable_prefix_caching=True,
                                         scheduling_policy="priority", **NGRAM),
    "async-caching-draft-model": dict(async_scheduling=True, enable_prefix_caching=True, **SWAP,
                                      speculative_config={"method": "draft_model", "model": "tiny",
                                                          "num_speculative_tokens": 2}),
    "sync-caching-fair-threshold": dict(async_scheduling=False, enable_prefix_caching=True, scheduling_policy="fair",
                                        long_prefill_token_threshold=5),
    "sync-caching-static": dict(async_scheduling=False, enable_prefix_caching=True, scheduling="static"),
    "async-nochunk-swap-ngram": dict(async_scheduling=True, enable_prefix_caching=True, enable_chunked_prefill=False,
                                     max_num_batched_tokens=40, **SWAP, **NGRAM),
}


def quiet(*_: object) -> None:
    pass


@functools.lru_cache(maxsize=1)
def plain_engine() -> LLMEngine:
    """The reference: no prefix caching, synchronous, every prompt whole in one step, and
    room for the one request it runs at a time whole (at most 10 of FUZZED's 13 blocks).
    FUZZED's cache and async-nochunk-swap-ngram's budget: its programs are theirs."""
    return LLMEngine(EngineConfig(**BASE, enable_prefix_caching=False, async_scheduling=False,
                                  num_kv_blocks=FUZZED["num_kv_blocks"], max_num_batched_tokens=40), log=quiet)


@functools.lru_cache(maxsize=None)
def alone(prompt: tuple[int, ...], params: SamplingParams) -> tuple[tuple[int, ...], str | None]:
    """The request run alone on the plain engine: (its tokens, its finish reason)."""
    return run_alone(prompt, params)[:2]


@functools.lru_cache(maxsize=None)
def run_alone(prompt: tuple[int, ...], params: SamplingParams) -> tuple:
    """(tokens, finish reason, sampled logprobs, prompt logprobs) of the request alone."""
    e = plain_engine()
    seq = e.add_request("ref", list(prompt), params)
    lps, plps = [], None
    while e.has_unfinished():
        for d in e.step():
            lps += [x.logprob for x in d.new_logprobs or ()]
            plps = d.prompt_logprobs if d.prompt_logprobs is not None else plps
    plps = None if plps is None else [None if x is None else x.logprob for x in plps]
    return tuple(seq.output_token_ids), seq.finish_reason, lps, plps


# ---- the operations --------------------------------------------------------------------
adds = st.tuples(
    st.just("add"),
    # the prompt: a prefix of SHARED (+ its own tail), its own, or one the tiny model continues
    # with a repeated token (LOOP), whose drafts ngram speculation proposes and the model accepts
    st.sampled_from(["shared", "shared", "own", "loop"]),
    st.one_of(st.integers(1, MAX_PROMPT), st.integers(MAX_PROMPT - 6, MAX_PROMPT)),  # prompt length: long ones preempt
    st.one_of(st.integers(1, MAX_TOKENS), st.just(MAX_TOKENS)),  # max_tokens
    st.sampled_from(["greedy", "greedy", "seeded", "random"]),
    st.sampled_from([None, None, "stop_token", "stop_string", "eos"]),  # what may end it early
    st.integers(0, 63),  # where in its own output the stop is picked, and its seed
    st.sampled_from([1, 1, 1, 2]),  # n
    st.integers(0, 2),  # priority (read only under the priority policy)
    st.booleans(),  # reuse the id of the latest aborted request (its step may still be in flight)
    st.sampled_from([None, None, "logprobs", "prompt_logprobs", "min_tokens", "choice"]),
)
aborts = st.tuples(st.just("abort"), st.sampled_from(["new", "waiting", "preempted", "prefill", "in_flight", "any"]),
                   st.integers(0, 7))
steps = st.tuples(st.just("step"), st.integers(1, 4))
# reset_prefix_cache: refused while any block is in use, unless it preempts the running requests
resets = st.tuples(st.just("reset"), st.booleans())
operations = st.lists(st.one_of(adds, adds, adds, aborts, steps, resets), min_size=1, max_size=14)


@dataclasses.dataclass
class Request:
    rid: str
    seq: object
    prompt: list[int]
    params: SamplingParams
    streamed: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None
    finals: int = 0
    aborted: bool = False


class Run:
    def __init__(self, config: dict) -> None:
        self.e = LLMEngine(EngineConfig(**BASE, **{**FUZZED, **config}), log=quiet)
        self.cfg = self.e.config
        self.priority = config.get("scheduling_policy") == "priority"
        self.draft_model = (config.get("speculative_config") or {}).get("method") == "draft_model"
        self.static = config.get("scheduling") == "static"
        self.requests: list[Request] = []
        self.live: dict[str, Request] = {}  # by id: added, not yet ended for its client
        self.last_aborted: str | None = None
        self.counter = 0

    # ---- operations --------------------------------------------------------------------
    def add(self, kind, length, max_tokens, sampling, stop, pick, n, priority, reuse, extra) -> None:
        if kind == "own":
            prompt = [3 + (31 * self.counter + 17 * j) % 240 for j in range(length)]
        elif kind == "loop":
            prompt = (SHARED[:2] + [LOOP] * length)[:length]
        else:
            prompt = SHARED[:length]
        if kind == "shared" and length > 8 and pick % 2:  # a shared prefix with its own tail
            prompt = SHARED[:length - 3] + [250, 251, 252 - pick % 5]
        kw: dict = dict(max_tokens=max_tokens, ignore_eos=stop != "eos")
        if sampling == "greedy":
            kw["temperature"] = 0.0
        else:
            kw.update(temperature=1.0, top_k=20, seed=pick if sampling == "seeded" else None)
        if extra == "logprobs":
            kw["logprobs"] = 1
        elif extra == "prompt_logprobs":  # no prefix-cache hit: every prompt position's logits are computed
            kw["prompt_logprobs"] = 1
        elif extra == "choice":  # structured outputs: a constrained row samples once its previous token is known
            kw["structured_outputs"] = StructuredOutputsParams(choice=("yes", "no", "maybe so"))
        elif extra == "min_tokens":
            kw["min_tokens"] = max_tokens // 2
        params = SamplingParams(**kw)
        if stop in ("stop_token", "stop_string"):  # picked from its own output, so it does end it
            out = alone(tuple(prompt), dataclasses.replace(params, seed=pick))[0]
            j = pick % len(out)
            if stop == "stop_token":
                params = dataclasses.replace(params, stop_token_ids=[out[j]])
            else:
                text = self.e.tokenizer.decode(list(out[j:j + 2]))
                if text.strip():
                    params = dataclasses.replace(params, stop=[text])
        if n > 1 and sampling != "greedy":  # greedy n > 1 is refused (vLLM's _verify_greedy_sampling)
            params = dataclasses.replace(params, n=n)
        rid = f"r{self.counter}"
        self.counter += 1
        if reuse and self.last_aborted is not None and self.last_aborted not in self.live:
            rid, self.last_aborted = self.last_aborted, None
        for child, one, parent in child_requests(rid, params):
            if child in self.live:
                continue
            seq = self.e.add_request(child, prompt, one, priority=priority if self.priority else 0, parent=parent)
            r = Request(child, seq, prompt, one)
            self.requests.append(r)
            self.live[child] = r

    def abort(self, where: str, i: int) -> None:
        live = list(self.live.values())
        in_flight = {id(s.seq) for o, _, _ in self.e._in_flight for s in o.scheduled}
        pick = {
            "new": live[-1:],
            "waiting": [r for r in live if r.seq.status is WAITING],
            "preempted": [r for r in live if r.seq.status is WAITING and (r.seq.num_preemptions or r.seq.swapped)],
            "prefill": [r for r in live if r.seq.status is RUNNING
                        and r.seq.num_computed_tokens < r.seq.num_prompt_tokens],
            "in_flight": [r for r in live if id(r.seq) in in_flight],
            "any": live,
        }[where] or live
        if not pick:
            return
        r = pick[i % len(pick)]
        last = self.e.abort(r.rid)
        assert last.request_id == r.rid and last.finished
        assert r.seq.finish_reason == "abort"
        r.aborted = True
        del self.live[r.rid]
        self.last_aborted = r.rid
        self.check()

    def reset(self, running: bool) -> None:
        sch, alloc = self.e.scheduler, self.e.scheduler.allocator
        in_use = alloc.num_used
        if not running:
            with pytest.raises(ValueError, match="must be a boolean"):
                self.e.reset_prefix_cache("false")  # refused before anything changed
            assert self.e.reset_prefix_cache() == (in_use == 0)
            assert in_use or alloc.num_cached == 0
            self.check()
            return
        was_running = [s for s in sch.running if not s.finished]
        if self.static:
            in_flight = len(self.e._in_flight)
            with pytest.raises(PreemptionRefusedError, match="never preempts"):
                self.e.reset_prefix_cache(reset_running_requests=True)
            assert len(self.e._in_flight) == in_flight and not self.e._undelivered  # refused before anything changed
        else:
            waiting_for_blocks = sch.waiting_by_reason()["kv_blocks"]
            assert self.e.reset_prefix_cache(reset_running_requests=True)
            # its victims wait for nothing yet (no step refused them a place); the others keep their reason
            assert sch.waiting_by_reason()["kv_blocks"] == waiting_for_blocks
            # no K/V survives: nothing runs, holds a block or a host copy, or is named
            assert not self.e._in_flight and not sch.running and alloc.num_used == alloc.num_cached == 0
            assert all(s.swapped is None for s in sch.waiting)
            # (the policy's queue puts them back where it puts a preempted request; a step
            # collected first may have ended one)
            assert all(s.status is WAITING or s.finished for s in was_running)
        self.step()  # it returns the deltas of the steps the reset collected

    def step(self) -> None:
        deltas = self.e.step()
        for d in deltas:
            r = self.live.get(d.request_id)
            assert r is not None, f"a delta for {d.request_id}, which is not live"
            assert r.finals == 0
            r.streamed += d.new_token_ids
            if r.params.logprobs is not None and d.new_token_ids:
                assert [x.token_id for x in d.new_logprobs] == d.new_token_ids, d
                r.logprobs += [x.logprob for x in d.new_logprobs]
            else:
                assert d.new_logprobs is None, d
            if d.prompt_logprobs is not None:
                assert r.params.prompt_logprobs is not None and r.prompt_logprobs is None and len(r.streamed) == len(
                    d.new_token_ids), f"{r.rid}: prompt logprobs not with its first token alone"
                assert len(d.prompt_logprobs) == len(r.prompt) and d.prompt_logprobs[0] is None
                assert [x.token_id for x in d.prompt_logprobs[1:]] == r.prompt[1:]
                r.prompt_logprobs = [None] + [x.logprob for x in d.prompt_logprobs[1:]]
            if d.finished:
                r.finals += 1
                assert d.finish_reason == r.seq.finish_reason is not None
                del self.live[d.request_id]
        self.check()

    def drain(self) -> None:
        for _ in range(2000):
            if not self.e.has_unfinished():
                break
            self.step()
        assert not self.e.has_unfinished(), "the engine stopped making progress"

    # ---- checks ------------------------------------------------------------------------
    def check(self) -> None:
        sch, alloc = self.e.scheduler, self.e.scheduler.allocator
        sch.check_invariants()
        held = {b for s in sch.running for b in s.block_table}
        assert alloc.num_free + len(held) == alloc.num_usable, "a KV block is neither free nor held"
        slots = [s.slot for s in sch.running]
        assert None not in slots and len(set(slots)) == len(slots)
        assert {s.request_id for s in [*sch.running, *sch.waiting]} <= set(self.live), \
            "the engine holds an ended request"
        for r in self.live.values():
            assert r.streamed == r.seq.output_token_ids, (r.rid, r.streamed, r.seq.output_token_ids)
            assert r.seq.finish_reason is None or r.seq in sch.running  # static batching seats a finished one
        for r in self.requests:
            if r.aborted:
                assert r.finals == 0 and r.seq.finish_reason == "abort"

    def finish(self) -> None:
        e, sch = self.e, self.e.scheduler
        alloc = sch.allocator
        assert not self.live and not e._in_flight and not e._prompt_lps
        assert alloc.num_free == alloc.num_usable == alloc.num_used + alloc.num_free, "a KV block leaked"
        assert len(sch._free_slots) == self.cfg.max_num_seqs, "a slot leaked"
        assert len(sch._host_free) == sch.num_swap_blocks, "a host swap block leaked"
        assert not sch._seqs and not sch.running and not len(sch.waiting)
        if self.draft_model:  # its draft K/V bookkeeping is dropped as each request ends
            assert not len(e.proposer._seqs)
        eos = (EOS,)
        for r in self.requests:
            seq, p = r.seq, r.params
            out = seq.output_token_ids
            assert seq.slot is None and not seq.block_table and seq.swapped is None, r.rid
            assert len(out) <= p.max_tokens, r.rid
            # (before min_tokens an end token is masked, so none comes out)
            ends = [j for j, t in enumerate(out) if p.stop_token(t, eos) is not None]
            assert all(j >= p.min_tokens for j in ends), f"{r.rid}: an end token before min_tokens"
            if r.aborted:
                assert seq.finish_reason == "abort"
                # (static batching seats a request after its end token until the batch is
                # done: aborted meanwhile, it ends as an abort, engine.abort says)
                assert not ends or self.static, f"{r.rid} was aborted after an end token: {out}"
                continue
            assert r.finals == 1 and r.streamed == out, r.rid
            assert not ends or ends == [len(out) - 1], f"{r.rid} ran past an end token: {out}"
            if seq.finish_reason == "length":
                assert len(out) == p.max_tokens, r.rid
            else:
                assert seq.finish_reason == "stop", (r.rid, seq.finish_reason)
                assert ends or (seq.stop_matcher is not None and seq.stop_matcher.stop_reason is not None) or (
                    seq.constraint is not None and seq.constraint.stopped), r.rid
            if seq.constraint is not None:  # the grammar's choice, whole when it ended it
                text = self.e.tokenizer.decode(out)
                assert any(c.startswith(text) for c in ("yes", "no", "maybe so")), (r.rid, text)
                assert seq.finish_reason == "length" or ends or seq.stop_matcher is not None or text in (
                    "yes", "no", "maybe so"), (r.rid, text)
            if p.prompt_logprobs is not None:
                assert r.prompt_logprobs is not None, f"{r.rid} got no prompt logprobs"
            # A seeded request draws what it draws alone (its key is fold_in(seed, tokens
            # generated)), ngram's verification included; a draft model's rejection sampling
            # emits the target distribution, not plain sampling's very draws.
            if p.temperature == 0.0 or p.seed is not None and not self.draft_model:
                tokens, reason, lps, plps = run_alone(tuple(r.prompt), p)
                assert (tuple(out), seq.finish_reason) == (tokens, reason), f"{r.rid} differs from alone"
                assert r.logprobs == pytest.approx(lps, abs=1e-4), r.rid
                if plps is not None:
                    assert r.prompt_logprobs[1:] == pytest.approx(plps[1:], abs=1e-4), r.rid
        self.check_stats()

    def check_stats(self) -> None:
        st_, seqs = self.e.stats, [r.seq for r in self.requests]
        assert st_.generation_tokens == sum(len(s.output_token_ids) for s in seqs)
        reasons = {k: sum(s.finish_reason == k for s in seqs) for k in ("stop", "length", "abort", "error")}
        assert st_.request_success == reasons
        assert st_.num_preemptions == sum(s.num_preemptions for s in seqs)
        started = [s for s in seqs if s.first_token_time is not None]
        assert st_.prompt_tokens == sum(s.num_prompt_tokens for s in started)
        if self.cfg.enable_prefix_caching:
            # (a request asking prompt_logprobs makes no prefix-cache query)
            scheduled = [s for s in seqs if s.first_scheduled_time is not None and s.params.prompt_logprobs is None]
            assert st_.prefix_cache_requests == len(scheduled)
            assert st_.prefix_cache_hits == sum(s.num_cached_tokens for s in scheduled)
        assert st_.swapped_in_blocks <= st_.swapped_out_blocks
        assert st_.num_requests_running == st_.num_requests_waiting == 0 and st_.kv_cache_usage == 0
        computed = st_.prefill_tokens + st_.decode_tokens + st_.spec_decode_num_draft_tokens
        if not any(r.aborted for r in self.requests) and not self.cfg.async_scheduling:
            assert st_.useful_tokens == computed, (st_.useful_tokens, st_.prefill_tokens, st_.decode_tokens)
            assert st_.recomputed_tokens == sum(s.num_recomputed_tokens for s in seqs)
        else:
            # A row whose request ended before its step came back (aborted meanwhile, or, under
            # async scheduling, ended by the step before's token) ran, but is counted nowhere.
            assert st_.useful_tokens >= computed
            assert st_.recomputed_tokens <= sum(s.num_recomputed_tokens for s in seqs)
        assert st_.recomputed_tokens <= st_.prefill_tokens


def run_ops(config: dict, ops: list[tuple]) -> Run:
    run = Run(config)
    for op in ops:
        if op[0] == "add":
            run.add(*op[1:])
        elif op[0] == "abort":
            run.abort(*op[1:])
        elif op[0] == "reset":
            run.reset(*op[1:])
        else:
            for _ in range(op[1]):
                run.step()
    run.drain()
    run.finish()
    return run


@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=int(os.environ.get("TAXIRANK_FUZZ_EXAMPLES", 8)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations)
# Always run, whatever hypothesis draws first (its first examples are small): long requests
# that preempt each other (swap where configured), n = 2, stop strings and tokens, a grammar,
# aborts of a request in flight and of a preempted one, an aborted id reused at once.
@example(ops=[("add", "shared", 24, 14, "greedy", None, 1, 1, 0, False, None),
              ("add", "loop", 20, 14, "seeded", "stop_string", 5, 2, 2, False, "logprobs"),
              ("add", "own", 22, 14, "greedy", "stop_token", 3, 1, 1, False, "prompt_logprobs"),
              ("step", 4), ("abort", "in_flight", 1),
              ("add", "shared", 18, 14, "greedy", None, 2, 1, 0, True, None),
              ("add", "shared", 10, 9, "greedy", "eos", 0, 1, 0, False, "choice"),
              ("step", 3), ("reset", True), ("abort", "preempted", 0), ("step", 2), ("reset", False),
              ("add", "own", 23, 14, "random", None, 4, 2, 2, False, "min_tokens")])
def test_adversarial_operations_keep_the_engines_bookkeeping(name, ops):
    run_ops(CONFIGS[name], ops)
