"""A seeded random-workload driver for the scheduler (pure Python, no model).

Each seed draws a small config (continuous or static batching, FCFS, priority or fair
policy, chunked prefill and prefix caching on or off, sync or async scheduling, optional
speculative decoding, a KV pool small enough that on-demand admission preempts) and a
workload (random prompt and output lengths, shared prefixes, arrivals, aborts between
steps and between a step's schedule() and its update()), and steps it the way engine.py
does, with fake sampled tokens. After every schedule() and every update() it checks,
from the sequences' own block tables and not the scheduler's bookkeeping:

- each KV block is free exactly when no seated sequence's table holds it, and its ref
  count is the number of seated sequences holding it (no leak, no double owner);
- running <= max_num_seqs, the step's tokens <= max_num_batched_tokens;
- a finished or aborted request holds no slot or block;
- each waiting request's wait_reason is the true one (check_wait_reasons);
- a ranked policy preempts no running sequence the step's admissions did not need;
- every request finishes within a bounded number of steps.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from config import EngineConfig, SamplingParams
from kvcache import blocks_needed, hash_block_tokens
from scheduler import FINISHED, WAITING, Scheduler, SchedulerOutput, Sequence

EOS = 0
NUM_SEEDS = 600


class Drive:
    def __init__(self, seed: int) -> None:
        rng = self.rng = random.Random(seed)
        self.scheduling = rng.choice(["continuous", "continuous", "static"])
        self.policy = rng.choice(["fcfs", "fcfs", "priority", "priority", "fair"])
        self.chunked = rng.random() < 0.5
        self.caching = rng.random() < 0.5
        self.async_ = rng.random() < 0.5
        self.kv_admission = rng.choice(["on-demand"] * 4 + ["reserve"])
        spec = None
        if rng.random() < 0.25:
            spec = rng.choice([{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2},
                               {"method": "draft_model", "model": "draft"}])
            spec = {**spec, "num_speculative_tokens": rng.randint(1, 3)}
            if rng.random() < 0.5:  # off at larger batches, so a step in flight may verify drafts
                spec["disable_by_batch_size"] = rng.randint(2, 4)
            if rng.random() < 0.3:
                spec.update(min_acceptance_rate=0.5, acceptance_window=2)
        self.spec = spec
        max_num_seqs = rng.randint(1, 4)
        block_size = rng.choice([1, 2, 4])
        self.max_model_len = mml = rng.randint(8, 32)
        budget = max_num_seqs + rng.randint(0, 12) if self.chunked else mml + rng.randint(0, 8)
        cfg = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size, max_model_len=mml,
                           enable_chunked_prefill=self.chunked, max_num_batched_tokens=budget,
                           enable_prefix_caching=self.caching, scheduling=self.scheduling,
                           scheduling_policy=self.policy, kv_admission=self.kv_admission,
                           speculative_config=spec, async_scheduling=self.async_).resolved(mml)
        # One max_model_len sequence and a few blocks more: on-demand preempts often.
        num_blocks = blocks_needed(mml, block_size) + 1 + rng.randint(0, 6)
        self.s = Scheduler(cfg, num_blocks, (EOS,))
        self.cfg = cfg
        self.seqs: list[Sequence] = []
        self.released: set[str] = set()
        n = rng.randint(1, 10)
        self.arrivals = sorted((rng.randint(0, 30), i) for i in range(n))
        self.aborts = {rng.randrange(n): rng.randint(0, 60) for _ in range(rng.randint(0, 2))}
        self.shared = [rng.randint(3, 9) for _ in range(mml)]

    # ---- the workload ------------------------------------------------------------------
    def new_sequence(self, i: int) -> Sequence:
        rng, mml = self.rng, self.max_model_len
        prompt_len = rng.randint(1, mml - 1)
        max_tokens = rng.randint(1, mml - prompt_len)
        if rng.random() < 0.5:  # a shared prefix: prefix-cache hits
            prompt = self.shared[:prompt_len]
        else:
            prompt = [1000 * (i + 1) + j for j in range(prompt_len)]
        kw = {}
        if self.policy == "priority":
            kw["priority"] = rng.choice([0, 2, 3, 3])  # a few urgent ones preempt the rest
        if self.policy == "fair":
            kw["user"] = rng.choice(["u0", "u1", "u2"])
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.5)
        return Sequence(f"r{i}", prompt, params, arrival_time=float(len(self.seqs)), **kw)

    def token(self) -> int:
        return EOS if self.rng.random() < 1 / 10 else self.rng.randint(3, 9)

    def abort(self, rid: str) -> None:
        seq = next(q for q in self.seqs if q.request_id == rid)
        if self.s.abort(rid) is not None:
            self.released.add(rid)
            # Ended for its client before release (static batching holds a finished one): an abort.
            assert seq.status is FINISHED and seq.finish_reason == "abort", (rid, seq.finish_reason)

    # ---- one step, as engine.step() drives it --------------------------------------------
    def run(self) -> None:
        s, rng = self.s, self.rng
        in_flight: deque[SchedulerOutput] = deque()
        pending = deque(self.arrivals)
        step = 0
        while pending or s.has_unfinished() or in_flight:
            while pending and pending[0][0] <= step:
                seq = self.new_sequence(pending.popleft()[1])
                s.validate(seq.prompt_token_ids, seq.params, seq.priority)
                self.seqs.append(seq)
                s.add(seq)
            for i, at in self.aborts.items():
                if at == step and i < len(self.seqs):
                    self.abort(self.seqs[i].request_id)
            if in_flight and s.speculating and self.spec is not None:
                self.update(in_flight.popleft())  # proposals read every token
            riding = bool(s.running)
            held = {q.request_id: len(q.block_table) for q in s.running}
            out = s.schedule()
            self.check_schedule(out, riding)
            self.check_victims_needed(out, held)
            if out.num_spec_tokens and self.spec["method"] == "draft_model":
                rows = [x for x in out.scheduled if x.spec_token_ids]
                s.take_proposals(out, [[rng.randint(3, 9) for _ in range(rng.randint(0, len(x.spec_token_ids) + 1))]
                                       for x in rows])
            if out.scheduled or out.preempted or not in_flight:
                in_flight.append(out)
            if rng.random() < 0.05 and out.scheduled:  # a client leaves while the step runs
                self.abort(rng.choice(out.scheduled).seq.request_id)
            overlaps = self.async_ and bool(out.scheduled) and len(in_flight) <= 1 and not out.num_spec_tokens
            if not overlaps:
                self.update(in_flight.popleft())
            step += 1
            assert step < 3000, "the scheduler stopped making progress"
        assert s.allocator.num_used == 0
        assert all(q.finish_reason is not None for q in self.seqs)

    def update(self, out: SchedulerOutput) -> None:
        tokens = [self.token() for _ in out.scheduled]
        spec = {}
        for i, x in enumerate(out.scheduled):
            if x.spec_token_ids:
                a = self.rng.randint(0, len(x.spec_token_ids))
                spec[i] = list(x.spec_token_ids[:a]) + [self.token()]
        outcome = self.s.update(out, tokens, spec)
        self.released.update(q.request_id for q in outcome.finished)
        self.s.check_invariants()
        self.check_blocks()

    # ---- the checks -------------------------------------------------------------------------
    def check_blocks(self) -> None:
        s, alloc = self.s, self.s.allocator
        seated = s.running
        assert len(seated) <= self.cfg.max_num_seqs
        assert len({q.slot for q in seated}) == len(seated) and all(q.slot is not None for q in seated)
        holders = [0] * alloc.num_blocks
        for q in seated:
            assert len(set(q.block_table)) == len(q.block_table), f"{q.request_id} holds a block twice"
            assert q.block_table == alloc.blocks_of(q.request_id), q.request_id
            for b in q.block_table:
                assert 0 < b < alloc.num_blocks
                holders[b] += 1
        for b in range(1, alloc.num_blocks):
            assert alloc.ref_count(b) == holders[b], f"block {b}: ref count {alloc.ref_count(b)}, held {holders[b]}"
            assert (b in alloc._free) == (holders[b] == 0), f"block {b}: free list disagrees with the tables"
        for q in self.seqs:
            if q.request_id in self.released or q.status is FINISHED and q not in seated:
                assert q.slot is None and not q.block_table and not alloc.blocks_of(q.request_id), q.request_id
            if q.status is WAITING:
                assert q.slot is None and not q.block_table and not alloc.blocks_of(q.request_id), q.request_id

    def check_schedule(self, out: SchedulerOutput, riding: bool) -> None:
        s, cfg = self.s, self.cfg
        assert sum(x.num_new_tokens for x in out.scheduled) <= cfg.max_num_batched_tokens
        assert len(s.running) <= cfg.max_num_seqs
        assert len({id(x.seq) for x in out.scheduled}) == len(out.scheduled)
        self.check_blocks()
        self.check_wait_reasons(out, riding)

    def check_victims_needed(self, out: SchedulerOutput, held: dict[str, int]) -> None:
        """A ranked policy preempts running sequences for waiting ones; none for nothing:
        had a victim stayed, seated and holding its blocks, the step's admissions would not
        have fit. Checked where what it held is what its preemption freed and admission
        takes whole prompts (continuous batching, no prefix caching, no chunks: a step that
        admits runs no decode, so none of its victims was preempted for a decode's block)."""
        s = self.s
        if self.policy == "fcfs" or self.scheduling == "static" or self.caching or self.chunked \
                or not out.preempted or all(x.is_decode for x in out.scheduled):
            return
        for v in out.preempted:
            spare = len(s._free_slots) >= 1 and s.allocator.num_free >= held[v.request_id]
            assert not spare, f"{v.request_id} was preempted for nothing: {held[v.request_id]} blocks and a seat are left"

    def cached_blocks(self, seq: Sequence) -> list[int]:
        """The cached prefix seq would start from, from its tokens' hashes."""
        if not self.caching or seq.swapped:
            return []
        bs, tokens, h, names = self.cfg.block_size, seq.all_token_ids, None, []
        for i in range((seq.num_tokens - 1) // bs):
            h = hash_block_tokens(h, tokens[i * bs:(i + 1) * bs])
            names.append(h)
        return self.s.allocator.cached_prefix(names)

    def check_wait_reasons(self, out: SchedulerOutput, riding: bool) -> None:
        """riding: sequences were seated as the step began."""
        s, cfg = self.s, self.cfg
        waiting = list(s.waiting)
        if not waiting:
            return
        preempted = {id(q) for q in out.preempted}
        static = self.scheduling == "static"
        if static and riding:
            for q in waiting:  # the bus has left; one it put off waits for blocks
                want = "kv_blocks" if id(q) in preempted else "static_batch"
                assert q.wait_reason == want, (q.request_id, q.wait_reason, want)
            return
        # The policy holds back some prompts (chunked prefill): those wait on it; the first
        # request it does not hold stops admission, and it and all behind it wait for one reason.
        i = 0
        while i < len(waiting) and waiting[i].wait_reason == "policy":
            assert self.chunked and s.policy.prompt_room(waiting[i], out.scheduled) == 0, waiting[i].request_id
            i += 1
        if i == len(waiting):
            return
        head, reason = waiting[i], waiting[i].wait_reason
        assert all(q.wait_reason == reason for q in waiting[i:]), [(q.request_id, q.wait_reason) for q in waiting]
        if self.policy != "fcfs" and out.preempted:
            # A ranked policy preempts for waiting requests too; which preemption was for
            # room is the scheduler's to know.
            assert reason in ("kv_blocks", "max_num_seqs", "token_budget")
            return
        if out.preempted:
            # A step that preempted running sequences for blocks admits nobody: KV room is
            # what every waiting request lacks (a seat and budget may be there).
            assert reason == "kv_blocks", (head.request_id, reason)
            return
        if not s._free_slots:
            assert reason == "max_num_seqs", (head.request_id, reason)
            return
        assert reason in ("token_budget", "kv_blocks"), (head.request_id, reason)
        if static:  # boarding: blocks for the whole prompt, no token budget
            assert reason == "kv_blocks", (head.request_id, reason)
            if not self.caching:  # (with it, the boarded prompts are named only as they are scheduled)
                self.check_blocks_short(head, reason, [], head.num_tokens)
            return
        # The budget admission saw: with chunked prefill admission comes last; without it,
        # decodes run only in a step that admitted nobody.
        used = sum(x.num_new_tokens for x in out.scheduled if self.chunked or not x.is_decode)
        budget = cfg.max_num_batched_tokens - used
        if self.chunked and budget > 0:  # a prompt the policy holds back waits on it, not behind the head
            assert s.policy.prompt_room(head, out.scheduled) > 0, (head.request_id, reason, "held by the policy")
        cached = self.cached_blocks(head)
        n = head.num_tokens - len(cached) * cfg.block_size
        if self.chunked:
            n = min(n, budget, s.policy.prompt_room(head, out.scheduled))
        if not 0 < n <= budget:
            assert reason == "token_budget", (head.request_id, reason)
            return
        self.check_blocks_short(head, reason, cached, n)

    def check_blocks_short(self, head: Sequence, reason: str, cached: list[int], n: int) -> None:
        """head, which a seat and the budget would take, waits for KV blocks: they are short."""
        s, cfg = self.s, self.cfg
        assert reason == "kv_blocks", (head.request_id, reason)
        if head.num_output_placeholders:
            return  # its latest token is still in flight: it boards once that is known
        tokens = s.kv_admission.tokens_at_admission(head, len(cached) * cfg.block_size + n, cfg)
        need = blocks_needed(tokens, cfg.block_size) - len(cached)
        revived = sum(1 for b in cached if s.allocator.ref_count(b) == 0)
        assert need + revived > s.allocator.num_free, (head.request_id, "blocks were there", need, revived)


@pytest.mark.parametrize("chunk", range(6))
def test_random_workloads_keep_the_invariants_and_finish(chunk: int) -> None:
    for seed in range(chunk * NUM_SEEDS // 6, (chunk + 1) * NUM_SEEDS // 6):
        try:
            Drive(seed).run()
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e

