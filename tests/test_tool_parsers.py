"""Tool calls out of model text (tool_parsers.py), no model needed.

Claims: the hermes parser finds each <tool_call> block's call and the content before the
first, as vLLM's; calls that do not all parse leave the whole response's text content (as
vLLM's whole response); a streamed response, cut anywhere, adds up (as the OpenAI client
adds deltas up) to the whole response whenever that has calls (but for a call object that
repeats its "name" key: the first streamed, the last whole), names each call in its first delta before any of its arguments, and sends a call's name as soon as it is written,
not at the end; a call that turns out not to be one is not sent further and the calls after
it still stream (as vLLM's stream); a stream ends "tool_calls" only if it sent a call, and
one that sent none sends all its text; text that may open a tag is held back, never shown
as content; tool_choice is parsed once, and "auto" without a parser is vLLM's 400."""

from __future__ import annotations

import json

import pytest
from hypothesis import event, given, settings, strategies as st

from protocol import ApiError, parse_sampling, parse_structured, tool_choice
from reasoning_parsers import REASONING_PARSERS
from tool_parsers import TOOL_PARSERS, HermesToolParser, ToolCallStream, ToolChoice

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
# WEATHER as the template gets it: vLLM's ChatCompletionToolsParam.model_dump(), description null
WEATHER_DUMP = {"type": "function", "function": {"name": "get_weather", "description": None,
                                                 "parameters": {"type": "object"}}}
AUTO = ToolChoice("auto", {"get_weather": {}, "get_time": {}}, [WEATHER])
REQUIRED = ToolChoice("required", {"get_weather": {}, "get_time": {}}, [WEATHER])
CALLS = [("get_weather", {"city": "Paris", "days": [1, 2], "note": "a \"quoted\" } brace"}),
         ("get_time", {"zone": "CET"})]


def hermes_text(calls: list[tuple[str, dict]], content: str = "Let me check. ") -> str:
    return content + "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n'
                             for n, a in calls)


def stream(tools: ToolChoice, text: str, cuts: list[int], reason: str = "stop") -> tuple[list[dict], str | None]:
    """The deltas of `text` streamed in pieces cut at `cuts`, and the last finish_reason."""
    s = ToolCallStream(tools, HermesToolParser)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    out, last = [], None
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        delta, last = s.delta(text[a:b], reason if k == len(bounds) - 2 else None)
        out.append(delta)
    return out, last


