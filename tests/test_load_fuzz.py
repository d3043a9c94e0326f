"""A property test of what enters from a model's files: hypothesis mutates a small valid
checkpoint's metadata (a Hugging Face folder's config.json, generation_config.json and
tokenizer_config.json, a GGUF file's metadata keys and tensor table, dequantized or served
natively, an orbax checkpoint's taxirank_checkpoint.json) with hostile values (keys
dropped, wrong JSON types, 10**30, 10**400 and 2**63 where sizes are due, zero, negatives,
NaN and Infinity as raw JSON tokens, floats for integers) and loads it with load_model /
checkpoint.load (no compile: the tiny shapes load in milliseconds).

Property, for every mutation: the load succeeds, or raises a ValueError whose message
names the file, one of the mutated keys, or a tensor the sizes disagree with; never
another exception (a TypeError, an OverflowError, a RecursionError, a MemoryError from a
size the tensors do not have). The hand-written tables of such values are test_model.py's
(config.json), test_gguf.py's (GGUF) and test_checkpoint_entry.py's (orbax, tokenizer
files); each defect this found has its row there.

TAXIRANK_FUZZ_EXAMPLES=1500 with --hypothesis-profile=explore searches further (about
four minutes on one core).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_gguf import patch_entry, write_gguf

import checkpoint
from model_loader import load_model

EXAMPLES = int(os.environ.get("TAXIRANK_FUZZ_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

EXTREME_INTS = st.sampled_from([0, 1, -1, 2, 3, 4, 7, 16, 64, 300, 2**31, 2**32 + 2, 2**62, 2**63 - 1, 2**63, 2**64,
                                10**30, 10**400, -(2**63)])
EXTREME_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 0.5, 1.0, 2.0, 1.5, 1e-300, 1e308,
                                  4096.0, 2.0**63])
SCALARS = st.one_of(st.none(), st.booleans(), EXTREME_INTS, st.integers(-2, 70), EXTREME_FLOATS,
                    st.sampled_from(["", "x", "2", "64", "llama", "qwen3", "llama3", "default", "float32", "bfloat16",
                                     "silu", "LlamaForCausalLM"]))
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["rope_type", "type", "factor", "rope_theta", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings", "x"]), inner, max_size=5), max_leaves=6)
DROP = object()  # the key left out
VALUES = st.one_of(st.just(DROP), SCALARS, JUNK)


def _check(e: ValueError, where: str, keys: list[str]) -> None:
    msg = str(e)
    if re.match(r"(unexpected )?tensor '[^']+' ", msg) or " lacks tensors: " in msg:
        return  # sizes the tensors do not have: named by the tensor
    names = [where, os.path.basename(where), *keys, *(k.rsplit(".", 1)[-1] for k in keys)]
    assert any(n and n in msg for n in names), f"{msg!r} names neither {where} nor any of {keys}"


def _load(call: Any, where: str, keys: list[str]) -> None:
    try:
        call()
    except ValueError as e:
        _check(e, where, keys)


# ---- a Hugging Face folder --------------------------------------------------------------

CONFIG_KEYS = ["model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta",
               "rope_scaling", "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "eos_token_id",
               "bos_token_id", "torch_dtype", "dtype", "sliding_window", "use_sliding_window", "attention_bias",
               "mlp_bias", "hidden_act", "partial_rotary_factor", "quantization_config"]
GENERATION_KEYS = ["eos_token_id", "bos_token_id", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "max_new_tokens"]
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64, rope_theta=500000.0)


@pytest.fixture(scope="module")
def hf_folder(hf_checkpoint) -> str:
    return hf_checkpoint("llama2")


def _mutated(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in changes.items():
        if v is DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


@SETTINGS
@given(config=st.dictionaries(st.sampled_from(CONFIG_KEYS), VALUES, min_size=1, max_size=4),
       base_extra=st.sampled_from([{}, {"rope_parameters": LLAMA3}, {"model_type": "mistral"}]),
       generation=st.none() | st.dictionaries(st.sampled_from(GENERATION_KEYS), VALUES, max_size=3),
       generation_raw=st.sampled_from([None, "[]", "{", "null", '"x"', "NaN"]))
def test_a_mutated_config_json_loads_or_is_a_value_error_naming_it(hf_folder, config, base_extra, generation,
                                                                   generation_raw):
    from hf_config import generation_sampling_defaults
    from config import EngineConfig

    base = json.load(open(os.path.join(hf_folder, "config.json")))
    d = _mutated({**base, **base_extra}, config)
    with tempfile.TemporaryDirectory() as folder:
        os.symlink(os.path.join(hf_folder, "model.safetensors"), os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write(json.dumps(d))  # NaN and Infinity as JSON's raw tokens, as Python's json writes and reads them
        if generation is not None or generation_raw is not None:
            with open(os.path.join(folder, "generation_config.json"), "w") as f:
                f.write(generation_raw if generation is None else json.dumps(_mutated({}, generation)))
        keys = [*config, *(generation or {}), "generation_config.json"]
        _load(lambda: load_model(folder, log=lambda *_: None), folder, keys)
        _load(lambda: generation_sampling_defaults(EngineConfig(model=folder)), folder, keys)


TOKENIZER_KEYS = ["eos_token", "bos_token", "unk_token", "pad_token", "chat_template", "model_max_length",
                  "added_tokens_decoder", "tokenizer_class", "add_bos_token", "add_eos_token",
                  "clean_up_tokenization_spaces"]


@SETTINGS
@given(changes=st.dictionaries(st.sampled_from(TOKENIZER_KEYS), VALUES, min_size=1, max_size=3))
def test_a_mutated_tokenizer_config_loads_or_is_a_value_error_naming_it(hf_checkpoint, changes):
    """The model's own tokenizer files beside a valid config.json and weights."""
    src = hf_checkpoint("llama2", tokenizer=True)
    with tempfile.TemporaryDirectory() as folder:
        for name in os.listdir(src):
            if name != "tokenizer_config.json":
                os.symlink(os.path.join(src, name), os.path.join(folder, name))
        d = _mutated(json.load(open(os.path.join(src, "tokenizer_config.json"))), changes)
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            f.write(json.dumps(d))
        _load(lambda: load_model(folder, log=lambda *_: None), folder, list(changes))


