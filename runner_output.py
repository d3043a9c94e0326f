"""What the model runner gives back for a step (vLLM's ModelRunnerOutput, v1/outputs.py):
InFlightStep, a dispatched step whose arrays are still being computed on the device, and
StepResult, the host copy of them that the engine reads. The engine sees these, never the
runner's inputs or programs (runner.py).

A step with constrained rows is dispatched in two parts: its forward first, its sample
program once every constrained row's matcher has its previous token (awaits_mask until
then), so the forward of step N+1 overlaps the host's work on step N's tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from sampler import SamplingTensors
    from sequence import Sequence

@dataclass
class StepResult:
    """What came back from the device for one step, in SchedulerOutput.scheduled order."""

    tokens: np.ndarray  # [n] i32
    # (logprob [n], rank [n], top ids [n, K], top logprobs [n, K]) of the sampled tokens, when asked
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None
    # Row i -> (first position, logprob [q], rank [q], top ids [q, K], top logprobs [q, K]) of
    # the prompt tokens after each of its q computed positions, for rows that asked.
    prompt_logprobs: dict[int, PromptLogprobs] | None = None
    # Speculative rows: row i -> (its emitted tokens, their logprobs ([n], [n], [n, K], [n, K]) when asked)
    spec: dict[int, tuple[list[int], tuple[np.ndarray, ...] | None]] | None = None


@dataclass
class PromptLogprobs:
    """For the prompt tokens at positions start+1 .. start+len: each one's logprob given
    the tokens before it, its rank in the vocabulary (1 = the most likely; vLLM's: the
    number of tokens at least as likely), and the top K."""

    start: int
    logprob: np.ndarray  # [q] f32
    rank: np.ndarray  # [q] i32
    top_ids: np.ndarray  # [q, K] i32
    top_logprobs: np.ndarray  # [q, K] f32


class InFlightStep:
    """A dispatched step: its outputs are device arrays still being computed. result()
    waits for them and copies them to the host (the only host<-device copy of a step).

    A step with constrained rows is dispatched in two parts: its forward by execute(),
    its sample program by ModelRunner.sample() once every constrained row's matcher has
    its previous token (awaits_mask until then)."""

    def __init__(self, forward: tuple[Any, ...], num_seqs: int, want_logprobs: bool,
                 prompt_rows: list[tuple[int, int, int, int]] | None,
                 sample_args: tuple[np.ndarray, SamplingTensors], constrained: list[tuple[Sequence, int]],
                 spec_rows: list[int] | None = None):
        """forward: the forward's outputs but the logits (the prompt logprob arrays, when
        asked); prompt_rows: (row, first flat token, first position, tokens) of the rows
        whose prompt logprobs this step computed; sample_args: (sample_slot, sampling,
        without a bitmask); constrained: (sequence, row) of the rows that sample under a
        constraint; spec_rows: the rows verified (by the forward), in their order."""
        self._forward, self.num_seqs, self.want_logprobs = forward, num_seqs, want_logprobs
        self.prompt_rows, self.sample_args, self.constrained = prompt_rows, sample_args, constrained
        self.spec_rows = spec_rows
        # The sample program's outputs (token ids, then the logprob arrays when asked), set
        # by ModelRunner.sample when it dispatches it; None until then.
        self.sampled: tuple[jax.Array, ...] | None = None

    @property
    def awaits_mask(self) -> bool:
        return self.sampled is None

    def block_until_ready(self) -> None:
        assert self.sampled is not None, "the step's sample program was never dispatched"
        jax.block_until_ready(self.sampled[0])

    def result(self) -> StepResult:
        assert self.sampled is not None, "the step's sample program was never dispatched"
        n = self.num_seqs
        tok, *lps = self.sampled
        logprobs = None
        if self.want_logprobs:
            logprobs = tuple(np.asarray(x)[:n] for x in lps)
        prompt = None
        if self.prompt_rows:
            arrays = [np.asarray(x) for x in self._forward[0]]
            prompt = {row: PromptLogprobs(pos, *(x[flat:flat + q] for x in arrays))
                      for row, flat, pos, q in self.prompt_rows}
        spec = None
        if self.spec_rows:
            toks, num, *lps = (np.asarray(x) for x in self._forward[1])
            spec = {row: (toks[r, :num[r]].tolist(),
                          tuple(x[r, :num[r]] for x in lps) if self.want_logprobs else None)
                    for r, row in enumerate(self.spec_rows)}
        return StepResult(np.asarray(tok)[:n], logprobs, prompt, spec)