def add_up(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """What a client makes of the deltas: content, and (name, arguments) per call index."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        assert len({c["index"] for c in d.get("tool_calls", [])}) == len(d.get("tool_calls", []))  # one per call
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] not in calls and c["type"] == "function", "a call's first delta names it"
                assert c["index"] == len(calls), "calls are numbered as they are sent, from 0"
                calls[c["index"]] = [c["function"]["name"], c["function"].get("arguments", "")]
            else:
                assert set(c["function"]) == {"arguments"}
                calls[c["index"]][1] += c["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


def test_hermes_whole_response_has_the_content_before_the_calls_and_each_call():
    message, reason = ToolCallStream(AUTO, HermesToolParser).message(hermes_text(CALLS), "stop")
    assert reason == "tool_calls" and message["content"] == "Let me check. "
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert got == CALLS and all(c["type"] == "function" and c["id"].startswith("call_") for c in message["tool_calls"])
    message, _ = ToolCallStream(AUTO, HermesToolParser).message(hermes_text(CALLS, content=""), "stop")
    assert message["content"] is None  # vLLM: no text before the calls is no content


def test_hermes_a_json_array_in_one_block_is_one_call_each():
    text = "<tool_call>" + json.dumps([{"name": n, "arguments": a} for n, a in CALLS]) + "</tool_call>"
    message, reason = ToolCallStream(AUTO, HermesToolParser).message(text, "stop")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == CALLS


@pytest.mark.parametrize("text", ["no calls here",
                                  'x <tool_call>{"name": "get_weather", "arguments": {"a": </tool_call>',
                                  '<tool_call>{"name": "get_weather", "arguments": {"a": 1}', "ends with <tool_c",
                                  "Sure. <tool_call>not a call</tool_call>"])
def test_text_without_calls_that_parse_is_content(text):
    message, reason = ToolCallStream(AUTO, HermesToolParser).message(text, "length")
    assert message == {"role": "assistant", "content": text} and reason == "length"
    if "get_weather" not in text:  # no call was ever named: streamed, the held-back text arrives as content too
        deltas, reason = stream(AUTO, text, list(range(len(text))), reason="length")
        assert add_up(deltas) == (text, []) and reason == "length"


@pytest.mark.parametrize("tools", [AUTO, REQUIRED])
def test_a_call_nested_past_the_json_decoders_stack_is_content_whole_and_streams_without_error(tools):
    # A client can make the model write it (a structured-output regex or logit_bias beside its
    # tools); vLLM's parser, whose json.loads fails on it, leaves the text as content.
    deep = "[" * 1500 + "]" * 1500
    text = f'<tool_call>{{"name": "get_weather", "arguments": {deep}}}</tool_call>' if tools is AUTO else \
        f'[{{"name":"get_weather","parameters":{{"a":{deep}}}}}]'
    message, reason = ToolCallStream(tools, HermesToolParser).message(text, "stop")
    assert message == {"role": "assistant", "content": text} and reason == "stop"
    deltas, reason = stream(tools, text, list(range(0, len(text), 97)))
    assert add_up(deltas)[1][0][0] == "get_weather" and reason == "tool_calls"  # named before it ended, as any call


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=12), n=st.integers(0, 2))
def test_hermes_streamed_anywhere_adds_up_to_the_whole_response(cuts, n):
    text = hermes_text(CALLS[:n])
    deltas, reason = stream(AUTO, text, cuts)
    whole, whole_reason = ToolCallStream(AUTO, HermesToolParser).message(text, "stop")
    content, calls = add_up(deltas)
    assert reason == whole_reason == ("tool_calls" if n else "stop")
    assert content == (whole["content"] or "")
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]


def test_hermes_streams_the_name_first_then_the_arguments_as_they_are_written():
    text = hermes_text(CALLS[:1])
    deltas, _ = stream(AUTO, text, list(range(len(text))))  # one character at a time
    named = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert text[:named + 1].endswith('"get_weather"')  # the name, as soon as its string closes
    args = [i for i, d in enumerate(deltas) if any("arguments" in c["function"] for c in d.get("tool_calls", []))]
    assert len(args) > 10 and args[-1] < len(text) - len("\n</tool_call>\n")  # char by char, before the tag closes
    assert all("<" not in d.get("content", "") for d in deltas)  # the tag's start was held back, never content


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=10))
def test_required_calls_stream_name_first_then_arguments_and_add_up(cuts):
    text = json.dumps([{"name": n, "parameters": a} for n, a in CALLS], separators=(",", ":"))
    deltas, reason = stream(REQUIRED, text, cuts)
    whole, whole_reason = ToolCallStream(REQUIRED, None).message(text, "stop")
    assert reason == whole_reason == "tool_calls" and add_up(deltas)[1] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]] == CALLS
    # char by char: the first call is named long before the output ends
    deltas, _ = stream(REQUIRED, text, list(range(len(text))))
    first = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert text[:first + 1] == '[{"name":"get_weather"'


GOOD = '{"name": "get_time", "arguments": {"zone": "CET"}}'
ONE_CHUNK, PER_CHARACTER = "one chunk", "one character a chunk"


@pytest.mark.parametrize("tools, text, reason, parallel, streamed", [
    # a call that is not one, then one that is: the first is skipped (or, streamed as it was
    # written, not sent further once it ends), the next streams at the next index
    (REQUIRED, '[{"name":"get_weather","parameters":12},{"name":"get_time","parameters":{}}]', "stop", True, {
        ONE_CHUNK: ("", [("get_time", "{}")], "tool_calls"),
        PER_CHARACTER: ("", [("get_weather", "12"), ("get_time", "{}")], "tool_calls")}),
    (AUTO, f'A. <tool_call>{{"name": "get_weather", "arguments": {{"a": 1}}</tool_call> <tool_call>{GOOD}</tool_call>',
     "stop", True, {ONE_CHUNK: ("A. ", [("get_time", '{"zone": "CET"}')], "tool_calls"),
                    PER_CHARACTER: ("A. ", [("get_weather", '{"a": 1}'), ("get_time", '{"zone": "CET"}')], "tool_calls")}),
    (AUTO, f'A. <tool_call>not a call</tool_call><tool_call>{GOOD}</tool_call><tool_call>{GOOD}</tool_call>',
     "stop", True, {k: ("A. ", [("get_time", '{"zone": "CET"}')] * 2, "tool_calls") for k in (ONE_CHUNK, PER_CHARACTER)}),
    (AUTO, f'<tool_call>{{"name": 7}}</tool_call><tool_call>{GOOD}</tool_call><tool_call>{GOOD}</tool_call>',
     "stop", False, {k: ("", [("get_time", '{"zone": "CET"}')], "tool_calls") for k in (ONE_CHUNK, PER_CHARACTER)}),
    # one that is, then one that is not
    (REQUIRED, '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":12}]', "stop", True, {
        ONE_CHUNK: ("", [("get_time", "{}")], "tool_calls"),
        PER_CHARACTER: ("", [("get_time", "{}"), ("get_weather", "12")], "tool_calls")}),
    (AUTO, f'<tool_call>{GOOD}</tool_call><tool_call>{{"name": "get_weather", "arguments": {{}} oops}}</tool_call>',
     "stop", True, {ONE_CHUNK: ("", [("get_time", '{"zone": "CET"}')], "tool_calls"),
                    PER_CHARACTER: ("", [("get_time", '{"zone": "CET"}'), ("get_weather", "{}")], "tool_calls")}),
    # cut short in a call: the calls before it, and it as far as it was written ("required":
    # an array's open call; "auto": a block left open on text that is no JSON value, as
    # vLLM's stream); a stream cut short ends "length", as vLLM's (resolve_finish_reason:
    # "tool_calls" only for an output that ended on "stop")
    (REQUIRED, '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"Pa', "length", True,
     {k: ("", [("get_time", "{}"), ("get_weather", '{"city":"Pa')], "length") for k in (ONE_CHUNK, PER_CHARACTER)}),
    (AUTO, f'A. <tool_call>{GOOD}</tool_call><tool_call>{{"name": "get_weather", "arguments": {{"city": "Pa', "length",
     True, {k: ("A. ", [("get_time", '{"zone": "CET"}'), ("get_weather", '{"city": "Pa')], "length")
            for k in (ONE_CHUNK, PER_CHARACTER)}),
    # no call sent: no "tool_calls", and the text held back comes as content at the end
    (AUTO, 'A. <tool_call>{"name": 7}</tool_call><tool_call>{"arguments": {}, "name": "get_time"', "length", True,
     {k: ('A. <tool_call>{"name": 7}</tool_call><tool_call>{"arguments": {}, "name": "get_time"', [], "length")
      for k in (ONE_CHUNK, PER_CHARACTER)}),
    (REQUIRED, '[{"name":"get_weather","parameters":12}]', "stop", True, {
        ONE_CHUNK: ('[{"name":"get_weather","parameters":12}]', [], "stop"),
        PER_CHARACTER: ("", [("get_weather", "12")], "tool_calls")}),
])
def test_a_stream_skips_a_call_that_is_not_one_and_streams_the_calls_after_it(tools, text, reason, parallel, streamed):
    """vLLM's stream: calls go out as they are written, a bad one is not taken back and does
    not stop the good ones after it. Its whole response is all or nothing: one call that
    does not parse leaves the whole text content, with the engine's finish_reason."""
    assert ToolCallStream(tools, HermesToolParser, parallel).message(text, reason) == (
        {"role": "assistant", "content": text}, reason)
    for chunking, cuts in ((ONE_CHUNK, []), (PER_CHARACTER, list(range(len(text))))):
        s = ToolCallStream(tools, HermesToolParser, parallel)
        bounds = [0, *cuts[1:], len(text)]
        deltas = [s.delta(text[a:b], reason if b == len(text) else None) for a, b in zip(bounds, bounds[1:])]
        assert (*add_up([d for d, _ in deltas]), deltas[-1][1]) == streamed[chunking], chunking


@pytest.mark.parametrize("tools, text", [
    (AUTO, '<tool_call>{"name": "get_weather", "name": "get_time", "arguments": {"a": 1}}</tool_call>'),
    (REQUIRED, '[{"name": "get_weather", "name": "get_time", "parameters": {"a": 1}}]')])
def test_a_call_object_naming_its_function_twice_streams_the_first_name_and_is_the_last_whole(tools, text):
    """Where a stream and its whole response both have calls and still differ (the docs say
    so): a call object with a repeated "name" key. The stream names the call as soon as the
    first name is written and cannot take it back; the whole response's json.loads (as
    vLLM's) keeps the last key. The arguments are the same."""
    whole, reason = ToolCallStream(tools, HermesToolParser).message(text, "stop")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == [
        ("get_time", '{"a": 1}')] and reason == "tool_calls"
    deltas, reason = stream(tools, text, list(range(len(text))))
    assert add_up(deltas) == ("", [("get_weather", '{"a": 1}')]) and reason == "tool_calls"
    deltas, reason = stream(tools, text, [])  # (in one chunk the call is whole when it is first named)
    assert add_up(deltas) == ("", [("get_time", '{"a": 1}')]) and reason == "tool_calls"


def test_required_output_cut_by_max_tokens_is_content_and_length():
    text = '[{"name":"get_weather","parameters":{"city":"Pa'
    message, reason = ToolCallStream(REQUIRED, None).message(text, "length")
    assert message == {"role": "assistant", "content": text} and reason == "length"
    # cut by a stop string instead: no complete call, so the whole response is content and "stop";
    # a stream has already sent the call's name and arguments, so it ends "tool_calls" (as vLLM's)
    assert ToolCallStream(REQUIRED, None).message(text, "stop")[1] == "stop"
    deltas, reason = stream(REQUIRED, text, [10, 30])
    assert reason == "tool_calls" and add_up(deltas)[1] == [("get_weather", '{"city":"Pa')]


def test_tool_choice_auto_needs_the_servers_parser_and_is_parsed_once():
    body = {"tools": [WEATHER]}  # tool_choice left out with tools: "auto", as vLLM
    with pytest.raises(ApiError, match='"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'):
        tool_choice(body, chat=True, auto=False)
    tools, _ = tool_choice(body, chat=True, auto=True)
    assert tools.mode == "auto" and tools.definitions == [WEATHER_DUMP]
    params = parse_sampling(body, 3, 64, chat=True, tools=tools)
    assert params.structured_outputs is None  # auto: free text, parsed after
    named, _ = tool_choice(body | {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, True,
                           False)
    params = parse_sampling(body, 3, 64, chat=True, tools=named)
    assert json.loads(params.structured_outputs.json) == {"type": "object"}
    with pytest.raises(ApiError, match="only for /v1/chat/completions"):
        tool_choice({"tools": [WEATHER]}, chat=False, auto=True)


def test_an_explicit_null_tool_choice_is_auto_where_the_server_parses_calls_and_no_400_where_not():
    """vLLM defaults only a left-out tool_choice to "auto" (ChatCompletionRequest.check_tool_usage);
    a null one passes its render check ("auto" alone needs the flags) and is parsed as "auto"
    where the server has a parser (serving.py: tool_choice "auto" or None), else its output is
    content, the tools still rendered."""
    body = {"tools": [WEATHER], "tool_choice": None}
    assert tool_choice(body, chat=True, auto=False) == (None, [WEATHER_DUMP])
    choice, _ = tool_choice(body, chat=True, auto=True)
    assert choice.mode == "auto"


def test_the_servers_tool_flags_are_checked_where_they_enter(capsys):
    import cli_args
    import server

    with pytest.raises(SystemExit):  # vLLM's rule: auto tool choice needs a parser
        server.main(["--enable-auto-tool-choice"])
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_args.build_parser().parse_args(["--tool-call-parser", "nope"])
    with pytest.raises(ValueError, match="tool_call_parser must be hermes, got 'nope'"):
        server.build_app(None, ["m"], tool_call_parser="nope")


def test_a_tool_conversation_goes_through_the_chat_template():
    """The assistant's calls (content null, as OpenAI sends them back) and the tool's answer
    reach the template; a malformed call list is a 400."""
    from chat_format import parse_messages
    from tokenizer import ByteTokenizer

    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "K\\u00f6ln"}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."}]
    seen = []

    class Template(ByteTokenizer):
        def apply_chat_template(self, chat, **kw):
            seen.append((chat, kw))
            return super().apply_chat_template(chat, **kw)

    ids = parse_messages({"messages": messages}, Template(), tool_choice({"tools": [WEATHER]}, True, True)[1])
    assert bytes(ids[1:]).decode().endswith("<|im_start|>tool\nSunny.<|im_end|>\n<|im_start|>assistant\n")
    chat, kw = seen[0]
    # the call's arguments reach the template as an object (transformers' convention), not OpenAI's JSON string
    as_object = call | {"function": {"name": "get_weather", "arguments": {"city": "Köln"}}}
    assert chat[1] == {"role": "assistant", "content": "", "tool_calls": [as_object]}
    assert chat[2]["tool_call_id"] == "call_1"
    assert kw["tools"] == [WEATHER_DUMP]
    # a model's own broken call, sent back: {} as vLLM's, so the conversation goes on
    parse_messages({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        call | {"function": {"name": "f", "arguments": "{oops"}}]}]}, Template())
    assert seen[-1][0][0]["tool_calls"][0]["function"]["arguments"] == {}
    with pytest.raises(ApiError, match="tool_calls must be an array"):
        parse_messages({"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]}, Template())


# tool_choice "required" texts, with what the parser must get right cut anywhere: whitespace
# around every token, escapes and brackets in strings, parameters before the name, a
# parameters value that is not an object, a key after the parameters, an element that is
# not a call, an element left open
REQUIRED_TEXTS = [
    json.dumps([{"name": n, "parameters": a} for n, a in CALLS], separators=(",", ":")),
    ' \n[ { "name" : "get_weather" ,\n "parameters" :  {"city": "Z\\u00fcrich \\\\ \\"[{\\"", "d": [1, {"x": []}]} } ,'
    '{"name":"get_time","parameters":{"zone":"CET"},"extra":[1,"]"]}, 7, {"parameters": {"a": 1}, "name": "get_time"},'
    ' {"name": "get_time", "parameters": 12.5e3 }, {"name": "get_weather", "parameters": tru}, '
    '{"name": "get_\\u0074ime", "parameters": {"open": "still',
]


def materialized(calls: list) -> list:
    """Calls as views of a text alone (a stream's open call reads its text as it grows)."""
    return [c if isinstance(c.arguments, str) else type(c)(c.name, str(c.arguments), c.done, c.valid) for c in calls]


def fed_calls(parser) -> list:
    """The calls a streaming parser has found in the text fed to it so far."""
    calls = []
    while (c := parser.call(len(calls))) is not None:
        calls.append(c)
    return materialized(calls)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=40), which=st.integers(0, len(REQUIRED_TEXTS) - 1))
