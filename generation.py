"""One engine request seen as text: a Generation's chunks (a BeamGeneration's for one
sequence of a beam search), which serving.py writes out as a choice.

The engine speaks token ids only. A Generation detokenizes its deltas incrementally, except
for a request with stop strings: the engine matches them on its own detokenized text, and
hands that text over in its deltas. A request the server no longer needs (client gone,
shutdown) is aborted in the engine at once, so its slot and KV blocks go to the next request
within a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from metrics import RequestMetrics
from protocol import ApiError
from tokenizer import IncrementalDetokenizer

# The engine (JAX, Flax) is imported where it is used: `server.py --help` and a bad flag
# answer in a fraction of a second instead of after seconds of importing JAX.
if TYPE_CHECKING:
    from async_engine import AsyncEngine
    from engine import EngineRequest
    from outputs import TokenLogprob


@dataclass
class Chunk:
    """What one engine step added to a response (or several steps', under a stream_interval)."""

    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # set on the last chunk only
    num_output_tokens: int
    metrics: RequestMetrics | None = None  # on the last chunk, when the request asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token, when asked
    # vLLM's stop_reason, on the last chunk: the engine's (engine.stop_reason), which
    # LLM.generate's CompletionOutput carries too.
    stop_reason: str | int | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)  # its steps', the ending token included

    def then(self, later: Chunk) -> Chunk:
        """This chunk and a later one as one (a stream_interval above 1)."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        prompt_logprobs = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        return Chunk(self.text + later.text, logprobs, later.finish_reason, later.num_output_tokens, later.metrics,
                     prompt_logprobs, later.stop_reason, self.token_ids + later.token_ids)


class Generation:
    """One engine request, seen as text.

    Created before any response byte is written, so a refusal by the engine (bad
    request, full queue, shutting down) still becomes a proper 4xx/503.
    """

    def __init__(self, engine: AsyncEngine, request: EngineRequest, want_metrics: bool = False) -> None:
        """want_metrics: the last chunk carries the request's RequestMetrics. A request with
        stop strings is detokenized by the engine, which matches them (its deltas carry the
        text, cut at the stop string); any other is detokenized here, off the engine thread."""
        self.engine, self.request_id, self.want_metrics = engine, request.request_id, want_metrics
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_cached_tokens = 0  # of the prompt, served from the prefix cache
        self.params = params = request.params
        # vLLM's stream_interval: a chunk once this many tokens have come since the last one; a
        # request's may raise the server's, never lower it (vLLM's RequestState clamps it so)
        self.interval = max(params.stream_interval or 1, engine.config.stream_interval)
        self.done = False  # the engine has ended the request, or close() aborted it
        self.detokenizer = None if params.stop else IncrementalDetokenizer(
            self.engine.tokenizer, request.prompt_token_ids, [], params, self.engine.model_config.eos_token_ids)
        with refusals_as_api_errors():
            self.stream = self.engine.add_request(request)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Use under contextlib.aclosing: leaving early (client gone) aborts the request.
        One chunk a step, or, with a stream_interval above 1, as vLLM's output stage: the
        steps' chunks held until that many tokens have come since the last one sent, except
        the first token's and the last chunk, sent at once."""
        held: Chunk | None = None
        sent = 0  # output tokens in the chunks sent
        try:
            async for delta in self.stream:
                self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
                ids = delta.new_token_ids
                if delta.new_text is not None:  # detokenized by the engine, which matched stop strings
                    text = delta.new_text
                else:  # one token at a time (a verified step's delta has several), as the engine's matcher
                    last = delta.finished or delta.ended  # (ended: static batching releases it later)
                    text = "".join(self.detokenizer.push(ids[j:j + 1], final=last and j >= len(ids) - 1)[0]
                                   for j in range(len(ids) or 1))
                self.done = done = delta.finished
                reason = delta.finish_reason if done else None
                metrics = delta.metrics if self.want_metrics else None
                c = Chunk(text, delta.new_logprobs, reason, delta.num_output_tokens, metrics,
                          delta.prompt_logprobs, delta.stop_reason, ids)
                held = c if held is None else held.then(c)
                # (ended: the request's last tokens, which static batching finishes only later)
                if done or delta.ended or sent == 0 or c.num_output_tokens - sent >= self.interval:
                    sent, chunk, held = c.num_output_tokens, held, None
                    yield chunk
                if done:
                    return
        except ValueError as e:  # refused by the scheduler after add_request accepted it
            raise ApiError(str(e)) from e
        except RuntimeError as e:  # this request failed in the engine, or the engine loop died
            raise ApiError(str(e), 500) from e
        finally:
            self.close()  # the client went away (its handler was cancelled): free the slot now

    def close(self) -> None:
        """Abort the request unless it has ended. serving.respond() calls it however it leaves,
        since chunks() never started (the client gone before the first byte) cannot."""
        if not self.done:
            self.done = True
            self.engine.abort(self.request_id)


