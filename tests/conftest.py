"""Shared helpers: tiny random Hugging Face checkpoints (no hub access) and HF reference
outputs to compare against."""

from __future__ import annotations

import functools
import gc
import importlib.util
import json
import os
import shutil
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Callable, Iterator

# torch's OpenMP pool (the transformers references, transformers' own server) and
# OpenBLAS's (NumPy references) spin-wait for their threads between operations: on cores
# that the other test worker keeps busy, the tiny models' operations cost many times their
# work in spinning (6 x 40 greedy tokens of test_draft_model's 4-layer checkpoint: 17 CPU-s
# with torch's default 2 threads, 0.55 with one). The suite keeps every core busy with
# its own workers, so one thread each is as fast and costs only the work. Read when each
# library loads (OpenBLAS: with NumPy): set before the imports below, for this process and
# every subprocess it starts. XLA's CPU thread pool does not read it: the engine's steps
# are unchanged.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Every scheduler step checks the global invariants (slots, no KV block leaked, block
# coverage: scheduler.CHECK_ALL_INVARIANTS), which production skips for speed; server
# subprocesses inherit it. Set before any test module imports the scheduler.
os.environ["TAXIRANK_CHECK_INVARIANTS"] = "1"

# XLA:CPU's MLIR fusion emitters own most of a CPU compile (XLA's default since 2025): with
# the older LLVM-IR emitters the attention reference compiles in 0.55 CPU-s instead of 1.95
# (2.1 instead of 3.2 at full optimisation) and a cold warm-up of the SmolLM2-shaped engine
# takes 0.6-0.7x the CPU. A cold run (CI: an empty compilation cache) is mostly compiling,
# and tests time nothing. The engine keeps XLA's default: its steps run slower with the old
# emitters (decode at 32 sequences 11-21% more CPU, prefill and mixed steps 3-7%:
# docs/PERFORMANCE.md). XLA reads its flags once, when the backend starts, before any test runs:
# set here, before anything starts it, for this process and every subprocess it starts
# (servers, Ray replicas, tensor-parallel children, which add their own flags to these).
# The real-model files, whose steps compute for real, compile with XLA's default emitters
# (_compile_optimisation): there the old ones cost more than they save (smollm2's decode of
# one sequence takes 4x the CPU).
# XLA:CPU also splits each program's LLVM module into up to 32 parts compiled on threads of
# their own: on 2 cores that two test workers already keep busy, the threads gain no time and
# the split costs CPU. One part took 9-12% less CPU cold on the tiny model's files (each file alone,
# alternating: test_engine.py 39.9 -> 35.4 CPU-s, the means of four runs and of three,
# test_logprobs_mode.py 28.5 -> 26.0, test_kernels.py 23.7 -> 21.5; test_parallel.py's
# 8-device child 61.7 -> 54.1, the whole machine's), and about the same on the real model's
# (test_spec_decode_smollm2.py 77.7 -> 77.5). Set for subprocesses too, as the flag above.
_FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"
_ONE_CODEGEN_PART = "--xla_cpu_parallel_codegen_split_count=1"


def _names(flags: list[str], flag: str) -> bool:
    """Whether `flags` (XLA_FLAGS, split) set `flag`'s option already: a choice made there stands."""
    return any(f.partition("=")[0] == flag.partition("=")[0] for f in flags)


for _flag in (_FAST_COMPILE_FLAG, _ONE_CODEGEN_PART):
    if not _names(os.environ.get("XLA_FLAGS", "").split(), _flag):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# Small enough to build and run in well under a second; GQA (4 heads over 2 KV heads).
_BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
             initializer_range=0.1, bos_token_id=1, eos_token_id=2)

# family -> (transformers class names, config overrides). Between them: tied and untied
# embeddings, llama3 RoPE scaling, a (stored, inactive at these lengths) sliding window,
# q/k/v biases, Qwen3's qk-norm with a head_dim that is not hidden/heads.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama2": ("Llama", dict(rms_norm_eps=1e-5)),
    "llama3": ("Llama", dict(tie_word_embeddings=True, eos_token_id=[2, 3], max_position_embeddings=16384,
                             rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                  low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=64))),
    "mistral": ("Mistral", dict(sliding_window=1024)),
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3", dict(head_dim=32, num_key_value_heads=1)),
}