def test_required_streamed_calls_are_the_whole_texts_parse_after_every_chunk(cuts, which):
    """The incremental parse of a "required" stream (ArrayCallStream, fed each chunk) gives,
    after each chunk, the calls a parse of the whole text so far gives, and the stream adds
    up to the whole response's calls."""
    from tool_parsers import ArrayCallStream, _array_calls

    text = REQUIRED_TEXTS[which]
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    parser = ArrayCallStream("parameters")
    for a, b in zip(bounds, bounds[1:]):
        parser.feed(text[a:b])
        assert fed_calls(parser) == _array_calls(text[:b], "parameters"), b
    deltas, reason = stream(REQUIRED, text, cuts)
    whole, _ = ToolCallStream(REQUIRED, None).message(text, "stop")
    if "tool_calls" in whole:
        assert add_up(deltas)[1] == [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]


def test_required_streams_parse_each_character_a_bounded_number_of_times(monkeypatch):
    """Streamed one character a chunk, a "required" response's text goes through the JSON
    decoder and the bracket scanner a few times in all, not once per chunk (which is
    quadratic in the output's length): each decoder call and each scan counts the
    characters it is handed."""
    handed = [0]
    count_decoding(monkeypatch, handed)
    calls = [{"name": "get_weather", "parameters": {"city": "Paris " * 150, "days": list(range(100))}},
             {"name": "get_time", "parameters": {"zone": {"nested": ["CET"] * 100}}}]
    text = json.dumps(calls)
    deltas, reason = stream(REQUIRED, text, list(range(len(text))))
    assert reason == "tool_calls" and [json.loads(a) for _, a in add_up(deltas)[1]] == [c["parameters"] for c in calls]
    assert handed[0] <= 4 * len(text), (handed[0], len(text))


