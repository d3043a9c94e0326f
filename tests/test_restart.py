"""Restarting the server from its persistent compilation cache, redirected by
TAXIRANK_CACHE as the README says: the second start compiles nothing, and a start with
a changed shape setting compiles the programs it needs and serves correctly.

JAX writes one entry to the cache for every program it compiles (the engine caches even
the quickest compiles), so the cache's entries are the record of what was compiled. The
servers get a cold cache of their own: the session's shared one (conftest) is removed
from their environment."""

from __future__ import annotations

from pathlib import Path

from conftest import env_without_test_cache
from test_server import metric, request, running_server, scrape

FLAGS = ["--model", "tiny", "--max-num-seqs", "2", "--max-model-len", "64", "--max-num-batched-tokens", "32",
         "--num-kv-blocks", "16", "--warmup"]
BODY = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def entries(cache: Path) -> set[str]:
    return {p.name for p in (cache / "jax").glob("*-cache")}


def serve_once(env: dict[str, str], *flags: str) -> tuple[list[int], float]:
    """Start, answer BODY, stop: (the answer's token ids, the engine's num_compilations)."""
    with running_server(*FLAGS, *flags, env=env) as srv:
        status, out = request(srv, "POST", "/v1/completions", BODY | {"logprobs": 0}, key=None)
        compiled = metric(scrape(srv), "num_compilations_total")
        srv.proc.terminate()
        assert srv.proc.wait(60) == 0, srv.log()
    assert status == 200 and out["choices"][0]["finish_reason"] == "length", out
    assert out["usage"]["completion_tokens"] == 8
    return out["choices"][0]["logprobs"]["tokens"], compiled


def test_a_restart_compiles_nothing_and_a_new_shape_compiles_what_it_needs(tmp_path) -> None:
    env = env_without_test_cache() | {"TAXIRANK_CACHE": str(tmp_path)}

    first, compiled = serve_once(env)
    cold = entries(tmp_path)
    assert any(e.startswith("jit_decode_fn-") for e in cold) and any(e.startswith("jit_ragged_fn-") for e in cold)
    assert compiled > 0

    again, recompiled = serve_once(env)
    assert entries(tmp_path) == cold  # every program came from the cache
    assert again == first and recompiled == compiled

    wider, _ = serve_once(env, "--max-num-seqs", "4")
    new = entries(tmp_path) - cold
    assert any(e.startswith("jit_decode_fn-") for e in new), new  # more rows: new step programs
    assert wider == first
