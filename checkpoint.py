"""Converted, sharded parameters in an orbax checkpoint: fast restarts, straight onto the mesh.

    python checkpoint.py convert SRC DST [--dtype bfloat16]

SRC is anything `--model` takes (a built-in model, an HF safetensors directory, a GGUF file,
whose quantized weights are dequantized: a checkpoint holds float weights); DST gets
the parameters already in taxirank's layout (stacked layers, [in, out] kernels, cast to
the dtype) as one orbax array per parameter, plus taxirank_checkpoint.json (the
ModelConfig and dtype), the tokenizer and SRC's generation_config.json. `--model DST`
then restores each parameter with its target sharding, so every device reads only its
own slice from disk (tensorstore): no full copy of the model on one device or host, and
no conversion at start-up. The KV head copies tensor parallelism may need are made after
loading (parallel.shard_model), so a checkpoint loads onto any tensor-parallel size,
whatever size it was saved from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from hf_config import check_hf_config, check_llama3_rope, read_json, token_ids
from model import FAMILIES, LLAMA3_ROPE_KEYS, Decoder, ModelConfig
from model_loader import LoadedModel, check_token_ids, load_model, resolve_dtype
from tokenizer import ByteTokenizer, load_tokenizer

META = "taxirank_checkpoint.json"
_FORMAT = 1


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


def _key(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def save(loaded: LoadedModel, dst: str) -> None:
    """Write loaded's parameters (as loaded: no tensor-parallel KV head copies) to dst."""
    import orbax.checkpoint as ocp

    if loaded.quant is not None:  # the orbax layout holds float parameters; quantize when loading
        raise ValueError("checkpoint convert saves float weights; pass --quantization when serving the result")
    if not dst:  # (abspath would make it the working folder)
        raise ValueError("the destination folder's path is empty")
    dst = os.path.abspath(dst)
    if os.path.isdir(dst) and os.listdir(dst):
        raise FileExistsError(f"{dst} exists and is not empty")
    os.makedirs(dst, exist_ok=True)  # an OSError here is one line; orbax's own would log its thread's traceback
    params = {_key(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(loaded.model, nnx.Param))}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(dst, "params"), params)
    tok = loaded.tokenizer
    if hasattr(tok, "save_pretrained"):
        tok.save_pretrained(dst)
    generation = os.path.join(loaded.name, "generation_config.json")
    if os.path.isfile(generation):  # the sampling defaults --generation-config auto reads from the model folder
        shutil.copy(generation, dst)
    meta = dict(format=_FORMAT, source=loaded.name, dtype=np.dtype(loaded.dtype).name,
                tokenizer="byte" if isinstance(tok, ByteTokenizer) else "hf" if tok is not None else None,
                model_config=dataclasses.asdict(loaded.config))
    with open(os.path.join(dst, META), "w") as f:
        json.dump(meta, f, indent=1)


def _read_meta(path: str) -> tuple[dict[str, Any], ModelConfig]:
    meta = read_json(os.path.join(path, META))  # a ValueError naming the file unless a JSON object
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, this taxirank reads {_FORMAT}")
    if not isinstance(meta.get("model_config"), dict):
        raise ValueError(f"{path}/{META}: model_config must be an object, got {meta.get('model_config')!r}"[:300])
    d = dict(meta["model_config"])
    try:
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = tuple((str(k), float(v)) for k, v in d["rope_scaling"])
        d["eos_token_ids"] = token_ids(d.get("eos_token_ids"), "eos_token_ids")  # not int(): "257" is no (2, 5, 7)
        cfg = ModelConfig(**d)
        kinds = {"int": int, "float": (int, float), "bool": bool, "str": str}
        for f in dataclasses.fields(ModelConfig):
            v = getattr(cfg, f.name)
            if f.type in kinds and (not isinstance(v, kinds[f.type]) or (f.type != "bool" and isinstance(v, bool))):
                raise ValueError(f"{f.name} must be {f.type}, got {v!r}")
        # the checks a config.json gets (sizes, heads, RoPE, eps, window, special ids), on the same fields
        if cfg.architecture not in FAMILIES:
            raise ValueError(f"architecture {cfg.architecture!r} is none of {', '.join(FAMILIES)}")
        check_hf_config({**dataclasses.asdict(cfg), "rope_scaling": None, "eos_token_id": list(cfg.eos_token_ids)},
                        "model_config")
        if cfg.rope_scaling is not None:
            scaling = dict(cfg.rope_scaling)
            if sorted(scaling) != sorted(LLAMA3_ROPE_KEYS):
                raise ValueError(f"rope_scaling must give {', '.join(LLAMA3_ROPE_KEYS)}, got {sorted(scaling)}")
            old = scaling["original_max_position_embeddings"]  # kept as a float, as every scaling value
            check_llama3_rope({**scaling, "original_max_position_embeddings": int(old) if old.is_integer() else old},
                              "model_config")
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}/{META}: bad model_config ({e})") from None
    if meta.get("dtype") not in ("float32", "bfloat16"):
        raise ValueError(f"{path}/{META}: dtype must be float32 or bfloat16, got {meta.get('dtype')!r}")
    return meta, cfg


