"""A property test of the server's command line: argv hypothesis draws from build_parser()'s
own options (every flag, any of its spellings, repeated, abbreviated), each with a value of
its type or a hostile one (negative, zero, 2**63, 10**400, 5,000 digits, nan and inf, empty,
unicode, NUL, JSON junk for the JSON flags, paths that name nothing, a file or a folder),
some with a `--config FILE` whose YAML holds random keys and values: nested lists and
mappings, dates, binaries, sets, anchors and aliases, several documents, deep nesting,
bytes that are not UTF-8.

server.main(argv) runs up to the model load: AsyncEngine is replaced by a stand-in that
makes the engine's own checks of its config before and around the load (the generation
config's sampling defaults, resolved() against the tiny model, the runner's host buffers,
the KV cache's sizing) and stops there. serve_ray.main(argv) (server.py's flags and the
fleet's) runs up to ray.init.

Property, for every argv: either the config is accepted, and then it holds what the engine
divides by and allocates with (a hashable, resolved config whose budget, buckets and KV
blocks are in range; for serve_ray, Ray Serve's options: counts >= 1, finite resources and
timeouts), or the program exits with code 2 and its last stderr line is one
`error:` line that names one of the flags (or file keys) given, or the file; never another
exception, never a traceback. The hand-written tables of such values are test_config.py's;
each defect this found has its row there.

TAXIRANK_FUZZ_EXAMPLES=5000 with --hypothesis-profile=explore searches further (about
three minutes a test on one core).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import signal
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import async_engine
import cli_args
import config_file
import server
from config import MAX_BLOCK_SIZE, EngineConfig
from hf_config import generation_sampling_defaults
from kvcache import num_kv_blocks_for
from model_loader import BUILTIN_MODELS
from parallel import kv_head_replicas, make_mesh
from runner import check_host_buffers, logprobs_bytes

EXAMPLES = int(os.environ.get("TAXIRANK_FUZZ_EXAMPLES", "150"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
TINY = BUILTIN_MODELS["tiny"]


class Accepted(Exception):
    """The stand-in engine's verdict: the config passed every check before the model loads."""

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        super().__init__()
        self.config, self.num_blocks = config, num_blocks


class CheckedEngine:
    """AsyncEngine up to its first allocation: LLMEngine reads the generation config's
    sampling defaults before the weights; build_engine builds the mesh, resolves the config
    against the model (the tiny one here, whatever --model names), checks the runner's host
    buffers and sizes the KV cache (no weights, no measured activations: the CPU's rules)."""

    def __init__(self, config: EngineConfig, log: Any = None) -> None:
        generation_sampling_defaults(config)
        if config.tensor_parallel_size > 1:  # the mesh, and the model's split over it
            make_mesh(config.tensor_parallel_size)
            kv_head_replicas(TINY, config.tensor_parallel_size)
        config = config.resolved(TINY.max_model_len)
        check_host_buffers(config, TINY, np.float32)
        num_blocks = num_kv_blocks_for(config, TINY, np.float32, 0,
                                       logprobs_bytes=sum(logprobs_bytes(config, TINY).values()))
        raise Accepted(config, num_blocks)


# ---- values ------------------------------------------------------------------------------

BIG_INTS = [0, 1, -1, 2, 3, 16, 255, 256, 2**31, 2**62, 2**63 - 1, 2**63, -(2**63), 2**64 + 1, 10**18, 10**30,
            10**400]
INT_WORDS = st.one_of(st.sampled_from([str(n) for n in BIG_INTS]),
                      st.sampled_from(["1" * 5000, "0x10", "1_000", "+5", " 7", "١٢", "1.0"]),
                      st.integers(-300, 5000).map(str))
FLOAT_WORDS = st.one_of(st.sampled_from(["nan", "-nan", "inf", "-inf", "1e400", "-1e400", "0", "-0.0", "1e-320",
                                         "0.5", "1", "1.5", "2", "-1", "1e308", "9" * 400, "0x1p3", "½"]),
                        st.floats(-1e3, 1e3, allow_nan=False).map(repr))
