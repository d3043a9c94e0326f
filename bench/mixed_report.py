"""bench/mixed.py's results, read: the answer to the seed's question, the side-by-side
comparison, the terminal table, report.md and the plots, all from the results dict that
mixed.py writes as results.json (so --report can redraw them without a run).
"""

from __future__ import annotations

import math
import os
from typing import Any

from report import md_table, num, pyplot, ratio, save_figure, text_table

SHARP = 1.5  # "short-request p99 fell sharply": at least this many times lower at half length
REASON_MEANS = {"kv_blocks": "KV blocks", "max_num_seqs": "compute (all max_num_seqs slots busy)",
                "token_budget": "compute (the step's token budget)", "static_batch": "the static batch to drain"}
HOLDS = {"on-demand": "blocks for the tokens computed so far", "reserve": "blocks for prompt + max_tokens",
         "reserve-max-len": "blocks for max_model_len"}
METRICS = (("ttft", " s", 1), ("itl", " ms", 1000), ("tpot", " ms", 1000), ("e2e", " s", 1))


def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    """EngineConfig fields as server.py's flags."""
    argv = []
    for k, v in flags.items():
        opt = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            argv.append(opt if v else "--no-" + k.replace("_", "-"))
        elif v is not None:
            argv += [opt, str(v)]
    return argv


def _ok(v: dict | None) -> bool:
    return bool(v) and "error" not in v and "short" in v


def _p(v: dict, cls: str, metric: str, q: str) -> float | None:
    return v[cls].get(metric, {}).get(q)


def _times(r: float) -> str:
    """old/new in words: '2.50x lower' or '1.20x higher'."""
    return f"{r:.2f}x lower" if r >= 1 else f"{1 / r:.2f}x higher"


def cores_used(v: dict) -> float | None:
    """CPU cores the server process got during the run (its CPU seconds / wall seconds)."""
    cpu = (v.get("load") or {}).get("server_cpu_s")
    return cpu / v["duration_s"] if cpu is not None and v.get("duration_s") else None


def _reason_text(v: dict) -> str:
    m = v["metrics"]
    by = m["waiting_by_reason_s"]
    if not by:
        return "the server reports no waiting-by-reason"
    if not m["dominant_wait_reason"]:
        return "no request waited"
    share = by[m["dominant_wait_reason"]] / max(sum(by.values()), 1e-9)
    slots = f" of {v['flags']['max_num_seqs']} slots" if "max_num_seqs" in (v.get("flags") or {}) else ""
    run = f" (max running {m['max_running']:.0f}{slots})" if m["max_running"] is not None else ""
    return f"{m['waiting_request_s']:.0f} request-s spent waiting, {share:.0%} of it on {m['dominant_wait_reason']}{run}"


def _why(mode: str, h: dict, full: dict, half: dict) -> str:
    """What halving max_model_len shows under `mode`, beyond the seed's rule of thumb (a sharp
    fall of short-request p99 means requests queued on KV blocks)."""
    kv, sharp = h["dominant_wait_reason_full"] == "kv_blocks", h["fell_sharply"]
    run = f"{h['max_running_full']:.0f} -> {h['max_running_half']:.0f}"
    tps = h["output_tokens_per_s_half"] / h["output_tokens_per_s_full"]
    if kv and mode == "reserve-max-len":
        text = f"Halving doubled the requests that fit (max running {run}); output tokens/s {tps:.2f}x"
        text += (": the seed's rule holds." if sharp else ", and no sharp fall: a step of more sequences costs "
                 "more here, so the queue drained only that much faster. The waiting reason, not the size of the "
                 "fall, is what says KV blocks.")
    elif kv:
        text = (f"But {mode} holds {HOLDS[mode]}, which max_model_len does not change (max running {run}): halving "
                "it frees no blocks" + (f"; this fall is not admission (output tokens/s {tps:.2f}x): compare the "
                                        "machine load." if sharp else ", and p99 did not fall."))
    elif sharp:
        text = f"p99 fell without waits on KV blocks (output tokens/s {tps:.2f}x): compare the machine load."
    else:
        text = (f"Requests waited mostly on {h['dominant_wait_reason_full'] or 'nothing'}, not KV blocks, and p99 "
                "barely moved: the seed's rule holds (it was not KV).")
    c = [cores_used(v) for v in (full, half)]
    if None not in c and min(c) < 0.75 * max(c):
        text += f" Caution: the server got {c[0]:.1f} cores at full length and {c[1]:.1f} at half: not comparable."
    return text


