"""Stop strings, end to end: the engine matches them on its own detokenized text and hands
that text to the server, which streams it without detokenizing the request again.

Claims, each against an independent reference (the tokenizer's decode of the request's
final token ids, cut at the stop string by plain string search): the streamed text is
exactly that, for the byte tokenizer (tiny; smollm2's BPE one: test_stop_strings_smollm2.py), with stop
strings that span tokens, end mid-token, are multi-byte, or never complete (their start
held back, then sent), with skip_special_tokens off and logprobs on, under static batching
too; include_stop_str_in_output keeps the stop string (vLLM's), streamed or whole, and a
stop token's text; a stop-string request is decoded once per token, by the engine only."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import tiny_async_engine
from protocol import ApiError, parse_sampling
from sampling_params import SamplingParams
from tokenizer import ByteTokenizer

_ids = itertools.count()


def reference(tokenizer: Any, ids: list[int], params: SamplingParams, eos: tuple[int, ...]) -> tuple[str, str | None]:
    """(text, stop string matched): decode the whole output, then cut it at the stop string
    found by str.find (the one starting first; with include_stop_str_in_output, the one
    ending first, kept)."""
    if ids and not params.include_stop_str_in_output and params.stop_token(ids[-1], eos):
        ids = ids[:-1]
    kw = {"skip_special_tokens": params.skip_special_tokens}
    full = tokenizer.decode(ids, **kw)
    hits = [(full.find(s), s) for s in params.stop if s in full]
    if not hits:
        return full, None
    if params.include_stop_str_in_output:
        end, s = min((i + len(s), s) for i, s in hits)
        return full[:end], s
    i, s = min(hits)
    return full[:i], s


async def collect(gen: Any) -> tuple[list[Any], list[int]]:
    """A server Generation's chunks, and the token ids its deltas carried."""
    ids, stream = [], gen.stream

    async def tee():
        async for d in stream:
            ids.extend(d.new_token_ids)
            yield d
    gen.stream = tee()
    return [c async for c in gen.chunks()], ids


async def generate_async(engine: Any, prompt: list[int], params: SamplingParams) -> tuple[list[Any], list[int]]:
    """The server's Generation of one request: its chunks, and the token ids its deltas carried."""
    import generation
    from engine import EngineRequest

    return await collect(generation.Generation(engine, EngineRequest(f"stop-{next(_ids)}", prompt, params)))


def generate(loop: asyncio.AbstractEventLoop, engine: Any, prompt: list[int],
             params: SamplingParams) -> tuple[list[Any], list[int]]:
    return loop.run_until_complete(asyncio.wait_for(generate_async(engine, prompt, params), 300))


def check(loop: asyncio.AbstractEventLoop, engine: Any, prompt: list[int], params: SamplingParams) -> str:
    """Generate; the streamed text must be the reference's."""
    return check_all(loop, engine, prompt, [params])[0]


def check_all(loop: asyncio.AbstractEventLoop, engine: Any, prompt: list[int], batch: list[SamplingParams]) -> list[str]:
    """check() of each params, the requests run together."""
    async def run() -> list[tuple[list[Any], list[int]]]:
        return await asyncio.gather(*(generate_async(engine, prompt, p) for p in batch))
    return [verify(engine, p, *r) for p, r in zip(batch, loop.run_until_complete(asyncio.wait_for(run(), 300)))]


def verify(engine: Any, params: SamplingParams, chunks: list[Any], ids: list[int]) -> str:
    want, stop = reference(engine.tokenizer, ids, params, engine.model_config.eos_token_ids)
    got = "".join(c.text for c in chunks)
    assert got == want, (params.stop, got, want)
    last = chunks[-1]
    assert last.finish_reason is not None and all(c.finish_reason is None for c in chunks[:-1])
    if stop is not None:
        assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    if params.logprobs is not None:
        assert sum(len(c.logprobs or []) for c in chunks) == len(ids)
    if not params.include_stop_str_in_output:
        assert not any(s in got for s in params.stop)
    return got


