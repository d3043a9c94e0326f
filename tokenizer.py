"""Tokenizers: a byte-level one for the built-in random-weight models, and transformers'
fast tokenizers for real checkpoints (from a directory's tokenizer files, or built from a
GGUF file's metadata).

Both expose the same small surface the engine and server use: encode, decode,
apply_chat_template, bos_token_id, eos_token_id. IncrementalDetokenizer turns output
tokens into text as they arrive: the engine's stop-string matcher and the server's text.

Nothing here needs torch: transformers' own GGUF reader does (it dequantizes tensors with
it), so a GGUF file's tokenizer is built from metadata the `gguf` library reads, through
transformers' torch-free GGUF-to-tokenizers converter.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any, Callable

from config import TOKENIZER_FILES
from sampling_params import SamplingParams


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes; then bos, eos, pad. The model's vocabulary may be
    larger (a random model can emit any id): ids with no meaning decode to U+FFFD, or to
    nothing when special tokens are skipped."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259
    _SPECIAL_TEXT = {256: "<|bos|>", 257: "<|eos|>", 258: "<|pad|>"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, pending = [], bytearray()  # bytes are decoded together: one char may span ids
        for i in ids:
            if 0 <= i < 256:
                pending.append(i)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special_tokens:
                out.append(self._SPECIAL_TEXT.get(i, "\ufffd"))
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: list[dict] | None = None,
                            continue_final_message: bool = False) -> str | list[int]:
        """ChatML-style text. The markers are plain text here (bytes), not special ids;
        with tokenize=True the ids get a leading bos, as encode() gives. tools are not
        rendered (as by a template without a tools section). continue_final_message: the
        last message stays open (no end marker), as transformers' apply_chat_template."""
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if continue_final_message:
            text = text[:-len("<|im_end|>\n")]
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if tokenize else text


def load_tokenizer(path: str) -> Any | None:
    """A transformers fast tokenizer when `path` holds tokenizer files or is a GGUF file
    with a tokenizer, else None (the engine then takes token-id prompts only)."""
    if path.endswith(".gguf"):
        import gguf_loader

        metadata = gguf_loader.read_tokenizer_metadata(path)
        return gguf_tokenizer(metadata) if metadata is not None else None
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    _quiet_transformers()
    from transformers import AutoTokenizer  # slow import: only when needed

    try:
        tok = AutoTokenizer.from_pretrained(path)
        # each special token's id, resolved now: an unk_token outside the vocabulary (such as "")
        # makes every lookup of an unknown token, unk_token_id's own included, recurse without end
        tok.all_special_ids
    except Exception as e:  # a malformed file raises what its parser raises (AttributeError, TypeError, ...)
        raise ValueError(f"{path}: its tokenizer files do not load ({type(e).__name__}: {e})"[:500]) from None
    check_chat_template_type(tok.chat_template, path)
    return tok


def load_named_tokenizer(path: str) -> Any:
    """The tokenizer --tokenizer names (a folder holding a Hugging Face tokenizer, or a
    .gguf file's metadata), used instead of the model's own; ValueError naming the flag
    where it does not load."""
    from config import check_tokenizer_path

    check_tokenizer_path(path)  # again: the folder may have changed since the config was made
    try:
        tok = load_tokenizer(path)
    except ValueError as e:
        raise ValueError(f"--tokenizer {path!r}: {e}") from None
    if tok is None:
        raise ValueError(f"--tokenizer {path!r}: the GGUF file has no tokenizer (no tokenizer.ggml.model key)")
    return tok


def num_token_ids(tokenizer: Any) -> int:
    """The ids a transformers tokenizer may produce: its largest id + 1 (its added tokens
    included; vLLM's max_token_id + 1), which is what must have embedding rows."""
    return max(tokenizer.get_vocab().values(), default=-1) + 1


def check_chat_template_type(template: object, source: str) -> None:
    """A checkpoint's chat template is text, or named texts (tokenizer_config.json's list
    of {name, template}): anything else would fail every chat request, not the load."""
    named = isinstance(template, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in template.items())
    if template is not None and not isinstance(template, str) and not named:
        raise ValueError(f"{source}: chat_template must be a string or a list of {{name, template}} strings, "
                         f"got {template!r}"[:300])


