"""model.py, model_loader.py and tokenizer.py against transformers: every family's logits through the
paged ragged and decode paths, loading (sharded, bf16, errors), the tokenizers."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_logits, make_hf_checkpoint
from flax import nnx

from attention_backend import get_attention_backend
from model import AttentionInputs, Decoder, ModelConfig, param_bytes
from model_loader import BUILTIN_MODELS, load_model
from tokenizer import ByteTokenizer, load_tokenizer

BS = 4  # block size: small, so a prompt spans several blocks
BACKEND = get_attention_backend("xla")


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, positions, caches, attn):
    model = nnx.merge(graphdef, state)
    hidden, caches = model(tokens, positions, caches, attn, BACKEND)
    return model.compute_logits(hidden), caches


class Paged:
    """A model with its paged KV caches and per-sequence (shuffled) block tables."""

    def __init__(self, model: Decoder, num_seqs: int, max_len: int, seed: int = 0):
        cfg, width = model.config, -(-max_len // BS)
        dtype = model.embed_tokens.embedding[...].dtype
        num_blocks = 1 + num_seqs * width + 3  # block 0 is the null block; a few spare
        shape = (cfg.num_hidden_layers, num_blocks, BS, cfg.num_key_value_heads, cfg.head_dim)
        self.caches = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        blocks = np.random.default_rng(seed).permutation(np.arange(1, num_blocks))
        self.block_tables = blocks[: num_seqs * width].reshape(num_seqs, width).astype(np.int32)
        self.graphdef, self.state = nnx.split(model)

    def step(self, chunks: list[tuple[int, list[int]] | None], decode: bool = False,
             pad_to: int = 0) -> list[np.ndarray]:
        """chunks[s] = (first position, token ids) for sequence s this step, or None for an
        idle slot. Returns each sequence's logits [q_len, vocab]."""
        tokens, positions, slots, kv_lens, cu = [], [], [], [], [0]
        for s, chunk in enumerate(chunks):
            start, toks = chunk or (0, [])
            pos = list(range(start, start + len(toks)))
            tokens += toks
            positions += pos
            slots += [int(self.block_tables[s, p // BS]) * BS + p % BS for p in pos]
            kv_lens.append(start + len(toks))
            cu.append(len(tokens))
            if decode and chunk is None:  # an idle decode slot still has a row: it writes to the null block
                tokens, positions, slots = tokens + [0], positions + [0], slots + [0]
        pad = max(pad_to - len(tokens), 0)  # padding rows write to the null block too
        i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
        attn = AttentionInputs(i32(slots + [0] * pad), i32(self.block_tables), i32(kv_lens),
                               None if decode else i32(cu))
        logits, self.caches = _forward(self.graphdef, self.state, i32(tokens + [0] * pad),
                                       i32(positions + [0] * pad), self.caches, attn)
        logits = np.asarray(logits)
        if decode:
            return [logits[s : s + 1] for s in range(len(chunks))]
        return [logits[cu[s] : cu[s + 1]] for s in range(len(chunks))]


def _prompt(n: int, seed: int, vocab: int = 300) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


@pytest.mark.parametrize("family", ["llama2", "llama3", "mistral", "qwen2", "qwen3"])
def test_prefill_matches_hf(hf_checkpoint, family):
    path = hf_checkpoint(family)
    lm = load_model(path)
    a, b = _prompt(20, 1), _prompt(13, 2)
    paged = Paged(lm.model, num_seqs=2, max_len=20)
    got_a, got_b = paged.step([(0, a), (0, b)], pad_to=40)
    np.testing.assert_allclose(got_a, hf_logits(path, a), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got_b, hf_logits(path, b), atol=1e-4, rtol=0)


def test_chunked_prefill_and_decode_match_hf(hf_checkpoint):
    """A's prompt in two chunks, the second in a mixed step with B's first decode; then
    decode steps with an idle slot. Every logit row equals HF's on the whole sequence."""
    path = hf_checkpoint("llama3")
    lm = load_model(path)
    a, b = _prompt(17, 3), _prompt(14, 4)
    ref_a, ref_b = hf_logits(path, a), hf_logits(path, b)
    paged = Paged(lm.model, num_seqs=3, max_len=17)
    got = paged.step([(0, a[:8]), (0, b[:11]), None], pad_to=24)
    np.testing.assert_allclose(got[0], ref_a[:8], atol=1e-4, rtol=0)
    np.testing.assert_allclose(got[1], ref_b[:11], atol=1e-4, rtol=0)
    got = paged.step([(8, a[8:15]), (11, b[11:12]), None])
    np.testing.assert_allclose(got[0], ref_a[8:15], atol=1e-4, rtol=0)
    np.testing.assert_allclose(got[1], ref_b[11:12], atol=1e-4, rtol=0)
    for i in range(2):
        got = paged.step([(15 + i, a[15 + i : 16 + i]), (12 + i, b[12 + i : 13 + i]), None], decode=True)
        np.testing.assert_allclose(got[0], ref_a[15 + i : 16 + i], atol=1e-4, rtol=0)
        np.testing.assert_allclose(got[1], ref_b[12 + i : 13 + i], atol=1e-4, rtol=0)


def _params(lm) -> dict:
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(lm.model, nnx.Param))}


def test_sharded_checkpoint_loads_identically(tmp_path):
    whole = load_model(make_hf_checkpoint(tmp_path / "whole", "qwen2"))
    sharded_dir = make_hf_checkpoint(tmp_path / "sharded", "qwen2", max_shard_size="40KB")
    assert os.path.exists(os.path.join(sharded_dir, "model.safetensors.index.json"))
    sharded = load_model(sharded_dir)
    a, b = _params(whole), _params(sharded)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def test_bf16_checkpoint(hf_checkpoint):
    path = hf_checkpoint("llama2", dtype="bfloat16")
    lm = load_model(path, dtype="auto")
    assert lm.dtype == jnp.bfloat16 and lm.model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    assert param_bytes(lm.model) == 2 * sum(v.size for v in _params(lm).values())
    prompt = _prompt(20, 5)
    (got,) = Paged(lm.model, num_seqs=1, max_len=20).step([(0, prompt)])
    ref = hf_logits(path, prompt)  # the same bf16 weights, run in f32
    # bf16 activations: each rounding is within eps = 2^-8 relative; a few of them deep
    # (embedding, two layers, norm, LM head) bound the logits' error by ~4 eps of their scale.
    tol = 4 * 2.0 ** -8 * np.abs(ref).max()
    assert np.abs(got - ref).max() <= tol
    # and the same top-1 token wherever the reference's top-2 margin exceeds that error twice
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * tol
    assert clear.sum() >= len(prompt) // 2, "too few positions to compare the top-1"
    np.testing.assert_array_equal(got[clear].argmax(-1), ref[clear].argmax(-1))
    assert load_model(path).dtype == jnp.float32  # an explicit dtype overrides the checkpoint's


def test_checkpoint_errors(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = make_hf_checkpoint(tmp_path / "c", "llama2")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    save_file({**tensors, "model.extra.weight": np.zeros(3, np.float32)}, file)
    with pytest.raises(ValueError, match="unexpected tensor 'model.extra.weight'"):
        load_model(path)
    del tensors["model.norm.weight"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match="lacks tensors: model.norm.weight"):
        load_model(path)
    with pytest.raises(FileNotFoundError, match="neither a built-in"):
        load_model(str(tmp_path / "nowhere"))


def test_config_from_hf_variants():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=4096)
    # pre-5.x layout: top-level rope_theta, rope_scaling with "type"; eos as a list
    scaling = dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    cfg = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": scaling, "eos_token_id": [5, 6]})
    assert cfg.rope_theta == 5e5 and dict(cfg.rope_scaling)["factor"] == 8.0 and cfg.eos_token_ids == (5, 6)
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 4 and hash(cfg)
    assert ModelConfig.from_hf({**base, "eos_token_id": 7}).eos_token_ids == (7,)
    qwen = {**base, "model_type": "qwen2", "sliding_window": 1024}
    assert ModelConfig.from_hf(qwen).sliding_window is None  # use_sliding_window defaults to off
    on = ModelConfig.from_hf({**qwen, "use_sliding_window": True})
    assert on.sliding_window == 1024 and on.max_model_len == 1024 and on.attention_bias and not on.o_proj_bias
    # an unsupported family names its model_type, not a field it lacks: Gemma3 and Mllama keep
    # theirs in a nested text_config
    gemma3 = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
              "text_config": {"model_type": "gemma3_text", "hidden_size": 2560}, "vision_config": {}}
    with pytest.raises(ValueError, match="unsupported model_type 'gemma3'"):
        ModelConfig.from_hf(gemma3)
    for bad, msg in [({"model_type": "gpt2"}, "unsupported model_type"),
                     ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "unsupported RoPE type 'yarn'"),
                     ({"hidden_act": "gelu"}, "unsupported hidden_act")]:
        with pytest.raises(ValueError, match=msg):
            ModelConfig.from_hf({**base, **bad})


