"""Tool calls out of model output: OpenAI's `tool_calls`, whole and streamed, as vLLM.

A chat request gets calls in one of three ways (protocol.ToolChoice):

  named     tool_choice names a function: the output, constrained to its parameters'
            schema, is the call's arguments.
  required  the output, constrained to vLLM's schema (a non-empty JSON array of
            {"name", "parameters"}), is the calls.
  auto      the model may call or answer: the server's tool parser (--tool-call-parser,
            with --enable-auto-tool-choice) finds the calls in its free text.

Parsers (TOOL_PARSERS): `hermes`, the format of Hermes, Qwen and the SmolLM chat
templates that render tools: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call (a block holding a JSON array of such objects counts each); content is
the text before the first block, as vLLM's Hermes2ProToolParser.

Streaming, as vLLM: a call's first delta carries its index, id, type and name (and the
arguments written by then, if any); the rest follow as string deltas as the model writes
them; text that may be the start of a `<tool_call>` tag is held back until it is known not to be. A call's arguments are the
model's own JSON text of them (valid JSON, its spacing kept), the same whole and streamed.
Every delta is derived from the whole text so far (`_view`), then diffed with what was
sent, so what a stream sends adds up to what the whole response says. In a stream the view
is kept up to date chunk by chunk (ArrayCallStream under "required", HermesToolParser.stream
under "auto"), as vLLM's streaming parsers keep their state, so a chunk's parsing follows
its own length, not the text's.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

from reasoning_parsers import ThinkReasoningParser, partial_tag_len

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS = {key: re.compile(r'\s*,\s*"%s"\s*:\s*' % key) for key in ("arguments", "parameters")}


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request's tools and tool_choice ask (parsed once, by protocol.tool_choice)."""

    mode: str  # "named", "required" or "auto"
    tools: dict[str, dict]  # function name -> its parameters' JSON schema ("named": that one function)
    definitions: list[dict] = field(default_factory=list)  # the request's tools, for the chat template


@dataclass
class CallView:
    """One call as far as the text goes: its name once complete, its arguments' text so far."""

    name: str | None
    arguments: str
    done: bool  # the call's text is complete (its arguments too)
    valid: bool = True  # complete, and the JSON of a call


def _call(text: str, key: str, done: bool) -> CallView:
    """The call in `text`, a JSON object {"name": ..., key: {...}} written so far."""
    if done:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):  # (nested past the decoder's stack: not a call either, as vLLM)
            obj = None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get(key), dict)):
            return CallView(None, "", True, False)
        whole = CallView(obj["name"], json.dumps(obj[key], ensure_ascii=False), True)
    m, start, end = _arguments(text, key, 0)
    # name or arguments not written yet, or not in that order, or arguments that do not
    # decode: a complete call counts as a whole
    if done and (start is None or end is None):
        return whole
    return CallView(_name(m), "" if start is None else text[start:end], done)


def _arguments(text: str, key: str, pos: int) -> tuple[re.Match | None, int | None, int | None]:
    """Where the arguments are of the call object {"name": ..., key: ...} that text[pos:]
    holds, written so far: (the name's match, the value's start (None: not written yet, or
    not after the name), the value's end (None: it does not decode (yet), so all that
    follows is the value))."""
    m = _NAME.match(text, pos)
    a = _ARGS[key].match(text, m.end()) if m else None
    if a is None:
        return m, None, None
    try:  # a complete value ends where the decoder stops
        return m, a.end(), _DECODER.raw_decode(text, a.end())[1]
    except (ValueError, RecursionError):
        return m, a.end(), None


def _name(m: re.Match | None) -> str | None:
    """The call's name as JSON decodes it; None while it does not (e.g. a bad escape)."""
    try:
        return json.loads(m.group(1)) if m else None
    except ValueError:
        return None