# tool_choice "auto" texts, with what the hermes parser must get right cut anywhere: plain
# content, blocks among text, a tag's start that is not one, an array block, a block that is
# not a call, text after a call's object inside its block, arguments that never decode,
# whitespace alone in a block, a block left open
AUTO_TEXTS = [
    "Just an answer, with < and <tool and </tool_call> in it.",
    hermes_text(CALLS),
    'Some <tool_c text. <tool_call> {"name": "get_weather", "arguments": {"city": "a\\"}b", "n": [1, {}]}}\n'
    '</tool_call> between <tool_call>[{"name": "get_time", "arguments": {"zone": "CET"}}, {"name": "x", '
    '"arguments": {}}]</tool_call><tool_call>not a call</tool_call> <tool_call>{"name": "get_time", '
    '"arguments": {"a": 1}} trailing {"b": 2}</tool_call><tool_call>{"name": "f", "arguments": }</tool_call>'
    '<tool_call>   </tool_call> after <tool_call>{"name": "get_\\u0074ime", "arguments": {"open": "still',
    'x <tool_call>{"name": "get_weather", "arguments": 12.5e3 </tool_call><tool_call>[{"name": "g", "arguments": {',
]


@settings(max_examples=80, deadline=None)
@given(cuts=st.lists(st.integers(0, 700), max_size=40), which=st.integers(0, len(AUTO_TEXTS) - 1))
def test_auto_streamed_view_is_the_whole_texts_parse_after_every_chunk(cuts, which):
    """The incremental hermes parse of an "auto" stream (HermesToolParser.feed) gives, after
    each chunk, the content and calls a parse of the whole text so far gives, and at the end
    the final parse."""
    text = AUTO_TEXTS[which]
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    parser, content = HermesToolParser(), ""
    for a, b in zip(bounds, bounds[1:]):
        content += parser.feed(text[a:b], False)
        assert (content, fed_calls(parser)) == HermesToolParser().view(text[:b], False), b
    content += parser.feed("", True)
    assert (content, fed_calls(parser)) == HermesToolParser().view(text, True)
    deltas, reason = stream(AUTO, text, cuts)
    whole, whole_reason = ToolCallStream(AUTO, HermesToolParser).message(text, "stop")
    if "tool_calls" in whole:
        assert reason == whole_reason == "tool_calls" and add_up(deltas) == (
            whole["content"] or "", [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]])


