"""Scheduling decisions: one small class each, one registration each.

The Scheduler (scheduler.py) owns the mechanics every decision shares: slots, KV blocks,
the token budget, chunked prefill, preemption by recompute, the invariants. What differs
between schedulers is asked of three objects, each chosen by one config field and found
in one registry here (EngineConfig validates the field against it, so a registered name
is a valid flag value with no edit anywhere else):

  POLICIES      --scheduling-policy (vLLM's flag): the waiting queue's order, the KV
                victim, whether a waiting request may preempt a running one, and whether
                requests carry a priority or an SLO.
  BATCHING      --scheduling: how a step is composed from the scheduler's mechanics
                (continuous: every step; static: a batch boards only when nothing runs)
                and when a finished sequence gives up its seat.
  KV_ADMISSION  --kv-admission: how many KV blocks a sequence holds from admission
                (on-demand: as tokens arrive; the reserve modes: its whole lifetime).

Adding one is a class and its decorator (docs/ARCHITECTURE.md, "Adding a scheduling
policy"); tests/test_recipes.py follows that recipe literally.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterable, Iterator, TypeVar

if TYPE_CHECKING:
    from config import EngineConfig
    from scheduler import Scheduler
    from scheduler_output import ScheduledSeq, SchedulerOutput
    from sequence import Sequence

T = TypeVar("T")


class Registry(dict, Generic[T]):
    """name -> class for one EngineConfig field or server flag; `register` is the one place
    a name is written. Every such field is validated (`check`) and offered as a flag's
    choices (`choices`) from its registry, by config.py and cli_args.py alike."""

    def __init__(self, field: str, also: tuple[str | None, ...] = ()) -> None:
        """also: the field's values that are not registered names (None: unset; `auto`: a choice among them)."""
        super().__init__()
        self.field = field
        self.also = also

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def add(cls: type[T]) -> type[T]:
            assert name not in self, f"{self.field} {name!r} is registered twice"
            cls.name = name
            self[name] = cls
            return cls
        return add

    @property
    def default(self) -> str:
        """The first registered name: the field's default."""
        return next(iter(self))

    @property
    def choices(self) -> list[str]:
        """The names a flag takes: `also`'s, then every registered one."""
        return [*(a for a in self.also if a is not None), *self]

    def check(self, name: object) -> None:
        """A ValueError naming the choices, unless `name` is one (or one of `also`)."""
        if name not in self.also and name not in self:
            *rest, last = self.choices
            choices = f"{', '.join(rest)} or {last}" if rest else last
            raise ValueError(f"{self.field} must be {choices}, got {name!r}")

    def names_where(self, declares: Callable[[type[T]], bool]) -> str:
        """The registered names whose class declares something ("priority or fair"), as a
        message that points the user at them says it."""
        return " or ".join(name for name, cls in self.items() if declares(cls))

    def create(self, config: EngineConfig) -> T:
        return self[getattr(config, self.field)]()


# ---- the waiting queue -------------------------------------------------------------------

# Each queue counts its requests whose place no caller reserved (num_unreserved; Sequence.
# place_reserved): what a limit on waiting requests counts besides the places reserved
# (AsyncEngine). One int, updated after each change, so another thread reads it whole.
#
# And it keeps what its requests wait for (a wait reason, metrics.wait_reasons()). A
# schedule() walks the queue from its head and stops at the first request that cannot
# board: that one and every request behind it wait for the same reason. So the queue holds
# that reason once (`_tail_reason`), and a reason of their own only for the requests that
# differ (`_own`): those the walk held back ("policy"), a preempted one ("kv_blocks"), and
# those no schedule() has looked at since they joined (None). A step then costs what it
# walks, not the queue's length: an offline batch of 100,000 prompts waits in one queue.

