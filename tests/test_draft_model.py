"""The draft_model proposer (draft_model.py): a layer-skip draft cut from a checkpoint
proposes what transformers' greedy decoding of that same truncated checkpoint gives,
before and after rejections (its cache past the accepted point is rewritten, never read
stale), across preemption and long catch-ups; its sampled proposals come with the exact
filtered distribution they were drawn from; a draft of another vocabulary is refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import fresh_step_programs, hf_greedy, hf_logits, make_hf_checkpoint, pinned_decode_buckets

from config import EngineConfig
from draft_model import check_vocabulary, parse_layers, write_layer_skip
from sampling_params import SamplingParams
from spec_decode import create_proposer
from kvcache import BlockAllocator, blocks_needed
from metrics import EngineStats
from model_loader import hf_state_dict, load_model
from sequence import Sequence

K = 4
BS = 8


@pytest.fixture(scope="module")
def target_ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("target"), "llama2", seed=3, num_hidden_layers=4,
                              tokenizer=True)


@pytest.fixture(scope="module")
def draft_dir(target_ckpt, tmp_path_factory):
    # layers 0 and 3 of 4: the cut renumbers them 0 and 1
    return write_layer_skip(target_ckpt, [0, 3], str(tmp_path_factory.mktemp("d") / "layer-skip"), log=lambda _: None)


@pytest.mark.parametrize("src, layers, says", [
    ("tiny", "1", "'tiny' is neither a GGUF file (or built-in GGUF name) nor an HF directory"),
    (None, "x", "layers must be a count (8) or ranges (0-5,24-29), got 'x'"),
    (None, "0-9", "layers must be increasing indices in 0..3, fewer than all 4"),
    ("no-layers", "1", "config.json: num_hidden_layers is missing"),  # (not a KeyError's traceback)
])
def test_the_layer_skip_command_exits_with_one_line_naming_what_is_wrong(target_ckpt, tmp_path, capsys, src, layers,
                                                                         says):
    """`python draft_model.py layer-skip SRC LAYERS DST`: exit 2 and one error line, not a traceback."""
    import shutil

    import draft_model

    if src == "no-layers":
        src = str(shutil.copytree(target_ckpt, tmp_path / "src"))
        cfg = json.load(open(os.path.join(src, "config.json")))
        del cfg["num_hidden_layers"]
        json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    with pytest.raises(SystemExit) as e:
        draft_model.main(["layer-skip", src or target_ckpt, layers, str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def drafter(target_ckpt, draft_dir):
    # A small token budget: a 40-token prompt is caught up in several passes. 16 is the one
    # token bucket (one catch-up program). Decode buckets (2, 3) make two draft programs where
    # (1, 2, 3) made three: a proposal of one sequence runs in 2 padded rows, and the sampled
    # proposals of two in the 2-row program, whose q is padded to max_num_seqs rows and checked
    # row by row against NumPy below. (The engine tests keep every bucket.)
    with pinned_decode_buckets(lambda cfg: (2, cfg.max_num_seqs)):
        config = EngineConfig(model=target_ckpt, max_num_seqs=3, max_model_len=128, block_size=BS,
                              max_num_batched_tokens=16, attention_backend="xla",
                              speculative_config={"method": "draft_model", "model": draft_dir,
                                                  "num_speculative_tokens": K}).resolved(2048)
        assert config.decode_buckets == (2, 3)  # read here: the config keeps them
    fresh_step_programs()  # the tests check that nothing compiles after this warm-up
    dm = create_proposer(config, load_model(target_ckpt), EngineStats())
    assert dm.kv_bytes_per_block() == 2 * 2 * BS * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, f32
    dm.allocate(64)
    dm.warmup(log=lambda _: None)
    again: list[str] = []  # its programs are the process's now: a second warm-up builds none, and says so
    dm.warmup(log=again.append)
    assert again == ["warm-up: the draft model's programs were compiled already, by an engine of this process "
                     "with the same model structure and settings"], again
    return dm, BlockAllocator(64, enable_caching=False)


def _grow(alloc: BlockAllocator, seq: Sequence, upto: int) -> None:
    """Blocks for positions < upto, appended to its table in place (as the scheduler)."""
    need = blocks_needed(upto, BS) - len(seq.block_table)
    if need > 0:
        seq.block_table += alloc.allocate(seq.request_id, need)


def test_layer_skip_keeps_the_chosen_layers(target_ckpt, draft_dir):
    cfg = json.load(open(os.path.join(draft_dir, "config.json")))
    assert cfg["num_hidden_layers"] == 2 and cfg["taxirank_layer_skip"]["source_layers"] == 4
    full, cut = hf_state_dict(load_model(target_ckpt).model), hf_state_dict(load_model(draft_dir).model)
    source = {n.replace("layers.3.", "layers.1."): x for n, x in full.items()
              if not n.startswith(("model.layers.1.", "model.layers.2."))}
    assert set(cut) == set(source)
    for name, x in cut.items():
        np.testing.assert_array_equal(x, source[name])
    assert parse_layers("3") == [0, 1, 2] and parse_layers("0-1,5,7-8") == [0, 1, 5, 7, 8]
    with pytest.raises(ValueError, match="increasing"):
        write_layer_skip(target_ckpt, [2, 1], str(draft_dir) + "-bad", log=lambda _: None)


def test_greedy_proposals_match_transformers_across_rejections(drafter, draft_dir):
    dm, alloc = drafter
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, n).tolist() for n in (5, 40, 17)]
    seqs = [Sequence(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=64)) for i, p in enumerate(prompts)]
    compiled = dm.stats.num_compilations

    def propose_and_check() -> list[list[int]]:
        for s in seqs:
            _grow(alloc, s, s.num_tokens + K)  # the verify step's positions: the last token .. + K
        out = dm.propose(seqs, K)
        proposals, q = out.token_ids, out.draft_probs
        assert q.shape == (3, K, 300)  # max_num_seqs rows
        for s, d in zip(seqs, proposals):
            assert d == hf_greedy(draft_dir, s.all_token_ids, K), s.request_id
            np.testing.assert_array_equal(np.asarray(q[seqs.index(s)]).argmax(-1), d)  # greedy q: one-hot
        return proposals

    d = propose_and_check()
    # r0: 2 accepted then a recovered token that differs; r1: all accepted + a bonus; r2: none accepted.
    seqs[0].output_token_ids += d[0][:2] + [(d[0][2] + 1) % 300]
    seqs[1].output_token_ids += d[1] + [7]
    seqs[2].output_token_ids += [(d[2][0] + 1) % 300]
    d = propose_and_check()
    # r1 loses its blocks (a preemption the draft is not told of), another sequence takes
    # them and writes its own draft K/V there, and r1 comes back in other blocks.
    alloc.free("r1")
    seqs[1].block_table = []
    intruder = Sequence("intruder", rng.integers(3, 300, 60).tolist(), SamplingParams(temperature=0.0))
    _grow(alloc, intruder, intruder.num_tokens + K)
    dm.propose([intruder], K)
    # r0: 1 accepted and a recovered token, then a step that gave it no draft room (a plain
    # decode: no spare budget or block), so the token that differs from its drafts is not its last.
    seqs[0].output_token_ids += d[0][:1] + [(d[0][1] + 5) % 300, 11]
    seqs[2].output_token_ids += d[2][:3] + [(d[2][3] + 1) % 300]
    propose_and_check()
    assert dm.stats.num_compilations == compiled, "a proposal compiled a program after warm-up"
    for s in [*seqs, intruder]:
        alloc.free(s.request_id)
        dm.free(s)


def test_proposals_stop_at_the_block_table_and_max_model_len(drafter):
    dm, alloc = drafter
    s = Sequence("edge", list(range(10, 30)), SamplingParams(temperature=0.0))  # 20 tokens
    _grow(alloc, s, 22)  # 3 blocks = 24 positions: d_1..d_3's K/V at 20..22 fit
    assert len(dm.propose([s], K).token_ids[0]) == K
    alloc.free("edge")
    s = Sequence("edge2", list(range(10, 30)), SamplingParams(temperature=0.0))
    s.output_token_ids += [5, 6, 7]  # 23 tokens known: d_1's K/V at 23, d_2's at 24, past the table
    _grow(alloc, s, 24)
    assert len(dm.propose([s], K).token_ids[0]) == 2
    alloc.free("edge2")


def _filtered(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """NumPy: vLLM's temperature, top_k, top_p (min_p 0) distribution over the vocabulary."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    p = np.exp(x[order] - x[order].max())
    p[top_k:] = 0
    p /= p.sum()
    keep = (np.cumsum(p) - p) < top_p
    p = np.where(keep, p, 0)
    out = np.zeros_like(p)
    out[order] = p / p.sum()
    return out