_HF = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8,
           intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
           max_position_embeddings=4096, eos_token_id=2, bos_token_id=1, dtype="float32")
_LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=64)


@pytest.mark.parametrize("change, says", [
    # each would be a KeyError, ZeroDivisionError, TypeError or a JAX shape error, or load a model that
    # computes something else
    (dict(num_attention_heads=None), "num_attention_heads is missing"),
    (dict(num_attention_heads=0), "num_attention_heads must be an integer >= 1, got 0"),
    (dict(num_attention_heads=-2), "num_attention_heads must be an integer >= 1"),
    (dict(num_attention_heads="2"), "num_attention_heads must be an integer >= 1, got '2'"),
    (dict(num_attention_heads=2.0), "num_attention_heads must be an integer >= 1, got 2.0"),
    (dict(num_attention_heads=True), "num_attention_heads must be an integer >= 1, got True"),
    (dict(hidden_size=0), "hidden_size must be an integer >= 1"),
    # NumPy reads 2**63..2**64-1 as uint64, which JAX takes for no shape: a TypeError building the model
    (dict(hidden_size=2**63), "hidden_size 9223372036854775808 is past the largest array dimension"),
    (dict(num_hidden_layers=2**64 - 1), "num_hidden_layers 18446744073709551615 is past the largest array"),
    (dict(num_hidden_layers=-1), "num_hidden_layers must be an integer >= 1"),
    (dict(intermediate_size=0), "intermediate_size must be an integer >= 1"),
    (dict(num_attention_heads=3, num_key_value_heads=None), "num_attention_heads \\(3\\) must divide hidden_size"),
    (dict(num_key_value_heads=3, num_attention_heads=4, head_dim=2), "num_key_value_heads \\(3\\) must divide"),
    (dict(num_key_value_heads=4), "num_key_value_heads \\(4\\) must divide num_attention_heads \\(2\\)"),
    (dict(num_key_value_heads=0), "num_key_value_heads must be an integer >= 1"),
    (dict(head_dim=0), "head_dim must be an integer >= 1"),
    (dict(head_dim=5), "head_dim \\(5\\) must be even"),
    (dict(max_position_embeddings=0), "max_position_embeddings must be an integer >= 1"),
    (dict(max_position_embeddings=2048.5), "max_position_embeddings must be an integer >= 1"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number > 0, got nan"),
    (dict(rms_norm_eps=-1), "rms_norm_eps must be a finite number > 0"),
    # an integer float() cannot take (JSON's 1e999 is inf, 10**400 written out an int): an OverflowError
    (dict(rms_norm_eps=10**400), "rms_norm_eps must be a finite number > 0, got 1000"),
    (dict(rope_theta=10**400), "rope_theta must be a finite number > 0, got 1000"),
    (dict(rope_parameters={**_LLAMA3, "factor": 10**400}), "rope scaling factor must be a finite number > 0"),
    (dict(rope_theta=0), "rope_theta must be a finite number > 0"),
    # frequencies theta^(-2i/d) past float32's range: NaN from position 0 on
    (dict(rope_theta=1e-300), "rope_theta must be >= 1, got 1e-300"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=0.5)), "rope_parameters.rope_theta must be >= 1"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta="abc")), "rope_parameters.rope_theta must be"),
    (dict(rope_scaling="linear"), "rope_scaling must be an object or null"),
    # transformers runs the legacy rope_scaling's llama3 where both are given: one of them, or the same RoPE
    (dict(rope_scaling=_LLAMA3, rope_parameters=dict(rope_type="default", rope_theta=1e4)),
     "rope_scaling and rope_parameters disagree on rope_type: give one of them"),
    (dict(rope_scaling={**_LLAMA3, "factor": 4.0}, rope_parameters={**_LLAMA3, "rope_theta": 5e5}),
     "disagree on factor"),
    (dict(rope_scaling=dict(type="linear", factor=2.0)), "unsupported RoPE type 'linear'"),
    (dict(rope_scaling=dict(type="dynamic", factor=2.0)), "unsupported RoPE type 'dynamic'"),
    # vLLM's patch_rope_scaling_dict: a scaling with no type, or with two that disagree, would
    # otherwise run as some other RoPE than the one it describes
    (dict(rope_scaling=dict(factor=8.0)), "rope_scaling gives factor but no rope_type"),
    (dict(rope_parameters=dict(rope_theta=1e4, factor=8.0)), "rope_parameters gives factor but no rope_type"),
    (dict(rope_scaling={**_LLAMA3, "type": "llama3", "rope_type": "default"}),
     "rope_scaling: rope_type 'default' and its legacy spelling type 'llama3' disagree"),
    # named by the key that holds it: "unsupported RoPE type None" alone named neither key nor file
    (dict(rope_parameters=dict(rope_type=None)), "unsupported RoPE type None \\(the rope_type of rope_parameters"),
    (dict(rope_parameters={**_LLAMA3, "factor": "x"}), "rope scaling factor must be a finite number"),
    # each is needed: else a TypeError from comparing or converting None
    (dict(rope_parameters={**_LLAMA3, "low_freq_factor": None}), "rope scaling low_freq_factor must be .*got None"),
    (dict(rope_scaling={**_LLAMA3, "factor": None}), "rope scaling factor must be a finite number > 0, got None"),
    (dict(rope_parameters={**_LLAMA3, "high_freq_factor": 1.0}), "needs high_freq_factor \\(1.0\\) > low_freq"),
    (dict(rope_parameters={**_LLAMA3, "original_max_position_embeddings": 64.5}),
     "original_max_position_embeddings must be an integer, got 64.5"),
    (dict(sliding_window=0), "sliding_window must be an integer >= 1 or null"),
    (dict(sliding_window=-1), "sliding_window must be an integer >= 1 or null"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
    (dict(eos_token_id="2"), "eos_token_id must be a token id >= 0, a list of them, or null"),
    (dict(eos_token_id=[2, "x"]), "eos_token_id must be a token id"),
    (dict(eos_token_id=-1), "eos_token_id must be a token id"),
    (dict(eos_token_id=10), "eos_token_id 10 is outside the vocabulary \\(vocab_size 10\\)"),
    (dict(bos_token_id=10**9), "bos_token_id 1000000000 is outside the vocabulary"),
    (dict(bos_token_id=[1, 2]), "bos_token_id must be a token id >= 0 or null, got \\[1, 2\\]"),  # one opens a prompt
    (dict(bos_token_id=-1), "bos_token_id must be a token id >= 0 or null, got -1"),
    (dict(dtype="banana"), "dtype must be one of float32, float16, bfloat16, float64, got 'banana'"),
    (dict(torch_dtype=5), "torch_dtype must be one of"),
    (dict(architectures=["LlamaForSequenceClassification"]), "names no causal language model"),
    (dict(architectures="LlamaForCausalLM"), "architectures must be a list of class names"),
    # its tensors (qweight, scales) are not float weights: refused before any is read
    (dict(quantization_config=dict(quant_method="awq", bits=4)), "pre-quantized checkpoint .*'awq'"),
    # an FP8-serialized one too (vLLM's is_checkpoint_fp8_serialized): --quantization fp8 is for float weights
    (dict(quantization_config=dict(quant_method="fp8", activation_scheme="dynamic")),
     "pre-quantized checkpoint .*'fp8'.*--quantization int8 or fp8"),
])
def test_config_json_values_are_checked_where_they_enter(change, says):
    d = {k: v for k, v in {**_HF, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=says):
        ModelConfig.from_hf(d)


def test_the_fields_of_the_hostile_table_load_at_their_sane_values():
    """The table above changes one field of a config that loads; its edges load too."""
    cfg = ModelConfig.from_hf(_HF)
    # null numbers are the defaults, as absent keys (not float(None))
    assert ModelConfig.from_hf({**_HF, "rms_norm_eps": None, "rope_theta": None}) == cfg
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.eos_token_ids) == (2, 2, 4, (2,))
    same = {"type": "llama3", **{k: v for k, v in _LLAMA3.items() if k != "rope_type"}}
    assert ModelConfig.from_hf({**_HF, "rope_scaling": same, "rope_parameters": _LLAMA3}).rope_scaling is not None
    ok = ModelConfig.from_hf({**_HF, "eos_token_id": [9, 2], "rope_parameters": _LLAMA3, "sliding_window": 64,
                              "architectures": None, "dtype": "float16", "head_dim": 6})
    assert ok.eos_token_ids == (9, 2) and ok.rope_scaling is not None and ok.max_model_len == 64 and ok.head_dim == 6


