"""The engine: one loop of schedule -> run -> update -> record.

  EngineRequest  one request as it enters the engine, its fields named once (vLLM's EngineCoreRequest).
  LLMEngine      the synchronous core: add_request, abort, step (its parts are built by
                 startup.py: the model, the sized KV cache, the scheduler, the runner).
What it gives back (a RequestOutputDelta per request per step) is in outputs.py.

Two front doors drive it: LLM (llm.py) for offline generation on the caller's thread, and
AsyncEngine (async_engine.py), which runs this loop on its own thread for the servers.

EngineConfig (config.py) and SamplingParams (sampling_params.py) are re-exported here;
neither module imports JAX, so the scheduler can take them.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence as Seq

import jax
import numpy as np

from config import EngineConfig
from hf_config import generation_sampling_defaults
from logits_controls import bad_words_token_ids, check_bad_words, controls_for, first_token_conflict
from metrics import ParentRequest, RequestMetrics, StepTrace
from outputs import RequestOutputDelta, TokenLogprob
from reasoning_parsers import REASONING_PARSERS
from runner_output import InFlightStep, PromptLogprobs, StepResult
from sampling_params import ParamError, SamplingParams, SLOTarget, check_cache_salt
from scheduler_output import ScheduledSeq, SchedulerOutput, StepOutcome
from sequence import Sequence
from spec_decode import StepProposer
from startup import build_engine
from structured import GrammarCompiler, new_constraint, next_mask
from tokenizer import IncrementalDetokenizer

__all__ = ["EngineConfig", "SamplingParams", "SLOTarget", "EngineRequest", "LLMEngine", "RequestMetrics",
           "QueueFullError", "EngineDeadError"]


class QueueFullError(RuntimeError):
    """max_waiting_requests requests are already waiting."""


class PreemptionRefusedError(ValueError):
    """reset_prefix_cache(reset_running_requests=True) under a batching that never preempts
    (static): refused before anything changed."""


class EngineDeadError(RuntimeError):
    """The engine loop died; every open stream gets this, and the server exits."""


@dataclass(frozen=True)
class EngineRequest:
    """One request as it enters the engine (vLLM's EngineCoreRequest): what its client asked
    for, every field set once, by name. LLMEngine.add checks it and turns it into the
    scheduler's Sequence, which carries the request's state from then on."""

    request_id: str
    prompt_token_ids: Seq[int]
    params: SamplingParams  # one sample (n = 1): its callers expand n (child_requests)
    arrival_time: float | None = None  # time.monotonic(); None: when the engine takes the request
    priority: int = 0  # under a policy that reads it (--scheduling-policy), lower runs first
    user: str | None = None  # the client, for the fair policy (None: the shared anonymous client)
    slo: SLOTarget | None = None  # its targets, for the slo policy (None: the server-wide defaults)
    # Its structured-output constraint, compiled: LLMEngine.validate fills it in, unless a
    # caller that must not block (the server's event loop) compiled it on another thread first.
    grammar: Any = None
    parent: ParentRequest | None = None  # one of n samples' shared ParentRequest (child_requests')
    # The chat request did not switch thinking off (its template variable enable_thinking,
    # chat_format.thinking_enabled), which the qwen3 reasoning parser reads: it decides where a
    # reasoning model's constraint starts.
    thinking: bool = True
    # vLLM's (a non-empty string, as the client sent it: LLMEngine.validate checks it): its
    # prefix-cache blocks are shared only with requests of the same salt.
    cache_salt: str | None = None
    # Its bad_words as token sequences (logits_controls.bad_words_token_ids): LLMEngine.validate
    # tokenizes them once, for its checks and the request's LogitsControls.
    bad_words_ids: list[list[int]] | None = None


class LLMEngine:
    """Synchronous core. Not thread-safe: one thread drives it (AsyncEngine's loop).

    record_trace=True keeps a StepTrace per step in `self.trace`."""

    def __init__(self, config: EngineConfig, log: Callable[[str], None] = print, record_trace: bool = False):
        # A request's sampling defaults (vLLM's --generation-config), read before the weights
        self.sampling_defaults = generation_sampling_defaults(config)  # SamplingParams keywords
        parts = build_engine(config, log)
        self.log = log
        self.config, self.loaded, self.stats = parts.config, parts.loaded, parts.stats
        self.scheduler, self.runner, self.num_kv_blocks = parts.scheduler, parts.runner, parts.num_kv_blocks
        self.proposer = parts.proposer  # speculative decoding (spec_decode.py), or None
        self.model_config = parts.loaded.config
        self.tokenizer = parts.loaded.tokenizer
        self.trace: list[StepTrace] | None = [] if record_trace else None
        # Steps dispatched and not yet collected, oldest first: with async scheduling one
        # stays on the device while the next is scheduled.
        self._in_flight: deque[tuple[SchedulerOutput, float, InFlightStep | StepResult | None]] = deque()
        self._max_in_flight = 1 if config.async_scheduling else 0
        # Deltas of steps collected between two calls of step() (a reset that preempts the
        # running requests collects the steps in flight first): the next step() returns them.
        self._undelivered: list[RequestOutputDelta] = []
        self._rng = random.Random(config.seed)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        if self.sampling_defaults:
            log(f"default sampling parameters from the generation config: {self.sampling_defaults} (requests that "
                "set them win; --generation-config vllm: none)")
        # Requests that asked prompt_logprobs, until their first token: filled chunk by chunk,
        # by position (a preempted prompt's recomputation writes the same values again).
        self._prompt_lps: dict[str, list[TokenLogprob | None]] = {}

    def follow(self) -> None:
        """Multi-host, processes other than 0: run process 0's steps until it stops.
        They schedule nothing and serve no HTTP."""
        if self.config.process_id == 0:
            raise RuntimeError("process 0 schedules; only the other processes follow")
        self.log(f"process {self.config.process_id}: following process 0's steps")
        self.runner.follow()
        self.log(f"process {self.config.process_id}: process 0 stopped")

    # ---- requests ------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> EngineRequest:
        """Raises ValueError saying why the request cannot run; safe from any thread. Returns
        the request with its structured-output constraint compiled (cached) unless it came
        with one, and a max_tokens of None made the room its prompt leaves. A caller that must
        not block (the server's event loop) compiles it first
        with `self.grammars.compile` on another thread and hands it on, so no later step
        looks it up again in the cache, which other requests' grammars may have evicted it
        from meanwhile."""
        prompt_token_ids, params, grammar = request.prompt_token_ids, request.params, request.grammar
        if params.max_tokens is None:  # vLLM's: the room the context leaves (a prompt that fills it: refused below)
            room = max(self.config.max_model_len - len(prompt_token_ids), 1)
            # (a min_tokens past the room: the length ends the request first, as in vLLM)
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        if params.n != 1:  # one engine request is one sample: its callers expand n (child_requests)
            raise ParamError(f"the engine runs one sample per request, got n={params.n}: run n requests, "
                             "as LLM.generate and the server do", "n")
        self.scheduler.validate(prompt_token_ids, params, request.priority, request.slo)
        check_cache_salt(request.cache_salt)
        if params.stop and self.tokenizer is None:
            raise ParamError("this model has no tokenizer, so stop strings cannot be matched: use stop_token_ids",
                             "stop")
        vocab = self.model_config.vocab_size
        # vLLM's --max-logprobs and a request's logprobs (-1 for both: the vocabulary), and its
        # messages (its processor's _validate_logprobs)
        cap = vocab if self.config.max_logprobs == -1 else self.config.max_logprobs
        for name, kind, n in (("logprobs", "sample", params.logprobs), ("prompt_logprobs", "prompt",
                                                                       params.prompt_logprobs)):
            n = vocab if n == -1 else n
            if n is not None and n > cap:
                raise ParamError(f"Requested {kind} logprobs of {n}, which is greater than max allowed: {cap}", name)
        if params.logit_bias:  # vLLM's messages (its processor's _validate_logit_bias, ...)
            bad = [str(t) for t in params.logit_bias if not 0 <= t < vocab]
            if bad:  # a JSON key may be thousands of digits long: not quoted whole
                shown = ", ".join(t if len(t) <= 20 else f"{t[:8]}...({len(t.lstrip('-'))} digits)" for t in bad[:8])
                raise ParamError(f"token_id(s) [{shown}] in logit_bias contain out-of-vocab token ids. "
                                 f"Vocabulary size: {vocab}", "logit_bias")
        if params.allowed_token_ids is not None and not all(0 <= t < vocab for t in params.allowed_token_ids):
            raise ParamError("allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids")
        if params.bad_words and self.tokenizer is None:
            raise ParamError("this model has no tokenizer, so bad_words cannot be tokenized: use allowed_token_ids "
                             "or logit_bias", "bad_words")
        bad_words_ids = None
        if params.bad_words:
            bad_words_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            check_bad_words(bad_words_ids)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        if params.masks_tokens:
            self._check_first_token(prompt_token_ids, params, grammar, bad_words_ids)
        return dataclasses.replace(request, params=params, grammar=grammar, bad_words_ids=bad_words_ids)

    def _check_first_token(self, prompt_token_ids: Seq[int], params: SamplingParams, grammar: Any,
                           bad_words_ids: list[list[int]] | None) -> None:
        """A ParamError naming the fields when the request's masks leave no token for its
        first output (its grammar's first tokens against allowed_token_ids, bad_words,
        min_tokens' stop tokens, or those against each other): it could output nothing, so
        it is refused here, not admitted to end at once. One whose masks part only later
        ends there, without a token (runner.sample, Scheduler.update)."""
        vocab = self.model_config.vocab_size
        controls = controls_for(params, prompt_token_ids, vocab, self.model_config.eos_token_ids, bad_words_ids)
        checks: list[tuple[Any, bool]] = [(None, True)]
        if grammar is not None:
            row = next_mask(grammar.deep_copy(), vocab)
            # With a --reasoning-parser the grammar may start later (after thinking): there it
            # meets the masks that hold at every position, not min_tokens'.
            checks = [(row, True)] if self.config.reasoning_parser is None else [(None, True), (row, False)]
        for grammar_row, first in checks:
            fields = first_token_conflict(controls, grammar_row, first)
            if fields:
                what = " and ".join(fields)
                if grammar_row is not None:
                    what = f"the structured output constraint ({params.structured_outputs.kind}) and {what}"
                raise ParamError(f"{what} leave no token allowed for the output's first token"
                                 if first else f"{what} leave no token allowed where the constraint starts",
                                 fields[0])

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                    **fields: Any) -> Sequence:
        """Add a request; its other fields (priority, user, slo, ...) by keyword, as
        EngineRequest names them."""
        return self.add(EngineRequest(request_id, prompt_token_ids, params, **fields))

    def add(self, request: EngineRequest) -> Sequence:
        """Check the request (validate) and queue it; returns its Sequence."""
        return self.enqueue(self.validate(request))

    def enqueue(self, request: EngineRequest, place_reserved: bool = False) -> Sequence:
        """Queue a request that validate() returned; returns its Sequence. AsyncEngine
        validates on its caller's thread and hands the loop this half alone: a check (a
        grammar's first-token mask among them) runs once, never on the engine loop.
        place_reserved: its waiting place is one its caller reserved (Sequence.place_reserved)."""
        params = request.params
        vocab = self.model_config.vocab_size
        if params.top_k >= vocab:  # vLLM: a top_k above the vocabulary keeps all
            params = dataclasses.replace(params, top_k=-1)
        if -1 in (params.logprobs, params.prompt_logprobs):  # vLLM's -1: the whole vocabulary
            params = dataclasses.replace(params, logprobs=vocab if params.logprobs == -1 else params.logprobs,
                                         prompt_logprobs=vocab if params.prompt_logprobs == -1
                                         else params.prompt_logprobs)
        arrival = time.monotonic() if request.arrival_time is None else request.arrival_time
        seq = Sequence(request_id=request.request_id, prompt_token_ids=[int(t) for t in request.prompt_token_ids],
                       params=params, arrival_time=arrival, priority=request.priority, user=request.user,
                       parent=request.parent, cache_salt=request.cache_salt, place_reserved=place_reserved)
        if request.slo is not None:
            seq.slo_ttft, seq.slo_tpot = request.slo.seconds
        # A request without a seed still gets its own stream, drawn from the engine's seed;
        # any integer seed (-1, 2**64, ...) maps into the sampler's 32-bit seed space.
        seq.seed = params.seed % 2**32 if params.seed is not None else self._rng.getrandbits(31)
        if params.structured_outputs is not None:
            seq.constraint = new_constraint(request.grammar.deep_copy(),  # its own
                                            self._reasoning_end(seq, request.thinking), self._token_text)
        assert (request.bad_words_ids is not None) == bool(params.bad_words), "enqueue takes what validate() returned"
        seq.controls = controls_for(params, seq.prompt_token_ids, self.model_config.vocab_size,
                                    self.model_config.eos_token_ids, request.bad_words_ids)
        if params.stop:
            seq.stop_matcher = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, list(params.stop), params,
                                                      self.model_config.eos_token_ids)
        self.scheduler.add(seq)
        if params.prompt_logprobs is not None:
            self._prompt_lps[seq.request_id] = [None] * len(seq.prompt_token_ids)
        return seq

    def _reasoning_end(self, seq: Sequence, thinking: bool) -> str:
        """The tag that ends a reasoning model's thinking, when the --reasoning-parser
        reads seq's output as reasoning until it (`implicit`: the prompt did not close the
        think block, and thinking is on or the parser ignores the switch): its constraint
        waits for it, as vLLM's structured outputs wait for reasoning to end. Otherwise ""
        (the response text starts with the output, and so does the constraint: under it no
        think block opens, unless the grammar writes one)."""
        name = self.config.reasoning_parser
        if name is None or self.tokenizer is None:
            return ""
        prompt_end = self.tokenizer.decode(seq.prompt_token_ids[-32:], skip_special_tokens=False)
        parser = REASONING_PARSERS[name](prompt_end, thinking)
        if not parser.implicit:
            return ""
        return parser.end

    def _token_text(self, token: int) -> str:
        """One token's text, as the reasoning parser reads it (special tokens included)."""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def abort(self, request_id: str, error: Exception | None = None) -> RequestOutputDelta | None:
        """Drop a request now (idempotent); its last delta (None: no such request in flight).
        A request ends for its client when it is released, so one that static batching holds
        seated after its last token ends as an abort. error: it failed alone, with this
        (finish_reason "error", vLLM's FinishReason.ERROR: a 500 to its client)."""
        seq = self.scheduler.abort(request_id, "abort" if error is None else "error")
        self._prompt_lps.pop(request_id, None)
        if seq is None:
            return None
        if self._undelivered:  # a delta names no request after its last one
            self._undelivered = [d for d in self._undelivered if d.request_id != request_id]
        if self.proposer is not None:
            self.proposer.free(seq)
        if seq.first_scheduled_time is None:  # its first step may be in flight: it was scheduled
            at = next((t for o, t, _ in self._in_flight if any(s.seq is seq for s in o.scheduled)), None)
            if at is not None:
                self.stats.record_first_scheduled(seq, at, self.config)
        self.stats.record_finished(seq, time.monotonic())
        self._refresh_gauges()
        return RequestOutputDelta.final(seq, self.model_config.eos_token_ids, error=error)

    @property
    def num_waiting_unreserved(self) -> int:
        """Requests in the scheduler's waiting queue at this instant whose place no caller
        reserved (enqueue's place_reserved). Safe from any thread: one int the queue keeps
        (policy.py), read whole under the GIL; a step running meanwhile may change it right after."""
        return self.scheduler.num_waiting_unreserved

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight) or bool(self._undelivered)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache). False, and nothing
        changed, while a request holds KV blocks, unless reset_running_requests: then the
        steps in flight are collected (the next step() returns their deltas) and every
        running request is preempted by recompute, its K/V computed again on its next
        admission, as after a weight update, when all of it is stale. PreemptionRefusedError
        under a batching that never preempts (static)."""
        if not isinstance(reset_running_requests, bool):  # (a string such as "false" would read as true)
            raise ValueError(f"reset_running_requests must be a boolean, got {reset_running_requests!r}")
        if reset_running_requests:
            batching = self.scheduler.batching
            if not batching.may_preempt:
                raise PreemptionRefusedError(f"{batching.name} batching never preempts a running request; "
                                             "reset_running_requests needs continuous batching")
            self._undelivered += self._drain()  # the preemptions come after every token in flight
            out = self.scheduler.preempt_running()
            if out.preempted:
                self._prepare(out)
                self._in_flight.append((out, time.monotonic(), None))
                self._undelivered += self._collect()
        ok = self.scheduler.reset_prefix_cache()
        if ok:
            with self.stats.lock:
                self.stats.prefix_cache_resets += 1
        self.log(f"prefix cache {'reset' if ok else 'NOT reset: requests still hold KV blocks'}")
        return ok

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[RequestOutputDelta]:
        """schedule -> run -> update -> record. Returns one delta per request that got a
        token, was released, or failed alone (its last delta, finish_reason "error": the
        one place a failure is reported). With async scheduling the step dispatched here
        is collected by the next call, so the host schedules step N+1 while the device runs
        step N (an empty step dispatches nothing and collects the one in flight).

        Speculative decoding: proposals are made from every token of a sequence, so while
        the scheduler may speculate (below disable_by_batch_size) the loop is synchronous,
        and a step that verifies proposals is collected before step() returns."""
        deltas = self._collect_early()
        out = self.scheduler.schedule()
        self._prepare(out)
        if out.scheduled or out.preempted or not self._in_flight:  # a preemption is recorded with its step
            at = time.monotonic()
            out, step = self._dispatch(out, deltas, at)
            self._in_flight.append((out, at, step))
        if self._overlaps(out):  # its tokens come back with the next call
            self._refresh_gauges()  # nothing came back yet, but who runs and waits moved
            return deltas
        return deltas + self._collect()

    def _collect_early(self) -> list[RequestOutputDelta]:
        """The deltas a step returns before its own: those a reset collected since the last
        step, and the step in flight when the next step's proposals need its tokens."""
        deltas, self._undelivered = self._undelivered, []
        if self._in_flight and self._needs_every_token():
            deltas += self._collect()
        return deltas

    def _needs_every_token(self) -> bool:
        """Proposals are made from every token of a sequence: while the scheduler may
        speculate, the step in flight is collected before the next is scheduled."""
        return self.proposer is not None and self.scheduler.speculating

    def _prepare(self, out: SchedulerOutput) -> None:
        """What the scheduler decided that must happen before out's step runs: preemptions
        logged, a preempted row's draft K/V freed (its blocks are gone), drafts proposed for
        the rows given room (by a proposer that runs after scheduling), and KV blocks
        swapped (the step may write where a swapped-out block was). Interrupted or failed,
        the step runs nowhere (_unname_unrun)."""
        try:
            if out.preempted:
                self._log_preemptions(out)
            proposer = self.proposer
            if proposer is not None:
                for seq in out.preempted:
                    proposer.free(seq)
                if out.num_spec_tokens and not proposer.drafts_at_scheduling:  # else schedule() took them
                    self._propose(proposer, out)
            if out.swap_out or out.swap_in:
                self.runner.swap(out.swap_out, out.swap_in)
        except BaseException:
            self._unname_unrun(out)
            raise

    def _overlaps(self, out: SchedulerOutput) -> bool:
        """Async scheduling: out's step stays on the device while the host schedules the
        next, unless nothing ran, it would be a second step in flight, or it verifies
        proposals (the next proposals read the tokens it accepts)."""
        return bool(out.scheduled) and len(self._in_flight) <= self._max_in_flight and not out.num_spec_tokens

    def _propose(self, proposer: StepProposer, out: SchedulerOutput) -> None:
        """The drafts of the rows the scheduler reserved room for; it trims each row to them."""
        spec = self.config.speculative_config
        assert spec is not None
        rows = [s.seq for s in out.scheduled if s.num_spec_tokens]
        proposals = proposer.propose(rows, spec.k)
        self.scheduler.take_proposals(out, proposals.token_ids, proposals.draft_probs)

    def _collect(self) -> list[RequestOutputDelta]:
        """Wait for the oldest step in flight, update the scheduler with it, record it."""
        out, scheduled_at, step = self._in_flight.popleft()
        result = step.result() if isinstance(step, InFlightStep) else step
        spec = {i: t for i, (t, _) in result.spec.items()} if result is not None and result.spec else None
        outcome = self.scheduler.update(out, result.tokens.tolist() if result is not None else [], spec)
        if spec:
            self.stats.record_spec_decode([(out.scheduled[i].num_spec_tokens, len(t) - 1) for i, t in spec.items()])
        return self._record(out, result, outcome, scheduled_at)

    def _dispatch(self, out: SchedulerOutput, deltas: list[RequestOutputDelta],
                  scheduled_at: float) -> tuple[SchedulerOutput, InFlightStep | StepResult | None]:
        """Dispatch out's step (scheduled at `scheduled_at`): the step as it runs (out, less
        the rows that failed alone) and its result. The steps collected meanwhile add their
        deltas to `deltas`."""
        if not out.scheduled:  # nothing runs, but update() may still release a static batch
            return out, None
        try:
            return out, self._execute(out, deltas)
        except Exception as e:
            deltas += self._drain()  # rows run alone may sample under a constraint: see _execute
            return self._isolate_failure(out, e, scheduled_at, deltas)
        except BaseException:  # an interrupt (Ctrl-C)
            self._unname_unrun(out)
            raise

    def _unname_unrun(self, out: SchedulerOutput) -> None:
        """out's step will not run (an interrupt, or a failure before its rows were sent): unless
        the device got it, the blocks its rows were to write lose their prefix-cache names, so no
        later request reads K/V nobody wrote, and the policy takes back each row's charge. Its
        requests are left to the caller to abort (LLM.generate does)."""
        if self._cache_donated():
            return
        for sch in out.scheduled:
            if sch.seq.finished:  # ended by a step collected since this one was scheduled
                self.scheduler.ran_nowhere_ended(sch)
            else:
                self.scheduler.ran_nowhere(sch)

    def _execute(self, out: SchedulerOutput, deltas: list[RequestOutputDelta]) -> InFlightStep:
        """Structured outputs: a constrained row's bitmask needs its previous token, which
        the step in flight may still be computing. Its step's forward is dispatched first;
        the earlier steps are collected while it runs (their tokens advance the matchers),
        then the bitmask is filled and the sample program dispatched. Unconstrained steps
        keep the whole overlap; a constrained one overlaps the host's work with its forward."""
        step = self.runner.execute(out)
        if step.awaits_mask:
            with self.stats.lock:
                self.stats.constrained_sample_steps += 1
            deltas += self._drain()
            self.runner.sample(step)
        return step

    def _drain(self) -> list[RequestOutputDelta]:
        deltas = []
        while self._in_flight:
            deltas += self._collect()
        return deltas

    def _record(self, out: SchedulerOutput, result: StepResult | None, outcome: StepOutcome,
                scheduled_at: float) -> list[RequestOutputDelta]:
        """Count the step, keep its trace, and turn it into deltas."""
        logprobs = self._logprobs(out.scheduled, result)
        if result is not None and result.prompt_logprobs:
            self._collect_prompt_logprobs(out.scheduled, result.prompt_logprobs, outcome.discarded)
        if outcome.discarded:
            # Rows whose sequence ended before this step came back computed nothing anyone
            # sees: they are counted nowhere and produce no delta.
            dropped = {id(s) for s in outcome.discarded}
            out = out.restricted_to([s for s in out.scheduled if id(s) not in dropped])
        accepted, released = outcome.accepted, outcome.finished
        extra = sum(len(t) - 1 for t in outcome.emitted.values())  # verified rows' tokens beyond one
        self.stats.record_step(out, accepted, released, scheduled_at, time.monotonic(), self.config, extra)
        self._refresh_gauges()
        # A step that only preempted (nothing ran) is kept too: the trace shows every preemption.
        if self.trace is not None and (out.scheduled or out.preempted):
            self.trace.append(StepTrace.of(self.stats.num_steps, out, accepted, released,
                                           self.scheduler.num_running, self.scheduler.num_waiting))
        deltas: list[RequestOutputDelta] = []
        add, delta, get = deltas.append, RequestOutputDelta, accepted.get  # locals: read per row
        prompt_lps, emitted = self._prompt_lps, outcome.emitted
        # (A sequence that sampled was admitted: its num_cached_tokens is set, >= 0.)
        plain = not (logprobs or prompt_lps or emitted)  # the common step: one token per row and nothing else
        for sch in out.scheduled:  # once per running sequence in a decode step: kept lean
            if not sch.samples:
                continue
            seq = sch.seq
            rid = seq.request_id
            token = get(rid)
            if token is None:
                continue
            if plain:
                d = delta(rid, [token], None, False, None, len(seq.prompt_token_ids), len(seq.output_token_ids),
                          seq.num_cached_tokens)
            else:
                lp = logprobs.get(rid) if logprobs else None
                tokens = emitted.get(rid, [token]) if sch.num_spec_tokens else [token]
                d = delta(rid, tokens, None if lp is None else lp[:len(tokens)], False, None,
                          len(seq.prompt_token_ids), len(seq.output_token_ids), seq.num_cached_tokens, None,
                          prompt_lps.pop(rid, None) if prompt_lps else None)
            add(d)
            d.ended = seq.finish_reason is not None
            if seq.stop_matcher is not None:  # its text is made here: update() fed the matcher the tokens
                d.new_text = seq.stop_matcher.take(d.ended)
        if released:
            by_id = {d.request_id: d for d in deltas}
            for seq in released:  # its last delta, possibly empty (static: padding released with its batch)
                if self.proposer is not None:
                    self.proposer.free(seq)
                if seq.no_token_allowed:
                    self.log(f"request {seq.request_id}: its masks (structured output constraint, allowed_token_ids, "
                             f"bad_words, min_tokens) allow no token after {seq.num_output_tokens} output tokens: "
                             f"ended ({seq.finish_reason}) without one")
                d = by_id.get(seq.request_id)
                last = RequestOutputDelta.final(seq, self.model_config.eos_token_ids, d)
                if d is None:
                    deltas.append(last)
        return deltas

    def _log_preemptions(self, out: SchedulerOutput) -> None:
        """One line per preemption (vLLM's): who, how, the computed tokens it gives up or
        moves, KV usage after, and the running totals, so the recompute tax is visible as it
        is paid."""
        usage = self.scheduler.allocator.usage
        # The stats count a step's preemptions when it is collected: a step still in flight
        # (async scheduling) has made its own already.
        before = self.stats.num_preemptions + sum(len(o.preempted) for o, _, _ in self._in_flight)
        for total, seq, n, swapped in zip(itertools.count(before + 1), out.preempted, out.preempted_tokens,
                                          out.preempted_swapped):
            mode, what = ("swap", "moved to the host pool") if swapped else ("recompute", "dropped")
            self.log(f"preempted {seq.request_id} ({mode}): {n} computed tokens {what} "
                     f"({seq.num_prompt_tokens} prompt + {seq.num_output_tokens} output), KV usage {usage:.0%}, "
                     f"{seq.num_preemptions} preemption(s) of it, {total} in all")

    # ---- one request's bad inputs end that request, not the engine -----------------
    def _cache_donated(self) -> bool:
        """True once a failed step got as far as the device: its donated KV cache is gone."""
        return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.runner.kv_caches))

    def _isolate_failure(self, out: SchedulerOutput, error: Exception, scheduled_at: float,
                         deltas: list[RequestOutputDelta]) -> tuple[SchedulerOutput, StepResult]:
        """The step failed. If it failed before the device ran (the KV cache was not
        donated), it was preparing some request's inputs: run each scheduled request alone
        to find the culprits, end each with a final delta of finish_reason "error" carrying
        what it failed with (added to `deltas`), and return the step restricted to the
        others, with their results as if it had run whole (less any that shared blocks a
        culprit was to write: _rerun). Otherwise the engine is broken: re-raise, and the
        loop dies loudly. The engine is broken when no row fails alone, or when every row
        does and they are more than one request's (the n samples of one are its own)."""
        if self._cache_donated():
            raise error
        tokens, lps, ok, bad, prompt, spec = [], [], [], [], {}, {}
        unwritten: set[int] = set()  # KV blocks the rows that ran nowhere were to write
        ended = False  # a row's request ended meanwhile: it may have been the culprit
        passed = 0  # rows that ran alone without failing (ok, and the rerun ones)
        for sch in out.scheduled:
            if sch.seq.finished:
                # Ended by a step collected since this one was scheduled (async scheduling):
                # its slot is gone, so it runs nowhere (no service: its charge is taken back),
                # and update() would discard its row.
                self.scheduler.ran_nowhere_ended(sch)
                ended = True
                continue
            one = SchedulerOutput([sch], num_prefill_tokens=0 if sch.is_decode else sch.num_new_tokens,
                                  num_decode_tokens=int(sch.is_decode), num_spec_tokens=sch.num_spec_tokens,
                                  draft_probs=out.draft_probs)
            try:
                r = self._execute(one, []).result()  # (nothing is in flight: no deltas)
            except Exception as e:
                if self._cache_donated():
                    raise
                self.log(f"request {sch.seq.request_id} failed while preparing its step inputs: {e!r}")
                unwritten.update(self.scheduler.ran_nowhere(sch))
                bad.append((sch.seq, e))
                continue
            passed += 1
            if unwritten.intersection(sch.seq.block_table):
                # It ran alone (so it is no culprit, and a broken engine still shows) but
                # read blocks a culprit did not write: its result is thrown away.
                self._rerun(sch, unwritten)
                continue
            if r.prompt_logprobs:
                prompt[len(ok)] = r.prompt_logprobs[0]
            if r.spec:
                spec[len(ok)] = r.spec[0]
            ok.append(sch)
            tokens.append(int(r.tokens[0]))
            lps.append(r.logprobs)
        if (not bad and not ended) or (not passed and len({id(seq.parent or seq) for seq, _ in bad}) > 1):
            raise error
        if not bad:
            self.log(f"a step failed ({error!r}), but each of its requests ran alone: the culprit was a request "
                     "that ended meanwhile")
        for seq, e in bad:
            if seq.first_scheduled_time is None:  # this was its first step: it was scheduled, its prefix looked up
                self.stats.record_first_scheduled(seq, scheduled_at, self.config)
            last = self.abort(seq.request_id, e)
            assert last is not None, seq.request_id  # a culprit ran alone, so it was in flight
            deltas.append(last)
        for seq in list(self.scheduler.running):  # one that boarded without a row (static batching)
            if not seq.finished and unwritten.intersection(seq.block_table):
                self._rerun(ScheduledSeq(seq, 0, False, False), unwritten)
        logprobs = None
        if any(lp is not None for lp in lps):
            K = self.runner.logprobs_width
            z = (np.zeros(1, np.float32), np.zeros(1, np.int32), np.zeros((1, K), np.int32),
                 np.zeros((1, K), np.float32))
            parts = [lp if lp is not None else z for lp in lps]
            logprobs = tuple(np.concatenate([p[i] for p in parts]) for i in range(len(z)))
        return out.restricted_to(ok), StepResult(np.asarray(tokens, np.int32), logprobs, prompt or None, spec or None)

    def _rerun(self, sch: ScheduledSeq, unwritten: set[int]) -> None:
        """sch's sequence holds blocks a row that ran nowhere was to write (its prefix-cache
        hit, named in the failed step): it would read K/V nobody wrote, so its row runs
        nowhere too and it computes them itself in a later step (Scheduler.rerun)."""
        self.log(f"request {sch.seq.request_id} shared KV blocks a failed request was to compute: "
                 "it computes them again")
        unwritten.update(self.scheduler.rerun(sch))
        if self.proposer is not None:
            self.proposer.free(sch.seq)

    def _collect_prompt_logprobs(self, scheduled: list[ScheduledSeq], rows: dict[int, PromptLogprobs],
                                 discarded: list[ScheduledSeq]) -> None:
        # A discarded row's request was aborted after the step was dispatched: its id may
        # already name a new request, whose prompt these logprobs are not.
        skip = {id(s) for s in discarded}
        for row, p in rows.items():
            if id(scheduled[row]) in skip:
                continue
            seq = scheduled[row].seq
            dest = self._prompt_lps.get(seq.request_id)
            if dest is None:  # aborted meanwhile
                continue
            k = seq.params.prompt_logprobs
            targets = seq.prompt_token_ids[p.start + 1:p.start + 1 + len(p.logprob)]
            for j, (tok, lp, rank) in enumerate(zip(targets, p.logprob.tolist(), p.rank.tolist())):
                dest[p.start + 1 + j] = TokenLogprob(tok, lp, list(zip(p.top_ids[j, :k].tolist(),
                                                                       p.top_logprobs[j, :k].tolist())), rank)

    def _logprobs(self, scheduled: list[ScheduledSeq], result: StepResult | None) -> dict[str, list[TokenLogprob]]:
        """Each sampling row's tokens' logprobs (a verified row's: one per emitted token)."""
        if result is None or result.logprobs is None:
            return {}
        tok_lp, rank, top_ids, top_lp = result.logprobs
        spec = result.spec or {}
        out = {}
        for s, sch in enumerate(scheduled):
            k = sch.seq.params.logprobs
            if not sch.samples or k is None:
                continue
            if s in spec:
                toks, (lp, rk, ids, tlp) = spec[s]
                out[sch.seq.request_id] = [TokenLogprob(t, float(lp[j]), list(zip(ids[j, :k].tolist(),
                                                                                  tlp[j, :k].tolist())), int(rk[j]))
                                           for j, t in enumerate(toks)]
            else:
                out[sch.seq.request_id] = [TokenLogprob(int(result.tokens[s]), float(tok_lp[s]),
                                                        list(zip(top_ids[s, :k].tolist(), top_lp[s, :k].tolist())),
                                                        int(rank[s]))]
        return out

    def _refresh_gauges(self) -> None:
        sch = self.scheduler
        by_reason = sch.waiting_by_reason()
        with self.stats.lock:
            self.stats.num_requests_running = sch.num_running
            self.stats.num_requests_waiting = sch.num_waiting
            self.stats.waiting_by_reason = by_reason  # a fresh dict of every metrics.wait_reasons() key
            self.stats.kv_cache_usage = sch.allocator.usage
            self.stats.prefix_cache_evictions = sch.allocator.num_evictions  # a counter the allocator keeps