def load(path: str, dtype: str = "auto", mesh: Mesh | None = None) -> LoadedModel:
    """Restore a converted checkpoint, each parameter directly with its target sharding
    (split over `mesh` as parallel.load_spec says, or on the default device). dtype
    "auto" keeps the saved dtype; another casts while restoring."""
    import orbax.checkpoint as ocp

    from parallel import load_spec

    path = os.path.abspath(path)
    meta, cfg = _read_meta(path)
    dt = resolve_dtype(dtype, meta["dtype"])
    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, dt, rngs=nnx.Rngs(0))), nnx.Param)

    def target(p: tuple[Any, ...], shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
        if mesh is None:
            sharding = SingleDeviceSharding(jax.devices()[0])
        else:
            sharding = NamedSharding(mesh, load_spec(p, cfg, mesh.size))
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    flat = nnx.to_flat_state(abstract)
    want = {_key(p): target(p, v.get_value().shape) for p, v in flat}
    with ocp.StandardCheckpointer() as ckptr:
        try:
            got = ckptr.restore(os.path.join(path, "params"), want)
        except (ValueError, KeyError) as e:  # a tree or shape that does not match the config
            raise ValueError(f"{path}: parameters do not match its {META} ({e})") from None
        except Exception as e:  # tensorstore's failed read of an array's data, wrapped in a bare Exception
            if type(e) is not Exception:  # anything else (out of memory, ...) is what it says
                raise
            raise ValueError(f"{path}: its parameters do not read, the checkpoint is damaged "
                             f"({e.__cause__ or e})"[:500]) from None
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, dt, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, nnx.from_flat_state([(p, v.replace(got[_key(p)])) for p, v in flat]))
    if meta.get("tokenizer") == "byte":
        tok = ByteTokenizer()
    else:  # its files, read from the folder as a config.json folder's are: their ids checked as there
        tok = load_tokenizer(path)
        check_token_ids(tok, cfg, f"the tokenizer of {path!r}")
    return LoadedModel(model, cfg, tok, path, dt)


def seed_arg(value: str) -> int:
    """--seed: a 64-bit integer, as the server's (a PRNG key holds no more)."""
    try:
        seed = int(value)
    except ValueError:  # (past 4,300 digits too)
        raise argparse.ArgumentTypeError(f"expected an integer, got {value[:100]!r}") from None
    if not -2**63 <= seed < 2**63:
        raise argparse.ArgumentTypeError(f"must be a 64-bit integer, got {value[:100]}")
    return seed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="convert a model to an orbax checkpoint of taxirank's parameters")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="load SRC (a built-in model, an HF directory or a .gguf file, "
                           "dequantized), save it to DST")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    c.add_argument("--seed", type=seed_arg, default=0, help="weights seed of a built-in model")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        loaded = load_model(args.src, args.dtype, args.seed)
        save(loaded, args.dst)
    except (ValueError, OSError) as e:  # a bad source or destination: one line, as server.py's
        p.exit(2, f"{p.prog}: error: {e}\n")
    n = sum(x.size for x in jax.tree.leaves(nnx.state(loaded.model, nnx.Param)))
    print(f"saved {args.src} ({n:,} parameters, {np.dtype(loaded.dtype).name}) to {args.dst} "
          f"in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
