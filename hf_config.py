"""A checkpoint's config.json and generation_config.json, checked where they enter.

ModelConfig.from_hf builds the architecture from whatever a config.json says (a GGUF
file's metadata comes as the same dict, gguf_loader.py). A value of the wrong type or out
of range there would otherwise surface as a shape error deep inside JAX, a division by
zero while building RoPE, or, worse, a model that loads and computes something else (no
heads dividing, NaN epsilon, an EOS id no token can match). Each check names the field.
"""

from __future__ import annotations

import json
import os
from typing import Any

from quant_methods import float_methods
from sampling_params import GENERATION_DEFAULT_KEYS, is_finite_number, is_int, sampling_defaults

# config.json's integer sizes, each >= 1 (num_key_value_heads and head_dim may be absent).
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "max_position_embeddings")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")
MAX_DIM = 2**63 - 1  # int64's: the sizes become array dimensions
# The dtypes a checkpoint may be stored in (config.json's dtype / torch_dtype, for --dtype auto).
CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from `path`; ValueError naming the file if it is not one."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise ValueError(f"{path} nests arrays or objects deeper than Python's JSON reader reaches") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _positive_number(d: dict[str, Any], key: str, where: str) -> None:
    v = d.get(key)
    if v is not None and not (is_finite_number(v) and v > 0):
        raise ValueError(f"{where}{key} must be a finite number > 0, got {v!r}"[:300])


def _rope_base(d: dict[str, Any], where: str) -> None:
    """rope_theta, RoPE's base: its frequencies theta^(-2i/d) fall from 1 with a base >= 1;
    below 1 they grow, past float32's range for a tiny one (NaN from the first position)."""
    _positive_number(d, "rope_theta", where)
    if d.get("rope_theta") is not None and d["rope_theta"] < 1:
        raise ValueError(f"{where}rope_theta must be >= 1, got {d['rope_theta']!r}")


def _rope_type(p: dict[str, Any], where: str) -> None:
    """vLLM's patch_rope_scaling_dict: a RoPE dict names its type, by rope_type or the legacy
    type, and both where given agree; otherwise its scaling parameters would be read as no
    scaling at all, or the one type as the other. A dict of rope_theta alone scales nothing."""
    if "rope_type" in p and "type" in p and p["rope_type"] != p["type"]:
        raise ValueError(f"{where}: rope_type {p['rope_type']!r} and its legacy spelling type {p['type']!r} "
                         "disagree: give one of them")
    if "rope_type" not in p and "type" not in p and p.keys() - {"rope_theta"}:
        raise ValueError(f"{where} gives {', '.join(sorted(map(str, p.keys() - {'rope_theta'})))} but no "
                         "rope_type (default, llama3, ...)")


def token_ids(value: object, field: str) -> tuple[int, ...]:
    """An eos_token_id / bos_token_id value: null, an id, or a list of ids (>= 0)."""
    ids = [] if value is None else [value] if not isinstance(value, list) else value
    if not all(is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"{field} must be a token id >= 0, a list of them, or null; got {value!r}")
    return tuple(ids)


