"""The benches' workloads, drawn from fixed seeds so every run, engine and peer server sees
the same requests: the short/long mix, exponential lengths, shared-prefix prompts, arrivals.
Prompts are random token ids or, for servers that only take text, prose from a small
fixed-seed grammar (any tokenizer and any model get words).
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass

BUILTIN_VOCAB = {"tiny": 512, "bench": 32000}


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]  # empty when the prompt is text
    max_tokens: int
    prompt_text: str | None = None

    @property
    def prompt(self) -> list[int] | str:
        """What goes in the request body's "prompt"."""
        return self.prompt_text if self.prompt_text is not None else self.prompt_token_ids


def token_ids(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    """n random ids above the ids models reserve for special tokens (0..2)."""
    return [rng.randrange(3, max(vocab_size, 4)) for _ in range(n)]


_WORDS = {
    "adj": "quiet old small bright narrow green wooden cold busy distant heavy gentle broken patient".split(),
    "noun": ("river town market road baker teacher window garden letter lantern bridge harbor child "
             "farmer train village mountain book clock kitchen sailor painter orchard").split(),
    "verb": "carried found watched repaired opened followed painted crossed remembered described visited built".split(),
    "place": ("near the station|under the old bridge|before the storm|after the long winter|along the coast|"
              "behind the school|at the edge of the forest|in the morning light").split("|"),
    "link": "Later,|Meanwhile,|Every evening|Without a word,|By noon|Once again".split("|"),
}


def _sentence(rng: random.Random) -> str:
    c = rng.choice
    s = f"the {c(_WORDS['adj'])} {c(_WORDS['noun'])} {c(_WORDS['verb'])} a {c(_WORDS['noun'])} {c(_WORDS['place'])}."
    return f"{c(_WORDS['link'])} {s}" if rng.random() < 0.3 else s[0].upper() + s[1:]


def text_prompt(rng: random.Random, num_words: int) -> str:
    """About num_words words of prose, cut mid-sentence so a model has something to continue."""
    words: list[str] = []
    while len(words) < num_words:
        words += _sentence(rng).split()
    return " ".join(words[:num_words])


def short_long_mix(num_requests: int, vocab_size: int, *, short: int = 16, long: int = 512,
                   prompt_len: tuple[int, int] = (32, 256), seed: int = 0, text: bool = False) -> list[Request]:
    """Half the requests max_tokens=short, half long (the odd one out long), shuffled: static
    batching holds every slot until its batch's longest request ends, continuous batching refills
    it. Prompts of prompt_len[0]..prompt_len[1] random ids, or words with text=True."""
    lengths = [short] * (num_requests // 2) + [long] * (num_requests - num_requests // 2)
    random.Random(seed).shuffle(lengths)
    rng = random.Random(seed + 1)  # prompts draw from a stream of their own: lengths do not depend on them
    if text:
        return [Request([], n, text_prompt(rng, rng.randint(*prompt_len))) for n in lengths]
    return [Request([rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))], n) for n in lengths]


def exponential_mix(num_requests: int, vocab_size: int, *, mean: float = 128, cap: int = 1536,
                    prompt_len: tuple[int, int] = (32, 256), seed: int = 0) -> list[Request]:
    """Output lengths ~ Exponential(mean), rounded up (at least 1 token), capped at `cap`."""
    draw = random.Random(seed)
    lengths = [min(cap, max(1, math.ceil(draw.expovariate(1.0 / mean)))) for _ in range(num_requests)]
    rng = random.Random(seed + 1)
    return [Request([rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))], n) for n in lengths]


def shared_prefix(num_requests: int, vocab_size: int, *, prefix_len: int, suffix_len: int, max_tokens: int,
                  seed: int = 0, num_prefixes: int = 1) -> list[Request]:
    """num_prefixes system prompts of prefix_len ids; each request starts with one (drawn at
    random when there are several), then a question of suffix_len ids of its own."""
    rng = random.Random(seed)
    systems = [token_ids(rng, vocab_size, prefix_len) for _ in range(num_prefixes)]
    return [Request(systems[rng.randrange(num_prefixes) if num_prefixes > 1 else 0]
                    + token_ids(rng, vocab_size, suffix_len), max_tokens) for _ in range(num_requests)]


def arrival_times(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """All at 0 (a burst) without a rate; else a Poisson process of `rate` requests/s from 0."""
    if not rate:
        return [0.0] * n
    rng, t, out = random.Random(seed + 2), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def vocab_size_of(model: str) -> int:
    """A built-in model's vocabulary, an HF directory's config.json's, else Llama's 32000."""
    if model in BUILTIN_VOCAB:
        return BUILTIN_VOCAB[model]
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])
    except (OSError, KeyError, ValueError):
        return 32000
