"""Loading a model: a built-in random one (`tiny`, `bench`), a GGUF file or a Hugging Face
checkpoint directory, into the Decoder (model.py), with the tokenizer it serves.

Every checkpoint format arrives as (HF tensor name, array) pairs at one function,
`model_from_hf_tensors`, which copies each into the parameter the Decoder's WEIGHTS name
it for (a decoder layer's into its row of the stacked parameter) and encodes a quantized
linear (quant.py) one layer at a time, so no float copy of it is ever whole;
`hf_state_dict` is its inverse. gguf_loader.py turns a GGUF file into such pairs and an
HF config dict. The tokenizer is the model's own or --tokenizer's, its ids checked
against the model's embedding rows before the weights are read. (vLLM keeps this in
model_executor/model_loader.)
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

import gguf_loader
from config import host_memory_bytes
from hf_config import generation_eos_ids, read_json
from model import Decoder, ModelConfig, declared_weight, hf_tensor_names, init_model
from quant import SCHEMES, GGUFBlocks, encode, weight_quant_for
from quant_methods import QUANTIZATION_METHODS, WeightQuant
from tokenizer import ByteTokenizer, gguf_tokenizer, load_named_tokenizer, load_tokenizer, num_token_ids

_BYTE = ByteTokenizer()
BUILTIN_MODELS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                        bos_token_id=_BYTE.bos_token_id, eos_token_ids=(_BYTE.eos_token_id,)),
    # 57,942,528 params: embed + lm_head 2 * 32000*512 = 32,768,000; per layer q,o 2 * 512*512 +
    # k,v 2 * 512*256 + mlp 3 * 512*1536 + 2 norms * 512 = 3,146,752, * 8 = 25,174,016; final norm 512.
    "bench": ModelConfig("llama", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-5,
                         max_position_embeddings=16384,
                         bos_token_id=_BYTE.bos_token_id, eos_token_ids=(_BYTE.eos_token_id,)),
}
_DTYPES = {"float32": jnp.dtype(jnp.float32), "bfloat16": jnp.dtype(jnp.bfloat16)}


@dataclass
class LoadedModel:
    model: Decoder
    config: ModelConfig  # the model's, with the stop ids of the tokenizer served (--tokenizer: named_tokenizer)
    tokenizer: Any | None  # ByteTokenizer, a transformers tokenizer, or None (token ids only)
    name: str
    dtype: jnp.dtype
    quant: WeightQuant | None = None  # the linears stored quantized (quant.py)


def resolve_dtype(dtype: str, checkpoint_dtype: str | None) -> jnp.dtype:
    """The parameter dtype for `--dtype` (float32, bfloat16, or auto: the checkpoint's)."""
    if dtype == "auto":
        # float16 checkpoints run in float32: exact, and without fp16's overflow risk.
        dtype = "bfloat16" if checkpoint_dtype == "bfloat16" else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or auto, got {dtype!r}")
    return _DTYPES[dtype]


def load_model(model: str = "tiny", dtype: str = "float32", seed: int = 0,
               log: Callable[[str], None] = print, quantization: str | None = None,
               tokenizer: str | None = None) -> LoadedModel:
    """A built-in random model ("tiny", "bench"), the built-in real model ("smollm2", a
    GGUF fetched on first use), a .gguf file, or an HF checkpoint directory; its decoder
    layers' linears quantized as --quantization says (quant.py). `tokenizer` (--tokenizer):
    a tokenizer folder or .gguf file used instead of the model's own, which is then not
    loaded (named_tokenizer: loaded and checked before the weights)."""
    if model in BUILTIN_MODELS:
        cfg, dt = BUILTIN_MODELS[model], resolve_dtype(dtype, None)
        tok, tok_cfg = named_tokenizer(tokenizer, cfg, log, builtin=True) if tokenizer else (ByteTokenizer(), cfg)
        loaded = LoadedModel(init_model(cfg, dt, seed), tok_cfg, tok, model, dt)
        return quantize_loaded(loaded, weight_quant_for(quantization, None))
    # A GGUF file comes as the same HF config dict and HF-named tensors as a checkpoint directory.
    if model in gguf_loader.BUILTIN_GGUF or model.endswith(".gguf"):
        path = gguf_loader.resolve_builtin(model, log) if model in gguf_loader.BUILTIN_GGUF else model
        ckpt = gguf_loader.read_gguf(path)
        cfg = ModelConfig.from_hf(ckpt.hf_config, f"{path} (GGUF metadata)")
        dt = resolve_dtype(dtype, "bfloat16" if ckpt.file_type == "BF16" else None)
        if tokenizer:  # instead of the metadata's, which is not converted (vLLM's advice for GGUF files)
            tok, tok_cfg = named_tokenizer(tokenizer, cfg, log)
        else:
            tok, tok_cfg = gguf_tokenizer(ckpt.tokenizer_metadata) if ckpt.tokenizer_metadata else None, cfg
            check_token_ids(tok, cfg, f"the tokenizer of {path!r}")
        quant = weight_quant_for(quantization, ckpt.linear_types())
        native = quantization is not None and QUANTIZATION_METHODS[quantization].reads_gguf_blocks
        served = (f"{quant.describe()}, the rest dequantized to {np.dtype(dt).name}" if native
                  else f"dequantized to {np.dtype(dt).name}" + (f", then {quant.describe()}" if quant else ""))
        log(f"model: {path} ({ckpt.file_type} GGUF, {served})")
        return LoadedModel(model_from_hf_tensors(cfg, dt, ckpt.tensors(native=native), f"checkpoint {path}", quant),
                           tok_cfg, tok, model, dt, quant)
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise FileNotFoundError(f"model {model!r} is neither a built-in model "
                                f"({', '.join([*BUILTIN_MODELS, *gguf_loader.BUILTIN_GGUF])}), a .gguf file, "
                                "nor a directory with a config.json")
    config_path = os.path.join(model, "config.json")
    hf = read_json(config_path)
    cfg = ModelConfig.from_hf(hf, config_path)
    # chat models often list extra stop ids (e.g. <|eot_id|>) only in generation_config.json
    extra = generation_eos_ids(os.path.join(model, "generation_config.json"), cfg.vocab_size)
    cfg = replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + extra)))
    if tokenizer:
        tok, tok_cfg = named_tokenizer(tokenizer, cfg, log)
    else:
        tok = load_tokenizer(model)
        check_token_ids(tok, cfg, f"the tokenizer of {model!r}")
        tok_cfg = with_tokenizer_eos(cfg, tok)
    dt = resolve_dtype(dtype, hf.get("dtype") or hf.get("torch_dtype"))
    quant = weight_quant_for(quantization, None)
    return LoadedModel(model_from_hf_tensors(cfg, dt, _safetensors_tensors(model), f"checkpoint {model}", quant),
                       tok_cfg, tok, model, dt, quant)


