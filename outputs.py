"""What the engine hands back (vLLM's vllm/outputs.py): a step's RequestOutputDelta per
request, which AsyncEngine streams (a request's last one built by RequestOutputDelta.final,
with its stop_reason), and the finished RequestOutput with its samples' CompletionOutputs,
which LLM returns; TokenLogprob is one token's logprob in either."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence as Seq

from metrics import RequestMetrics

if TYPE_CHECKING:
    from sequence import Sequence


@dataclass(frozen=True)
class Logprob:
    """vLLM's Logprob: one token's log-probability, its rank (1: the most likely) and its
    text (None where nothing decoded it: no tokenizer, or detokenize=False)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class TokenLogprob(Mapping[int, Logprob]):
    """One position's logprobs: the token there, its logprob and rank, and the top ones.
    Read as a mapping it is vLLM's per-position dict, token id -> Logprob: the token there
    first, then the top ones not already in it, ranked 1, 2, ... in their order (so
    `out.outputs[0].logprobs[i][token_id].logprob` reads as in vLLM)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    # the token's rank in the vocabulary (1: the most likely; vLLM's: the tokens at least as
    # likely, itself included), under the distribution its logprob is of (--logprobs-mode)
    rank: int | None = None
    # token id -> its text (vLLM's decoded_token), filled in by LLM's outputs where it decodes
    decoded: dict[int, str] | None = None

    def _entries(self) -> dict[int, Logprob]:
        texts = self.decoded or {}
        entries = {self.token_id: Logprob(self.logprob, self.rank, texts.get(self.token_id))}
        for rank, (token_id, logprob) in enumerate(self.top, 1):
            if token_id not in entries:
                entries[token_id] = Logprob(logprob, rank, texts.get(token_id))
        return entries

    def __getitem__(self, token_id: int) -> Logprob:
        return self._entries()[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())


@dataclass(slots=True)  # one per request per step: slots make it cheap to build
class RequestOutputDelta:
    """What one step produced for one request: streamed by AsyncEngine. The request's last
    one (finished), whatever ended it, is built by final() alone."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    metrics: RequestMetrics | None = None  # on the request's last delta
    # With a request's first token, when it asked: one entry per prompt token, the first None
    # (nothing precedes it), as vLLM's prompt_logprobs.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: str | int | None = None  # on the request's last delta: stop_reason(seq)
    # A request with stop strings is detokenized by the engine (its Sequence.stop_matcher):
    # the text this step adds that is safe to send (held back: a maybe-stop string, part of
    # a character). None: not detokenized here (the server does it, off the engine thread).
    new_text: str | None = None
    # The request's last token is this delta's (it may be released, finished, later: static
    # batching holds a member seated until its batch is done).
    ended: bool = False
    # finish_reason "error" (vLLM's FinishReason.ERROR): what its inputs failed with. The
    # request alone ends: AsyncEngine raises it on its stream, LLM.generate raises it.
    error: Exception | None = None

    @classmethod
    def final(cls, seq: Sequence, eos_token_ids: Seq[int], step: RequestOutputDelta | None = None,
              error: Exception | None = None) -> RequestOutputDelta:
        """seq's last delta, whatever ended it (released, aborted, failed): `step`, this
        step's delta with its last tokens, or an empty one, marked finished with why
        (finish_reason, stop_reason), its metrics, and the rest of its text where the engine
        detokenizes it: finish() flushes a character still incomplete (as a whole decode
        gives it) when nothing fed its matcher a final token (an abort mid-output, an end
        its masks forced without a token); after a final token it adds nothing."""
        if step is None:
            step = cls(request_id=seq.request_id, new_token_ids=[], new_logprobs=None, finished=True,
                       finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
                       num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_prompt_tokens)
        step.finished, step.finish_reason, step.metrics = True, seq.finish_reason, RequestMetrics.of(seq)
        step.stop_reason, step.error = stop_reason(seq, eos_token_ids), error
        if seq.stop_matcher is not None:
            step.new_text = (step.new_text or "") + seq.stop_matcher.finish()
        return step


def stop_reason(seq: Sequence, eos_token_ids: Seq[int]) -> str | int | None:
    """vLLM's stop_reason of a finished request: the stop string its matcher found, or the
    stop_token_ids entry it ended on (EOS, checked first by SamplingParams.stop_token, is
    None); None for any other end. The server's responses and LLM.generate both read it."""
    if seq.finish_reason != "stop":
        return None
    if seq.stop_matcher is not None and seq.stop_matcher.stop_reason is not None:
        return seq.stop_matcher.stop_reason
    last = seq.output_token_ids[-1] if seq.output_token_ids else None
    if last is not None and seq.params.stop_token(last, eos_token_ids) == "stop_token_id":
        return last
    return None


@dataclass
class CompletionOutput:
    """One sample of a request, as vLLM's CompletionOutput."""

    index: int  # its place among the request's n samples
    text: str  # "" where the model has no tokenizer
    token_ids: list[int]
    # vLLM's: the sum of the sampled tokens' logprobs when the request asked for logprobs, else None
    cumulative_logprob: float | None
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    # vLLM's: the stop string matched, or the stop_token_ids entry that ended it; None for
    # EOS, a length cut, a grammar's end or an abort.
    stop_reason: str | int | None = None
    lora_request: None = None  # vLLM's: the adapter that made it; always None here (no LoRA)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A finished request, as vLLM's RequestOutput: LLM.generate returns one per prompt,
    its `outputs` the request's n samples in index order."""

    request_id: str
    prompt: str | None  # the prompt's text when it was given as text (chat: the rendered template)
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprob | None] | None  # when asked: first entry None, as vLLM
    outputs: list[CompletionOutput]
    finished: bool
    # Its timings and scheduling history (vLLM's RequestOutput.metrics); with n > 1 the
    # sample that finished last's, as vLLM's parallel sampling reports.
    metrics: RequestMetrics
    num_cached_tokens: int  # prompt tokens served from the prefix cache (vLLM's field; the first sample's)
    # Beyond vLLM's fields, over all n samples: when the request arrived, when its first
    # token came and its last sample finished (time.monotonic), and its samples' preemptions.
    arrival_time: float
    first_token_time: float | None
    finished_time: float
    num_preemptions: int
    # vLLM's fields for what taxirank does not run, at the values vLLM gives a text-only,
    # decoder-only request without LoRA or disaggregated serving
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    multi_modal_placeholders: dict = field(default_factory=dict)
    kv_transfer_params: None = None
