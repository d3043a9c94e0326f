"""--reasoning-parser (reasoning_parsers.py), as vLLM: the model's thinking comes back as the
chat message's `reasoning`, apart from its content.

Claims: each parser splits vLLM's examples as vLLM's parsers do; streamed in any pieces,
the reasoning and content deltas add up to the whole response's; tool calls are parsed from
the content only; through HTTP on the tiny model, the flag, the prompt's own end tag,
enable_thinking / reasoning_effort and include_reasoning act as vLLM's, and a constraint
holds once thinking ends."""

from __future__ import annotations

import asyncio
import json
import re

import jinja2
import pytest
from hypothesis import given, settings, strategies as st

from conftest import tiny_async_engine
from reasoning_parsers import REASONING_PARSERS
from tokenizer import ByteTokenizer
from tool_parsers import HermesToolParser, ToolCallStream, ToolChoice

# (output, reasoning, content) under deepseek_r1, and under qwen3 with thinking on and off
CASES = [
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    ("</think>This is the rest", "", "This is the rest"),
    ("<think>Still thinking when cut off", "Still thinking when cut off", None),
    ("no tags at all", "no tags at all", None),
    ("\n<think>thought</think>\n\nanswer", "thought", "\n\nanswer"),
    ("preamble <think>thought</think>answer", "preamble <think>thought", "answer"),  # only an opening <think>
    ("<think>a</think>b</think>c", "a", "b</think>c"),
]
# thinking off: output that does not open with <think> is content, tags and all
QWEN3_THINKING_OFF = {o: (None, o) for o in ("no tags at all", "This is a reasoning section</think>This is the rest",
                                             "</think>This is the rest", "preamble <think>thought</think>answer")}


@pytest.mark.parametrize("output, reasoning, content", CASES)
def test_each_parser_splits_vllms_examples_as_vllm(output, reasoning, content):
    for name in ("deepseek_r1", "qwen3"):
        assert REASONING_PARSERS[name]("<|im_start|>assistant\n").split(output, True) == (reasoning, content)
    off = REASONING_PARSERS["qwen3"]("<|im_start|>assistant\n", False).split(output, True)
    assert off == QWEN3_THINKING_OFF.get(output, (reasoning, content))
    # a prompt whose reasoning already ended: as thinking off, output that opens with <think>
    # still thinks (an earlier turn's </think> near the prompt's end: a Qwen3 agent loop's)
    for ended in ("<|im_start|>assistant\n<think>\n\n</think>\n\n",
                  '<think>\nplan\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
                  "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"):
        for name in ("deepseek_r1", "qwen3"):
            assert REASONING_PARSERS[name](ended).split(output, True) == QWEN3_THINKING_OFF.get(output, (reasoning, content))


class TagTokens(ByteTokenizer):
    """Bytes, and `<think>` and `</think>` one id each, as in Qwen3's and DeepSeek-R1's vocabularies."""

    TAGS = {300: "<think>", 301: "</think>"}

    def ids(self, text: str) -> list[int]:
        ids_of = {v: k for k, v in self.TAGS.items()}
        return [i for part in re.split("(</?think>)", text) for i in ([ids_of[part]] if part in ids_of
                                                                      else list(part.encode()))]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.TAGS.get(i) or super(TagTokens, self).decode([i], skip_special_tokens) for i in ids)


def vllm_count(ids: list[int]) -> int:
    """vLLM's BaseThinkingReasoningParser.count_reasoning_tokens: the ids between a start and
    an end tag id, nested starts counted in depth, the tags themselves not."""
    count = depth = 0
    for i in ids:
        if i == 300:
            depth += 1
        elif i == 301:
            depth = max(depth - 1, 0)
        else:
            count += depth > 0
    return count


