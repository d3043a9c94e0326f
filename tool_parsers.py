"""Tool calls out of model output: OpenAI's `tool_calls`, whole and streamed, as vLLM.

A chat request gets calls in one of three ways (protocol.ToolChoice):

  named     tool_choice names a function: the output, constrained to its parameters'
            schema, is the call's arguments; the call begins with their first character
            (vLLM's stream names it then), so an output cut off while reasoning has none.
  required  the output, constrained to vLLM's schema (a non-empty JSON array of
            {"name", "parameters"}), is the calls.
  auto      the model may call or answer: the server's tool parser (--tool-call-parser,
            with --enable-auto-tool-choice) finds the calls in its free text.

Parsers (TOOL_PARSERS): `hermes`, the format of Hermes, Qwen and the SmolLM chat
templates that render tools: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call (a block holding a JSON array of such objects counts each); content is
the text before the first block, as vLLM's Hermes2ProToolParser.

The whole response's calls are its calls only if all of them parse, else its text is
content (as vLLM's whole response). Streaming, as vLLM: a call's first delta carries its
index, id, type and name (and the arguments written by then, if any); the rest follow as
string deltas as the model writes them; text that may be the start of a `<tool_call>` tag
is held back until it is known not to be. A call that turns out not to be one (its JSON,
complete, is not a call) gets nothing more, and the calls after it still stream, numbered
as sent. A response ends "tool_calls" only if it has (a stream: sent) a call and was not
cut short, as vLLM's; a stream that sent none sends the text it held back as content at
the end. A call's arguments are the model's own JSON text of them (valid JSON, its
spacing kept), the same whole and streamed. A stream's deltas are what the whole text so
far says (`message`'s parse: `_view`) less what was sent, so they add up to the whole
response whenever that has calls, but for a call object that repeats its "name" key (the
stream named the call by the first as soon as it was written; the whole response's
json.loads, as vLLM's, keeps the last); and what a stream sent cannot be taken back, so
where one call does not parse it may have sent the others. No stage takes the text so
far: each is fed the chunk's new text and keeps its state, as vLLM's streaming parsers do
(the reasoning split, then HermesToolParser.feed under "auto", ArrayCallStream under
"required"), so a chunk costs its own length, not the text's. What a parse needs again is
bounded by the open call: its text is decoded again only while what it says can still
change (OpenCall: its name, its arguments' start and end), a few times per call whatever
is written after them, but once per digit of a bare number as its arguments (never a
call). An open call's arguments are a Span of its text, so a delta copies only what it
sends. A stream keeps its text only while it may still send it (Text: about one string
per 64 chunks, not one per chunk).
"""

from __future__ import annotations

import itertools
import json
import re
import uuid
from dataclasses import dataclass, field
from json import JSONDecodeError
from typing import Protocol

from policy import Registry
from reasoning_parsers import ThinkReasoningParser, partial_tag_len

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS = {key: re.compile(r'\s*,\s*"%s"\s*:\s*' % key) for key in ("arguments", "parameters")}


def _so_far(*atoms: str) -> str:
    """A pattern that matches the texts that begin a match of the atoms in turn (a prefix)."""
    pattern = ""
    for atom in reversed(atoms):
        pattern = f"(?:{atom}{pattern})?"
    return pattern


# what may still become a match of _NAME, and of _ARGS after it (fullmatch)
_NAME_SO_FAR = re.compile(r'\s*' + _so_far(r'\{', r'\s*', '"', *"name", '"', r'\s*', ':', r'\s*', r'"(?:[^"\\]|\\.)*\\?'))
_ARGS_SO_FAR = {key: re.compile(_so_far(r'\s*', ',', r'\s*', '"', *key, '"', r'\s*', ':')) for key in _ARGS}


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
        # hermes' arguments may be any JSON value (vLLM json.dumps whatever the model wrote); the
        # parameters of tool_choice "required" are an object (vLLM's FunctionDefinition)
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and
                (key in obj if key == "arguments" else isinstance(obj.get(key), dict))):
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
    not after the name), the value's end (None: it does not decode (yet) and is no closed
    array, object or string, so all that follows is the value))."""
    m = _NAME.match(text, pos)
    a = _ARGS[key].match(text, m.end()) if m else None
    if a is None:
        return m, None, None
    try:  # a complete value ends where the decoder stops
        return m, a.end(), _DECODER.raw_decode(text, a.end())[1]
    except (ValueError, RecursionError):  # else as OpenCall.parse has it
        return m, a.end(), _close(text, a.end()) if text[a.end():a.end() + 1] in ("[", "{", '"') else None


def _decodes(text: str) -> bool:
    """Whether text is one JSON value (whitespace around it)."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


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