def gguf_tokenizer(metadata: dict[str, Any]) -> Any:
    """The tokenizer a GGUF file describes, from its `tokenizer.*` keys and
    `general.architecture` (as gguf_loader.read_tokenizer_metadata returns them): the
    same vocabulary, merges, special tokens, BOS/EOS and chat template that
    `AutoTokenizer.from_pretrained(folder, gguf_file=name)` gives, without its torch import."""
    try:
        tok = _gguf_tokenizer(metadata)
    except Exception as e:  # missing keys, ids past the vocabulary, a model type the converter lacks
        raise ValueError(f"the GGUF file's tokenizer metadata does not describe a usable tokenizer "
                         f"({type(e).__name__}: {e})") from None
    check_chat_template_type(tok.chat_template, "the GGUF file's tokenizer.chat_template")
    return tok


def _gguf_tokenizer(metadata: dict[str, Any]) -> Any:
    _quiet_transformers()
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING, _SPECIAL_TOKENS,
                                                                       convert_gguf_tokenizer)

    # What transformers' get_gguf_tokenizer does with the metadata its own reader returns.
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokens, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokens.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary by default
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokens["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokens)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def _quiet_transformers() -> None:
    # Without torch, importing transformers advises that "models won't be available":
    # true, and irrelevant here (only its tokenizers are used).
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


# ---- detokenizing ---------------------------------------------------------------

DETOKENIZE_CONTEXT = 5  # prompt tokens decoded as left context (as vLLM's detokenizer)


def decoder(tokenizer: Any, params: SamplingParams) -> Callable[[list[int]], str]:
    """ids -> text as tokenizer.decode gives it under params. A transformers fast tokenizer
    whose decode is its Rust backend's (its own _decode, no clean-up pass) is called there
    directly: 2 us a call against 13 us through decode()'s Python layers, which the
    per-token detokenizer pays twice a token of every request."""
    skip = params.skip_special_tokens
    # Only a transformers tokenizer's class (transformers imported already) is looked up: the
    # first import of transformers' lazy attributes is not thread-safe, and requests build
    # decoders on the event loop and the engine thread at once (a ByteTokenizer's first ones
    # failed with "cannot import name 'PreTrainedTokenizerFast'", a 500).
    if any(c.__module__.startswith("transformers") for c in type(tokenizer).__mro__):
        from transformers import PreTrainedTokenizerFast
        if (isinstance(tokenizer, PreTrainedTokenizerFast)
                and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
                and not tokenizer.clean_up_tokenization_spaces):
            return partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=skip)
    kw = {"skip_special_tokens": skip}
    if not params.spaces_between_special_tokens:
        # transformers' slow tokenizers honour this; the fast ones join tokens without
        # spaces already, as vLLM's default output for them does.
        kw["spaces_between_special_tokens"] = False

    def decode(ids: list[int]) -> str:
        try:
            return tokenizer.decode(ids, **kw)
        except TypeError:  # a tokenizer without the keyword
            return tokenizer.decode(ids, skip_special_tokens=skip)
    return decode


def _context(decode: Callable[[list[int]], str], prompt_ids: list[int]) -> list[int]:
    """The longest suffix of at most DETOKENIZE_CONTEXT prompt tokens that decodes without
    a U+FFFD (as vLLM picks its detokenizer's prompt suffix): a prompt that ends in part of
    a character would otherwise complete it with the output's first bytes, text a whole
    decode of the output never has."""
    for n in range(min(DETOKENIZE_CONTEXT, len(prompt_ids)), 0, -1):
        if "\ufffd" not in decode(list(prompt_ids[-n:])):
            return list(prompt_ids[-n:])
    return []