class Counted(str):
    """A chunk of text that counts the characters that searches (find), strips, slices and
    concatenations of it, and of the texts made from it, are handed or copy."""

    handed = [0]

    def __add__(self, other: str) -> "Counted":
        Counted.handed[0] += len(self) + len(other)
        return Counted(str(self) + other)

    def __radd__(self, other: str) -> "Counted":
        Counted.handed[0] += len(self) + len(other)
        return Counted(other + str(self))

    def __getitem__(self, key) -> "Counted":
        part = str.__getitem__(self, key)
        Counted.handed[0] += len(part)
        return Counted(part)

    def find(self, sub: str, start: int = 0, *args) -> int:
        Counted.handed[0] += len(self) - max(0, start)
        return str.find(self, sub, start, *args)

    def lstrip(self, *args) -> "Counted":
        Counted.handed[0] += len(self)
        return Counted(str.lstrip(self, *args))

    def strip(self, *args) -> "Counted":
        Counted.handed[0] += len(self)
        return Counted(str.strip(self, *args))


def count_decoding(monkeypatch, handed: list[int]) -> None:
    """Count the characters each JSON decoder call and bracket scan of tool_parsers is handed."""
    import tool_parsers

    class CountingDecoder:
        def raw_decode(self, s: str, idx: int = 0):
            handed[0] += len(s) - idx
            return json.JSONDecoder().raw_decode(s, idx)

    def loads(s: str):
        handed[0] += len(s)
        return json.loads(s)

    def elements(text: str):
        handed[0] += len(text)
        return elements_of(text)

    elements_of = tool_parsers._elements
    monkeypatch.setattr(tool_parsers, "_DECODER", CountingDecoder())
    monkeypatch.setattr(tool_parsers, "json", type("J", (), {"loads": staticmethod(loads), "dumps": json.dumps}))
    monkeypatch.setattr(tool_parsers, "_elements", elements)


def test_auto_streams_parse_each_character_a_bounded_number_of_times(monkeypatch):
    """Streamed one character a chunk, an "auto" response's text goes through the tag
    search, slicing, the JSON decoder and the bracket scanner a few times in all, not once
    per chunk (which is quadratic in the output's length): a long call's arguments too."""
    Counted.handed = handed = [0]
    count_decoding(monkeypatch, handed)
    args = {"city": "Paris " * 150, "days": list(range(100))}
    text = "Let me look that up. " * 40 + hermes_text([("get_weather", args)] * 2 + [("get_time", {"z": 1})], "")
    s = ToolCallStream(AUTO, HermesToolParser)
    deltas = [s.delta(Counted(ch), "stop" if i == len(text) - 1 else None) for i, ch in enumerate(text)]
    assert handed[0] <= 40 * len(text), (handed[0], len(text))
    assert deltas[-1][1] == "tool_calls" and add_up([d for d, _ in deltas]) == (
        "Let me look that up. " * 40, [("get_weather", json.dumps(args))] * 2 + [("get_time", '{"z": 1}')])


@pytest.mark.parametrize("mode", [None, "auto", "required", "named"])
@pytest.mark.parametrize("reasoning", [None, "deepseek_r1"])
def test_a_parsed_stream_handles_each_character_a_bounded_number_of_times(monkeypatch, mode, reasoning):
    """Whatever parses a stream (tool parser, reasoning parser, both, neither), each chunk's
    text is searched, sliced and copied a bounded number of times, the text before it not
    at all (which, one character a chunk, is quadratic in the output's length); without
    either the chunk is its content delta as it comes."""
    Counted.handed = handed = [0]
    count_decoding(monkeypatch, handed)
    calls = [{"name": "get_weather", "parameters": {"city": "Paris " * 300, "days": list(range(200))}}]
    tools = {"auto": AUTO, "required": REQUIRED, "named": ToolChoice("named", {"get_weather": {}})}.get(mode)
    answer = "A long answer, streamed one character a chunk. " * 60 if mode in (None, "auto") else ""
    answer += {"auto": hermes_text([("get_weather", calls[0]["parameters"])], ""), "required": json.dumps(calls),
               "named": json.dumps(calls[0]["parameters"])}.get(mode, "")
    text = ("<think>" + "Hmm, </thin is not the end. " * 60 + "</think>" if reasoning else "") + answer
    s = ToolCallStream(tools, HermesToolParser, reasoning=reasoning and REASONING_PARSERS[reasoning](""))
    deltas = [s.delta(Counted(ch), "stop" if i == len(text) - 1 else None)[0] for i, ch in enumerate(text)]
    assert handed[0] <= (40 * len(text) if tools or reasoning else 0), (handed[0], len(text))
    whole_message, _ = ToolCallStream(tools, HermesToolParser,
                                      reasoning=reasoning and REASONING_PARSERS[reasoning]("")).message(text, "stop")
    streamed = add_up(deltas)
    assert streamed[0] == (whole_message["content"] or "") and "".join(d.get("reasoning", "") for d in deltas) == (
        whole_message.get("reasoning") or "")
    assert streamed[1] == [(c["function"]["name"], c["function"]["arguments"]) for c in whole_message.get("tool_calls", [])]
    if tools is None and reasoning is None:
        assert s.delta("", "length") == ({}, "length")


@pytest.mark.parametrize("tools, text", [
    (REQUIRED, '[{"name": "get_weather", "parameters": {"city": "' + "Paris " * 300 + '"}' + ", 1" * 1000),
    (AUTO, '<tool_call>{"name": "get_weather", "arguments": {"city": "' + "Paris " * 300 + '"}' + ", 1" * 1000),
    (AUTO, '<tool_call>{"arguments": {"city": "' + "Paris " * 300 + '"}' + ", 1" * 1000),
    (AUTO, '<tool_call>{"name": "get_weather", "extra": {"city": "' + "Paris " * 300 + '"}' + ", 1" * 1000),
    (AUTO, '<tool_call>{"name": "get_weather", "arguments": {"city": "' + "Paris " * 300 + '"]' + ", 1" * 1000)])