def stops_from(text: str) -> list[tuple[str, ...]]:
    """Stop strings picked from a run's text: 3 characters from the middle (spanning tokens
    for the byte tokenizer, starting or ending inside one for a BPE one), 2 characters
    near the start, the last character (multi-byte if the text has one), and one that never
    completes though its first characters appear (held back, then sent)."""
    clean = [i for i in range(2, len(text) - 3) if "\ufffd" not in text[i:i + 3] and text[i:i + 3].strip()]
    assert len(clean) > 4, f"the sample text is too short to pick stop strings from: {text!r}"
    mid, early = clean[len(clean) // 2], clean[0]
    wide = next((c for c in text if len(c.encode()) > 1 and c != "\ufffd"), text[mid + 1])
    return [(text[mid:mid + 3],), (text[early:early + 2],), (wide,), (text[mid:mid + 2] + "\x01\x02",),
            (text[mid:mid + 3], text[early + 1:early + 3])]


VARIANTS = [dict(), dict(include_stop_str_in_output=True), dict(skip_special_tokens=False, logprobs=2),
            dict(include_stop_str_in_output=True, logprobs=1)]


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[asyncio.AbstractEventLoop, Any]]:
    with tiny_async_engine() as (loop, engine):
        yield loop, engine


def test_tiny_stop_strings_stream_exactly_the_reference_text(tiny) -> None:
    loop, engine = tiny
    prompt = ByteTokenizer().encode("Once upon")
    base = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    free = check(loop, engine, prompt, SamplingParams(**base))
    check_all(loop, engine, prompt, [SamplingParams(**base, stop=stop, **extra)
                                     for stop, extra in itertools.product(stops_from(free), VARIANTS)])
    # sampled, so EOS may end some: the ending token is text only when included
    check_all(loop, engine, prompt, [SamplingParams(max_tokens=30, seed=seed, stop=stops_from(free)[0], **extra)
                                     for seed, extra in itertools.product(range(4), VARIANTS)])


def test_a_stop_string_or_token_under_static_batching_ends_its_request_with_the_reference_text() -> None:
    """Static batching holds a finished member seated until the whole batch is done: its
    last token and its release come in different deltas."""
    from async_engine import AsyncEngine
    from engine import EngineConfig, EngineRequest

    loop = asyncio.new_event_loop()
    engine = AsyncEngine(EngineConfig(model="tiny", max_num_seqs=2, max_model_len=128, warmup=False,
                                      scheduling="static"), log=lambda *_: None)
    loop.run_until_complete(engine.start())
    try:
        prompt = ByteTokenizer().encode("Once upon")
        base = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
        import generation

        async def bus(params: SamplingParams) -> tuple[str, list[int]]:  # with a longer one in the same batch
            gens = [generation.Generation(engine, EngineRequest(f"static-{next(_ids)}", prompt, p))
                    for p in (params, SamplingParams(**base))]
            chunks, ids = (await asyncio.gather(*map(collect, gens)))[0]
            return "".join(c.text for c in chunks), ids

        free, free_ids = loop.run_until_complete(asyncio.wait_for(bus(SamplingParams(**base)), 300))
        stop = stops_from(free)[1]  # taken from a run in the same batch shape (the same greedy tokens)
        for extra in VARIANTS:
            params = SamplingParams(**base, stop=stop, **extra)
            text, ids = loop.run_until_complete(asyncio.wait_for(bus(params), 300))
            assert len(ids) < base["max_tokens"] or not params.skip_special_tokens  # (special tokens' text between)
            assert text == reference(engine.tokenizer, ids, params, engine.model_config.eos_token_ids)[0]
        # a stop token ends a member before its release too: its text is never output, unless included
        ids = free_ids
        k = next(i for i, t in enumerate(ids) if i > 2 and 32 < t < 127 and t not in ids[:i])
        for include in (False, True):
            params = SamplingParams(**base, stop_token_ids=[ids[k]], include_stop_str_in_output=include)
            text, got = loop.run_until_complete(asyncio.wait_for(bus(params), 300))
            assert got == ids[:k + 1] and text == engine.tokenizer.decode(ids[:k + 1 if include else k])
        # under a stream_interval, a member's last tokens go out when they come, not at its release

        async def member(params: SamplingParams) -> list[Any]:
            gens = [generation.Generation(engine, EngineRequest(f"static-{next(_ids)}", prompt, p))
                    for p in (params, SamplingParams(**base))]
            return (await asyncio.gather(*map(collect, gens)))[0][0]
        chunks = loop.run_until_complete(asyncio.wait_for(member(SamplingParams(**base, stop=stop,
                                                                                 stream_interval=8)), 300))
        assert chunks[-1].finish_reason == "stop" and chunks[-1].token_ids == [] and chunks[-2].token_ids
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()