# ---- a GGUF file ----------------------------------------------------------------------

GGUF_KEYS = ["general.architecture", "llama.block_count", "llama.context_length", "llama.embedding_length",
             "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
             "llama.attention.key_length", "llama.attention.value_length", "llama.rope.dimension_count",
             "llama.rope.freq_base", "llama.rope.scaling.type", "llama.rope.scaling.factor", "llama.rope.scale_linear",
             "llama.attention.layer_norm_rms_epsilon", "llama.vocab_size", "llama.attention.sliding_window",
             "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
             "tokenizer.ggml.padding_token_id", "tokenizer.ggml.model", "tokenizer.ggml.tokens",
             "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"]
TENSORS = ["token_embd.weight", "output.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
           "blk.1.ffn_up.weight", "blk.1.attn_norm.weight"]


@st.composite
def gguf_values(draw: st.DrawFn) -> Any:
    """(value, gguf.GGUFValueType) or None (the key removed)."""
    import gguf

    T = gguf.GGUFValueType
    kind = draw(st.sampled_from(["drop", "u32", "i32", "u64", "i64", "f32", "f64", "bool", "str", "array"]))
    if kind == "drop":
        return None
    if kind in ("u32", "u64"):
        bits = 32 if kind == "u32" else 64
        value = draw(st.sampled_from([0, 1, 2, 3, 4, 15, 16, 64, 299, 300, 2**31, 2**bits - 1]))
        return value, getattr(T, f"UINT{bits}")
    if kind in ("i32", "i64"):
        bits = 32 if kind == "i32" else 64
        return draw(st.sampled_from([-1, 0, 2, 64, -(2**(bits - 1)), 2**(bits - 1) - 1])), getattr(T, f"INT{bits}")
    if kind in ("f32", "f64"):
        return draw(EXTREME_FLOATS.filter(lambda x: kind == "f64" or abs(x) < 3e38)), getattr(
            T, "FLOAT32" if kind == "f32" else "FLOAT64")
    if kind == "bool":
        return draw(st.booleans()), T.BOOL
    if kind == "str":
        return draw(st.sampled_from(["", "llama", "qwen2", "gpt2", "none", "yarn", "x"])), T.STRING
    n = draw(st.sampled_from([1, 5, 300, 301]))  # (the writer refuses an empty array)
    item = draw(st.sampled_from(["str", "int", "float"]))
    values = ([f"t{i}" for i in range(n)] if item == "str" else list(range(n)) if item == "int"
              else [0.0] * n)
    return values, T.ARRAY