class Text:
    """A text written chunk by chunk, kept compact: appending costs the chunk, reading
    text[i:j] near its end costs that slice and the pieces it spans, and the whole is joined
    (then kept joined) when a parse needs it. The newest chunks are joined in runs of
    `RUN`, and the runs into the text's head once they add up to its length, so each
    character is copied a few times in all and a text of many small chunks costs about its
    characters, not a string object per chunk."""

    RUN = 64

    def __init__(self) -> None:
        self.parts: list[str] = []  # the head (the text joined so far), runs of RUN chunks, then the newest chunks
        self.size = 0
        self.chunks = 0  # how many of parts are chunks not joined yet (fewer than RUN)
        self.runs = 0  # characters in the runs

    def __len__(self) -> int:
        return self.size

    def append(self, chunk: str) -> None:
        if not chunk:
            return
        self.parts.append(chunk)
        self.size += len(chunk)
        self.chunks += 1
        if self.chunks < self.RUN:
            return
        run = "".join(self.parts[-self.RUN:])
        del self.parts[-self.RUN:]
        self.parts.append(run)
        self.chunks = 0
        if len(self.parts) > 1:
            self.runs += len(run)
            if self.runs >= len(self.parts[0]):  # (the head at least doubles: a character is joined in a few times)
                self.parts, self.runs = ["".join(self.parts)], 0

    def whole(self) -> str:
        if len(self.parts) > 1:
            self.parts, self.chunks, self.runs = ["".join(self.parts)], 0, 0
        return self.parts[0] if self.parts else ""

    def drop(self, n: int) -> None:
        """Forget the text's first n characters (copying the rest, which is freed then)."""
        rest = self[n:] if n < self.size else ""
        self.parts, self.size, self.chunks, self.runs = [rest] if rest else [], len(rest), 0, 0

    def __getitem__(self, key: slice) -> str:
        start, stop, _ = key.indices(self.size)
        out, end = [], self.size
        for part in reversed(self.parts):  # (from the end: what a stream reads is its newest text)
            begin = end - len(part)
            if begin < stop and start < end:
                out.append(part[max(start - begin, 0):stop - begin])
            if begin <= start:
                break
            end = begin
        return "".join(reversed(out))


class Span:
    """text[start:end] of a Text, read without copying the rest (end None: to the text's end,
    growing with it): an open call's arguments while its text is written."""

    def __init__(self, text: Text, start: int, end: int | None) -> None:
        self.text, self.start, self.end = text, start, end

    def __len__(self) -> int:
        return (self.text.size if self.end is None else self.end) - self.start

    def __getitem__(self, key: slice) -> str:
        start, stop, _ = key.indices(len(self))
        return self.text[self.start + start:self.start + stop]

    def __str__(self) -> str:
        return self[:]

    def __eq__(self, other: object) -> bool:
        return str(self) == str(other)