def _elements(text: str) -> list[tuple[int, int | None]]:
    """(start, end or None while open) of each element of the JSON array `text` begins."""
    out: list[tuple[int, int | None]] = []
    depth, in_str, esc, start = 0, False, False, None
    for i, ch in enumerate(text):
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth == 2 and ch == "{":
                start = i
        elif ch in "]}":
            depth -= 1
            if depth == 1 and start is not None:
                out.append((start, i + 1))
                start = None
    if start is not None:
        out.append((start, None))
    return out


def _array_calls(text: str, key: str) -> list[CallView]:
    """The calls of a JSON array of call objects written so far (an open one: not done)."""
    if not text.lstrip().startswith("["):
        return []
    return [_call(text[a:] if b is None else text[a:b], key, b is not None) for a, b in _elements(text)]


class ArrayCallStream:
    """_array_calls of a text that grows chunk by chunk (tool_choice "required", streamed),
    without rescanning it: each character is scanned once (the bracket and string state
    carries over, as _elements keeps it), a complete call is parsed once, and the open call
    again only after a character at its own level (outside strings at depth 2, or a string
    closing there): in between its name cannot change and its arguments grow only by the
    text of a value still being written. A text that does not extend the last starts over.

    one: a text that does not open an array is one call object, never complete (an open
    <tool_call> block's body: _call(text, key, False)); its level is depth 1."""

    def __init__(self, key: str, one: bool = False) -> None:
        self.key, self.one, self.level, self.text, self.scanned = key, one, 2, "", 0
        self.depth, self.in_str, self.esc = 0, False, False
        self.array: bool | None = None  # the text starts with "[" (None: whitespace alone so far)
        self.calls: list[CallView] = []  # the complete ones
        self.start: int | None = None  # where the open call begins
        self.stale = False  # a character at the open call's level since it was parsed
        self.name: str | None = None  # the open call's, and its arguments' span (end None: to the end)
        self.span: tuple[int, int | None] | None = None

    def calls_of(self, text: str) -> list[CallView]:
        """_array_calls(text, key) (one: the array's calls, or else [_call(text, key, False)])."""
        if not text.startswith(self.text):  # (a C memcmp: no character is scanned in Python)
            self.__init__(self.key, self.one)
        self.text = text
        if self.array is None:
            head = text[self.scanned:].lstrip()
            if not head:
                self.scanned = len(text)
                return [CallView(None, "", False)] if self.one else []
            self.array = head[0] == "["
            if not self.array and self.one:
                self.level, self.start, self.stale = 1, 0, True
        if not self.array and not self.one:
            return []
        for i in range(self.scanned, len(text)):
            ch = text[i]
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
                self.stale |= not self.in_str and self.depth == self.level
                continue
            level = self.depth == self.level
            if ch == '"':
                self.in_str = True
            elif ch in "[{":
                self.depth += 1
                if self.array and self.depth == 2 and ch == "{":
                    self.start, self.stale = i, True
            elif ch in "]}":
                self.depth -= 1
                if self.array and self.depth == 1 and self.start is not None:
                    self.calls.append(_call(text[self.start:i + 1], self.key, True))
                    self.start = None
            self.stale |= (level or self.depth == self.level) and not ch.isspace()
        self.scanned = len(text)
        if self.start is None:
            return list(self.calls)
        if self.stale:
            m, start, end = _arguments(text, self.key, self.start)
            self.name, self.stale = _name(m), False
            # arguments not begun (whitespace alone after the key) stay "" until a character
            self.span = None if start is None else (start, start if start == len(text) else end)
        value = "" if self.span is None else text[self.span[0]:self.span[1]]
        return [*self.calls, CallView(self.name, value, False)]


