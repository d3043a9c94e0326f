"""A property test of the HTTP API against one live server: request bodies hypothesis
builds for /v1/completions, /v1/chat/completions, /tokenize and /detokenize, valid fields
mixed with hostile values in every field protocol.py and server.py read (wrong JSON types,
integers past 64 bits, NaN and Infinity as raw JSON tokens, floats and booleans where
integers are due, empty, long and non-Unicode strings, nested junk, required fields left
out), some with a client that hangs up (a stream's after a few events, any other's before
its answer). tests/test_hostile.py is the hand-written table of such requests; this draws them.

Properties, for every request:
- the answer is a 200 or a 4xx, never a 5xx, never a dropped connection (except where the
  client hung up itself); a 4xx carries OpenAI's error JSON with a message;
- a 200 is the endpoint's JSON (strict JSON: no NaN), each choice with its finish_reason,
  n of them per prompt; a stream read to its end is events ending with `data: [DONE]`, none of them
  an error, every choice finished;
- the server logs no traceback for it;
and after them all: /health is 200, no request is running or waiting and the KV cache is
empty again (no slot or block leaked).

TAXIRANK_FUZZ_EXAMPLES=2000 with --hypothesis-profile=explore searches further (about
half a minute on one core).
"""

from __future__ import annotations

import http.client
import json
import math
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import API_KEY, Server, metric, request, running_server, scrape, wait_for

FLAGS = ["--max-num-seqs", "4", "--max-model-len", "128", "--max-num-batched-tokens", "64", "--num-kv-blocks", "64",
         "--scheduling-policy", "priority", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--reasoning-parser", "deepseek_r1", "--enable-per-request-metrics"]
C, CHAT, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
EXAMPLES = int(os.environ.get("TAXIRANK_FUZZ_EXAMPLES", "500"))

# ---- values ----------------------------------------------------------------------------

EXTREME_INTS = st.sampled_from([0, 1, -1, 2, 7, 255, 256, 257, 2**31, -(2**31), 2**63 - 1, 2**63, -(2**63), 2**64 + 1,
                                -(2**64), 10**30, 10**400])
EXTREME_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 0.5, 1.5, -1.5, 1e-320, 1e308, -1e308,
                                  2.0**63])
STRINGS = st.one_of(st.sampled_from(["", " ", "5", "true", "null", "\x00", "\ud800", "a\udfffb", "\U0001f600",
                                     "<tool_call>", "</think>", "<|im_end|>", "{{ x }}", "{% raise %}", "a" * 5000]),
                    st.text(max_size=12))
SCALARS = st.one_of(st.none(), st.booleans(), EXTREME_INTS, st.integers(-300, 300), EXTREME_FLOATS, STRINGS)
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(STRINGS, inner, max_size=3),
                    max_leaves=6)