# Published config.json files (the fields from_hf reads, as their authors wrote them): the
# checks must refuse none of these real checkpoints.
_LLAMA32_1B_INSTRUCT = dict(  # meta-llama/Llama-3.2-1B-Instruct
    architectures=["LlamaForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009], head_dim=64, hidden_act="silu", hidden_size=2048,
    initializer_range=0.02, intermediate_size=8192, max_position_embeddings=131072, mlp_bias=False,
    model_type="llama", num_attention_heads=32, num_hidden_layers=16, num_key_value_heads=8, pretraining_tp=1,
    rms_norm_eps=1e-05, rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                          original_max_position_embeddings=8192, rope_type="llama3"),
    rope_theta=500000.0, tie_word_embeddings=True, torch_dtype="bfloat16", use_cache=True, vocab_size=128256)
_QWEN25_05B = dict(  # Qwen/Qwen2.5-0.5B
    architectures=["Qwen2ForCausalLM"], attention_dropout=0.0, bos_token_id=151643, eos_token_id=151643,
    hidden_act="silu", hidden_size=896, initializer_range=0.02, intermediate_size=4864,
    max_position_embeddings=32768, max_window_layers=24, model_type="qwen2", num_attention_heads=14,
    num_hidden_layers=24, num_key_value_heads=2, rms_norm_eps=1e-06, rope_theta=1000000.0, sliding_window=32768,
    tie_word_embeddings=True, torch_dtype="bfloat16", use_cache=True, use_mrope=False, use_sliding_window=False,
    vocab_size=151936)