class HermesToolParser:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks in free text. One per
    response: `stream` keeps its state across a stream's chunks."""

    start, end = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.text, self.pos = "", 0  # the tag looked for next does not begin before pos
        self.first: int | None = None  # where the first <tool_call> begins
        self.body: int | None = None  # where the open block's body begins
        self.calls: list[CallView] = []  # the closed blocks'
        self.open = ArrayCallStream("arguments", one=True)  # the open block's

    @staticmethod
    def _block(body: str, done: bool) -> list[CallView]:
        if body.lstrip().startswith("["):
            return _array_calls(body, "arguments")
        return [_call(body.strip() if done else body, "arguments", done)]

    def view(self, text: str, final: bool) -> tuple[str, list[CallView]]:
        """(content safe to show, calls) of the text so far."""
        i = text.find(self.start)
        if i < 0:
            return text[:len(text) - (0 if final else partial_tag_len(text, self.start))], []
        calls: list[CallView] = []
        while i >= 0:
            j = text.find(self.end, i)
            calls += self._block(text[i + len(self.start):j if j >= 0 else len(text)], j >= 0 or final)
            i = text.find(self.start, j) if j >= 0 else -1
        return text[:text.find(self.start)], calls

    def stream(self, text: str, final: bool) -> tuple[str, list[CallView]]:
        """view(text, final) of a text that grows chunk by chunk, as vLLM's streaming parser
        keeps its state: each tag is looked for past where it was not found, a closed
        block is parsed once, the open one incrementally. A text that does not extend the
        last (a reasoning parser's content cut anew) starts over."""
        if not text.startswith(self.text):  # (a C memcmp)
            self.__init__()
        self.text = text
        while True:
            tag = self.start if self.body is None else self.end
            k = text.find(tag, self.pos)
            if k < 0:
                self.pos = max(self.pos, len(text) - partial_tag_len(text, tag))  # (a tag's start may end the text)
                break
            if self.body is None:
                self.first = k if self.first is None else self.first
                self.body = self.pos = k + len(tag)
            else:
                self.calls += self._block(text[self.body:k], True)
                self.body, self.pos, self.open = None, k + len(tag), ArrayCallStream("arguments", one=True)
        if self.first is None:
            return text[:len(text) - (0 if final else partial_tag_len(text, self.start))], []
        if self.body is None:
            return text[:self.first], list(self.calls)
        body = text[self.body:]
        return text[:self.first], self.calls + (self._block(body, True) if final else self.open.calls_of(body))


TOOL_PARSERS: dict[str, Callable[[], HermesToolParser]] = {"hermes": HermesToolParser}