JUNK_WORDS = st.one_of(st.sampled_from(["", " ", "-", "--", "-1", "none", "None", "null", "true", "\x00", "\ud800",
                                        "é", "\U0001f600", "a" * 5000, "{", "[]", "{}", "=", "--max"]),
                       st.text(max_size=8))


def json_junk(depth: int = 3) -> st.SearchStrategy[Any]:
    scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(BIG_INTS), st.integers(-5, 40),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=depth * 3)


def json_text(plausible: list[str]) -> st.SearchStrategy[str]:
    raw = st.sampled_from(["", "{", "[" * 100_000, "NaN", "Infinity", '{"a": NaN}', '{"a": 1e400}',
                           '{"a": ' + "1" * 5000 + "}", "null", "[]", '"x"', "{'a': 1}"])
    return st.one_of(st.sampled_from(plausible), raw, json_junk().map(json.dumps),
                     st.dictionaries(st.sampled_from(["method", "num_speculative_tokens", "model", "prompt_lookup_min",
                                                      "prompt_lookup_max", "temperature", "top_p", "top_k", "min_p",
                                                      "max_new_tokens", "repetition_penalty", "enable_thinking",
                                                      "disable_by_batch_size", "min_acceptance_rate", "options"]),
                                     json_junk(1), max_size=4).map(json.dumps))


SPEC = ['{"method": "ngram", "num_speculative_tokens": 2}', '{"model": "[ngram]", "num_speculative_tokens": 3}',
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 1}']
GEN = ['{"temperature": 0.5}', '{"top_k": 5, "max_new_tokens": 10}', '{}']
KWARGS = ['{"enable_thinking": false}', '{"add_generation_prompt": true}', '{"messages": []}', '{}']


def paths(root: str) -> st.SearchStrategy[str]:
    """A folder, a file, nothing, and the folders a flag names by what they hold."""
    return st.sampled_from([root, os.path.join(root, "empty.txt"), os.path.join(root, "none"), "/", "/dev/null",
                            os.path.join(root, "tok"), os.path.join(root, "gen"), os.path.join(root, "badgen"),
                            os.path.join(root, "x.gguf")])


SANE_INTS = st.one_of(st.sampled_from(["0", "1", "2", "4", "16", "64", "128", "256", "1024"]),
                      st.integers(0, 4096).map(str))
SANE_FLOATS = st.sampled_from(["0", "0.5", "0.9", "1", "2", "30"])


def value_words(action: argparse.Action, root: str, hostile: bool) -> st.SearchStrategy[list[str]]:
    """The words after a flag: a value of its kind, and (hostile) junk besides."""
    dest, kind = action.dest, action.type
    if action.nargs == 0:
        return st.just([])
    if action.choices is not None:
        good: st.SearchStrategy[str] = st.sampled_from([str(c) for c in action.choices])
    elif kind in (int, cli_args.non_negative_int):
        good = INT_WORDS if hostile else SANE_INTS
    elif kind is float:
        good = FLOAT_WORDS if hostile else SANE_FLOATS
    elif kind is config_file.json_text:
        good = json_text(SPEC)
    elif kind is config_file.json_object:
        good = json_text(KWARGS)
    elif kind is config_file.json_list:
        good = st.one_of(st.sampled_from(['["*"]', '["https://a.example"]', '["GET", "POST"]', '[""]', '[1]']),
                         json_text(['["*"]']))
    elif kind is cli_args.load_chat_template:
        good = st.one_of(st.sampled_from(["{{ messages }}", "{% for m in messages %}{{ m.content }}{% endfor %}",
                                          "{% if %}", "\\n{{ x }}", "\\x", "\\u12", "{{"]), paths(root))
    elif kind is cli_args.root_path_arg:
        good = st.sampled_from(["", "/", "/llm", "llm", "/llm/", "/a b", "/é", "//x"])
    elif dest == "override_generation_config":
        good = json_text(GEN)
    elif dest == "model":
        good = st.sampled_from(["tiny", "smollm2", "bench"])
    elif dest in ("tokenizer", "generation_config", "compilation_cache_dir", "uds", "ssl_keyfile", "ssl_certfile",
                  "ssl_ca_certs"):
        good = st.one_of(paths(root), st.sampled_from(["auto", "vllm", ""]))
    elif dest == "host":
        good = st.sampled_from(["127.0.0.1", "localhost", "", "::1", "0.0.0.0", "256.1.1.1", "a" * 64 + ".invalid",
                                "\ud800", "\x00", "é.invalid"])
    elif dest == "distributed_coordinator":
        good = st.sampled_from(["127.0.0.1:1234", "h:0", "h:65536", ":1", "h:", "h:١٢", "h:+1", "h: 1",
                                "h:" + "1" * 5000, "[::1]:80"])
    else:  # a name (served model name, api key, response role)
        good = st.one_of(st.sampled_from(["a", "tiny", "k-1", "assistant"]), JUNK_WORDS)
    if not hostile:
        return st.lists(good, min_size=1, max_size=3 if action.nargs in ("+", "*") else 1)
    word = st.one_of(good, good, good, INT_WORDS, FLOAT_WORDS, JUNK_WORDS)
    if action.nargs in ("+", "*"):
        return st.lists(word, min_size=0, max_size=3)
    return st.one_of(word.map(lambda w: [w]), st.just([]))


