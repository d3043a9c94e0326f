"""Beam search (beam_search.py, LLM.beam_search) against a search written here over
transformers' logits of the same checkpoint: vLLM's algorithm (each step the 2 x width most
likely tokens of every beam, an EOS among them set aside as ended, the best width of the
rest go on; the ended and live sequences ranked by cum_logprob / length ** length_penalty),
computed in float64 NumPy from the reference model, not from the engine's logprobs."""

from __future__ import annotations

import re
import time
from typing import Callable

import numpy as np
import pytest
from conftest import hf_greedy, hf_logits

from beam_search import BeamSearch, BeamSearchParams
from llm import LLM
from outputs import TokenLogprob

SMALL = dict(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=128, block_size=4, warmup=False)
PROMPTS = [[5, 17, 42, 99, 7, 23], [200, 3, 3, 150]]


def reference(path: str, prompt: list[int], width: int, steps: int, eos: set[int], *, length_penalty: float = 1.0,
              include_stop: bool = False, ignore_eos: bool = False,
              rank: Callable[[int, float], object] | None = None) -> tuple[list[tuple[list[int], float, str]], int]:
    """(the best `width` of (tokens, cum_logprob, finish_reason), best first; how many ended on
    EOS). rank: a sort key of (length, cum_logprob), best first, in place of the score."""
    beams, ended = [(list(prompt), 0.0)], []
    for _ in range(steps):
        candidates = []
        for tokens, cum in beams:
            logits = hf_logits(path, tokens)[-1].astype(np.float64)
            logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
            for t in np.argsort(-logprobs, kind="stable")[:2 * width].tolist():
                if t in eos and not ignore_eos:
                    ended.append((tokens + [t] if include_stop else tokens, cum + logprobs[t], "stop"))
                else:
                    candidates.append((tokens + [t], cum + logprobs[t]))
        beams = sorted(candidates, key=lambda c: -c[1])[:width]
        if not beams:
            break
    pool = ended + [(t, c, "length") for t, c in beams]

    def key(s: tuple[list[int], float, str]) -> object:
        length = len(s[0]) - (s[0][-1] in eos)
        return -(s[1] / length ** length_penalty) if rank is None else rank(length, s[1])
    return sorted(pool, key=key)[:width], len(ended)


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint) -> tuple[str, str, int]:
    """(a checkpoint, the same weights with the second token of PROMPTS[0]'s greedy answer as
    its EOS (so that searches meet it) and a tokenizer with a chat template, that token)."""
    plain = hf_checkpoint("llama2")
    eos = hf_greedy(plain, PROMPTS[0], 2)[1]
    return plain, hf_checkpoint("llama2", eos_token_id=eos, tokenizer=True), eos


def check(outputs, path: str, width: int, steps: int, eos: set[int], **kw) -> int:
    total_ended = 0
    for prompt, out in zip(PROMPTS, outputs):
        want, num_ended = reference(path, prompt, width, steps, eos, **kw)
        total_ended += num_ended
        got = out.sequences
        assert [s.tokens for s in got] == [t for t, _, _ in want]
        assert [s.finish_reason for s in got] == [f for _, _, f in want]
        np.testing.assert_allclose([s.cum_logprob for s in got], [c for _, c, _ in want], rtol=1e-4, atol=1e-4)
        for s in got:  # a logprob per step (an EOS left out of the tokens included): the sum is cum_logprob
            dropped_eos = s.finish_reason == "stop" and not kw.get("include_stop", False)
            assert len(s.logprobs) == len(s.tokens) - len(prompt) + dropped_eos
            assert abs(sum(t.logprob for t in s.logprobs) - s.cum_logprob) < 1e-4
    return total_ended


@pytest.mark.parametrize("kw", [dict(), dict(length_penalty=0.3, include_stop=True), dict(length_penalty=2.0),
                                dict(ignore_eos=True)])