def _close(text: str, start: int) -> int | None:
    """Where the JSON array, object or string that text[start:] begins ends (brackets counted,
    as _elements counts them, whether or not it decodes); None while it is open."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(itertools.islice(text, start, None), start):
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
            if not in_str and depth == 0:
                return i + 1
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth <= 0:
                return i + 1
    return None


class OpenCall:
    """_arguments of a call object's text as it is written, each part kept once more text
    cannot change it (`settled`: all are): the name once its string closes (or once the text
    cannot begin {"name": ...}), the arguments' start once their first character is written
    (or once the text cannot be {"name": ..., key: ...}), their end once they are complete
    (an array, object or string once closed, whether or not it decodes; a number or literal
    once 3 characters follow it, or one that does not decode once 9 are written). So an open
    call is decoded a few times, not once per character at its level; only a bare number as
    its arguments (never a call) is decoded again per digit."""

    def __init__(self, key: str) -> None:
        self.key, self.settled = key, False
        self.m: re.Match | None = None
        self.name: str | None = None
        self.named = False  # the name's match is final
        self.start: int | None = None  # the arguments' start, final once their first character is written

    def parse(self, text: str) -> tuple[str | None, tuple[int, int | None] | None]:
        """(name, arguments' span (end None: to the text's end)) of the call's text so far."""
        if not self.named:
            self.m = _NAME.match(text)
            self.named = self.m is not None or not _NAME_SO_FAR.fullmatch(text)
            if self.m is None:
                self.settled = self.named  # (never named: no arguments either)
                return None, None
            self.name = _name(self.m)
        if self.start is None:
            a = _ARGS[self.key].match(text, self.m.end())
            if a is None:
                self.settled = not _ARGS_SO_FAR[self.key].fullmatch(text, self.m.end())
                return self.name, None
            if a.end() == len(text):  # arguments not begun (whitespace alone after the key): "" until a character
                return self.name, (a.end(), a.end())
            self.start = a.end()
        start, container = self.start, text[self.start] in '[{"'
        try:  # a complete value ends where the decoder stops
            end = _DECODER.raw_decode(text, start)[1]
            self.settled = container or len(text) - end >= 3  # ("1" may go on as "1.5" or "1e+5")
        except (ValueError, RecursionError) as e:
            # it does not decode (yet): a closed array, object or string ends where its brackets
            # close (vLLM's brace matching), else all that follows is the value
            end = _close(text, start) if container else None
            self.settled = end is not None if container else \
                isinstance(e, JSONDecodeError) and len(text) - start >= len("-Infinity")
        return self.name, (start, end)


class ArrayCallStream:
    """_array_calls of a text fed chunk by chunk (tool_choice "required", streamed), as vLLM's
    streaming parsers keep their state: each character is scanned once (the bracket and
    string state carries over, as _elements keeps it), a complete call is parsed once, and
    the open call, whose text alone is kept, again only after a character at its own level
    (outside strings at depth 2, or a string closing there), and then only the parts that
    may still change (OpenCall): in between its name cannot change and its arguments grow
    only by the text of a value still being written.

    one: a text that does not open an array is one call object, never complete (an open
    <tool_call> block's body: _call(text, key, False)); its level is depth 1."""

    def __init__(self, key: str, one: bool = False) -> None:
        self.key, self.one, self.level = key, one, 2
        self.depth, self.in_str, self.esc = 0, False, False
        self.array: bool | None = None  # the text starts with "[" (None: whitespace alone so far)
        self.done: list[CallView] = []  # the complete calls
        self.text: Text | None = Text() if one else None  # the open call's text, from its start
        self.stale = False  # a character at the open call's level since it was parsed
        self.parsed = OpenCall(key)  # what the open call says so far
        self.name: str | None = None  # the open call's, and its arguments' span (end None: to the end)
        self.span: tuple[int, int | None] | None = None

    def call(self, i: int) -> CallView | None:
        """The i-th call of the text so far (None: there is none yet)."""
        if i < len(self.done):
            return self.done[i]
        if i > len(self.done) or self.text is None:  # (no call open, or no array: none)
            return None
        if self.array is None:
            return CallView(None, "", False)
        return CallView(self.name, "" if self.span is None else Span(self.text, *self.span), False)

    def feed(self, chunk: str) -> None:
        """The text's next chunk: scanned, a call it completes parsed, the open one again if stale."""
        if self.array is None:
            head = chunk.lstrip()
            if not head:
                if self.text is not None:
                    self.text.append(chunk)  # (whitespace before the one call: its text too)
                return
            self.array = head[0] == "["
            if self.array:
                self.text = None
            elif self.one:
                self.level, self.stale = 1, True
        if not self.array and not self.one:
            return
        depth, in_str, esc, stale, level_of = self.depth, self.in_str, self.esc, self.stale, self.level
        opened = 0  # where the open call's text begins in this chunk (0: it began before)
        for i, ch in enumerate(chunk):
            if in_str:
                esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
                stale |= not in_str and depth == level_of
                continue
            level = depth == level_of
            if ch == '"':
                in_str = True
            elif ch in "[{":
                depth += 1
                if self.array and depth == 2 and ch == "{":
                    self.text, self.parsed, opened, stale = Text(), OpenCall(self.key), i, True
            elif ch in "]}":
                depth -= 1
                if self.array and depth == 1 and self.text is not None:
                    self.text.append(chunk[opened:i + 1])
                    self.done.append(_call(self.text.whole(), self.key, True))
                    self.text = None
            stale |= (level or depth == level_of) and not ch.isspace()
        self.depth, self.in_str, self.esc, self.stale = depth, in_str, esc, stale
        if self.text is None:
            return
        self.text.append(chunk[opened:])
        if self.stale and not self.parsed.settled:  # the open call's text so far, parsed again
            self.name, self.span = self.parsed.parse(self.text.whole())
        self.stale = False