def make_hf_checkpoint(path: str | os.PathLike, family: str = "llama2", *, seed: int = 0, dtype: str = "float32",
                       max_shard_size: str | None = None, tokenizer: bool | str = False, **overrides: Any) -> str:
    """A random-weight HF checkpoint of `family` (see FAMILIES) saved as safetensors under
    `path`; returns the directory. `overrides` go to the transformers config. tokenizer:
    True for make_hf_tokenizer's byte-level BPE, "sp" for make_sp_tokenizer's."""
    import torch
    import transformers

    prefix, fam = FAMILIES[family]
    cfg = getattr(transformers, f"{prefix}Config")(**{**_BASE, **fam, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(cfg)
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb them so they are tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    model = model.to(getattr(torch, dtype)).eval()
    out = str(path)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kw)
    if tokenizer == "sp":
        make_sp_tokenizer(out)
    elif tokenizer:
        make_hf_tokenizer(out)
    return out


def make_hf_tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer (vocab <= 300, <unk>/<s>/</s> = 0/1/2) with a ChatML
    chat template, saved next to a checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            chat_template=template).save_pretrained(path)


def make_sp_tokenizer(path: str) -> None:
    """A SentencePiece-style tokenizer as transformers converts Llama 2's and Mistral's (vocab
    300, <unk>/<s>/</s> = 0/1/2, then the 256 byte-fallback pieces): "▁" marks a word's
    space, and a decode drops the space of its first piece."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Pieces and merges learnt from a sentence, then the byte pieces put before them (ordinary
    # tokens, as in Llama's vocabulary: a skipped special token would drop the byte).
    learnt = Tokenizer(models.BPE(unk_token="<unk>"))
    learnt.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    learnt.train_from_iterator(["the capital of France is Paris"] * 10, trainers.BpeTrainer(
        vocab_size=300 - 256, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    pieces = sorted(learnt.get_vocab().items(), key=lambda kv: kv[1])
    vocab = {p: i for i, (p, _) in enumerate(pieces[:3])} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {p: 259 + i for i, (p, _) in enumerate(pieces[3:])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(learnt.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = learnt.pre_tokenizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            add_bos_token=True).save_pretrained(path)


@functools.cache
def _hf_model(path: str) -> Any:
    """transformers' float32 model of the checkpoint at `path`, loaded once per session
    (checkpoints are read-only once built: a test that edits one builds its own)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(path: str, token_ids: list[int]) -> np.ndarray:
    """[len(token_ids), vocab] float32 logits of the checkpoint at `path`, run by transformers."""
    import torch

    with torch.no_grad():
        return _hf_model(str(path))(torch.tensor([token_ids])).logits[0].numpy()


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (ignoring eos), for end-to-end engine checks."""
    import torch

    with torch.no_grad():
        out = _hf_model(str(path)).generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                            min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                            pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def hf_rounded_reference(path: str, prompts: list[list[int]], max_new_tokens: int,
                         rounded: Callable[[str, np.ndarray], np.ndarray | None]) -> tuple[list, list, list]:
    """transformers on the checkpoint at `path`, a fresh float32 copy whose parameters
    `rounded(name, float64 weight)` maps (None: kept) are replaced by what it returns: each
    prompt's log-softmax [len, vocab] before and after the replacement, and the greedy
    continuations (ignoring eos) after it. The reference for a quantization method."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        floats = [torch.log_softmax(model(torch.tensor([p])).logits[0], -1).numpy() for p in prompts]
        for name, w in model.named_parameters():
            r = rounded(name, w.numpy().astype(np.float64))
            if r is not None:
                w.copy_(torch.from_numpy(np.asarray(r, np.float32)))
        want = [torch.log_softmax(model(torch.tensor([p])).logits[0], -1).numpy() for p in prompts]
        tokens = [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                  for p in prompts]
    return floats, want, tokens