def analyze(results: dict[str, Any]) -> dict[str, Any]:
    """The comparisons the report states, computed from the variants' figures."""
    vs = results["variants"]
    out: dict[str, Any] = {"sharp_fall_threshold": SHARP, "halving": {}, "answer": []}
    c, s = vs.get("continuous"), vs.get("static")
    if _ok(c) and _ok(s) and s["output_tokens_per_s"] > 0:
        cs = {"output_tokens_per_s_ratio": c["output_tokens_per_s"] / s["output_tokens_per_s"],
              "short_p99_e2e_ratio": _p(s, "short", "e2e", "p99") / _p(c, "short", "e2e", "p99"),
              "short_p50_ttft_ratio": _p(s, "short", "ttft", "p50") / _p(c, "short", "ttft", "p50")}
        out["continuous_vs_static"] = cs
        out["answer"].append(
            f"Continuous vs static: {cs['output_tokens_per_s_ratio']:.2f}x the output tokens/s; short-request p99 "
            f"e2e {_times(cs['short_p99_e2e_ratio'])} under continuous ({_p(s, 'short', 'e2e', 'p99'):.3g} s -> "
            f"{_p(c, 'short', 'e2e', 'p99'):.3g} s).")
    for mode in sorted({v["admission"] for v in vs.values() if v.get("admission")}):
        full, half = vs.get(f"{mode}/full"), vs.get(f"{mode}/half")
        if not (_ok(full) and _ok(half)):
            continue
        p_full, p_half = _p(full, "short", "e2e", "p99"), _p(half, "short", "e2e", "p99")
        fall = p_full / p_half if p_half else math.inf
        reason = full["metrics"]["dominant_wait_reason"]
        h: dict[str, Any] = {"fall": fall, "fell_sharply": fall >= SHARP,
                             "queued_on": REASON_MEANS.get(reason, reason) if reason else None}
        for tag, v in (("full", full), ("half", half)):
            m = v["metrics"]
            h |= {f"max_model_len_{tag}": v["flags"]["max_model_len"], f"short_p99_e2e_{tag}": _p(v, "short", "e2e", "p99"),
                  f"short_p99_ttft_{tag}": _p(v, "short", "ttft", "p99"),
                  f"output_tokens_per_s_{tag}": v["output_tokens_per_s"], f"max_running_{tag}": m["max_running"],
                  f"preemptions_{tag}": m["preemptions"], f"waiting_by_reason_s_{tag}": m["waiting_by_reason_s"],
                  f"dominant_wait_reason_{tag}": m["dominant_wait_reason"]}
        h["seed_rule_holds"] = h["fell_sharply"] == (reason == "kv_blocks")
        h["why"] = _why(mode, h, full, half)
        out["halving"][mode] = h
        out["answer"].append(
            f"{mode}: short-request p99 e2e {p_full:.3g} s at max_model_len {h['max_model_len_full']} -> {p_half:.3g} s "
            f"at {h['max_model_len_half']} ({_times(fall)}: {'fell sharply' if h['fell_sharply'] else 'no sharp fall'})."
            f" At full length {_reason_text(full)}" + (f": requests were queueing on {h['queued_on']}. " if reason else ". ")
            + h["why"])
    if out["halving"]:
        hs = out["halving"]
        kv = [m for m, h in hs.items() if h["dominant_wait_reason_full"] == "kv_blocks"]
        sharp = [m for m, h in hs.items() if h["fell_sharply"]]
        more = [f"{m} ({h['max_running_full']:.0f} -> {h['max_running_half']:.0f})" for m, h in hs.items()
                if (h["max_running_half"] or 0) > (h["max_running_full"] or 0)]
        out["answer"].append(f"So: halving max_model_len made short-request p99 fall sharply under "
                             f"{', '.join(sharp) or 'no mode'}; requests queued on KV blocks under "
                             f"{', '.join(kv) or 'no mode'}; more requests ran at once only under "
                             f"{', '.join(more) or 'no mode'}.")
    targets = [t["name"] for t in results["settings"].get("targets") or []]
    for name in targets:
        v = vs.get(name)
        if not _ok(v):
            out["answer"].append(f"{name}: not measured ({(v or {}).get('error', 'no figures')}).")
            continue
        out["answer"].append(
            f"{name}: {v['output_tokens_per_s']:.1f} output tokens/s; short-request e2e p50 "
            f"{num(_p(v, 'short', 'e2e', 'p50'), ' s')}, p99 {num(_p(v, 'short', 'e2e', 'p99'), ' s')}; "
            f"{v['errors']} of {v['requests']} requests failed"
            + (f"; {_reason_text(v)}" if v["metrics"]["waiting_by_reason_s"] else "") + ".")
    ok = [n for n in targets if _ok(vs.get(n))]
    if len(ok) >= 2:
        out["comparison"] = compare(vs, ok)
        for name, c in out["comparison"]["vs"].items():
            tps, p99, g = c["output_tokens_per_s"], c["short"]["e2e"]["p99"], c["greedy_texts"]
            out["answer"].append(
                f"{ok[0]} vs {name}: {num(tps['ratio'], 'x', '{:.2f}')} the output tokens/s ({tps[ok[0]]:.1f} vs "
                f"{tps[name]:.1f}); short-request p99 e2e {_times(p99['ratio']) if p99['ratio'] else 'not comparable'} "
                f"under {ok[0]}; greedy texts identical in {g['identical']} of {g['compared']} requests.")
    return out


