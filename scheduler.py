"""The scheduler: which sequences compute which tokens in the next step. Pure Python.

The engine loop calls `schedule()`, runs the step it describes, then `update()` with the
sampled tokens. The scheduler owns the waiting queue, the running list, the slots
(0..max_num_seqs-1: the seats; a running sequence holds one) and the block allocator; it
knows blocks, never arrays (the runner packs the occupied slots into device rows).

`schedule()` advances the sequences it schedules at once: their computed tokens, and one
in-flight output token (`num_output_placeholders`) for each that samples. `update()`
turns those into real tokens. Between the two, the next step may already be scheduled
(async scheduling): a sequence's next decode then reads a token the host has not seen,
which the runner takes from the device.

What differs between schedulers is asked of three objects from policy.py, chosen by
config: the policy (the waiting queue's order, the KV victim, whether a waiting request
may preempt a running one), the batching (how the mechanics below compose a step, when
a finished sequence gives up its seat) and the KV admission (the blocks a sequence holds
from admission). Everything here is mechanics they share.

Prefix caching (config.enable_prefix_caching, kvcache.py): at admission a sequence takes
the longest cached prefix of its full blocks (shared, ref-counted) and computes only the
rest, always at least its last token (whose logits are sampled). A block is named when
the step that computes it is scheduled (`_add`), so a sequence admitted later in the same
step can already share it: each layer writes the step's K/V before it attends.
"""

from __future__ import annotations

import heapq
import itertools
import os
from typing import Any, Sequence as Seq

import numpy as np

from config import EngineConfig
from kvcache import BlockAllocator, blocks_needed, hash_block_tokens
from metrics import wait_reasons
from policy import BATCHING, KV_ADMISSION, POLICIES, WaitingQueue
from preemption import PreemptionPlan
from sampling_params import ParamError, SamplingParams, SLOTarget
from scheduler_output import ScheduledSeq, SchedulerOutput, StepOutcome
from sequence import FINISHED, RUNNING, WAITING, DuplicateRequestError, Sequence
from spec_decode import scheduling_drafter

