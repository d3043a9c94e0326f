"""Reasoning out of model output: a chat message's `reasoning`, beside its `content`, as vLLM's
--reasoning-parser.

Models such as DeepSeek-R1 and Qwen3 think first, between `<think>` and `</think>`, then
answer. With a parser the server sends the thinking as `reasoning` (whole, or as stream
deltas before the content's) and only the answer as `content`, which is also the only text
tool calls are parsed from. Parsers (REASONING_PARSERS), each vLLM's rule:

  deepseek_r1  everything before `</think>` is reasoning (R1's template opens `<think>` in
               the prompt, so the output may hold only the end tag); no end tag yet: all of
               it is reasoning.
  qwen3        the same, except that with thinking switched off (chat_template_kwargs
               enable_thinking false, or reasoning_effort "none") output that does not open
               with `<think>` is content, an end tag in it included: a stream has sent the
               text before the tag as content by the time the tag comes. (vLLM's whole
               response splits at such a tag, and its stream does not: here both are content.)

Either way a `<think>` opening the output is dropped (vLLM drops one anywhere, with what
precedes it, from a whole response, but streams that text as it comes: here a stream says
what the whole response says). A prompt whose reasoning already ended (a template that
writes an empty `<think>\\n\\n</think>` when thinking is off) makes output that does not
open with `<think>` content, as thinking off does; output that opens with `<think>` is
reasoning whatever the prompt says: the prompt's end (its last 32 tokens) may hold an
earlier turn's `</think>` (Qwen3 renders the assistant turns after the last user message
with their reasoning, so an agent loop's short tool call and result leave one in reach),
and the new answer's thinking must not read as content. The tags are matched in the text,
so a model whose tokenizer spells them in several tokens parses the same. While streaming, text
that may be the start of a tag is held back until it is known not to be.
"""

from __future__ import annotations

from policy import Registry

# --reasoning-parser: name -> parser class, constructed (prompt, thinking) per response; None: no parser
REASONING_PARSERS: Registry["ThinkReasoningParser"] = Registry("reasoning_parser", also=(None,))


def partial_tag_len(text: str, tag: str) -> int:
    """How many characters at the end of text may be the start of tag."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


@REASONING_PARSERS.register("deepseek_r1")
class ThinkReasoningParser:
    """`<think>...</think>` reasoning, then content. One per response."""

    start, end = "<think>", "</think>"

    def __init__(self, prompt: str, thinking: bool = True) -> None:
        """prompt: the end of the rendered chat prompt; thinking: the request did not switch
        thinking off (its template variable enable_thinking)."""
        self.prompt_ended = prompt.rfind(self.end) > prompt.rfind(self.start)
        # Output that does not open with <think> is reasoning until </think> (the prompt opened
        # the block, or may have: no end tag after its last start); output that does is
        # reasoning until then whatever this says.
        self.implicit = not self.prompt_ended
        # a stream's state (feed): where the output is (None: before the opening tag is
        # decided, "reasoning", "content"); before that, its leading whitespace (chunks) and
        # the text after it (shorter than the tag); in reasoning, the end that may begin the end tag
        self.phase: str | None = None
        self.blank: list[str] = []
        self.head = self.held = ""

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of the output so far; None: none. Not final: what may still
        turn out to be part of a tag is in neither."""
        opened = text.lstrip()
        if not final and not opened.startswith(self.start) and self.start.startswith(opened):
            return None, None  # may yet open with "<think>"
        if (where := self.span(text)) is None:
            return None, text
        begin, end = where
        if end < len(text):  # the end tag
            return text[begin:end], text[end + len(self.end):] or None
        return text[begin:end - (0 if final else partial_tag_len(text[begin:], self.end))], None

    def span(self, text: str) -> tuple[int, int] | None:
        """Where the whole output text's reasoning lies, [begin, end) (end: where the end tag
        starts, else the text's end); None when it has none."""
        opened = text.lstrip()
        if opened.startswith(self.start):
            begin = len(text) - len(opened) + len(self.start)
        elif self.implicit:
            begin = 0
        else:
            return None
        j = text.find(self.end, begin)
        return begin, j if j >= 0 else len(text)

    def feed(self, chunk: str, final: bool) -> tuple[str, str]:
        """The (reasoning, content) that the output's next chunk adds to split(output so far,
        final) (None there: ""), as vLLM's extract_reasoning_content_streaming keeps its
        state: the opening tag is decided once, and the end tag looked for in the chunk and
        the few characters held back before it, so a chunk costs its own length."""
        if self.phase is None:
            if not self.head:  # (whitespace before the opening tag: as str.lstrip)
                rest = chunk.lstrip()
                self.blank.append(chunk[:len(chunk) - len(rest)])
                chunk = rest
            self.head += chunk
            if self.head.startswith(self.start):
                self.phase, chunk = "reasoning", self.head[len(self.start):]
            elif not final and self.start.startswith(self.head) and len(self.head) < len(self.start):
                return "", ""  # may yet open with "<think>"
            else:
                self.phase, chunk = "reasoning" if self.implicit else "content", "".join(self.blank) + self.head
            self.blank, self.head = [], ""
        if self.phase == "content":
            return "", chunk
        text = self.held + chunk
        j = text.find(self.end)
        if j >= 0:
            self.phase, self.held = "content", ""
            return text[:j], text[j + len(self.end):]
        cut = len(text) - (0 if final else partial_tag_len(text, self.end))
        self.held = text[cut:]
        return text[:cut], ""


@REASONING_PARSERS.register("qwen3")
class Qwen3ReasoningParser(ThinkReasoningParser):
    def __init__(self, prompt: str, thinking: bool = True) -> None:
        super().__init__(prompt, thinking)
        self.implicit = thinking and not self.prompt_ended