# ---- side by side ------------------------------------------------------------------------

def text_agreement(a: dict, b: dict) -> dict[str, Any]:
    """Do two servers' greedy completions of the same requests match, text for text?"""
    pairs = [(i, x["text"], y["text"]) for i, (x, y) in enumerate(zip(a["per_request"], b["per_request"]))
             if not x["error"] and not y["error"] and x.get("text") is not None and y.get("text") is not None]
    diff = [(i, x, y) for i, x, y in pairs if x != y]
    first = None
    if diff:
        i, x, y = diff[0]
        k = len(os.path.commonprefix([x, y]))
        first = {"request": i, "common_prefix_chars": k, "a": x[max(0, k - 20):k + 40], "b": y[max(0, k - 20):k + 40]}
    known = [(x["prompt_tokens"], y["prompt_tokens"]) for x, y in zip(a["per_request"], b["per_request"])
             if x.get("prompt_tokens") is not None and y.get("prompt_tokens") is not None]
    return {"compared": len(pairs), "identical": len(pairs) - len(diff),
            # the same prompt text made the same number of tokens on both (from usage; None: not reported)
            "prompt_tokens_equal": sum(x == y for x, y in known) if known else None, "prompt_tokens_compared": len(known),
            "first_difference": first}


def compare(vs: dict[str, dict], names: list[str]) -> dict[str, Any]:
    """Each server against the first: output tokens/s, TTFT / ITL / TPOT / e2e p50 and p99 per
    class, each as both values and a ratio (> 1: the first is better), and the texts."""
    ref = names[0]
    out = {"reference": ref, "ratio_meaning": "ratio > 1: the reference (the first server) is better: its output "
           "tokens/s over the other's, the other's latency over its own", "vs": {}}
    a = vs[ref]
    for name in names[1:]:
        b = vs[name]
        c: dict[str, Any] = {"output_tokens_per_s": {ref: a["output_tokens_per_s"], name: b["output_tokens_per_s"],
                                                     "ratio": ratio(a["output_tokens_per_s"], b["output_tokens_per_s"])}}
        for cls in ("short", "long"):
            c[cls] = {m: {q: {ref: a[cls][m].get(q), name: b[cls][m].get(q), "ratio": ratio(b[cls][m].get(q),
                                                                                          a[cls][m].get(q))}
                          for q in ("p50", "p99")} for m, _, _ in METRICS}
        c["greedy_texts"] = text_agreement(a, b)
        out["vs"][name] = c
    return out


# ---- tables ------------------------------------------------------------------------------

def _q(cls: str, metric: str, qs: tuple[str, ...], scale: float = 1.0) -> Any:
    return lambda v: tuple(scale * x if x is not None else None for x in (_p(v, cls, metric, q) for q in qs))