def test_a_stop_string_request_is_decoded_once_per_token(tiny, monkeypatch) -> None:
    """The engine's matcher decodes a short window twice a token; the server decodes nothing
    more for a request whose text the engine made."""
    loop, engine = tiny
    calls = []
    decode = ByteTokenizer.decode
    monkeypatch.setattr(ByteTokenizer, "decode", lambda self, ids, **kw: calls.append(1) or decode(self, ids, **kw))
    n = 20
    chunks, ids = generate(loop, engine, ByteTokenizer().encode("Once upon"),
                           SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, stop=("\x01\x02\x03",)))
    assert len(ids) == n
    assert len(calls) <= 2 * n + 2, f"{len(calls)} decodes for {n} tokens"


# ---- include_stop_str_in_output: the field, offline, and over HTTP ------------------------

def test_include_stop_str_in_output_is_a_boolean() -> None:
    for bad in (1, "yes", [True]):
        with pytest.raises(ApiError, match="include_stop_str_in_output"):
            parse_sampling({"include_stop_str_in_output": bad}, 3, 256, chat=False)
        with pytest.raises(ValueError, match="include_stop_str_in_output"):
            SamplingParams(include_stop_str_in_output=bad)
    assert parse_sampling({"include_stop_str_in_output": True, "stop": "x"}, 3, 256, chat=False).include_stop_str_in_output


def test_include_stop_str_in_output_offline_keeps_the_stop_string_and_a_stop_tokens_text() -> None:
    from llm import LLM

    llm = LLM("tiny", log=lambda *_: None, max_num_seqs=2, max_model_len=128, warmup=False)
    tok, eos = llm.tokenizer, llm.engine.model_config.eos_token_ids
    base = dict(max_tokens=30, temperature=0.0, ignore_eos=True)
    free = llm.generate(["Once upon"], SamplingParams(**base))[0].outputs[0]
    stop = stops_from(free.text)[0]
    for include in (False, True):
        params = SamplingParams(**base, stop=stop, include_stop_str_in_output=include)
        out = llm.generate(["Once upon"], params)[0].outputs[0]
        assert (out.text, out.finish_reason) == (reference(tok, out.token_ids, params, eos)[0], "stop")
        assert out.text.endswith(stop[0]) == include
    # a stop token's text: an ASCII byte past the first few tokens
    k = next(i for i, t in enumerate(free.token_ids) if i > 2 and 32 < t < 127 and t not in free.token_ids[:i])
    for include in (False, True):
        params = SamplingParams(**base, stop_token_ids=[free.token_ids[k]], include_stop_str_in_output=include)
        out = llm.generate(["Once upon"], params)[0].outputs[0]
        assert out.token_ids == free.token_ids[:k + 1]
        assert out.text == tok.decode(free.token_ids[:k + 1 if include else k])


