"""A request as the scheduler and the engine track it (vLLM's Request, nano-vllm's
Sequence): its prompt and output tokens, the outputs still in flight, its slot and block
table, how many of its tokens are computed, why it waits, and what the engine hangs on it
(matchers, timings, speculation counters). Pure Python, as the scheduler that imports it.
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from metrics import ParentRequest
from sampling_params import SamplingParams

class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


WAITING, RUNNING, FINISHED = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED
MAX_USER_CHARS = 128  # a longer `user` is kept as its SHA-256 (Sequence.__post_init__)


class DuplicateRequestError(ValueError):
    """A request's id names one still in flight. Raised where each map of requests by id
    is kept: the scheduler's (every request not yet released) and AsyncEngine's (every
    stream not yet ended, checked on the caller's thread, which may not read the first)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in flight")


@dataclass(eq=False)  # identity semantics: one object per request, however its fields change
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)  # the sampled tokens the host has
    # Output tokens sampled by scheduled steps whose result has not come back (vLLM's
    # num_output_placeholders): 1 between schedule() and update() of a sampling step, 2
    # while async scheduling has scheduled the next one too.
    num_output_placeholders: int = 0
    status: SequenceStatus = WAITING
    slot: int | None = None
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache, or is computed by a scheduled step
    num_cached_tokens: int = -1  # prompt tokens the prefix cache served at first admission; -1: not admitted yet
    block_hashes: list[bytes] = field(default_factory=list)  # names of its full blocks so far (kvcache.py)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (vLLM's FinishReason)
    num_preemptions: int = 0
    # Positions below this were computed once: computing them again is the recompute tax
    # (set at each preemption from num_computed_tokens, read by _add).
    num_computed_high: int = 0
    num_recomputed_tokens: int = 0  # tokens computed again after a preemption (prefix-cache hits excluded)
    # Swapped out (--preemption-mode swap): (host blocks holding its K/V, tokens they hold).
    swapped: tuple[list[int], int] | None = None
    priority: int = 0  # read by a policy that declares uses_priority: lower runs first (vLLM's field)
    user: str | None = None  # the client (OpenAI's `user`), read by the fair policy
    cache_salt: str | None = None  # vLLM's: its blocks are shared only with requests of the same salt
    slo_ttft: float | None = None  # SLO targets in seconds, read by a policy that declares uses_slo
    slo_tpot: float | None = None
    arrival_order: int = -1  # set by Scheduler.add: breaks ties between equal arrival times
    admitted_seq_no: int = -1  # order of the latest admission: the highest is preempted first
    seed: int | None = None  # this request's sampling stream (set by the engine)
    # Structured outputs: the request's matcher (structured.Constraint, set by the engine),
    # advanced by update() with each output token; its state is the outputs, so a
    # preemption (which recomputes K/V, never outputs) leaves it as it is.
    constraint: Any = None
    # Stop strings: the request's matcher (tokenizer.IncrementalDetokenizer, set by the
    # engine), advanced by update() with each output token.
    stop_matcher: Any = None
    # vLLM's logits processors (logits_controls.LogitsControls, set by the engine): like a
    # constraint, the request samples once its previous token is known, and never speculates.
    controls: Any = None
    # Its constraint and controls together allow no token at the position the step in flight
    # samples (set by runner.sample): update() ends it there, and the token drawn is not output.
    no_token_allowed: bool = False
    # One of a request's n samples: their shared metrics.ParentRequest (set by the engine).
    parent: ParentRequest | None = None
    # Its place in the waiting queue is one its caller reserved (AsyncEngine.reserve_waiting):
    # a limit on waiting requests counts that place, not the request as well.
    place_reserved: bool = False
    # Filled by the engine.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    max_itl: float = 0.0  # the longest gap between two of its output tokens (seconds)
    finished_time: float | None = None
    # Speculative decoding (spec_decode.py): its verified proposals so far, and whether it
    # still speculates (SpeculativeConfig.min_acceptance_rate turns it off).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    speculates: bool = True
    # token_array()'s buffer and how many tokens it holds: filled as tokens arrive.
    _token_buf: np.ndarray | None = field(default=None, init=False, repr=False)
    _num_buffered: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        # The fair policy remembers up to max_clients names after their requests leave, and
        # a client picks its name's length: a long one is kept as its digest, equal for
        # equal names, so what each remembered name costs is bounded.
        if self.user is not None and len(self.user) > MAX_USER_CHARS:
            self.user = "sha256:" + hashlib.sha256(self.user.encode("utf-8", "surrogatepass")).hexdigest()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known to the host: the prompt and the outputs that came back."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_array(self) -> np.ndarray:
        """all_token_ids as an int32 array (a view of a buffer kept on the sequence): a
        read per step (ngram's lookup) copies only the tokens that arrived since the last,
        as outputs are only ever appended."""
        p, n, have, buf = len(self.prompt_token_ids), self.num_tokens, self._num_buffered, self._token_buf
        if buf is None:  # room for the longest it may get: prompt + max_tokens
            buf = self._token_buf = np.empty(p + self.params.max_tokens, np.int32)
            buf[:p], have = self.prompt_token_ids, p
        assert p <= have <= n <= len(buf) and (have == p or buf[have - 1] == self.output_token_ids[have - 1 - p]), \
            "outputs are only appended, up to max_tokens"
        buf[have:n] = self.output_token_ids[have - p:]
        self._num_buffered = n
        return buf[:n]

    @property
    def finished(self) -> bool:
        return self.status is FINISHED

    @property
    def num_cached_prompt_tokens(self) -> int:
        """Prompt tokens the prefix cache served (usage.prompt_tokens_details): 0 for a
        request never admitted (num_cached_tokens' -1)."""
        return max(self.num_cached_tokens, 0)

    @property
    def may_speculate(self) -> bool:
        """Its next tokens may be drafted and verified: it still speculates, and no
        constraint or logits control needs each previous token before it samples."""
        return self.speculates and self.constraint is None and self.controls is None

    @property
    def is_decode(self) -> bool:
        """Everything but the latest output token (known or in flight) is cached: the next
        step computes one token. After a preemption the prompt *and* the outputs are a
        prefill again."""
        num_out = len(self.output_token_ids) + self.num_output_placeholders
        return num_out > 0 and self.num_computed_tokens == len(self.prompt_token_ids) + num_out - 1