def test_beam_search_matches_a_reference_search_over_transformers_logits(checkpoints, kw):
    _, path, eos = checkpoints
    width, steps = 3, 5
    llm = LLM(path, log=lambda *_: None, **SMALL)
    params = BeamSearchParams(width, steps, length_penalty=kw.get("length_penalty", 1.0),
                              include_stop_str_in_output=kw.get("include_stop", False),
                              ignore_eos=kw.get("ignore_eos", False))
    outputs = llm.beam_search(PROMPTS, params)
    assert len(outputs) == len(PROMPTS) and all(len(o.sequences) == width for o in outputs)
    num_ended = check(outputs, path, width, steps, {eos}, **kw)
    assert (num_ended == 0) == kw.get("ignore_eos", False)  # the EOS path is exercised
    # every step's beams of both prompts ran as one batch, the beams' shared prefixes from the cache
    assert llm.stats.prefix_cache_hits > 0


def test_width_one_ignoring_eos_is_greedy_decoding(checkpoints):
    path, _, _ = checkpoints
    llm = LLM(path, log=lambda *_: None, **SMALL)
    out = llm.beam_search({"prompt_token_ids": PROMPTS[0]}, BeamSearchParams(1, 8, ignore_eos=True))
    assert out[0].sequences[0].tokens == PROMPTS[0] + hf_greedy(path, PROMPTS[0], 8)


def test_text_is_the_whole_sequence_decoded():
    llm = LLM("tiny", log=lambda *_: None, **SMALL)
    out = llm.beam_search(["hello", "ab"], BeamSearchParams(2, 4))
    for o in out:
        assert len(o.sequences) == 2
        for s in o.sequences:
            assert s.text == llm.tokenizer.decode(s.tokens) and s.text.startswith(("hello", "ab"))
    # vLLM's concurrency_limit: the prompts searched a few at a time, each search the same
    one_by_one = llm.beam_search(["ab", "hello", "ab"], BeamSearchParams(2, 4), concurrency_limit=2)
    assert [[s.tokens for s in o.sequences] for o in one_by_one] == \
        [[s.tokens for s in o.sequences] for o in (out[1], out[0], out[1])]
    with pytest.raises(ValueError, match="concurrency_limit must be None or an integer >= 1, got 0"):
        llm.beam_search(["hello"], BeamSearchParams(2, 4), concurrency_limit=0)


def test_a_prompt_of_one_eos_ended_at_once_counts_its_length():
    """The length a score divides by counts the prompt, less an EOS among the output tokens
    only: a prompt that is one EOS token, ended at once by an EOS (not kept), is 1 long."""
    eos = 2
    search = BeamSearch([eos], BeamSearchParams(1, 1), [eos])
    search.advance([TokenLogprob(eos, -0.1, [(eos, -0.1), (7, -2.5)], 1)])
    # -0.1 / 1 beats the live [eos, 7]'s -2.5 / 2
    assert [(s.tokens, s.finish_reason, s.cum_logprob) for s in search.best()] == [([eos], "stop", -0.1)]


@pytest.mark.parametrize("kw, message", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be an integer >= 1"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(beam_width=2, max_tokens=4, temperature=2.5), re.escape("temperature must be in [0, 2], got 2.5.")),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(beam_width=2, max_tokens=4, length_penalty=10**400), "length_penalty must be a finite number"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos must be a boolean"),
])
def test_bad_params_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kw)


def test_a_search_the_engine_cannot_run_is_refused_before_any_step():
    llm = LLM("tiny", log=lambda *_: None, **SMALL)
    with pytest.raises(ValueError, match="prompt 1: .*max_model_len"):  # the last step's beams would not fit
        llm.beam_search([[5, 6], list(range(3, 60))], BeamSearchParams(2, 10))
    # 2 x 11 candidates a step, past max_logprobs 20 (vLLM's bound too): the message is the width's
    assert llm.engine.config.max_logprobs == 20
    with pytest.raises(ValueError) as e:
        llm.beam_search([[5, 6]], BeamSearchParams(11, 2))
    assert str(e.value).startswith("beam_width must be at most 10 for beam search, got 11: each step ranks the "
                                   "2 x beam_width most likely next tokens of every beam, from the 20 top logprobs")
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search([[5, 6]], None)
    assert llm.stats.prompt_tokens == 0  # nothing ran
    assert len(llm.beam_search([[5, 6]], BeamSearchParams(10, 1, ignore_eos=True))[0].sequences) == 10


