"""Offline bench: how much does continuous batching beat static, and taxirank beat transformers?

    python bench/offline.py [--tiny] [--sections mix32,p99-64,exp32,peers] [--num-requests N]

Sections, workloads and targets: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import (continuous_vs_static, lean, log, machine_info, positive, ratio_rows, results_dir,  # noqa: E402
                    run_line, sections, side_by_side, text_table, timed_generate, warm, write_json)
from workload import Request, exponential_mix, short_long_mix, vocab_size_of  # noqa: E402

SECTIONS = ("mix32", "p99-64", "exp32", "peers")
TORCH_THREADS = 2  # the bench machine has 2 cores; JAX's CPU client uses all cores too


@dataclass(frozen=True)
class Sizes:
    model: str
    num_requests: int  # the short/long mix: half `short`, half `long` output tokens
    short: int
    long: int
    prompt_len: tuple[int, int]
    seqs_throughput: int  # max_num_seqs of mix32 and exp32
    seqs_latency: int  # max_num_seqs of p99-64
    max_model_len: int  # engines running the mix
    exp_requests: int  # exp32: lengths ~ Exponential(exp_mean), capped at exp_cap
    exp_mean: float
    exp_cap: int
    exp_max_model_len: int
    peer_requests: int  # the slice the peers run: the first peer_requests/2 short and long requests
    peer_seqs: int  # max_num_seqs / max_requests_per_batch / static batch size, the same for all three
    peer_long: int  # max_tokens of the slice's long requests
    max_num_batched_tokens: int | None  # None: the engine's default


# The peers run a slice of the mix (transformers on 2 CPU cores would take most of an hour for
# all of it) that keeps its shape: static batches still wait for their longest member.
FULL = Sizes(model="bench", num_requests=100, short=16, long=512, prompt_len=(32, 256), seqs_throughput=32,
             seqs_latency=64, max_model_len=1024, exp_requests=300, exp_mean=128, exp_cap=1536,
             exp_max_model_len=2048, peer_requests=24, peer_seqs=8, peer_long=512, max_num_batched_tokens=None)
TINY = Sizes(model="tiny", num_requests=8, short=4, long=24, prompt_len=(8, 24), seqs_throughput=4, seqs_latency=4,
             max_model_len=64, exp_requests=12, exp_mean=8, exp_cap=32, exp_max_model_len=64, peer_requests=4,
             peer_seqs=4, peer_long=24, max_num_batched_tokens=64)
TARGETS = {"mix32": 1.8, "p99-64": 15.0, "exp32": 3.0, "peers_cb": 5.0, "peers_static": 2.0}


class Engines:
    """One LLM per (max_num_seqs, scheduling, max_model_len), built and warmed up outside every
    timed region and shared by the sections that use it. `engine_args`: the EngineConfig fields
    every engine shares beyond the default float32 model."""

    def __init__(self, model: str, log: Callable[[str], None], **engine_args: Any) -> None:
        self.model, self.log, self.engine_args = model, log, {"dtype": "float32"} | engine_args
        self.engines: dict[tuple[int, str, int], Any] = {}
        self.build_s: dict[str, float] = {}

    def keep_only(self, keys: set[tuple[int, str, int]]) -> None:
        for k in [k for k in self.engines if k not in keys]:
            del self.engines[k]
        gc.collect()

    def get(self, max_num_seqs: int, scheduling: str, max_model_len: int) -> Any:
        key = (max_num_seqs, scheduling, max_model_len)
        if key not in self.engines:
            from compilation import clear_program_caches
            from llm import LLM

            clear_program_caches()  # each build whole, as in a new process: not another engine's programs
            t0 = time.perf_counter()
            # KV never limits (scheduling is measured here, not memory); the +1 is the null block
            llm = LLM(self.model, log=lambda s: self.log(f"    [engine] {s}"), max_num_seqs=max_num_seqs,
                      scheduling=scheduling, max_model_len=max_model_len, block_size=16,
                      num_kv_blocks=max_num_seqs * math.ceil(max_model_len / 16) + 1, **self.engine_args)
            warm(llm)
            self.build_s[f"{scheduling}-{max_num_seqs}-{max_model_len}"] = round(time.perf_counter() - t0, 2)
            self.engines[key] = llm
        return self.engines[key]


# ---- the Hugging Face peer -------------------------------------------------------------

def hf_config(c: Any) -> dict[str, Any]:
    """A taxirank Llama ModelConfig as the fields of an HF config.json."""
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=c.vocab_size,
                hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
                tie_word_embeddings=c.tie_word_embeddings, hidden_act="silu", torch_dtype="float32",
                bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids))


def hf_model_from(model_name: str):
    """transformers' LlamaForCausalLM holding the very arrays of taxirank's model (load_model is
    deterministic from seed 0), named with the loader's own mapping; EOS off."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_loader import hf_state_dict, load_model

    loaded = load_model(model_name, "float32", 0)
    c = loaded.config
    assert c.architecture == "llama" and not c.attention_bias and not c.qk_norm, c
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope = {**dict(c.rope_scaling), "rope_type": "llama3", "rope_theta": c.rope_theta}
    fields = {k: v for k, v in hf_config(c).items() if k not in ("rope_theta", "torch_dtype")}
    hf_cfg = LlamaConfig(**fields | {"rope_parameters": rope, "eos_token_id": None, "pad_token_id": 0})
    hf_cfg._attn_implementation = "sdpa"
    state = {k: torch.from_numpy(np.array(x, np.float32)) for k, x in hf_state_dict(loaded.model).items()}
    hf = LlamaForCausalLM(hf_cfg)  # random init, overwritten in full just below
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    return hf.eval()