TOKEN = st.integers(0, 257)  # the tiny model's byte vocabulary and its two specials
SMALL_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=6)


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True one time in n (hypothesis' integers favour their bounds), shrinking to False."""
    return st.sampled_from([False] * (n - 1) + [True])


def hostile(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a value the field could take, sometimes anything."""
    return st.one_of(plausible, plausible, plausible, plausible, JUNK)


def ints(lo: int, hi: int) -> st.SearchStrategy:
    return st.one_of(st.integers(lo, hi), EXTREME_INTS)


def floats(lo: float, hi: float) -> st.SearchStrategy:
    return st.one_of(st.floats(lo, hi), EXTREME_FLOATS)


FUNCTION = st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])}, optional={
    "description": hostile(STRINGS), "parameters": hostile(st.sampled_from([
        None, {}, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"s": {"type": "string", "pattern": "[a-c]{1,3}"}}}]))})
TOOL = hostile(st.fixed_dictionaries({"type": st.just("function"), "function": FUNCTION}))
TOOL_CHOICE = hostile(st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "h"])})})))
SCHEMA = st.sampled_from([{}, True, False, {"type": "integer"}, {"type": "string", "maxLength": 3},
                          {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                          {"enum": ["x", "y"]}, {"type": "integer", "minimum": 5, "maximum": 1}, {"$ref": "#/nope"}])
REGEX = st.sampled_from(["a+", "[0-9]{1,3}", "(a", "", ".*", "\\d{99999}", "(?=a)b"])
GRAMMAR = st.sampled_from(["start: \"a\" | \"b\"", "start: nope", "root ::= \"x\"", ""])
CHOICE = st.lists(st.one_of(SMALL_TEXT, st.just("")), max_size=3)
STRUCTURAL_TAG = st.fixed_dictionaries({"type": st.just("structural_tag")}, optional={
    "structures": hostile(st.just([{"begin": "<a>", "schema": {"type": "integer"}, "end": "</a>"}])),
    "triggers": hostile(st.just(["<a>"])), "format": JUNK})
RESPONSE_FORMAT = hostile(st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "nope"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": hostile(st.fixed_dictionaries(
        {"name": st.just("s")}, optional={"schema": hostile(SCHEMA), "strict": hostile(st.booleans())}))}),
    STRUCTURAL_TAG))
STRUCTURED_OUTPUTS = hostile(st.fixed_dictionaries({}, optional={
    "json": hostile(SCHEMA), "regex": hostile(REGEX), "choice": hostile(CHOICE), "grammar": hostile(GRAMMAR),
    "json_object": hostile(st.booleans()), "structural_tag": hostile(STRUCTURAL_TAG), "whitespace_pattern": JUNK}))

# Every field the server reads, with values it could take; each drawn field is sometimes junk.
COMMON = {
    "model": st.sampled_from(["tiny", "tiny", "nope", ""]),
    "max_tokens": ints(-1, 8),
    "temperature": floats(0, 3), "top_p": floats(0, 1), "top_k": ints(-2, 300), "min_p": floats(0, 1),
    "n": ints(0, 3), "best_of": ints(0, 3), "seed": st.integers(-(2**64), 2**64),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={k: hostile(st.booleans()) for k in (
        "include_usage", "continuous_usage_stats", "include_obfuscation", "nope")}),
    "stop": st.one_of(SMALL_TEXT, st.lists(SMALL_TEXT, max_size=3)),
    "stop_token_ids": st.lists(ints(0, 257), max_size=3),
    "include_stop_str_in_output": st.booleans(), "ignore_eos": st.booleans(),
    "prompt_logprobs": ints(-1, 5), "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "add_special_tokens": st.booleans(),
    "response_format": RESPONSE_FORMAT, "structured_outputs": STRUCTURED_OUTPUTS,
    "guided_json": SCHEMA, "guided_regex": REGEX, "guided_choice": CHOICE, "guided_grammar": GRAMMAR,
    "priority": ints(-5, 5), "include_metrics": st.booleans(), "user": STRINGS, "cache_salt": STRINGS,
    "slo": st.fixed_dictionaries({}, optional={"ttft_ms": floats(0, 1e4), "tpot_ms": floats(0, 1e4), "x": JUNK}),
    "tools": st.lists(TOOL, max_size=2), "tool_choice": TOOL_CHOICE,
    "request_id": STRINGS, "truncate_prompt_tokens": ints(-2, 130),
    "truncation_side": st.sampled_from(["left", "right", "up"]),
    "echo": st.booleans(), "return_token_ids": st.booleans(), "return_tokens_as_token_ids": st.booleans(),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-2, 300).map(str), STRINGS), floats(-200, 200), max_size=3),
    "presence_penalty": floats(-3, 3), "frequency_penalty": floats(-3, 3), "repetition_penalty": floats(0, 3),
    "min_tokens": ints(0, 10), "bad_words": st.lists(SMALL_TEXT, max_size=3),
    "allowed_token_ids": st.lists(ints(0, 257), max_size=4),
    "suffix": STRINGS, "store": st.booleans(), "service_tier": st.sampled_from(["auto", "flex"]),
    "metadata": st.dictionaries(STRINGS, STRINGS, max_size=2), "logits_processors": st.just([]),
    "use_beam_search": st.booleans(), "length_penalty": floats(0, 2), "unknown_field": JUNK,
}
COMPLETION = COMMON | {"logprobs": ints(-1, 5), "max_completion_tokens": ints(1, 8), "top_logprobs": ints(0, 3),
                       "prompt_embeds": STRINGS}
CHAT_FIELDS = COMMON | {
    "logprobs": st.booleans(), "top_logprobs": ints(-1, 5), "max_completion_tokens": ints(-1, 8),
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "tokenize", "x", "tools"]), JUNK,
                                            max_size=2),
    "parallel_tool_calls": st.booleans(), "reasoning_effort": st.sampled_from(["low", "none", "huge"]),
    "include_reasoning": st.booleans(), "chat_template": STRINGS, "documents": st.lists(JUNK, max_size=1),
}

VALID_PROMPT = st.one_of(SMALL_TEXT, st.lists(TOKEN, min_size=1, max_size=8))
PROMPT = st.one_of(SMALL_TEXT, STRINGS, st.lists(TOKEN, min_size=1, max_size=8), st.lists(ints(0, 257), max_size=4),
                   st.lists(SMALL_TEXT, min_size=1, max_size=2), st.lists(st.lists(TOKEN, min_size=1, max_size=3),
                                                                          min_size=1, max_size=2))
CALL = hostile(st.fixed_dictionaries({"function": hostile(st.fixed_dictionaries(
    {"name": hostile(st.sampled_from(["f", ""])), "arguments": hostile(st.sampled_from(['{"a": 1}', "{", '"\\ud800"',
                                                                                        "[]"]))}))},
    optional={"id": hostile(st.just("c")), "type": hostile(st.just("function"))}))
PART = hostile(st.one_of(SMALL_TEXT, st.fixed_dictionaries({"type": st.sampled_from(
    ["text", "input_text", "refusal", "thinking", "image_url"])}, optional={
    "text": hostile(SMALL_TEXT), "refusal": hostile(SMALL_TEXT), "thinking": hostile(SMALL_TEXT)})))
MESSAGE = hostile(st.fixed_dictionaries(
    {"role": hostile(st.sampled_from(["user", "assistant", "system", "developer", "tool", "ipython", ""]))},
    optional={"content": hostile(st.one_of(SMALL_TEXT, st.lists(PART, max_size=2))), "name": hostile(SMALL_TEXT),
              "tool_calls": hostile(st.lists(CALL, max_size=2)), "tool_call_id": hostile(SMALL_TEXT),
              "reasoning": hostile(SMALL_TEXT), "reasoning_content": hostile(SMALL_TEXT)}))
TEXT_PART = st.one_of(SMALL_TEXT, st.builds(lambda kind, text: {"type": kind, kind if kind in ("refusal", "thinking")
                                                                   else "text": text},
                                            st.sampled_from(["text", "input_text", "refusal", "thinking"]), SMALL_TEXT))
LAST_MESSAGE = st.one_of(st.just({"role": "user", "content": "hi"}), st.fixed_dictionaries(
    {"role": st.just("assistant"), "content": st.one_of(SMALL_TEXT, st.lists(TEXT_PART, min_size=1, max_size=2))}))
VALID_MESSAGES = st.tuples(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                           "content": SMALL_TEXT}), min_size=1, max_size=2),
                           LAST_MESSAGE).map(lambda t: t[0] + [t[1]])
MESSAGES = st.one_of(VALID_MESSAGES, VALID_MESSAGES, st.lists(MESSAGE, max_size=3), JUNK)


@st.composite
def bodies(draw: st.DrawFn, wild: bool, fields: dict[str, st.SearchStrategy],
           required: dict[str, st.SearchStrategy], base: dict) -> dict:
    """base (a valid request, with its small max_tokens) and the required fields overlaid
    with a few drawn fields, each a value the field could take; wild: a value may be any
    junk, a required field may be left out."""
    body = dict(base)
    for name, value in required.items():
        if not (wild and draw(one_in(10))):
            body[name] = draw(value)
    # fewer fields when wild: one bad value refuses the request, and the rest go unread
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5 if wild else 12, unique=True)):
        body[name] = draw(hostile(fields[name]) if wild else fields[name])
    return body


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, object, int | None]:
    """(path, body, how many stream events the client reads before hanging up: None, all; a
    request that is no stream is left unanswered when this is not None)."""
    path = draw(st.sampled_from([C, C, CHAT, CHAT, TOKENIZE, DETOKENIZE]))
    wild = draw(st.booleans())  # else only values each field could take, so that more requests run
    if path == C:
        body = draw(bodies(wild, COMPLETION, {"prompt": PROMPT if wild else VALID_PROMPT}, {"max_tokens": 4}))
    elif path == CHAT:
        body = draw(bodies(wild, CHAT_FIELDS, {"messages": MESSAGES if wild else VALID_MESSAGES}, {"max_tokens": 4}))
    elif path == TOKENIZE:
        chat = draw(st.booleans())  # messages through the template, else a prompt
        fields = {"add_special_tokens": st.booleans(), "return_token_strs": st.booleans()}
        if chat:
            fields |= {"tools": st.lists(TOOL, max_size=2), "tool_choice": TOOL_CHOICE,
                       "add_generation_prompt": st.booleans(), "chat_template_kwargs": JUNK}
        if wild:  # both prompt and messages: refused
            fields["prompt" if chat else "messages"] = PROMPT if chat else MESSAGES
        required = {"messages": MESSAGES if wild else VALID_MESSAGES} if chat else \
            {"prompt": PROMPT if wild else SMALL_TEXT}  # (a string only: /tokenize takes no token ids)
        body = draw(bodies(wild, fields, required, {}))
    else:
        body = draw(bodies(wild, {"model": COMMON["model"]}, {"tokens": st.lists(ints(0, 257), max_size=6)}, {}))
    if wild and draw(one_in(15)):  # not an object at all
        body = draw(JUNK)
    # a client that hangs up: a stream's after a few events, any other's as soon as it has sent the request
    hang_up = draw(st.none() | st.none() | st.integers(0, 3))
    return path, body, hang_up


# ---- the client ------------------------------------------------------------------------

def strict_json(data: bytes | str) -> object:
    """JSON as RFC 8259 has it: NaN and Infinity, which Python's json writes and reads, are no JSON."""
    def refuse(token: str) -> None:
        raise ValueError(f"{token} in a response")
    return json.loads(data, parse_constant=refuse)


def post(server: Server, path: str, body: object, hang_up: int | None) -> tuple[int | None, object]:
    """The request as raw JSON (NaN and Infinity as their bare tokens, lone surrogates as
    \\ud800 escapes): (status, the JSON answer; a stream's events; None where the client hung up);
    (None, None) for a request the client left before its answer."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        if hang_up is not None and not (isinstance(body, dict) and body.get("stream") is True):
            return None, None
        resp = conn.getresponse()
        if resp.status != 200 or not resp.getheader("Content-Type", "").startswith("text/event-stream"):
            return resp.status, strict_json(resp.read())
        events = []
        for line in resp:
            if hang_up is not None and len(events) >= hang_up:
                return resp.status, None  # conn.close() below: the client is gone mid-stream
            if line.strip():
                events.append(line.strip().decode())
        return resp.status, events
    finally:
        conn.close()


def num_choices(path: str, body: dict) -> int:
    """n per prompt, and a completion's prompt may be a batch: a list of strings or of
    token-id lists."""
    prompt = body.get("prompt")
    batch = len(prompt) if path == C and isinstance(prompt, list) and prompt and \
        isinstance(prompt[0], (str, list)) else 1
    return (body.get("n") or 1) * batch


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server("--api-key", API_KEY, *FLAGS) as s:
        yield s


def test_no_request_body_gets_a_5xx_a_dropped_connection_or_leaves_anything_behind(server: Server) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(requests())
    def one(req: tuple[str, object, int | None]) -> None:
        path, body, hang_up = req
        logged = len(server.log())
        status, answer = post(server, path, body, hang_up)
        assert status is None or status == 200 or 400 <= status < 500, (status, answer)
        if status is not None and status >= 400:
            assert isinstance(answer, dict) and set(answer["error"]) == {"message", "type", "param", "code"}, answer
            assert isinstance(answer["error"]["message"], str) and answer["error"]["message"], answer
        elif isinstance(answer, list):  # a stream read to its end
            assert answer and answer[-1] == "data: [DONE]", answer[-3:]
            assert all(e.startswith("data: {") for e in answer[:-1]), answer
            events = [strict_json(e[6:]) for e in answer[:-1]]
            assert not [e for e in events if "error" in e], events
            if path in (C, CHAT):  # every choice ends, with its reason
                finished = {c["index"] for e in events for c in e["choices"] if c["finish_reason"]}
                assert finished == set(range(num_choices(path, body))), events
        elif answer is not None:
            assert isinstance(answer, dict) and "error" not in answer, answer
            if path in (C, CHAT):
                choices = answer["choices"]
                assert len(choices) == num_choices(path, body) and all(c["finish_reason"] for c in choices), answer
            else:
                assert "tokens" in answer or "prompt" in answer, answer
        assert "Traceback" not in server.log()[logged:], server.log()[logged:][-5000:]

    one()
    assert request(server, "GET", "/health")[0] == 200

    def drained() -> bool:
        m = scrape(server)
        return (metric(m, "num_requests_running"), metric(m, "num_requests_waiting"),
                metric(m, "kv_cache_usage_perc")) == (0, 0, 0)
    wait_for(drained, timeout=120)