def test_a_queued_search_takes_exactly_the_waiting_places_it_holds():
    """A search holds beam_width places in the waiting queue from its start to its end
    (AsyncEngine.reserve_waiting); its step's requests wait in those places, not in places
    of their own. With --max-waiting-requests 3 and a search of width 2 queued, one plain
    request fits beside it and a second does not, whether the search's request is in the
    inbox or in the scheduler's queue; nor does a reservation of one more place. Closed (its
    client gone) before its step's streams were read, the search's request leaves the
    queue, and its places count until it has; a search closed before it started, or after
    it ended, frees its places at once."""
    import asyncio

    from async_engine import AsyncEngine
    from config import EngineConfig
    from engine import EngineRequest, QueueFullError
    from generation import BeamSearchRun
    from sampling_params import SamplingParams

    async def go() -> None:
        # The loop thread is not started: whatever is handed over stays unscheduled until
        # the test hands it to the engine (_drain_inbox, the loop's first act each turn).
        eng = AsyncEngine(EngineConfig(model="tiny", max_waiting_requests=3, **SMALL), log=lambda *_: None)
        eng._loop = asyncio.get_running_loop()  # where aborted requests' last outputs go (as start() sets)
        beam = dict(beam_width=2, max_tokens=3)
        run = BeamSearchRun(eng, EngineRequest("s", [5, 6, 7], SamplingParams()), beam)  # as the server's
        reader = asyncio.ensure_future(run.sequences())
        await asyncio.sleep(0)  # the search starts and hands its first step's request over
        await asyncio.sleep(0)

        def plain(rid: str) -> None:
            eng.add_request(EngineRequest(rid, [9, 9], SamplingParams(max_tokens=2)))

        def waiting() -> list[str]:
            return sorted(q.request_id for q in eng.engine.scheduler.waiting)
        plain("a")  # the search's request in the inbox: 2 reserved + 1
        with pytest.raises(QueueFullError):
            plain("b")
        with pytest.raises(QueueFullError):
            eng.reserve_waiting(1)
        eng._drain_inbox()
        assert waiting() == ["a", "s-0-0"]
        eng.abort("a")
        eng._drain_inbox()
        plain("c")  # the search's request in the scheduler's queue: 2 reserved + 1
        with pytest.raises(QueueFullError):
            plain("d")
        eng._drain_inbox()
        run.close()
        run.close()  # (a second close frees nothing more)
        reader.cancel()
        await asyncio.wait({run.task})  # the search ends
        await asyncio.sleep(0)  # and its end's callbacks run
        with pytest.raises(QueueFullError):  # s-0-0 waits on, in its reserved place
            plain("e")
        eng._drain_inbox()  # its abort, then the release
        assert waiting() == ["c"] and eng._num_reserved == 0
        BeamSearchRun(eng, EngineRequest("t", [5], SamplingParams()), beam).close()  # never started
        plain("f"), plain("g")
        with pytest.raises(QueueFullError):
            plain("h")
    asyncio.run(go())


# ---- the OpenAI API's use_beam_search --------------------------------------------------

@pytest.fixture(scope="module")
def server(checkpoints):
    from test_server import HF_SMALL, running_server

    _, path, _ = checkpoints
    with running_server("--model", path, *HF_SMALL, "--block-size", "4", "--served-model-name", "tiny") as s:
        yield s


def test_the_api_answers_n_beams_as_the_reference_search(server, checkpoints):
    from test_server import request

    _, path, eos = checkpoints
    for prompt in PROMPTS:
        status, body = request(server, "POST", "/v1/completions", {
            "prompt": prompt, "use_beam_search": True, "n": 3, "max_tokens": 5, "temperature": 0,
            "length_penalty": 0.5, "include_stop_str_in_output": True, "return_token_ids": True, "logprobs": 2,
            "return_tokens_as_token_ids": True})  # (ids: two byte tokens may share a text)
        assert status == 200, body
        want, _ = reference(path, prompt, 3, 5, {eos}, length_penalty=0.5, include_stop=True)
        assert [c["token_ids"] for c in body["choices"]] == [t[len(prompt):] for t, _, _ in want]
        assert [c["finish_reason"] for c in body["choices"]] == [f for _, _, f in want]
        assert [c["stop_reason"] for c in body["choices"]] == [eos if f == "stop" else None for _, _, f in want]
        for c, (_, cum, _) in zip(body["choices"], want):  # each token's logprob, with the 2 most likely
            lps = c["logprobs"]
            assert len(lps["token_logprobs"]) == len(c["token_ids"])
            # OpenAI's logprobs + 1 entries where the beam's token is not among the 2 most likely
            assert all(len(top) in (2, 3) and token in top for token, top in zip(lps["tokens"], lps["top_logprobs"]))
            assert abs(sum(lps["token_logprobs"]) - cum) < 1e-3
        assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])