class ToolParser(Protocol):
    """What ToolCallStream asks of a --tool-call-parser: one per response, constructed
    with no arguments; `feed` keeps its state across a stream's chunks."""

    def view(self, text: str, final: bool) -> tuple[str, list[CallView]]:
        """(content, calls) of the whole text so far, every call it holds, parsed or not."""

    def feed(self, chunk: str, final: bool) -> str:
        """A stream's next text: the content it adds (its calls so far: `call`)."""

    def call(self, i: int) -> CallView | None:
        """The i-th call of the text fed so far, as view(text so far, final) has it."""


# --tool-call-parser: name -> parser class; None: tool_choice "auto" is refused
TOOL_PARSERS: Registry[ToolParser] = Registry("tool_call_parser", also=(None,))


@TOOL_PARSERS.register("hermes")
class HermesToolParser:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks in free text. One per
    response: `feed` keeps its state across a stream's chunks."""

    start, end = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.held = ""  # the end of the text so far that may begin the tag looked for next
        self.content = True  # no <tool_call> yet: the text is content
        self.done: list[CallView] = []  # the closed blocks' calls
        self.block: Text | None = None  # the open block's body so far
        self.open = ArrayCallStream("arguments", one=True)  # the open block's calls

    @staticmethod
    def _block(body: str, done: bool) -> list[CallView]:
        """The calls of a block's body; done: the block is closed, or the output ended on JSON
        (a block cut short stays open, its call's arguments as far as they were written, as
        vLLM's stream sends them; the whole response, whose calls must all be complete, has
        none then)."""
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
            body = text[i + len(self.start):j if j >= 0 else len(text)]
            calls += self._block(body, j >= 0 or (final and _decodes(body)))
            i = text.find(self.start, j) if j >= 0 else -1
        return text[:text.find(self.start)], calls

    def call(self, i: int) -> CallView | None:
        """The i-th call of the text fed so far, as view(text so far, final) has it."""
        if i < len(self.done):
            return self.done[i]
        return None if self.block is None else self.open.call(i - len(self.done))

    def feed(self, chunk: str, final: bool) -> str:
        """The content that the text's next chunk adds to view(text so far, final)'s, its
        calls kept up to date (`call`), as vLLM's streaming parser keeps its state: each tag
        is looked for in the chunk and the few characters held back before it, a closed
        block is parsed once, the open one as it grows (ArrayCallStream)."""
        content = []
        text, seen = self.held + chunk, len(self.held)  # text[:seen]: held back from the last chunk
        while True:
            if self.block is None:
                k = text.find(self.start)
                if k < 0:
                    cut = len(text) - (0 if final else partial_tag_len(text, self.start))
                    content.append(text[:cut] if self.content else "")
                    self.held = text[cut:]
                    break
                content.append(text[:k] if self.content else "")
                self.content, self.block, self.open = False, Text(), ArrayCallStream("arguments", one=True)
                text, seen = text[k + len(self.start):], 0
            else:  # in a block, what was held back is its body's end already (the open call's text)
                k = text.find(self.end)
                if k < 0:
                    new = text[seen:]
                    self.block.append(new)
                    self.open.feed(new)
                    self.held = text[len(text) - partial_tag_len(text, self.end):]
                    if final and _decodes(self.block.whole()):  # the output ended on a block's JSON: its call
                        self.done += self._block(self.block.whole(), True)
                        self.block = None
                    break
                body = self.block.whole()
                self.done += self._block(body[:len(body) - seen] + text[:k], True)
                self.block, text, seen = None, text[k + len(self.end):], 0
        return "".join(content)


