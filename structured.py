"""Structured outputs: llguidance glue. A constraint (JSON schema, regex, choice, Lark or
GBNF grammar, structural tag) is compiled once into a matcher over the model's vocabulary; each request
gets a copy, which advances with every accepted token and fills the request's row of the
packed token bitmask the step applies to the logits before sampling.

llguidance, not xgrammar: no torch, NumPy bitmasks, the engine vLLM, SGLang and llama.cpp
already use. Compiling is the slow part (a large schema: tens of milliseconds), so a
compiled matcher is cached by the constraint's text (LRU, MAX_CACHED_GRAMMARS) and a
request's own matcher is a `deep_copy` of it (microseconds). The matcher a request was
validated with travels with it to the engine (LLMEngine.validate returns it), so however
many other grammars pass through the cache meanwhile, it is compiled once, where the
server put that work (its executor), never again on the event loop or the engine loop.

Limits, so that no request can stall the engine loop (the matcher's work per token runs on
the loop thread):
  - the constraint's text: sampling_params.MAX_STRUCTURED_CHARS characters (checked where it enters);
  - compile: llguidance's LLParserLimits (LIMITS below): grammar size, the lexer fuel to
    build it; over them the request is refused with llguidance's message;
  - per token: the fuel and Earley items one mask may take (LIMITS); a request whose
    grammar exceeds them mid-way ends with finish_reason "abort" (its matcher errors).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Sequence

import llguidance
import llguidance.numpy as llnp
import numpy as np

from sampling_params import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 128  # compiled matchers kept; a big schema's lexer is a few MB at most
# llguidance's own defaults, written out so they are documented here: ~20 ms of lexer work
# to build a grammar, ~14 ms and ~2.5 ms of lexer and parser work per token at most.
LIMITS = dict(max_grammar_size=500_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
              step_max_items=50_000, max_lexer_states=250_000, max_items_in_row=2_000)
# JSON without free whitespace between tokens: a small model at temperature 1 can spend its
# whole budget on newlines (vLLM's default allows it); compact JSON is valid and shortest.
JSON_OPTIONS = {"whitespace_flexible": False}
FIRST_TOKEN_PROBES = 16  # allowed first tokens a compile takes on copies of the matcher (see compile)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for `spec` (not yet checked: LLMatcher reports errors)."""
    M = llguidance.LLMatcher
    if spec.json is not None:
        return M.grammar_from_json_schema(spec.json, defaults=json_options(spec))
    if spec.json_object:
        return M.grammar_from_json_schema('{"type": "object"}', defaults=json_options(spec))
    if spec.regex is not None:
        return M.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    if spec.structural_tag is not None:
        return structural_tag_grammar(json.loads(spec.structural_tag), json_options(spec))
    assert spec.grammar is not None
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark


def json_options(spec: StructuredOutputsParams) -> dict:
    """llguidance's JSON options for spec: JSON_OPTIONS, or its whitespace_pattern between
    tokens (unless it disables any whitespace, which JSON_OPTIONS does already)."""
    if spec.whitespace_pattern is None or spec.disable_any_whitespace:
        return JSON_OPTIONS
    return JSON_OPTIONS | {"whitespace_pattern": spec.whitespace_pattern}


