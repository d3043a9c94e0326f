"""The scheduler: which sequences compute which tokens in the next step. Pure Python.

The engine loop calls `schedule()`, runs the step it describes, then `update()` with the
sampled tokens. The scheduler owns the waiting queue, the running list, the slots
(0..max_num_seqs-1: the seats; a running sequence holds one, and under static batching a
finished one keeps it until its batch leaves) and the block allocator; it knows blocks,
never arrays (the runner packs the occupied slots into device rows).

continuous (default): every step, decodes first (one token per running sequence), then
    prompt chunks of running sequences, then admissions from the waiting queue while a
    slot, the token budget and KV blocks allow. A finished sequence frees its slot and
    blocks in the update() of its last token, so a queued request joins the next step.
static: the seed's bus. A batch boards only when nothing runs, prefills, then decodes;
    finished sequences keep their slot as padding until the whole batch is done.

KV admission (config.kv_admission): "on-demand" (vLLM) allocates blocks as tokens are
computed and preempts by recompute when they run out; "reserve" (TGI) allocates prompt +
max_tokens at admission; "reserve-max-len" (contiguous slots) allocates max_model_len.
The reserve modes never preempt: every block a sequence will use is held from the start.

Policy (policy.py, chosen by config): the waiting queue's order, the KV victim, whether a
waiting request may preempt a running one (priority), and the boarding rule (static).
Everything else here is mechanics every policy shares.

Prefix caching (config.enable_prefix_caching, kvcache.py): at admission a sequence takes
the longest cached prefix of its full blocks (shared, ref-counted) and computes only the
rest, always at least its last token (whose logits are sampled). A block is named when
the step that computes it is scheduled (`_add`), so a sequence admitted later in the same
step can already share it: each layer writes the step's K/V before it attends.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import os
import time
from dataclasses import dataclass, field

from config import EngineConfig, SamplingParams
from kvcache import BlockAllocator, blocks_needed, hash_block_tokens
from metrics import WAIT_REASONS
from policy import FCFSQueue, SortedQueue, make_policy


# An output token sampled by a step the host has not seen the result of yet (async
# scheduling): it stands in output_token_ids until update() writes the real token.
PLACEHOLDER = -1

# The scheduler's global invariants (every slot owned once, no KV block leaked, blocks
# cover every computed token) cost O(running + blocks in use) a step: at 256 sequences,
# more than the rest of a decode step's host work. They are checked after every step
# when TAXIRANK_CHECK_INVARIANTS=1 (the test suite sets it, tests/conftest.py), and by
# check_invariants(); the local asserts (each block allocated or freed, each sequence's
# token counts) run always.
CHECK_ALL_INVARIANTS = os.environ.get("TAXIRANK_CHECK_INVARIANTS", "") == "1"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


WAITING, RUNNING, FINISHED = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED


@dataclass(eq=False)  # identity semantics: one object per request, however its fields change
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = WAITING
    slot: int | None = None
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_cached_tokens: int = -1  # prompt tokens the prefix cache served at first admission; -1: not admitted yet
    block_hashes: list[bytes] = field(default_factory=list)  # names of its full blocks so far (kvcache.py)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    wait_reason: str | None = None  # one of metrics.WAIT_REASONS, set by each schedule()
    num_preemptions: int = 0
    priority: int = 0  # --scheduling-policy priority: lower runs first (vLLM's per-request field)
    arrival_order: int = -1  # set by Scheduler.add: breaks ties between equal arrival times
    admitted_seq_no: int = -1  # order of the latest admission: the highest is preempted first
    seed: int | None = None  # this request's sampling stream (set by the engine)
    # Filled by the engine.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_decode(self) -> bool:
        """Everything but the last sampled token is cached: the next step computes one
        token. After a preemption the prompt *and* the outputs are a prefill again."""
        return bool(self.output_token_ids) and self.num_computed_tokens == self.num_tokens - 1


@dataclass(slots=True)  # one per scheduled sequence per step: slots make it cheap to build
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # positions seq.num_computed_tokens .. + num_new_tokens - 1
    samples: bool  # a token comes out: a decode, or the chunk that completes the prompt
    is_decode: bool  # seq.is_decode when scheduled (async scheduling advances seq before update)
    output_index: int = -1  # async scheduling: where its token stands (a PLACEHOLDER) in output_token_ids


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prompt chunks
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Async scheduling: update_after_schedule() advanced the sequences before the step ran.
    advanced: bool = False
    # Set by update(): the tokens kept, by request id, and the rows whose work was dropped
    # (their sequence was aborted, or finished in an earlier step, before this one came back).
    accepted: dict[str, int] = field(default_factory=dict)
    discarded: list[ScheduledSeq] = field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        return self.num_prefill_tokens == 0


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, eos_token_ids: tuple[int, ...]) -> None:
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None, \
            "pass config.resolved(...)"
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = BlockAllocator(num_kv_blocks, enable_caching=config.enable_prefix_caching)
        self.policy = make_policy(config)  # admission order, KV victim, boarding rule (policy.py)
        self.waiting: FCFSQueue | SortedQueue = self.policy.new_queue()
        self.running: list[Sequence] = []  # admission order; under static, finished padding too
        self._free_slots = list(range(config.max_num_seqs))  # a heap: the lowest free slot first
        self._seqs: dict[str, Sequence] = {}  # every request not yet released, by id
        self._admissions = itertools.count()
        self._arrivals = itertools.count()
        # The boarding rule's consequences are mechanics: finished sequences keep their
        # seats as padding and the batch is released together.
        self._static = self.policy.boards_only_when_empty
        self._room_preempted = False  # this step preempted to find blocks for running sequences
        self._budget = 0  # tokens left in the step being scheduled

    # ---- requests ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        cfg, n = self.config, seq.num_prompt_tokens
        if seq.request_id in self._seqs:
            raise ValueError(f"request id {seq.request_id!r} is already in flight")
        if n == 0:
            raise ValueError("the prompt is empty")
        if n + seq.params.max_tokens > cfg.max_model_len:
            raise ValueError(f"the prompt ({n} tokens) plus max_tokens ({seq.params.max_tokens}) is "
                             f"{n + seq.params.max_tokens} tokens, over max_model_len ({cfg.max_model_len})")
        # On-demand too: a sequence larger than the whole cache would preempt itself forever.
        need = blocks_needed(self._lifetime_tokens(seq), cfg.block_size)
        if need > self.allocator.num_usable:
            raise ValueError(f"the request needs {need} KV blocks of {cfg.block_size} tokens "
                             f"({cfg.kv_admission}), the whole cache has {self.allocator.num_usable}")
        if seq.priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {seq.priority} was given, but priority scheduling is not enabled "
                             "(--scheduling-policy priority)")
        assert seq.status is WAITING and seq.num_computed_tokens == 0 and not seq.block_table
        seq.arrival_order = next(self._arrivals)
        self.waiting.add(seq)
        self._seqs[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is; its slot and blocks are free on return."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        if seq.status is WAITING:
            self.waiting.remove(seq)
            del self._seqs[request_id]
        else:
            self._retire(seq)
        seq.status, seq.finish_reason, seq.wait_reason = FINISHED, "abort", None
        while seq.output_token_ids and seq.output_token_ids[-1] == PLACEHOLDER:
            seq.output_token_ids.pop()  # tokens of steps in flight: never delivered
        self._assert_step_invariants()
        return seq

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._budget = self.config.max_num_batched_tokens
        self._room_preempted = False
        if self._static:
            self._schedule_static(out)
        elif self.config.enable_chunked_prefill:
            # Decodes first, so a long prompt joining costs streaming users no stutter.
            self._preempt_for_waiting(out)
            prompts = self._schedule_decodes(out)
            self._schedule_prompts(out, prompts)
            self._admit(out)
        else:
            # vLLM v0: a step that admits prompts runs only those prompts; the running
            # sequences' decodes stall for that step (the stutter chunking removes).
            self._preempt_for_waiting(out)
            self._admit(out)
            if not out.scheduled:
                self._schedule_decodes(out)
        return out  # _add counted num_decode_tokens and num_prefill_tokens

    def update_after_schedule(self, out: SchedulerOutput) -> None:
        """Async scheduling: the step has been dispatched and the next one is scheduled
        before its tokens are known. Advance its sequences now, each sampled token a
        PLACEHOLDER that update() fills in. A sequence whose placeholder is its last token
        by length is not scheduled again (_schedule_decodes); one that stops on a token
        (EOS, a stop id) may be computed one step more, and update() drops that token."""
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            assert seq.num_computed_tokens <= seq.num_tokens
            if s.samples:
                s.output_index = seq.num_output_tokens
                seq.output_token_ids.append(PLACEHOLDER)
        out.advanced = True

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Record the step's work and tokens. Returns the sequences released this step:
        the finished ones (continuous), or the whole batch once all of it is done (static)."""
        released: list[Sequence] = []
        advanced, accepted = out.advanced, out.accepted
        for s in out.scheduled:  # once per running sequence in a decode step: kept lean
            seq = s.seq
            if seq.status is FINISHED or (seq.status is WAITING and not advanced):
                out.discarded.append(s)  # aborted (or, async, finished) before this step came back
                continue
            if advanced:
                if s.samples:
                    self._accept_placeholder(out, s, sampled[seq.request_id], released)
                continue
            seq.num_computed_tokens += s.num_new_tokens
            if not s.samples:
                assert seq.num_computed_tokens < seq.num_tokens
                continue
            token = sampled[seq.request_id]
            out_ids = seq.output_token_ids
            out_ids.append(token)
            # all but the new token are cached
            assert seq.num_computed_tokens == len(seq.prompt_token_ids) + len(out_ids) - 1
            accepted[seq.request_id] = token
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.finish_reason is not None:
                seq.status = FINISHED
                if not self._static:
                    self._retire(seq)
                    released.append(seq)
        if self._static and self.running and all(s.status is FINISHED for s in self.running):
            released = list(self.running)  # the bus arrives: everyone gets off at once
            for seq in released:
                self._retire(seq)
        self._assert_step_invariants()
        return released

    def _accept_placeholder(self, out: SchedulerOutput, s: ScheduledSeq, token: int,
                            released: list[Sequence]) -> None:
        """Async: the token of an advanced step arrives. The sequence may have been
        preempted since (it waits, keeping its outputs), and it may have placeholders of
        later steps behind this one: if this token ends it, those are dropped."""
        seq, i = s.seq, s.output_index
        assert seq.output_token_ids[i] == PLACEHOLDER and (i == 0 or seq.output_token_ids[i - 1] != PLACEHOLDER)
        seq.output_token_ids[i] = token
        out.accepted[seq.request_id] = token
        reason = self._finish_reason(seq, token, num_output_tokens=i + 1)
        if reason is None:
            return
        del seq.output_token_ids[i + 1:]
        seq.finish_reason = reason
        if seq.status is WAITING:  # preempted after this step was scheduled: it holds nothing
            self.waiting.remove(seq)
            del self._seqs[seq.request_id]
            seq.status, seq.wait_reason = FINISHED, None
            released.append(seq)
            return
        seq.status = FINISHED
        if not self._static:
            self._retire(seq)
            released.append(seq)

    # ---- introspection -----------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.allocator.usage

    def waiting_by_reason(self) -> dict[str, int]:
        counts = dict.fromkeys(WAIT_REASONS, 0)
        for seq in self.waiting:
            if seq.wait_reason is not None:
                counts[seq.wait_reason] += 1
        return counts

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block name (vLLM's reset_prefix_cache): False, and nothing
        changed, while any request holds blocks."""
        return self.allocator.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Everything, O(num_blocks): for tests. update() checks the per-step subset."""
        self.allocator.check_invariants()
        self._check_step_invariants()
        for seq in self.running:
            assert seq.block_table == self.allocator.blocks_of(seq.request_id), seq.request_id
        for seq in self.waiting:
            assert seq.status is WAITING and seq.slot is None and not seq.block_table
            assert not self.allocator.blocks_of(seq.request_id), f"waiting {seq.request_id} owns blocks"
        assert self._seqs.keys() == {s.request_id for s in [*self.waiting, *self.running]}

    # ---- internals ---------------------------------------------------------------------
    def _schedule_static(self, out: SchedulerOutput) -> None:
        if not self.running:
            self._admit(out)
        else:
            for seq in self.waiting:
                seq.wait_reason = "static_batch"
        # The bus boards everyone before it leaves: no decode until every prompt is in.
        if any(s.status is RUNNING and not s.is_decode for s in self.running):
            self._schedule_prompts(out)
        else:
            self._schedule_decodes(out)

    def _schedule_decodes(self, out: SchedulerOutput) -> list[Sequence]:
        """One token for every running decode, admission order. Returns the running
        sequences with prompt work left (for _schedule_prompts).

        The hot loop of a steady decode step, one pass over every running sequence, so
        is_decode, the length check, _make_room's "room already" case and _add are inlined."""
        bs, max_len = self.config.block_size, self.config.max_model_len
        caching, num_named = self.config.enable_prefix_caching, self.allocator.num_named
        scheduled, prompts = out.scheduled, []
        assert self._budget >= len(self.running), "config: max_num_batched_tokens >= max_num_seqs"
        for seq in list(self.running):  # preemption edits the list
            if seq.status is not RUNNING:
                continue
            num_out = len(seq.output_token_ids)
            num_tokens = len(seq.prompt_token_ids) + num_out
            computed = seq.num_computed_tokens
            if not num_out or computed != num_tokens - 1:
                prompts.append(seq)  # a prompt, or a preempted sequence's recompute
                continue
            if num_out >= seq.params.max_tokens or num_tokens >= max_len:
                # Its latest token (async: maybe still a placeholder) is its last by length.
                # Never so under synchronous scheduling: update() retired it.
                continue
            if computed >= len(seq.block_table) * bs and not self._make_room(out, seq, 1):
                continue  # it needed a block, and was itself preempted for one
            scheduled.append(ScheduledSeq(seq, 1, True, True))  # = _add(out, seq, 1)
            self._budget -= 1
            out.num_decode_tokens += 1
            if caching and (computed + 1) // bs > num_named(seq.request_id):  # completes a block: name it
                self.allocator.cache_blocks(seq.request_id, self._block_hashes(seq, (computed + 1) // bs))
        return prompts

    def _schedule_prompts(self, out: SchedulerOutput, candidates: list[Sequence] | None = None) -> None:
        """Prompt work of admitted sequences, admission order: the next chunk with chunked
        prefill (as much as the budget allows), else the whole remaining prompt.
        candidates: the running sequences that may have prompt work (default: all)."""
        for seq in list(self.running) if candidates is None else candidates:
            if seq.status is not RUNNING:
                continue  # preempted meanwhile
            n = len(seq.prompt_token_ids) + len(seq.output_token_ids) - seq.num_computed_tokens
            if n <= 1 and seq.output_token_ids:
                continue  # a decode (or, async, one whose latest token is in flight): not prompt work
            if self.config.enable_chunked_prefill:
                n = min(n, self._budget)
            if n == 0 or n > self._budget:
                break
            if self._make_room(out, seq, n):
                self._add(out, seq, n)

    def _admit(self, out: SchedulerOutput) -> None:
        """Move waiting sequences to running, in the queue's order, while a slot, KV
        blocks and (continuous) the token budget allow; stop at the first that cannot go
        and record why the rest wait. Continuous schedules the first chunk at once;
        static boards the whole batch and prefills it over the next steps."""
        # As vLLM: a step that preempted running sequences for blocks admits nobody.
        reason = "kv_blocks" if self._room_preempted else None
        while self.waiting and reason is None:
            seq = self.waiting.peek()
            cached, n, num_new_blocks = self._admission_need(seq)
            if not self._free_slots:
                reason = "max_num_seqs"
            elif not self._static and not 0 < n <= self._budget:
                reason = "token_budget"
            # A cached block nobody holds is taken out of the free queue: it counts like a
            # fresh one. A cached block another sequence holds costs nothing: counted once.
            elif not self.allocator.can_allocate(num_new_blocks + self.allocator.num_revived(cached)):
                reason = "kv_blocks"
            else:
                self._start(seq, cached, num_new_blocks)
                if not self._static:
                    self._add(out, seq, n)
        for seq in self.waiting:
            seq.wait_reason = reason

    def _admission_need(self, seq: Sequence) -> tuple[list[int], int, int]:
        """(cached prefix blocks, tokens to compute in its first step, fresh blocks) of a
        waiting sequence's admission now."""
        cached = self._cached_prefix(seq)
        num_cached = len(cached) * self.config.block_size
        n = seq.num_tokens - num_cached  # the prompt (+ a preempted sequence's outputs) not cached
        if self.config.enable_chunked_prefill and not self._static:
            n = min(n, self._budget)
        return cached, n, self._blocks_at_admission(seq, num_cached + n) - len(cached)

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Waiting requests that outrank running ones (the priority policy) take seats and
        KV blocks from the lowest ranked of them when slots or blocks are full, before
        anything is scheduled. Walks the queue in admission order as _admit will, counting
        the room each admission takes; a request whose admission preempting cannot make
        room stops the walk, and nobody is preempted for it (no preemption for nothing)."""
        running = [r for r in self.running if r.status is RUNNING]
        if not self.waiting or not any(self.policy.outranks(self.waiting.peek(), r) for r in running):
            return  # FCFS always returns here: it outranks nobody
        bs, chunked = self.config.block_size, self.config.enable_chunked_prefill

        def growth(r: Sequence) -> int:  # chunked: decodes go first and take their next block
            return blocks_needed(r.num_computed_tokens + 1, bs) - len(r.block_table) if chunked and r.is_decode else 0

        def freed(r: Sequence) -> int:  # blocks another sequence also holds (a shared prefix) free nothing
            return growth(r) + sum(1 for b in r.block_table if self.allocator.ref_count(b) == 1)

        slots = len(self._free_slots)
        blocks = self.allocator.num_free - sum(growth(r) for r in running)
        budget = self._budget - (sum(1 for r in running if r.is_decode) if chunked else 0)
        victims: list[Sequence] = []
        for seq in self.waiting:
            cached, n, num_new_blocks = self._admission_need(seq)
            need = num_new_blocks + self.allocator.num_revived(cached)
            if not 0 < n <= budget:
                break  # the token budget holds it back, not a seat or blocks
            lower = [r for r in running if self.policy.outranks(seq, r)]
            chosen, s_, b_ = [], slots, blocks
            while (s_ < 1 or b_ < need) and lower:
                r = self.policy.victim(lower)  # the lowest ranked first
                lower.remove(r)
                chosen.append(r)
                s_, b_ = s_ + 1, b_ + freed(r)
            if s_ < 1 or b_ < need:
                break
            for r in chosen:
                running.remove(r)
            victims += chosen
            slots, blocks, budget = s_ - 1, b_ - need, budget - n
        for r in victims:
            self._preempt(out, r)

    def _lifetime_tokens(self, seq: Sequence) -> int:
        """The most tokens seq can ever write to the cache: what the reserve modes allocate
        up front. The last sampled token is never computed (the sequence ends on it), so a
        16-token prompt with max_tokens 1 at block size 16 needs one block, not two."""
        if self.config.kv_admission == "reserve-max-len":
            return self.config.max_model_len - 1
        return seq.num_prompt_tokens + seq.params.max_tokens - 1

    def _blocks_at_admission(self, seq: Sequence, num_tokens: int) -> int:
        """Block-table length at admission: blocks for the first num_tokens (cached + this
        step's), or, in the reserve modes, for the sequence's whole lifetime."""
        tokens = num_tokens if self.config.kv_admission == "on-demand" else self._lifetime_tokens(seq)
        return blocks_needed(tokens, self.config.block_size)

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The names of seq's first num_blocks full blocks (fewer when one holds a token still
        in flight), extending seq.block_hashes."""
        hashes, bs = seq.block_hashes, self.config.block_size
        if len(hashes) < num_blocks:
            tokens = seq.all_token_ids
            for i in range(len(hashes), num_blocks):
                block = tokens[i * bs:(i + 1) * bs]
                if PLACEHOLDER in block:
                    # Async: a token still in flight. The block is named by a later step's
                    # _add, once its tokens are known: a name over a placeholder would
                    # match another sequence's block whose real token differs.
                    break
                hashes.append(hash_block_tokens(hashes[-1] if hashes else None, block))
        return hashes[:num_blocks]

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks seq can start from: its longest cached prefix of full blocks,
        never its last token (that one's logits are needed, so it is always computed).
        A preempted sequence finds its own blocks here, unless they were evicted."""
        if not self.config.enable_prefix_caching:
            return []
        return self.allocator.cached_prefix(self._block_hashes(seq, (seq.num_tokens - 1) // self.config.block_size))

    def _start(self, seq: Sequence, cached: list[int], num_new_blocks: int) -> None:
        assert self.waiting.pop_head() is seq
        seq.slot = heapq.heappop(self._free_slots)
        self.allocator.share(seq.request_id, cached)  # before allocate, which could evict them
        seq.block_table = cached + self.allocator.allocate(seq.request_id, num_new_blocks)
        seq.num_computed_tokens = len(cached) * self.config.block_size
        if seq.num_cached_tokens < 0:  # as vLLM: the first admission's hit is the request's
            seq.num_cached_tokens = seq.num_computed_tokens
        seq.status, seq.wait_reason = RUNNING, None
        seq.admitted_seq_no = next(self._admissions)
        self.running.append(seq)

    def _add(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        assert 0 < n <= self._budget
        computed, num_tokens = seq.num_computed_tokens, len(seq.prompt_token_ids) + len(seq.output_token_ids)
        end = computed + n
        is_decode = computed == num_tokens - 1 and bool(seq.output_token_ids)
        out.scheduled.append(ScheduledSeq(seq, n, end == num_tokens, is_decode))
        self._budget -= n
        if is_decode:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += n
        if self.config.enable_prefix_caching:  # name the full blocks this step completes
            full = end // self.config.block_size
            if full > self.allocator.num_named(seq.request_id):  # most decode steps complete none
                self.allocator.cache_blocks(seq.request_id, self._block_hashes(seq, full))

    def _make_room(self, out: SchedulerOutput, seq: Sequence, n: int) -> bool:
        """Blocks for seq's next n tokens. On-demand, when none are free, preempt the
        policy's victim among the running sequences not yet in this step (FCFS: the latest
        admitted) and retry; False if that was seq itself."""
        need = blocks_needed(seq.num_computed_tokens + n, self.config.block_size) - len(seq.block_table)
        while not self.allocator.can_allocate(need):
            assert self.config.kv_admission == "on-demand", "reserve modes hold every block from admission"
            in_step = {id(s.seq) for s in out.scheduled}
            victim = self.policy.victim([s for s in self.running if s.status is RUNNING and id(s) not in in_step])
            self._preempt(out, victim)
            self._room_preempted = True
            if victim is seq:
                return False
        if need > 0:
            seq.block_table += self.allocator.allocate(seq.request_id, need)
        return True

    def _preempt(self, out: SchedulerOutput, victim: Sequence) -> None:
        """Preemption by recompute: drop the cache, keep the outputs, back to the waiting
        queue where the policy puts it (FCFS: the front)."""
        self.running.remove(victim)
        self._release(victim)
        victim.status, victim.wait_reason = WAITING, "kv_blocks"
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.requeue(victim)
        out.preempted.append(victim)
        # Never one already in this step: the full blocks a scheduled chunk completes are
        # already named in the prefix cache, and their K/V must then be computed.
        assert all(s.seq is not victim for s in out.scheduled)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.request_id)
        seq.block_table = []
        heapq.heappush(self._free_slots, seq.slot)
        seq.slot = None

    def _retire(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        del self._seqs[seq.request_id]

    def _finish_reason(self, seq: Sequence, token: int, num_output_tokens: int | None = None) -> str | None:
        """Why seq ends with `token` as its output number num_output_tokens (default:
        its last), or None."""
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or (p.stop_token_ids and token in p.stop_token_ids):
            return "stop"
        n = len(seq.output_token_ids) if num_output_tokens is None else num_output_tokens
        if n >= p.max_tokens or len(seq.prompt_token_ids) + n >= self.config.max_model_len:
            return "length"
        return None

    def _assert_step_invariants(self) -> None:
        """After a step (with CHECK_ALL_INVARIANTS): slot ownership, and every block in use
        belongs to a running sequence and covers its computed tokens."""
        if CHECK_ALL_INVARIANTS:
            self._check_step_invariants()

    def _check_step_invariants(self) -> None:
        slots = [s.slot for s in self.running]
        assert sorted([*slots, *self._free_slots]) == list(range(self.config.max_num_seqs)), "slot leaked or shared"
        # A block shared by several sequences is one block in use.
        assert len({b for s in self.running for b in s.block_table}) == self.allocator.num_used, "KV block leaked"
        bs = self.config.block_size
        for seq in self.running:
            assert seq.status is not WAITING
            assert len(seq.block_table) * bs >= seq.num_computed_tokens, f"{seq.request_id}: K/V beyond its blocks"
