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
what the whole response says), and a prompt whose
reasoning already ended (a template that writes an empty `<think>\\n\\n</think>` when
thinking is off) makes the whole output content. The tags are matched in the text, so a
model whose tokenizer spells them in several tokens parses the same. While streaming, text
that may be the start of a tag is held back until it is known not to be.
"""

from __future__ import annotations

from typing import Callable


def partial_tag_len(text: str, tag: str) -> int:
    """How many characters at the end of text may be the start of tag."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class ThinkReasoningParser:
    """`<think>...</think>` reasoning, then content. One per response."""

    start, end = "<think>", "</think>"
    # Output that does not open with <think> is reasoning until </think> (the prompt opened
    # the block); output that does is reasoning until then whatever this says.
    implicit = True

    def __init__(self, prompt: str, thinking: bool = True) -> None:
        """prompt: the end of the rendered chat prompt; thinking: the request did not switch
        thinking off (its template variable enable_thinking)."""
        self.prompt_ended = prompt.rfind(self.end) > prompt.rfind(self.start)
        # a stream's state (split_stream): the output so far, its leading whitespace's end,
        # where its reasoning begins (None: not known yet; -1: there is none), where the end tag is not before
        # (found: where it is)
        self.text, self.blank, self.begin, self.pos, self.found = "", 0, None, 0, -1

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of the output so far; None: none. Not final: what may still
        turn out to be part of a tag is in neither."""
        if self.prompt_ended:
            return None, text
        opened = text.lstrip()
        if opened.startswith(self.start):
            text = opened[len(self.start):]
        elif not final and self.start.startswith(opened):
            return None, None  # may yet open with "<think>"
        elif not self.implicit:
            return None, text
        j = text.find(self.end)
        if j >= 0:
            return text[:j], text[j + len(self.end):] or None
        return text[:len(text) - (0 if final else partial_tag_len(text, self.end))], None

    def split_stream(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """split(text, final) of an output that grows chunk by chunk, as vLLM's
        extract_reasoning_content_streaming keeps its state: the opening tag is decided
        once, and the end tag looked for past where it was not found. An output that does
        not extend the last starts over."""
        if self.prompt_ended:
            return None, text
        if not text.startswith(self.text):  # (a C memcmp)
            self.text, self.blank, self.begin, self.pos, self.found = "", 0, None, 0, -1
        self.text = text
        if self.begin is None:
            while self.blank < len(text) and text[self.blank].isspace():  # (as str.lstrip)
                self.blank += 1
            if text.startswith(self.start, self.blank):
                self.begin = self.pos = self.blank + len(self.start)
            elif not final and self.start.startswith(text[self.blank:self.blank + len(self.start)]) \
                    and len(text) - self.blank < len(self.start):
                return None, None  # may yet open with "<think>"
            else:
                self.begin = 0 if self.implicit else -1
        begin = self.begin
        if begin < 0:
            return None, text
        if self.found < 0:
            self.found = text.find(self.end, self.pos)
            self.pos = max(self.pos, len(text) - partial_tag_len(text, self.end))
        if self.found >= 0:
            return text[begin:self.found], text[self.found + len(self.end):] or None
        held = 0 if final else partial_tag_len(text[max(begin, len(text) - len(self.end)):], self.end)
        return text[begin:len(text) - held], None


class Qwen3ReasoningParser(ThinkReasoningParser):
    def __init__(self, prompt: str, thinking: bool = True) -> None:
        super().__init__(prompt, thinking)
        self.implicit = thinking


REASONING_PARSERS: dict[str, Callable[[str, bool], ThinkReasoningParser]] = {
    "deepseek_r1": ThinkReasoningParser, "qwen3": Qwen3ReasoningParser}
