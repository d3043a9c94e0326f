"""Compilations, counted by JAX itself (its backend-compile and persistent-cache events
through jax.monitoring), not by the engine's own trace hook.

Claims: warm-up compiles exactly one program per shape bucket, the engine's counter agrees,
and afterwards no workload compiles anything, whatever the scheduling (continuous chunked,
continuous unchunked, static), sampling and logprobs, across every bucket the workload
uses (checked to be all of them). (A restart from the persistent compilation cache is
test_restart.py's.)"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import count_compilations, fresh_step_programs

from llm import LLM, SamplingParams

# One set of shapes for every variant: their programs are the same, so after the first
# variant warm-up is persistent-cache hits (still compiles handed to XLA, still counted).
SHAPES = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
VARIANTS = {
    "continuous, chunked": dict(enable_chunked_prefill=True),
    "continuous, unchunked": dict(),
    "static": dict(scheduling="static"),
}


# generate() calls of 4, 2, 1 and 5 requests: static batches of every size, so static
# too decodes in every row bucket (its rows are its seats, finished or not).
GROUPS = [4, 2, 1, 5]


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompt lengths spread over every token bucket, batches of every decode row count,
    greedy and sampled rows, with and without logprobs and prompt logprobs."""
    rng = np.random.default_rng(5)
    lens = [1, 60, 5, 20, 40, 3, 12, 30, 50, 2, 9, 25]
    ps = [rng.integers(3, 250, m).tolist() for m in lens]
    params = [SamplingParams(max_tokens=int(min(k, 64 - m)), temperature=t, top_p=0.9, top_k=tk, min_p=mp, seed=i,
                             logprobs=lp, prompt_logprobs=plp, ignore_eos=True)
              for i, (m, k, t, tk, mp, lp, plp) in enumerate(zip(
                  lens, [1, 3, 20, 9, 12, 30, 2, 14, 6, 40, 4, 11], [0.0, 0.7, 1.0] * 4, [-1, 5, 50] * 4,
                  [0.0, 0.0, 0.1] * 4, [None, 3, None, 0] * 3, [None, 2, None, None, 0, None] * 2))]
    return ps, params


def buckets_used(llm: LLM) -> set[tuple[str, int]]:
    """The shape of every step the trace shows, as the runner pads it: a decode step
    computes the occupied slots (those running before the step: the ones still running
    after it plus the ones it released), a step with prompt tokens its token count."""
    cfg = llm.engine.config
    used = set()
    for t in llm.engine.trace:
        if t.num_prefill_tokens == 0:
            rows = t.num_running + len(t.released)
            used.add(("decode", next(b for b in cfg.decode_buckets if b >= rows)))
        else:
            tokens = t.num_prefill_tokens + t.num_decode_tokens
            used.add(("ragged", next(b for b in cfg.token_buckets if b >= tokens)))
    return used


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_warmup_compiles_each_bucket_once_and_no_workload_compiles_after(variant):
    fresh_step_programs()  # else another engine's programs with these shapes leave warm-up nothing to compile
    llm = LLM("tiny", log=lambda *_: None, warmup=False, record_trace=True, **SHAPES, **VARIANTS[variant])
    cfg = llm.engine.config
    all_buckets = {("decode", b) for b in cfg.decode_buckets} | {("ragged", b) for b in cfg.token_buckets}
    # and one sample program, whatever the step's row count, and one prompt-logprob program
    num_programs = len(all_buckets) + 2
    with count_compilations() as warm:
        llm.engine.runner.warmup(lambda *_: None)
    assert len(warm) == num_programs == llm.stats.num_compilations, warm
    ps, params = workload()
    outs = []
    with count_compilations() as during:
        for start, n in zip(np.cumsum([0] + GROUPS), GROUPS):
            outs += llm.generate(ps[start:start + n], params[start:start + n])
    assert during == [], f"compiled while serving: {during}"
    assert llm.stats.num_compilations == num_programs
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert [len(o.outputs[0].logprobs or []) for o in outs] == [p.max_tokens if p.logprobs is not None else 0
                                                                for p in params]
    assert [len(o.prompt_logprobs or []) for o in outs] == [
        len(x) if p.prompt_logprobs is not None else 0 for x, p in zip(ps, params)]
    assert buckets_used(llm) == all_buckets, "the workload must exercise every bucket"


def test_an_engine_like_one_built_before_compiles_nothing_and_another_model_compiles_its_own(hf_checkpoint):
    """Engines in one process share programs by what the programs close over (runner.
    ProgramKey): a second engine on the same checkpoint and shapes compiles nothing and
    gives transformers' tokens; a checkpoint with the same shapes but another RoPE theta
    (only its ModelConfig differs, in the model's GraphDef) compiles programs of its own
    and gives its own transformers' tokens, which differ from the first's."""
    from conftest import hf_greedy

    base = hf_checkpoint("llama2")
    other = hf_checkpoint("llama2", rope_theta=100.0)
    prompt, n = [1, 17, 45, 200, 3, 99, 150, 7], 12
    want, want_other = hf_greedy(base, prompt, n), hf_greedy(other, prompt, n)
    assert want != want_other, "the RoPE theta must change these tokens, or sharing could not show"
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    fresh_step_programs()
    first = LLM(base, log=lambda *_: None, **SHAPES)
    assert first.stats.num_compilations > 0
    lines: list[str] = []
    with count_compilations() as compiled:
        again = LLM(base, log=lines.append, **SHAPES)
        assert again.generate([prompt], greedy)[0].outputs[0].token_ids == want
    assert compiled == [] and again.stats.num_compilations == 0
    warmup = [x for x in lines if x.startswith("warm-up: ")]
    assert warmup == [f"warm-up: all {len([x for x in lines if x.startswith('warm-up ')])} programs were compiled "
                      "already, by an engine of this process with the same model structure and settings"], lines
    with count_compilations() as compiled:
        theirs = LLM(other, log=lambda *_: None, **SHAPES)
        assert theirs.generate([prompt], greedy)[0].outputs[0].token_ids == want_other
    assert theirs.stats.num_compilations == first.stats.num_compilations == len(compiled)