def prompt_logprob_gap(outs: list, prompts: list[list[int]], logprobs: list[np.ndarray]) -> float:
    """The largest |engine prompt logprob - reference| over every prompt token after the
    first; `outs`: RequestOutputs asked for prompt_logprobs=0, `logprobs`: [len, vocab] each."""
    gaps = [np.abs(np.array([lp.logprob for lp in out.prompt_logprobs[1:]]) - lp[np.arange(len(p) - 1), p[1:]]).max()
            for out, p, lp in zip(outs, prompts, logprobs)]
    return float(max(gaps))


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory fixture: hf_checkpoint(family, **kw) -> path of a checkpoint built once per
    session for each (family, kw) and shared: treat it as read-only (a test that edits its
    files builds its own with make_hf_checkpoint)."""
    built: dict[tuple, str] = {}

    def get(family: str = "llama2", **kw: Any) -> str:
        key = (family, tuple(sorted(kw.items())))
        if key not in built:
            built[key] = make_hf_checkpoint(tmp_path_factory.mktemp(f"ckpt-{family}"), family, **kw)
        return built[key]
    return get


@pytest.fixture(scope="session")
def hf_server(hf_checkpoint):
    """One server of the llama2 checkpoint without a tokenizer (prompts and answers by
    token id) at test_server's HF_SMALL shapes, shared by every test that asks for it."""
    from test_server import API_KEY, HF_SMALL, running_server

    with running_server("--model", hf_checkpoint("llama2"), "--api-key", API_KEY, *HF_SMALL) as s:
        yield s


@pytest.fixture(scope="session")
def smollm2_layer_skip() -> str:
    """A cheap draft of smollm2 (draft_model.py's layer-skip): its first and last decoder
    layers with its embeddings, final norm and LM head, written once into the model cache
    beside smollm2 and kept between runs, as smollm2 itself is."""
    import gguf_loader
    from draft_model import write_layer_skip

    out = os.path.join(gguf_loader.cache_dir(), "smollm2-skip-0,29")
    if not os.path.isdir(out):
        try:
            write_layer_skip("smollm2", [0, 29], out, log=lambda _: None)
        except OSError:  # another worker renamed its copy into place first
            if not os.path.isdir(out):
                raise
    return out