COLUMNS = [  # (header, figures of a variant, format)
    ("tok/s", lambda v: (v["output_tokens_per_s"],), "{:.0f}"),
    ("short TTFT p50/p99 s", _q("short", "ttft", ("p50", "p99")), "{:.2f}/{:.2f}"),
    ("short ITL mean/p50/p99 ms", _q("short", "itl", ("mean", "p50", "p99"), 1000), "{:.0f}/{:.0f}/{:.0f}"),
    ("short e2e p50/p90/p99 s", _q("short", "e2e", ("p50", "p90", "p99")), "{:.1f}/{:.1f}/{:.1f}"),
    ("out tok short/long", lambda v: (_p(v, "short", "output_tokens", "mean"), _p(v, "long", "output_tokens", "mean")),
     "{:.0f}/{:.0f}"),
    ("long TTFT p50 s", _q("long", "ttft", ("p50",)), "{:.2f}"),
    ("long ITL mean ms", _q("long", "itl", ("mean",), 1000), "{:.0f}"),
    ("long e2e p50/p90/p99 s", _q("long", "e2e", ("p50", "p90", "p99")), "{:.1f}/{:.1f}/{:.1f}"),
    ("KV blocks", lambda v: (v["metrics"]["num_kv_blocks"],), "{:.0f}"),
    ("max run", lambda v: (v["metrics"]["max_running"],), "{:.0f}"),
    ("KV max", lambda v: (100 * v["metrics"]["max_kv_usage"],), "{:.0f}%"),
    ("preempt", lambda v: (v["metrics"]["preemptions"],), "{:.0f}"),
    ("waited on", lambda v: (v["metrics"]["dominant_wait_reason"] or "-",), "{}"),
    ("server cores", lambda v: (cores_used(v),), "{:.1f}"),
]


def _cell(v: dict, fn: Any, fmt: str) -> str:
    try:
        return fmt.format(*fn(v))
    except (TypeError, KeyError, ValueError):
        return "-"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = [["variant"] + [h for h, _, _ in COLUMNS]]
    for name, v in results["variants"].items():
        rows.append([name] + [_cell(v, fn, fmt) for _, fn, fmt in COLUMNS] if _ok(v) else
                    [name, f"error: {v.get('error', 'no figures')}"[:80]] + [""] * (len(COLUMNS) - 1))
    return rows


def print_table(results: dict[str, Any]) -> None:
    print(text_table(table_rows(results)) + "\n")
    for line in results["analysis"]["answer"]:
        print("- " + line)


# ---- report.md ---------------------------------------------------------------------------

def _budget_text(results: dict[str, Any]) -> str:
    """The KV budget's arithmetic: how many requests each admission mode fits in it."""
    st = results["settings"]
    blocks, bs, full = st["kv_budget_blocks"] - 1, st["block_size"], st["max_model_len"]
    return (f"KV budget of the admission variants: --num-kv-blocks {blocks + 1} = {blocks} usable blocks of {bs} "
            f"tokens = {st['kv_budget_seqs']} sequences of max_model_len {full}. Under reserve-max-len every request "
            f"holds max_model_len: {blocks // math.ceil(full / bs)} requests fit at {full}, "
            f"{blocks // math.ceil(full // 2 / bs)} at {full // 2} (of {st['max_num_seqs']} slots), so there "
            "max_model_len governs concurrency, as the seed assumes; under reserve a request holds prompt + "
            "max_tokens and under on-demand the tokens computed so far, neither of which depends on max_model_len.")