def child_requests(request_id: str, params: SamplingParams
                   ) -> list[tuple[str, SamplingParams, ParentRequest | None]]:
    """vLLM's parallel sampling (its ParentRequest): the n engine requests of a request
    with params.n samples, as (request id, params with n = 1, the ParentRequest they share,
    which each sample's EngineRequest carries: the request's n is observed once, as its last
    sample finishes).
    With n > 1 sample i is `i_<request_id>`, seeded seed + i (wrapped into the 64-bit seeds
    SamplingParams takes) when the request is seeded, so that it is what the request alone
    gives with that seed."""
    if params.n == 1:
        return [(request_id, params, None)]
    one, parent = dataclasses.replace(params, n=1), ParentRequest(params.n)
    if params.seed is None:
        return [(f"{i}_{request_id}", one, parent) for i in range(params.n)]
    return [(f"{i}_{request_id}", dataclasses.replace(one, seed=(params.seed + i + 2**63) % 2**64 - 2**63), parent)
            for i in range(params.n)]


def decode_output(tokenizer: object, token_ids: Seq[int], params: SamplingParams,
                  eos_token_ids: Seq[int] = (), prompt_ids: Seq[int] = ()) -> str:
    """A whole output as text, as vLLM's detokenizer builds it and the server streams it:
    token by token after the prompt's last tokens, so the first word keeps the space a
    SentencePiece decode of the output alone strips, and a stray byte token is the same
    text (a SentencePiece byte-fallback decode turns a whole run of bytes that is not UTF-8
    into U+FFFDs, a stream only the bytes it could not complete). The EOS or stop token that ended it is
    never text (token_ids still has it) unless include_stop_str_in_output; other special
    tokens follow params.skip_special_tokens."""
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_ids), [], params, tuple(eos_token_ids))
    ids = list(token_ids)
    for j, token in enumerate(ids):  # one at a time, as they arrived: a window decodes bytes as a stream does
        detokenizer.advance([token], final=j == len(ids) - 1)
    return detokenizer.text