@pytest.mark.parametrize("length_penalty, rank", [
    (1e300, lambda length, cum: (-length, -cum)),  # length ** 1e300 overflows; the score's limit: the longest first
    (-1e300, lambda length, cum: (length, -cum)),  # length ** -1e300 is 0; the limit: the shortest first
])
def test_a_huge_length_penalty_ranks_as_its_limit(server, checkpoints, length_penalty, rank):
    from test_server import request

    _, path, eos = checkpoints
    status, body = request(server, "POST", "/v1/completions", {
        "prompt": PROMPTS[0], "use_beam_search": True, "n": 3, "max_tokens": 5, "temperature": 0,
        "length_penalty": length_penalty, "return_token_ids": True})
    assert status == 200, body
    want, num_ended = reference(path, PROMPTS[0], 3, 5, {eos}, rank=rank)
    assert num_ended > 0  # sequences of several lengths to rank
    assert [c["token_ids"] for c in body["choices"]] == [t[len(PROMPTS[0]):] for t, _, _ in want]
    assert [c["finish_reason"] for c in body["choices"]] == [f for _, _, f in want]


def test_a_streamed_beam_search_sends_each_sequence_once_it_has_ended(server, checkpoints):
    from test_server import sse

    _, path, eos = checkpoints
    events = sse(server, "/v1/completions", {"prompt": PROMPTS[1], "use_beam_search": True, "n": 2,
                                             "max_tokens": 4, "return_token_ids": True,
                                             "stream_options": {"include_usage": True},
                                             "stream_interval": 3})  # (asks nothing of a search)
    want, _ = reference(path, PROMPTS[1], 2, 4, {eos})
    chunks = [c for e in events for c in e["choices"]]
    assert sorted((c["index"], c["token_ids"], c["finish_reason"]) for c in chunks) == \
        [(i, t[len(PROMPTS[1]):], f) for i, (t, _, f) in enumerate(want)]
    assert events[-1]["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in chunks)


@pytest.mark.parametrize("body, param, message", [
    (dict(top_p=0.5), "top_p", "'top_p' is not supported with use_beam_search"),
    (dict(seed=1), "seed", "'seed' is not supported with use_beam_search"),
    (dict(stop_token_ids=[5]), "stop_token_ids", "'stop_token_ids' is not supported with use_beam_search"),
    (dict(echo=True), "echo", "'echo' is not supported with use_beam_search"),
    (dict(n=11), "n", "n must be at most 10"),  # 2 x 11 candidates, --max-logprobs 20
    (dict(length_penalty="long"), "length_penalty", "'length_penalty' must be an integer or a number"),
    (dict(length_penalty=1e309), "length_penalty", "must be a finite number"),
    (dict(use_beam_search=False, length_penalty=0.5), "length_penalty", "is for beam search"),
    (dict(use_beam_search="yes"), "use_beam_search", "'use_beam_search' must be a boolean"),
    (dict(max_tokens=200), "max_tokens", "max_tokens"),  # past max_model_len 128
])
def test_what_beam_search_cannot_do_is_a_400(server, body, param, message):
    from test_server import request, wait_idle

    status, answer = request(server, "POST", "/v1/completions",
                             {"prompt": PROMPTS[0], "use_beam_search": True, "n": 2, "max_tokens": 3} | body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and message in answer["error"]["message"], answer
    wait_idle(server)


@pytest.mark.parametrize("body, param", [(dict(echo=True), "echo"), (dict(top_p=0.5), "top_p"),
                                         (dict(include_metrics=True), "include_metrics")])
def test_what_beam_search_cannot_do_in_a_chat_is_a_400_naming_the_chat_field(server, body, param):
    """Chat's echo (the last message again, before the answer) and the sampling fields beam
    search does not read: refused in a chat as on completions; without them the search runs."""
    from test_server import request, wait_idle

    status, answer = request(server, "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "n": 2,
                              "max_completion_tokens": 3} | body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and "not supported with use_beam_search" in answer["error"]["message"], \
        answer
    wait_idle(server)
    status, answer = request(server, "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "n": 2,
                              "max_completion_tokens": 3})
    assert status == 200 and len(answer["choices"]) == 2, answer


def test_a_width_the_waiting_queue_cannot_hold_is_a_400():
    """Each step adds one request per live beam: with --max-waiting-requests 2 a search of
    n = 3 would be refused at its second step (a 503 saying "retry later", or an error in a
    stream whose 200 is out) every time; n = 2 runs. So with n plain samples, or a batch of
    prompts, that are more engine requests than the queue lets wait: a 400, not a 503 whose
    retry never succeeds on an idle server."""
    from test_server import request, running_server

    with running_server("--max-waiting-requests", "2", "--no-warmup") as s:
        for stream in (False, True):
            for body, param in (({"prompt": [5, 6, 7], "use_beam_search": True, "n": 3}, "n"),
                                ({"prompt": [5, 6, 7], "n": 3}, "n"),
                                ({"prompt": [[5, 6, 7], [8], [9, 10]]}, "prompt"),
                                ({"prompt": [[5, 6, 7], [8]], "use_beam_search": True, "n": 2}, "prompt")):
                status, answer = request(s, "POST", "/v1/completions", body | {"max_tokens": 3, "stream": stream})
                assert status == 400 and answer["error"]["param"] == param, (body, answer)
                assert "--max-waiting-requests" in answer["error"]["message"]
        for body in ({"prompt": [5, 6, 7], "use_beam_search": True, "n": 2}, {"prompt": [5, 6, 7], "n": 2},
                     {"prompt": [[5, 6, 7], [8]]}):
            status, answer = request(s, "POST", "/v1/completions", body | {"max_tokens": 3})
            assert status == 200 and len(answer["choices"]) == 2, answer


def test_a_chat_answer_by_beam_search(server):
    from test_server import request

    status, body = request(server, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "the quick brown fox"}], "use_beam_search": True, "n": 2,
        "max_completion_tokens": 4, "top_logprobs": 1, "logprobs": True})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for c in body["choices"]:
        assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
        assert c["finish_reason"] in ("stop", "length") and len(c["logprobs"]["content"]) <= 4
        # vLLM's list: top_logprobs entries, the beam's token first, not the step's 2 x n candidates
        for x in c["logprobs"]["content"]:
            assert x["top_logprobs"] == [{k: x[k] for k in ("token", "logprob", "bytes")}], x
    status, body = request(server, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "the quick brown fox"}], "use_beam_search": True, "n": 2,
        "max_completion_tokens": 4, "logprobs": True})
    assert status == 200 and all(x["top_logprobs"] == [] for c in body["choices"] for x in c["logprobs"]["content"])
    status, body = request(server, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "n": 2, "top_logprobs": 1,
        "logprobs": True, "top_p": 0.9})
    assert status == 400 and body["error"]["param"] == "top_p"


def test_a_client_gone_mid_search_stops_it(server):
    from test_server import metric, open_stream, scrape, wait_for, wait_idle

    wait_idle(server)
    before = metric(scrape(server), "generation_tokens_total")
    steps, width = 120, 4  # a whole search: the prompt's one-token request, then 119 steps of 4
    with open_stream(server, {"prompt": PROMPTS[0], "use_beam_search": True, "n": width, "max_tokens": steps,
                              "ignore_eos": True}):
        # the connection closes once the search has run a step
        wait_for(lambda: metric(scrape(server), "generation_tokens_total") > before)
    # idle, and still idle a moment later (between two steps of a search nothing runs)
    last: list[float] = []

    def settled() -> bool:
        m = scrape(server)
        last.append(metric(m, "generation_tokens_total"))
        time.sleep(0.5)
        m = scrape(server)
        return metric(m, "num_requests_running") == metric(m, "num_requests_waiting") == 0 and \
            metric(m, "generation_tokens_total") == last[-1]
    wait_for(settled)
    assert last[-1] - before < 1 + (steps - 1) * width  # the search stopped before its last step
    assert metric(scrape(server), "kv_cache_usage_perc") == 0