class WaitingQueue:
    """A waiting queue: its requests in `_seqs`, in the order they are to be admitted. The
    four changes are each subclass's own, and each tells `_joined` or `_left`, which keep
    num_unreserved and the wait reasons; no container method is inherited that would
    change `_seqs` behind them."""

    _seqs: deque[Sequence] | list[Sequence]

    def __init__(self) -> None:
        self.num_unreserved = 0
        self._tail_reason: str | None = None
        self._own: dict[int, str | None] = {}  # id(seq) -> its own reason, for the waiting ones that have one

    def add(self, seq: Sequence) -> None:
        """A new arrival."""
        raise NotImplementedError

    def requeue(self, seq: Sequence, reason: str | None = None) -> None:
        """A preempted (or rerun) sequence, back in the queue, waiting for `reason`."""
        raise NotImplementedError

    def pop_head(self) -> Sequence:
        raise NotImplementedError

    def remove(self, seq: Sequence) -> None:
        raise NotImplementedError

    def _joined(self, seq: Sequence, reason: str | None) -> None:
        self.num_unreserved += not seq.place_reserved
        self._own[id(seq)] = reason

    def _left(self, seq: Sequence) -> None:
        self.num_unreserved -= not seq.place_reserved
        self._own.pop(id(seq), None)

    # ---- wait reasons ----
    def wait_all(self, reason: str | None, held: Iterable[Sequence] = ()) -> None:
        """After a schedule(): every waiting request waits for `reason`, except those in
        `held`, which the policy holds back ("policy")."""
        self._tail_reason = reason
        self._own = {id(seq): "policy" for seq in held}

    def reason_of(self, seq: Sequence) -> str | None:
        """What the waiting `seq` waits for (None: no schedule() has looked at it yet)."""
        return self._own.get(id(seq), self._tail_reason)

    def count_reasons(self, counts: dict[str, int]) -> dict[str, int]:
        """Adds each reason's number of waiting requests to `counts`; O(own reasons)."""
        for reason in self._own.values():
            if reason is not None:
                counts[reason] += 1
        if self._tail_reason is not None:
            counts[self._tail_reason] += len(self._seqs) - len(self._own)
        return counts

    def check_invariants(self) -> None:
        assert self.num_unreserved == sum(not s.place_reserved for s in self._seqs), "waiting miscounted"
        assert self._own.keys() <= {id(s) for s in self._seqs}, "a wait reason kept for a request not waiting"

    def peek(self) -> Sequence:
        return self._seqs[0]

    def __getitem__(self, i: int) -> Sequence:
        return self._seqs[i]

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)


class FCFSQueue(WaitingQueue):
    """Arrival order; a preempted sequence goes back to the front (vLLM's FCFS)."""

    def __init__(self) -> None:
        super().__init__()
        self._seqs: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._seqs.append(seq)
        self._joined(seq, None)

    def requeue(self, seq: Sequence, reason: str | None = None) -> None:
        self._seqs.appendleft(seq)
        self._joined(seq, reason)

    def pop_head(self) -> Sequence:
        seq = self._seqs.popleft()
        self._left(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)
        self._left(seq)