@pytest.mark.parametrize("output, reasoning, content", CASES)
def test_reasoning_tokens_are_the_tokens_of_the_reasoning_as_vllms_count(output, reasoning, content):
    """usage's reasoning_tokens: the output's tokens that spell the message's reasoning (tags
    one token each, as in the models these parsers are for); for an output that opens its
    think block, what vLLM's count of the ids between the tags gives. Thinking off, or a
    prompt that closed the block: those of a think block the output opens only."""
    from sampling_params import SamplingParams
    from serving import count_reasoning_tokens

    tok, prompt = TagTokens(), "<|im_start|>assistant\n"
    ids = tok.ids(output)
    assert tok.decode(ids) == output

    def count(parser) -> int:
        return count_reasoning_tokens(parser, output, ids, tok, [], SamplingParams())
    for name in ("deepseek_r1", "qwen3"):
        assert count(REASONING_PARSERS[name](prompt)) == len(tok.ids(reasoning or "")), name
    if output.lstrip().startswith("<think>"):
        assert count(REASONING_PARSERS["qwen3"](prompt)) == vllm_count(ids)
    off = QWEN3_THINKING_OFF.get(output, (reasoning, content))[0]
    assert count(REASONING_PARSERS["qwen3"](prompt, False)) == len(tok.ids(off or ""))
    assert count(REASONING_PARSERS["deepseek_r1"](prompt + "<think>\n\n</think>\n\n")) == len(tok.ids(off or ""))


def stream(s: ToolCallStream, text: str, cuts: list[int]) -> tuple[list[dict], str | None]:
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    out, last = [], None
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        delta, last = s.delta(text[a:b], "stop" if k == len(bounds) - 2 else None)
        out.append(delta)
    return out, last


PIECES = ["<think>", "</think>", "<thi", "</th", "<", "/", ">", "abc", " ", "\n", "think"]


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=12), cuts=st.lists(st.integers(0, 80), max_size=10),
       name=st.sampled_from(sorted(REASONING_PARSERS)), thinking=st.booleans())
def test_streamed_in_any_pieces_the_deltas_add_up_to_the_whole_message(parts, cuts, name, thinking):
    text = "".join(parts)
    whole, _ = ToolCallStream(None, reasoning=REASONING_PARSERS[name]("", thinking)).message(text, "stop")
    deltas, reason = stream(ToolCallStream(None, reasoning=REASONING_PARSERS[name]("", thinking)), text, cuts)
    assert reason == "stop"
    assert "".join(d.get("reasoning", "") for d in deltas) == (whole["reasoning"] or "")
    assert "".join(d.get("content", "") for d in deltas) == (whole["content"] or "")


def test_thinking_off_an_end_tag_after_sent_content_stays_content_streamed_and_whole():
    """qwen3 with thinking off sends output that did not open a think block as content: an
    end tag coming later cannot take that text back, so the whole message agrees (not a
    stream of "abc", then only "w" of "xyzw")."""
    def parser() -> ToolCallStream:
        return ToolCallStream(None, reasoning=REASONING_PARSERS["qwen3"]("", False))
    deltas, _ = stream(parser(), "abc</think>xyzw", [3])
    whole, _ = parser().message("abc</think>xyzw", "stop")
    assert [d.get("content") for d in deltas] == ["abc", "</think>xyzw"] and not any("reasoning" in d for d in deltas)
    assert whole["content"] == "abc</think>xyzw" and whole["reasoning"] is None
    # a model that opens the block itself thinks, with thinking off too
    deltas, _ = stream(parser(), "<think>abc</think>xyz", [10])
    assert "".join(d.get("reasoning", "") for d in deltas) == "abc"
    assert "".join(d.get("content", "") for d in deltas) == "xyz"


def test_a_partial_tag_is_held_back_until_it_is_known():
    s = ToolCallStream(None, reasoning=REASONING_PARSERS["deepseek_r1"](""))
    assert s.delta("<thi", None) == ({}, None)  # may be "<think>"
    assert s.delta("nk>I think</th", None) == ({"reasoning": "I think"}, None)  # "</th" may be the end tag
    assert s.delta("ere", None) == ({"reasoning": "</there"}, None)  # it was not
    assert s.delta("</think>Yes.", "stop") == ({"content": "Yes."}, "stop")