def side_by_side_md(results: dict[str, Any]) -> list[str]:
    """One table per server against the first: values, and ratios (> 1: the first is better)."""
    comp = results["analysis"]["comparison"]
    ref, lines = comp["reference"], ["## Side by side", ""]
    for name, c in comp["vs"].items():
        def row(label: str, d: dict, unit: str, scale: float = 1.0, fmt: str = "{:.3g}") -> list[str]:
            val = [None if d[k] is None else d[k] * scale for k in (ref, name)]
            return [label, num(val[0], unit, fmt), num(val[1], unit, fmt), num(d["ratio"], "x", "{:.2f}")]

        rows = [["", ref, name, f"{ref} better by"], row("output tokens/s", c["output_tokens_per_s"], "", fmt="{:.1f}")]
        rows += [row(f"{cls} {m.upper()} {q}", c[cls][m][q], unit, scale)
                 for cls in ("short", "long") for m, unit, scale in METRICS for q in ("p50", "p99")]
        g, d = c["greedy_texts"], c["greedy_texts"]["first_difference"]
        lines += [f"### {ref} vs {name}", "", md_table(rows), "",
                  f"Ratios: output tokens/s {ref} / {name}; latencies {name} / {ref}. Greedy texts: "
                  f"{g['identical']} of {g['compared']} requests identical"
                  + (f"; first difference in request {d['request']} after {d['common_prefix_chars']} characters: "
                     f"{d['a']!r} vs {d['b']!r}" if d else "") + ". Prompt tokens (usage): "
                  + (f"the same count on both in {g['prompt_tokens_equal']} of {g['prompt_tokens_compared']} requests."
                     if g["prompt_tokens_equal"] is not None else "not reported by both servers."), ""]
    return lines


def server_text(v: dict) -> str:
    """In words: how the bench talked to this server, and what it could not measure there."""
    if "capabilities" not in v:
        return f"not measured: {v.get('error', 'no figures')}"
    caps = v["capabilities"]
    said = [f"model `{caps['model']}`" if caps["model"] else "no model name from /v1/models (requests name none)",
            f"{caps['prompts']} prompts"]
    said += [f"refused {dict(include_usage='stream_options.include_usage', logprobs='logprobs=0').get(f, f)} "
             f"({answer[:120]})" for f, answer in caps["refused"].items()]
    lengths = (f"finish reasons {', '.join(f'{k} {n}' for k, n in v['finish_reasons'].items())}; mean output "
               f"tokens short {num(_p(v, 'short', 'output_tokens', 'mean'), '', '{:.1f}')}, long "
               f"{num(_p(v, 'long', 'output_tokens', 'mean'), '', '{:.1f}')}")
    if caps["ignore_eos"]:
        said.append("ignore_eos sent, " + ("output lengths exact" if v["exact_lengths"] else
                                           f"but output lengths were not exact ({lengths})"))
    else:
        said.append(f"no ignore_eos sent, so output lengths follow the model ({lengths})")
    missing = []
    if not caps["usage"]:
        missing.append("usage: prompt tokens not known, output tokens counted from the streamed chunks")
    elif v.get("prompt_tokens"):
        said.append(f"prompt tokens from usage: mean {v['prompt_tokens']['mean']:.0f}, "
                    f"total {v['prompt_tokens']['total']:.0f}")
    if caps["timing"] == "chunks":
        missing.append("per-token ITL (timed per streamed chunk)")
    if not caps["metrics"]:
        missing.append("running / waiting / KV usage / preemptions (no /metrics with a series the bench knows)")
    elif not v["metrics"]["waiting_by_reason_s"]:
        missing.append("why requests waited (no waiting-by-reason series)")
    return "; ".join(said) + ". Not measured: " + ("; ".join(missing) or "nothing") + "."


TIMING_TEXT = {"text": "one chunk per token, from the stream's text chunks",
               "logprobs": "each token's chunk (logprobs=0 asked for, as some tokens decode to no text)",
               "chunks": "per SSE chunk (approximate: a chunk may hold several tokens)"}