def test_an_open_call_is_decoded_a_few_times_whatever_follows_at_its_level(monkeypatch, tools, text):
    """An open call's text is decoded again only while what it says can change: not once
    per character written at the call's own level after its arguments closed (or after it
    can no longer be a call, or after arguments that will never decode), which is quadratic
    in the call's length. Streamed one character a chunk."""
    handed = [0]
    count_decoding(monkeypatch, handed)
    deltas, _ = stream(tools, text, list(range(len(text))))
    assert handed[0] <= 4 * len(text), (handed[0], len(text))
    # (the last chunk ends the stream: an open call gets nothing more then, as a whole response's)
    assert add_up(deltas)[1] == [(c.name, c.arguments) for c in ToolCallStream(tools, HermesToolParser)._view(
        text[:-1], False)[1] if c.name is not None]


@pytest.mark.parametrize("mode", [None, "auto", "required", "named"])
def test_a_stream_keeps_its_text_only_while_it_may_be_read(mode):
    """A stream keeps the text after the reasoning only where it may still send it: without
    tools none (each chunk is content as it comes), under "auto" or "required" what was not
    sent as content until a call is sent, under a named tool_choice the call's arguments;
    and what it keeps is about one string per Text.RUN chunks, not one per chunk."""
    from tool_parsers import Text

    tools = {"auto": AUTO, "required": REQUIRED, "named": ToolChoice("named", {"get_weather": {}})}.get(mode)
    answer = "An answer, one character a chunk. " * 100 if mode in (None, "auto") else ""
    call = {"auto": hermes_text([("get_weather", {"city": "Paris " * 300})], ""),
            "required": json.dumps([{"name": "get_weather", "parameters": {"city": "Paris " * 300}}]),
            "named": json.dumps({"city": "Paris " * 300})}.get(mode, "")
    s = ToolCallStream(tools, HermesToolParser, reasoning=REASONING_PARSERS["deepseek_r1"]("<think>\n\n</think>\n\n"))
    for ch in answer:
        s.delta(ch, None)
        assert s.unsent is None if mode is None else len(s.unsent) < len("<tool_call>")
    for ch in call:
        s.delta(ch, None)
    assert s.unsent is None and (s.body is None) == (mode != "named")
    if mode == "named":
        assert s.body.whole() == call
    text = Text()
    for ch in call * 3:
        text.append(ch)
    assert text[:] == call * 3 and len(text.parts) <= len(call) * 3 // Text.RUN + Text.RUN


@settings(max_examples=200, deadline=None)
@given(chunks=st.lists(st.text(max_size=3), max_size=300), reads=st.lists(st.tuples(st.integers(-5, 905), st.integers(-5, 905))))
def test_a_text_kept_as_its_chunks_reads_as_the_text(chunks, reads):
    """Text (chunks joined in runs, runs into its head) reads as the joined string, anywhere."""
    from tool_parsers import Text

    text, whole = Text(), ""
    for k, chunk in enumerate(chunks):
        text.append(chunk)
        whole += chunk
        i, j = reads[k % len(reads)] if reads else (0, None)
        assert (len(text), text[i:j], text[i:]) == (len(whole), whole[i:j], whole[i:])
    assert text.whole() == whole == text[:]
    text.drop(len(whole) // 2)
    assert (len(text), text[:]) == (len(whole) - len(whole) // 2, whole[len(whole) // 2:])


# The pieces a response is built from, for every parser: its tags whole and cut short, call
# objects (a "required" array's and a <tool_call> block's, bare, in tags, in an array, of any
# JSON and spacing), JSON's brackets, strings, escapes and literals, plain text, whitespace
# and non-ASCII text; the whole may be cut short anywhere.
PIECES = ["<think>", "</think>", "<thi", "</th", "<tool_call>", "</tool_call>", "<tool_c", "</tool_", "<", "/", ">",
          '{"name": "get_time", "arguments": ', '"name"', '"arguments"', '"parameters"', '"get_time"', "[", "]", "{",
          "}", ",", ":", '"', "\\", "12.5", "tru", "e", " ", "\n", "Paris", "é", "🙂", "日本"]
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) |
                    st.text(max_size=6), lambda inner: st.lists(inner, max_size=3) |
                    st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)


@st.composite
def call_text(draw, key: str) -> str:
    call = {"name": draw(st.sampled_from(["get_weather", "get_time", "not_a_tool"])),
            key: draw(st.dictionaries(st.text(max_size=4), JSON, max_size=3) | JSON)}
    if draw(st.booleans()):
        call = {k: call[k] for k in reversed(call)}
    separators = draw(st.sampled_from([(", ", ": "), (",", ":"), (" ,\n ", " :  ")]))
    return json.dumps(call, separators=separators, ensure_ascii=draw(st.booleans()))


@st.composite
def response(draw, mode: str | None, reasoning: bool) -> str:
    """A response for that tool_choice mode (and a reasoning parser): mostly of its form,
    with pieces of any form around and in it, often cut short."""
    noise = st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=4).map("".join)
    blocks = st.lists(call_text("arguments"), min_size=1, max_size=2).map(
        lambda calls: "<tool_call>\n" + (calls[0] if len(calls) == 1 else "[" + ", ".join(calls) + "]") + "\n</tool_call>")
    array = st.lists(call_text("parameters"), max_size=3).map(lambda calls: "[" + ", ".join(calls) + "]")
    body = {"required": array, "named": JSON.map(json.dumps), None: noise,
            "auto": st.lists(noise | blocks, max_size=4).map("".join)}[mode]
    parts = [draw(body)]
    if reasoning:
        parts.insert(0, draw(st.sampled_from(["<think>", "", " \n<think>"])) + draw(noise) +
                     draw(st.sampled_from(["</think>", "</think>\n\n", ""])))
    if draw(st.booleans()):  # pieces of another form, anywhere
        parts.insert(draw(st.integers(0, len(parts))), draw(noise | blocks | array))
    text = "".join(parts)
    return text[:draw(st.integers(0, len(text)))] if draw(st.booleans()) else text


