"""Beam search, as vLLM runs it: outside the engine, over ordinary one-token requests.

Each step asks the engine for one token of every live beam, with the 2 x beam_width most
likely next tokens' logprobs. Every (beam, candidate) pair is scored by its cumulative
logprob: a candidate that is an end-of-sequence token (unless ignore_eos) is set aside as a
completed sequence, and the best beam_width of the others are the next step's beams. After
max_tokens steps, or once no beam is left, the completed and live sequences are ranked by
cum_logprob / length ** length_penalty (the length counts the prompt and not an ending EOS,
as vLLM and Hugging Face count it) and the best beam_width are the answer.

Why outside the engine: continuous batching already runs every beam of every request in one
step, and the prefix cache keeps a beam's request (its prompt is the beam so far) from
computing again what the previous step computed: each step computes about one block.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Collection, Sequence

from engine import EngineRequest
from outputs import RequestOutputDelta, TokenLogprob
from sampling_params import MAX_TEMPERATURE, ParamError, SamplingParams, is_finite_number, is_int

if TYPE_CHECKING:
    from async_engine import AsyncEngine


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams (the OpenAI API's n is beam_width)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    # of each step's one-token requests: with the default raw logprobs (--logprobs-mode) it
    # changes which token a step samples, not the candidates' scores
    temperature: float = 0.0
    length_penalty: float = 1.0  # the exponent of the length a finished sequence's score is divided by
    include_stop_str_in_output: bool = False  # a sequence that ended on EOS keeps the EOS token
    # top logprobs each output token reports (the OpenAI API's logprobs); at most 2 x
    # beam_width of them are candidates, whatever this asks
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature > MAX_TEMPERATURE:  # each step's SamplingParams would refuse it
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}.")
        if not is_finite_number(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")

    def check_width(self, cap: int, name: str = "beam_width") -> None:
        """A ParamError naming `name` (the API's n) when the width asks more candidates a step
        than the engine's `cap` top logprobs (EngineConfig.logprobs_width, max_logprobs): each
        step ranks every beam's 2 x beam_width most likely next tokens, its logprobs. vLLM's
        search has the same bound, whose refusal reads as the steps' logprobs request's."""
        if 2 * self.beam_width > cap:
            raise ParamError(f"{name} must be at most {cap // 2} for beam search, got {self.beam_width}: each step "
                             f"ranks the 2 x {name} most likely next tokens of every beam, from the {cap} top "
                             "logprobs the engine computes (max_logprobs, --max-logprobs)", name)

    def step_params(self) -> SamplingParams:
        """Each step's request for one beam: one token, and the logprobs of the
        2 x beam_width most likely (vLLM's; an EOS among them still leaves beam_width others),
        or of as many as `logprobs` asks to report if more. Not detokenized: the search
        reads the step's logprobs only, and decodes its sequences once they are done."""
        return SamplingParams(max_tokens=1, temperature=self.temperature,
                              logprobs=max(2 * self.beam_width, self.logprobs or 0), detokenize=False)

    def search_params(self) -> SamplingParams:
        """A step's request grown to the whole search's length: checking it (LLMEngine.validate)
        before the first step checks that the last step's requests fit."""
        return dataclasses.replace(self.step_params(), max_tokens=self.max_tokens)


@dataclass
class BeamSearchSequence:
    """One sequence of a search, as vLLM's: `tokens` starts with the prompt's."""

    tokens: list[int]
    logprobs: list[TokenLogprob]  # per output token: its logprob and the step's candidates
    cum_logprob: float = 0.0
    text: str | None = None  # set on the returned sequences only
    finish_reason: str | None = None  # "stop" (an EOS) or "length"
    stop_reason: int | None = None  # the EOS token that ended it


@dataclass
class BeamSearchOutput:
    """A prompt's answer: the best beam_width sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_rank(seq: BeamSearchSequence, num_prompt_tokens: int, eos_token_ids: Collection[int],
              length_penalty: float) -> tuple[int, float]:
    """A sort key, best first, that orders sequences as vLLM's (and Hugging Face's) score
    cum_logprob / length ** length_penalty does: the length counts the prompt and not an
    ending EOS among the output tokens. Taken in logs (the score's sign, then log |score|
    divided by max(1, |length_penalty|), which keeps the order), since length **
    length_penalty overflows, or is 0, for a large finite penalty the API accepts."""
    output_eos = len(seq.tokens) > num_prompt_tokens and seq.tokens[-1] in eos_token_ids
    length = len(seq.tokens) - output_eos  # >= 1: a prompt is never empty
    cum = seq.cum_logprob
    if cum == 0:
        return (1, 0.0)
    scale = max(1.0, abs(length_penalty))
    log_magnitude = math.log(abs(cum)) / scale - length_penalty / scale * math.log(length)
    return (0, -log_magnitude) if cum > 0 else (2, log_magnitude)


class BeamSearch:
    """One prompt's search: its live beams and the sequences that have ended."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_ids: Collection[int]) -> None:
        self.params = params
        self.eos = frozenset(eos_token_ids)  # what the score does not count at a sequence's end (vLLM's)
        self.ends = frozenset() if params.ignore_eos else self.eos  # what ends a sequence
        self.num_prompt_tokens = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids), [])]
        self.completed: list[BeamSearchSequence] = []
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.num_steps == self.params.max_tokens

    def advance(self, steps: Sequence[TokenLogprob]) -> None:
        """One step: `steps[i]` is what live beam i's one-token request returned (the token it
        sampled, with the step's most likely tokens in `top`)."""
        assert len(steps) == len(self.beams) and not self.done
        candidates = []  # (cum_logprob, beam index, token, its TokenLogprob)
        for i, (beam, step) in enumerate(zip(self.beams, steps)):
            # the sampled token is a candidate even where it is not among the most likely (vLLM's)
            scored = dict(step.top[:2 * self.params.beam_width])
            scored.setdefault(step.token_id, step.logprob)
            ranks = {token: r for r, (token, _) in enumerate(step.top, 1)} | {step.token_id: step.rank}
            for token, logprob in sorted(scored.items(), key=lambda t: -t[1]):
                entry = TokenLogprob(token, logprob, step.top, ranks[token])
                cum = beam.cum_logprob + logprob
                if token in self.ends:
                    ended = beam.tokens + [token] if self.params.include_stop_str_in_output else list(beam.tokens)
                    self.completed.append(BeamSearchSequence(ended, beam.logprobs + [entry], cum, None, "stop", token))
                else:
                    candidates.append((cum, i, token, entry))
        # stable: among equal scores the earlier beam, then the likelier token, goes first
        best = sorted(candidates, key=lambda c: -c[0])[:self.params.beam_width]
        self.beams = [BeamSearchSequence(self.beams[i].tokens + [token], self.beams[i].logprobs + [entry], cum)
                      for cum, i, token, entry in best]
        self.num_steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The answer once done: the best beam_width of the ended and the live sequences, best
        first (a live one ended by the length cap: "length")."""
        assert self.done
        ended = self.completed + [dataclasses.replace(b, finish_reason="length") for b in self.beams]
        return sorted(ended, key=lambda s: beam_rank(s, self.num_prompt_tokens, self.eos, self.params.length_penalty)
                      )[:self.params.beam_width]

    def output_ids(self, seq: BeamSearchSequence) -> list[int]:
        """A sequence's output token ids (after the prompt)."""
        return seq.tokens[self.num_prompt_tokens:]


