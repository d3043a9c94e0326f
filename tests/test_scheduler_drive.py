"""A seeded random-workload driver for the scheduler (pure Python, no model).

Each seed draws a small config (continuous or static batching, FCFS, priority, fair or
slo policy, chunked prefill and prefix caching on or off, sync or async scheduling, every
KV admission, preemption by recompute or by swap into a small host pool, optional
speculative decoding, a KV pool small enough that on-demand admission preempts) and a
workload (random prompt and output lengths, shared prefixes, structured-output requests,
SLO targets, arrivals, aborts between steps and between a step's schedule() and its
update()), and steps it the way engine.py does, with fake sampled tokens drawn as each
step "runs" (in dispatch order, as the device runs them). After every schedule() and every
update() it checks, from the sequences' own block tables and not the scheduler's bookkeeping:

- each KV block is free exactly when no seated sequence's table holds it, and its ref
  count is the number of seated sequences holding it (no leak, no double owner);
- the K/V itself (a model of the device and host pools, KVModel): every row of a step
  reads, at each position up to its last, the K/V of exactly its own tokens there,
  through shared prefix-cache blocks, swap-outs and swap-ins, rejected drafts;
- running <= max_num_seqs, the step's tokens <= max_num_batched_tokens, every prompt
  chunk <= long_prefill_token_threshold (drawn for some chunked seeds);
- no request is both preempted and scheduled in one step (vLLM's rule);
- a finished or aborted request holds no slot, device block or host block;
- a swapped-out sequence resumes with exactly the computed tokens it had;
- a reserving admission's running sequence holds its whole reservation (reserve-max-len:
  max_model_len's blocks), and only a ranked policy's admission preempts it;
- each waiting request's wait reason is the true one (check_wait_reasons);
- admissions follow the policy's queue order; a ranked policy preempts no running
  sequence the step's admissions did not need, and only for a request that outranks it
  (slo: only a lost request, for one that can still make its target);
- a structured-output request's matcher has seen exactly its output tokens, it never
  verifies drafts, and it ends where its grammar does;
- every request finishes within a bounded number of steps, and the host pool is whole.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from config import EngineConfig
from kvcache import blocks_needed, hash_block_tokens
from sampling_params import SamplingParams
from scheduler import Scheduler
from scheduler_output import SchedulerOutput
from sequence import FINISHED, RUNNING, WAITING, Sequence

EOS = 0
REFUSED = 9  # the token a strict fake grammar refuses
NUM_SEEDS = 600


class FakeConstraint:
    """A structured-output matcher's interface (structured.Constraint): it takes every
    token (a strict one refuses REFUSED) and is complete after `length` of them."""

    def __init__(self, length: int, strict: bool) -> None:
        self.length, self.strict, self.tokens = length, strict, []

    def accept(self, token: int) -> bool:
        self.tokens.append(token)
        return not (self.strict and token == REFUSED)

    @property
    def stopped(self) -> bool:
        return len(self.tokens) >= self.length


class KVModel:
    """The device's KV pool and the host's swap pool, as what each (block, offset) holds:
    a hash chained over the tokens up to that position (K/V depends on the whole prefix).
    Steps run in dispatch order: swap-outs, swap-ins, then every row writes its new
    positions, then every row reads all its positions (each layer writes a step's K/V
    before it attends)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.dev: dict[tuple[int, int], int] = {}
        self.host: dict[tuple[int, int], int] = {}
        self.tokens: dict[str, list[int]] = {}  # per request: its tokens as the device knows them

    @staticmethod
    def chain(tokens: list[int]) -> list[int]:
        h, out = 0, []
        for t in tokens:
            h = hash((h, t))
            out.append(h)
        return out

    def run(self, out: SchedulerOutput, sample) -> tuple[list[int], dict[int, list[int]]]:
        bs = self.bs
        for dev, host in out.swap_out:
            assert len(dev) == len(host)
            for d, h in zip(dev, host):
                for o in range(bs):
                    self.host[h, o] = self.dev.get((d, o))
        for dev, host in out.swap_in:
            for d, h in zip(dev, host):
                for o in range(bs):
                    self.dev[d, o] = self.host.get((h, o))
        rows = []
        for x in out.scheduled:
            seq = x.seq
            toks = self.tokens.setdefault(seq.request_id, list(seq.prompt_token_ids))
            end = seq.num_computed_tokens
            start = end - x.num_new_tokens
            inputs = toks + list(x.spec_token_ids)
            assert end <= len(inputs), f"{seq.request_id}: computes position {end - 1}, whose token the device lacks"
            assert end <= len(seq.block_table) * bs, f"{seq.request_id}: K/V beyond its blocks"
            h = self.chain(inputs[:end])
            written = {}
            for p in range(start, end):
                key = (seq.block_table[p // bs], p % bs)
                assert written.setdefault(key, h[p]) == h[p], f"two rows write {key} with different K/V"
                self.dev[key] = h[p]
            rows.append((seq, h, end))
        for seq, h, end in rows:
            for p in range(end):
                got = self.dev.get((seq.block_table[p // bs], p % bs))
                assert got == h[p], f"{seq.request_id} reads wrong K/V at position {p} (block {seq.block_table[p // bs]})"
        tokens, spec = [], {}
        for i, x in enumerate(out.scheduled):
            toks = self.tokens[x.seq.request_id]
            tokens.append(sample())
            if x.spec_token_ids:
                a = random.Random(tokens[-1] * 7919 + len(toks)).randint(0, len(x.spec_token_ids))
                spec[i] = list(x.spec_token_ids[:a]) + [tokens[-1]]
                toks += spec[i]
            elif x.samples:
                toks.append(tokens[-1])
        return tokens, spec


class Drive:
    def __init__(self, seed: int) -> None:
        rng = self.rng = random.Random(seed)
        self.scheduling = rng.choice(["continuous", "continuous", "static"])
        self.policy = rng.choice(["fcfs", "fcfs", "priority", "priority", "fair", "slo"])
        self.chunked = rng.random() < 0.5
        self.caching = rng.random() < 0.5
        self.async_ = rng.random() < 0.5
        self.kv_admission = rng.choice(["on-demand"] * 4 + ["reserve", "reserve-max-len"])
        self.swap = self.kv_admission == "on-demand" and rng.random() < 0.5
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
        self.constrained = rng.random() < 0.3  # some requests carry a grammar
        max_num_seqs = rng.randint(1, 4)
        block_size = rng.choice([1, 2, 4])
        self.max_model_len = mml = rng.randint(8, 32)
        budget = max_num_seqs + rng.randint(0, 12) if self.chunked else mml + rng.randint(0, 8)
        # vLLM's long_prefill_token_threshold, drawn apart so each seed keeps its workload
        self.threshold = random.Random(f"threshold/{seed}").choice([0, 0, 1, 2, 5]) if self.chunked else 0
        cfg = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size, max_model_len=mml,
                           enable_chunked_prefill=self.chunked, max_num_batched_tokens=budget,
                           long_prefill_token_threshold=self.threshold,
                           enable_prefix_caching=self.caching, scheduling=self.scheduling,
                           scheduling_policy=self.policy, kv_admission=self.kv_admission,
                           preemption_mode="swap" if self.swap else "recompute",
                           speculative_config=spec, async_scheduling=self.async_).resolved(mml)
        # One max_model_len sequence and a few blocks more: on-demand preempts often.
        num_blocks = blocks_needed(mml, block_size) + 1 + rng.randint(0, 6)
        num_swap = rng.choice([1, 2, 4, 8, 16]) if self.swap else 0
        self.s = Scheduler(cfg, num_blocks, (EOS,), num_swap_blocks=num_swap)
        self.now = 0  # the policy's clock (slo deadlines, fair's activity window): the step
        self.s.policy.clock = lambda: float(self.now)
        self.cfg = cfg
        self.kv = KVModel(block_size)
        self.seqs: list[Sequence] = []
        self.released: set[str] = set()
        self.aborted: set[str] = set()  # by the client
        self.swapped_computed: dict[str, int] = {}  # a swapped-out sequence's computed tokens
        n = rng.randint(1, 10)
        self.arrivals = sorted((rng.randint(0, 8 if self.swap else 30), i) for i in range(n))  # swap: under pressure
        self.aborts = {rng.randrange(n): rng.randint(0, 60) for _ in range(rng.randint(0, 2))}
        self.shared = [rng.randint(3, 9) for _ in range(mml)]
        # What each step's ranked preemption for waiting requests chose, and the queue it walked.
        self.walked: list[Sequence] = []
        self.queue_at_start: list[Sequence] = []
        plan, begin = self.s.preempt_for_waiting, self.s.policy.begin_step

        def preempt_for_waiting(out: SchedulerOutput) -> None:
            k = len(out.preempted)
            plan(out)
            self.walked = out.preempted[k:]
            self.outranked = {v.request_id: [q.request_id for q in self.s.waiting if self.s.policy.outranks(q, v)]
                              for v in self.walked}

        def begin_step(running: list[Sequence]) -> None:
            begin(running)
            self.queue_at_start = list(self.s.waiting)
            if self.s.policy.orders_prompts:  # the ranks this step goes by (fair's move only as it is charged)
                self.keys_at_start = {id(q): self.s.policy.key(q) for q in [*running, *self.s.waiting]}

        self.s.preempt_for_waiting = preempt_for_waiting
        self.s.policy.begin_step = begin_step

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
        if self.policy == "slo":  # targets in steps: some are missed, and those requests rank last
            kw["slo_ttft"] = rng.choice([None, 1.0, 3.0, 8.0, 30.0])
            kw["slo_tpot"] = rng.choice([None, 1.0, 2.0])
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.5)
        seq = Sequence(f"r{i}", prompt, params, arrival_time=float(self.now if self.policy == "slo" else len(self.seqs)),
                       **kw)
        if self.constrained and rng.random() < 0.5:
            seq.constraint = FakeConstraint(rng.randint(1, max_tokens + 2), strict=rng.random() < 0.3)
        return seq

    def token(self) -> int:
        return EOS if self.rng.random() < 1 / 10 else self.rng.randint(3, 9)

    def abort(self, rid: str) -> None:
        seq = next(q for q in self.seqs if q.request_id == rid)
        if self.s.abort(rid) is not None:
            self.released.add(rid)
            self.aborted.add(rid)
            # Ended for its client before release (static batching holds a finished one): an abort.
            assert seq.status is FINISHED and seq.finish_reason == "abort", (rid, seq.finish_reason)

    # ---- one step, as engine.step() drives it --------------------------------------------
    def run(self) -> None:
        s, rng = self.s, self.rng
        in_flight: deque[tuple[SchedulerOutput, list[int], dict[int, list[int]]]] = deque()
        pending = deque(self.arrivals)
        step = 0
        while pending or s.has_unfinished() or in_flight:
            self.now = step
            while pending and pending[0][0] <= step:
                seq = self.new_sequence(pending.popleft()[1])
                s.validate(seq.prompt_token_ids, seq.params, seq.priority)
                self.seqs.append(seq)
                s.add(seq)
            for i, at in self.aborts.items():
                if at == step and i < len(self.seqs):
                    self.abort(self.seqs[i].request_id)
            if in_flight and s.speculating and self.spec is not None:
                self.update(*in_flight.popleft())  # proposals read every token
            riding = bool(s.running)
            held = {q.request_id: len(q.block_table) for q in s.running}
            was_running = self.was_running = {id(q) for q in s.running}
            self.walked, self.outranked = [], {}
            out = s.schedule()
            self.check_schedule(out, riding)
            self.check_victims_needed(out, held)
            self.check_admission_order(out, was_running)
            self.check_swaps(out)
            if out.num_spec_tokens and self.spec["method"] == "draft_model":
                rows = [x for x in out.scheduled if x.num_spec_tokens]
                s.take_proposals(out, [[rng.randint(3, 9) for _ in range(rng.randint(0, x.num_spec_tokens + 1))]
                                       for x in rows])
            assert not any(x.spec_token_ids and x.seq.constraint is not None for x in out.scheduled), \
                "a constrained row verifies drafts"
            ran = self.kv.run(out, self.token)  # the device runs it now (an empty step may still swap)
            if out.scheduled or out.preempted or not in_flight:
                in_flight.append((out, *ran))
            if rng.random() < 0.05 and out.scheduled:  # a client leaves while the step runs
                self.abort(rng.choice(out.scheduled).seq.request_id)
            overlaps = self.async_ and bool(out.scheduled) and len(in_flight) <= 1 and not out.num_spec_tokens
            if not overlaps:
                self.update(*in_flight.popleft())
            step += 1
            assert step < 3000, "the scheduler stopped making progress"
        assert s.allocator.num_used == 0
        assert len(s._host_free) == s.num_swap_blocks, "a host swap block leaked"
        assert all(q.finish_reason is not None for q in self.seqs)

    def update(self, out: SchedulerOutput, tokens: list[int], spec: dict[int, list[int]]) -> None:
        outcome = self.s.update(out, tokens, spec)
        self.released.update(q.request_id for q in outcome.finished)
        for x in out.scheduled:
            seq = x.seq
            if x.samples and seq.first_token_time is None and seq.output_token_ids:
                seq.first_token_time = float(self.now)  # as the engine's metrics do
        self.s.check_invariants()
        self.check_blocks()
        self.check_constraints()

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
                assert q.swapped is None, f"{q.request_id} ended holding host blocks"
            if q.status is WAITING:
                assert q.slot is None and not q.block_table and not alloc.blocks_of(q.request_id), q.request_id
        if self.kv_admission != "on-demand":  # a reservation is held whole from admission to release
            adm, bs = s.kv_admission, self.cfg.block_size
            for q in seated:
                want = blocks_needed(adm.lifetime_tokens(q.num_prompt_tokens, q.params.max_tokens, self.cfg), bs)
                assert len(q.block_table) >= want, f"{q.request_id} holds {len(q.block_table)} blocks of its {want}"
                if self.kv_admission == "reserve-max-len":
                    assert len(q.block_table) >= blocks_needed(self.max_model_len - 1, bs), q.request_id

    def check_constraints(self) -> None:
        for q in self.seqs:
            c = q.constraint
            if c is None or q.request_id in self.aborted:
                continue
            assert c.tokens == q.output_token_ids, f"{q.request_id}: the matcher saw {c.tokens}, outputs {q.output_token_ids}"
            if q.finish_reason is not None and c.tokens:
                refused = c.strict and c.tokens[-1] == REFUSED
                assert not any(t == REFUSED for t in c.tokens[:-1]) or not c.strict, q.request_id
                if refused:
                    assert q.finish_reason == "abort", (q.request_id, q.finish_reason)
                elif c.stopped and not (q.params.stop_token(c.tokens[-1], (EOS,)) is not None):
                    assert q.finish_reason == "stop", (q.request_id, q.finish_reason)
            if q.finish_reason is None:
                assert not c.stopped, f"{q.request_id} runs past its complete grammar"

    def check_swaps(self, out: SchedulerOutput) -> None:
        """A swapped-out sequence comes back with exactly the computed tokens it had (the
        K/V itself is checked by KVModel), into its first blocks; a recomputed one with none."""
        s, bs = self.s, self.cfg.block_size
        for v, n, swapped in zip(out.preempted, out.preempted_tokens, out.preempted_swapped):
            assert not swapped or self.swap
            if swapped:
                assert v.swapped is None or v.swapped[1] == n and len(v.swapped[0]) == blocks_needed(n, bs)
                self.swapped_computed[v.request_id] = n
            else:
                assert v.swapped is None
        assert len(out.swap_out) == sum(out.preempted_swapped)
        for dev, host in out.swap_in:
            owner = next(q for q in s.running if q.block_table[:len(dev)] == dev)
            n = self.swapped_computed.pop(owner.request_id)
            assert len(host) == blocks_needed(n, bs)
            row = next((x for x in out.scheduled if x.seq is owner), None)
            assert owner.num_computed_tokens - (row.num_new_tokens if row else 0) == n, \
                f"{owner.request_id} resumes at {owner.num_computed_tokens}, swapped out at {n}"

    def check_admission_order(self, out: SchedulerOutput, was_running: set[int]) -> None:
        """Admissions take the queue's head (in the order the step began with), walking past
        only a request the policy holds back; a ranked policy preempts for waiting requests
        only running sequences a waiting request outranks (slo: lost ones, for one that is not)."""
        s = self.s
        admitted = [q for q in self.queue_at_start if q.status is RUNNING]
        eligible = [q for q in self.queue_at_start if q.status is RUNNING or s.waiting.reason_of(q) != "policy"]
        assert admitted == eligible[:len(admitted)], ([q.request_id for q in admitted],
                                                      [q.request_id for q in eligible])
        if self.policy in ("priority", "slo"):  # the queue is in rank order
            keys = [s.policy.key(q) for q in s.waiting]
            assert keys == sorted(keys), [q.request_id for q in s.waiting]
        if s.policy.orders_prompts:  # seated prompts get the step's budget in rank order (admissions come after)
            keys = [self.keys_at_start[id(x.seq)] for x in out.scheduled
                    if not x.is_decode and id(x.seq) in was_running]
            assert keys == sorted(keys), "prompt chunks out of rank order"
        if self.walked and self.policy != "fair":  # (fair's ranks move with the service charged this step)
            for v in self.walked:
                assert self.outranked[v.request_id] or any(s.policy.outranks(q, v) for q in admitted), v.request_id
                if self.policy == "slo":
                    assert s.policy.lost(v), f"{v.request_id} was preempted, but it can still make its target"
            if self.policy == "slo":  # for a request that can still make its target (a lost one never preempts)
                assert any(not s.policy.lost(q) for q in admitted), [q.request_id for q in admitted]

    def check_schedule(self, out: SchedulerOutput, riding: bool) -> None:
        s, cfg = self.s, self.cfg
        assert sum(x.num_new_tokens for x in out.scheduled) <= cfg.max_num_batched_tokens
        assert len(s.running) <= cfg.max_num_seqs
        assert len({id(x.seq) for x in out.scheduled}) == len(out.scheduled)
        if self.threshold:  # every prompt chunk (a recompute's too) within the threshold
            assert all(x.is_decode or x.num_new_tokens <= self.threshold for x in out.scheduled)
        # vLLM's rule: a victim boards again no sooner than the next step (it would only thrash)
        assert not {id(q) for q in out.preempted} & {id(x.seq) for x in out.scheduled}, \
            [q.request_id for q in out.preempted]
        if self.kv_admission != "on-demand":
            assert not s.room_preempted, "a reserving admission preempted for room"
        if self.policy == "fcfs":
            assert not self.walked
        if not out.scheduled and not out.preempted:  # an idle step: nobody seated had work it could do
            idle = [q.request_id for q in s.running if q.status is RUNNING and not q.num_output_placeholders]
            assert not idle, f"a step scheduled nothing while {idle} had work"
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
        waiting, reason_of = list(s.waiting), s.waiting.reason_of
        if not waiting:
            return
        preempted = {id(q) for q in out.preempted}
        static = self.scheduling == "static"
        if static and riding:
            for q in waiting:  # the bus has left; one it put off waits for blocks
                want = "kv_blocks" if id(q) in preempted else "static_batch"
                assert reason_of(q) == want, (q.request_id, reason_of(q), want)
            return
        # The policy holds back some prompts (chunked prefill): those wait on it; the first
        # request it does not hold stops admission, and it and all behind it wait for one reason.
        i = 0
        while i < len(waiting) and reason_of(waiting[i]) == "policy":
            assert self.chunked and s.policy.prompt_room(waiting[i], out.scheduled) == 0, waiting[i].request_id
            i += 1
        if i == len(waiting):
            return
        head, reason = waiting[i], reason_of(waiting[i])
        assert all(reason_of(q) == reason for q in waiting[i:]), [(q.request_id, reason_of(q)) for q in waiting]
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
            cached = self.cached_blocks(head)
            self.check_blocks_short(head, reason, cached, head.num_tokens - self.num_cached_tokens(head, cached))
            return
        # The budget admission saw: with chunked prefill admission comes last; without it,
        # decodes run only in a step that admitted nobody (an admission's own first step may
        # be a decode: a swapped-out sequence whose K/V came back whole).
        used = sum(x.num_new_tokens for x in out.scheduled
                   if self.chunked or not x.is_decode or id(x.seq) not in self.was_running)
        budget = cfg.max_num_batched_tokens - used
        if self.chunked and budget > 0:  # a prompt the policy holds back waits on it, not behind the head
            assert s.policy.prompt_room(head, out.scheduled) > 0, (head.request_id, reason, "held by the policy")
        if self.caching and not self.chunked and out.num_decode_tokens:
            return  # the decodes ran after admission: blocks they completed were named too late for it
        cached = self.cached_blocks(head)
        n = head.num_tokens - self.num_cached_tokens(head, cached)
        if self.chunked:
            n = min(n, budget, s.policy.prompt_room(head, out.scheduled))
        if not 0 < n <= budget:
            assert reason == "token_budget", (head.request_id, reason)
            return
        self.check_blocks_short(head, reason, cached, n)

    def num_cached_tokens(self, seq: Sequence, cached: list[int]) -> int:
        """The tokens seq would not compute at admission: its cached prefix's, or what its
        swapped-out K/V holds (copied back into fresh blocks)."""
        return seq.swapped[1] if seq.swapped else len(cached) * self.cfg.block_size

    def check_blocks_short(self, head: Sequence, reason: str, cached: list[int], n: int) -> None:
        """head, which a seat and the budget would take, waits for KV blocks: they are short."""
        s, cfg = self.s, self.cfg
        assert reason == "kv_blocks", (head.request_id, reason)
        if head.num_output_placeholders:
            return  # its latest token is still in flight: it boards once that is known
        tokens = s.kv_admission.tokens_at_admission(head, self.num_cached_tokens(head, cached) + n, cfg)
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

