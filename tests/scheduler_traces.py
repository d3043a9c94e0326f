"""Recorded step traces of the scheduler, so a refactor can prove it changed nothing.

`CASES` are workloads (configs x requests with arrival steps, EOS draws and an abort)
chosen to cover continuous and static batching, chunked prefill, the three KV admission
modes and on-demand preemption. `trace_of(case)` drives a Scheduler through one (pure
Python, no model) and returns one line of text per step: who was scheduled with how
many tokens, who sampled, who was preempted or released, and why the rest wait.

tests/fixtures/scheduler_traces.json was written by `python tests/scheduler_traces.py`
from a scheduler that had no policy objects; test_policy.py checks that today's
scheduler reproduces it step for step. Regenerate it only for a change that is
meant to alter scheduling decisions, and say so in the commit.
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from config import EngineConfig  # noqa: E402
from kvcache import blocks_needed  # noqa: E402
from sampling_params import SamplingParams  # noqa: E402
from scheduler import Scheduler  # noqa: E402
from sequence import Sequence  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "scheduler_traces.json")
EOS = 0

# name -> EngineConfig overrides and a KV budget as a number of max_model_len sequences
_CONFIGS: dict[str, dict[str, Any]] = {
    "continuous": dict(scheduling="continuous"),
    "static": dict(scheduling="static"),
    "continuous-chunked": dict(scheduling="continuous", enable_chunked_prefill=True, max_num_batched_tokens=16),
    "static-chunked": dict(scheduling="static", enable_chunked_prefill=True, max_num_batched_tokens=16),
    "continuous-tight": dict(scheduling="continuous", kv_seqs=1.5),
    "continuous-tight-chunked": dict(scheduling="continuous", kv_seqs=1.5, enable_chunked_prefill=True,
                                     max_num_batched_tokens=12),
    "static-tight": dict(scheduling="static", kv_seqs=1.5),
    "reserve-tight": dict(scheduling="continuous", kv_admission="reserve", kv_seqs=2),
    "reserve-max-len-tight": dict(scheduling="continuous", kv_admission="reserve-max-len", kv_seqs=2),
    "static-reserve": dict(scheduling="static", kv_admission="reserve", kv_seqs=2),
}
MAX_NUM_SEQS, BLOCK_SIZE, MAX_MODEL_LEN = 4, 4, 48


def make_scheduler(overrides: dict[str, Any], **extra: Any) -> Scheduler:
    kw = {k: v for k, v in overrides.items() if k != "kv_seqs"}
    # Without prefix caching (a preempted sequence would find its own freed blocks in the
    # cache and recompute less) and chunked prefill, unless a case turns them on: the
    # traces pin the mechanics those features change.
    kw.setdefault("enable_prefix_caching", False)
    kw.setdefault("enable_chunked_prefill", False)
    cfg = EngineConfig(max_num_seqs=MAX_NUM_SEQS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                       **kw, **extra).resolved(MAX_MODEL_LEN)
    per_seq = blocks_needed(MAX_MODEL_LEN, BLOCK_SIZE)
    usable = int(overrides.get("kv_seqs", MAX_NUM_SEQS) * per_seq)
    return Scheduler(cfg, usable + 1, (EOS,))


def requests(seed: int, n: int = 14) -> list[dict[str, Any]]:
    """n requests: arrival step, prompt length, max_tokens, ignore_eos; one is aborted."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt_len = rng.randint(1, 30)
        out.append(dict(id=f"r{i}", arrival=rng.randint(0, 40), prompt_len=prompt_len,
                        max_tokens=rng.randint(1, MAX_MODEL_LEN - prompt_len), ignore_eos=rng.random() < 0.5))
    out[rng.randrange(n)]["abort_at"] = rng.randint(1, 60)
    return out


def token_for(request_id: str, num_output_tokens: int) -> int:
    """A deterministic stream: EOS about one draw in 13."""
    return EOS if random.Random(f"{request_id}/{num_output_tokens}").random() < 1 / 13 else 7


def trace_of(config: str, seed: int, **extra: Any) -> list[str]:
    s = make_scheduler(_CONFIGS[config], **extra)
    reqs = requests(seed)
    pending = sorted(reqs, key=lambda r: r["arrival"])
    lines: list[str] = []
    step = 0
    while pending or s.has_unfinished():
        while pending and pending[0]["arrival"] <= step:
            r = pending.pop(0)
            s.add(make_sequence(r))
        for r in reqs:
            if r.get("abort_at") == step and s.abort(r["id"]) is not None:
                lines.append(f"{step} abort {r['id']}")
        out = s.schedule()
        tokens = [token_for(x.seq.request_id, x.seq.num_output_tokens) for x in out.scheduled]
        released = s.update(out, tokens).finished
        s.check_invariants()
        waits = s.waiting_by_reason()
        # These traces' policies cap no prompt share, so none waits on it; the recorded
        # lines count the other reasons.
        assert waits.pop("policy") == 0
        lines.append(" ".join([
            str(step),
            "sched=" + ",".join(f"{x.seq.request_id}:{x.num_new_tokens}{'*' if x.samples else ''}" for x in out.scheduled),
            "pre=" + ",".join(q.request_id for q in out.preempted),
            "rel=" + ",".join(f"{q.request_id}:{q.finish_reason}:{q.num_output_tokens}" for q in released),
            "run=" + ",".join(f"{q.request_id}@{q.slot}/{len(q.block_table)}" for q in s.running),
            "wait=" + ",".join(f"{q.request_id}:{s.waiting.reason_of(q)}" for q in s.waiting),
            "waits=" + ",".join(str(waits[k]) for k in sorted(waits)),
        ]))
        step += 1
        assert step < 5000, "no progress"
    return lines


def make_sequence(r: dict[str, Any]) -> Sequence:
    # Distinct prompts (no shared prefix), so a prefix cache has nothing to find.
    base = 1000 * (int(r["id"][1:]) + 1)
    return Sequence(r["id"], list(range(base, base + r["prompt_len"])),
                    SamplingParams(max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"]), arrival_time=r["arrival"])


CASES = [(config, seed) for config in _CONFIGS for seed in (0, 1, 2)]


def record() -> dict[str, list[str]]:
    return {f"{config}/{seed}": trace_of(config, seed) for config, seed in CASES}


if __name__ == "__main__":
    traces = record()
    with open(FIXTURE, "w") as f:
        json.dump(traces, f, indent=0)
    print(f"wrote {FIXTURE}: {len(traces)} traces, {sum(map(len, traces.values()))} steps")