def check_hf_config(d: object, source: str = "config.json") -> None:
    """The fields ModelConfig.from_hf reads: types, ranges and how they fit together."""
    if not isinstance(d, dict):
        raise ValueError(f"{source} must be a JSON object, got {type(d).__name__}")
    where = f"{source}: "
    for key in SIZES:
        if key not in d:
            raise ValueError(f"{where}{key} is missing")
    for key in SIZES + OPTIONAL_SIZES:
        v = d.get(key)
        if (v is not None or key in SIZES) and not (is_int(v) and v >= 1):
            raise ValueError(f"{where}{key} must be an integer >= 1, got {v!r}"[:300])
        if v is not None and v > MAX_DIM:  # NumPy reads 2**63..2**64-1 as uint64, which JAX takes for no shape
            raise ValueError(f"{where}{key} {v} is past the largest array dimension ({MAX_DIM})"[:300])
    heads, kv_heads = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
    if heads % kv_heads:
        raise ValueError(f"{where}num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads}): "
                         "each KV head serves a whole group of query heads")
    if d.get("head_dim") is None and d["hidden_size"] % heads:
        raise ValueError(f"{where}num_attention_heads ({heads}) must divide hidden_size ({d['hidden_size']}) "
                         "when head_dim is not given")
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    if head_dim % 2:
        raise ValueError(f"{where}head_dim ({head_dim}) must be even: RoPE rotates pairs of dimensions")
    _positive_number(d, "rms_norm_eps", where)
    _rope_base(d, where)
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
        if d.get(key) is not None and not isinstance(d[key], bool):
            raise ValueError(f"{where}{key} must be true or false, got {d[key]!r}")
    window = d.get("sliding_window")
    if window is not None and not (is_int(window) and window >= 1):
        raise ValueError(f"{where}sliding_window must be an integer >= 1 or null, got {window!r}")
    for key in ("rope_scaling", "rope_parameters"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise ValueError(f"{where}{key} must be an object or null, got {d[key]!r}")
        _rope_base(d.get(key) or {}, f"{where}{key}.")
        _rope_type(d.get(key) or {}, f"{where}{key}")
    if d.get("rope_scaling") and d.get("rope_parameters"):
        # transformers 5 reads the legacy rope_scaling first, taxirank rope_parameters: where
        # they disagree the two would run different RoPE
        old, new = ({("rope_type" if k == "type" else k): v for k, v in d[key].items()}
                    for key in ("rope_scaling", "rope_parameters"))
        differ = sorted(k for k in {"rope_type", *old.keys() & new.keys()}
                        if old.get(k, "default") != new.get(k, "default"))
        if differ:
            raise ValueError(f"{where}rope_scaling and rope_parameters disagree on {', '.join(differ)}: "
                             "give one of them")
    vocab = d["vocab_size"]
    bos = d.get("bos_token_id")
    if bos is not None and not (is_int(bos) and bos >= 0):  # one token opens a prompt (transformers: no list)
        raise ValueError(f"{where}bos_token_id must be a token id >= 0 or null, got {bos!r}")
    for key in ("eos_token_id", "bos_token_id"):
        ids = token_ids(d.get(key), f"{where}{key}")
        if any(i >= vocab for i in ids):
            raise ValueError(f"{where}{key} {d[key]!r} is outside the vocabulary (vocab_size {vocab})")
    for key in ("dtype", "torch_dtype"):
        if d.get(key) is not None and d[key] not in CHECKPOINT_DTYPES:
            raise ValueError(f"{where}{key} must be one of {', '.join(CHECKPOINT_DTYPES)}, got {d[key]!r}")
    quant = d.get("quantization_config")
    if quant is not None:  # its tensors (qweight, scales, fp8) are not the float weights the loader reads
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"{where}a pre-quantized checkpoint (quantization_config: {method!r}) is not supported: "
                         f"load a float checkpoint (and pass --quantization {float_methods()} to serve it in 8 bits)")
    arch = d.get("architectures")
    if arch is not None and (not isinstance(arch, list) or not all(isinstance(a, str) for a in arch)):
        raise ValueError(f"{where}architectures must be a list of class names, got {arch!r}")
    if arch and not any(a.endswith("ForCausalLM") for a in arch):
        raise ValueError(f"{where}architectures {arch} names no causal language model (a ...ForCausalLM class): "
                         "taxirank generates text only")


def check_llama3_rope(p: dict[str, Any], source: str = "config.json") -> None:
    """Llama 3.1's RoPE scaling parameters: positive numbers, the high band above the low."""
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if p.get(key) is None:  # each is needed: null is no value (_positive_number lets it pass)
            raise ValueError(f"{source}: rope scaling {key} must be a finite number > 0, got None")
        _positive_number(p, key, f"{source}: rope scaling ")
    if not is_int(p["original_max_position_embeddings"]):  # a context length, as transformers checks it
        raise ValueError(f"{source}: rope scaling original_max_position_embeddings must be an integer, "
                         f"got {p['original_max_position_embeddings']!r}")
    if not p["high_freq_factor"] > p["low_freq_factor"]:
        raise ValueError(f"{source}: llama3 rope scaling needs high_freq_factor ({p['high_freq_factor']}) > "
                         f"low_freq_factor ({p['low_freq_factor']})")


def generation_eos_ids(path: str, vocab_size: int) -> tuple[int, ...]:
    """The eos_token_id(s) of a generation_config.json (none if the file is absent)."""
    if not os.path.isfile(path):
        return ()
    ids = token_ids(read_json(path).get("eos_token_id"), f"{path}: eos_token_id")
    if any(i >= vocab_size for i in ids):
        raise ValueError(f"{path}: eos_token_id {list(ids)} is outside the vocabulary (vocab_size {vocab_size})")
    return ids


def generation_sampling_defaults(config: Any) -> dict[str, Any]:
    """A request's sampling defaults under EngineConfig `config`, as vLLM's
    --generation-config / --override-generation-config: what the generation_config.json
    (of the model folder, for "auto") sets of sampling_params.GENERATION_DEFAULT_KEYS, then the
    override's keys over them; SamplingParams keyword arguments ({}: OpenAI's defaults)."""
    folder = {"auto": config.model if os.path.isdir(config.model) else None, "vllm": None}.get(
        config.generation_config, config.generation_config)  # (a GGUF file's metadata holds none)
    path = os.path.join(folder, "generation_config.json") if folder is not None else None
    found: dict[str, Any] = {}
    if path is not None and os.path.isfile(path):
        found = {k: v for k, v in read_json(path).items() if k in GENERATION_DEFAULT_KEYS}
        sampling_defaults(found, path)  # each value checked where it enters
    if config.override_generation_config is not None:
        found |= json.loads(config.override_generation_config)
    return sampling_defaults(found, "the generation config")
