"""What the scheduler decides for one step and what it made of the step's results (vLLM's
v1/core/sched/output.py): SchedulerOutput, the step the runner executes, one ScheduledSeq per
sequence that computes tokens in it; StepOutcome, what Scheduler.update() returns. The
runner and the engine read these, never the Scheduler's own state. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sequence import Sequence


@dataclass(slots=True)  # one per scheduled sequence per step: slots make it cheap to build
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # positions seq.num_computed_tokens - num_new_tokens .. seq.num_computed_tokens - 1
    samples: bool  # a token comes out: a decode, or the chunk that completes the prompt
    is_decode: bool  # a decode step of a sequence past its prompt (one token, or one + its drafts)
    # Speculative decoding: the number of drafts computed after its latest token
    # (num_new_tokens is 1 + it; from schedule() to take_proposals(), the room reserved for
    # a proposer that drafts after scheduling), the drafts once known, and its row in the
    # step's Proposals.draft_probs.
    num_spec_tokens: int = 0
    spec_token_ids: list[int] | tuple[()] = ()
    spec_src: int = 0
    num_recomputed: int = 0  # of num_new_tokens, computed before a preemption dropped them


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prompt chunks
    preempted: list[Sequence] = field(default_factory=list)
    preempted_tokens: list[int] = field(default_factory=list)  # per preempted: computed tokens it lost or moved
    preempted_swapped: list[bool] = field(default_factory=list)  # per preempted: moved to the host pool
    # KV copies the runner makes before the step: (device blocks, host blocks) each.
    swap_out: list[tuple[list[int], list[int]]] = field(default_factory=list)
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)
    num_swap_fallbacks: int = 0  # preemptions under swap that recomputed: the host pool was full
    num_prefill_tokens: int = 0
    num_recomputed_tokens: int = 0  # of num_prefill_tokens, computed before a preemption dropped them
    num_decode_tokens: int = 0
    # Rows a decode step computes at least: a batching that keeps finished sequences
    # seated (static) computes their seats too.
    num_occupied: int = 0
    num_spec_tokens: int = 0  # draft tokens verified (besides the decode tokens)
    draft_probs: Any = None  # the proposer's draft distributions (spec_decode.Proposals), on the device

    @property
    def is_decode_only(self) -> bool:
        return self.num_prefill_tokens == 0 and self.num_spec_tokens == 0

    def restricted_to(self, rows: list[ScheduledSeq]) -> SchedulerOutput:
        """This step as if only `rows` (some of its scheduled rows, in order) had been
        scheduled: its token counts summed over them; its preemptions, swaps and draft
        distributions kept."""
        num_decode = sum(1 for s in rows if s.is_decode)
        num_spec = sum(s.num_spec_tokens for s in rows)
        return replace(self, scheduled=rows, num_decode_tokens=num_decode, num_spec_tokens=num_spec,
                       num_prefill_tokens=sum(s.num_new_tokens for s in rows) - num_decode - num_spec,
                       num_recomputed_tokens=sum(s.num_recomputed for s in rows))


@dataclass(slots=True)
class StepOutcome:
    """What update() made of one step."""

    accepted: dict[str, int]  # the tokens kept, by request id (a verified row's: its last)
    finished: list[Sequence]  # the sequences released this step, their results complete
    # Rows whose sequence ended (aborted, or finished by an earlier step's token under
    # async scheduling) before this step came back: their work is seen by nobody.
    discarded: list[ScheduledSeq]
    emitted: dict[str, list[int]]  # verified rows: every token kept, by request id
