"""Scheduling policies: the decisions that differ between schedulers, one small class each.

The Scheduler (scheduler.py) owns the mechanics every policy shares: slots, KV blocks,
the token budget, chunked prefill, preemption by recompute, the invariants. A policy
answers four questions and nothing else:

  new_queue()              the waiting queue: the order in which requests are admitted,
                           and where a preempted one goes back
  victim(candidates)       which running sequence gives up its blocks when KV runs out
  outranks(waiting, run)   may a waiting request preempt a running one for its seat or
                           its blocks? (FCFS: never; priority: when it ranks higher)
  boards_only_when_empty   the boarding rule: static batching admits a batch only when
                           nothing runs (and its seats stay taken until all of it is done)

Chosen by config: --scheduling-policy picks the class (fcfs | priority, vLLM's flag),
--scheduling static|continuous the boarding rule. Adding a policy is one class here and
one entry in POLICIES (docs/ARCHITECTURE.md, "Adding a scheduling policy").
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from config import EngineConfig
    from scheduler import Sequence


class FCFSQueue(deque):
    """Arrival order; a preempted sequence goes back to the front (vLLM's FCFS)."""

    def add(self, seq: Sequence) -> None:
        self.append(seq)

    def requeue(self, seq: Sequence) -> None:
        self.appendleft(seq)

    def peek(self) -> Sequence:
        return self[0]

    def pop_head(self) -> Sequence:
        return self.popleft()


class SortedQueue:
    """Kept sorted by a policy's key; a preempted sequence goes back to the place its key
    gives it, not to the front or the back (vLLM #41951: a preempted request must keep
    its place by priority and arrival)."""

    def __init__(self, key: Any) -> None:
        self._key = key
        self._keys: list[tuple] = []
        self._seqs: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        k = self._key(seq)
        i = bisect.bisect_right(self._keys, k)
        self._keys.insert(i, k)
        self._seqs.insert(i, seq)

    requeue = add

    def peek(self) -> Sequence:
        return self._seqs[0]

    def pop_head(self) -> Sequence:
        self._keys.pop(0)
        return self._seqs.pop(0)

    def remove(self, seq: Sequence) -> None:
        i = self._seqs.index(seq)
        del self._keys[i], self._seqs[i]

    def __getitem__(self, i: int) -> Sequence:
        return self._seqs[i]

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)


class FCFS:
    """First come, first served: vLLM's default. KV victim: the latest admitted."""

    def __init__(self, boards_only_when_empty: bool = False) -> None:
        self.boards_only_when_empty = boards_only_when_empty

    def new_queue(self) -> FCFSQueue | SortedQueue:
        return FCFSQueue()

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """candidates: the running sequences not yet scheduled this step, admission order
        (the one asking for blocks among them)."""
        return max(candidates, key=lambda s: s.admitted_seq_no)

    def outranks(self, waiting: Sequence, running: Sequence) -> bool:
        return False


class Priority(FCFS):
    """vLLM's --scheduling-policy priority: lower `priority` first, ties by arrival. The
    KV victim is the lowest ranked; a waiting request that outranks running ones may
    preempt them when slots or KV blocks are full."""

    @staticmethod
    def key(seq: Sequence) -> tuple[int, float, int]:
        return (seq.priority, seq.arrival_time, seq.arrival_order)

    def new_queue(self) -> SortedQueue:
        return SortedQueue(self.key)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return max(candidates, key=self.key)

    def outranks(self, waiting: Sequence, running: Sequence) -> bool:
        return self.key(waiting) < self.key(running)


POLICIES: dict[str, type[FCFS]] = {"fcfs": FCFS, "priority": Priority}


def make_policy(config: EngineConfig) -> FCFS:
    return POLICIES[config.scheduling_policy](boards_only_when_empty=config.scheduling == "static")
