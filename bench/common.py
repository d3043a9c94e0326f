"""What the benches share: the seed's workloads, percentiles, and the machine they ran on.

Workloads are lists of `Request` (prompt token ids + max_tokens), drawn from a fixed
seed so every run, engine and peer sees the same requests. Prompts are random token ids:
with random weights and ignore_eos, only lengths matter.
"""

from __future__ import annotations

import math
import os
import platform
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


def _prompt(rng: random.Random, vocab_size: int, prompt_len: tuple[int, int]) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))]


def seed_mix(num_requests: int, vocab_size: int, *, short: int = 16, long: int = 512,
             prompt_len: tuple[int, int] = (32, 256), seed: int = 0) -> list[Request]:
    """The seed's exercise: half max_tokens=short, half long (the odd one out is long),
    shuffled with a fixed seed; prompts of prompt_len[0]..prompt_len[1] random tokens."""
    lengths = [short] * (num_requests // 2) + [long] * (num_requests - num_requests // 2)
    random.Random(seed).shuffle(lengths)
    rng = random.Random(seed + 1)  # prompts: a stream of their own, so lengths do not depend on them
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
