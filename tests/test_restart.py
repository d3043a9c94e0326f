"""Restarting the server from its persistent compilation cache, as the README says: the
cache is $TAXIRANK_CACHE/jax unless --compilation-cache-dir moves it; a second start on
the same cache (a copy of it, at another path) compiles nothing, says so in its warm-up
lines and gives the same tokens; a start with a changed shape setting compiles the
programs it needs and serves correctly; an unreadable entry is rewritten once.

What JAX compiled is read from JAX itself, not from the engine: its persistent-cache
events (a sitecustomize module on the servers' path prints one line for each), and its
cache directory, where it writes one entry for every program it compiles (the engine
caches even the quickest compiles). The servers get a cold cache of their own: the
session's shared one (conftest) is removed from their environment."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from conftest import ROOT, env_without_test_cache
from test_server import metric, request, running_server, scrape

# One slot, one token bucket: the fewest programs a start compiles (sampling, decode of 1
# row, prefill of 16 tokens, prompt logprobs).
FLAGS = ["--model", "tiny", "--max-num-seqs", "1", "--max-model-len", "16", "--max-num-batched-tokens", "16",
         "--num-kv-blocks", "16", "--warmup"]
PROGRAMS = 4
BODY = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}

EVENTS = """
import sys

from jax import monitoring

_NAMES = {"/jax/compilation_cache/cache_hits": "hit", "/jax/compilation_cache/cache_misses": "miss"}


def _print(event, **kw):
    if event in _NAMES:
        sys.stdout.write(f"jax persistent cache: {_NAMES[event]}\\n")  # one write: no other line splits it
        sys.stdout.flush()


monitoring.register_event_listener(_print)
"""


def entries(cache: Path) -> set[str]:
    return {p.name for p in cache.glob("*-cache")}


def serve_once(env: dict[str, str], *flags: str) -> dict:
    """Start, answer BODY, stop: the answer's token ids, the engine's num_compilations, its
    warm-up lines and JAX's persistent-cache events."""
    with running_server(*FLAGS, *flags, env=env) as srv:
        status, out = request(srv, "POST", "/v1/completions", BODY | {"logprobs": 0}, key=None)
        compiled = metric(scrape(srv), "num_compilations_total")
        srv.proc.terminate()
        assert srv.proc.wait(60) == 0, srv.log()
        # the server's log lines: "<time> INFO taxirank.server: <message>"
        log = [line.partition(" taxirank.server: ")[2] or line for line in srv.log().splitlines()]
    assert status == 200 and out["choices"][0]["finish_reason"] == "length", out
    assert out["usage"]["completion_tokens"] == 8
    warmup = [x for x in log if x.startswith("warm-up: ")]
    return dict(tokens=out["choices"][0]["logprobs"]["tokens"], programs=compiled, warmup=warmup,
                progress=[x for x in log if x.startswith("warm-up ") and x not in warmup],
                hits=log.count("jax persistent cache: hit"), misses=log.count("jax persistent cache: miss"))


