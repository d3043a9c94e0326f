"""The README's deterministic figures, recomputed by the real Scheduler without the model
(bench/simulate.py, one unit of time per step) in seconds, and read from the README
itself so a figure and its check cannot drift apart.

Step counts, finish steps, preemptions and prefix-cache hits depend only on the
scheduler's decisions (every request runs greedy with ignore_eos, so its length is its
max_tokens), not on the model's numbers. The figures were measured with chunked prefill
off and synchronous scheduling (the simulator's loop), on the benches' workloads."""

from __future__ import annotations

import math
import os
import random
import re

from conftest import ROOT, load_bench

from config import EngineConfig
from sampling_params import SamplingParams
from scheduler import Scheduler
from sequence import Sequence

README = open(os.path.join(ROOT, "README.md")).read()
VOCAB = 32000  # the `bench` model's


def quoted(pattern: str) -> float:
    """The number the README quotes where `pattern` (one group) matches, exactly once."""
    found = re.findall(pattern, " ".join(README.split()))
    assert len(found) == 1, f"the README should quote {pattern!r} once, found {found}"
    return float(found[0])


def simulate(reqs, max_num_seqs: int, max_model_len: int, scheduling: str = "continuous",
             num_kv_blocks: int | None = None, prefix_caching: bool = False):
    sim = load_bench("simulate")
    cfg = EngineConfig(model="bench", max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=16,
                       scheduling=scheduling, enable_chunked_prefill=False,
                       enable_prefix_caching=prefix_caching).resolved(max_model_len)
    # bench/offline.py's KV: every slot can hold a whole max_model_len sequence (+ the null block)
    num_kv_blocks = num_kv_blocks or max_num_seqs * math.ceil(max_model_len / 16) + 1
    work = [sim.SimRequest(0.0, list(r.prompt_token_ids), r.max_tokens, cls=str(r.max_tokens)) for r in reqs]
    return sim.simulate(cfg, num_kv_blocks, work, sim.UNIT_STEPS, record_trace=prefix_caching)


def short_long_mix():
    return load_bench("workload").short_long_mix(100, VOCAB, short=16, long=512, prompt_len=(32, 256))


def test_offline_step_count_ideals_continuous_over_static():
    """bench/offline.py's ideals: static steps / continuous steps on the short/long mix at 32
    slots and on exponential lengths (300 requests, mean 128, cap 1536, max_model_len
    2048); the short requests' p99 finish step, static / continuous, at 64 slots."""
    mix = short_long_mix()
    c32, s32 = simulate(mix, 32, 1024), simulate(mix, 32, 1024, "static")
    assert round(s32.steps / c32.steps, 2) == quoted(r"\(step-count ideal (\d+\.\d+)x\)")
    c64, s64 = simulate(mix, 64, 1024), simulate(mix, 64, 1024, "static")
    p99 = s64.latency("16")["p99"] / c64.latency("16")["p99"]  # time = steps: the finish step
    assert round(p99, 1) == quoted(r"10\.5x lower \(ideal (\d+\.\d+)x\)")
    exp = load_bench("workload").exponential_mix(300, VOCAB, mean=128, cap=1536, prompt_len=(32, 256))
    c, s = simulate(exp, 32, 2048), simulate(exp, 32, 2048, "static")
    assert round(s.steps / c.steps, 2) == quoted(r"exponential lengths \(ideal (\d+\.\d+)x\)")


def test_simulator_validation_preemptions_on_a_tight_kv_cache():
    """bench/simulate.py --validate's tight case: the short/long mix at 32 slots with KV blocks
    for 6 sequences of max_model_len 1024."""
    tight = simulate(short_long_mix(), 32, 1024, num_kv_blocks=6 * 64 + 1)
    assert tight.preemptions == quoted(r"tight KV with (\d+) preemptions")


def prompt_hits(res, prompts: list[list[int]]) -> float:
    """Prompt tokens served from the cache / prompt tokens: with nothing preempted, every
    prompt token the steps did not compute was a hit."""
    assert res.preemptions == 0
    computed = sum(t.num_prefill_tokens for t in res.trace)
    total = sum(len(p) for p in prompts)
    return (total - computed) / total


# bench/prefix.py's one engine shape: 64 slots, max_model_len 1120, KV for every request at once.
PREFIX_SHAPE = dict(max_num_seqs=64, max_model_len=1120, num_kv_blocks=64 * 70 + 1)


def test_prefix_cache_hit_rate_of_64_requests_sharing_a_system_prompt():
    """bench/prefix.py's `shared`: a 1,024-token system prompt, then each request's own
    32-token question; 64 tokens out."""
    class Req:
        def __init__(self, prompt_token_ids: list[int]) -> None:
            self.prompt_token_ids, self.max_tokens = prompt_token_ids, 64

    rng = random.Random(0)
    system = [rng.randrange(3, VOCAB) for _ in range(1024)]
    prompts = [system + [rng.randrange(3, VOCAB) for _ in range(32)] for _ in range(64)]
    rate = prompt_hits(simulate([Req(p) for p in prompts], **PREFIX_SHAPE, prefix_caching=True), prompts)
    assert round(100 * rate, 1) == quoted(r"\((\d+\.\d+)% of prompt tokens hit\)")


def test_prefix_cache_hit_rate_of_the_fourth_turn_of_16_conversations():
    """bench/prefix.py's `multiturn`: a 512-token first message, 32-token messages after,
    64-token answers; each turn resends the conversation so far. One scheduler across the
    turns, as one engine serves them, so turn k finds turn k-1's blocks cached. The
    answers are the simulator's one sampled id: a hit depends on what is resent, not on
    what it says."""
    sim = load_bench("simulate")
    rng = random.Random(1)
    convs = [[rng.randrange(3, VOCAB) for _ in range(512)] for _ in range(16)]
    news = [[[rng.randrange(3, VOCAB) for _ in range(32)] for _ in range(16)] for _ in range(3)]
    cfg = EngineConfig(model="bench", max_num_seqs=64, max_model_len=1120, block_size=16, enable_chunked_prefill=False,
                       enable_prefix_caching=True).resolved(1120)
    sched = Scheduler(cfg, PREFIX_SHAPE["num_kv_blocks"], eos_token_ids=())
    for turn in range(4):
        seqs = [Sequence(f"t{turn}-{i}", c, SamplingParams(max_tokens=64, ignore_eos=True), arrival_time=0.0)
                for i, c in enumerate(convs)]
        for s in seqs:
            sched.add(s)
        computed = 0
        while sched.has_unfinished():
            out = sched.schedule()
            computed += out.num_prefill_tokens
            sched.update(out, [sim.NOT_EOS] * len(out.scheduled))
        if turn < 3:
            convs = [c + [sim.NOT_EOS] * 64 + new for c, new in zip(convs, news[turn])]
    assert sum(s.num_preemptions for s in seqs) == 0
    total = sum(s.num_prompt_tokens for s in seqs)
    assert round(100 * (total - computed) / total) == quoted(r"TTFT p50 5\.3x lower \((\d+)% hit\)")
