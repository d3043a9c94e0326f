"""Differential fuzzing of speculative decoding: random greedy workloads on random engine
configs, each run with speculation off and on; the outputs must be the same token for
token (text, finish and stop reasons, logprobs; seeded sampling too under ngram, whose
verification draws what plain sampling draws), and after each drain no KV block may stay
held. Not collected by pytest (no test_ prefix): run it by hand,

    PYTHONPATH=$PWD python tests/spec_fuzz.py [first_seed] [num_seeds]

An engine pair serves GROUP consecutive seeds (a new shape compiles); every scheduler step checks the
scheduler's invariants (TAXIRANK_CHECK_INVARIANTS)."""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import sys
import traceback

os.environ["TAXIRANK_CHECK_INVARIANTS"] = "1"
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false".strip()

import numpy as np  # noqa: E402

from llm import LLM  # noqa: E402
from sampling_params import SamplingParams  # noqa: E402

MAX_LEN = 128
GROUP = 8
_engines: dict[tuple, LLM] = {}


CKPT = os.path.join(os.environ.get("TMPDIR", "/tmp"), "spec_fuzz_ckpt")


def checkpoints() -> tuple[str, str, str]:
    """A random 4-layer HF target and two layer-skip drafts of it: layers 0 and 3 (mostly
    wrong) and 0-2 (right more often)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from conftest import make_hf_checkpoint

    from draft_model import write_layer_skip

    target, far, near = (os.path.join(CKPT, name) for name in ("target", "draft", "draft-012"))
    if not os.path.isdir(target):
        make_hf_checkpoint(target, "llama2", seed=3, num_hidden_layers=4, tokenizer=True)
    for layers, out in (([0, 3], far), ([0, 1, 2], near)):
        if not os.path.isdir(out):
            write_layer_skip(target, layers, out, log=lambda _: None)
    return target, far, near


def engine(model: str, spec: dict | None, **flags) -> LLM:
    key = (model, repr(sorted(spec.items())) if spec else None, tuple(sorted(flags.items())))
    if key not in _engines:
        if len(_engines) >= 2:  # only the current pair: engines hold their compiled programs and caches
            _engines.clear()
            gc.collect()
        _engines[key] = LLM(model, speculative_config=spec, max_model_len=MAX_LEN, warmup=False,
                            log=lambda *_: None, **flags)
    return _engines[key]


def random_flags(rng: random.Random) -> dict:
    chunked = rng.random() < 0.7
    bs = rng.choice([4, 8])
    return dict(block_size=bs, max_num_seqs=4, num_kv_blocks=rng.choice([36, 80]) * 4 // bs,
                max_num_batched_tokens=rng.choice([16, 32]) if chunked else MAX_LEN,
                enable_chunked_prefill=chunked, enable_prefix_caching=rng.random() < 0.6,
                async_scheduling=rng.random() < 0.5,
                **(dict(preemption_mode="swap", swap_space=0.001) if rng.random() < 0.3 else {}),
                **(dict(long_prefill_token_threshold=rng.choice([2, 3, 8])) if chunked and rng.random() < 0.3 else {}),
                **(dict(scheduling_policy="priority") if rng.random() < 0.3 else {}))


def random_spec(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        draft = "tiny" if rng.random() < 0.3 else rng.choice(checkpoints()[1:])
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": rng.choice([1, 3])}
    lo = rng.randint(1, 3)
    return {"method": "ngram", "num_speculative_tokens": rng.choice([1, 3]), "prompt_lookup_min": lo,
            "prompt_lookup_max": lo + rng.randint(0, 2)}


def random_prompt(rng: random.Random, shared: list[int]) -> list[int]:
    passage = [rng.randint(3, 250) for _ in range(rng.randint(2, 10))]
    p = (shared if rng.random() < 0.5 else []) + passage * rng.randint(1, 4)
    return p[:rng.randint(3, 60)] or [5]


def random_params(rng: random.Random, prompt: list[int], llm: LLM) -> SamplingParams:
    # (greedy: n is 1, as vLLM refuses more; run_seed's seeded requests draw n)
    kw: dict = dict(temperature=0.0, max_tokens=rng.randint(1, min(50, MAX_LEN - len(prompt))),
                    ignore_eos=rng.random() < 0.5)
    r = rng.random
    if r() < 0.3:
        kw["stop_token_ids"] = rng.sample(prompt, min(len(prompt), rng.randint(1, 3)))
    if r() < 0.25:
        i = rng.randrange(len(prompt))
        text = llm.tokenizer.decode(prompt[i:i + rng.randint(1, 3)])
        if text:
            kw["stop"] = [text]
            kw["include_stop_str_in_output"] = r() < 0.5
    if r() < 0.08:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if r() < 0.05:
        kw["presence_penalty"] = rng.choice([-1.0, 0.5, 2.0])
    if r() < 0.05:
        kw["frequency_penalty"] = rng.choice([-0.5, 1.0])
    if r() < 0.05:
        kw["repetition_penalty"] = rng.choice([0.7, 1.3])
    if r() < 0.05:
        kw["logit_bias"] = {rng.choice(prompt): rng.choice([-100.0, 5.0, 100.0])}
    if r() < 0.4:
        kw["logprobs"] = rng.randint(0, 3)
    if r() < 0.1:
        kw["prompt_logprobs"] = rng.randint(0, 2)
    return SamplingParams(**kw)


def same(a, b, where: str) -> list[str]:
    errs = []
    for i, (x, y) in enumerate(zip(a.outputs, b.outputs)):
        tag = f"{where} sample {i}"
        if x.token_ids != y.token_ids:
            n = next((j for j, (p, q) in enumerate(zip(x.token_ids, y.token_ids)) if p != q),
                     min(len(x.token_ids), len(y.token_ids)))
            errs.append(f"{tag}: tokens differ at {n}: off {x.token_ids[n:n + 6]} ({len(x.token_ids)}) "
                        f"on {y.token_ids[n:n + 6]} ({len(y.token_ids)})")
            continue
        if (x.finish_reason, x.stop_reason, x.text) != (y.finish_reason, y.stop_reason, y.text):
            errs.append(f"{tag}: finish {x.finish_reason, x.stop_reason, x.text!r} vs "
                        f"{y.finish_reason, y.stop_reason, y.text!r}")
        if (x.logprobs is None) != (y.logprobs is None):
            errs.append(f"{tag}: logprobs presence differs")
        elif x.logprobs is not None:
            lx, ly = [t.logprob for t in x.logprobs], [t.logprob for t in y.logprobs]
            if len(lx) != len(ly) or not np.allclose(lx, ly, atol=2e-4):
                errs.append(f"{tag}: logprobs differ {lx[:4]} vs {ly[:4]}")
            if [len(t.top) for t in x.logprobs] != [len(t.top) for t in y.logprobs]:
                errs.append(f"{tag}: top logprob counts differ")
        if x.cumulative_logprob is not None and not np.isclose(x.cumulative_logprob, y.cumulative_logprob, atol=1e-2):
            errs.append(f"{tag}: cumulative_logprob {x.cumulative_logprob} vs {y.cumulative_logprob}")
    if len(a.outputs) != len(b.outputs):
        errs.append(f"{where}: {len(a.outputs)} vs {len(b.outputs)} samples")
    if (a.prompt_logprobs is None) != (b.prompt_logprobs is None):
        errs.append(f"{where}: prompt_logprobs presence differs")
    return errs


def drained(llm: LLM, tag: str) -> list[str]:
    errs = []
    e = llm.engine
    if e.has_unfinished():
        errs.append(f"{tag}: unfinished requests after drain")
    if e.scheduler.allocator.num_used:
        errs.append(f"{tag}: {e.scheduler.allocator.num_used} KV blocks held after drain")
    tracked = getattr(e.proposer, "_seqs", None)  # a draft model's per-sequence cache state
    if tracked is not None and len(tracked):
        errs.append(f"{tag}: the draft model still tracks {len(tracked)} sequences after drain")
    s = llm.stats.snapshot()
    per_pos = s.spec_decode_num_accepted_tokens_per_pos
    if sum(per_pos) != s.spec_decode_num_accepted_tokens or s.spec_decode_num_accepted_tokens > \
            s.spec_decode_num_draft_tokens or any(a < b for a, b in zip(per_pos, per_pos[1:])) or \
            (per_pos and per_pos[0] > s.spec_decode_num_drafts):
        errs.append(f"{tag}: spec counters inconsistent: drafts {s.spec_decode_num_drafts} draft tokens "
                    f"{s.spec_decode_num_draft_tokens} accepted {s.spec_decode_num_accepted_tokens} per pos {per_pos}")
    return errs


def run_seed(seed: int) -> list[str]:
    # An engine pair serves GROUP consecutive seeds (building one compiles).
    erng = random.Random(seed // GROUP)
    flags, spec = random_flags(erng), random_spec(erng)
    rng = random.Random(seed)
    model = "tiny" if spec.get("model", "tiny") == "tiny" else checkpoints()[0]
    base, on = engine(model, None, **flags), engine(model, spec, **flags)
    shared = [rng.randint(3, 250) for _ in range(rng.randint(4, 12))]
    prompts = [random_prompt(rng, shared) for _ in range(rng.randint(1, 6))]
    params = [random_params(rng, p, base) for p in prompts]
    if spec["method"] == "ngram":  # its verification draws what plain seeded sampling draws: token for token
        params = [p if rng.random() < 0.6 else dataclasses.replace(p, **{"temperature": rng.choice([0.3, 1.0]),
                                                                 "top_k": rng.choice([-1, 5]), "seed": rng.randint(0, 9),
                                                                 "n": rng.choice([1, 2])})
                  for p in params]
    tag = f"seed {seed} flags {flags} spec {spec}"
    priority = [rng.randint(0, 2) if flags.get("scheduling_policy") == "priority" else 0 for _ in prompts]
    b0, s0 = base.stats.snapshot(), on.stats.snapshot()
    want = base.generate(prompts, params, use_tqdm=False, priority=priority)
    got = on.generate(prompts, params, use_tqdm=False, priority=priority)
    b1, s1 = base.stats.snapshot(), on.stats.snapshot()
    counted = {k: (getattr(b1, k) - getattr(b0, k), getattr(s1, k) - getattr(s0, k))
               for k in ("generation_tokens", "prompt_tokens")}
    counted["request_success"] = tuple({r: n - getattr(x0, "request_success").get(r, 0) for r, n in
                                        getattr(x1, "request_success").items()} for x0, x1 in ((b0, b1), (s0, s1)))
    errs = [e for i, (w, g) in enumerate(zip(want, got)) for e in same(w, g, f"{tag} request {i} {params[i]}")]
    errs += [f"{tag}: {k} off {a} on {b}" for k, (a, b) in counted.items() if a != b]
    errs += drained(on, tag)
    # Aborts mid-run: some requests dropped after a few steps; the rest still match.
    if rng.random() < 0.4:
        e = on.engine
        ids = [f"fz{seed}-{i}" for i in range(len(prompts))]
        single = [p if p.n == 1 else dataclasses.replace(p, n=1) for p in params]
        seqs = [e.add_request(rid, p, sp) for rid, p, sp in zip(ids, prompts, single)]
        for _ in range(rng.randint(1, 6)):
            e.step()
        victims = [rid for rid in ids if rng.random() < 0.5]
        for rid in victims:
            e.abort(rid)
        while e.has_unfinished():
            e.step()
        errs += drained(on, tag + " after aborts")
        for i, (seq, w) in enumerate(zip(seqs, want)):
            if seq.request_id not in victims and params[i].n == 1 and seq.output_token_ids != w.outputs[0].token_ids:
                errs.append(f"{tag} request {i} beside aborts: {seq.output_token_ids} vs {w.outputs[0].token_ids}")
    if seed % GROUP == GROUP - 1:  # what the group exercised
        st = on.stats.snapshot()
        print(f"  group {seed // GROUP}: {spec} {flags}: drafts {st.spec_decode_num_drafts}, draft tokens "
              f"{st.spec_decode_num_draft_tokens}, accepted {st.spec_decode_num_accepted_tokens}, preemptions "
              f"{st.num_preemptions}, prefix hits {st.prefix_cache_hits}", flush=True)
    return errs


def main() -> None:
    first = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    bad = 0
    for seed in range(first, first + count):
        try:
            errs = run_seed(seed)
        except Exception:
            errs = [f"seed {seed}: {traceback.format_exc()}"]
        for e in errs:
            print("FAIL", e, flush=True)
        bad += bool(errs)
        print(f"seed {seed}: {'FAIL' if errs else 'ok'} ({len(_engines)} engines)", flush=True)
    print(f"{count} seeds, {bad} failing")


if __name__ == "__main__":
    main()