def test_tool_calls_are_parsed_from_the_content_only():
    auto = ToolChoice("auto", {"f": {}}, [])
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    text = f"<think>Maybe {call} is wrong</think>Calling. {call}"
    s = ToolCallStream(auto, HermesToolParser, reasoning=REASONING_PARSERS["qwen3"](""))
    message, reason = s.message(text, "stop")
    assert reason == "tool_calls" and message["reasoning"] == f"Maybe {call} is wrong"
    assert message["content"] == "Calling. " and len(message["tool_calls"]) == 1
    message, reason = ToolCallStream(auto, HermesToolParser, reasoning=REASONING_PARSERS["qwen3"]("")).message(
        f"<think>only {call} thought of</think>", "stop")
    assert reason == "stop" and "tool_calls" not in message and message["content"] is None


def test_a_named_call_begins_with_its_arguments_after_the_reasoning_as_vllms():
    """vLLM's stream names a tool_choice function only with the first text after the
    reasoning: none while the model thinks, and none at all from an output cut off while
    thinking (whole or streamed), which would be a call whose arguments are "", no JSON."""
    named = ToolChoice("named", {"f": {"type": "object"}}, [])

    def parser() -> ToolCallStream:
        return ToolCallStream(named, reasoning=REASONING_PARSERS["deepseek_r1"](""))
    deltas, reason = stream(parser(), "still thinking", [5])
    whole, whole_reason = parser().message("still thinking", "length")
    assert not any("tool_calls" in d for d in deltas) and "tool_calls" not in whole
    assert whole["reasoning"] == "still thinking" and whole_reason == "length"
    text = 'hmm</think>{"a": 1}'
    for cuts in ([3], [5, 12], [11, 13]):
        deltas, reason = stream(parser(), text, cuts)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "f" and calls[0]["function"]["arguments"]  # named with its start
        assert "".join(c["function"].get("arguments", "") for c in calls) == '{"a": 1}' and reason == "stop"
    whole, _ = parser().message(text, "stop")
    assert [c["function"] for c in whole["tool_calls"]] == [{"name": "f", "arguments": '{"a": 1}'}]


def test_include_reasoning_false_sends_no_reasoning():
    s = ToolCallStream(None, reasoning=REASONING_PARSERS["qwen3"](""), include_reasoning=False)
    message, _ = s.message("<think>x</think>y", "stop")
    assert message == {"role": "assistant", "content": "y", "reasoning": None}
    deltas, _ = stream(ToolCallStream(None, reasoning=REASONING_PARSERS["qwen3"](""), include_reasoning=False),
                       "<think>x</think>y", [1, 3, 9])
    assert all("reasoning" not in d for d in deltas) and "".join(d.get("content", "") for d in deltas) == "y"


class ThinkingTemplate(ByteTokenizer):
    """Bytes, with a Qwen3-like chat template: thinking off writes an empty think block."""

    TEMPLATE = jinja2.Template(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, tools=None, **variables):
        text = self.TEMPLATE.render(messages=messages, **variables)
        return self.encode(text) if tokenize else text


class OpenBlockTemplate(ThinkingTemplate):
    """A template that writes no think block, thinking on or off: the prompt never closes one."""

    TEMPLATE = jinja2.Template(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def post():
    """post(parser, body) -> the chat response's message, whole, and as its stream added up,
    from a tiny engine with that --reasoning-parser (None: without)."""
    from contextlib import ExitStack

    from aiohttp.test_utils import TestClient, TestServer

    import server

    with ExitStack() as stack:
        engines: dict = {}

        async def one(engine, body: dict) -> tuple[dict, list[dict]]:
            app = server.build_app(engine, ["tiny"])
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0.0} | body
            async with TestClient(TestServer(app)) as client:
                resp = await client.post("/v1/chat/completions", json=body)
                assert resp.status == 200, await resp.text()
                whole = json.loads(await resp.text())
                resp = await client.post("/v1/chat/completions",
                                         json=body | {"stream": True, "stream_options": {"include_usage": True}})
                lines = (await resp.text()).splitlines()
                return whole, [json.loads(line[6:]) for line in lines if line.startswith("data: {")]

        def run(parser: str | None, body: dict, template: type = ThinkingTemplate,
                raw: bool = False) -> tuple[dict, dict | list[dict]]:
            """raw: the whole response and the stream's chunks as they came."""
            if (parser, template) not in engines:
                engines[parser, template] = stack.enter_context(tiny_async_engine(template(), reasoning_parser=parser))
            loop, engine = engines[parser, template]
            whole, chunks = loop.run_until_complete(asyncio.wait_for(one(engine, body), 300))
            if raw:
                return whole, chunks
            added: dict = {}
            for delta in (c["choices"][0]["delta"] for c in chunks if c["choices"]):
                for k, v in delta.items():
                    if isinstance(v, str):
                        added[k] = added.get(k, "") + v
            return whole["choices"][0]["message"], added

        yield run