def reference_deltas(make, text: str, bounds: list[int], reason: str) -> list[tuple[dict, str | None]]:
    """The deltas of `text` cut at `bounds` the straightforward way: after every chunk the
    whole text so far is parsed (message()'s parse: the reasoning parser's split, then the
    tool parser's view, every call), and what was not sent yet is sent, as one delta per
    call: each call that is one so far (named, and complete only if it parses) at the next
    index (parallel_tool_calls false: one call in all), its arguments as they grow; a call
    that no longer is one gets nothing more. At the end, if no call was sent, the text
    (after the reasoning) is content; "tool_calls" only if a call was sent and the output
    stopped on its own (vLLM's: one cut by max_tokens ends "length")."""
    s = make()
    sent: dict[int, list[int]] = {}  # a call's place in the parse -> [its index, characters of its arguments sent]
    content_sent, reasoning_sent, out = 0, 0, []
    for k, b in enumerate(bounds[1:]):
        final, delta = k == len(bounds) - 2, {}
        thought, body = (None, text[:b]) if s.reasoning is None else s.reasoning.split(text[:b], final)
        if thought is not None and len(thought) > reasoning_sent:
            if s.include_reasoning:
                delta["reasoning"] = thought[reasoning_sent:]
            reasoning_sent = len(thought)
        content, calls = s._view(body or "", final)
        for p, c in enumerate(calls):
            if c.name is None or not c.valid or (p not in sent and sent and not s.parallel):
                continue
            if p not in sent:
                sent[p] = [len(sent), 0]
                delta.setdefault("tool_calls", []).append({"index": sent[p][0], "type": "function",
                                                           "function": {"name": c.name}})
            if len(c.arguments) > sent[p][1]:
                if not delta.get("tool_calls") or delta["tool_calls"][-1]["index"] != sent[p][0]:
                    delta.setdefault("tool_calls", []).append({"index": sent[p][0], "function": {}})
                delta["tool_calls"][-1]["function"]["arguments"], sent[p][1] = c.arguments[sent[p][1]:], len(c.arguments)
        if final and not sent:
            content = body or ""
        if len(content) > content_sent:
            delta["content"], content_sent = content[content_sent:], len(content)
        finish = None
        if final:
            finish = "tool_calls" if sent and s.tools.mode != "named" and reason == "stop" else reason
        out.append((delta, finish))
    return out


@settings(max_examples=500, deadline=None)
@given(data=st.data(), cuts=st.lists(st.integers(0, 400), max_size=40),
       mode=st.sampled_from(["auto", "required", "named", None]),
       tool_parser=st.sampled_from(sorted(TOOL_PARSERS)), reasoning=st.sampled_from([None, *sorted(REASONING_PARSERS)]),
       prompt=st.sampled_from(["", "<think>\n\n</think>\n\n"]), thinking=st.booleans(), parallel=st.booleans(),
       include_reasoning=st.booleans(), reason=st.sampled_from(["stop", "length"]))
def test_every_parsers_incremental_deltas_are_the_whole_texts_parse_after_every_chunk(
        data, cuts, mode, tool_parser, reasoning, prompt, thinking, parallel, include_reasoning, reason):
    """For every registered tool and reasoning parser (and tool_choice mode), a response
    streamed in any chunks gives exactly the deltas that parsing the whole text so far after
    every chunk gives; they add up to the whole response's message (reasoning, content,
    calls and finish_reason) whenever it has calls, or none was streamed; and whatever the
    text, a stream ends "tool_calls" only if it sent a call, and loses no text: one that
    sent no call sends it all as content."""
    text = data.draw(response(mode, reasoning is not None))
    tools = None if mode is None else ToolChoice(mode, {"get_weather": {}} if mode == "named" else AUTO.tools)

    def make() -> ToolCallStream:
        return ToolCallStream(tools, TOOL_PARSERS[tool_parser], parallel,
                              reasoning and REASONING_PARSERS[reasoning](prompt, thinking), include_reasoning)

    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    s = make()
    got = [s.delta(text[a:b], reason if k == len(bounds) - 2 else None) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    for delta, _ in got:  # (a call's id is random: its first delta has one)
        for c in delta.get("tool_calls", []):
            assert "id" not in c or c.pop("id").startswith("call_")
    assert got == reference_deltas(make, text, bounds, reason)

    whole_message, whole_reason = make().message(text, reason)
    deltas = [d for d, _ in got]
    assert "".join(d.get("reasoning", "") for d in deltas) == (whole_message.get("reasoning") or "")
    content, calls = add_up([{**d, "tool_calls": [c | ({"id": "x"} if "type" in c else {}) for c in
                                                   d.get("tool_calls", [])]} for d in deltas])
    event(f"{mode} {reasoning}: calls streamed {len(calls)}, whole {len(whole_message.get('tool_calls', []))}, "
          f"reasoning {bool(whole_message.get('reasoning'))}, content {bool(whole_message['content'])}")
    if "tool_calls" in whole_message or not calls:  # (no call streamed: the whole has none either)
        assert (content, calls, got[-1][1]) == (whole_message["content"] or "", [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole_message.get("tool_calls", [])], whole_reason)
    if got[-1][1] == "tool_calls":
        assert calls, "finish_reason tool_calls, but no tool call was sent"
    if not calls:  # no text lost: what was held back came as content at the end
        body = text if reasoning is None else make().reasoning.split(text, True)[1] or ""
        assert content == body
    assert len(calls) <= 1 or parallel


def test_a_function_defined_twice_is_vllms_last_when_named_and_either_under_required():
    """vLLM takes tools that share a name: a named tool_choice looks the name up in a
    name -> function dict (the last definition), "required" admits a call of any of them
    (its schema's anyOf has one entry per tool)."""
    import jsonschema

    def takes(key: str) -> dict:
        return {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {key: {"type": "integer"}}, "required": [key],
            "additionalProperties": False}}}

    body = {"tools": [takes("a"), takes("b")]}
    named, _ = tool_choice(body | {"tool_choice": {"type": "function", "function": {"name": "f"}}}, True, False)
    assert named.tools == {"f": takes("b")["function"]["parameters"]}
    required = body | {"tool_choice": "required"}
    schema = parse_structured(required, tool_choice(required, True, False)[0]).json
    schema = json.loads(schema) if isinstance(schema, str) else schema
    for call in ({"a": 1}, {"b": 1}):
        jsonschema.validate([{"name": "f", "parameters": call}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"c": 1}}], schema)