def write_report(results: dict[str, Any], out_dir: str) -> str:
    st, m, an = results["settings"], results["machine"], results["analysis"]
    targets = st.get("targets") or []
    vs = results["variants"]
    lines = ["# Mixed short/long online bench", "",
             f"{results['started']}, {results['total_s'] / 60:.1f} minutes. Generated by `python bench/mixed.py`"
             + (" from a run that did not finish." if results.get("partial") else "."), "", "## Answer", ""]
    lines += [f"- {a}" for a in an["answer"]] + [""]
    if not targets:
        lines += [f"A \"sharp fall\" is short-request p99 e2e at least {SHARP}x lower at half max_model_len. Waiting "
                  "reasons are request-seconds integrated from `taxirank:num_requests_waiting_by_reason` samples.", ""]
    if an.get("comparison"):
        lines += side_by_side_md(results)
    lines += ["## Results", "", md_table(table_rows(results)), "",
              "Client-side TTFT, ITL and e2e; tok/s: output tokens from the first request sent to the last token. "
              "`server cores`: the server's CPU seconds over the run's wall time. `-`: not measured.", ""]
    if an["halving"]:
        lines += ["### Halving max_model_len, per KV admission mode", "", md_table(
            [["mode", "short p99 e2e full -> half", "fall", "short p99 TTFT full -> half", "tok/s full -> half",
              "max running full -> half", "waited on (full / half)", "preemptions full / half"]]
            + [[mode, f"{h['short_p99_e2e_full']:.1f} s -> {h['short_p99_e2e_half']:.1f} s", f"{h['fall']:.2f}x",
                f"{h['short_p99_ttft_full']:.1f} s -> {h['short_p99_ttft_half']:.1f} s",
                f"{h['output_tokens_per_s_full']:.0f} -> {h['output_tokens_per_s_half']:.0f}",
                f"{num(h['max_running_full'])} -> {num(h['max_running_half'])}",
                f"{h['dominant_wait_reason_full']} / {h['dominant_wait_reason_half']}",
                f"{num(h['preemptions_full'])} / {num(h['preemptions_half'])}"] for mode, h in an["halving"].items()]),
            ""]
    lo_hi = st["prompt_len"].replace(",", "..")
    prompts = (f"{lo_hi} words of generated prose" if st.get("prompt_kind") == "text"
               else f"{lo_hi} random token ids (vocabulary {st['vocab_size']})")
    timings = sorted({v["token_timing"] for v in vs.values() if v.get("token_timing")})
    lines += ["## Settings", "",
              f"- Workload: {st['num_requests']} requests, half max_tokens={st['short']} and half {st['long']}, "
              f"shuffled (seed {st['seed']}); prompts of {prompts}; temperature 0, streamed; "
              + (f"Poisson arrivals at {st['rate']} requests/s." if st["rate"] else "all sent at once."),
              "- Token timing: " + ("; ".join(TIMING_TEXT[t] for t in timings) or "none") + "."]
    if targets:
        lines += ["- Servers, one after the other, the same requests to each:", ""]
        lines += [f"  - {t['name']}: " + (f"`{t['command']}`" if t.get("command") else t["url"]) for t in targets]
        lines += ["", "### What each server took, and what could not be measured", ""]
        lines += [f"- {t['name']}: {server_text(vs.get(t['name']) or {})}" for t in targets]
    else:
        lines += ["- ignore_eos on every request, so output lengths are exact.",
                  f"- Model `{st['model']}`; max_num_seqs {st['max_num_seqs']}, block size {st['block_size']}, "
                  f"max_model_len {st['max_model_len']} (full) or {st['max_model_len'] // 2} (half)"
                  + (f", extra server flags `{st['server_args']}`" if st["server_args"] else "") + ".",
                  f"- {_budget_text(results)}", "", "| variant | server flags |", "|---|---|"]
        lines += [f"| {n} | `{' '.join(flags_to_argv(v['flags']))}` |" for n, v in vs.items()]
    la = "/".join(f"{x:.1f}" for x in results["loadavg_start"]), "/".join(f"{x:.1f}" for x in results["loadavg_end"])
    lines += ["", "## Machine", "", f"- {m.get('cpu')}, {m.get('cores')} cores; Python {m.get('python')}, JAX "
              f"{m.get('jax')} ({m.get('jax_backend')}); load average {la[0]} at start, {la[1]} at the end.", "",
              "## Plots", ""] + [f"![{p}]({p})" for p in results.get("plots", [])]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


# ---- plots -------------------------------------------------------------------------------

def client_view(v: dict, points: int = 300) -> dict[str, list[float]] | None:
    """Requests in flight over time as the client saw them: waiting for their first token,
    and streaming (first token in, not finished). Needs no server metrics."""
    reqs = [r for r in v.get("per_request") or [] if r["e2e"] is not None]
    if not reqs:
        return None
    end = max(r["start"] + r["e2e"] for r in reqs)
    ts = [end * i / points for i in range(points + 1)]
    first = [r["start"] + (r["ttft"] if r["ttft"] is not None else r["e2e"]) for r in reqs]
    return {"t": ts, "awaiting": [sum(r["start"] <= t < f for r, f in zip(reqs, first)) for t in ts],
            "streaming": [sum(f <= t < r["start"] + r["e2e"] for r, f in zip(reqs, first)) for t in ts]}


