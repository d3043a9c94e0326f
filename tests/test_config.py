"""Engine options where they enter: EngineConfig (LLM(...) keyword arguments reach it
without argparse), server.py's flags and a `--config` YAML file. Each bad value is a
ValueError (or the parser's exit 2) naming the option, before any model is loaded."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import cli_args
import compilation
import config_file
import server
import kvcache
import runner
from config import EngineConfig, host_memory_bytes
from llm import LLM


@pytest.mark.parametrize("kwargs, says", [
    (dict(max_num_seqs=2.5), "max_num_seqs must be an integer"),
    (dict(max_num_seqs=True), "max_num_seqs must be an integer"),  # True is not a count
    (dict(block_size=16.0), "block_size must be an integer"),  # else a TypeError from `&`, naming nothing
    (dict(block_size=512), "block_size must be a power of two up to 256"),  # else a 32 GiB cache for tiny
    (dict(max_model_len=1.5), "max_model_len must be an integer or None"),
    (dict(num_kv_blocks=2.5), "num_kv_blocks must be an integer or None"),
    (dict(kv_cache_memory=float("nan")), "kv_cache_memory must be an integer or None"),
    (dict(gpu_memory_utilization=float("inf")), "gpu_memory_utilization must be a finite number"),
    (dict(swap_space=10**400), "swap_space must be a finite number"),  # else an OverflowError from isfinite
    (dict(seed=2**70), "seed must be a 64-bit integer"),  # else an OverflowError inside JAX's PRNG
    (dict(seed=1.5), "seed must be an integer"),
    # every count: else an OverflowError from the KV and host-buffer sizing's GiB, naming nothing
    (dict(num_kv_blocks=10**400), "num_kv_blocks must be a 64-bit integer, got an integer of 1329 bits"),
    (dict(max_num_seqs=2**63), "max_num_seqs must be a 64-bit integer, got 9223372036854775808"),
    (dict(kv_cache_memory=-(2**63) - 1), "kv_cache_memory must be a 64-bit integer"),
    (dict(warmup="yes"), "warmup must be a boolean"),
    (dict(enable_chunked_prefill="no"), "enable_chunked_prefill must be a boolean"),
    (dict(compilation_cache_dir=5), "compilation_cache_dir must be a string or None"),
    (dict(model=5), "model must be a string"),
    (dict(max_waiting_requests=1.5), "max_waiting_requests must be an integer or None"),
    (dict(preemption_mode="swap", swap_space=1e6), "swap_space 1e\\+06 GiB is too large"),  # vLLM's 70% rule
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold must be >= 0"),
    (dict(long_prefill_token_threshold=1.5), "long_prefill_token_threshold must be an integer"),
    # a port of another script's digits (which int() reads), or past int()'s 4,300 digits
    (dict(distributed_coordinator="h:١٢", num_processes=2, tensor_parallel_size=2),
     "distributed_coordinator must be HOST:PORT, got 'h:١٢'"),
    (dict(distributed_coordinator="h:" + "1" * 5000, num_processes=2, tensor_parallel_size=2),
     "distributed_coordinator must be HOST:PORT"),
    (dict(long_prefill_token_threshold=64, enable_chunked_prefill=False),
     "long_prefill_token_threshold \\(64\\) caps a prompt's chunk: it needs chunked prefill"),
])
def test_a_bad_engine_option_is_a_value_error_naming_it(kwargs, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(**kwargs)


def test_dtype_takes_vllms_float_for_float32_and_says_why_float16_is_refused():
    """vLLM's ModelDType (vllm/config/model.py): auto, half, float16, bfloat16, float, float32."""
    assert EngineConfig(dtype="float").dtype == "float32"
    assert cli_args.engine_config(cli_args.build_parser().parse_args(["--dtype", "float"])).dtype == "float32"
    for name in ("half", "float16"):
        with pytest.raises(ValueError, match=f"got '{name}'; float16 is not run here .*: use bfloat16"):
            EngineConfig(dtype=name)


def test_numpy_integers_and_bools_are_accepted_and_become_plain_python_values():
    c = EngineConfig(max_num_seqs=np.int64(4), block_size=np.int32(8))
    assert (c.max_num_seqs, c.block_size) == (4, 8) and type(c.max_num_seqs) is int and hash(c)
    c = EngineConfig(warmup=np.bool_(False), enable_prefix_caching=np.bool_(True))
    assert type(c.warmup) is bool and c.warmup is False and c.enable_prefix_caching is True and hash(c)
    assert EngineConfig(swap_space=1e6).swap_space == 1e6  # no host pool under recompute: no limit