_QWEN3_06B = dict(  # Qwen/Qwen3-0.6B
    architectures=["Qwen3ForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=151643,
    eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=1024, initializer_range=0.02,
    intermediate_size=3072, max_position_embeddings=40960, max_window_layers=28, model_type="qwen3",
    num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=8, rms_norm_eps=1e-06, rope_scaling=None,
    rope_theta=1000000, sliding_window=None, tie_word_embeddings=True, torch_dtype="bfloat16", use_cache=True,
    use_sliding_window=False, vocab_size=151936)
_MISTRAL_7B_V03 = dict(  # mistralai/Mistral-7B-v0.3
    architectures=["MistralForCausalLM"], attention_dropout=0.0, bos_token_id=1, eos_token_id=2, hidden_act="silu",
    hidden_size=4096, initializer_range=0.02, intermediate_size=14336, max_position_embeddings=32768,
    model_type="mistral", num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8, rms_norm_eps=1e-05,
    rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True,
    vocab_size=32768)
_MISTRAL_7B_V01 = dict(  # mistralai/Mistral-7B-v0.1
    architectures=["MistralForCausalLM"], bos_token_id=1, eos_token_id=2, hidden_act="silu", hidden_size=4096,
    initializer_range=0.02, intermediate_size=14336, max_position_embeddings=32768, model_type="mistral",
    num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8, rms_norm_eps=1e-05, rope_theta=10000.0,
    sliding_window=4096, tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True, vocab_size=32000)
_TINYLLAMA_3T = dict(  # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T
    architectures=["LlamaForCausalLM"], attention_bias=False, bos_token_id=1, eos_token_id=2, hidden_act="silu",
    hidden_size=2048, initializer_range=0.02, intermediate_size=5632, max_position_embeddings=2048,
    model_type="llama", num_attention_heads=32, num_hidden_layers=22, num_key_value_heads=4, pretraining_tp=1,
    rms_norm_eps=1e-05, rope_scaling=None, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32",
    use_cache=True, vocab_size=32000)
# Llama-3.2-1B-Instruct as transformers 5 writes it: `dtype`, and rope_theta inside rope_parameters.
_LLAMA32_1B_TRANSFORMERS5 = {
    **{k: v for k, v in _LLAMA32_1B_INSTRUCT.items() if k not in ("rope_scaling", "rope_theta", "torch_dtype")},
    "dtype": "bfloat16", "pad_token_id": None,
    "rope_parameters": dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                            original_max_position_embeddings=8192, rope_theta=500000.0, rope_type="llama3")}