def check_token_ids(tokenizer: Any | None, cfg: ModelConfig, source: str) -> int:
    """The tokenizer's number of token ids (0: none). Its ids must have embedding rows: a
    vocabulary larger than the model's is refused; a smaller one is fine (the rows past it,
    often padding to a round vocab_size, are never produced by encoding)."""
    n = num_token_ids(tokenizer) if tokenizer is not None else 0
    if n > cfg.vocab_size:
        raise ValueError(f"{source}: its vocabulary has {n} token ids, more than the model's "
                         f"{cfg.vocab_size} embedding rows (vocab_size): ids {cfg.vocab_size}..{n - 1} would have "
                         "no embedding")
    return n


def with_tokenizer_eos(cfg: ModelConfig, tokenizer: Any | None) -> ModelConfig:
    """cfg with the tokenizer's eos_token_id as its first stop id (vLLM's primary EOS), the
    model's own (config.json's, generation_config.json's, a GGUF file's) beside it."""
    eos = getattr(tokenizer, "eos_token_id", None)
    own = (eos,) if isinstance(eos, int) and 0 <= eos < cfg.vocab_size else ()
    return replace(cfg, eos_token_ids=tuple(dict.fromkeys(own + cfg.eos_token_ids)))


def named_tokenizer(path: str, cfg: ModelConfig, log: Callable[[str], None] = print,
                    builtin: bool = False) -> tuple[Any, ModelConfig]:
    """--tokenizer's tokenizer for a model of `cfg`, and `cfg` with the stop ids that follow
    from it. Its ids must have embedding rows (check_token_ids). As vLLM, the tokenizer's
    eos_token_id is the primary EOS and the model's own stop ids (config.json's,
    generation_config.json's, a GGUF file's eos/eot/eom) stay beside it; a built-in random
    model's are its byte tokenizer's, which the named one replaces. The
    decoder keeps the model's own ModelConfig (the ids are not in its computation), so its
    step programs are those of the same model served without the flag."""
    tok = load_named_tokenizer(path)
    n = check_token_ids(tok, cfg, f"--tokenizer {path!r}")
    if builtin:
        cfg = replace(cfg, eos_token_ids=(), bos_token_id=tok.bos_token_id)
    cfg = with_tokenizer_eos(cfg, tok)
    log(f"tokenizer: {path} (--tokenizer; {n} token ids of the model's {cfg.vocab_size}, EOS ids "
        f"{list(cfg.eos_token_ids)})")
    return tok, cfg