def test_an_explicit_kv_cache_that_cannot_fit_is_refused_naming_the_flag_before_allocation():
    have = kvcache.device_memory_bytes()
    if jax.default_backend() == "cpu":  # the CPU "device" is the host (a container's limit, if lower)
        assert have == host_memory_bytes() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    model = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=4, head_dim=8)  # what sizing reads
    per_block = kvcache.kv_cache_bytes_per_block(model, 16, np.float32)

    def blocks(**kw) -> int:
        config = EngineConfig(max_model_len=256, **kw).resolved(4096)
        return kvcache.num_kv_blocks_for(config, model, np.float32, weight_bytes=have // 8)

    fits = have // 4 // per_block
    assert blocks(num_kv_blocks=fits) == fits
    with pytest.raises(ValueError, match=r"--num-kv-blocks/--num-gpu-blocks-override \d+: a KV cache of \d+ blocks "
                                         r"takes .* GiB"):
        blocks(num_kv_blocks=fits * 4)  # with the weights, past the device's memory
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        blocks(kv_cache_memory=have)


def test_server_refuses_an_unusable_port_host_or_shutdown_timeout_before_loading_the_model(capsys):
    for flags, says in [(["--port", "70000"], "--port must be in 0..65535"),
                        (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' does not resolve"),
                        # a stream that never ends would hold the shutdown forever
                        (["--shutdown-timeout", "inf"], "--shutdown-timeout must be a finite number of seconds"),
                        (["--shutdown-timeout", "nan"], "--shutdown-timeout must be a finite number of seconds")]:
        with pytest.raises(SystemExit) as exit_:  # model "/nowhere" would fail later: these come first
            server.main(["--model", "/nowhere", *flags])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    # "" is every interface (asyncio, aiohttp, vLLM): it resolves, and the model is what fails
    with pytest.raises(SystemExit) as exit_:
        server.main(["--model", "/nowhere", "--host", ""])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "does not resolve" not in err and "/nowhere" in err


@pytest.mark.parametrize("flag", ["--num-kv-blocks", "--kv-cache-memory", "--max-num-batched-tokens", "--max-num-seqs"])
def test_server_exits_on_a_count_past_64_bits_naming_it(capsys, flag):
    with pytest.raises(SystemExit) as exit_:  # refused by EngineConfig: model "/nowhere" is never read
        server.main(["--model", "/nowhere", flag, "1" * 400])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{flag[2:].replace('-', '_')} must be a 64-bit integer, got an integer of " in err


@pytest.mark.parametrize("value, want", [("32k", 32_000), ("32K", 32 * 1024), ("25.6k", 25_600), ("1.001k", 1001),
                                         ("2M", 2 * 2**20), ("3g", 3 * 10**9), ("1T", 2**40), (" 4k ", 4000),
                                         ("77", 77)])
@pytest.mark.parametrize("flag, field", [("--max-model-len", "max_model_len"),
                                         ("--max-num-batched-tokens", "max_num_batched_tokens"),
                                         ("--kv-cache-memory-bytes", "kv_cache_memory")])
def test_vllms_size_flags_take_its_human_readable_integers(value, want, flag, field):
    """vLLM's human_readable_int (vllm/engine/arg_utils.py): k, m, g, t multiply by powers of
    1000, K, M, G, T by powers of 1024."""
    assert getattr(cli_args.build_parser().parse_args([flag, value]), field) == want


@pytest.mark.parametrize("value, says", [("1.5K", "a decimal does not take a binary suffix (K), got '1.5K'; "
                                                 "did you mean 1.5k?"),
                                         ("32kb", "expected an integer, or one such as 32k or 32K, got '32kb'"),
                                         ("1e3", "expected an integer")])
def test_a_size_flag_that_is_no_human_readable_integer_exits_naming_it(capsys, value, says):
    with pytest.raises(SystemExit) as exit_:
        cli_args.build_parser().parse_args(["--max-model-len", value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument --max-model-len: {says}" in err


# ---- --config FILE ------------------------------------------------------------------

def parse(tmp_path, text: str, *argv: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return config_file.parse_args(cli_args.build_parser(), ["--config", str(path), *argv])


def test_a_config_file_sets_flags_as_typed_and_the_command_line_wins(tmp_path):
    args = parse(tmp_path, "model: tiny\nmax-model-len: 128\nmax_num_seqs: 4\nenable-prefix-caching: false\n"
                           "served-model-name: [a, b]\nmax-waiting-requests: null\n"
                           "speculative-config: {method: ngram, num_speculative_tokens: 2}\n",
                 "--max-num-seqs", "8")
    c = cli_args.engine_config(args)
    assert (c.model, c.max_model_len, c.max_num_seqs, c.enable_prefix_caching) == ("tiny", 128, 8, False)
    assert args.served_model_name == ["a", "b"] and c.max_waiting_requests is None
    assert c.speculative_config.method == "ngram" and c.speculative_config.num_speculative_tokens == 2
    assert parse(tmp_path, "").max_num_seqs == EngineConfig().max_num_seqs  # an empty file sets nothing
    # vLLM's flag, from the EngineConfig field; 0 (vLLM's default) caps nothing
    assert cli_args.engine_config(parse(tmp_path, "", "--long-prefill-token-threshold", "256")) \
        .long_prefill_token_threshold == 256
    assert EngineConfig().long_prefill_token_threshold == 0


def test_a_config_files_mapping_is_the_json_of_every_json_flag(tmp_path):
    args = parse(tmp_path, "override-generation-config: {temperature: 0.5}\n"
                           "speculative-config: {method: ngram, num_speculative_tokens: 2}\n")
    assert json.loads(args.override_generation_config) == {"temperature": 0.5}
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 2}


def test_a_config_files_no_spelling_of_a_switch_takes_false_as_the_switch(tmp_path):
    """`no-enable-log-requests: false` is --enable-log-requests, not a --no-no-... flag
    nobody wrote."""
    assert parse(tmp_path, "no-enable-log-requests: false\n").enable_log_requests is True
    assert parse(tmp_path, "no-enable-log-requests: true\n").enable_log_requests is False
    assert parse(tmp_path, "no-enable-log-requests: false\n", "--no-enable-log-requests").enable_log_requests \
        is False  # the command line wins


def test_a_config_files_value_that_starts_with_a_dash_is_the_flags_value(tmp_path):
    """An API key or a name such as "-k1", which argparse would take for a flag ("expected
    one argument"), alone or as a one-item list."""
    args = parse(tmp_path, "api-key: -k1\nresponse-role: -bot\nmax-num-seqs: -3\n")
    assert (args.api_key, args.response_role, args.max_num_seqs) == (["-k1"], "-bot", -3)
    args = parse(tmp_path, "api-key: [-k1]\nserved-model-name: [-bot]\n")
    assert (args.api_key, args.served_model_name) == (["-k1"], ["-bot"])


@pytest.mark.parametrize("text, says", [
    ("max-modl-len: 5\n", "'max-modl-len' is not a flag this command takes"),
    ("config: other.yaml\n", "'config' is not a flag"),
    ("max-num-seqs: abc\n", "argument --max-num-seqs: invalid int value: 'abc'"),
    ("max-num-seqs: true\n", "max-num-seqs takes a value, not true"),
    ("max-num-seqs: [1, 2]\n", "max-num-seqs takes one value, got a list"),
    ("api-key: [-k1, k2]\n", "api-key: a list of several values cannot hold one starting with '-'"),
    ("warmup: 1\n", "warmup is a switch: give true or false"),
    ("kv-cache-dtype: fp16\n", "argument --kv-cache-dtype: invalid choice"),
    # A mapping only for a JSON flag, and within it only what JSON holds (else a TypeError
    # from json.dumps, or a scalar flag given '{"a": 1}' as its text).
    ("model: {a: 1}\n", "model takes one value, got a mapping"),
    ("max-model-len: {a: 1}\n", "max-model-len takes one value, got a mapping"),
    ("served-model-name: [a, {b: 1}]\n", "served-model-name takes one value, got a mapping"),
    ("speculative-config: {method: ngram, when: 2024-01-01}\n", "speculative-config.when: datetime.date"),
    ("speculative-config: {method: ngram, at: 2024-01-01 10:00:00}\n", "speculative-config.at: datetime.datetime"),
    ("speculative-config: {method: ngram, x: [1, !!binary aGk=]}\n", "speculative-config.x[1]: b'hi' is not a JSON"),
    ("speculative-config: {2024-01-01: 1}\n", "speculative-config: key datetime.date(2024, 1, 1) is not a string"),
    ("speculative-config: {1: ngram}\n", "speculative-config: key 1 is not a string"),
    ("speculative-config: {method: ngram, x: .nan}\n", "speculative-config.x: nan is not a JSON value"),
    ("speculative-config: [1, 2]\n", "speculative-config takes one value, got a list"),
    ("model: 2024-01-01\n", "model: datetime.date(2024, 1, 1) is not a value a flag takes"),
    ("served-model-name: [a, null]\n", "served-model-name: None is not a value a flag takes"),
    ("served-model-name: [a, [b]]\n", "served-model-name: ['b'] is not a value a flag takes"),
    ("- max-num-seqs\n", "must be a mapping of flag names to values"),
    ("a: [\n", "not valid YAML"),
    # PyYAML's message on one line: what it expected, what it found, where
    ("a: 1\n---\nb: 2\n", "not valid YAML (expected a single document in the stream: but found another document, "
                        "line 2, column 1)"),
    # past int()'s digit limit: the file's line, not advice to call sys.set_int_max_str_digits
    ("max-num-seqs: " + "1" * 5000 + "\n", "not valid YAML (an integer of more than 4300 digits, line 1, column 15)"),
])
def test_a_bad_config_file_exits_naming_the_key(tmp_path, capsys, text, says):
    with pytest.raises(SystemExit) as exit_:
        parse(tmp_path, text)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_a_config_file_of_aliases_that_stand_for_millions_of_values_exits_at_once(tmp_path, capsys):
    """Ten lines of YAML aliases, each repeating the line before nine times, are 9^10 values
    (3.5 billion): spelled out by the JSON check and json.dumps, minutes and gigabytes. A
    flag's JSON holds at most config_file.MAX_JSON_VALUES."""
    lines = ["speculative-config:", "  method: ngram", "  a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    with pytest.raises(SystemExit) as exit_:
        parse(tmp_path, "\n".join(lines) + "\n")
    assert exit_.value.code == 2
    assert "c.yaml: speculative-config: more than 10,000 values" in capsys.readouterr().err
    assert parse(tmp_path, "speculative-config: {method: ngram, num_speculative_tokens: &k 2, prompt_lookup_max: *k}\n")


def test_a_config_file_that_is_not_utf8_exits_naming_it(tmp_path, capsys):
    (tmp_path / "c.yaml").write_bytes("max-num-seqs: 4\n".encode("utf-16"))
    with pytest.raises(SystemExit):
        config_file.parse_args(cli_args.build_parser(), ["--config", str(tmp_path / "c.yaml")])
    assert "c.yaml: not UTF-8 text" in capsys.readouterr().err


def test_a_missing_config_file_exits_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit):
        config_file.parse_args(cli_args.build_parser(), ["--config", str(tmp_path / "none.yaml")])
    assert "none.yaml: cannot read it" in capsys.readouterr().err


def test_a_second_config_file_exits_naming_the_flag(tmp_path, capsys):
    """vLLM's parser refuses a second --config (argparse_utils.py): here the last one would
    stand in for the first, its flags silently dropped."""
    (tmp_path / "a.yaml").write_text("max-num-seqs: 4\n")
    (tmp_path / "b.yaml").write_text("max-model-len: 64\n")
    with pytest.raises(SystemExit) as exit_:
        config_file.parse_args(cli_args.build_parser(), ["--config", str(tmp_path / "a.yaml"),
                                                         "--config", str(tmp_path / "b.yaml")])
    assert exit_.value.code == 2 and "--config is given more than once" in capsys.readouterr().err


def _tiny(**kw: object) -> LLM:  # (the KV blocks by vLLM's keyword, num_kv_blocks here)
    return LLM("tiny", log=lambda *_: None, max_model_len=64, num_gpu_blocks_override=16, warmup=False, **kw)


@pytest.mark.parametrize("flag, value, at_least", [
    ("max_num_batched_tokens", 10**9, 10**9 * 64 * 4),  # the hidden-state buffer alone: rows x hidden 64 x f32
    ("max_num_seqs", 10**5, 10**5 * 259 * 4),  # the logits buffer alone: rows x the tiny vocabulary x f32
])
def test_host_buffers_past_the_hosts_ram_are_a_value_error_naming_the_flag(monkeypatch, flag, value, at_least):
    """Not numpy's MemoryError mid start-up: the runner's host arrays are sized from the flags
    and checked against the host's RAM before any is allocated."""
    monkeypatch.setattr(runner, "host_memory_bytes", lambda: 64 * 2**20)
    with pytest.raises(ValueError, match=rf"--{flag.replace('_', '-')} {value} is too large: .* more than the "
                                         r"host's 67,108,864 bytes") as e:
        _tiny(**{flag: value})
    need = int(re.search(rf"{flag} {value}: ([\d,]+) bytes", str(e.value)).group(1).replace(",", ""))
    assert need >= at_least


def test_host_buffers_are_bounded_by_their_need_not_a_cap(monkeypatch):
    """A host with exactly the RAM the runner's arrays need builds the engine; one byte less
    is refused. The need covers the buffers the runner really keeps."""
    llm = _tiny(max_num_seqs=4)
    r, cfg = llm.engine.runner, llm.engine.config
    assert cfg.num_kv_blocks == 16  # vLLM's num_gpu_blocks_override
    need = runner.host_buffer_bytes(cfg, llm.engine.model_config, llm.engine.loaded.dtype)
    assert need["max_num_batched_tokens"] >= r._hidden.nbytes
    assert need["max_num_seqs"] >= r._logits.nbytes + sum(a.nbytes for a in r._samp.values())
    assert need["max_model_len"] >= r._bt.nbytes
    monkeypatch.setattr(runner, "host_memory_bytes", lambda: sum(need.values()))
    _tiny(max_num_seqs=4)
    monkeypatch.setattr(runner, "host_memory_bytes", lambda: sum(need.values()) - 1)
    with pytest.raises(ValueError, match="is too large"):
        _tiny(max_num_seqs=4)


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_host_buffers_grow_with_the_logprob_arrays_width(spec):
    """--max-logprobs is the width of the logprob arrays the programs return (-1: the
    vocabulary, [rows, V] ids and values, and prompt logprobs' [P, V]), copied to the host
    when asked: the host budget grows with the width by exactly what those programs'
    outputs take, read from their shapes (jax.eval_shape of the sample, prompt-logprob and
    verify computations)."""
    import jax.numpy as jnp

    from model_loader import BUILTIN_MODELS
    from sampler import RAW_LOGPROBS, SamplingTensors, emitted_logprobs, empty_sampling_arrays, sample_rows

    model = BUILTIN_MODELS["tiny"]
    V, H = model.vocab_size, model.hidden_size
    N, rows, P, K1 = 12, 16, 256, 4  # 12 sequences: two sample chunks of 8; 200 tokens: two prompt chunks of 128

    def cfg(max_logprobs: int) -> EngineConfig:
        return EngineConfig(model="tiny", max_num_seqs=N, max_model_len=128, max_num_batched_tokens=200,
                            max_logprobs=max_logprobs, speculative_config=spec).resolved(128)

    def nbytes(tree) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

    def outputs(width: int) -> dict[str, int]:
        def t(n: int) -> SamplingTensors:
            return SamplingTensors(**empty_sampling_arrays(n), want_logprobs=np.bool_(True))

        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        sample = jax.eval_shape(lambda x: sample_rows(x, t(rows), rows, 8, RAW_LOGPROBS, width)[1:], f32(rows, V))
        prompt = jax.eval_shape(lambda h, w, tg: compilation.prompt_logprobs(lambda x: x @ w, h, tg, 128, width),
                                f32(P, H), f32(H, V), i32(P))
        verify = jax.eval_shape(lambda x, tok: emitted_logprobs(x, tok, t(N), True, RAW_LOGPROBS, width),
                                f32(N, K1, V), i32(N, K1))
        return {"max_num_batched_tokens": nbytes(prompt), "max_num_seqs": nbytes(sample) + nbytes(verify) * bool(spec)}

    def host(max_logprobs: int) -> dict[str, int]:
        return runner.host_buffer_bytes(cfg(max_logprobs), model, np.float32)

    for narrow, wide, width in ((0, 20, 20), (20, -1, V)):
        grown = {k: host(wide)[k] - host(narrow)[k] for k in host(narrow)}
        want = {k: outputs(width).get(k, 0) - outputs(20 if width == V else 0).get(k, 0) for k in grown}
        assert grown == want
    assert grown["max_num_batched_tokens"] == P * (V - 20) * 8  # [P, V] ids and values


def test_every_engine_config_field_is_a_server_flag_with_its_own_help():
    """A field added to EngineConfig is a flag at once (build_parser reads the dataclass);
    its --help says what it does, not just the field's name."""
    import dataclasses

    actions = {a.dest: a for a in cli_args.build_parser()._actions}
    for f in dataclasses.fields(EngineConfig):
        assert f.name in actions, f.name
        assert actions[f.name].help and "EngineConfig." not in actions[f.name].help, f.name


# ---- parallelism: vLLM's flags, and the ones taxirank does not have ----------------------

@pytest.mark.parametrize("kwargs, says", [
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size 2: taxirank does not support pipeline parallelism "
                                     r"\(only 1\); shard the model over devices with --tensor-parallel-size"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size 0: taxirank does not support"),
    (dict(data_parallel_size=4), r"data_parallel_size 4: .* run replicas instead: serve_ray.py --num-replicas"),
    (dict(data_parallel_size=1.0), "data_parallel_size must be an integer"),
    (dict(distributed_executor_backend="mp"), "distributed_executor_backend mp: taxirank supports only uni"),
    (dict(distributed_executor_backend="ray"), "ray: taxirank supports only uni .* serve_ray.py runs engine replicas"),
    (dict(distributed_executor_backend="external_launcher"), "external_launcher: taxirank supports only uni"),
    (dict(distributed_executor_backend="torchrun"),
     "distributed_executor_backend must be one of mp, ray, uni, external_launcher"),
    # a multi-host mesh is every process's devices: at least one each
    (dict(distributed_coordinator="h:1", num_processes=2),
     r"tensor_parallel_size \(1\) is smaller than num_processes \(2\)"),
    (dict(distributed_coordinator="h:1", num_processes=4, tensor_parallel_size=2),
     r"tensor_parallel_size \(2\) is smaller than num_processes \(4\)"),
])
def test_parallelism_taxirank_does_not_have_is_a_value_error_saying_what_to_use(kwargs, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(**kwargs)
    with pytest.raises(ValueError, match=says):  # offline: LLM's keyword arguments, before any model loads
        LLM(model="/nowhere", **kwargs)


def test_parallelism_flags_take_vllms_spellings_and_the_values_that_run():
    c = EngineConfig(pipeline_parallel_size=1, data_parallel_size=1, distributed_executor_backend="uni")
    assert (c.pipeline_parallel_size, c.data_parallel_size, c.distributed_executor_backend) == (1, 1, "uni")
    assert EngineConfig(distributed_coordinator="h:1", num_processes=2, tensor_parallel_size=2).num_processes == 2
    parser = cli_args.build_parser()
    c = cli_args.engine_config(parser.parse_args(["-tp", "2", "-pp", "1", "-dp", "1",
                                                "--distributed-executor-backend", "uni"]))
    assert (c.tensor_parallel_size, c.pipeline_parallel_size, c.data_parallel_size) == (2, 1, 1)
    long = cli_args.engine_config(parser.parse_args(["--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
                                                   "--data-parallel-size", "1"]))
    assert long == dataclasses.replace(c, distributed_executor_backend=None)
    # vLLM's names of the KV cache's size, beside taxirank's
    kv = cli_args.engine_config(parser.parse_args(["--num-gpu-blocks-override", "64",
                                                   "--kv-cache-memory-bytes", "4096"]))
    assert (kv.num_kv_blocks, kv.kv_cache_memory) == (64, 4096)
    assert cli_args.engine_config(parser.parse_args(["-q", "int8"])).quantization == "int8"  # vLLM's -q
    for flags, says in [(["-pp", "2"], "does not support pipeline parallelism"),
                        (["--pipeline-parallel-size", "3"], "does not support pipeline parallelism"),
                        (["-dp", "2"], "does not support data parallelism"),
                        (["--distributed-executor-backend", "mp"], "supports only uni")]:
        with pytest.raises(ValueError, match=says):
            cli_args.engine_config(parser.parse_args(flags))


def test_a_kv_sizing_error_names_the_flag_as_vllm_spells_it_too():
    """--num-gpu-blocks-override and --kv-cache-memory-bytes set the same fields as ours: a
    message about their value names each spelling the parser takes (as argparse's own errors
    do), so a vLLM user reads the flag they typed."""
    parser = cli_args.build_parser()
    model = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=4, head_dim=8)
    for dest, flag, value in [("num_kv_blocks", "--num-gpu-blocks-override", "2"),
                              ("kv_cache_memory", "--kv-cache-memory-bytes", "1")]:
        config = cli_args.engine_config(parser.parse_args(["--max-model-len", "256", flag, value])).resolved(4096)
        spellings = next(a.option_strings for a in parser._actions if a.dest == dest)
        assert flag in spellings and len(spellings) == 2
        with pytest.raises(ValueError, match="but one sequence of max_model_len 256 needs 16") as e:
            kvcache.num_kv_blocks_for(config, model, np.float32, weight_bytes=0)
        assert f"({'/'.join(spellings)} {value}" in str(e.value)


def test_server_exits_on_an_unsupported_parallelism_flag_and_an_unknown_backend(capsys):
    for flags, says in [(["-dp", "2"], "run replicas instead"), (["-pp", "2"], "--tensor-parallel-size instead")]:
        with pytest.raises(SystemExit) as exit_:
            server.main(["--model", "/nowhere", *flags])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # argparse's choices: vLLM's four names
        cli_args.build_parser().parse_args(["--distributed-executor-backend", "torchrun"])
    assert exit_.value.code == 2 and "invalid choice: 'torchrun'" in capsys.readouterr().err


def test_an_unknown_llm_keyword_is_a_type_error_as_vllms():
    with pytest.raises(TypeError, match="pipeline_parallel"):  # a misspelling of a flag it has
        LLM(model="/nowhere", pipeline_parallel=2)


@pytest.mark.parametrize("kwargs, says", [
    (dict(enforce_eager=True), "enforce_eager=True is not supported: every step runs as a compiled JAX program"),
    (dict(enforce_eager=1), "enforce_eager=1 is not supported"),  # a bool, as vLLM's
    (dict(tokenizer_mode="slow"), "tokenizer_mode='slow' is not supported"),
    (dict(skip_tokenizer_init=True), "skip_tokenizer_init=True is not supported"),
    (dict(revision="main"), "revision='main' is not supported"),
    (dict(hf_overrides={"rope_theta": 1.0}), "hf_overrides=.* is not supported"),
    (dict(cpu_offload_gb=4), "cpu_offload_gb=4 is not supported"),
    (dict(compilation_config={"level": 3}), "compilation_config=.* is not supported"),
    (dict(task="embed"), "task='embed' is not supported: taxirank runs text generation only"),
    (dict(enable_lora=True), "enable_lora=True is not supported: taxirank has no LoRA"),
])
def test_a_vllm_llm_keyword_taxirank_cannot_honour_is_a_value_error_naming_it(kwargs, says):
    """vLLM's LLM(...) keywords without an engine field here: not a TypeError (a vLLM script's
    LLM(model, enforce_eager=...) is no misspelling) but a ValueError naming the keyword and
    its value, before any model loads; the values that ask for what taxirank does anyway pass
    on to the model's loading (here: a missing model)."""
    with pytest.raises(ValueError, match=says):
        LLM(model="/nowhere", **kwargs)
    # vLLM's names of fields named otherwise here are those fields (checked as they are)
    with pytest.raises(ValueError, match="kv_cache_memory must be > 0 bytes"):
        LLM(model="/nowhere", kv_cache_memory_bytes=-1)
    with pytest.raises(TypeError, match="num_gpu_blocks_override and num_kv_blocks are one setting"):
        LLM(model="/nowhere", num_gpu_blocks_override=8, num_kv_blocks=8)
    with pytest.raises(FileNotFoundError, match="/nowhere"):
        LLM(model="/nowhere", enforce_eager=False, trust_remote_code=True, tokenizer_mode="auto",
            skip_tokenizer_init=False, revision=None, hf_token=None, hf_overrides={}, cpu_offload_gb=0.0,
            compilation_config=None, disable_log_stats=True, task="generate", load_format="auto",
            disable_custom_all_reduce=False, download_dir=None, allowed_local_media_path="")