@pytest.mark.parametrize("d, want", [
    # (architecture, kv heads, head_dim, rope_theta, llama3 rope?, sliding_window, max_model_len, eos, tied)
    (_LLAMA32_1B_INSTRUCT, ("llama", 8, 64, 5e5, True, None, 131072, (128001, 128008, 128009), True)),
    (_QWEN25_05B, ("qwen2", 2, 64, 1e6, False, None, 32768, (151643,), True)),
    (_QWEN3_06B, ("qwen3", 8, 128, 1e6, False, None, 40960, (151645,), True)),
    (_MISTRAL_7B_V03, ("mistral", 8, 128, 1e6, False, None, 32768, (2,), False)),
    (_MISTRAL_7B_V01, ("mistral", 8, 128, 1e4, False, 4096, 4096, (2,), False)),
    (_TINYLLAMA_3T, ("llama", 4, 64, 1e4, False, None, 2048, (2,), False)),
    (_LLAMA32_1B_TRANSFORMERS5, ("llama", 8, 64, 5e5, True, None, 131072, (128001, 128008, 128009), True)),
], ids=["llama3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b", "mistral-v0.3", "mistral-v0.1", "tinyllama-fp32",
        "transformers5"])
def test_published_config_json_files_load(d, want):
    cfg = ModelConfig.from_hf(d)
    assert (cfg.architecture, cfg.num_key_value_heads, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling is not None,
            cfg.sliding_window, cfg.max_model_len, cfg.eos_token_ids, cfg.tie_word_embeddings) == want
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.bos_token_id) == (d["vocab_size"], d["num_hidden_layers"],
                                                                         d["bos_token_id"])
    # as the installed transformers' config class rewrites it (5.x: dtype, rope_parameters): the same model
    import transformers

    hf_class = dict(llama="LlamaConfig", qwen2="Qwen2Config", qwen3="Qwen3Config", mistral="MistralConfig")
    assert ModelConfig.from_hf(getattr(transformers, hf_class[cfg.architecture])(**d).to_dict()) == cfg