def run_hf_static(hf, reqs: list[Request], batch_size: int) -> dict[str, Any]:
    """Padded static batching, the way `generate` does it: batches of batch_size prompts,
    left-padded, each running to its longest max_tokens; only the requested tokens count."""
    import torch
    from transformers import GenerationConfig

    def gen(batch: list[Request]) -> list[list[int]]:
        width, n = max(len(r.prompt_token_ids) for r in batch), max(r.max_tokens for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        return [out[i, width:width + r.max_tokens].tolist() for i, r in enumerate(batch)]

    with torch.inference_mode():
        gen([replace(r, max_tokens=min(r.max_tokens, 4)) for r in reqs[:batch_size]])  # warm-up at the real shapes
        batches = [reqs[i:i + batch_size] for i in range(0, len(reqs), batch_size)]
        t0 = time.perf_counter()
        tokens = [t for batch in batches for t in gen(batch)]
        wall = time.perf_counter() - t0
    n_out = sum(r.max_tokens for r in reqs)
    assert all(len(t) == r.max_tokens for t, r in zip(tokens, reqs))
    return {"peer": "transformers generate (padded static)", "batch_size": batch_size, "wall_s": wall,
            "output_tokens": n_out, "output_tok_s": n_out / wall, "token_ids": tokens,
            "decode_steps": sum(max(r.max_tokens for r in b) for b in batches)}


def run_hf_continuous(hf, reqs: list[Request], max_requests: int, max_batch_tokens: int) -> dict[str, Any]:
    """transformers' continuous batching. `generate_batch` takes one max_new_tokens for all
    requests, so this drives the manager it wraps (add_request(..., max_new_tokens=n),
    get_result): same scheduler and runner, per-request lengths. Start-up and a warm-up
    request stay outside the timed region."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256  # its default page size
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in reqs)
    cb = ContinuousBatchingConfig(
        max_requests_per_batch=max_requests, max_batch_tokens=max_batch_tokens, page_size=page,
        num_blocks=max_requests * (math.ceil(longest / page) + 1) + 2,  # KV never limits, as for taxirank
        allow_block_sharing=False,  # no prefix caching: random prompts share nothing
    )
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in reqs), eos_token_id=-1,
                               pad_token_id=0)

    def run(manager: Any, batch: list[Request], prefix: str) -> dict[str, Any]:
        for i, r in enumerate(batch):
            manager.add_request(r.prompt_token_ids, request_id=f"{prefix}{i}", max_new_tokens=r.max_tokens)
        done: dict[str, Any] = {}
        while len(done) < len(batch):
            out = manager.get_result(timeout=1)
            assert out is not None or manager.is_running(), "transformers' generation thread died"
            if out is not None and out.is_finished():
                assert out.error is None, out.error
                done[out.request_id] = out
        return done

    with torch.inference_mode(), hf.continuous_batching_context_manager(
            generation_config=gen_cfg, continuous_batching_config=cb, block=True, timeout=30) as manager:
        run(manager, [replace(r, max_tokens=min(r.max_tokens, 4)) for r in reqs[:max_requests]], "warmup")
        t0 = time.perf_counter()
        results = run(manager, reqs, "r")
        wall = time.perf_counter() - t0
        resolved = manager.continuous_batching_config
    tokens = [list(results[f"r{i}"].generated_tokens) for i in range(len(reqs))]
    assert all(len(t) == r.max_tokens for t, r in zip(tokens, reqs)), "transformers CB: wrong output lengths"
    n_out = sum(len(t) for t in tokens)
    return {"peer": "transformers continuous batching (generate_batch's manager)", "wall_s": wall,
            "output_tokens": n_out, "output_tok_s": n_out / wall, "attn_implementation": hf.config._attn_implementation,
            "config": {k: str(v) for k, v in vars(resolved).items()}, "token_ids": tokens}


# ---- sections ----------------------------------------------------------------------------

def run_pair(name: str, engines: Engines, reqs: list[Request], seqs: int, max_model_len: int,
             short: int | None = None) -> dict[str, dict[str, Any]]:
    """The same requests through a continuous and a static engine of the same size."""
    engines.keep_only({(seqs, "continuous", max_model_len), (seqs, "static", max_model_len)})
    classes = None if short is None else ["short" if r.max_tokens == short else "long" for r in reqs]
    runs = {}
    for m in ("continuous", "static"):
        runs[m] = timed_generate(engines.get(seqs, m, max_model_len), [r.prompt_token_ids for r in reqs],
                                 [r.max_tokens for r in reqs], classes)
        assert runs[m]["stats"]["num_compilations"] == 0, "a timed run compiled: warm-up missed a shape"
        log(run_line(f"{name} {m}", runs[m]) + f" (engine built in {engines.build_s[f'{m}-{seqs}-{max_model_len}']}s)")
    return runs


def the_mix(sz: Sizes) -> list[Request]:
    return short_long_mix(sz.num_requests, vocab_size_of(sz.model), short=sz.short, long=sz.long,
                          prompt_len=sz.prompt_len)


def section_pair(name: str, sz: Sizes, engines: Engines) -> dict[str, Any]:
    """mix32 and p99-64 (the short/long mix at two slot counts) and exp32 (exponential lengths):
    continuous vs static, the section's headline ratio first."""
    exp, latency = name == "exp32", name == "p99-64"
    seqs = sz.seqs_latency if latency else sz.seqs_throughput
    if exp:
        reqs = exponential_mix(sz.exp_requests, vocab_size_of(sz.model), mean=sz.exp_mean, cap=sz.exp_cap,
                               prompt_len=sz.prompt_len)
        assert max(len(r.prompt_token_ids) + r.max_tokens for r in reqs) <= sz.exp_max_model_len
        lens = [r.max_tokens for r in reqs]
        workload = {"num_requests": len(reqs), "output_len": f"exponential, mean {sz.exp_mean}, capped at {sz.exp_cap}",
                    "drawn_mean": sum(lens) / len(lens), "drawn_max": max(lens), "prompt_len": sz.prompt_len}
        runs = run_pair(name, engines, reqs, seqs, sz.exp_max_model_len)
    else:
        reqs = the_mix(sz)
        n = sz.num_requests
        workload = {"num_requests": n, "max_tokens": {str(sz.short): n // 2, str(sz.long): n - n // 2},
                    "prompt_len": sz.prompt_len, "shuffle_seed": 0}
        runs = run_pair(name, engines, reqs, seqs, sz.max_model_len, sz.short)
    ratios = continuous_vs_static(runs["continuous"], runs["static"], None if latency else TARGETS[name],
                                  TARGETS[name] if latency else None,
                                  f", max_num_seqs {seqs}" + (" (exponential lengths)" if exp else ""))
    return {"workload": workload, "runs": {m: lean(r, per_request=True) for m, r in runs.items()},
            "ratios": ratios[::-1] if latency else ratios}


def peer_slice(sz: Sizes) -> list[Request]:
    """The first peer_requests/2 short and peer_requests/2 long requests of the mix, in its
    shuffled order (long ones cut to peer_long tokens)."""
    reqs = the_mix(sz)
    half = sz.peer_requests // 2
    shorts = {id(r) for r in [r for r in reqs if r.max_tokens == sz.short][:half]}
    longs = {id(r) for r in [r for r in reqs if r.max_tokens == sz.long][:sz.peer_requests - half]}
    return [replace(r, max_tokens=sz.peer_long) if id(r) in longs else r for r in reqs if id(r) in shorts | longs]


def section_peers(name: str, sz: Sizes, engines: Engines) -> dict[str, Any]:
    import torch

    torch.set_num_threads(TORCH_THREADS)
    reqs, s = peer_slice(sz), sz.peer_seqs
    tx = run_pair("peers taxirank", engines, reqs, s, sz.max_model_len, sz.short)
    c, st = tx["continuous"], tx["static"]
    engines.keep_only(set())  # free the JAX engines' KV caches before torch allocates its own
    t0 = time.perf_counter()
    hf = hf_model_from(sz.model)
    log(f"  transformers model built from taxirank's arrays in {time.perf_counter() - t0:.1f}s "
        f"(attn {hf.config._attn_implementation}, torch threads {torch.get_num_threads()})")
    hf_static = run_hf_static(hf, reqs, s)
    hf_cb = run_hf_continuous(hf, reqs, s, sz.max_num_batched_tokens or max(sz.max_model_len, 2048, s))
    for r in (hf_static, hf_cb):
        log(f"  peers {r['peer']}, {s} sequences: {r['output_tok_s']:.1f} tok/s, {r['wall_s']:.1f}s")
    k = min(8, sz.short)  # both sides run one model: their first k greedy tokens must agree
    agreement = {f"first_{k}_tokens_{x}_vs_{y}": sum(p[:k] == q[:k] for p, q in zip(a, b)) / max(len(a), 1)
                 for x, y, a, b in (("taxirank", "hf_cb", c["token_ids"], hf_cb["token_ids"]),
                                    ("taxirank", "hf_generate", c["token_ids"], hf_static["token_ids"]),
                                    ("hf_cb", "hf_generate", hf_cb["token_ids"], hf_static["token_ids"]))}
    log(f"  greedy agreement (same weights): {agreement}")
    return {"workload": {"slice": f"the first {sz.peer_requests // 2} requests of max_tokens {sz.short} and "
                         f"{sz.peer_requests - sz.peer_requests // 2} of max_tokens {sz.long} (run as {sz.peer_long}) "
                         f"of the {sz.num_requests}-request mix, in its shuffled order",
                         "max_tokens": [r.max_tokens for r in reqs],
                         "prompt_len": [len(r.prompt_token_ids) for r in reqs],
                         "max_num_seqs": s, "torch_threads": torch.get_num_threads()},
            "runs": {m: lean(r, per_request=True) for m, r in tx.items()} | {
                "hf_generate": lean(hf_static), "hf_continuous": lean(hf_cb)},
            "greedy_agreement": agreement, "ratios": [
        side_by_side(f"output tok/s, taxirank continuous / transformers continuous batching, {s} seqs",
                     c["output_tok_s"] / hf_cb["output_tok_s"], None, TARGETS["peers_cb"]),
        side_by_side(f"output tok/s, taxirank continuous / transformers padded generate, batch {s}",
                     c["output_tok_s"] / hf_static["output_tok_s"], hf_static["decode_steps"] / c["stats"]["num_steps"],
                     TARGETS["peers_static"]),
        side_by_side(f"output tok/s, taxirank static / transformers padded generate, batch {s} (same schedule)",
                     st["output_tok_s"] / hf_static["output_tok_s"],
                     hf_static["decode_steps"] / st["stats"]["num_steps"])]}


def header(results: dict[str, Any]) -> str:
    m, sz = results["machine"], results["sizes"]
    end = f", at end {results['loadavg_end'][0]:.1f}" if "loadavg_end" in results else ""
    return (f"taxirank offline bench: model {sz['model']} (float32, random weights, seed 0), "
            f"{m['cpu']} x {m['cores']} cores, jax {m['jax']} ({m.get('jax_backend')}), transformers "
            f"{m['transformers']}, torch {m['torch']} ({TORCH_THREADS} threads); load average at start "
            f"{results['loadavg_start'][0]:.1f}" + end)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    ap.add_argument("--num-requests", type=positive, default=None,
                    help="requests in the short/long mix (default 100; the exponential variant runs 3x as many)")
    ap.add_argument("--max-model-len", type=positive, default=None, help="max_model_len of the engines running the mix "
                    "(default 1024; the exponential variant uses 2048)")
    ap.add_argument("--tiny", action="store_true", help="the tiny model and a handful of requests (tests)")
    ap.add_argument("--out", default=None, help="JSON results (default bench/results/offline-<timestamp>.json)")
    args = ap.parse_args(argv)
    chosen = sections(ap, args.sections, SECTIONS)
    sz = TINY if args.tiny else FULL
    if args.num_requests is not None:
        sz = replace(sz, num_requests=args.num_requests, exp_requests=3 * args.num_requests)
    if args.max_model_len is not None:
        sz = replace(sz, max_model_len=args.max_model_len)
    if sz.max_model_len < (need := sz.prompt_len[1] + sz.long):
        ap.error(f"--max-model-len {sz.max_model_len} cannot hold the mix's longest request ({need} tokens)")
    out = args.out or results_dir(f"offline-{time.strftime('%Y%m%d-%H%M%S')}.json")
    results: dict[str, Any] = {"machine": machine_info(), "sizes": asdict(sz), "torch_threads": TORCH_THREADS,
                               "argv": sys.argv[1:] if argv is None else argv, "loadavg_start": os.getloadavg(),
                               "sections": {}}
    log(header(results))
    engines = Engines(sz.model, log, max_num_batched_tokens=sz.max_num_batched_tokens)
    t_all = time.perf_counter()
    for name in chosen:
        log(f"== {name}")
        t0 = time.perf_counter()
        try:
            results["sections"][name] = (section_peers if name == "peers" else section_pair)(name, sz, engines)
        except Exception as e:  # one broken section must not lose the others' figures
            traceback.print_exc()
            results["sections"][name] = {"error": f"{type(e).__name__}: {e}"}
        results["sections"][name]["section_s"] = round(time.perf_counter() - t0, 1)
    engines.keep_only(set())
    results |= {"engine_build_s": engines.build_s, "loadavg_end": os.getloadavg(),  # load skews every figure
                "total_s": round(time.perf_counter() - t_all, 1)}
    rows = [["section", "ratio", "measured", "ideal (steps)", "target", ""]]
    for name, sec in results["sections"].items():
        rows += ([[name, f"ERROR: {sec['error'][:80]}", "", "", "", ""]] if "error" in sec
                 else ratio_rows(sec["ratios"], name))
    log("\n" + header(results) + "\n" + text_table(rows, left=2))
    write_json(out, results)
    log(f"results: {out} ({results['total_s']}s in all; engine build + warm-up times in engine_build_s)")
    return results


if __name__ == "__main__":
    sys.exit(1 if any("error" in sec for sec in main()["sections"].values()) else 0)