def test_a_response_cut_by_max_tokens_ends_length_whatever_calls_it_has_as_vllms():
    """vLLM says "tool_calls" only for an output that stopped on its own
    (vllm/entrypoints/serve/utils/tool_calls_utils.py resolve_finish_reason, for whole and
    streamed responses), so a client can tell a call cut by max_tokens from a whole one."""
    cut = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    done = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> and th'
    for text, cuts in ((cut, list(range(len(cut)))), (done, []), (done, list(range(len(done))))):
        deltas, reason = stream(AUTO, text, cuts, reason="length")
        assert add_up(deltas)[1] and reason == "length", (text, cuts)  # (a call sent, yet "length")
    message, reason = ToolCallStream(AUTO, HermesToolParser).message(done, "length")
    assert message["tool_calls"] and reason == "length"
    assert stream(AUTO, done, [], reason="stop")[1] == "tool_calls"
    assert ToolCallStream(AUTO, HermesToolParser).message(done, "stop")[1] == "tool_calls"


@pytest.mark.parametrize("arguments", ['"{\\"city\\": \\"Paris\\"}"', "null", "12", '["Paris"]'])
def test_hermes_arguments_that_are_not_an_object_are_still_the_call_whole_and_streamed_as_vllms(arguments):
    """vLLM's Hermes2ProToolParser takes a block's "arguments" whatever JSON they are
    (json.dumps of the value, whole; the value's text, streamed), so a model that writes them
    as a string gets its call either way: the whole response is not content while the
    stream sends the call."""
    text = f'Checking. <tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>'
    message, reason = ToolCallStream(AUTO, HermesToolParser).message(text, "stop")
    assert message["content"] == "Checking. " and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", json.loads(arguments))]
    for cuts in ([], list(range(len(text)))):
        deltas, reason = stream(AUTO, text, cuts)
        assert add_up(deltas) == ("Checking. ", [("get_weather", arguments)]) and reason == "tool_calls"
    # a block without "arguments" is no call (vLLM's KeyError): the whole text is content
    text = '<tool_call>{"name": "get_weather"}</tool_call>'
    assert ToolCallStream(AUTO, HermesToolParser).message(text, "stop") == ({"role": "assistant", "content": text},
                                                                            "stop")


@pytest.mark.parametrize("tools, text, arguments", [
    (AUTO, '<tool_call>{"name": "get_weather", "arguments": {"a": 1,}}</tool_call>', '{"a": 1,}'),
    (AUTO, '<tool_call>{"name": "get_weather", "arguments": {"a": "\\x"} }\n</tool_call> Done.', '{"a": "\\x"}'),
    (REQUIRED, '[{"name": "get_weather", "parameters": {"a": [1,]}}, {"name": "get_time", "parameters": {}}]',
     '{"a": [1,]}')])
def test_streamed_arguments_that_do_not_decode_end_where_their_brackets_close_as_vllms(tools, text, arguments):
    """vLLM's streaming hermes parser cuts a call's arguments where their braces close, decode
    or not (Hermes2ProToolParser._extract_tool_args), so what follows them (the call
    object's own brace, the </tool_call> tag as it is written) never goes out as arguments."""
    deltas, _ = stream(tools, text, list(range(len(text))))
    assert add_up(deltas)[1][0] == ("get_weather", arguments)


def test_a_call_cut_by_max_tokens_streams_all_its_arguments_as_vllms():
    """The last chunk of a call cut short is streamed too (vLLM's stream sends the open
    region's arguments as written, Hermes2ProToolParser._extract_tool_call_jsons); its whole
    response, whose calls must parse, is content. Ended on a complete call without its end
    tag, both have the call."""
    cut = 'I will look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    for cuts in ([], [30], list(range(len(cut)))):
        deltas, reason = stream(AUTO, cut, cuts, reason="length")
        assert add_up(deltas) == ("I will look. ", [("get_weather", '{"city": "Par')]) and reason == "length"
    assert ToolCallStream(AUTO, HermesToolParser).message(cut, "length") == (
        {"role": "assistant", "content": cut}, "length")
    whole = cut + 'is"}}'
    deltas, reason = stream(AUTO, whole, list(range(len(whole))))
    message, _ = ToolCallStream(AUTO, HermesToolParser).message(whole, "stop")
    assert add_up(deltas)[1] == [("get_weather", '{"city": "Paris"}')] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def test_auto_tool_choice_keeps_the_special_tokens_its_parser_reads_as_vllms():
    """Some tokenizers mark <tool_call> special; vLLM's hermes parser (adjust_request) turns
    skip_special_tokens off for a request whose calls it parses, else the tags would be gone
    from the text before the parser saw them. A tokenizer whose tags are special ids:"""
    from tokenizer import ByteTokenizer, decoder

    class SpecialTags(ByteTokenizer):
        vocab_size = 261
        _SPECIAL_TEXT = ByteTokenizer._SPECIAL_TEXT | {259: "<tool_call>", 260: "</tool_call>"}

    ids = [*b"Sure. ", 259, *b'{"name": "get_weather", "arguments": {"city": "Paris"}}', 260]
    body = {"tools": [WEATHER], "skip_special_tokens": True}
    auto, _ = tool_choice(body, chat=True, auto=True)
    text = decoder(SpecialTags(), parse_sampling(body, 3, 64, chat=True, tools=auto))(ids)
    message, reason = ToolCallStream(auto, HermesToolParser).message(text, "stop")
    assert message["content"] == "Sure. " and reason == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]
    # no call parsed (tool_choice "none"): the request's own
    tools, _ = tool_choice(body | {"tool_choice": "none"}, chat=True, auto=True)
    assert tools is None and parse_sampling(body, 3, 64, chat=True, tools=tools).skip_special_tokens is True