def structural_tag_grammar(tag: dict, options: dict = JSON_OPTIONS) -> str:
    """A Lark grammar for vLLM's structural tag (checked by StructuredOutputsParams), as
    vLLM's llguidance backend builds it: free text, in which each trigger starts a structure
    (its begin, JSON under its schema, its end) and free text resumes after it. JSON is
    as `options` say (json_options), unless the schema sets its own `x-guidance` ones."""
    tags = []
    for s in tag["structures"]:
        schema = {"x-guidance": options} | s["schema"]  # an object (StructuredOutputsParams made it one)
        trigger = next(t for t in tag["triggers"] if s["begin"].startswith(t))
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return llguidance.StructTag.to_grammar(tags)


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The model's vocabulary as llguidance sees it, `vocab_size` ids (the logits' width):
    a transformers fast tokenizer, or taxirank's ByteTokenizer (ids 0..255 are bytes, the
    rest special, never allowed by a grammar)."""
    if hasattr(tokenizer, "backend_tokenizer"):
        from llguidance.hf import from_tokenizer  # imports transformers: only for its tokenizers

        return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
    from tokenizer import ByteTokenizer

    if not isinstance(tokenizer, ByteTokenizer):
        raise ValueError(f"structured outputs need a fast (tokenizers) tokenizer, not {type(tokenizer).__name__}")

    class _Bytes:
        eos_token_id, bos_token_id = eos_token_ids[0], tokenizer.bos_token_id
        tokens = [bytes([i]) for i in range(256)] + [b"<|special_%d|>" % i for i in range(256, vocab_size)]
        special_token_ids = list(range(256, vocab_size))

        def __call__(self, s: bytes | str) -> list[int]:
            return list(s if isinstance(s, bytes) else s.encode())

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=vocab_size,
                                  eos_token=list(eos_token_ids))


class Constraint:
    """One request's matcher: its state is the request's output tokens so far (a
    preemption recomputes K/V, never the outputs, so the matcher is never reset)."""

    __slots__ = ("matcher",)
    active = True  # the grammar applies to the next token (its row of the bitmask is filled)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar refuses it (the mask makes
        that impossible) or ran out of its per-token limits."""
        return self.matcher.consume_token(token)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (an accepting state with no
        continuation, or EOS taken in an accepting state)."""
        return self.matcher.is_stopped()


class AfterReasoning(Constraint):
    """A constraint that holds once the model has stopped thinking (vLLM's structured
    outputs with a --reasoning-parser): free until the output's text holds the end tag
    (`</think>`), the grammar from the next token on. The tag is looked for in the text, as
    the reasoning parser looks for it, not as the ids the tokenizer encodes it to alone: a
    tokenizer without a token of its own for the tag spells it in pieces that depend on
    the text around it (SmolLM2's " </" "think" ">" after a space, not "</" "think" ">"),
    which an id match would miss, leaving the answer unconstrained."""

    __slots__ = ("end", "token_text", "tail", "active")

    def __init__(self, matcher: llguidance.LLMatcher, end: str, token_text: Callable[[int], str]) -> None:
        super().__init__(matcher)
        self.end, self.token_text, self.tail, self.active = end, token_text, "", False

    def accept(self, token: int) -> bool:
        if self.active:
            return super().accept(token)
        text = self.tail + self.token_text(token)
        self.active = self.end in text
        self.tail = text[max(0, len(text) - len(self.end) + 1):]  # what may begin a tag the next token ends
        return True

    @property
    def stopped(self) -> bool:
        return self.active and super().stopped


def new_constraint(matcher: llguidance.LLMatcher, after: str = "",
                   token_text: Callable[[int], str] | None = None) -> Constraint:
    """A request's constraint over its own matcher; after: text that must end the output's
    reasoning first (a reasoning model's end-of-thinking tag), with token_text the text of
    a token id; "" to constrain from the first token."""
    if not after:
        return Constraint(matcher)
    assert token_text is not None, "an end tag is found in the tokens' text"
    return AfterReasoning(matcher, after, token_text)


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary; thread-safe (the server compiles on
    its executor, the engine loop copies matchers). Built on first use: wrapping a 50k
    vocabulary takes about a second, which an engine that never sees a constraint skips."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, tuple(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutputsParams, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        # the latest cache misses' compile times (bench/structured_outputs.py reads their percentiles)
        self.compile_seconds: deque[float] = deque(maxlen=1024)

    def _tokenizer_for_llguidance(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer is None:
                    raise ValueError("this model has no tokenizer, so no structured outputs")
                self._ll_tokenizer = ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled (fresh) matcher for spec, from the cache or built now; a ValueError
        with llguidance's message if the constraint is invalid or over the limits."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        tok = self._tokenizer_for_llguidance()
        t0 = time.perf_counter()
        try:
            text = grammar_text(spec)
        except ValueError as e:  # not JSON, or a GBNF grammar that does not convert
            raise ValueError(f"invalid {spec.kind}: {e}") from e
        # Never raises for a bad grammar: the matcher is born in its error state instead.
        matcher = llguidance.LLMatcher(tok, text, log_level=0, limits=llguidance.LLParserLimits(**LIMITS))
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind}: {matcher_error(matcher)}")
        # The first mask, here on the caller's thread, not on the engine loop's: building
        # the lexer for it is where a grammar past the limits fails (a regex bomb, an
        # alternative too wide, a grammar no string satisfies, `start: start`), which then
        # is this request's error instead of an abort after it was admitted.
        first = next_mask(matcher, self.vocab_size)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind}: {matcher_error(matcher)}")
        allowed = np.flatnonzero(np.unpackbits(first.view(np.uint8), bitorder="little")[:self.vocab_size])
        if not len(allowed):
            raise ValueError(f"invalid {spec.kind}: it allows no token at all")
        # The parser's row limit fails on the first token taken, not on the mask: a schema of
        # hundreds of optional properties or a wide alternative has its Earley row grow past
        # max_items_in_row as the first byte is scanned. A few of the allowed first tokens
        # (copies of the matcher) catch that here, and a grammar whose every string is
        # infinite (`start: "a" start`). One that fails only on a later token still ends
        # its request with "abort" then.
        for token in allowed[np.linspace(0, len(allowed) - 1, min(len(allowed), FIRST_TOKEN_PROBES)).astype(int)]:
            probe = matcher.deep_copy()
            if not probe.consume_token(int(token)) and probe.is_error():
                raise ValueError(f"invalid {spec.kind}: {matcher_error(probe)}")
        with self._lock:
            self.compile_seconds.append(time.perf_counter() - t0)
            self._cache[spec] = matcher
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher


def matcher_error(matcher: llguidance.LLMatcher) -> str:
    """llguidance's error without the parser state it appends (rows, lexer costs, ...: a
    debugging dump of the matcher's internals, not a message for a client)."""
    msg = matcher.get_error().split("<state>", 1)[0].strip()
    if msg == "NoExtensionBias":  # its name for a state from which no string completes the grammar
        return "no output satisfies it"
    return msg


_executor: llguidance.LLExecutor | None = None


def fill_bitmask(rows: list[tuple[Constraint, int]], bitmask: np.ndarray) -> None:
    """Row r of bitmask [R, ceil(vocab/32)] int32 := the tokens row r's matcher allows next
    (bit t % 32 of word t // 32), for each (constraint, r); computed in parallel by
    llguidance's threads. Called from the engine loop thread only."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    llnp.fill_next_token_bitmask_par(_executor, [(c.matcher, r) for c, r in rows], bitmask)


def next_mask(matcher: llguidance.LLMatcher, vocab_size: int) -> np.ndarray:
    """The packed row (int32 [ceil(vocab_size / 32)], fill_bitmask's layout) of the tokens
    `matcher` allows next. A compiled matcher is shared by threads: pass a deep_copy of one."""
    row = np.zeros((1, bitmask_width(vocab_size)), np.int32)
    llnp.fill_next_token_bitmask(matcher, row, 0)
    return row[0]


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