# The scheduler's global invariants (every slot owned once, no KV block leaked, blocks
# cover every computed token) cost O(running + blocks in use) a step: at 256 sequences,
# more than the rest of a decode step's host work. They are checked after every step
# when TAXIRANK_CHECK_INVARIANTS=1 (the test suite sets it, tests/conftest.py), and by
# check_invariants(); the local asserts (each block allocated or freed, each sequence's
# token counts) run always.
CHECK_ALL_INVARIANTS = os.environ.get("TAXIRANK_CHECK_INVARIANTS", "") == "1"


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, eos_token_ids: tuple[int, ...],
                 vocab_size: int | None = None, num_swap_blocks: int = 0) -> None:
        """vocab_size: the model's, for validate() (None: token ids are not checked).
        num_swap_blocks: the host pool's size in KV blocks (--preemption-mode swap)."""
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None, \
            "pass config.resolved(...)"
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.allocator = BlockAllocator(num_kv_blocks, enable_caching=config.enable_prefix_caching)
        self.policy = POLICIES.create(config)  # admission order, KV victim, who may preempt (policy.py)
        self.batching = BATCHING.create(config)  # how a step is composed, when a seat frees
        self.kv_admission = KV_ADMISSION.create(config)  # the blocks a sequence holds from admission
        self.waiting: WaitingQueue = self.policy.new_queue()
        self.running: list[Sequence] = []  # admission order; finished ones a batching keeps seated too
        self._free_slots = list(range(config.max_num_seqs))  # a heap: the lowest free slot first
        self._seqs: dict[str, Sequence] = {}  # every request not yet released, by id
        self._admissions = itertools.count()
        self._arrivals = itertools.count()
        self._room_preempted = False  # this step preempted to find blocks for running sequences
        # The waiting requests this step preempted running ones for (ids), or None: nobody else boards.
        self._preempted_for: set[int] | None = None
        self._budget = 0  # tokens left in the step being scheduled
        self.num_swap_blocks = num_swap_blocks if config.swaps_kv else 0
        self._host_free = set(range(self.num_swap_blocks))  # free blocks of the host pool
        self._swap_in: list[tuple[list[int], list[int]]] = []  # this step's, until schedule() returns
        self.spec = config.speculative_config
        self._drafter = scheduling_drafter(self.spec) if self.spec is not None else None
        self._slo_defaults = SLOTarget(config.slo_ttft_ms, config.slo_tpot_ms).seconds

    # ---- requests ----------------------------------------------------------------------
    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams, priority: int = 0,
                 slo: SLOTarget | None = None) -> None:
        """Everything a request must satisfy that the config decides; raises ValueError
        saying why. Reads only what never changes after start-up: safe from any thread."""
        cfg, n = self.config, len(prompt_token_ids)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and not self.policy.uses_priority:
            readers = POLICIES.names_where(lambda p: p.uses_priority)
            raise ParamError(f"priority {priority} was given, but priority scheduling is not enabled "
                             f"(--scheduling-policy {readers}; {self.policy.name} does not read it)", "priority")
        if slo is not None and not isinstance(slo, SLOTarget):
            raise ValueError(f"slo must be an SLOTarget, got {type(slo).__name__}")
        if slo is not None and not self.policy.uses_slo:
            readers = POLICIES.names_where(lambda p: p.uses_slo)
            raise ParamError(f"an slo was given, but the {self.policy.name} scheduling policy does not read it "
                             f"(--scheduling-policy {readers})", "slo")
        if n == 0:
            raise ValueError("the prompt is empty")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        # Before the per-token scan: an over-long prompt is refused in O(1), not after a pass
        # over millions of ids on the caller's thread (the server's event loop).
        if n + params.max_tokens > cfg.max_model_len:
            raise ValueError(f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is "
                             f"{n + params.max_tokens} tokens, over max_model_len ({cfg.max_model_len})")
        if self.vocab_size is not None:
            vocab = self.vocab_size
            bad = [t for t in prompt_token_ids
                   if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab}) or not an integer")
        # On-demand too: a sequence larger than the whole cache would preempt itself forever.
        need = blocks_needed(self.kv_admission.lifetime_tokens(n, params.max_tokens, cfg), cfg.block_size)
        if need > self.allocator.num_usable:
            raise ValueError(f"the request needs {need} KV blocks of {cfg.block_size} tokens "
                             f"({self.kv_admission.name}), the whole cache has {self.allocator.num_usable}")

    def add(self, seq: Sequence) -> None:
        """Queue a request that passed validate()."""
        if seq.request_id in self._seqs:
            raise DuplicateRequestError(seq.request_id)
        assert seq.status is WAITING and seq.num_computed_tokens == 0 and not seq.block_table
        assert 0 < seq.num_prompt_tokens and seq.num_prompt_tokens + seq.params.max_tokens <= self.config.max_model_len
        seq.arrival_order = next(self._arrivals)
        if self.policy.uses_slo:  # the server-wide targets, where the request set none
            ttft, tpot = self._slo_defaults
            if seq.slo_ttft is None:
                seq.slo_ttft = ttft
            if seq.slo_tpot is None:
                seq.slo_tpot = tpot
        self.waiting.add(seq)
        self._seqs[seq.request_id] = seq

    def abort(self, request_id: str, reason: str = "abort") -> Sequence | None:
        """Drop a request wherever it is; its slot and blocks are free on return. reason:
        "abort" (its client or the engine's shutdown ended it) or "error" (it failed alone)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        if seq.status is WAITING:
            self.waiting.remove(seq)
            self._forget(seq)
            self._drop_swapped(seq)
        else:
            self.retire(seq)
        seq.status, seq.finish_reason = FINISHED, reason
        seq.num_output_placeholders = 0  # tokens of steps in flight: never delivered
        self._assert_step_invariants()
        return seq

    def ran_nowhere(self, s: ScheduledSeq) -> list[int]:
        """s's row of a scheduled step ran nowhere (its request failed alone, or rerun): the
        blocks it was to complete lose the names _add gave them when it was scheduled, and
        the policy takes back the service it charged for it. Returns its blocks whose K/V it
        was to write: no other row of the step may read them."""
        seq = s.seq
        self.policy.refund(s)
        first = (seq.num_computed_tokens - s.num_new_tokens) // self.config.block_size
        self.allocator.uncache_from(seq.request_id, first)
        return seq.block_table[first:]

    def ran_nowhere_ended(self, s: ScheduledSeq) -> None:
        """s's row of a scheduled step ran nowhere, and its request had ended meanwhile (a
        step collected since this one was scheduled ended it): its blocks are freed already,
        and the policy takes back the service it charged for the row."""
        assert s.seq.finished
        self.policy.refund(s)

    def rerun(self, s: ScheduledSeq) -> list[int]:
        """s's row of a scheduled step runs nowhere, but its request goes on: back to the
        waiting queue (as a victim of preemption by recompute, a first admission undone),
        to compute again what the step was to compute. For a row that shares blocks a row
        that ran nowhere was to write (its prefix-cache hit named in the same step).
        Returns ran_nowhere's blocks."""
        seq = s.seq
        unwritten = self.ran_nowhere(s)
        seq.num_output_placeholders -= s.samples
        seq.num_recomputed_tokens -= s.num_recomputed  # not computed: the next admission counts them
        if seq.first_scheduled_time is None:  # its first admission is undone, its prefix-cache hit too
            seq.num_cached_tokens = -1
        self.running.remove(seq)
        self._release(seq)
        seq.status, seq.num_computed_tokens = WAITING, 0
        # No reason yet: nothing refused it a place (it had one); like a request arriving
        # while a step runs, it waits for the next schedule(), which says why if it still waits.
        self.waiting.requeue(seq, None)
        self._assert_step_invariants()
        return unwritten

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step, its sequences advanced (see the module docstring)."""
        out = SchedulerOutput()
        self._budget = self.config.max_num_batched_tokens
        self._room_preempted = False
        self._preempted_for = None
        self.policy.begin_step(self.running)
        self.batching.schedule(self, out)
        if out.preempted:  # a victim boards again no sooner than the next step (admit's rule)
            assert not {id(q) for q in out.preempted} & {id(x.seq) for x in out.scheduled}, \
                "a sequence preempted and scheduled in one step"
        self.policy.charge(out)
        if self._swap_in:
            # Their host blocks are free only now, so no swap-out of this step overwrites
            # them before the runner has read them.
            out.swap_in, self._swap_in = self._swap_in, []
            for _, host in out.swap_in:
                self._host_free.update(host)
        return out  # _add counted num_decode_tokens and num_prefill_tokens

    def update(self, out: SchedulerOutput, tokens: Seq[int], spec: dict[int, list[int]] | None = None) -> StepOutcome:
        """Record the step's sampled tokens: tokens[i] is out.scheduled[i]'s (read only
        where it samples), spec[i] the tokens a verified row emitted (its accepted drafts
        and one more). A token may end its sequence; the batching says who leaves."""
        accepted: dict[str, int] = {}
        finished: list[Sequence] = []
        released: list[Sequence] = []
        discarded: list[ScheduledSeq] = []
        emitted: dict[str, list[int]] = {}
        assert len(tokens) == len(out.scheduled)
        eos, finished_ = self.eos_token_ids, FINISHED  # locals: read per row
        for i, (s, token) in enumerate(zip(out.scheduled, tokens)):  # once per running sequence: kept lean
            seq = s.seq
            if seq.status is finished_:
                discarded.append(s)
                continue
            if not s.samples:
                continue
            seq.num_output_placeholders -= 1
            if s.num_spec_tokens:
                assert spec is not None
                reason = self._update_verified(seq, s, spec[i], emitted)
                accepted[seq.request_id] = seq.output_token_ids[-1]
            elif seq.no_token_allowed:
                # Its masks allowed nothing (a grammar against allowed_token_ids or bad_words):
                # the token drawn is none it allows, so it is not output, and the request ends
                # as one its grammar cannot go on with (vLLM's abort; structured.py).
                reason = "abort"
            else:
                out_ids = seq.output_token_ids
                out_ids.append(token)
                accepted[seq.request_id] = token
                p = seq.params
                # Most rows end nothing: only one that could (an end token, stop tokens, a grammar,
                # its length: max_tokens comes first, as add() asserts prompt + max_tokens <=
                # max_model_len) pays for _finish_reason.
                if not (token in eos or p.stop_token_ids or seq.constraint is not None or seq.stop_matcher is not None
                        or len(out_ids) >= p.max_tokens):
                    continue
                if seq.constraint is not None and not seq.constraint.accept(token):
                    reason = "abort"  # over the grammar's per-token limits (the mask allows only what it accepts)
                    if seq.stop_matcher is not None:  # the token is still output: its text too
                        seq.stop_matcher.advance([token], final=True)
                else:
                    reason = self._finish_reason(seq, token)
            if reason is None:
                continue
            seq.finish_reason = reason
            seq.num_output_placeholders = 0  # tokens of a later step still in flight: dropped
            if seq.status is WAITING:  # preempted after this step was scheduled: it holds no device blocks
                self.waiting.remove(seq)
                self._forget(seq)
                self._drop_swapped(seq)
                seq.status = FINISHED
                released.append(seq)
            else:
                seq.status = FINISHED
                finished.append(seq)
        released += self.batching.release(self, finished)
        self._assert_step_invariants()
        return StepOutcome(accepted, released, discarded, emitted)

    # ---- speculative decoding ----------------------------------------------------------
    @property
    def speculating(self) -> bool:
        """Whether the next step may verify proposals: speculation is configured, the
        batch is below disable_by_batch_size (vLLM's rule: at large batches the step is
        compute-bound and verifying k rejected tokens costs more than it saves), and some
        running sequence still speculates (min_acceptance_rate)."""
        spec = self.spec
        return spec is not None and (spec.disable_by_batch_size is None
                                     or len(self.running) < spec.disable_by_batch_size) \
            and any(seq.may_speculate for seq in self.running)

    def take_proposals(self, out: SchedulerOutput, proposals: list[list[int]], draft_probs: Any = None) -> None:
        """The proposer's drafts for out's speculating rows (in their order), for a proposer
        that proposes after scheduling: each row keeps as many as it reserved room for, and
        gives back the budget's blocks it does not use (a row with no draft is a plain decode)."""
        assert self._drafter is None, "drafts known at scheduling are taken by schedule()"
        rows = [s for s in out.scheduled if s.num_spec_tokens]
        assert len(proposals) == len(rows)
        bs = self.config.block_size
        for r, (s, draft) in enumerate(zip(rows, proposals)):
            reserved = s.num_spec_tokens
            draft = list(draft[:reserved])
            unused = reserved - len(draft)
            s.spec_token_ids, s.spec_src = draft or (), r
            if unused:
                seq = s.seq
                s.num_spec_tokens -= unused
                s.num_new_tokens -= unused
                seq.num_computed_tokens -= unused
                out.num_spec_tokens -= unused
                self._free_tail(seq, blocks_needed(seq.num_computed_tokens, bs))
        out.draft_probs = draft_probs

    def _update_verified(self, seq: Sequence, s: ScheduledSeq, tokens: list[int],
                         emitted: dict[str, list[int]]) -> str | None:
        """A verified row's emitted tokens, each checked as a sampled one (the first that
        ends the sequence is its last); the blocks its accepted drafts completed are named,
        as a decode's are; the K/V of its rejected drafts is given back."""
        num_draft, num_accepted = s.num_spec_tokens, len(tokens) - 1
        assert 0 <= num_accepted <= num_draft and tokens[:num_accepted] == list(s.spec_token_ids[:num_accepted])
        seq.num_drafts += 1
        seq.num_draft_tokens += num_draft
        seq.num_accepted_tokens += num_accepted
        seq.num_computed_tokens -= num_draft - num_accepted
        reason = None
        start = len(seq.output_token_ids)
        for token in tokens:
            seq.output_token_ids.append(token)
            if (reason := self._finish_reason(seq, token)) is not None:
                break
        emitted[seq.request_id] = seq.output_token_ids[start:]
        # Named now, not by the next step's scheduling: a sequence this step finishes (or
        # that is preempted first) would leave them unnamed, a miss for a prompt sharing them.
        # _block_hashes names only blocks whose tokens are all known (an ending cuts the run).
        self._name_full_blocks(seq, seq.num_computed_tokens)
        spec = self.spec
        assert spec is not None
        if (spec.min_acceptance_rate and seq.num_drafts >= spec.acceptance_window
                and seq.num_accepted_tokens < spec.min_acceptance_rate * seq.num_draft_tokens):
            seq.speculates = False
        if reason is None:
            self._free_tail(seq, blocks_needed(seq.num_computed_tokens, self.config.block_size))
        return reason

    def _free_tail(self, seq: Sequence, keep: int) -> None:
        """Give back seq's blocks past its first `keep` (never named: they held drafts)."""
        # A reserving admission's blocks stay held to the end: it never preempts, so a block
        # given back could be gone when the sequence grows into it.
        keep = max(keep, blocks_needed(self.kv_admission.tokens_at_admission(seq, 0, self.config),
                                       self.config.block_size))
        if len(seq.block_table) > keep:
            assert keep >= self.allocator.num_named(seq.request_id), f"{seq.request_id}: a named block in the tail"
            self.allocator.free_tail(seq.request_id, keep)
            # A new list: the runner rewrites a slot's block-table row when its list changes
            # (it otherwise only appends), and a block given back may return as another.
            seq.block_table = seq.block_table[:keep]

    # ---- introspection -----------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_unreserved(self) -> int:
        """The waiting requests whose place no caller reserved (Sequence.place_reserved)."""
        return self.waiting.num_unreserved

    @property
    def room_preempted(self) -> bool:
        """The step being scheduled preempted running sequences to find them KV blocks."""
        return self._room_preempted

    def waiting_by_reason(self) -> dict[str, int]:
        return self.waiting.count_reasons(dict.fromkeys(wait_reasons(), 0))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block name (vLLM's reset_prefix_cache): False, and nothing
        changed, while any request holds blocks."""
        return self.allocator.reset_prefix_cache()

    def preempt_running(self) -> SchedulerOutput:
        """Every running request back to the waiting queue by recompute, and every swapped
        one's host copy dropped: the K/V of no request survives (vLLM's
        reset_prefix_cache(reset_running_requests=True), used after a weight update, when
        all of it is stale). The latest admitted goes first, so a queue that puts a
        preempted request at its front keeps their order. Only between steps, none in flight:
        the step it returns has no rows, only these preemptions."""
        assert self.batching.may_preempt, f"{self.batching.name} batching never preempts"
        out = SchedulerOutput()
        for victim in reversed(list(self.running)):
            # No wait reason yet: nothing refused it a place; the next schedule() says why if it still waits.
            self._preempt(out, victim, may_swap=False, reason=None)
        for seq in self.waiting:
            if seq.swapped:
                seq.num_computed_high = max(seq.num_computed_high, seq.swapped[1])
                self._drop_swapped(seq)
        self._assert_step_invariants()
        return out

    def check_invariants(self) -> None:
        """Everything, O(num_blocks): too slow for every step, so callers (tests, bench/policies.py)
        choose when. update() checks the per-step subset."""
        self.allocator.check_invariants()
        self._check_step_invariants()
        for seq in self.running:
            assert seq.block_table == self.allocator.blocks_of(seq.request_id), seq.request_id
        for seq in self.waiting:
            assert seq.status is WAITING and seq.slot is None and not seq.block_table
            assert not self.allocator.blocks_of(seq.request_id), f"waiting {seq.request_id} owns blocks"
        assert self._seqs.keys() == {s.request_id for s in [*self.waiting, *self.running]}

    # ---- the mechanics a batching composes a step from (policy.py) ----------------------
    def schedule_decodes(self, out: SchedulerOutput) -> list[Sequence]:
        """One token for every running decode, in the policy's step order (FCFS: admission
        order). Returns the running sequences with prompt work left (for schedule_prompts).

        The hot loop of a steady decode step, one pass over every running sequence, so
        is_decode, the length check, _make_room's "room already" case and _add are inlined."""
        bs, max_len = self.config.block_size, self.config.max_model_len
        caching, num_named = self.config.enable_prefix_caching, self.allocator.named_counts.get
        add, prompts, running, row = out.scheduled.append, [], RUNNING, ScheduledSeq  # locals: read per row
        n = len(out.scheduled)  # (a preemption below never takes a sequence already in this step)
        assert self._budget >= len(self.running), "config: max_num_batched_tokens >= max_num_seqs"
        # Speculation: each eligible decode reserves up to k more tokens of the budget (and
        # their blocks, never by preempting); the engine's proposals trim the reservation.
        # None in a step that preempted for waiting requests: drafts would take the budget
        # and blocks their admission was counted on, and the preemption would be for nothing.
        spec_k = self.spec.k if self.speculating and not out.preempted else 0
        spare = self._budget - len(self.running)
        speculative: list[ScheduledSeq] = []  # decodes that may get draft room, after the loop
        for seq in self.policy.step_order(self.running):  # a copy: preemption edits the list
            if seq.status is not running:
                continue
            num_out = len(seq.output_token_ids) + seq.num_output_placeholders
            num_tokens = len(seq.prompt_token_ids) + num_out
            computed = seq.num_computed_tokens
            if not num_out or computed != num_tokens - 1:
                prompts.append(seq)  # a prompt, or a preempted sequence's recompute
                continue
            if num_out >= seq.params.max_tokens:  # (never past max_model_len first: add() asserts it)
                # Its latest token, still in flight, is its last by length: update() retires it.
                continue
            if computed >= len(seq.block_table) * bs and not self._make_room(out, seq, 1):
                continue  # it needed a block, and was itself preempted for one
            add(row(seq, 1, True, True))  # = _add(out, seq, 1), the budget and count summed below
            seq.num_computed_tokens = computed + 1
            seq.num_output_placeholders += 1
            if spec_k and seq.may_speculate and seq.num_output_placeholders == 1:
                speculative.append(out.scheduled[-1])
            if caching and (computed + 1) // bs > num_named(seq.request_id, 0):  # completes a block: name it
                self.allocator.cache_blocks(seq.request_id, self._block_hashes(seq, (computed + 1) // bs))
        # Draft room only after every decode has its own token's block, and beside the blocks
        # the running prompts' chunks may take after it (each at most what the budget leaves):
        # a reservation never takes a block a real token needs, so it never causes a preemption.
        keep, left = 0, self._budget - (len(out.scheduled) - n)  # the budget the decodes leave
        if speculative and prompts and self.config.enable_chunked_prefill:  # (else none has prompt work)
            for seq in sorted(prompts, key=self.policy.key) if self.policy.orders_prompts else prompts:
                if seq.status is not running:
                    continue  # preempted for a decode's block
                chunk = self.prefill_chunk(seq.num_tokens + seq.num_output_placeholders - seq.num_computed_tokens,
                                           left, float("inf"))
                left -= chunk
                keep += max(0, blocks_needed(seq.num_computed_tokens + chunk, bs) - len(seq.block_table))
        for s in speculative:
            seq = s.seq
            if not spare or seq.status is not running:
                continue
            num_out = len(seq.output_token_ids) + seq.num_output_placeholders
            # every emitted token within max_tokens and max_model_len, and, as vLLM's cap on a
            # running request's new tokens, 1 + k within long_prefill_token_threshold
            k = min(spec_k, spare, seq.params.max_tokens - num_out, max_len - len(seq.prompt_token_ids) - num_out,
                    self.config.long_prefill_token_threshold - 1 if self.config.long_prefill_token_threshold else spec_k)
            if k <= 0:
                continue
            # Drafts known now are taken now (room for exactly them); else the room for k
            # is held until take_proposals.
            drafts = self._drafter(seq, k) if self._drafter is not None else None
            if drafts is not None:
                k = len(drafts)
            need = blocks_needed(seq.num_computed_tokens + k, bs) - len(seq.block_table)
            if k == 0 or (need > 0 and not self.allocator.can_allocate(need + keep)):
                continue
            if need > 0:
                seq.block_table += self.allocator.allocate(seq.request_id, need)
            s.num_new_tokens, s.num_spec_tokens = 1 + k, k
            if drafts is not None:
                s.spec_token_ids = drafts
            seq.num_computed_tokens += k
            spare -= k
            out.num_spec_tokens += k
            self._budget -= k
        n = len(out.scheduled) - n
        self._budget -= n
        out.num_decode_tokens += n
        return prompts

    def schedule_prompts(self, out: SchedulerOutput, candidates: list[Sequence] | None = None) -> None:
        """Prompt work of admitted sequences, in candidates' order: the next chunk with chunked
        prefill (as much as the budget allows), else the whole remaining prompt.
        candidates: the running sequences that may have prompt work (default: all not yet
        in this step, admission order: one chunk a sequence a step, also where boarding
        scheduled some)."""
        if candidates is None:
            in_step = {id(x.seq) for x in out.scheduled}
            candidates = [q for q in self.running if id(q) not in in_step]
        if self.policy.orders_prompts:
            candidates = sorted(candidates, key=self.policy.key)
        for seq in candidates:
            if not self._schedule_prompt(out, seq):
                break

    def _schedule_prompt(self, out: SchedulerOutput, seq: Sequence) -> bool:
        """seq's prompt work in this step, if it has any the policy lets it have; False when
        the budget cannot take it (the prompts after it wait too)."""
        if seq.status is not RUNNING:
            return True  # preempted meanwhile (or finished, seated until its batch leaves)
        if seq.is_decode:
            return True  # not prompt work (async: maybe a decode whose input is in flight)
        n = seq.num_tokens + seq.num_output_placeholders - seq.num_computed_tokens
        if self.config.enable_chunked_prefill:
            room = self.policy.prompt_room(seq, out.scheduled)
            if not room:
                return True  # the policy holds this one's prompt back this step, not the others'
            n = self.prefill_chunk(n, self._budget, room)
        if n == 0 or n > self._budget:
            return False
        if self._make_room(out, seq, n):
            self._add(out, seq, n)
        return True

    def admit(self, out: SchedulerOutput, schedule: bool = True) -> None:
        """Move waiting sequences to running, in the queue's order, while a slot, KV
        blocks and (schedule) the token budget allow; walk past one whose prompt the policy
        holds back this step (wait reason "policy"), stop at the first that cannot go for
        any other reason, and record why the rest wait. schedule: its first chunk is in
        this step; else it boards, with blocks for its whole prompt, and its prompt is
        scheduled as the budget takes the boarded prompts in order (schedule_prompts'
        rule; the rest prefill over the next steps). In a step that preempted, only the
        requests preempt_for_waiting made room for board: never a victim."""
        # As vLLM: a step that preempted running sequences for blocks admits nobody, and one
        # that preempted for waiting requests admits only those: freeing blocks and then
        # handing them to a victim (or to anyone it was not freed for) only thrashes.
        reason = "kv_blocks" if self._room_preempted else None
        only = self._preempted_for
        held: list[Sequence] = []  # the policy holds their prompts back this step: the rest may pass
        prompts_fit = True  # boarding (not schedule): the budget has taken every boarded prompt so far
        while reason is None and len(held) < len(self.waiting):
            seq = self.waiting[len(held)]  # the held ones stay ahead of it, in queue order
            if not self._free_slots:
                reason = "max_num_seqs"
                break
            if schedule and self._held(seq, out):  # before sizing it: a held backlog is walked every step
                held.append(seq)
                continue
            if only is not None and id(seq) not in only:
                reason = "kv_blocks"
                break
            cached, n, num_new_blocks = self.admission_need(seq, out, chunk=schedule)
            if schedule and not 0 < n <= self._budget:
                reason = "token_budget"
            # A cached block nobody holds is taken out of the free queue: it counts like a
            # fresh one. A cached block another sequence holds costs nothing: counted once.
            elif not self.allocator.can_allocate(num_new_blocks + self.allocator.num_revived(cached)):
                reason = "kv_blocks"
            elif seq.num_output_placeholders:
                # Preempted while its latest token was in flight: that token is part of
                # its prefill, so it boards once the token is known (the next update()).
                reason = "kv_blocks"
            else:
                self._start(seq, cached, num_new_blocks)
                if schedule:
                    self._add(out, seq, n)
                elif prompts_fit:
                    # Boarding: its prompt is scheduled as it boards (as schedule_prompts
                    # would: boarding order is the queue's, the policy's key order), so the
                    # full blocks it computes are named before the next one is sized, and a
                    # request sharing its prefix shares them rather than waiting for blocks.
                    prompts_fit = self._schedule_prompt(out, seq)
        self.waiting.wait_all(reason, held)

    def preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Waiting requests that outrank running ones (a ranked policy) take seats and KV
        blocks from the lowest ranked of them when slots or blocks are full, before
        anything is scheduled, as preemption.PreemptionPlan plans: only the victims its
        admissions need, and none for an admission preempting cannot make room for. When
        it preempts, the planned admissions are the only ones admit makes this step."""
        if not self.waiting:
            return
        running = [r for r in self.running if r.status is RUNNING]
        if not any(self.policy.outranks(self.waiting.peek(), r) for r in running):
            return  # FCFS always returns here: it outranks nobody
        admitted, victims = PreemptionPlan(self, out, running, len(self._free_slots), self._budget).choose()
        for r in victims:
            self._preempt(out, r)
        if victims:
            self._preempted_for = {id(q) for q in admitted}

    def prefill_chunk(self, n: int, budget: float, room: float) -> int:
        """The tokens a prompt computes in this step with chunked prefill, n of them left:
        at most the token budget, the policy's prompt room and long_prefill_token_threshold
        (vLLM's: it caps running and waiting requests' chunks alike, so several prompts
        share a step's budget rather than one long prompt taking it all)."""
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        return int(min(n, budget, room))

    def admission_need(self, seq: Sequence, out: SchedulerOutput, chunk: bool = True,
                       budget: int | None = None) -> tuple[list[int], int, int]:
        """(cached prefix blocks, tokens to compute in its first step, fresh blocks) of a
        waiting sequence's admission now. chunk: with chunked prefill, its first step is
        what the token budget (default: what is left of this step's) and the policy's
        prompt room allow (0: it cannot start now)."""
        cached = [] if seq.swapped else self._cached_prefix(seq)
        # A swapped-out sequence's K/V comes back from the host pool: like a cache hit, in fresh blocks.
        num_cached = seq.swapped[1] if seq.swapped else len(cached) * self.config.block_size
        n = seq.num_tokens - num_cached  # the prompt (+ a preempted sequence's outputs) not cached
        if chunk and self.config.enable_chunked_prefill:
            budget = self._budget if budget is None else budget
            n = self.prefill_chunk(n, budget, self.policy.prompt_room(seq, out.scheduled))
        tokens = self.kv_admission.tokens_at_admission(seq, num_cached + n, self.config)
        return cached, n, blocks_needed(tokens, self.config.block_size) - len(cached)

    def retire(self, seq: Sequence) -> None:
        """seq leaves the running list: its slot and blocks are free."""
        self.running.remove(seq)
        self._release(seq)
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        del self._seqs[seq.request_id]

    # ---- internals ---------------------------------------------------------------------
    def _held(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Does the policy hold seq's prompt back this step (chunked prefill; room 0)?"""
        chunked = self.config.enable_chunked_prefill
        return chunked and self._budget > 0 and not self.policy.prompt_room(seq, out.scheduled)

    def _drop_swapped(self, seq: Sequence) -> None:
        if seq.swapped:
            self._host_free.update(seq.swapped[0])
            seq.swapped = None

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The names of seq's first num_blocks full blocks, extending seq.block_hashes;
        fewer when a block holds a token still in flight: it is named by a later step's
        _add, once its tokens are known (a name over an unknown token would match another
        sequence's block whose real token differs). The salt is the first block's extra key
        only (vLLM's): every later name chains from it, so it parts the whole prefix."""
        hashes, bs = seq.block_hashes, self.config.block_size
        if len(hashes) < num_blocks:
            tokens = seq.all_token_ids
            for i in range(len(hashes), min(num_blocks, len(tokens) // bs)):
                hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs],
                                                None if hashes else seq.cache_salt))
        return hashes[:num_blocks]

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks seq can start from: its longest cached prefix of full blocks,
        never its last token (that one's logits are needed, so it is always computed).
        A preempted sequence finds its own blocks here, unless they were evicted. None
        for a request asking prompt_logprobs (vLLM's rule): every prompt position's logits
        must be computed."""
        if not self.config.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        return self.allocator.cached_prefix(self._block_hashes(seq, (seq.num_tokens - 1) // self.config.block_size))

    def _start(self, seq: Sequence, cached: list[int], num_new_blocks: int) -> None:
        if self.waiting.peek() is seq:
            self.waiting.pop_head()
        else:  # the policy held back the ones ahead of it
            self.waiting.remove(seq)
        seq.slot = heapq.heappop(self._free_slots)
        self.allocator.share(seq.request_id, cached)  # before allocate, which could evict them
        seq.block_table = cached + self.allocator.allocate(seq.request_id, num_new_blocks)
        seq.num_computed_tokens = len(cached) * self.config.block_size
        if seq.swapped:  # its K/V is copied back into its first fresh blocks before the step
            host, seq.num_computed_tokens = seq.swapped
            self._swap_in.append((seq.block_table[:len(host)], host))
            seq.swapped = None
            # Named now, as a cache hit's are: a request admitted after it in this step (it
            # reads them after the copy) shares them, also when seq computes nothing as it boards.
            self._name_full_blocks(seq, seq.num_computed_tokens)
        if seq.num_cached_tokens < 0:  # as vLLM: the first admission's hit is the request's
            seq.num_cached_tokens = seq.num_computed_tokens
        seq.status = RUNNING
        seq.admitted_seq_no = next(self._admissions)
        self.running.append(seq)

    def _add(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        """Schedule seq's next n tokens, and advance it past them."""
        assert 0 < n <= self._budget
        computed = seq.num_computed_tokens
        num_out = len(seq.output_token_ids) + seq.num_output_placeholders
        end, num_tokens = computed + n, len(seq.prompt_token_ids) + num_out
        assert end <= num_tokens
        is_decode = num_out > 0 and computed == num_tokens - 1
        samples = end == num_tokens
        out.scheduled.append(ScheduledSeq(seq, n, samples, is_decode))
        seq.num_computed_tokens = end
        seq.num_output_placeholders += samples
        self._budget -= n
        if is_decode:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += n
            if computed < seq.num_computed_high:  # recomputing what a preemption dropped
                again = min(end, seq.num_computed_high) - computed
                seq.num_recomputed_tokens += again
                out.num_recomputed_tokens += again
                out.scheduled[-1].num_recomputed = again  # a row discarded later is taken back out
        self._name_full_blocks(seq, end)  # the full blocks this step completes

    def _name_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Offer the prefix cache a name for each full block of seq's first num_tokens not
        named yet (most decode steps complete none)."""
        if self.config.enable_prefix_caching:
            full = num_tokens // self.config.block_size
            if full > self.allocator.num_named(seq.request_id):
                self.allocator.cache_blocks(seq.request_id, self._block_hashes(seq, full))

    def _make_room(self, out: SchedulerOutput, seq: Sequence, n: int) -> bool:
        """Blocks for seq's next n tokens. When none are free, preempt the policy's victim
        among the running sequences not yet in this step, and (victim_in_step) its plain
        decodes, whose rows are taken back (FCFS: the latest admitted), and retry; False if
        that was seq itself."""
        need = blocks_needed(seq.num_computed_tokens + n, self.config.block_size) - len(seq.block_table)
        while not self.allocator.can_allocate(need):
            assert self.kv_admission.preempts, "a reserving admission holds every block from admission"
            rows = {id(s.seq): s for s in out.scheduled}
            # A plain decode row can be taken back (no drafts: a proposer may hold its room)
            takeable = {id(s.seq) for s in out.scheduled if s.is_decode and not s.num_spec_tokens} \
                if self.policy.victim_in_step else set()
            victim = self.policy.victim([s for s in self.running if s.status is RUNNING
                                         and (id(s) not in rows or id(s) in takeable)])
            if id(victim) in rows:
                self._unschedule(out, rows[id(victim)])
            self._preempt(out, victim)
            self._room_preempted = True
            if victim is seq:
                return False
        if need > 0:
            seq.block_table += self.allocator.allocate(seq.request_id, need)
        return True

    def _unschedule(self, out: SchedulerOutput, s: ScheduledSeq) -> None:
        """Take back a plain decode row of this step (its sequence is about to be preempted):
        its token, its budget, and the name of a block it was to complete (nobody shares it
        yet: only an admission shares, and admissions come after every running row)."""
        seq = s.seq
        assert s.is_decode and not s.num_spec_tokens and s.num_new_tokens == 1
        out.scheduled.remove(s)
        seq.num_computed_tokens -= 1
        seq.num_output_placeholders -= 1
        self._budget += 1
        out.num_decode_tokens -= 1
        self.allocator.uncache_from(seq.request_id, seq.num_computed_tokens // self.config.block_size)

    def _preempt(self, out: SchedulerOutput, victim: Sequence, may_swap: bool = True,
                 reason: str | None = "kv_blocks") -> None:
        """Back to the waiting queue where the policy puts it (FCFS: the front), outputs
        kept, its device blocks freed. By recompute: its K/V is dropped and computed again
        on re-admission. By swap: its K/V blocks are copied to the host pool and back on
        re-admission; a full pool falls back to recompute (counted)."""
        computed = victim.num_computed_tokens
        blocks = victim.block_table[:blocks_needed(computed, self.config.block_size)]
        swap = may_swap and self.config.swaps_kv and 0 < len(blocks)
        if swap and len(blocks) > len(self._host_free):
            swap = False
            out.num_swap_fallbacks += 1
        if swap:  # the runner copies them out before the step, before anyone writes there
            host = [self._host_free.pop() for _ in blocks]
            out.swap_out.append((blocks, host))
            victim.swapped = (host, computed)
        else:
            victim.num_computed_high = max(victim.num_computed_high, computed)
        self.running.remove(victim)
        self._release(victim)
        victim.status = WAITING
        out.preempted_tokens.append(computed)
        out.preempted_swapped.append(swap)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.requeue(victim, reason)
        out.preempted.append(victim)
        # Never one already in this step: the full blocks a scheduled chunk completes are
        # already named in the prefix cache, and their K/V must then be computed.
        assert all(s.seq is not victim for s in out.scheduled)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.request_id)
        seq.block_table = []
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot = None

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why seq ends with `token`, its latest output, or None. vLLM's order: a stop token
        (never text), then a stop string (even on the token that reaches max_tokens), then
        a complete grammar, then the length."""
        p = seq.params
        n = len(seq.output_token_ids)
        # Before min_tokens no stop token ends it (vLLM's check_stop; the sampler masks them too)
        if n >= p.min_tokens and p.stop_token(token, self.eos_token_ids) is not None:
            if seq.stop_matcher is not None:  # its text ends here (the token is text only if included)
                seq.stop_matcher.advance([token], final=True)
            return "stop"
        grammar_done = seq.constraint is not None and seq.constraint.stopped
        at_length = n >= p.max_tokens or len(seq.prompt_token_ids) + n >= self.config.max_model_len
        if seq.stop_matcher is not None and seq.stop_matcher.advance([token], final=grammar_done or at_length):
            return "stop"
        if grammar_done:
            return "stop"  # the output is complete: the grammar allows nothing more
        return "length" if at_length else None

    def _assert_step_invariants(self) -> None:
        """After a step (with CHECK_ALL_INVARIANTS): slot ownership, and every block in use
        belongs to a running sequence and covers its computed tokens."""
        if CHECK_ALL_INVARIANTS:
            self._check_step_invariants()

    def _check_step_invariants(self) -> None:
        slots = [s.slot for s in self.running]
        assert sorted([*slots, *self._free_slots]) == list(range(self.config.max_num_seqs)), "slot leaked or shared"
        # O(swapped), not O(pool): a pool of a few GiB holds hundreds of thousands of blocks.
        swapped = [b for s in self.waiting if s.swapped for b in s.swapped[0]]
        assert len(swapped) + len(self._host_free) == self.num_swap_blocks and len(set(swapped)) == len(swapped) \
            and self._host_free.isdisjoint(swapped) and all(0 <= b < self.num_swap_blocks for b in swapped), \
            "host swap block leaked or shared"
        self.waiting.check_invariants()
        # A block shared by several sequences is one block in use.
        assert len({b for s in self.running for b in s.block_table}) == self.allocator.num_used, "KV block leaked"
        bs = self.config.block_size
        for seq in self.running:
            assert seq.status is not WAITING
            assert len(seq.block_table) * bs >= seq.num_computed_tokens, f"{seq.request_id}: K/V beyond its blocks"
            # The latest output token (known or in flight) is never computed; a step in flight
            # that verifies drafts computes them past it (up to k), until update() keeps the accepted.
            drafts = self.spec.k if self.spec is not None and seq.num_output_placeholders else 0
            assert seq.finished or seq.num_computed_tokens < seq.num_tokens + seq.num_output_placeholders + drafts