def test_include_stop_str_in_output_over_http_whole_and_streamed(tiny) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    import server

    loop, engine = tiny
    client = TestClient(TestServer(server.build_app(engine, ["tiny"])), loop=loop)
    loop.run_until_complete(client.start_server())
    try:
        async def post(body: dict) -> tuple[str, str | None, str | None]:
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 200, await resp.text()
            if not body.get("stream"):
                c = (await resp.json())["choices"][0]
                return c["text"], c["finish_reason"], c["stop_reason"]
            events = [json.loads(line[6:]) for line in (await resp.text()).split("\n\n")
                      if line.startswith("data: {")]
            c = [e["choices"][0] for e in events]
            return "".join(x["text"] for x in c), c[-1]["finish_reason"], c[-1]["stop_reason"]

        def run(body: dict) -> tuple[str, str | None, str | None]:
            return loop.run_until_complete(asyncio.wait_for(post(body), 300))

        base = {"prompt": "Once upon", "max_tokens": 30, "temperature": 0.0, "ignore_eos": True}
        free = run(base)[0]
        stop = stops_from(free)[0][0]
        want = free[:free.find(stop)]
        for stream in (False, True):
            assert run(base | {"stop": [stop], "stream": stream}) == (want, "stop", stop)
            assert run(base | {"stop": [stop], "stream": stream, "include_stop_str_in_output": True}) == (
                want + stop, "stop", stop)
    finally:
        loop.run_until_complete(client.close())


def test_partial_stop_len_is_the_longest_suffix_that_starts_a_stop_string() -> None:
    """Against the definition, by brute force, over every short text and stop string of a
    small alphabet (the matcher holds exactly this much back)."""
    from tokenizer import partial_stop_len

    words = ["".join(w) for n in range(0, 5) for w in itertools.product("ab\u00e9", repeat=n)]
    for text in words:
        for stop in itertools.combinations([w for w in words if w and len(w) <= 3], 2):
            want = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            assert partial_stop_len(text, list(stop)) == want, (text, stop)


def test_partial_stop_len_with_nul_in_the_stop_string() -> None:
    """A stop string may hold any character, NUL too: by brute force again (a held-back
    tail longer than the definition's delays text that can never start a stop string)."""
    from tokenizer import partial_stop_len

    words = ["".join(w) for n in range(0, 5) for w in itertools.product("a\0", repeat=n)]
    for text in words:
        for stop in itertools.combinations([w for w in words if w and len(w) <= 4], 2):
            want = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            assert partial_stop_len(text, list(stop)) == want, (text, stop)
    assert partial_stop_len("ab\0", ["\0\0"]) == 1


@pytest.mark.parametrize("reason", ["length", "abort", "error"])
def test_a_requests_last_delta_sends_the_rest_of_its_text_however_it_ended(reason) -> None:
    """RequestOutputDelta.final builds every request's last delta (released, aborted, failed):
    its text is the rest of the whole decode, an incomplete character included (a stream's
    last push is final), even where no final token reached the matcher (an abort mid-output,
    an end its masks forced without a token); and nothing is sent twice."""
    from outputs import RequestOutputDelta
    from sequence import Sequence
    from tokenizer import IncrementalDetokenizer

    tok, eos = ByteTokenizer(), (ByteTokenizer.eos_token_id,)
    params = SamplingParams(max_tokens=8, stop=["zz"])
    seq = Sequence("r", [104, 105], params)
    seq.stop_matcher = IncrementalDetokenizer(tok, seq.prompt_token_ids, ["zz"], params, eos)
    out = [*"ab z".encode(), *"é".encode()[:1]]  # a held-back maybe-stop "z" follows, then half a character
    sent = ""
    for t in out:
        seq.output_token_ids.append(t)
        seq.stop_matcher.advance([t], final=False)
        sent += seq.stop_matcher.take(False)
    seq.finish_reason, seq.finished_time = reason, seq.arrival_time + 1.0
    last = RequestOutputDelta.final(seq, eos)
    assert last.finished and last.finish_reason == reason and last.new_token_ids == []
    assert sent + last.new_text == tok.decode(out) == "ab z\ufffd"
    again = RequestOutputDelta(seq.request_id, [], None, False, None, 2, len(out))
    assert RequestOutputDelta.final(seq, eos, again).new_text == ""  # a second end adds nothing