def test_the_flag_splits_the_answer_and_the_request_fields_act_as_vllms(post):
    plain, _ = post(None, {})
    text = plain["content"]  # the tiny model's greedy bytes, with no think tags: all reasoning if thinking
    assert plain["reasoning"] is None and text  # (vLLM's message has the field, null without a parser)
    for name in ("deepseek_r1", "qwen3"):
        whole, added = post(name, {})
        assert (whole["reasoning"], whole["content"]) == (text, None)
        assert added.get("reasoning") == text and not added.get("content")
    # thinking switched off: the template ends the reasoning in the prompt, so all is content
    for body in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        whole, added = post("qwen3", body)
        assert whole["reasoning"] is None and whole["content"] and added.get("content") == whole["content"]
    whole, added = post("qwen3", {"include_reasoning": False})
    assert (whole["reasoning"], whole["content"]) == (None, None) and "reasoning" not in added


def test_include_reasoning_false_sends_no_logprobs_nor_token_ids_that_would_show_the_reasoning_as_vllm(post):
    """vLLM's include_reasoning false under a reasoning parser hides the reasoning's tokens
    too: no logprobs and no token ids, whole or streamed (asked for or not), so a stream
    sends no chunk for reasoning alone; the usage still counts every token. The tiny model
    never writes `</think>`: all its tokens are reasoning, so the stream is the role's chunk
    and the last (the finish_reason's) alone."""
    body = {"include_reasoning": False, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    whole, chunks = post("qwen3", body, raw=True)
    choice = whole["choices"][0]
    assert whole["usage"]["completion_tokens"] > 1 and whole["prompt_token_ids"], whole
    assert (choice["message"]["reasoning"], choice["logprobs"], choice["token_ids"]) == (None, None, None), choice
    parts = [c["choices"][0] for c in chunks if c["choices"]]
    assert [(p["delta"].get("role"), p["finish_reason"]) for p in parts] == [("assistant", None), (None, "length")]
    assert all(p["logprobs"] is None and p.get("token_ids") is None and not p["delta"].get("reasoning") for p in parts)
    shown, _ = post("qwen3", body | {"include_reasoning": True}, raw=True)  # (the same answer, shown)
    assert len(shown["choices"][0]["logprobs"]["content"]) == len(shown["choices"][0]["token_ids"]) > 1


def test_usage_counts_the_reasoning_tokens_whole_and_streamed_as_vllm(post):
    """vLLM's usage.completion_tokens_details.reasoning_tokens under a --reasoning-parser,
    shown or not: the tiny model never writes `</think>`, so with thinking on its every
    token is reasoning, with it off none; in the whole response and the stream's usage
    chunk alike (never a continuous_usage_stats chunk's). Without a parser: null whole,
    absent streamed (vLLM drops its None fields there)."""
    cases = [("qwen3", {}, "all"), ("qwen3", {"include_reasoning": False}, "all"), ("deepseek_r1", {}, "all"),
             ("qwen3", {"chat_template_kwargs": {"enable_thinking": False}}, 0), (None, {}, None)]
    for parser, body, expect in cases:
        whole, chunks = post(parser, body, raw=True)
        use, streamed = whole["usage"], chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and streamed["completion_tokens"] == use["completion_tokens"] == 12
        details = None if expect is None else {"reasoning_tokens": 12 if expect == "all" else expect}
        assert use["completion_tokens_details"] == details, (parser, body, use)
        assert streamed.get("completion_tokens_details") == details and \
            ("completion_tokens_details" in streamed) == (details is not None), (parser, body, streamed)


def test_a_constraint_holds_once_thinking_ends(post):
    """As vLLM: the grammar waits for the end of thinking. Thinking switched off (the
    prompt closes the block): constrained from the first token. Thinking on, and the tiny
    model never writing `</think>`: free, so its 12 tokens are reasoning, not 3 of [ab]."""
    rx = {"structured_outputs": {"regex": "[ab]{3}"}}
    whole, _ = post("qwen3", rx | {"chat_template_kwargs": {"enable_thinking": False}})
    assert whole["reasoning"] is None and re.fullmatch("[ab]{3}", whole["content"]), whole
    whole, _ = post("qwen3", rx)
    assert whole["content"] is None and len(whole["reasoning"].encode()) >= 4, whole
    whole, _ = post(None, rx)
    assert re.fullmatch("[ab]{3}", whole["content"])  # without a parser: constrained from the start


def test_thinking_off_constrains_from_the_first_token_when_the_prompt_leaves_the_block_open(post):
    """qwen3 with thinking off reads output that does not open with `<think>` as content, so
    the constraint starts there too, even when the template wrote no closed block; under
    deepseek_r1, which has no switch, the output is reasoning until `</think>` whatever the
    request says, and the grammar waits for it (the tiny model never writes it)."""
    rx = {"structured_outputs": {"regex": "[ab]{3}"}}
    for off in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        whole, added = post("qwen3", rx | off, OpenBlockTemplate)
        assert whole["reasoning"] is None and re.fullmatch("[ab]{3}", whole["content"]), whole
        assert added.get("content") == whole["content"] and not added.get("reasoning")
    whole, _ = post("qwen3", rx, OpenBlockTemplate)  # thinking on: the grammar waits
    assert whole["content"] is None and len(whole["reasoning"].encode()) >= 4, whole
    whole, _ = post("deepseek_r1", rx | {"chat_template_kwargs": {"enable_thinking": False}}, OpenBlockTemplate)
    assert whole["content"] is None and len(whole["reasoning"].encode()) >= 4, whole


class SplitTag(ByteTokenizer):
    """Bytes, and two ids that spell `</think>` between them as a BPE tokenizer without a
    token for the tag may: " </" then "think>" (SmolLM2 writes " </" "think" ">" after a
    space), never the bytes that encode("</think>") gives."""

    PIECES = {300: " </", 301: "think>"}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.PIECES.get(i) or super(SplitTag, self).decode([i], skip_special_tokens) for i in ids)