class IncrementalDetokenizer:
    """Token ids in, text safe to send out, one engine step at a time.

    Decoding is not append-only: a multi-byte character arrives over several byte tokens
    (decoding to '\\ufffd' until it is complete), and SentencePiece drops a word's leading
    space when a piece is decoded alone. So, as vLLM does, decode a short window that
    starts a few tokens back and take only what the newest tokens added, once it does not
    end in '\\ufffd'. Stop strings are matched on the accumulated text, so one split across
    tokens is still found; text that may be the start of a stop string is held back until
    the next token decides, so a stop string is never partly sent.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: list[str],
                 params: SamplingParams | None = None, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.params = params or SamplingParams()
        self.eos_token_ids = eos_token_ids
        self.decode = decoder(tokenizer, self.params) if tokenizer is not None else None
        # Left context from the prompt, so the first output token decodes as it would
        # mid-text; never emitted itself.
        self.ids = _context(self.decode, prompt_ids) if self.decode is not None else []
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.ids)  # tokens up to here are already in self.text
        self.text = ""  # decoded output, cut at a stop string
        self.sent = 0  # characters of self.text already handed out
        self.stop_reason: str | None = None  # the stop string that matched (vLLM's stop_reason)
        self.num_output = 0  # output tokens taken: stop strings are looked for past min_tokens of them
        self.final = False  # the latest advance was final: every token is in `text` as a whole decode has it

    def push(self, new_ids: list[int], final: bool) -> tuple[str, bool]:
        """Add one step's tokens; return (new text to send, whether a stop string matched)."""
        stopped = self.advance(new_ids, final)
        return self.take(final or stopped), stopped

    def take(self, whole: bool) -> str:
        """The text not handed out yet that is safe to send: all of it once the request has
        ended (`whole`), else all but a tail that may still become a stop string (none with
        include_stop_str_in_output: the string is output anyway, as vLLM)."""
        end = len(self.text)
        if not whole and not self.params.include_stop_str_in_output:
            end -= partial_stop_len(self.text, self.stop)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> str:
        """The request has ended (any reason): the rest of its text, a character still
        incomplete included (as '\\ufffd', as a whole decode gives it). After a final
        advance (the common end) that is all decoded already: no decode again."""
        if not self.final:
            self.advance([], final=True)
        return self.take(whole=True)

    def advance(self, new_ids: list[int], final: bool) -> bool:
        """Add tokens to `text`; whether a stop string completed in them (`text` then ends
        before it, or after it with include_stop_str_in_output, and `stop_reason` is it).
        The engine's matcher calls this alone."""
        if self.tokenizer is None:
            return False
        self.num_output += len(new_ids)
        self.final = final
        include = self.params.include_stop_str_in_output
        # A token that ends the request with "stop" is never text (vLLM): not even with
        # skip_special_tokens=False, and not when a tokenizer does not mark it special;
        # unless include_stop_str_in_output keeps it, as vLLM's.
        if final and new_ids and not include and self.params.stop_token(new_ids[-1], self.eos_token_ids):
            new_ids = new_ids[:-1]
        self.ids += new_ids
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        window = self.decode(self.ids[self.prefix_offset:])
        old_len = len(self.text)
        if len(window) > len(prefix) and (final or not window.endswith("\ufffd")):
            self.text += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

        # A stop string found now must end in the new text, so start looking len(s)-1 back;
        # none is looked for until the output is longer than min_tokens (vLLM's detokenizer).
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, max(0, old_len - len(s) + 1))) >= 0] \
            if self.num_output > self.params.min_tokens else []
        stopped = bool(hits)
        if stopped:
            if include:  # the one completed first, as if the text came a character at a time; kept
                cut, self.stop_reason = min(((i + len(s), s) for i, s in hits), key=lambda h: h[0])
            else:  # the earliest: nothing of any stop string is output
                cut, self.stop_reason = min(hits, key=lambda h: h[0])
            self.text = self.text[:cut]
            assert len(self.text) >= self.sent, "held-back text was sent"
        return stopped


def partial_stop_len(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string.

    Linear in the stop strings' length (KMP: the prefix function of s, then its automaton
    run over the last len(s) - 1 characters), where trying every prefix of every stop
    string is quadratic. No separator character joins the two: a stop string may hold any."""
    best = 0
    for s in stop:
        if len(s) < 2:
            continue
        tail = text[-(len(s) - 1):]
        if s[0] not in tail:  # the common case, in C: no suffix can start the stop string
            continue
        pi = [0] * len(s)
        for i in range(1, len(s)):
            k = pi[i - 1]
            while k and s[i] != s[k]:
                k = pi[k - 1]
            pi[i] = k + (s[i] == s[k])
        k = 0  # the longest prefix of s that ends here; below len(s): tail is shorter
        for c in tail:
            while k and c != s[k]:
                k = pi[k - 1]
            k += c == s[k]
        best = max(best, k)
    return best