@pytest.fixture
def smollm2_transformers() -> Any:
    """transformers' float32 model of smollm2's GGUF file (its own reader and
    dequantization: the reference the real-model tests compare against). Loading the GGUF
    takes transformers seconds of parsing and dequantizing, so its float32 tensors are
    written once into the model cache, beside smollm2, keyed by the transformers version
    (the tensors are its dequantization), and later loads read them back bit for bit."""
    import json
    import tempfile

    import safetensors.torch
    import torch
    import transformers

    import gguf_loader

    path = gguf_loader.resolve_builtin("smollm2", log=lambda _: None)
    out = os.path.join(gguf_loader.cache_dir(), f"smollm2-transformers-{transformers.__version__}")
    if not os.path.isdir(out):
        # transformers builds gguf's tensor-name map anew for each of the model's 397 modules,
        # the same read-only map each time: 4.4 of its 8 CPU-s of loading (the file parsed
        # already). Built once here; the tensors it loads are the same.
        import gguf

        name_map = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.cache(name_map)
        try:
            ref = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                                    gguf_file=os.path.basename(path),
                                                                    dtype=torch.float32).eval()
        finally:
            gguf.get_tensor_name_map = name_map
        tmp = tempfile.mkdtemp(dir=gguf_loader.cache_dir(), prefix=".smollm2-transformers-")
        config = ref.config.to_dict()
        config.pop("quantization_config")  # the GGUF file's: the tensors written are plain float32
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        safetensors.torch.save_model(ref, os.path.join(tmp, "model.safetensors"))  # tied embeddings stored once
        try:
            os.rename(tmp, out)
        except OSError:  # another worker renamed its copy into place first
            shutil.rmtree(tmp)
            if not os.path.isdir(out):
                raise
        return ref
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as module bench_<name> (bench/ is scripts, not a package); loaded
    once per session."""
    mod_name = f"bench_{name}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, os.path.join(ROOT, "bench", f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod  # dataclasses look their module up while the file runs
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[mod_name]
            raise
    return sys.modules[mod_name]


@contextmanager
def count_compilations() -> Iterator[list[str]]:
    """XLA compilations as JAX itself reports them (its backend-compile event, which fires
    for every program handed to the compiler, persistent-cache hits included), not the
    engine's own count: yields the list of compiled function names, filled while inside."""
    from jax import monitoring

    names: list[str] = []

    def on_duration(event: str, duration: float, **kw: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(str(kw.get("fun_name")))

    monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield names
    finally:
        monitoring.unregister_event_duration_listener(on_duration)


@contextmanager
def pinned_decode_buckets(pin: Callable[[Any], tuple[int, ...] | None]) -> Iterator[None]:
    """While up, an EngineConfig whose decode buckets are first read gets pin(config)'s (None:
    its own), and keeps them (a cached property): fewer decode programs for tests whose tokens
    and counters are the same at any padding."""
    import config

    own = config.EngineConfig.__dict__["decode_buckets"]
    pinned = functools.cached_property(lambda cfg: pin(cfg) or own.func(cfg))
    pinned.__set_name__(config.EngineConfig, "decode_buckets")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(config.EngineConfig, "decode_buckets", pinned)
        yield


def fresh_step_programs() -> None:
    """Engines built after this compile programs of their own, as in a new process (engines
    in one process share their programs by key): for a test that counts what one engine
    compiles, or that nothing compiles after its warm-up."""
    import compilation

    compilation.clear_program_caches()


@contextmanager
def tiny_async_engine(tokenizer: Any = None, **config: Any) -> Iterator[tuple[Any, Any]]:
    """(event loop, started AsyncEngine) on the tiny model in test_request_metrics' shapes
    (its programs are cached), shut down on exit. tokenizer: one to render chats with
    instead of the engine's own; config: more EngineConfig fields, or other shapes."""
    import asyncio

    from async_engine import AsyncEngine
    from engine import EngineConfig

    loop = asyncio.new_event_loop()
    shapes = {"model": "tiny", "max_num_seqs": 2, "max_model_len": 128, "warmup": False}
    engine = AsyncEngine(EngineConfig(**shapes | config), log=lambda *_: None)
    if tokenizer is not None:
        engine.tokenizer = tokenizer
    loop.run_until_complete(engine.start())
    try:
        yield loop, engine
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()


def jax_test_cache_dir() -> str:
    """The tests' persistent compilation cache: kept between runs (a compile is the
    biggest cost of a CPU test run, and the same small shapes recur in every run), beside
    the user's model cache, keyed by the jaxlib version, since a cache written by another
    XLA is never read back. Separate from the engine's default ~/.cache/taxirank/jax so
    that tests never fill a user's serving cache, and the tests that need a cold cache
    (restarts) make their own."""
    import jaxlib

    root = os.environ.get("TAXIRANK_CACHE") or os.path.expanduser("~/.cache/taxirank")
    return os.path.join(root, f"jax-tests-{jaxlib.__version__}")


# Hypothesis: the same examples on every run (derandomized), so a red suite is red for
# the same reason when rerun. `pytest --hypothesis-profile=explore` draws new ones.
settings.register_profile("derandomized", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("derandomized")


# The test files that take longest cold (an empty compilation cache, as on CI, where the
# suite's time is mostly compiling), slowest first: each file's wall time measured alone
# with a cache of its own, on 2 busy cores. xdist hands out whole files (--dist loadfile) in
# collection order (--no-loadscope-reorder: its default order is by test count, which put
# these few-test files last), one to each worker as it frees: longest first leaves only
# short files for the end, so the workers finish together instead of one waiting out
# another's last long file. (Warm, the compile-bound files shrink most; the order still
# holds the long ones first. test_structured_smollm2 measured as long as test_perplexity,
# warm, in one process with the other smollm2 files: 118-156 s against 131-160 s.)
SLOWEST_FIRST = ["test_kernels", "test_parallel", "test_perplexity", "test_structured_smollm2", "test_serve_ray",
                 "test_spec_decode_smollm2", "test_spec_decode", "test_draft_model", "test_engine", "test_bench_offline",
                 "test_hostile",
                 "test_async_scheduling", "test_real_model", "test_simulate", "test_kvcache", "test_recipes_model",
                 "test_stop_strings_smollm2", "test_sampling_controls", "test_api_extras", "test_server", "test_bench_mixed", "test_stutter", "test_serving_path", "test_kv_quant",
                 "test_structured", "test_policy", "test_request_metrics", "test_metrics",
                 "test_fair_slo", "test_prefix_cache", "test_prompt_logprobs", "test_server_concurrency",
                 "test_quant", "test_semantics", "test_restart", "test_real_model_server", "test_compilation",
                 "test_model"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {f"tests/{name}.py": i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest as collected


def pytest_collection_finish(session: pytest.Session) -> None:
    # What the test modules' imports built (JAX, transformers, torch) lives for the whole
    # run: frozen, as server.py freezes its start-up heap, the collector never walks it again.
    gc.collect()
    gc.freeze()


def pytest_configure(config: pytest.Config) -> None:
    # Python's cyclic collector: a young collection every 700 allocations (its default)
    # promotes the many short-lived objects of a trace or a compile, and then full
    # collections walk every object a test process holds (JAX's caches of traces and
    # programs grow all run). At every 50,000, with the imports' objects frozen
    # (pytest_collection_finish), the two workers of a cold run spent 20.5 CPU-s collecting
    # instead of 49.8 (gc.callbacks; 35 full collections instead of 91). A test that needs
    # garbage gone calls gc.collect() itself.
    gc.set_threshold(50_000, 20, 20)
    # Many tests build an engine on the same small shapes: with a persistent compilation
    # cache every compile after the first (in this run or any earlier one) is a cache hit
    # (traces still count). Server subprocesses share it through JAX's environment
    # variables (the engine leaves a directory already chosen).
    cache = jax_test_cache_dir()
    os.makedirs(cache, exist_ok=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    os.environ.setdefault(_CHEAP_COMPILES, "1")  # =0: every file at full optimisation
    import jax

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update(_CHEAP_COMPILES.lower(), os.environ[_CHEAP_COMPILES].lower() not in ("0", "false", "no", "off"))
    # Parsing a GGUF file walks every metadata array in Python (about 2 s for smollm2's
    # vocabulary), and the tests load smollm2 many times in one process: here each version
    # of a file (path, size, modification time) is parsed once per test process. A server
    # loads its model once, so the engine itself parses once per load and keeps nothing.
    import gguf

    gguf.GGUFReader = _parsed_once_per_version(gguf.GGUFReader)
    # Building a model from a GGUF file dequantizes and stacks every tensor (2-3 CPU-s for
    # smollm2 with the file parsed), and most real-model engines in one test process load
    # the same file the same way: engines (startup.build_engine) get the last GGUF model
    # loaded in this process again when the file and the loading arguments are the same.
    # The weights are immutable arrays that no engine donates, so engines can share them.
    # model_loader.load_model itself, which the loader's own tests call, is left as it is.
    import startup

    startup.load_model = _gguf_loaded_once(startup.load_model)
    # XLA's flags are read once per process, but a compile's own options can override them:
    # the real-model files' compiles take _REAL_MODEL_OVERRIDES. The hook is JAX's private
    # API: a JAX without it runs those files, slower, with this process's flags.
    from jax._src import compiler

    if hasattr(compiler, "get_compile_options"):
        compiler.get_compile_options = _with_real_model_overrides(compiler.get_compile_options)


# Set by _compile_optimisation while a real-model file runs: the XLA options its compiles
# (in this process) take, as its subprocesses do through XLA_FLAGS.
_REAL_MODEL_OVERRIDES: list[tuple[str, Any]] = []


def _with_real_model_overrides(get_compile_options: Callable[..., Any]) -> Callable[..., Any]:
    def compile_options(*args: Any, **kw: Any) -> Any:
        options = get_compile_options(*args, **kw)
        if _REAL_MODEL_OVERRIDES:  # part of the persistent cache's key, as any override
            options.env_option_overrides = [*options.env_option_overrides, *_REAL_MODEL_OVERRIDES]
        return options

    return compile_options


def _gguf_loaded_once(load: Callable[..., Any]) -> Callable[..., Any]:
    last: dict[tuple, tuple[Any, list[str]]] = {}  # one entry: a model holds hundreds of MB

    def loaded(model: str, dtype: str = "float32", seed: int = 0, log: Callable[[str], None] = print,
               quantization: str | None = None, tokenizer: str | None = None) -> Any:
        import gguf_loader

        if model in gguf_loader.BUILTIN_GGUF:
            path = gguf_loader.resolve_builtin(model, log)
        elif model.endswith(".gguf") and os.path.isfile(model):
            path = model
        else:
            return load(model, dtype, seed, log=log, quantization=quantization, tokenizer=tokenizer)
        st = os.stat(path)
        key = (model, os.path.realpath(path), st.st_size, st.st_mtime_ns, dtype, seed, quantization, tokenizer)
        if key not in last:
            last.clear()
            lines: list[str] = []
            result = load(model, dtype, seed, log=lambda line: (lines.append(line), log(line)), quantization=quantization,
                          tokenizer=tokenizer)
            last[key] = (result, lines)
            return result
        result, lines = last[key]
        for line in lines:  # what the load said, said again
            log(line)
        return result

    return loaded


def _parsed_once_per_version(reader_cls: type) -> Callable[..., Any]:
    @functools.lru_cache(maxsize=4)
    def parsed(path: str, size: int, mtime_ns: int) -> Any:
        return reader_cls(path)

    def reader(path: str, *args: Any, **kw: Any) -> Any:
        if args or kw:  # another mode than reading: not kept
            return reader_cls(path, *args, **kw)
        st = os.stat(path)
        return parsed(os.path.realpath(path), st.st_size, st.st_mtime_ns)

    return reader


# The tiny models' steps compute next to nothing, but each of their programs costs seconds
# of XLA's optimisation: a cold run (CI: an empty cache) spends most of its time there.
# JAX's jax_disable_most_optimizations (XLA backend optimisation level 0, no expensive LLVM
# passes) takes about 40% off their compile time (measured, one process, cold:
# test_compilation.py 49 -> 34 CPU-s, test_engine.py 129 -> 98; warm, their steps run
# slower: test_engine.py 39 -> 44); subprocesses (servers, Ray replicas, TP children)
# inherit it through the environment. It is read at each compile (and keys the persistent
# cache), so the files that run the real model, whose steps compute for real (one 2,048-token
# prefill: +5% CPU cold with its compiles), compile at full optimisation, and with XLA's
# default emitters (_FAST_COMPILE_FLAG): in this process and in the subprocesses they start.
# Full optimisation there is XLA's backend level 1 rather than its default 3 (LLVM's O1
# rather than O3 over the code XLA generates): those files' compiles and steps together
# take less CPU. Measured with an empty cache, /usr/bin/time's CPU-s:
# the four in-process real-model files in one process (test_perplexity,
# test_spec_decode_smollm2, test_structured_smollm2, test_real_model) 211 and 190 at
# level 3, 192 at 2, 182, 174 and 183 at 1; the four that start servers or children
# (test_serving_path, test_real_model_server, test_stop_strings_smollm2,
# test_tokenizer_flag_smollm2) 77.7 and 82.4 at 3, 70.1 and 73.9 at 1. Level 0 made
# test_perplexity's prefills slow (119 CPU-s against 74 at level 3).
# The settings are per file (a module's fixtures compile before any one test's setup could
# change them), so a concept tested on both models keeps its tiny tests in one file and its
# smollm2 tests in a `_smollm2` file of their own.
_CHEAP_COMPILES = "JAX_DISABLE_MOST_OPTIMIZATIONS"
_REAL_MODEL_OPT_LEVEL = "--xla_backend_optimization_level=1"
REAL_MODEL_FILES = {"test_perplexity", "test_real_model", "test_real_model_server", "test_serving_path",
                    "test_spec_decode_smollm2", "test_structured_smollm2", "test_stop_strings_smollm2",
                    "test_tokenizer_flag_smollm2"}


def env_without_test_cache() -> dict[str, str]:
    """This process's environment without the tests' JAX cache settings (JAX_*, but for the
    compile optimisation), for a subprocess that starts from a compilation cache of its own."""
    return {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k == _CHEAP_COMPILES}


@pytest.fixture(autouse=True, scope="module")
def _compile_optimisation(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.module.__name__.rpartition(".")[2] not in REAL_MODEL_FILES:
        yield
        return
    import jax

    # The settings do not key JAX's in-memory executables, which engines in one process
    # share (compilation.step_programs): each side of the switch starts without the other's.
    env, cheap = os.environ[_CHEAP_COMPILES], jax.config.read(_CHEAP_COMPILES.lower())
    xla_flags = os.environ.get("XLA_FLAGS")
    os.environ[_CHEAP_COMPILES] = "0"
    jax.config.update(_CHEAP_COMPILES.lower(), False)
    flags = (xla_flags or "").split()
    # Where XLA_FLAGS chose already, its choice stands.
    if _FAST_COMPILE_FLAG in flags:
        _REAL_MODEL_OVERRIDES.append(("xla_cpu_use_fusion_emitters", True))
    if not _names(flags, _REAL_MODEL_OPT_LEVEL):
        _REAL_MODEL_OVERRIDES.append(("xla_backend_optimization_level", int(_REAL_MODEL_OPT_LEVEL.partition("=")[2])))
        flags.append(_REAL_MODEL_OPT_LEVEL)
    os.environ["XLA_FLAGS"] = " ".join(f for f in flags if f != _FAST_COMPILE_FLAG)
    fresh_step_programs()
    try:
        yield
    finally:
        os.environ[_CHEAP_COMPILES] = env
        jax.config.update(_CHEAP_COMPILES.lower(), cheap)
        if xla_flags is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = xla_flags
        _REAL_MODEL_OVERRIDES.clear()
        fresh_step_programs()
