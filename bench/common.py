"""What the benches share: the seed's workloads, percentiles, and the machine they ran on.

Workloads are lists of `Request` (a prompt + max_tokens), drawn from a fixed seed so every
run, engine and peer sees the same requests. Prompts are random token ids (with random
weights and ignore_eos, only lengths matter) or, for servers that only take text, English-
looking text from a small fixed-seed generator (so any tokenizer and any model get words).
"""

from __future__ import annotations

import math
import os
import platform
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]  # empty when the prompt is text
    max_tokens: int
    prompt_text: str | None = None

    @property
    def prompt(self) -> list[int] | str:
        """What goes in the request body's "prompt"."""
        return self.prompt_text if self.prompt_text is not None else self.prompt_token_ids


def _prompt(rng: random.Random, vocab_size: int, prompt_len: tuple[int, int]) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))]


# A tiny grammar, enough for text that reads like prose to any tokenizer (and that a real
# model continues as prose): sentences of a subject, a verb, an object and a place.
_WORDS = {
    "adj": "quiet old small bright narrow green wooden cold busy distant heavy gentle broken patient".split(),
    "noun": ("river town market road baker teacher window garden letter lantern bridge harbor child "
             "farmer train village mountain book clock kitchen sailor painter orchard").split(),
    "verb": ("carried found watched repaired opened followed painted crossed remembered described "
             "visited built").split(),
    "place": ("near the station|under the old bridge|before the storm|after the long winter|"
              "along the coast|behind the school|at the edge of the forest|in the morning light").split("|"),
    "link": "Later,|Meanwhile,|Every evening|Without a word,|By noon|Once again".split("|"),
}


def _sentence(rng: random.Random) -> str:
    c = rng.choice
    s = f"the {c(_WORDS['adj'])} {c(_WORDS['noun'])} {c(_WORDS['verb'])} a {c(_WORDS['noun'])} {c(_WORDS['place'])}."
    return (f"{c(_WORDS['link'])} {s}" if rng.random() < 0.3 else s[0].upper() + s[1:])


def text_prompt(rng: random.Random, num_words: int) -> str:
    """About num_words words of prose (cut mid-sentence, so a model has something to continue)."""
    words: list[str] = []
    while len(words) < num_words:
        words += _sentence(rng).split()
    return " ".join(words[:num_words])


def seed_mix(num_requests: int, vocab_size: int, *, short: int = 16, long: int = 512,
             prompt_len: tuple[int, int] = (32, 256), seed: int = 0, text: bool = False) -> list[Request]:
    """The seed's exercise: half max_tokens=short, half long (the odd one out is long),
    shuffled with a fixed seed; prompts of prompt_len[0]..prompt_len[1] random tokens, or
    with text=True that many words of text_prompt (the server's usage says how many tokens)."""
    lengths = [short] * (num_requests // 2) + [long] * (num_requests - num_requests // 2)
    random.Random(seed).shuffle(lengths)
    rng = random.Random(seed + 1)  # prompts: a stream of their own, so lengths do not depend on them
    if text:
        return [Request([], n, text_prompt(rng, rng.randint(*prompt_len))) for n in lengths]
    return [Request(_prompt(rng, vocab_size, prompt_len), n) for n in lengths]


def exponential_mix(num_requests: int, vocab_size: int, *, mean: float = 128, cap: int = 1536,
                    prompt_len: tuple[int, int] = (32, 256), seed: int = 0) -> list[Request]:
    """Output lengths ~ Exponential(mean), rounded up (at least 1 token), capped at `cap`."""
    draw = random.Random(seed)
    lengths = [min(cap, max(1, math.ceil(draw.expovariate(1.0 / mean)))) for _ in range(num_requests)]
    rng = random.Random(seed + 1)  # prompts: a stream of their own, so lengths do not depend on them
    return [Request(_prompt(rng, vocab_size, prompt_len), n) for n in lengths]


def percentile(values: list[float], q: float) -> float:
    """q-th percentile (0..100), linear interpolation between ranks (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99, max: the figures the benches print for a latency list."""
    if not values:
        return {}
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values)}


def machine_info() -> dict[str, object]:
    """CPU model, cores and the versions that matter, for the JSON and the table header."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info: dict[str, object] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}
    for mod in ("jax", "jaxlib", "flax", "transformers", "torch"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    try:
        import jax

        info["jax_backend"] = jax.default_backend()
        info["jax_devices"] = [str(d) for d in jax.devices()]
    except ImportError:
        pass
    return info