def with_named_tokenizer(loaded: LoadedModel, path: str, log: Callable[[str], None] = print) -> LoadedModel:
    """A model already loaded (an orbax checkpoint, its own tokenizer with it) serving
    --tokenizer's instead."""
    builtin = isinstance(loaded.tokenizer, ByteTokenizer)  # a built-in random model, converted
    tok, cfg = named_tokenizer(path, loaded.config, log, builtin=builtin)
    return replace(loaded, tokenizer=tok, config=cfg)


def quantize_loaded(loaded: LoadedModel, quant: WeightQuant | None) -> LoadedModel:
    """A float model already in memory (a built-in model, an orbax checkpoint) with its
    linears quantized as `quant` says, through the same loading path as a checkpoint."""
    if quant is None:
        return loaded
    assert loaded.quant is None, "the model is quantized already"
    model = model_from_hf_tensors(loaded.config, loaded.dtype, hf_state_dict(loaded.model).items(),
                                  loaded.name, quant)
    return replace(loaded, model=model, quant=quant)


def hf_state_dict(model: Decoder) -> dict[str, np.ndarray]:
    """The model's weights under HF names and layouts (unstacked, torch [out, in])."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        w, x = declared_weight(path), np.asarray(var.get_value())
        if w.derived or x.dtype in (np.int8, np.uint8):
            raise ValueError("a model with quantized weights has no HF state dict (its float weights are gone)")
        for i, name in enumerate(hf_tensor_names(path, model.config.num_hidden_layers)):
            t = x[i] if w.stacked else x
            out[name] = np.ascontiguousarray(t.T if w.transposed else t)
    return out


def model_from_hf_tensors(cfg: ModelConfig, dtype: jnp.dtype, tensors: Iterable[tuple[str, Any]],
                          source: str = "the checkpoint", quant: WeightQuant | None = None) -> Decoder:
    """Build the model from (HF tensor name, array) pairs, the one loading path for every
    checkpoint format: per-layer tensors are copied into their layer of the stacked
    params; a quantized linear's tensor (float, or GGUF blocks: quant.GGUFBlocks) is
    encoded into its codes and scales one layer at a time, so no float copy of a
    quantized parameter is ever whole. Raises ValueError on an unexpected, misshapen or
    missing tensor."""
    # Build the module abstractly (no random init), then fill each param from the tensors.
    try:
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, dtype, quant, rngs=nnx.Rngs(0))))
    except ValueError as e:  # a size the quantization cannot hold (quant.QuantLinear's blocks of 32)
        raise ValueError(f"{source}: {e}") from None
    L = cfg.num_hidden_layers
    wanted: dict[str, tuple[tuple[Any, ...], int | None, bool]] = {}
    buffers: dict[tuple[Any, ...], np.ndarray] = {}
    variables = dict(nnx.to_flat_state(abstract))
    check_fits_in_host_memory(variables.values(), source)
    for p, var in variables.items():
        w = declared_weight(p)
        for i, name in enumerate(hf_tensor_names(p, L)):
            wanted[name] = (p, i if w.stacked else None, w.transposed)
        buffers[p] = np.empty(var.get_value().shape, var.get_value().dtype)
    # A quantized linear: its kernel's path -> its scheme
    schemes = {p: quant.scheme(".".join(map(str, p[:-1]))) for p in variables if quant and p[-1] == "kernel"}
    seen: set[str] = set()
    for name, x in tensors:
        if name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue  # derived from the config / a copy of the embedding
        if name not in wanted:
            raise ValueError(f"unexpected tensor {name!r} in {source}")
        if name in seen:  # in two shards: the one read last would win without a word
            raise ValueError(f"tensor {name!r} appears twice in {source}")
        p, layer, transpose = wanted[name]
        if not isinstance(x, GGUFBlocks) and not jnp.issubdtype(x.dtype, jnp.floating):
            # an integer or bool tensor would be cast to the weights' dtype without a word
            raise ValueError(f"tensor {name!r} in {source} has dtype {x.dtype}, not a floating-point type")
        # (layer, ...): a view even of a per-layer scalar (a per-tensor scale), where [layer] copies
        at = (lambda q: buffers[q]) if layer is None else (lambda q: buffers[q][layer, ...])
        scheme = schemes.get(p)
        if scheme is not None:
            lin = variables[p[:-1] + ("kernel",)].get_value().shape  # [(L,) in or in/2, out]
            want = (lin[-1], SCHEMES[scheme].input_features(lin[-2]))
            if tuple(x.shape) != want:
                raise ValueError(f"tensor {name!r} in {source} has shape {tuple(x.shape)}, expected {want}")
            for part, arr in encode(x, scheme).items():
                at(p[:-1] + (part,))[...] = arr
            seen.add(name)
            continue
        x = x.dequantize() if isinstance(x, GGUFBlocks) else np.asarray(x)
        dest = at(p)
        want = dest.shape[::-1] if transpose else dest.shape
        if x.shape != want:
            raise ValueError(f"tensor {name!r} in {source} has shape {x.shape}, expected {want}")
        dest[...] = (x.T if transpose else x).astype(dtype)
        seen.add(name)
    missing = [n for n in wanted if n not in seen]
    if missing:  # (a config with many more layers than the tensors have would list thousands)
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"{source} lacks tensors: {', '.join(missing[:8])}{more}")
    filled = [(p, var.replace(jnp.asarray(buffers[p]))) for p, var in variables.items()]
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def check_fits_in_host_memory(params: Iterable[Any], source: str) -> None:
    """The parameters a config describes are built on the host before they reach the
    device: a ValueError when they alone exceed its memory (a config.json with a vocab_size
    or num_hidden_layers the tensors do not have), not a MemoryError while allocating."""
    need = sum(math.prod(v.get_value().shape) * np.dtype(v.get_value().dtype).itemsize for v in params)
    have = host_memory_bytes()
    if need > have:
        raise ValueError(f"{source} describes {need / 2**30:,.1f} GiB of parameters, more than the "
                         f"host's {have / 2**30:.1f} GiB of memory: check its vocab_size, hidden_size, "
                         "intermediate_size and num_hidden_layers")


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(v, str) and v for v in weight_map.values()):
            raise ValueError(f"{index}: weight_map must map tensor names to shard file names, got {weight_map!r}"[:300])
        return [os.path.join(path, n) for n in sorted(set(weight_map.values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path} "
                            "(only safetensors checkpoints are supported)")


def _safetensors_tensors(path: str) -> Iterator[tuple[str, Any]]:
    """(HF name, array) for every tensor of a checkpoint directory, one at a time."""
    from safetensors import safe_open

    for file in _safetensors_files(path):
        try:
            st = safe_open(file, framework="flax")  # the flax reader handles bfloat16
        except Exception as e:  # SafetensorError (not a ValueError): truncated, or not safetensors
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
        with st:
            for name in st.keys():
                # named by the dtype the file stores: JAX, without 64-bit types, reads I64 as int32, F64 as float32
                stored = st.get_slice(name).get_dtype()
                if not stored.startswith(("F", "BF")):
                    raise ValueError(f"tensor {name!r} in {file} has dtype {stored}, not a floating-point type")
                try:
                    x = st.get_tensor(name)
                except (AttributeError, TypeError) as e:  # a dtype the reader has no array type for (F8_E4M3)
                    raise ValueError(f"tensor {name!r} in {file} does not read as an array (dtype {stored}; "
                                     f"{type(e).__name__}: {e})"[:300]) from None
                if not jnp.isfinite(x).all():  # as a GGUF file's (gguf_loader): every output would be NaN
                    if stored == "F64":
                        with safe_open(file, framework="numpy") as raw:
                            if np.isfinite(raw.get_tensor(name)).all():
                                raise ValueError(f"tensor {name!r} in {file} holds F64 values beyond float32's "
                                                 "range: they overflow float32, the dtype the engine loads it as")
                    raise ValueError(f"tensor {name!r} in {file} holds NaN or infinite values: the file is damaged")
                yield name, x