def test_a_restart_compiles_nothing_and_a_new_shape_compiles_what_it_needs(tmp_path) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(EVENTS)
    env = env_without_test_cache() | {"PYTHONPATH": os.pathsep.join((str(hook), str(ROOT)))}
    cache = tmp_path / "jax"  # TAXIRANK_CACHE's compiled programs, where the README says

    first = serve_once(env | {"TAXIRANK_CACHE": str(tmp_path)})
    cold = entries(cache)
    assert any(e.startswith("jit_decode_fn-") for e in cold) and any(e.startswith("jit_ragged_fn-") for e in cold)
    assert first["programs"] == PROGRAMS
    assert first["misses"] >= PROGRAMS and first["hits"] == 0  # a cold start compiles them all
    assert len(cold) == first["misses"]  # one entry for each

    # A copy of the directory at another path through --compilation-cache-dir, TAXIRANK_CACHE
    # elsewhere (empty): the flag alone decides where the programs come from, and a cache
    # moved or copied (another user's home, a volume mounted elsewhere) is still read.
    elsewhere, moved = tmp_path / "elsewhere", tmp_path / "moved"
    shutil.copytree(cache, moved)
    again = serve_once(env | {"TAXIRANK_CACHE": str(elsewhere)}, "--compilation-cache-dir", str(moved))
    assert not (elsewhere / "jax").exists()
    assert again["misses"] == 0, "the restart compiled something"
    assert again["hits"] == first["misses"]  # every program is read back instead
    assert entries(moved) == cold
    assert again["tokens"] == first["tokens"] and again["programs"] == first["programs"]

    # the warm-up lines say which: the README's "a restart compiles nothing" is what a user reads
    assert len(first["warmup"]) == len(again["warmup"]) == 1, (first["warmup"], again["warmup"])
    assert first["warmup"][0].startswith(f"warm-up: {PROGRAMS} programs compiled in "), first["warmup"]
    assert again["warmup"][0].startswith(f"warm-up: {PROGRAMS} programs in "), again["warmup"]
    assert again["warmup"][0].endswith(f": {PROGRAMS} loaded from the compilation cache, 0 compiled"), again["warmup"]
    # and each program's own line says how it was got: compiled, then read back
    for run, how in ((first, "compiled"), (again, "loaded from the compilation cache")):
        assert len(run["progress"]) == PROGRAMS, run["progress"]
        for i, line in enumerate(run["progress"]):
            assert re.fullmatch(rf"warm-up {i + 1}/{PROGRAMS} \(.+\): {how} in \d+\.\ds", line), line

    wider = serve_once(env | {"TAXIRANK_CACHE": str(tmp_path)}, "--max-num-seqs", "2")
    new = entries(cache) - cold
    assert any(e.startswith("jit_decode_fn-") for e in new), new  # more rows: new step programs
    assert wider["misses"] == len(new) > 0
    assert wider["hits"] > 0  # the programs of one row (sampling, the token bucket) are read back
    assert wider["tokens"] == first["tokens"]


def test_an_unreadable_cache_entry_is_compiled_again_once_and_then_read() -> None:
    """A cache entry truncated (a process killed while writing it, a full disk) is a miss
    that replaces it: the next compile of that program is read from the cache again, where
    JAX alone would keep the broken entry (it never overwrites a key) and compile the program
    at every start. In this process, on the tests' own cache, with a program of its own."""
    import warnings

    import jax
    import numpy as np

    import startup
    from compilation import persistent_cache_hits

    startup.use_compilation_cache(None)  # the tests' cache stays; the engine's handling of it is installed

    salt = int.from_bytes(os.urandom(3), "little")  # a program no earlier run left an entry for

    def compile_probe() -> int:
        """Compile the probe as a new process would (a new jit: nothing in memory); 1 if
        its executable was read from the persistent cache."""
        def restart_probe_program(x):
            return x * 3 + salt

        with persistent_cache_hits() as hits, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # JAX's own warning about the unreadable entry
            assert int(jax.jit(restart_probe_program)(np.int32(2))) == 6 + salt
        return hits[0]

    cache = Path(jax.config.jax_compilation_cache_dir)
    before = set(cache.glob("jit_restart_probe_program-*-cache"))
    assert compile_probe() == 0  # its entry written
    [entry] = set(cache.glob("jit_restart_probe_program-*-cache")) - before
    entry.write_bytes(entry.read_bytes()[:10])  # truncated
    assert compile_probe() == 0  # unreadable: compiled
    assert compile_probe() == 1, "the broken entry was kept: every start would compile this program"


def test_a_cache_directory_that_is_a_file_is_refused(tmp_path) -> None:
    """A file where the cache directory (or a folder above it) would be: one error naming
    the flag (server.py: exit 2), not JAX's one warning and no cache, every start compiling
    every program."""
    import pytest

    import startup

    (tmp_path / "f").write_text("")
    for path in (tmp_path / "f", tmp_path / "f" / "jax"):
        with pytest.raises(ValueError, match=rf"^compilation cache directory '{path}' \(--compilation-cache-dir, "
                                             rf"else \$TAXIRANK_CACHE/jax\): {tmp_path / 'f'} is not a directory$"):
            startup.use_compilation_cache(str(path))
    startup.use_compilation_cache(str(tmp_path / "new" / "jax"))  # a folder still to create is fine