def _new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolCallStream:
    """A chat response's message, whole (`message`) or as stream deltas (`delta`), for a
    request with or without tools. One per response."""

    def __init__(self, tools: ToolChoice | None, parser: Callable[[], HermesToolParser] | None = None,
                 parallel: bool = True, reasoning: ThinkReasoningParser | None = None,
                 include_reasoning: bool = True) -> None:
        """parallel: OpenAI's parallel_tool_calls; False keeps the first call only (as vLLM).
        reasoning: the server's --reasoning-parser for this response: the message's
        `reasoning` is split off first, and content and calls come from the rest (sent
        only with include_reasoning, vLLM's request field)."""
        assert tools is None or tools.mode != "auto" or parser is not None, "tool_choice auto needs a parser"
        self.tools, self.parser = tools, parser() if tools is not None and tools.mode == "auto" else None
        self.parallel, self.reasoning, self.include_reasoning = parallel, reasoning, include_reasoning
        self.text, self.content_sent, self.reasoning_sent = "", 0, 0
        self.required = ArrayCallStream("parameters")  # a stream's calls under tool_choice "required"
        self.sent: list[tuple[str, int]] = []  # per call streamed: (id, characters of its arguments sent)

    def _split(self, final: bool, stream: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, the text that holds content and calls) of the text so far."""
        if self.reasoning is None:
            return None, self.text
        return self.reasoning.split_stream(self.text, final) if stream else self.reasoning.split(self.text, final)

    def _view(self, text: str, final: bool, stream: bool = False) -> tuple[str, list[CallView]]:
        if self.tools is None:
            return text, []
        if self.tools.mode == "named":
            return "", [CallView(next(iter(self.tools.tools)), text, final)]
        if self.tools.mode == "required":
            content, calls = "", self.required.calls_of(text) if stream else _array_calls(text, "parameters")
        else:
            content, calls = self.parser.stream(text, final) if stream else self.parser.view(text, final)
        return content, calls if self.parallel else calls[:1]

    def _reason(self, calls: list[CallView], reason: str) -> str:
        """vLLM's finish_reason: "tool_calls" for complete required calls or any call found
        in free text; a named call keeps the engine's reason."""
        if self.tools is None or self.tools.mode == "named":
            return reason
        if self.tools.mode == "required":
            return "tool_calls" if reason == "stop" and calls and all(c.done and c.valid for c in calls) else reason
        return "tool_calls" if any(c.name is not None for c in calls) else reason

    def message(self, text: str, reason: str) -> tuple[dict, str]:
        """The whole response's assistant message and finish_reason. Free text whose
        calls do not parse is content, as vLLM."""
        self.text = text
        reasoning, body = self._split(final=True)
        said = {"reasoning": reasoning if self.include_reasoning else None} if self.reasoning is not None else {}
        content, calls = self._view(body or "", final=True)
        if self.tools is None or not calls or not all(c.done and c.valid and c.name is not None for c in calls):
            return {"role": "assistant", "content": body} | said, reason
        out = [_new_call(c.name, c.arguments) for c in calls]
        content = (content or None) if self.tools.mode == "auto" else ""  # vLLM's forms
        return {"role": "assistant", "content": content, "tool_calls": out} | said, self._reason(calls, reason)

    def delta(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The delta of one streamed chunk (text: its new text; reason: set on the last)."""
        if self.tools is None and self.reasoning is None:  # nothing parses it: the chunk is content as it is
            return ({"content": text} if text else {}), reason
        self.text += text  # (a copy of the text so far, as the parsers take it: docs/ARCHITECTURE.md says why)
        reasoning, body = self._split(final=reason is not None, stream=True)
        out: dict = {}
        if reasoning is not None and len(reasoning) > self.reasoning_sent:
            if self.include_reasoning:
                out["reasoning"] = reasoning[self.reasoning_sent:]
            self.reasoning_sent = len(reasoning)
        content, calls = self._view(body or "", final=reason is not None, stream=True)
        if reason is not None and not self.sent and not any(c.name is not None and c.valid for c in calls):
            content = body or ""  # no call, sent or to send: the held-back text is content, as message() says
        if len(content) > self.content_sent:
            out["content"] = content[self.content_sent:]
            self.content_sent = len(content)
        deltas = []
        for i, c in enumerate(calls):
            if c.name is None or not c.valid:
                continue
            if i == len(self.sent):  # (calls complete in order: a later one never precedes an earlier)
                call = _new_call(c.name, "")
                del call["function"]["arguments"]  # the first delta names the function, as vLLM
                deltas.append(call | {"index": i})
                self.sent.append((call["id"], 0))
            if i < len(self.sent) and len(c.arguments) > self.sent[i][1]:
                more = c.arguments[self.sent[i][1]:]
                if deltas and deltas[-1]["index"] == i:  # named in this very chunk: one delta per call
                    deltas[-1]["function"]["arguments"] = more
                else:
                    deltas.append({"index": i, "function": {"arguments": more}})
                self.sent[i] = (self.sent[i][0], len(c.arguments))
        if deltas:
            out["tool_calls"] = deltas
        if reason is None:
            return out, None
        # A stream that has sent a call cannot take it back: it ends "tool_calls", as vLLM's does
        # (the whole response, parsed at the end, may still find no complete call).
        return out, "tool_calls" if self.sent and self.tools.mode != "named" else self._reason(calls, reason)