@contextlib.contextmanager
def refusals_as_api_errors() -> Iterator[None]:
    """The engine's refusal of a new request as the client's answer: a full queue or an
    engine that is shutting down (or died) a 503, a request it cannot run a 400."""
    from engine import QueueFullError

    try:
        yield
    except QueueFullError as e:
        raise ApiError(f"server is at capacity ({e}); retry later", status=503) from e
    except ValueError as e:  # (a ParamError names the field)
        raise ApiError(str(e), param=getattr(e, "param", None)) from e
    except RuntimeError as e:  # shutting down, or the engine loop died
        raise ApiError(str(e), status=503) from e


class BeamSearchRun:
    """vLLM's use_beam_search: one search (beam_search.run) for a request's n sequences,
    started by the first of its BeamGenerations to ask and shared by all of them."""

    def __init__(self, engine: AsyncEngine, request: EngineRequest, beam: dict) -> None:
        """request: its prompt, priority, user, SLO and cache_salt (params: the body's, for
        the text's decoding); beam: BeamSearchParams' fields (protocol.parse_beam_search).
        Checks here, before any byte is written, that the last step's requests can run, and
        holds n places in the waiting queue for the steps' requests until close()."""
        from beam_search import BeamSearchParams

        self.engine, self.request, self.params = engine, request, BeamSearchParams(**beam)
        with refusals_as_api_errors():
            self.params.check_width(engine.config.logprobs_width(engine.model_config.vocab_size), "n")
            engine.validate(dataclasses.replace(request, params=self.params.search_params()))
            engine.reserve_waiting(self.params.beam_width)  # (last: a refusal above holds nothing)
        self.reserved = True
        self.task: asyncio.Future | None = None

    async def sequences(self) -> tuple[Any, list[Any]]:
        """(the finished search, its best sequences, best first)."""
        import beam_search

        if self.task is None:
            self.task = asyncio.ensure_future(beam_search.run(self.engine, self.request, self.params))
        search = await asyncio.shield(self.task)  # (n readers: one's cancellation is not the search's)
        return search, search.best()

    def close(self) -> None:
        """The client is gone or the answer is out: a search still running stops (its step's
        requests are aborted), and then its places in the waiting queue are free."""
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the search aborts its step's requests as it ends: release after
            self.task.add_done_callback(lambda _: self._release(after_aborts=True))
        else:  # not started, or ended: done, none of its requests is left; failed, it aborted them
            self._release(after_aborts=self.task is not None and (self.task.cancelled()
                                                                  or self.task.exception() is not None))

    def _release(self, after_aborts: bool) -> None:
        if self.reserved:
            self.reserved = False
            self.engine.release_waiting(self.params.beam_width, after_aborts)


class BeamGeneration:
    """Sequence `index` of a BeamSearchRun, read by its Choice as a Generation is: one chunk,
    the whole sequence, once the search has ended (vLLM's beam search streams nothing sooner)."""

    def __init__(self, run: BeamSearchRun, index: int) -> None:
        self.run, self.index = run, index
        self.num_prompt_tokens = len(run.request.prompt_token_ids)
        self.num_cached_tokens = 0
        self.params = run.request.params
        self.done = False

    async def chunks(self) -> AsyncIterator[Chunk]:
        from engine import decode_output

        with refusals_as_api_errors():  # a later step's request refused: the queue full, the engine stopping
            search, best = await self.run.sequences()
        seq = best[self.index]
        ids = search.output_ids(seq)
        engine = self.run.engine
        # vLLM's: an EOS kept by include_stop_str_in_output is a token id, never text
        text = "" if engine.tokenizer is None else decode_output(
            engine.tokenizer, ids, dataclasses.replace(self.params, include_stop_str_in_output=False),
            engine.model_config.eos_token_ids, self.run.request.prompt_token_ids)
        self.done = True
        logprobs = seq.logprobs[:len(ids)] if self.params.logprobs is not None else None  # (an EOS not kept: none)
        yield Chunk(text, logprobs, seq.finish_reason, len(ids), stop_reason=seq.stop_reason, token_ids=ids)

    def close(self) -> None:
        self.done = True
        self.run.close()