def _plot_client_view(ax: Any, cv: dict) -> None:
    ax.stackplot(cv["t"], cv["streaming"], cv["awaiting"], step="post", alpha=0.6,
                 labels=["streaming tokens", "waiting for the first token"])
    ax.set_ylabel("requests")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")


def _plot_timeline(plt: Any, name: str, v: dict, out_dir: str) -> str | None:
    """The server's view from /metrics (running, waiting by reason, KV usage), else the client's."""
    tl, fname = v.get("timeline"), f"timeline-{name.replace('/', '-')}.png"
    if not tl or not tl["t"]:
        cv = client_view(v)
        if not cv:
            return None
        fig, ax = plt.subplots(figsize=(9, 4))
        _plot_client_view(ax, cv)
        ax.set(title=f"{name}: no /metrics, the client's view", xlabel="seconds since the first request")
        return save_figure(fig, os.path.join(out_dir, fname))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(2, 1))
    t = tl["t"]
    reasons = {r: col for r, col in tl["waiting_by_reason"].items() if any(col)}
    if reasons:
        top.stackplot(t, *reasons.values(), labels=[f"waiting: {r}" for r in reasons], alpha=0.5, step="post")
    elif any(x is not None for x in tl["waiting"]):
        top.step(t, [x or 0 for x in tl["waiting"]], where="post", label="waiting")
    top.step(t, [x or 0 for x in tl["running"]], where="post", color="black", label="running")
    f = v.get("flags") or {}
    keys = ("scheduling", "kv_admission", "max_model_len", "num_kv_blocks", "max_num_seqs")
    top.set(ylabel="requests", title=f"{name}\n" + (", ".join(f"{k} {f[k]}" for k in keys if k in f) or "as it runs"))
    top.legend(fontsize=8, loc="upper right")
    top.grid(True, alpha=0.3)
    bottom.step(t, [100 * x if x is not None else math.nan for x in tl["kv_usage"]], where="post", color="tab:red")
    pre = [x for x in tl["preemptions"] if x is not None]
    bottom.set(ylabel="KV usage %", xlabel="seconds since the first request", ylim=(0, 105),
               title=f"preemptions: {pre[-1]:.0f}" if pre else None)
    bottom.grid(True, alpha=0.3)
    return save_figure(fig, os.path.join(out_dir, fname))


def write_plots(results: dict[str, Any], out_dir: str) -> list[str]:
    """cdf_short_e2e.png (all variants), timeline-<variant>.png, and with two or more servers
    timeline_side_by_side.png; the file names written."""
    plt = pyplot()
    vs = results["variants"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, v in vs.items():
        xs = sorted(r["e2e"] for r in v.get("per_request", []) if r["class"] == "short" and r["e2e"] is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set(xscale="log", xlabel="short-request end-to-end latency (s, log)", ylabel="fraction of short requests",
           title=f"CDF of short-request (max_tokens={results['settings']['short']}) e2e latency")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    written = [save_figure(fig, os.path.join(out_dir, "cdf_short_e2e.png"))]
    written += [p for p in (_plot_timeline(plt, n, v, out_dir) for n, v in vs.items()) if p]
    side = [t["name"] for t in results["settings"].get("targets") or [] if client_view(vs[t["name"]])]
    if len(side) >= 2:
        fig, axes = plt.subplots(len(side), 1, figsize=(9, 2.6 * len(side)), sharex=True, sharey=True, squeeze=False)
        for ax, name in zip(axes[:, 0], side):
            _plot_client_view(ax, client_view(vs[name]))
            ax.set_title(f"{name}: {vs[name]['output_tokens_per_s']:.1f} output tok/s", fontsize=10)
        axes[-1, 0].set_xlabel("seconds since the first request")
        fig.suptitle("The same workload, one server after the other (client's view)", fontsize=11)
        written.append(save_figure(fig, os.path.join(out_dir, "timeline_side_by_side.png")))
    return written