async def run(engine: AsyncEngine, request: EngineRequest, params: BeamSearchParams) -> BeamSearch:
    """The search for `request` on a running AsyncEngine: its prompt, and its priority, user,
    SLO and cache_salt for every step's requests (its params are replaced by each step's),
    which take the beam_width places in the waiting queue the caller reserved for them
    (AsyncEngine.reserve_waiting). Cancelled or failed, it aborts the step's requests before it ends."""
    search = BeamSearch(request.prompt_token_ids, params, engine.model_config.eos_token_ids)
    step = params.step_params()
    ids: list[str] = []
    try:
        while not search.done:
            ids = [f"{request.request_id}-{search.num_steps}-{i}" for i in range(len(search.beams))]
            streams = [engine.add_request(dataclasses.replace(request, request_id=rid, prompt_token_ids=beam.tokens,
                                                              params=step), reserved=True)
                       for rid, beam in zip(ids, search.beams)]
            search.advance(await asyncio.gather(*(_token(s) for s in streams)))
    except BaseException:  # cancelled, or a step's request failed: its other requests run on
        # A stream cancelled before its first read has no cleanup to abort its request: each
        # is aborted here, by id, before the caller frees the search's waiting places.
        for rid in ids:
            engine.abort(rid)
        raise
    return search


async def _token(stream: AsyncIterator[RequestOutputDelta]) -> TokenLogprob:
    """A one-token request's token, with its step's candidates."""
    got = None
    async for delta in stream:
        got = got or (delta.new_logprobs or [None])[0]
        if delta.finished and got is None:  # aborted before its token (the server shutting down)
            raise RuntimeError(f"beam search step ended without a token ({delta.finish_reason})")
    assert got is not None
    return got
