"""Preemption for waiting requests: under a ranked policy, which running sequences the
waiting requests that outrank them take seats and KV blocks from, planned before anything
is scheduled. Pure Python. The plan only chooses; `Scheduler.preempt_for_waiting`
preempts its victims, and its admissions are then the only ones `Scheduler.admit` makes
in the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache import blocks_needed
from scheduler_output import SchedulerOutput
from sequence import Sequence

if TYPE_CHECKING:
    from scheduler import Scheduler


class PreemptionPlan:
    """Walks the waiting queue in admission order as admit will, counting the room each
    admission takes; a request whose admission preempting cannot make room stops the walk,
    and nobody is preempted for it (no preemption for nothing); nor for a planned admission
    that the other victims already make room for.

    running: the running sequences not finished (the candidate victims); free_slots and
    budget: the seats and tokens left in the step."""

    def __init__(self, sched: Scheduler, out: SchedulerOutput, running: list[Sequence], free_slots: int,
                 budget: int) -> None:
        self.sched, self.out, self.running = sched, out, running
        self.policy, self.allocator = sched.policy, sched.allocator
        self.free_slots, self.step_budget = free_slots, budget
        self.block_size, self.chunked = sched.config.block_size, sched.config.enable_chunked_prefill
        self.slots = self.blocks = self.budget = 0  # the room left as the walk plans admissions (set by _walk)
        self.gone: set[int] = set()
        self.taken: set[int] = set()
        self.holders: dict[int, int] = {}

    def choose(self) -> tuple[list[Sequence], list[Sequence]]:
        """The admissions planned, in queue order, and the victims they need."""
        admitted, victims = self._walk(set())
        # Only the victims the walk as a whole needs: one chosen for an early admission may
        # be spared once a later admission's victim frees room for both. The highest ranked
        # is tried first (as in each admission's own trim); sparing it must keep every
        # planned admission and take no new victim.
        ranked, rest = [], list(victims)
        while rest:
            ranked.append(self.policy.victim(rest))
            rest.remove(ranked[-1])
        spared: set[int] = set()
        for r in ranked[::-1] if len(victims) > 1 else ():
            if r not in victims:
                continue
            again, fewer = self._walk(spared | {id(r)})
            if again == admitted and {id(v) for v in fewer} < {id(v) for v in victims}:
                spared.add(id(r))
                victims = fewer
        return admitted, victims

    def _growth(self, r: Sequence) -> int:  # chunked: the blocks r's own work takes before any admission
        # (none for a reserving admission's decode: its table already covers it)
        if not self.chunked:
            return 0
        return max(0, blocks_needed(r.num_computed_tokens + self._work(r), self.block_size) - len(r.block_table))

    def _frees(self, r: Sequence, holders: dict[int, int]) -> set[int]:
        # the blocks r's preemption frees, victims `holders` (block -> how many of them hold it) chosen
        # already: a block another running sequence also holds (a shared prefix) frees nothing
        return {b for b in r.block_table if holders.get(b, 0) + 1 == self.allocator.ref_count(b)}

    def _work(self, r: Sequence) -> int:  # chunked: the budget r takes before any admission (a decode, or its
        # prompt's rest as far as the policy lets it have it this step)
        if r.is_decode:  # none when its in-flight token is its last by length: schedule_decodes skips it
            return int(len(r.output_token_ids) + r.num_output_placeholders < r.params.max_tokens)
        return self.sched.prefill_chunk(r.num_tokens + r.num_output_placeholders - r.num_computed_tokens,
                                        float("inf"), self.policy.prompt_room(r, self.out.scheduled))

    def _tally(self, seq: Sequence, chosen: list[Sequence]) -> tuple[int, int, int, dict, set[int], set[int], int, int]:
        """The room seq finds once `chosen` go, the admissions planned so far counted: (slots,
        blocks, budget, holders, the blocks they free, the cached blocks seq keeps, its first
        chunk, the blocks it needs)."""
        s_, b_, t_, h_, freed = self.slots + len(chosen), self.blocks, self.budget, dict(self.holders), set()
        for r in chosen:
            freed |= self._frees(r, h_)
            for b in r.block_table:
                h_[b] = h_.get(b, 0) + 1
            b_ += self._growth(r)
            t_ += self._work(r) if self.chunked else 0
        # Its first chunk is what the budget leaves once the others' decodes and prompt
        # chunks are in (the victims' are not: choosing one may give it a chunk at all),
        # and its blocks follow from that chunk.
        cached, n, num_new_blocks = self.sched.admission_need(seq, self.out, budget=t_)
        # A cached block that only a victim holds joins the free queue when the victim goes,
        # and this admission takes it back out: it frees nothing for seq, which revives it.
        kept = set(cached)
        b_ += len(freed - kept - self.taken)
        need = num_new_blocks + sum(1 for b in kept - self.taken
                                    if b in self.gone or self.allocator.ref_count(b) == 0)
        return s_, b_, t_, h_, freed, kept, n, need

    def _walk(self, spared: set[int]) -> tuple[list[Sequence], list[Sequence]]:
        """The admissions planned in queue order and their victims, none of them in spared (ids)."""
        policy, chunked = self.policy, self.chunked
        seated = list(self.running)
        self.slots = self.free_slots
        self.blocks = self.allocator.num_free - sum(self._growth(r) for r in seated)
        self.budget = self.step_budget - (sum(self._work(r) for r in seated) if chunked else 0)
        admitted: list[Sequence] = []
        victims: list[Sequence] = []
        self.gone = set()  # the blocks only the victims chosen so far hold
        self.taken = set()  # cached blocks an admission planned so far takes back (later ones share them)
        self.holders = {}  # per block, how many of the victims chosen so far hold it
        for seq in self.sched.waiting:
            if victims and any(policy.key(v) < policy.key(seq) for v in victims):
                break  # a victim is requeued ahead of it: admit stops there first, the room gone to others
            room = policy.prompt_room(seq, self.out.scheduled) if chunked else float("inf")
            if room == 0:
                continue  # held back this step (its room only shrinks as the step fills): admit walks past it
            if room != float("inf"):
                break  # capped: admit tries it first, with a room known only once the step's prompt work is in
            lower = [r for r in seated if id(r) not in spared and policy.outranks(seq, r)]
            chosen: list[Sequence] = []
            while True:
                s_, b_, t_, h_, freed, kept, n, need = self._tally(seq, chosen)
                if (s_ >= 1 and b_ >= need) or not lower:
                    break
                r = policy.victim(lower)  # the lowest ranked first
                lower.remove(r)
                chosen.append(r)
            if not 0 < n <= t_:
                break  # the token budget holds it back, not a seat or blocks
            if s_ < 1 or b_ < need:
                break
            # Only the victims the admission needs: a later, larger victim may free enough
            # alone, and the earlier ones would be preempted for nothing. The highest ranked
            # is tried first, so a lower ranked one goes where either would do.
            for r in chosen[::-1]:
                fewer = [c for c in chosen if c is not r]
                s_, b_, t_, *_, n, need = self._tally(seq, fewer)
                if s_ >= 1 and b_ >= need and 0 < n <= t_:
                    chosen = fewer
            s_, b_, t_, h_, freed, kept, n, need = self._tally(seq, chosen)
            for r in chosen:
                seated.remove(r)
            self.gone |= freed - kept  # the admission takes what it keeps back
            self.holders = h_
            self.taken |= kept
            victims += chosen
            admitted.append(seq)
            self.slots, self.blocks, self.budget = s_ - 1, b_ - need, t_ - n
        return admitted, victims