# ---- the --config file ---------------------------------------------------------------------

YAML_SCALARS = st.one_of(st.none(), st.booleans(), st.sampled_from(BIG_INTS), st.integers(-5, 300),
                         st.floats(), st.text(max_size=8), st.dates(), st.datetimes(), st.binary(max_size=4),
                         st.sampled_from(["tiny", "ngram", "fcfs", "auto", "swap", "127.0.0.1", "", "a" * 300]))
YAML_VALUES = st.recursive(YAML_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.one_of(st.text(max_size=6), st.integers(0, 3)), inner, max_size=3)
                           | st.frozensets(st.integers(0, 3), max_size=2).map(set), max_leaves=6)
RAW_YAML = ["", "---\n", "a: 1\n---\nb: 2\n", "? [a, b]\n: 1\n", "x: !!python/object:os.system 1\n", "[" * 20_000,
            "{" * 20_000, "a: &x [1, 2]\nb: *x\n", "\tmodel: tiny\n", "%YAML 1.2\n---\nmodel: tiny\n", "- 1\n- 2\n",
            "just text\n", "model: tiny\nmodel: bench\n", "max-num-seqs: 0x10\n", "max-num-seqs: 1_000\n",
            "max-num-seqs: 1e3\n", "max-num-seqs: .inf\n", "seed: -.nan\n", "<<: {model: tiny}\n",
            "speculative-config: &s {method: ngram, num_speculative_tokens: 2}\ndefault-chat-template-kwargs: *s\n",
            "served-model-name: !!set {a, b}\n", "model: !!binary aGk=\n", "model: 2024-01-01\n",
            "max-num-seqs: " + "1" * 5000 + "\n", "speculative-config: {num_speculative_tokens: " + "1" * 5000 + "}\n"]


def config_text(flag_names: list[str]) -> st.SearchStrategy[str | bytes]:
    keys = st.one_of(st.sampled_from(flag_names), st.sampled_from(flag_names).map(lambda k: k.replace("-", "_")),
                     st.sampled_from(["config", "help", "no-warmup", "-tp", "", "max", "x y"]), st.integers(0, 3),
                     st.dates())
    mapping = st.dictionaries(keys, st.one_of(YAML_VALUES, YAML_VALUES, st.sampled_from(["tiny", "4", "0.5"])),
                              max_size=5)
    return st.one_of(mapping.map(lambda m: yaml.safe_dump(m, allow_unicode=True)), st.sampled_from(RAW_YAML),
                     st.sampled_from([b"\xff\xfe\x00m", "model: tiny\n".encode("utf-16"), b"model: \x80\n"]))