@pytest.mark.parametrize("model_type, extra", [("llama", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", {}),
                                               ("qwen2", {"use_sliding_window": True}),
                                               ("qwen3", {"use_sliding_window": True})])
def test_a_config_json_without_a_window_key_gets_the_window_transformers_gives_it(tmp_path, model_type, extra):
    """A missing key is the family's transformers default, not None: Mistral's is a
    4,096-token window, and Qwen's when use_sliding_window is on (attending past it would
    compute another model)."""
    import json

    import transformers

    d = {k: v for k, v in _HF.items() if k != "architectures"} | {"model_type": model_type, **extra}
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    want = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
    assert ModelConfig.from_hf(d).sliding_window == want
    assert ModelConfig.from_hf({**d, "sliding_window": None}).sliding_window is None


def test_checkpoint_files_that_are_not_what_they_claim_are_errors_naming_the_file(hf_checkpoint, tmp_path):
    import shutil

    src = hf_checkpoint("llama2")

    def copy(name: str) -> str:
        return shutil.copytree(src, tmp_path / name)

    bad_json = copy("bad-json")
    (bad_json / "config.json").write_text("{bad")
    with pytest.raises(ValueError, match="bad-json/config.json is not valid JSON"):
        load_model(str(bad_json))
    a_list = copy("a-list")
    (a_list / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="a-list/config.json must hold a JSON object, got list"):
        load_model(str(a_list))
    cut = copy("cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut/model.safetensors is not a readable safetensors file"):
        load_model(str(cut))  # safetensors' own SafetensorError is no ValueError: the server would not catch it


@pytest.mark.parametrize("eos, ids", [(3, (2, 3)), ([3, 4], (2, 3, 4)), (None, (2,)), ("absent", (2,)),
                                      ("3", None), (3.0, None), (True, None), (-5, None), (10**9, None), ({"a": 1}, None)])
def test_generation_config_eos_forms(hf_checkpoint, tmp_path, eos, ids):
    """An int, a list or null add to config.json's eos (2); anything else is refused, not
    kept as a stop id no token equals (a string, a bool) or a TypeError (a float)."""
    import json

    from hf_config import generation_eos_ids

    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({} if eos == "absent" else {"eos_token_id": eos}))
    if ids is None:
        with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
            generation_eos_ids(str(path), 300)
    else:
        assert (2, *generation_eos_ids(str(path), 300)) == ids


