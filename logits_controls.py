"""vLLM's logits processors for one request, on the host: what the sampler must do to the
model's logits before it samples the request's next token (SamplingParams' min_tokens,
allowed_token_ids, bad_words, logit_bias and penalties).

Each depends on the request's output so far, so a request that has any of them samples
as a structured-output row does (runner.py): its step's sample program is dispatched once
the previous step's token is known, with

  - a row of the packed token bitmask (structured.py's layout: bit t % 32 of word t // 32),
    AND-ed with the row of its grammar when it has one: allowed_token_ids, bad_words and,
    while the output is shorter than min_tokens, EOS and stop_token_ids;
  - a short sparse list of (token, bias, repetition penalty, subtracted penalty) that the
    sampler applies by a gather and a scatter (sampler.apply_penalties): logit_bias,
    then the repetition penalty on every prompt and output token, then the frequency and
    presence penalties on the output tokens (vLLM's order and formulas).

No JAX here: the lists are built from counts kept up to date one token at a time.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import numpy as np

from sampling_params import ParamError, SamplingParams

MIN_PENALTY_WIDTH = 16  # the narrowest sparse list; wider ones are powers of two
F32_TINY, F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


# vLLM's VLLM_MAX_NUM_BAD_WORDS and VLLM_MAX_BAD_WORDS_TOTAL_TOKENS defaults: a request's
# bad words as token sequences (bad_words_token_ids), and their tokens in all
MAX_NUM_BAD_WORDS, MAX_BAD_WORDS_TOTAL_TOKENS = 128, 1024


def bad_words_token_ids(tokenizer: Any, bad_words: Sequence[str]) -> list[list[int]]:
    """Each bad word as token ids, as vLLM tokenizes it (SamplingParams.update_from_tokenizer):
    a word given twice once, as written (left-stripped), and with a leading space only where
    that spelling is a word of its own, a new first token and as many tokens (" fox" as one
    token when "fox" is two is not refused, as in vLLM)."""
    out = []
    for word in dict.fromkeys(bad_words):
        plain, spaced = (tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False) for prefix in ("", " "))
        if plain:
            out.append([int(t) for t in plain])
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append([int(t) for t in spaced])
    return out


def check_bad_words(token_ids: list[list[int]]) -> None:
    """vLLM's caps on bad words (VLLM_MAX_NUM_BAD_WORDS, VLLM_MAX_BAD_WORDS_TOTAL_TOKENS),
    with its GPU worker's messages: here both are a 400 as the request enters, where vLLM
    refuses the count there and the total only in its worker."""
    if len(token_ids) > MAX_NUM_BAD_WORDS:
        raise ParamError(f"Too many bad words: {len(token_ids)}. The max number is {MAX_NUM_BAD_WORDS}.", "bad_words")
    total = sum(map(len, token_ids))
    if total > MAX_BAD_WORDS_TOTAL_TOKENS:
        raise ParamError(f"Too many total bad word tokens: {total}. The max is {MAX_BAD_WORDS_TOTAL_TOKENS}.",
                         "bad_words")


def penalty_width(n: int) -> int:
    """The sparse list's width for n entries: a power of two, at least MIN_PENALTY_WIDTH (each
    width is one compiled sample program)."""
    return max(MIN_PENALTY_WIDTH, 1 << max(n - 1, 0).bit_length())


class LogitsControls:
    """One request's processors. mask() and penalties() read the request's outputs, every
    one of them but the token the step samples (the runner asserts none is in flight)."""

    __slots__ = ("vocab_size", "allowed", "min_tokens", "stop_ids", "bad_single", "bad_multi", "bias",
                 "presence", "frequency", "repetition", "prompt_ids", "counts", "_seen", "idle_from")

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int,
                 eos_token_ids: Sequence[int], bad_words_ids: list[list[int]]) -> None:
        self.vocab_size = vocab_size
        self.allowed: np.ndarray | None = None  # packed uint32 row of allowed_token_ids
        if params.allowed_token_ids is not None:
            ok = np.zeros(vocab_size, bool)
            ok[list(params.allowed_token_ids)] = True
            self.allowed = pack(ok)
        # vLLM's all_stop_token_ids: EOS whatever ignore_eos says, and the stop tokens
        self.min_tokens = params.min_tokens
        self.stop_ids = sorted(t for t in {*eos_token_ids, *(params.stop_token_ids or ())} if 0 <= t < vocab_size)
        # (a word with a token the logits do not have can never be completed: nothing to mask)
        bad_words_ids = [w for w in bad_words_ids if all(0 <= t < vocab_size for t in w)]
        self.bad_single = sorted({w[0] for w in bad_words_ids if len(w) == 1})
        self.bad_multi = [w for w in bad_words_ids if len(w) > 1]
        self.bias = dict(params.logit_bias or {})
        self.presence, self.frequency = params.presence_penalty, params.frequency_penalty
        self.repetition = params.repetition_penalty
        self.prompt_ids = set(int(t) for t in prompt_ids) if self.repetition != 1.0 else set()
        self.counts: Counter[int] = Counter()  # output token -> occurrences, for the first _seen outputs
        self._seen = 0
        # The output index from which no processor changes anything: min_tokens when it is the
        # only one (its mask of stop tokens ends there); None while any other applies.
        others = (self.allowed is not None or self.bad_single or self.bad_multi or self.bias or self.presence
                  or self.frequency or self.repetition != 1.0)
        self.idle_from: int | None = None if others else self.min_tokens

    def mask(self, outputs: Sequence[int]) -> np.ndarray | None:
        """The packed uint32 row of the tokens allowed next after `outputs`, or None: all."""
        forbid = list(self.bad_single)
        if len(outputs) < self.min_tokens:
            forbid += self.stop_ids
        for w in self.bad_multi:  # vLLM's rule: the last token, where the output ends in the rest
            n = len(w) - 1
            if n <= len(outputs) and list(outputs[len(outputs) - n:]) == w[:-1]:
                forbid.append(w[-1])
        if self.allowed is None and not forbid:
            return None
        row = self.allowed.copy() if self.allowed is not None else np.full((self.vocab_size + 31) // 32, ~np.uint32(0))
        if forbid:
            ids = np.asarray(forbid, np.int64)
            np.bitwise_and.at(row, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        return row

    def penalties(self, outputs: Sequence[int]) -> tuple[np.ndarray, ...] | None:
        """(ids, bias, repetition, subtracted) of the tokens whose logit changes, or None."""
        for t in outputs[self._seen:]:
            self.counts[t] += 1
        self._seen = len(outputs)
        keys = set(self.bias)
        if self.repetition != 1.0:
            keys |= self.prompt_ids
        if self.repetition != 1.0 or self.presence or self.frequency:
            keys |= self.counts.keys()
        if not keys:
            return None
        ids = np.fromiter(keys, np.int32, len(keys))
        counts = np.fromiter((self.counts.get(t, 0) for t in keys), np.float32, len(keys))
        bias = np.fromiter((self.bias.get(t, 0.0) for t in keys), np.float32, len(keys))
        # every key but a bias-only one was seen; float32's normal range (any positive number is
        # vLLM's): 1e-300 would be 0, and a logit / 0 inf; 1e300 inf, and a zero logit * inf NaN
        rep = np.full(len(keys), min(max(self.repetition, F32_TINY), F32_MAX), np.float32)
        if self.bias and self.repetition != 1.0:
            seen = np.fromiter((t in self.prompt_ids or t in self.counts for t in keys), bool, len(keys))
            rep = np.where(seen, rep, np.float32(1.0))
        sub = np.float32(self.frequency) * counts + np.float32(self.presence) * (counts > 0)
        return ids, bias, rep, sub.astype(np.float32)


def first_token_conflict(controls: LogitsControls, grammar_row: np.ndarray | None,
                         position_zero: bool = True) -> list[str]:
    """The request fields that leave no token allowed where the grammar's mask is
    `grammar_row` (a packed uint32 row; None: no grammar), or [] when some token is allowed:
    allowed_token_ids and single-token bad_words, and min_tokens' stop tokens at the first
    position (`position_zero`). Each field named removes some token the grammar allows."""
    everything = pack(np.ones(controls.vocab_size, bool))
    base = everything if grammar_row is None else grammar_row.view(np.uint32) & everything
    parts = []
    if controls.allowed is not None:
        parts.append(("allowed_token_ids", controls.allowed))
    for name, ids in (("bad_words", controls.bad_single),
                      ("min_tokens", controls.stop_ids if position_zero and controls.min_tokens > 0 else [])):
        if len(ids):
            out = np.zeros(controls.vocab_size, bool)
            out[ids] = True
            parts.append((name, ~pack(out)))
    row = base.copy()
    for _, m in parts:
        row &= m
    if row.any():
        return []
    return [name for name, m in parts if (base & ~m).any()]


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [V] -> the packed uint32 row of structured.py's bitmask (bit t % 32 of word t // 32)."""
    words = np.zeros(((len(allowed) + 31) // 32) * 32, bool)
    words[:len(allowed)] = allowed
    return np.packbits(words.reshape(-1, 32), axis=1, bitorder="little").view(np.uint32).reshape(-1)


def controls_for(params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int, eos_token_ids: Sequence[int],
                 bad_words_ids: list[list[int]] | None) -> LogitsControls | None:
    """A request's LogitsControls, or None when it has no processor (the common request);
    bad_words_ids: its bad_words tokenized (bad_words_token_ids)."""
    if not (params.masks_tokens or params.penalized):
        return None
    return LogitsControls(params, prompt_ids, vocab_size, eos_token_ids, bad_words_ids or [])