def test_offline_chat_reads_enable_thinking_for_where_the_constraint_starts():
    from llm import LLM, SamplingParams
    from sampling_params import StructuredOutputsParams

    llm = LLM("tiny", max_num_seqs=2, max_model_len=128, warmup=False, reasoning_parser="qwen3", log=lambda *_: None)
    llm.tokenizer = OpenBlockTemplate()  # (bytes, as the tiny model's own)
    params = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[ab]{3}"))
    chat = [{"role": "user", "content": "hi"}]
    off = llm.chat(chat, params, chat_template_kwargs={"enable_thinking": False})[0].outputs[0].text
    on = llm.chat(chat, params)[0].outputs[0].text
    assert re.fullmatch("[ab]{3}", off) and len(on.encode()) >= 4 and not re.fullmatch("[ab]{3}", on), (off, on)
    # The grammar starts after the end tag as the parser reads it, in the text: here spelled
    # in pieces that the tag's own encoding does not have (a tokenizer without a tag token).
    llm.engine.tokenizer = SplitTag()
    seq = llm.engine.add_request("split-tag", list(b"hi"), params)
    for token in [*b"x no", 300]:
        assert seq.constraint.accept(token) and not seq.constraint.active
    assert seq.constraint.accept(301) and seq.constraint.active
    llm.engine.abort("split-tag")