def test_tokenizer_files(tmp_path):
    assert load_model(make_hf_checkpoint(tmp_path / "bare", "llama2")).tokenizer is None
    tok = load_model(make_hf_checkpoint(tmp_path / "tok", "llama2", tokenizer=True)).tokenizer
    assert tok is not None and tok.eos_token_id == 2 and len(tok) <= 300
    ids = tok.encode("the lazy fox", add_special_tokens=False)
    assert tok.decode(ids) == "the lazy fox"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert load_tokenizer(str(tmp_path / "bare")) is None


@pytest.mark.parametrize("template, says", [("{% for m in messages %}{{ m.content ", "chat template failed"),
                                             ("{{ raise_exception('no system role') }}", "no system role")])
def test_a_chat_template_that_is_broken_or_raises_fails_its_chat_request_with_a_400(tmp_path, template, says):
    """The checkpoint still loads (completions need no template); each chat request is a
    400 naming the template's error, before the engine sees it."""
    from chat_format import parse_messages
    from protocol import ApiError

    path = make_hf_checkpoint(tmp_path / "tok", "llama2", tokenizer=True)
    (tmp_path / "tok" / "chat_template.jinja").write_text(template)
    tok = load_model(path).tokenizer
    assert tok.encode("the fox", add_special_tokens=False)
    with pytest.raises(ApiError, match=says) as e:
        parse_messages({"messages": [{"role": "user", "content": "hi"}]}, tok)
    assert e.value.status == 400 and e.value.param == "messages"


def test_byte_tokenizer():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=False) == f"<|bos|>{text}<|eos|>"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut multi-byte char is replaced, not an error
    assert tok.decode([104, 400, 105]) == "hi"  # ids past the tokenizer's vocab decode to nothing
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, tokenize=True) == tok.encode(text)


def test_builtin_models():
    bench = nnx.eval_shape(lambda: Decoder(BUILTIN_MODELS["bench"], rngs=nnx.Rngs(0)))
    assert sum(v.size for v in jax.tree.leaves(nnx.state(bench, nnx.Param))) == 57_942_528
    lm = load_model("tiny")
    assert lm.config.vocab_size > lm.tokenizer.vocab_size and lm.config.eos_token_ids == (lm.tokenizer.eos_token_id,)
    prompt = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    (logits,) = Paged(lm.model, num_seqs=1, max_len=len(prompt)).step([(0, prompt)])
    assert np.isfinite(logits).all() and len(set(logits.argmax(-1).tolist())) > len(prompt) // 2  # not degenerate
    same = load_model("tiny", seed=0).model.embed_tokens.embedding[...]
    assert np.array_equal(same, lm.model.embed_tokens.embedding[...])
    assert not np.array_equal(same, load_model("tiny", seed=1).model.embed_tokens.embedding[...])