def test_sampled_proposals_carry_their_distribution(drafter, draft_dir):
    dm, alloc = drafter
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_tokens=64)
    seqs = [Sequence(f"s{i}", list(range(20 + i, 31 + i)), params, seed=i) for i in range(2)]
    for s in seqs:
        _grow(alloc, s, s.num_tokens + K)
    out = dm.propose(seqs, K)
    proposals, q = out.token_ids, np.asarray(out.draft_probs)
    for i, (s, d) in enumerate(zip(seqs, proposals)):
        assert len(d) == K
        logits = hf_logits(draft_dir, s.all_token_ids + d[:-1])[s.num_tokens - 1:]
        for j in range(K):
            want = _filtered(logits[j], 0.7, 40, 0.9)
            np.testing.assert_allclose(q[i, j], want, atol=2e-5)
            assert want[d[j]] > 0, "a draft token outside the distribution it was drawn from"
    # Same seed and position: the same draws (the draft's stream is the request's own).
    again = Sequence("again", list(seqs[0].prompt_token_ids), params, seed=0)
    _grow(alloc, again, again.num_tokens + K)
    assert dm.propose([again], K).token_ids[0] == proposals[0]
    for s in [*seqs, again]:
        alloc.free(s.request_id)


def test_a_draft_of_another_vocabulary_is_refused(target_ckpt, tmp_path):
    target = load_model(target_ckpt)
    other = load_model(make_hf_checkpoint(tmp_path / "v", "llama2", vocab_size=320, num_hidden_layers=1))
    with pytest.raises(ValueError, match="vocabulary sizes"):
        check_vocabulary(target, other)
    other = load_model(make_hf_checkpoint(tmp_path / "e", "llama2", eos_token_id=5, num_hidden_layers=1))
    with pytest.raises(ValueError, match="special ids"):
        check_vocabulary(target, other)
    with pytest.raises(ValueError, match="vocabulary sizes"):
        check_vocabulary(target, load_model("tiny"))