def _new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolCallStream:
    """A chat response's message, whole (`message`) or as stream deltas (`delta`), for a
    request with or without tools. One per response."""

    def __init__(self, tools: ToolChoice | None, parser: type[ToolParser] | None = None,
                 parallel: bool = True, reasoning: ThinkReasoningParser | None = None,
                 include_reasoning: bool = True) -> None:
        """parallel: OpenAI's parallel_tool_calls; False keeps the first call only (as vLLM).
        reasoning: the server's --reasoning-parser for this response: the message's
        `reasoning` is split off first, and content and calls come from the rest (sent
        only with include_reasoning, vLLM's request field)."""
        assert tools is None or tools.mode != "auto" or parser is not None, "tool_choice auto needs a parser"
        self.tools, self.parser = tools, parser() if tools is not None and tools.mode == "auto" else None
        self.parallel, self.reasoning, self.include_reasoning = parallel, reasoning, include_reasoning
        # a stream's state: the text after the reasoning, kept only while it may be read:
        # under a named tool_choice all of it (the call's arguments); under "auto" and
        # "required" the part not sent as content, until a call is sent (a stream that sends
        # none sends it as content at the end); without tools none (each chunk is content)
        mode = None if tools is None else tools.mode
        self.body = Text() if mode == "named" else None
        self.unsent = Text() if mode in ("auto", "required") else None
        # the calls under tool_choice "required"
        self.required = ArrayCallStream("parameters")
        self.sent: list[tuple[str, int]] = []  # per call streamed, by index: (id, characters of its arguments sent)
        # the parser's first call not complete yet (the calls before it were sent or
        # skipped), and the index it was sent at (None: not sent)
        self.next, self.at = 0, None

    def _view(self, text: str, final: bool) -> tuple[str, list[CallView]]:
        """(content, calls) of the text after the reasoning (the whole response's), every
        call the text holds, whether or not it parses."""
        if self.tools is None:
            return text, []
        if self.tools.mode == "named":  # the call begins with its arguments' first character (none yet: no call)
            return "", [CallView(next(iter(self.tools.tools)), text, final)] if text else []
        if self.tools.mode == "required":
            return "", _array_calls(text, "parameters")
        return self.parser.view(text, final)

    def _feed(self, text: str, final: bool) -> str:
        """A stream's next text after the reasoning into the tool parser: the content it adds."""
        if self.tools is None:
            return text
        for kept in (self.body, self.unsent):
            if kept is not None:
                kept.append(text)
        if self.tools.mode == "required":
            self.required.feed(text)
        elif self.tools.mode == "auto":
            return self.parser.feed(text, final)
        return ""

    def _call(self, i: int, final: bool) -> CallView | None:
        """The i-th call of a stream's text so far, as _view has it (None: there is none)."""
        if self.tools is None:
            return None
        if self.tools.mode == "named":  # the text after the reasoning is its arguments, once it has begun
            return CallView(next(iter(self.tools.tools)), Span(self.body, 0, None), final) if i == 0 and \
                len(self.body) else None
        return self.required.call(i) if self.tools.mode == "required" else self.parser.call(i)

    def _reason(self, called: bool, reason: str) -> str:
        """vLLM's finish_reason (resolve_finish_reason), called: the response has tool calls (a
        stream: it sent one): "tool_calls" for calls the output ended on its own ("stop"); a
        named call, none, or an output cut short (so a client can tell a call cut by
        max_tokens from a whole one) keep the engine's reason."""
        return "tool_calls" if called and self.tools.mode != "named" and reason == "stop" else reason

    def message(self, text: str, reason: str) -> tuple[dict, str]:
        """The whole response's assistant message and finish_reason. Calls count only if
        all of them parse, else the text is content, as vLLM's whole response (its hermes
        parser's json.loads of every block in one try; "required": its whole array)."""
        reasoning, body = (None, text) if self.reasoning is None else self.reasoning.split(text, final=True)
        said = {"reasoning": reasoning if self.include_reasoning else None} if self.reasoning is not None else {}
        content, calls = self._view(body or "", final=True)
        if self.tools is None or not calls or not all(c.done and c.valid and c.name is not None for c in calls):
            return {"role": "assistant", "content": body} | said, reason
        # (parallel_tool_calls false: the first of calls that all parse, as vLLM filters after parsing)
        out = [_new_call(c.name, c.arguments) for c in (calls if self.parallel else calls[:1])]
        content = (content or None) if self.tools.mode == "auto" else ""  # vLLM's forms
        return {"role": "assistant", "content": content, "tool_calls": out} | said, self._reason(True, reason)

    def delta(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The delta of one streamed chunk (text: its new text; reason: set on the last).
        Each stage takes the chunk's text and gives what it adds (reasoning split -> tag
        search -> call scanner), so a chunk costs its own length, not the text's
        (docs/ARCHITECTURE.md). Calls stream as they are written, as vLLM's: a call is
        named as soon as its name is, its arguments follow as they grow; one that turns
        out not to be a call is not sent further, and the calls after it still are, each
        at the next index. What a stream sent cannot be taken back, so unlike `message`
        (all calls or none) a stream may send the calls that parse of a text that has one
        that does not; it ends "tool_calls" only if it sent a call and stopped on its own,
        and if it sent none, the text held back (from the first <tool_call> on) comes as
        content at the end."""
        if self.tools is None and self.reasoning is None:  # nothing parses it: the chunk is content as it is
            return ({"content": text} if text else {}), reason
        final, out = reason is not None, {}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, final)
            if reasoning and self.include_reasoning:
                out["reasoning"] = reasoning
        content = self._feed(text, final)
        deltas = []
        # From the first call not complete when the last chunk was parsed (the calls before
        # it were sent or skipped for good): the complete ones, and the open one, the last.
        while (c := self._call(self.next, final)) is not None:
            if c.name is not None and c.valid and (self.at is not None or self.parallel or not self.sent):
                if self.at is None:
                    call = _new_call(c.name, "")
                    del call["function"]["arguments"]  # the first delta names the function, as vLLM
                    deltas.append(call | {"index": len(self.sent)})
                    self.at = len(self.sent)
                    self.sent.append((call["id"], 0))
                if len(c.arguments) > self.sent[self.at][1]:
                    more = c.arguments[self.sent[self.at][1]:]
                    if deltas and deltas[-1]["index"] == self.at:  # named in this very chunk: one delta per call
                        deltas[-1]["function"]["arguments"] = more
                    else:
                        deltas.append({"index": self.at, "function": {"arguments": more}})
                    self.sent[self.at] = (self.sent[self.at][0], len(c.arguments))
            if not c.done:
                break
            self.next, self.at = self.next + 1, None
        if self.unsent is not None:
            if final and not self.sent:  # no call sent: what was held back is content, as message() says
                content = self.unsent.whole()
            # (a call sent: the stream will send no more content; else what was sent is not needed)
            if self.sent:
                self.unsent = None
            elif content:
                self.unsent.drop(len(content))
        if content:
            out["content"] = content
        if deltas:
            out["tool_calls"] = deltas
        return out, None if reason is None else self._reason(bool(self.sent), reason)