@pytest.fixture(scope="module")
def gguf_base(hf_checkpoint, tmp_path_factory) -> tuple[str, str, set[str]]:
    """The llama2 checkpoint, a folder for the files, and the metadata keys write_gguf writes."""
    import gguf

    src = hf_checkpoint("llama2")
    folder = str(tmp_path_factory.mktemp("gguf-fuzz"))
    return src, folder, set(gguf.GGUFReader(write_gguf(src, os.path.join(folder, "base.gguf"))).fields)


@SETTINGS
@given(metadata=st.dictionaries(st.sampled_from(GGUF_KEYS), gguf_values(), max_size=4),
       entry=st.none() | st.tuples(st.sampled_from(TENSORS),
                                   st.none() | st.sampled_from([(0, 64), (64, 0), (1, 1), (2**40, 64), (2**63, 2),
                                                                (64, 2**62), (32, 300), (300, 64), (64, 64)]),
                                   st.none() | st.sampled_from([1, 2, 8, 12, 30, 31, 40, 99, 2**31])),
       quant=st.sampled_from([("F32", None), ("Q8_0", None), ("Q8_0", "gguf"), ("Q4_0", "gguf")]))
def test_a_mutated_gguf_file_loads_or_is_a_value_error_naming_it(gguf_base, metadata, entry, quant):
    src, folder, written = gguf_base
    metadata = {k: v for k, v in metadata.items() if v is not None or k in written}
    with tempfile.NamedTemporaryFile(suffix=".gguf", dir=folder) as f:
        data = open(write_gguf(src, f.name, quant=quant[0], metadata=metadata), "rb").read()
        if entry is not None:
            name, dims, type_id = entry
            if dims is not None:
                n_dims = 1 if name.endswith("norm.weight") else 2
                dims = dims[:n_dims]
            data = patch_entry(data, name, dims=dims, type_id=type_id)
            with open(f.name, "wb") as out:
                out.write(data)
        keys = [*metadata, *([entry[0]] if entry else [])]
        _load(lambda: load_model(f.name, log=lambda *_: None, quantization=quant[1]), f.name, keys)


# ---- an orbax checkpoint ---------------------------------------------------------------

MODEL_CONFIG_KEYS = ["architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                     "rope_scaling", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
                     "o_proj_bias", "qk_norm", "sliding_window", "bos_token_id", "eos_token_ids", "unknown_field"]


@pytest.fixture(scope="module")
def orbax_base(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("orbax-fuzz") / "ck")
    checkpoint.save(load_model("tiny"), path)
    return path


@SETTINGS
@given(top=st.dictionaries(st.sampled_from(["format", "dtype", "tokenizer", "model_config"]), VALUES, max_size=2),
       model_config=st.dictionaries(st.sampled_from(MODEL_CONFIG_KEYS), VALUES, max_size=3),
       raw=st.sampled_from([None, None, None, None, "[]", "{", "null", "5"]))
def test_a_mutated_orbax_checkpoint_meta_loads_or_is_a_value_error_naming_it(orbax_base, tmp_path_factory, top,
                                                                             model_config, raw):
    with tempfile.TemporaryDirectory(dir=tmp_path_factory.getbasetemp()) as folder:
        path = os.path.join(folder, "ck")
        shutil.copytree(orbax_base, path, symlinks=True)
        meta_file = os.path.join(path, checkpoint.META)
        meta = json.load(open(meta_file))
        meta["model_config"] = _mutated(meta["model_config"], model_config)
        meta = _mutated(meta, top)
        with open(meta_file, "w") as f:
            f.write(raw if raw is not None else json.dumps(meta))
        _load(lambda: checkpoint.load(path), path, [*top, *model_config])