# ---- end to end: the engine with a draft model ----------------------------------------------

def _engine_prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, 250, n).tolist() for n in (9, 30, 17, 4, 25, 12)]


def _run_speculative(target: str, draft: str, **kw):
    from llm import LLM

    fresh_step_programs()  # nothing compiles after this engine's own warm-up
    lines: list[str] = []
    llm = LLM(target, log=lines.append, max_num_seqs=2, max_model_len=96, block_size=BS,
              max_num_batched_tokens=16, attention_backend="xla",
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3}, **kw)
    # the draft's warm-up reports through the engine's log, as the target's does
    assert any(line.startswith("warm-up: ") and "the draft model's" in line for line in lines), lines
    compiled = llm.stats.num_compilations
    outs = llm.generate(_engine_prompts(), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert llm.stats.num_compilations == compiled, "a step compiled a program after warm-up"
    assert llm.engine.scheduler.allocator.num_used == 0
    return llm, [o.outputs[0].token_ids for o in outs]


def test_greedy_output_with_the_target_as_its_own_draft_is_greedy_decoding(target_ckpt):
    """A tight KV cache (preemptions), chunked prefill, prefix caching, async scheduling:
    the tokens are transformers' greedy ones, and every draft token is accepted."""
    llm, outs = _run_speculative(target_ckpt, target_ckpt, num_kv_blocks=14)
    stats = llm.stats
    for p, o in zip(_engine_prompts(), outs):
        assert o == hf_greedy(target_ckpt, p, 40)
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    # Sampled: q is the distribution the verifier's p is (same model, same filters, the
    # row and position it belongs to), so p(x)/q(x) = 1 up to rounding and drafts are
    # accepted; a q of another row or position would be rejected most of the time.
    before = stats.snapshot()
    llm.generate(_engine_prompts()[:3], [SamplingParams(temperature=t, top_k=40, seed=i, max_tokens=30, ignore_eos=True)
                                         for i, t in enumerate((0.2, 0.4, 0.6))])
    after = stats.snapshot()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert drafted > 0 and accepted >= 0.97 * drafted, (accepted, drafted)


@pytest.fixture(scope="module")
def far_ckpt(tmp_path_factory):
    """Another random model of the target's vocabulary: a draft far from the target. Of the
    target's structure (another seed), so its draft programs are those the target compiled
    as its own draft in the test before, at the same shapes."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("far"), "llama2", seed=9, num_hidden_layers=4, tokenizer=True)


def test_greedy_output_with_a_far_draft_is_greedy_decoding(target_ckpt, far_ckpt):
    """Most drafts are rejected, and the output is still exactly greedy decoding's."""
    llm, outs = _run_speculative(target_ckpt, far_ckpt, num_kv_blocks=14)
    stats = llm.stats
    for p, o in zip(_engine_prompts(), outs):
        assert o == hf_greedy(target_ckpt, p, 40)
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_accepted_tokens < 0.5 * stats.spec_decode_num_draft_tokens


def test_sampled_output_with_a_cut_draft_is_the_targets_filtered_distribution(target_ckpt, tmp_path_factory):
    """Through the whole engine (the draft's sampling and q, the ragged verification, the
    scheduler's bookkeeping of accepted runs): many seeded requests of one prompt with a
    layer-skip draft (the target's first 3 of 4 random layers: its distribution overlaps
    the target's without being it, so both acceptances and recovered tokens are frequent,
    which a wrong acceptance rule or residual needs to show), and
    every emitted token at a speculated output index (1: the first draft or the recovered
    token; 2: a later draft, a recovered or a bonus token) follows the target's
    temperature/top-k/top-p distribution given the prefix that request emitted, computed
    independently (transformers' logits, NumPy's filters): a chi-square test per prefix
    seen often enough, summed over prefixes. A residual of p instead of max(p - q, 0), or
    an acceptance test that ignores q, fails it."""
    import torch
    from scipy import stats as scipy_stats
    from transformers import AutoModelForCausalLM

    from test_sampling import ALPHA, chi_square, exact

    # n: index 1 alone (5 prefixes of about n/5 requests each, 20 degrees of freedom) gives
    # the summed statistic a noncentrality of 174 under a residual of p (the subtlest of the
    # two bugs: 394 for an acceptance that ignores q), against a limit of 65 at ALPHA: it
    # misses such a bug with probability 1e-9, and fails a correct engine with ALPHA's 1e-6
    # whatever n (its power computed from transformers' p and q of these two models).
    n, max_tokens, filters = 800, 3, dict(temperature=0.8, top_k=5, top_p=0.9)
    prompt = np.random.default_rng(5).integers(3, 250, 8).tolist()
    draft = write_layer_skip(target_ckpt, [0, 1, 2], str(tmp_path_factory.mktemp("d3") / "skip"), log=lambda _: None)
    # the target's shapes of the tests above, KV blocks included (the cache's shape is in every program's):
    # its ragged, decode and sample programs are theirs, compiled once
    llm, _ = _run_speculative(target_ckpt, draft, num_kv_blocks=14)
    before = llm.stats.snapshot()
    outs = llm.generate([prompt] * n, [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, **filters)
                                       for i in range(n)])
    emitted = np.array([o.outputs[0].token_ids for o in outs])  # [n, max_tokens]
    after = llm.stats.snapshot()
    assert after.spec_decode_num_drafts - before.spec_decode_num_drafts >= n  # indices 1.. were speculated
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert 0.1 * drafted < accepted < 0.9 * drafted  # both the acceptance and the residual are exercised

    hf = AutoModelForCausalLM.from_pretrained(target_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        full = torch.tensor([prompt + row.tolist() for row in emitted])
        logits = hf(full).logits.numpy()[:, len(prompt) - 1:]  # [n, max_tokens + 1, V]: position j's
    total_stat, total_df = 0.0, 0
    for j in range(1, max_tokens):
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, row in enumerate(emitted):
            groups.setdefault(tuple(row[:j]), []).append(i)
        tested = 0
        for members in groups.values():
            p = exact(logits[members[0], j], **filters)
            counts = np.bincount(emitted[members, j], minlength=len(p))
            assert counts[p == 0].sum() == 0, f"index {j}: a token outside the target's filtered set"
            if len(members) >= 40:
                stat, _ = chi_square(counts, p)
                total_stat += stat
                total_df += int(min((p > 0).sum(), 1 + (len(members) * p >= 20).sum())) - 1
                tested += len(members)
        assert j > 1 or tested >= 0.8 * n, f"index {j}: only {tested} draws in prefixes seen 40 times"
    limit = float(scipy_stats.chi2.isf(ALPHA, df=total_df))
    assert total_stat < limit, f"chi-square {total_stat:.1f} over {limit:.1f} ({total_df} degrees of freedom)"


def test_kv_sizing_and_the_reported_memory_count_the_draft_model(target_ckpt, draft_dir, monkeypatch):
    """On a device of known memory (--gpu-memory-utilization sizing), the draft's weights
    (its checkpoint's tensor bytes) come out of the KV budget and the remainder is divided
    by target + draft bytes per block; the memory start-up reports (the /metrics gauges)
    is the target's plus the draft's, as their arrays hold them."""
    import jax
    from types import SimpleNamespace

    from safetensors.numpy import load_file

    import startup
    from llm import LLM
    from runner import logprobs_bytes

    limit, util = 64 * 2**20, 0.5
    gpu = SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": limit})
    sizing = startup.num_kv_blocks_for

    def on_gpu(*args, **kw):  # only the sizing sees the device: the engine still runs on CPU
        with monkeypatch.context() as m:
            m.setattr(jax, "devices", lambda *_: [gpu])
            return sizing(*args, **kw)

    monkeypatch.setattr(startup, "num_kv_blocks_for", on_gpu)
    file_bytes = {path: sum(x.nbytes for x in load_file(os.path.join(path, "model.safetensors")).values())
                  for path in (target_ckpt, draft_dir)}
    kw = dict(log=lambda _: None, max_num_seqs=2, max_model_len=96, block_size=BS, gpu_memory_utilization=util,
              attention_backend="xla", warmup=False)
    plain = LLM(target_ckpt, **kw)
    spec = LLM(target_ckpt, speculative_config={"method": "draft_model", "model": draft_dir,
                                                "num_speculative_tokens": 3}, **kw)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    per_block = nbytes(plain.engine.runner.kv_caches) // plain.engine.num_kv_blocks
    draft_per_block = nbytes(spec.engine.proposer.kv_caches) // spec.engine.num_kv_blocks
    assert draft_per_block > 0 and nbytes(spec.engine.runner.kv_caches) == per_block * spec.engine.num_kv_blocks
    # the device measured no activations (it is a CPU): the logprob arrays are the reserve,
    # two steps' under async scheduling (the default)
    reserve = [2 * sum(logprobs_bytes(e.config, e.model_config).values()) for e in (plain.engine, spec.engine)]
    budget = int(util * limit) - file_bytes[target_ckpt]
    assert plain.engine.num_kv_blocks == (budget - reserve[0]) // per_block
    assert spec.engine.num_kv_blocks == (budget - file_bytes[draft_dir] - reserve[1]) // (per_block + draft_per_block)
    assert plain.stats.weight_bytes == file_bytes[target_ckpt]
    assert spec.stats.weight_bytes == file_bytes[target_ckpt] + file_bytes[draft_dir]
    assert spec.stats.kv_cache_bytes == (per_block + draft_per_block) * spec.engine.num_kv_blocks


def test_the_drafts_quantization_key_quantizes_the_draft_alone(target_ckpt, draft_dir):
    """vLLM's speculative_config.quantization (vllm/config/speculative.py: the draft model's
    method, None: its weights as stored) stores the draft's linears as that method does, not
    the target's; it is a draft_model key, checked where the config is built."""
    from flax import nnx

    from quant import QuantLinear

    def linears(loaded) -> set[str]:
        return {m.scheme.name for _, m in nnx.iter_modules(loaded.model) if isinstance(m, QuantLinear)}

    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 2}
    for quantization, schemes in ((None, set()), ("int8", {"int8"}), ("fp8", {"fp8_e4m3"})):
        config = EngineConfig(model=target_ckpt, max_model_len=64, block_size=BS,
                              speculative_config={**spec, "quantization": quantization}).resolved(2048)
        assert config.speculative_config.options.quantization == quantization
        draft = create_proposer(config, load_model(target_ckpt), EngineStats())
        assert linears(draft.loaded) == schemes
    for bad, says in (({"quantization": "awq"}, "speculative_config.quantization must be one of"), ({"quantization": []}, "quantization must be"),
                      ({"method": "ngram", "quantization": "int8", "model": None},
                       "quantization is for method draft_model, not ngram")):
        with pytest.raises(ValueError, match=says):
            EngineConfig(speculative_config={**spec, **bad})