class SortedQueue(WaitingQueue):
    """Kept sorted by a policy's key; a preempted sequence goes back to the place its key
    gives it, not to the front (it would jump a request that outranks it) nor to the back
    (behind later ones). A key must not change while its request waits."""

    def __init__(self, key: Callable[[Sequence], Any]) -> None:
        super().__init__()
        self._key = key
        self._keys: list[Any] = []
        self._seqs: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self._insert(seq, None)

    def requeue(self, seq: Sequence, reason: str | None = None) -> None:
        self._insert(seq, reason)

    def _insert(self, seq: Sequence, reason: str | None) -> None:
        k = self._key(seq)
        i = bisect.bisect_right(self._keys, k)
        self._keys.insert(i, k)
        self._seqs.insert(i, seq)
        self._joined(seq, reason)

    def pop_head(self) -> Sequence:
        self._keys.pop(0)
        seq = self._seqs.pop(0)
        self._left(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        i = self._seqs.index(seq)
        del self._keys[i], self._seqs[i]
        self._left(seq)


class ResortedQueue(SortedQueue):
    """Sorted by a key that moves while its requests wait (service received, deadlines
    passing): the policy resorts it once as each step begins (`begin_step`), so one step
    sees one order and pays one sort, O(waiting log waiting); within the step the keys
    hold still, and an arrival or a requeue is inserted in its place as in SortedQueue."""

    def __init__(self, key: Callable[[Sequence], Any], on_arrival: Callable[[Sequence], None] | None = None) -> None:
        """on_arrival(seq): told of each new request before it is queued (not of a requeue)."""
        super().__init__(key)
        self._on_arrival = on_arrival

    def add(self, seq: Sequence) -> None:
        if self._on_arrival is not None:
            self._on_arrival(seq)
        super().add(seq)

    def resort(self) -> None:
        keyed = sorted(zip(map(self._key, self._seqs), self._seqs), key=lambda p: p[0])
        self._keys, self._seqs = [k for k, _ in keyed], [s for _, s in keyed]


# ---- policies: --scheduling-policy -------------------------------------------------------

POLICIES: Registry[FCFS] = Registry("scheduling_policy")


@POLICIES.register("fcfs")
class FCFS:
    """First come, first served (vLLM's default): arrival order; the KV victim is the
    latest admitted; a waiting request never preempts a running one."""

    name: str
    uses_priority = False  # requests may carry a `priority` only under a policy that reads it
    uses_slo = False  # requests may carry an `slo` only under a policy that reads it
    orders_prompts = False  # True: the step's prompt chunks go by `key`, not by admission
    # True: a prompt chunk short of a block may take it from a decode already in the step (its
    # row taken back). vLLM steps through its running requests in admission order, decodes and
    # chunks alike, so its victim (the latest admitted) is never in the step before it; here
    # decodes go first, and one of them may be that victim.
    victim_in_step = True
    # The policy's clock, the one arrival times are read on (the simulator sets its own).
    clock: Callable[[], float] = staticmethod(time.monotonic)

    @staticmethod
    def key(seq: Sequence) -> Any:
        """The rank, lower first, by which the scheduler orders prompt chunks (under
        orders_prompts) and compares a victim with a waiting request: here arrival order,
        the queue's (which also puts a preempted request back at the front)."""
        return seq.arrival_order

    def new_queue(self) -> WaitingQueue:
        return FCFSQueue()

    def begin_step(self, running: list[Sequence]) -> None:
        """Called as each step's scheduling starts, with the running sequences (a policy
        whose order moves reads the time or the seats here and resorts its queue, so one
        step sees one instant and one order)."""

    def charge(self, out: SchedulerOutput) -> None:
        """Called with each step as scheduled (a policy that accounts for service does it here)."""

    def refund(self, s: ScheduledSeq) -> None:
        """Called for a row of a charged step that ran nowhere (its request failed alone, or
        computes it again: Scheduler.ran_nowhere; or had ended meanwhile: ran_nowhere_ended),
        before its sequence changes: it was no service (a policy that accounts for service
        takes back what charge gave it)."""

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """candidates: the running sequences not yet scheduled this step, admission order
        (the one asking for blocks among them)."""
        return max(candidates, key=lambda s: s.admitted_seq_no)

    def step_order(self, running: list[Sequence]) -> list[Sequence]:
        """The order the running sequences get their tokens (and KV blocks) in each step. One
        short of a block preempts the victim among those not yet in the step, so the order
        puts the victims last: here admission order, the victim being the latest admitted."""
        return list(running)

    def outranks(self, waiting: Sequence, running: Sequence) -> bool:
        """May `waiting` preempt `running` for its seat or its blocks?"""
        return False

    def prompt_room(self, seq: Sequence, scheduled: list[ScheduledSeq]) -> float:
        """The most prompt tokens (chunks, recomputes) seq may get in this step, its step so
        far being `scheduled` (chunked prefill only; without chunking a prompt is whole)."""
        return float("inf")


class Ranked(FCFS):
    """A policy that orders requests by `key` (lower first): the queue is sorted by it,
    the KV victim is the lowest ranked, and a waiting request that ranks higher than
    running ones may preempt them when slots or KV blocks are full."""

    @staticmethod
    def key(seq: Sequence) -> Any:
        """The rank: lower runs first. Must not change while its request waits."""
        raise NotImplementedError

    def new_queue(self) -> SortedQueue:
        return SortedQueue(self.key)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return max(candidates, key=self.key)

    def step_order(self, running: list[Sequence]) -> list[Sequence]:
        # Rank order, so the lowest ranked running sequence is the victim even when it was
        # admitted first (vLLM's victim: the max over every running request, in the step or not).
        return sorted(running, key=self.key)

    def outranks(self, waiting: Sequence, running: Sequence) -> bool:
        return self.key(waiting) < self.key(running)


@POLICIES.register("priority")
class Priority(Ranked):
    """vLLM's --scheduling-policy priority: lower `priority` first, ties by arrival; may
    preempt lower-priority running requests."""

    uses_priority = True

    @staticmethod
    def key(seq: Sequence) -> tuple[int, float, int]:
        return (seq.priority, seq.arrival_time, seq.arrival_order)


ANONYMOUS = "anonymous"  # the fair policy's client for requests without a `user`, and for overflow


@POLICIES.register("fair")
class Fair(FCFS):
    """Fair share between clients by a virtual token counter (VTC; Sheng et al., "Fairness
    in Serving Large Language Models", OSDI 2024). A client (the request's OpenAI `user`;
    none: one shared "anonymous" client) is charged `prompt_weight` per prompt token
    computed for it (a recompute after a preemption is not charged) and `output_weight` per
    output token, as each step is scheduled. The waiting request of the least-served client
    goes first; at equal service, the client holding fewer seats (it will be served less
    from now on), then arrival. A client that starts waiting again is lifted to the least
    counter of the clients already waiting, so idle time banks no credit.

    A waiting request preempts a running one (for its seat or blocks) in two cases:
    - seat share: it heads the queue (the least-served client's), its client was served no
      more than the running one's and holds at least two seats fewer (counted as the step
      began). This keeps an interactive client's first token one step away while another
      floods every seat. One request a step qualifies, and it takes seats only from clients
      holding two or more than its own, which lowers the sum over clients of seats squared
      (a client of a seats taking one from one of b >= a + 2: by 2(b - a - 1) or more), so
      such preemptions cannot cycle: between two of them a seat must be freed by progress;
    - service gap: its client was served more than `preempt_gap` weighted tokens less. A
      recompute is not charged, so each such preemption is paid for by that much new service
      in between: every request progresses and finishes.
    At most `max_clients` clients are tracked: the least recently active is forgotten, and
    comes back like a new one: at the least counter tracked, lifted as above (so a client
    that sprays new names ties with the least-served client, never overtakes it).

    Prefill share (chunked prefill): the order decides who is seated, but a step is shared,
    and an under-served client's first token waits for the step in flight and then for its
    own step, both lengthened by whatever prompt work they carry. So the step's prompt
    chunks go least-served client first, and an *over-served* client, one holding at least
    two seats more than an active client holding the fewest (active: with a request in the
    system now or within the last `active_window_s` of the policy's clock; seats as the
    step began), gets at most `over_served_prefill` prompt tokens a step (admissions,
    chunks and recomputes together) while a client it is over (not over-served itself) has
    a request in the system. The cap is work-conserving: it is never 0 at a step's start,
    so an over-served client's seated prompt work advances min(cap, what is left of it)
    tokens a step whenever the budget left after the chunks sorted ahead of it allows,
    whatever arrives, and its prompts finish; an admission the cap holds back waits
    (reason "policy") without blocking the requests behind it. A client idle between
    requests holds no request, so it costs the others nothing; the price is that a flood's
    step in flight when such a client's next request arrives is uncapped. Seats, not counters, decide who is over-served because the
    counters of competing clients stay within a step's service of each other (the lift
    above), while seats show who holds the batch.
    With one active client, or clients holding about equal seats, no step is capped."""

    prompt_weight, output_weight = 1.0, 2.0  # the paper's: an output token costs about two prompt tokens
    preempt_gap = 1024.0
    max_clients = 1024
    orders_prompts = True
    victim_in_step = False  # its victim is among the rows not yet in the step
    over_served_prefill = 16  # tokens a step: about the prompt work a flood of long requests needs per step
    active_window_s = 1.0

    def __init__(self) -> None:
        self.counters: OrderedDict[str, float] = OrderedDict()  # least recently active first
        self.seats: dict[str, int] = {}  # running sequences per client, as this step began
        self._head: Sequence | None = None  # the waiting queue's head as this step began
        self.queue: ResortedQueue | None = None
        self.last_active: dict[str, float] = {}  # client -> when it last had a request in the system
        self.over_served: set[str] = set()  # clients whose prompt work is capped this step

    def new_queue(self) -> ResortedQueue:
        self.queue = ResortedQueue(self.key, on_arrival=self._arrive)
        return self.queue

    @staticmethod
    def client(seq: Sequence) -> str:
        return seq.user or ANONYMOUS

    def counter(self, client: str) -> float:
        return self.counters.get(client, 0.0)

    def key(self, seq: Sequence) -> tuple[float, int, float, int]:
        client = seq.user or ANONYMOUS
        c = self.counters.get(client)
        if c is None:  # forgotten while its request was in the system: as a new client
            c = min(self.counters.values(), default=0.0)
        return (c, self.seats.get(client, 0), seq.arrival_time, seq.arrival_order)

    def begin_step(self, running: list[Sequence]) -> None:
        seats: dict[str, int] = {}
        for seq in running:
            c = self.client(seq)
            seats[c] = seats.get(c, 0) + 1
        self.seats = seats
        self.queue.resort()
        self._head = self.queue.peek() if self.queue else None
        now, last = self.clock(), self.last_active
        present = {*seats, *map(self.client, self.queue)}  # clients with a request in the system
        for c in present:
            last[c] = now
        for c in [c for c, t in last.items() if now - t > self.active_window_s or c not in self.counters]:
            del last[c]  # idle too long (or forgotten): banks no claim on the others' prefill
        fewest = min((seats.get(c, 0) for c in last), default=0)
        over = {c for c in last if seats.get(c, 0) >= fewest + 2}
        # The cap binds only while a client it protects has a request in the system: a
        # client idle between requests costs the others nothing (the window only says who
        # counts as competing, so a brief gap does not hand the batch to the flood).
        self.over_served = over if present - over else set()

    def prompt_room(self, seq: Sequence, scheduled: list[ScheduledSeq]) -> float:
        c = self.client(seq)
        if c not in self.over_served:
            return float("inf")
        used = sum(s.num_new_tokens for s in scheduled if not s.is_decode and self.client(s.seq) == c)
        return max(0, self.over_served_prefill - used)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """The most-served client's sequence (then the one holding more seats) with the least
        computed: the least work lost or moved."""
        return max(candidates, key=lambda s: (self.key(s)[:2], -s.num_computed_tokens, s.arrival_order))

    def outranks(self, waiting: Sequence, running: Sequence) -> bool:
        w, r = self.key(waiting), self.key(running)
        return w[0] + self.preempt_gap < r[0] or (waiting is self._head and w[0] <= r[0] and w[1] + 2 <= r[1])

    def charge(self, out: SchedulerOutput) -> None:
        counters = self.counters
        for s in out.scheduled:
            counters[self._track(self.client(s.seq))] += self._cost(s)

    def refund(self, s: ScheduledSeq) -> None:
        c = self.client(s.seq)
        if c in self.counters:  # (else forgotten since: nothing to take back)
            self.counters[c] -= self._cost(s)

    def _cost(self, s: ScheduledSeq) -> float:
        """What a row is charged: from the row alone, so its refund is exactly its charge.
        A recompute is not charged: each preemption is then paid for by new work."""
        if s.is_decode:
            return self.output_weight * s.samples
        return self.prompt_weight * (s.num_new_tokens - s.num_recomputed) + self.output_weight * s.samples

    def _arrive(self, seq: Sequence) -> None:
        c = self.client(seq)
        waiting = {self.client(q) for q in self.queue}
        if c not in waiting:
            floor = min((self.counter(w) for w in waiting), default=self.counter(c))
            self._track(c)
            self.counters[c] = max(self.counters[c], floor)
        else:
            self._track(c)

    def _track(self, client: str) -> str:
        """client, counted as just active; forgets the least recently active when full."""
        if client in self.counters:
            self.counters.move_to_end(client)
        else:
            if len(self.counters) >= self.max_clients:
                self.counters.popitem(last=False)
            self.counters[client] = min(self.counters.values(), default=0.0)
        return client


@POLICIES.register("slo")
class SLOAware(FCFS):
    """Goodput first: the most requests meeting their SLO (first token within slo.ttft_ms
    of arrival, then one token per slo.tpot_ms on average; server-wide defaults
    --slo-ttft-ms/--slo-tpot-ms; no target: never urgent). A request is *lost* once it
    missed its first-token target (its first token came late, or it has none and the
    deadline has passed): nothing it gets can save its SLO. The rule: lost requests rank
    below every request that can still make it, so they never take a seat, a chunk of the
    budget or KV blocks another needs; among themselves they keep arrival order (by
    deadline), and run on whatever capacity the others leave, so they still finish. Others
    go earliest deadline first: the first token's (arrival + ttft) while it has none, then
    the next token's (+ tpot per output token), for admission and for the step's prompt
    chunks. The KV victim is the lowest ranked (lost first, then the most slack); a
    waiting request that can still make it preempts a lost running one for its seat or
    blocks. A lost request never preempts, and preempting one makes no request lost, so it
    cannot cycle."""

    uses_slo = True
    orders_prompts = True
    victim_in_step = False  # its victim is among the rows not yet in the step

    def __init__(self) -> None:
        self.now = self.clock()
        self.queue: ResortedQueue | None = None

    def begin_step(self, running: list[Sequence]) -> None:
        self.now = self.clock()
        self.queue.resort()

    def new_queue(self) -> ResortedQueue:
        self.queue = ResortedQueue(self.key)
        return self.queue

    def lost(self, seq: Sequence) -> bool:
        if seq.slo_ttft is None:
            return False
        due = seq.arrival_time + seq.slo_ttft
        if seq.output_token_ids or seq.num_output_placeholders:
            return seq.first_token_time is not None and seq.first_token_time > due
        return self.now > due

    def key(self, seq: Sequence) -> tuple[bool, float, float, int]:
        n = len(seq.output_token_ids)
        if n == 0:
            deadline = seq.arrival_time + seq.slo_ttft if seq.slo_ttft is not None else float("inf")
        elif seq.slo_tpot is None:
            deadline = float("inf")
        else:
            deadline = seq.arrival_time + (seq.slo_ttft or 0.0) + seq.slo_tpot * n
        return (self.lost(seq), deadline, seq.arrival_time, seq.arrival_order)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return max(candidates, key=self.key)

    def outranks(self, waiting: Sequence, running: Sequence) -> bool:
        return not self.lost(waiting) and self.lost(running)


# ---- batching: --scheduling ----------------------------------------------------------------

BATCHING: Registry[Continuous] = Registry("scheduling")


@BATCHING.register("continuous")
class Continuous:
    """Iteration-level: every step, decodes first, then prompt chunks, then admissions
    while a slot, the token budget and KV blocks allow; a finished sequence leaves in the
    update() of its last token, so a queued request joins the next step."""

    name: str
    # What a request waits for that only this batching makes it wait for (None: nothing):
    # a label of metrics' num_requests_waiting_by_wait_reason beside the scheduler's own reasons.
    wait_reason: str | None = None
    may_preempt = True  # whether a running request may go back to the queue (Scheduler.preempt_running)

    def schedule(self, s: Scheduler, out: SchedulerOutput) -> None:
        s.preempt_for_waiting(out)
        if s.config.enable_chunked_prefill:
            # Decodes first, so a long prompt joining costs streaming users no stutter.
            s.schedule_prompts(out, s.schedule_decodes(out))
            s.admit(out)
        else:
            # vLLM v0: a step that admits prompts runs only those prompts; the running
            # sequences' decodes stall for that step (the stutter chunking removes).
            s.admit(out)
            if not out.scheduled:
                s.schedule_decodes(out)
                if s.room_preempted:
                    # A decode preempted for blocks after admission found the seats full: a
                    # seat is free now, and KV room is what every waiting request lacks.
                    s.waiting.wait_all("kv_blocks")

    def release(self, s: Scheduler, finished: list[Sequence]) -> list[Sequence]:
        """Sequences that finished this step -> those that leave now (slot and blocks freed)."""
        for seq in finished:
            s.retire(seq)
        return finished


@BATCHING.register("static")
class Static:
    """The naive baseline (a bus leaves when its last passenger is on board): a batch
    boards only when nothing runs, prefills, then decodes; finished sequences keep their
    seats as padding (the decode step computes them) until the whole batch is done.
    Never preempts for boarding: the bus does not stop mid-route."""

    name: str
    wait_reason = "static_batch"  # a request waiting while a batch runs waits for the bus
    may_preempt = False

    def schedule(self, s: Scheduler, out: SchedulerOutput) -> None:
        if not s.running:
            s.admit(out, schedule=False)  # (which schedules the boarded prompts the budget takes)
        else:
            s.waiting.wait_all(self.wait_reason)
        # Everyone boards before it leaves: no decode until every prompt is in.
        if out.scheduled or any(not seq.finished and not seq.is_decode for seq in s.running):
            s.schedule_prompts(out)
        else:
            s.schedule_decodes(out)
        out.num_occupied = len(s.running)

    def release(self, s: Scheduler, finished: list[Sequence]) -> list[Sequence]:
        if not s.running or not all(seq.finished for seq in s.running):
            return []
        batch = list(s.running)  # the bus arrives: everyone gets off at once
        for seq in batch:
            s.retire(seq)
        return batch


# ---- KV admission: --kv-admission ----------------------------------------------------------

KV_ADMISSION: Registry[OnDemand] = Registry("kv_admission")


@KV_ADMISSION.register("on-demand")
class OnDemand:
    """vLLM: blocks are allocated as tokens are computed; when they run out, the policy's
    victim is preempted by recompute."""

    name: str
    preempts = True
    summary = "blocks grow as tokens arrive, shorter sequences fit more"

    def lifetime_tokens(self, num_prompt_tokens: int, max_tokens: int, config: EngineConfig) -> int:
        """The most tokens a request can ever write to the cache. The last sampled token is
        never computed (the sequence ends on it), so a 16-token prompt with max_tokens 1 at
        block size 16 needs one block, not two."""
        return num_prompt_tokens + max_tokens - 1

    def tokens_at_admission(self, seq: Sequence, num_tokens: int, config: EngineConfig) -> int:
        """Tokens whose blocks seq holds from admission, given it computes its first
        num_tokens (cached + its first step's) then."""
        return num_tokens

    def max_concurrency(self, config: EngineConfig, num_usable_blocks: int) -> float:
        """max_model_len sequences the cache holds at once (the start-up line)."""
        return num_usable_blocks * config.block_size / config.max_model_len


@KV_ADMISSION.register("reserve")
class Reserve(OnDemand):
    """TGI: prompt + max_tokens allocated at admission; never preempts."""

    preempts = False
    summary = "prompt + max_tokens reserved, shorter sequences fit more"

    def tokens_at_admission(self, seq: Sequence, num_tokens: int, config: EngineConfig) -> int:
        return self.lifetime_tokens(seq.num_prompt_tokens, seq.params.max_tokens, config)


@KV_ADMISSION.register("reserve-max-len")
class ReserveMaxLen(Reserve):
    """Contiguous slots: every request holds max_model_len worth of blocks."""

    summary = "every request reserves max_model_len worth of blocks"

    def lifetime_tokens(self, num_prompt_tokens: int, max_tokens: int, config: EngineConfig) -> int:
        return config.max_model_len - 1

    def max_concurrency(self, config: EngineConfig, num_usable_blocks: int) -> float:
        return num_usable_blocks // config.max_blocks_per_seq


REGISTRIES = (POLICIES, BATCHING, KV_ADMISSION)