@st.composite
def argvs(draw: st.DrawFn, parser: argparse.ArgumentParser, root: str) -> tuple[list[str], set[str]]:
    """(argv, the names an error may give for what it drew: flags, their dests, file keys)."""
    actions = [a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")]
    argv: list[str] = []
    names: set[str] = set()
    hostile = draw(st.integers(0, 2)) > 0  # else values of each flag's kind only, which mostly make a config
    for action in draw(st.lists(st.sampled_from(actions), max_size=8 if hostile else 4)):
        flag = draw(st.sampled_from(action.option_strings))
        if hostile and flag.startswith("--") and draw(st.integers(0, 9)) == 0:
            flag = flag[:draw(st.integers(3, len(flag)))]  # argparse takes a unique prefix
            names.add(flag)  # (or the flag it spells in full: --scheduling of --scheduling-policy)
        words = draw(value_words(action, root, hostile))
        if words and flag.startswith("--") and draw(st.integers(0, 5)) == 0:
            argv.append(f"{flag}={words[0]}")
            argv += words[1:]
        else:
            argv += [flag, *words]
        names |= {action.dest, *action.option_strings, action.dest.replace("_", "-")}
    if draw(st.integers(0, 2)) == 0:
        flag_names = [s[2:] for a in actions for s in a.option_strings if s.startswith("--")]
        text = draw(config_text(flag_names))
        path = os.path.join(root, "c.yaml")
        with open(path, "wb") as f:
            f.write(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
        argv[draw(st.integers(0, len(argv))):0] = ["--config", path]
        keys = [n for n in flag_names if n in str(text) or n.replace("-", "_") in str(text)]
        names |= {path, *keys, *(n.replace("-", "_") for n in keys)}
    if hostile and draw(st.integers(0, 9)) == 0:
        # a stray positional word (argparse echoes it as it is: a newline in it is the user's own)
        argv.insert(draw(st.integers(0, len(argv))), draw(JUNK_WORDS.filter(lambda w: "\n" not in w and "\r" not in w)))
    return argv, names


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """A folder of the files a path flag may name: a tokenizer folder, generation configs."""
    root = tmp_path_factory.mktemp("cli")
    (root / "empty.txt").write_text("")
    (root / "x.gguf").write_bytes(b"GGUF")
    (root / "tok").mkdir()
    (root / "tok" / "tokenizer.json").write_text("{}")
    (root / "gen").mkdir()
    (root / "gen" / "generation_config.json").write_text('{"temperature": 0.7, "top_k": 20}')
    (root / "badgen").mkdir()
    (root / "badgen" / "generation_config.json").write_text('{"temperature": -1, "top_k": 1e400}')
    return str(root)


@pytest.fixture
def contained(monkeypatch):
    """main() up to the model load, leaving this process as it was: no SIGTERM handler, the
    loggers' levels and PYTHONPATH restored."""
    monkeypatch.setattr(async_engine, "AsyncEngine", CheckedEngine)
    monkeypatch.setattr(signal, "signal", lambda *_: None)
    monkeypatch.setattr(logging, "basicConfig", lambda **_: None)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    level = logging.getLogger("taxirank").level
    yield
    logging.getLogger("taxirank").setLevel(level)


def check_exit(exit_: SystemExit, err: str, names: set[str]) -> None:
    """A clean refusal: code 2, one `error:` line last, naming something drawn."""
    assert exit_.code == 2, err
    assert "Traceback" not in err, err
    last = err.rstrip("\n").rsplit("\n", 1)[-1]
    assert ": error: " in last, err
    message = last.split(": error: ", 1)[1]
    generic = ("unrecognized arguments", "ambiguous option", "expected one argument", "expected at least one",
               "ignored explicit argument", "not allowed with")
    assert any(n in message for n in names) or any(g in message for g in generic), last


def check_accepted(config: EngineConfig, num_blocks: int) -> None:
    """What the engine divides by and allocates with, in range."""
    assert hash(config) is not None
    assert 1 <= config.max_model_len <= TINY.max_model_len
    assert 1 <= config.max_num_seqs <= config.max_num_batched_tokens
    assert 1 <= config.block_size <= MAX_BLOCK_SIZE and config.block_size & (config.block_size - 1) == 0
    assert num_blocks - 1 >= config.max_blocks_per_seq >= 1
    assert config.decode_buckets[-1] == config.max_num_seqs and config.token_buckets[-1] == config.max_num_batched_tokens
    assert 0 < config.gpu_memory_utilization <= 1 and math.isfinite(config.swap_space) and config.swap_space >= 0
    assert -2**63 <= config.seed < 2**63 and config.max_logprobs >= -1
    assert 1 <= config.tensor_parallel_size and 0 <= config.process_id < config.num_processes
    if config.distributed_coordinator is not None:  # jax.distributed's HOST:PORT
        port = config.distributed_coordinator.rpartition(":")[2]
        assert port.isascii() and 0 < int(port) < 65536
    if config.speculative_config is not None:
        assert config.speculative_config.k >= 1


def run_main(main: Any, argv: list[str]) -> tuple[BaseException, str]:
    """main(argv)'s Accepted or SystemExit, and its stderr, written as Python writes a real
    one: a word of the command line that is not UTF-8 (a surrogate) comes out escaped."""
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace")
    try:
        with contextlib.redirect_stderr(err):
            main(argv)
    except (Accepted, SystemExit) as e:
        err.flush()
        return e, err.buffer.getvalue().decode()
    raise AssertionError(f"main() returned: {argv!r}")


def drawn_run(data: st.DataObject, parser: Any, main: Any, root: Any) -> tuple[BaseException, str, Any]:
    """A command line drawn from `parser`'s options, run through `main`: (its outcome, its
    stderr, the flag names and file keys drawn)."""
    argv, names = data.draw(argvs(parser, root))
    outcome, err = run_main(main, argv)
    event(type(outcome).__name__)
    return outcome, err, names


@SETTINGS
@given(data=st.data())
def test_any_server_command_line_is_a_valid_config_or_one_error_line_naming_a_flag(data, root, contained):
    outcome, err, names = drawn_run(data, cli_args.build_parser(), server.main, root)
    if isinstance(outcome, Accepted):
        check_accepted(outcome.config, outcome.num_blocks)
    else:
        check_exit(outcome, err, names)


@pytest.fixture
def ray_plans(contained, monkeypatch) -> list:
    """serve_ray.main up to ray.init; the plans it made, in turn."""
    serve_ray = pytest.importorskip("serve_ray")
    plans, plan = [], serve_ray.plan

    def stop(**_: Any) -> None:
        raise Accepted(plans[-1].config, 0)

    monkeypatch.setattr(serve_ray.ray, "init", stop)
    monkeypatch.setattr(serve_ray, "plan", lambda args: plans.append(plan(args)) or plans[-1])
    return plans


@SETTINGS
@given(data=st.data())
def test_any_serve_ray_command_line_is_a_plan_or_one_error_line_naming_a_flag(data, root, ray_plans):
    import serve_ray

    outcome, err, names = drawn_run(data, serve_ray.build_parser(), serve_ray.main, root)
    if isinstance(outcome, SystemExit):
        check_exit(outcome, err, names)
        return
    options = ray_plans[-1].options  # what Ray Serve is handed: counts and resources it can meet
    assert options["max_ongoing_requests"] >= 1 and 0 <= options["graceful_shutdown_timeout_s"] < math.inf
    assert all(0 <= v < math.inf for v in options["ray_actor_options"].values())
    if "autoscaling_config" in options:
        scaling = options["autoscaling_config"]
        assert 0 <= scaling.min_replicas <= scaling.max_replicas and scaling.max_replicas >= 1
        assert 0 < scaling.target_ongoing_requests < math.inf
    else:
        assert options["num_replicas"] >= 1