def test_hf_tensors_map_into_the_stacked_layers_and_back(hf_checkpoint):
    """hf_state_dict and model_from_hf_tensors are inverses: the per-layer HF tensors land
    in their layer of the stacked params (every layer leaf has a leading [L] axis)."""
    from safetensors.numpy import load_file

    from model_loader import hf_state_dict, model_from_hf_tensors

    path = hf_checkpoint("qwen2")  # tied embeddings and q/k/v biases
    lm = load_model(path)
    L = lm.config.num_hidden_layers
    for p, x in _params(lm).items():
        assert (x.shape[0] == L) == (p[0] == "layers"), p
    hf = hf_state_dict(lm.model)
    ckpt = load_file(os.path.join(path, "model.safetensors"))
    assert hf.keys() == ckpt.keys() - {"lm_head.weight"}
    for name, x in hf.items():
        np.testing.assert_array_equal(x, ckpt[name], err_msg=name)
    again = model_from_hf_tensors(lm.config, jnp.float32, hf.items())
    a, b = _params(lm), {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(again, nnx.Param))}
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_every_parameter_is_declared_once_with_axes_of_its_rank():
    """Decoder.WEIGHTS covers every parameter of the fullest configuration (biases,
    qk-norm, an untied LM head) with one HF and one GGUF name each and one logical axis
    per dim; tensor parallelism splits exactly the axes it declares."""
    from dataclasses import replace

    from jax.sharding import PartitionSpec as P

    from model import declared_weight, hf_tensor_names
    from parallel import param_spec

    cfg = replace(BUILTIN_MODELS["tiny"], attention_bias=True, o_proj_bias=True, qk_norm=True)
    flat = nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param))
    hf, gguf = [], []
    for path, var in flat:
        w = declared_weight(path)
        assert len(w.axes) == var.get_value().ndim, (path, w.axes)
        hf += hf_tensor_names(path, cfg.num_hidden_layers)
        gguf.append(w.gguf)
    assert len(hf) == len(set(hf)) and len(gguf) == len(set(gguf))
    # quantized linears (quant.py): codes under the kernel's declaration, scales their own
    from quant import LAYER_LINEARS, WeightQuant

    seen = {p for p, _ in flat}
    for scheme in ("int8", "fp8_e4m3", "q4_1"):
        quant = WeightQuant(tuple((path, scheme) for path in LAYER_LINEARS), scheme)
        for path, var in nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: Decoder(cfg, quant=quant,
                                                                                     rngs=nnx.Rngs(0))), nnx.Param)):
            assert len(declared_weight(path).axes) == var.get_value().ndim, (path, scheme)
            seen.add(path)
    assert len(seen) == len(Decoder.WEIGHTS)  # no declaration without its parameter
    spec = {".".join(map(str, p)): param_spec(p, cfg, 2) for p, _ in flat}
    assert spec["layers.self_attn.k_proj.kernel"] == P(None, None, "tp")
    assert spec["layers.self_attn.o_proj.kernel"] == P(None, "tp", None)
    assert spec["layers.self_attn.o_proj.bias"] == P(None, None)  # added once, after the sum
    assert spec["layers.mlp.down_proj.kernel"] == P(None, "tp", None)
    # a quantized kernel's scales split with its features: per output channel with the
    # output (column-parallel) or replicated (row-parallel), per input block with the input,
    # per tensor replicated
    assert param_spec(("layers", "self_attn", "q_proj", "scale"), cfg, 2) == P(None, "tp")
    assert param_spec(("layers", "self_attn", "o_proj", "scale"), cfg, 2) == P(None, None)
    assert param_spec(("layers", "mlp", "down_proj", "block_scale"), cfg, 2) == P(None, "tp", None)
    assert param_spec(("layers", "mlp", "down_proj", "tensor_scale"), cfg, 2) == P(None)  # one per layer: replicated
    assert spec["embed_tokens.embedding"] == P("tp", None) and spec["norm.weight"] == P(None)