def test_after_reasoning_frees_the_tokens_until_the_end_tag_then_applies_the_grammar():
    """As the reasoning parser reads it: the tag in the output's text, however the tokens
    spell it (each gate's tokens ending with the tag, the grammar starts at the next)."""
    from sampling_params import StructuredOutputsParams
    from structured import GrammarCompiler, new_constraint

    grammars = GrammarCompiler(ByteTokenizer(), 512, [257])
    text = SplitTag().decode
    for thought, tag in ((b"x <think> no</think", [ord(">")]), (b"x no", [300, 301])):
        gate = new_constraint(grammars.compile(StructuredOutputsParams(regex="[ab]{3}")).deep_copy(), "</think>",
                              lambda t: text([t]))
        for token in thought:
            assert gate.accept(token) and not gate.active and not gate.stopped
        assert all(gate.accept(t) for t in tag) and gate.active, thought
        assert not gate.accept(ord("x"))  # now the grammar's: "x" is refused
    gate = new_constraint(grammars.compile(StructuredOutputsParams(regex="[ab]{3}")).deep_copy(), "</think>",
                          lambda t: text([t]))
    for token in b"</think>aba":
        assert gate.accept(token)
    assert gate.stopped


def test_an_unknown_reasoning_parser_is_refused_where_it_enters(capsys):
    import cli_args
    from config import EngineConfig

    with pytest.raises(SystemExit):
        cli_args.build_parser().parse_args(["--reasoning-parser", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="reasoning_parser must be deepseek_r1 or qwen3, got 'nope'"):
        EngineConfig(reasoning_parser="nope")


# outputs with what the split must get right cut anywhere: a tag split across chunks, with
# and without its end, whitespace before the opening tag, text that only starts like a tag,
# a second end tag, no tags, a tool call after the reasoning
TEXTS = ["<think>I think </th, so </think>The answer.", "  \n <think>still thinking <thin </thi",
         "no tags, only < and </ and <think", "early</think>content</think>more", " <thi", "\n\n",
         '<think>x</think>Calling. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>']


@settings(max_examples=150, deadline=None)
@given(cuts=st.lists(st.integers(0, 100), max_size=30), which=st.integers(0, len(TEXTS) - 1),
       name=st.sampled_from(sorted(REASONING_PARSERS)), thinking=st.booleans(), prompt=st.sampled_from(["", "</think>"]))
def test_the_streamed_split_is_the_whole_outputs_split_after_every_chunk(cuts, which, name, thinking, prompt):
    """The incremental split of a stream (feed, each chunk) gives, after each chunk, what a
    split of the whole output so far gives, and at the end the final split."""
    text = TEXTS[which]
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    parser, reasoning, content = REASONING_PARSERS[name](prompt, thinking), "", ""
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        final = k == len(bounds) - 2
        more = parser.feed(text[a:b], final)
        reasoning, content = reasoning + more[0], content + more[1]
        whole = REASONING_PARSERS[name](prompt, thinking).split(text[:b], final)
        assert (reasoning, content) == (whole[0] or "", whole[1] or ""), b


def test_a_stream_searches_each_character_for_a_tag_a_bounded_number_of_times():
    """Streamed one character a chunk, the output goes through the tag search, strips and
    slices a few times in all, not once per chunk (which is quadratic in its length)."""
    from test_tool_parsers import Counted

    Counted.handed = handed = [0]
    text = " <think>" + "Hmm, </thin is not the end. " * 150 + "</think>" + "The answer. " * 150
    s = ToolCallStream(None, reasoning=REASONING_PARSERS["deepseek_r1"](""))
    deltas = [s.delta(Counted(ch), "stop" if i == len(text) - 1 else None) for i, ch in enumerate(text)]
    assert handed[0] <= 20 * len(text), (handed[0], len(text))
    assert deltas[-1][1] == "stop" and "".join(d.get("reasoning", "") for d, _ in deltas) == "Hmm, </thin is not the end. " * 150
    assert "".join(d.get("content", "") for d, _ in deltas) == "The answer. " * 150
