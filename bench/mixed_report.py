"""bench/mixed.py's results, read: the answer to the seed's question, the terminal table,
report.md and the plots. Takes the results dict mixed.py builds (and writes as results.json).
"""

from __future__ import annotations

import math
import os
from typing import Any

SHARP = 1.5  # "short-request p99 fell sharply": at least this many times lower at half length
REASON_MEANS = {"kv_blocks": "KV blocks", "max_num_seqs": "compute (all max_num_seqs slots busy)",
                "token_budget": "compute (the step's token budget)", "static_batch": "the static batch to drain"}
HOLDS = {"on-demand": "blocks for the tokens computed so far", "reserve": "blocks for prompt + max_tokens",
         "reserve-max-len": "blocks for max_model_len"}


def _ok(v: dict | None) -> bool:
    return bool(v) and "error" not in v and "short" in v


def _p(v: dict, cls: str, metric: str, q: str) -> float | None:
    return v[cls].get(metric, {}).get(q)


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _num(x: float | None, unit: str = "", fmt: str = "{:.3g}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return (f"{x:.0f}" if fmt == "{:.3g}" and abs(x) >= 1000 else fmt.format(x)) + unit  # 13744 ms, not 1.37e+04


def _times(ratio: float) -> str:
    """old/new as words: '2.50x lower' or '1.20x higher'."""
    return f"{ratio:.2f}x lower" if ratio >= 1 else f"{1 / ratio:.2f}x higher"


def _reason_text(v: dict) -> str:
    m = v["metrics"]
    by, total = m["waiting_by_reason_s"], m["waiting_request_s"]
    if not by:
        return "the server reports no waiting-by-reason"
    if not m["dominant_wait_reason"]:
        return "no request waited"
    share = by[m["dominant_wait_reason"]] / max(sum(by.values()), 1e-9)
    return (f"{total:.0f} request-s spent waiting, {share:.0%} of it on {m['dominant_wait_reason']}"
            + (f" (max running {m['max_running']:.0f}" + (f" of {v['flags']['max_num_seqs']} slots)"
                                                         if "max_num_seqs" in (v.get("flags") or {}) else ")")
               if m["max_running"] is not None else ""))


def cores_used(v: dict) -> float | None:
    """CPU cores the server process got during the run (its CPU seconds / wall seconds)."""
    cpu = (v.get("load") or {}).get("server_cpu_s")
    return cpu / v["duration_s"] if cpu is not None and v.get("duration_s") else None


def _why(mode: str, h: dict, full: dict, half: dict) -> str:
    """What the halving shows, beyond the seed's rule of thumb, from the two runs' figures."""
    kv, sharp = h["dominant_wait_reason_full"] == "kv_blocks", h["fell_sharply"]
    run = f"{h['max_running_full']:.0f} -> {h['max_running_half']:.0f}"
    tps = h["output_tokens_per_s_half"] / h["output_tokens_per_s_full"]
    if kv and mode == "reserve-max-len":
        text = f"Halving doubled the requests that fit (max running {run}) and output tokens/s rose {tps:.2f}x"
        if sharp:
            text += ": the seed's rule (a sharp fall means KV blocks) holds."
        else:
            itl = [v["long"]["itl"].get("mean", math.nan) * 1000 for v in (full, half)]
            text += (f", no more, because a step of more sequences costs more here (long-request ITL mean "
                     f"{itl[0]:.0f} -> {itl[1]:.0f} ms): the queue drained only that much faster. The seed's rule "
                     "assumes decode steps that cost about the same at any batch size (a memory-bound GPU); the "
                     "waiting reason, not the size of the fall, is what says KV blocks.")
    elif kv:
        text = (f"But {mode} holds {HOLDS[mode]}, which max_model_len does not change (max running {run}): halving it "
                "frees no blocks" + (", so this fall does not come from admission: compare output tokens/s "
                                     f"({tps:.2f}x) and the machine load." if sharp else ", and p99 did not fall."))
    elif sharp:
        text = (f"p99 fell without waits on KV blocks (output tokens/s {tps:.2f}x): not the seed's KV story; "
                "compare the machine load of the two runs.")
    else:
        text = (f"Requests waited mostly on {h['dominant_wait_reason_full'] or 'nothing'}, not KV blocks, and p99 "
                "barely moved: the seed's rule holds (it was not KV).")
    c = [cores_used(v) for v in (full, half)]
    if None not in c and min(c) < 0.75 * max(c):
        text += (f" Caution: the server got {c[0]:.1f} cores at full length and {c[1]:.1f} at half (something else "
                 "was running): this pair's timings are not comparable.")
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
            f"Continuous vs static: {cs['output_tokens_per_s_ratio']:.2f}x the output tokens/s; short-request "
            f"p99 e2e {_times(cs['short_p99_e2e_ratio'])} under continuous ({_p(s, 'short', 'e2e', 'p99'):.3g} s -> "
            f"{_p(c, 'short', 'e2e', 'p99'):.3g} s).")
    modes = sorted({v["admission"] for v in vs.values() if v.get("admission")}, key=str)
    for mode in modes:
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
            h |= {f"max_model_len_{tag}": v["flags"]["max_model_len"],
                  f"short_p99_e2e_{tag}": _p(v, "short", "e2e", "p99"),
                  f"short_p99_ttft_{tag}": _p(v, "short", "ttft", "p99"),
                  f"output_tokens_per_s_{tag}": v["output_tokens_per_s"], f"max_running_{tag}": m["max_running"],
                  f"preemptions_{tag}": m["preemptions"], f"waiting_by_reason_s_{tag}": m["waiting_by_reason_s"],
                  f"dominant_wait_reason_{tag}": m["dominant_wait_reason"]}
        h["seed_rule_holds"] = h["fell_sharply"] == (reason == "kv_blocks")
        h["why"] = _why(mode, h, full, half)
        out["halving"][mode] = h
        out["answer"].append(
            f"{mode}: short-request p99 e2e {p_full:.3g} s at max_model_len {h['max_model_len_full']} -> "
            f"{p_half:.3g} s at {h['max_model_len_half']} ("
            + _times(fall)
            + f": {'fell sharply' if h['fell_sharply'] else 'no sharp fall'}). At full length {_reason_text(full)}"
            + (f": requests were queueing on {h['queued_on']}. " if reason else ". ")
            + h["why"])
    if out["halving"]:
        hs = out["halving"]
        kv = [m for m, h in hs.items() if h["dominant_wait_reason_full"] == "kv_blocks"]
        sharp = [m for m, h in hs.items() if h["fell_sharply"]]
        other = [f"{m} on {h['queued_on'] or 'nothing (none waited)'}" for m, h in hs.items() if m not in kv]
        more = [f"{m} ({h['max_running_full']:.0f} -> {h['max_running_half']:.0f})" for m, h in hs.items()
                if (h["max_running_half"] or 0) > (h["max_running_full"] or 0)]
        out["answer"].append(
            f"So: halving max_model_len made short-request p99 fall sharply under {', '.join(sharp) or 'no mode'}. "
            f"Requests queued on KV blocks under {', '.join(kv) or 'no mode'}"
            + (f"; under {'; '.join(other)}" if other else "")
            + f". Halving let more requests run at once only under {', '.join(more) or 'no mode'}.")
    targets = [t["name"] for t in results["settings"].get("targets") or []]
    for name in targets:
        v = vs.get(name)
        if not _ok(v):
            out["answer"].append(f"{name}: not measured ({(v or {}).get('error', 'no figures')}).")
            continue
        out["answer"].append(
            f"{name}: {v['output_tokens_per_s']:.1f} output tokens/s; short-request e2e p50 "
            f"{_num(_p(v, 'short', 'e2e', 'p50'), ' s')}, p99 {_num(_p(v, 'short', 'e2e', 'p99'), ' s')}; "
            f"{v['errors']} of {v['requests']} requests failed"
            + (f"; {_reason_text(v)}" if v["metrics"]["waiting_by_reason_s"] else "") + ".")
    ok = [n for n in targets if _ok(vs.get(n))]
    if len(ok) >= 2:
        out["comparison"] = compare(vs, ok)
        ref = ok[0]
        for name, c in out["comparison"]["vs"].items():
            tps, p99, g = c["output_tokens_per_s"], c["short"]["e2e"]["p99"], c["greedy_texts"]
            out["answer"].append(
                f"{ref} vs {name}: {_x(tps['ratio'])} the output tokens/s ({tps[ref]:.1f} vs {tps[name]:.1f}); "
                f"short-request p99 e2e {_times(p99['ratio']) if p99['ratio'] else 'not comparable'} under {ref} "
                f"({_num(p99[ref], ' s')} vs {_num(p99[name], ' s')}); greedy texts identical in {g['identical']} "
                f"of {g['compared']} requests.")
    return out


# ---- side by side --------------------------------------------------------------------

RATIO_MEANING = ("ratio > 1: the reference (the first server) is better: its output tokens/s over the other's, "
                 "the other's latency over its own")


def _ratio(num: float | None, den: float | None) -> float | None:
    ok = num is not None and den is not None and not math.isnan(num) and not math.isnan(den) and den > 0
    return num / den if ok else None


def _prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def text_agreement(a: dict, b: dict) -> dict[str, Any]:
    """Do two servers' greedy completions of the same requests match, text for text?"""
    pairs = [(i, x["text"], y["text"]) for i, (x, y) in enumerate(zip(a["per_request"], b["per_request"]))
             if not x["error"] and not y["error"] and x.get("text") is not None and y.get("text") is not None]
    diff = [(i, x, y) for i, x, y in pairs if x != y]
    first = None
    if diff:
        i, x, y = diff[0]
        k = _prefix(x, y)
        first = {"request": i, "common_prefix_chars": k, "a": x[max(0, k - 20):k + 40], "b": y[max(0, k - 20):k + 40]}
    counts = [(x.get("prompt_tokens"), y.get("prompt_tokens")) for x, y in zip(a["per_request"], b["per_request"])]
    known = [(x, y) for x, y in counts if x is not None and y is not None]
    return {"compared": len(pairs), "identical": len(pairs) - len(diff),
            # the same prompt text made the same number of tokens on both (from usage; None: not reported)
            "prompt_tokens_equal": sum(x == y for x, y in known) if known else None, "prompt_tokens_compared": len(known),
            "mean_common_prefix": (sum(_prefix(x, y) / max(len(x), len(y), 1) for _, x, y in pairs) / len(pairs)
                                   if pairs else None),
            "first_difference": first}


def compare(vs: dict[str, dict], names: list[str]) -> dict[str, Any]:
    """Each server against the first: output tokens/s, TTFT / ITL / TPOT / e2e p50 and p99
    per class, each as both values and a ratio (> 1: the first is better), and the texts."""
    ref, out = names[0], {"reference": names[0], "ratio_meaning": RATIO_MEANING, "vs": {}}
    a = vs[ref]
    for name in names[1:]:
        b = vs[name]
        c: dict[str, Any] = {"output_tokens_per_s": {ref: a["output_tokens_per_s"], name: b["output_tokens_per_s"],
                                                     "ratio": _ratio(a["output_tokens_per_s"],
                                                                     b["output_tokens_per_s"])}}
        for cls in ("short", "long"):
            c[cls] = {m: {q: {ref: a[cls][m].get(q), name: b[cls][m].get(q),
                              "ratio": _ratio(b[cls][m].get(q), a[cls][m].get(q))} for q in ("p50", "p99")}
                      for m in ("ttft", "itl", "tpot", "e2e")}
        c["greedy_texts"] = text_agreement(a, b)
        out["vs"][name] = c
    return out


# ---- table -------------------------------------------------------------------------

COLUMNS = [  # (header, function of a variant, format)
    ("tok/s", lambda v: v["output_tokens_per_s"], "{:.0f}"),
    ("short TTFT p50/p99 s", lambda v: (_p(v, "short", "ttft", "p50"), _p(v, "short", "ttft", "p99")), "{:.2f}/{:.2f}"),
    ("short ITL mean/p50/p99 ms", lambda v: tuple(1000 * (_p(v, "short", "itl", q) or math.nan)
                                                  for q in ("mean", "p50", "p99")), "{:.0f}/{:.0f}/{:.0f}"),
    ("short e2e p50/p90/p99 s", lambda v: tuple(_p(v, "short", "e2e", q) for q in ("p50", "p90", "p99")),
     "{:.1f}/{:.1f}/{:.1f}"),
    ("out tok short/long", lambda v: (_p(v, "short", "output_tokens", "mean"), _p(v, "long", "output_tokens", "mean")),
     "{:.0f}/{:.0f}"),
    ("long TTFT p50 s", lambda v: _p(v, "long", "ttft", "p50"), "{:.2f}"),
    ("long ITL mean ms", lambda v: 1000 * (_p(v, "long", "itl", "mean") or math.nan), "{:.0f}"),
    ("long e2e p50/p90/p99 s", lambda v: tuple(_p(v, "long", "e2e", q) for q in ("p50", "p90", "p99")),
     "{:.1f}/{:.1f}/{:.1f}"),
    ("max run", lambda v: v["metrics"]["max_running"], "{:.0f}"),
    ("KV max", lambda v: 100 * v["metrics"]["max_kv_usage"], "{:.0f}%"),
    ("preempt", lambda v: v["metrics"]["preemptions"], "{:.0f}"),
    ("waited on", lambda v: v["metrics"]["dominant_wait_reason"] or "-", "{}"),
    ("server cores", cores_used, "{:.1f}"),
]


def _cell(v: dict, fn: Any, fmt: str) -> str:
    try:
        x = fn(v)
        return fmt.format(*x) if isinstance(x, tuple) else fmt.format(x)
    except (TypeError, KeyError, ValueError):
        return "-"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = [["variant"] + [h for h, _, _ in COLUMNS]]
    for name, v in results["variants"].items():
        if not _ok(v):
            rows.append([name, f"error: {v.get('error', 'no figures')}"[:80]] + [""] * (len(COLUMNS) - 1))
        else:
            rows.append([name] + [_cell(v, fn, fmt) for _, fn, fmt in COLUMNS])
    return rows


def print_table(results: dict[str, Any]) -> None:
    rows = table_rows(results)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print()
    for line in results["analysis"]["answer"]:
        print("- " + line)


# ---- report.md ---------------------------------------------------------------------

def _md_table(rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
                     + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def _budget_text(results: dict[str, Any]) -> str:
    """The KV budget's arithmetic: how many requests each admission mode fits in it."""
    st, vs = results["settings"], results["variants"]
    blocks, bs, full = st["kv_budget_blocks"] - 1, st["block_size"], st["max_model_len"]
    half = full // 2
    per = {}  # mean reserve blocks per class, from the workload actually sent
    for v in vs.values():
        for r in v.get("per_request", []):
            per.setdefault(r["class"], []).append(math.ceil((r["prompt_len"] + r["max_tokens"]) / bs))
        if per:
            break
    mean = {k: sum(x) / len(x) for k, x in per.items()}
    mix = st["max_num_seqs"] / 2 * (mean.get("short", 0) + mean.get("long", 0))
    return (f"KV budget of the admission variants: --num-kv-blocks {blocks + 1} = {blocks} usable blocks of {bs} "
            f"tokens = {blocks * bs} tokens = {st['kv_budget_seqs']} sequences of max_model_len {full}. "
            f"Under reserve-max-len every request holds max_model_len: {blocks // math.ceil(full / bs)} requests fit "
            f"at {full}, {blocks // math.ceil(half / bs)} at {half} (of {st['max_num_seqs']} slots), so there "
            f"max_model_len governs concurrency, as the seed assumes. Under reserve a request holds prompt + "
            f"max_tokens (on average {mean.get('short', 0):.1f} blocks short, {mean.get('long', 0):.1f} long in this "
            f"workload: {st['max_num_seqs']} requests half and half need ~{mix:.0f} of {blocks} blocks, more as "
            f"short ones finish and long ones take their slots), and under "
            f"on-demand only the tokens computed so far; neither depends on max_model_len.")


def write_report(results: dict[str, Any], out_dir: str) -> str:
    st, m, an = results["settings"], results["machine"], results["analysis"]
    targets = st.get("targets") or []
    lines = ["# Mixed short/long online bench", "",
             f"{results['started']}, {results['total_s'] / 60:.1f} minutes. Generated by `python bench/mixed.py`"
             + (" from a run that did not finish: only the servers before it stopped are here." if results.get("partial")
                else "."), "", "## Answer", ""] + [f"- {a}" for a in an["answer"]] + [""]
    if not targets:
        lines += [f"A \"sharp fall\" is short-request p99 e2e at least {SHARP}x lower at half max_model_len. Waiting "
                  "reasons are request-seconds integrated from the server's "
                  "`taxirank:num_requests_waiting_by_reason` samples (~10 per second), not inferred.", ""]
    if an.get("comparison"):
        lines += side_by_side_md(results)
    lines += ["## Results", "", _md_table(table_rows(results)), "",
              "TTFT, ITL and e2e as the client measured them (streamed tokens); tok/s: output tokens over the time "
              "from the first request sent to the last token. `out tok`: mean output tokens per request of each "
              "class. `waited on`: the reason with the most waiting "
              "request-seconds. `server cores`: the server process's CPU seconds over the run's wall time; a "
              "variant that got fewer cores than its peers ran while something else competed for the machine. "
              "`-`: not measured (see below).", ""]
    if an["halving"]:
        lines += ["### Halving max_model_len, per KV admission mode", "",
                  _md_table([["mode", "short p99 e2e full -> half", "fall", "short p99 TTFT full -> half",
                              "tok/s full -> half", "max running full -> half", "waited on (full / half)",
                              "preemptions full / half"]]
                            + [[mode, f"{h['short_p99_e2e_full']:.1f} s -> {h['short_p99_e2e_half']:.1f} s",
                                f"{h['fall']:.2f}x",
                                f"{h['short_p99_ttft_full']:.1f} s -> {h['short_p99_ttft_half']:.1f} s",
                                f"{h['output_tokens_per_s_full']:.0f} -> {h['output_tokens_per_s_half']:.0f}",
                                f"{h['max_running_full']:.0f} -> {h['max_running_half']:.0f}",
                                f"{h['dominant_wait_reason_full']} / {h['dominant_wait_reason_half']}",
                                f"{h['preemptions_full']:.0f} / {h['preemptions_half']:.0f}"]
                               for mode, h in an["halving"].items()]), ""]
    text = st.get("prompt_kind") == "text"
    prompts = (f"{st['prompt_len'].replace(',', '..')} words of generated prose (the servers' usage counts their "
               "tokens)" if text else f"{st['prompt_len'].replace(',', '..')} random token ids (vocabulary "
                                      f"{st['vocab_size']})")
    lines += ["## Settings", "",
              f"- Workload: {st['num_requests']} requests, half max_tokens={st['short']} and half {st['long']}, "
              f"shuffled (seed {st['seed']}); prompts of {prompts}; temperature 0, streamed; "
              + (f"Poisson arrivals at {st['rate']} requests/s." if st["rate"] else "all sent at once."),
              f"- Token timing: {_timing_text(results)}."]
    if targets:
        lines += ["- Servers, one after the other, the same requests to each:", ""]
        lines += [f"  - {t['name']}: " + (f"`{t['command']}` (at {results['variants'].get(t['name'], {}).get('url')})"
                                          if t.get("command") else t["url"]) for t in targets]
        lines += ["", "### What each server took, and what could not be measured", ""]
        lines += [f"- {t['name']}: {server_text(results['variants'].get(t['name']) or {})}" for t in targets]
    else:
        lines += ["- ignore_eos on every request, so output lengths are exact.",
                  f"- Model `{st['model']}`; every variant: max_num_seqs {st['max_num_seqs']}, block size "
                  f"{st['block_size']}, max_model_len {st['max_model_len']} (full) or {st['max_model_len'] // 2} (half)"
                  + (f", extra server flags `{st['server_args']}`" if st["server_args"] else "") + ".",
                  "- continuous / static: the server's default KV cache for its config "
                  f"({_blocks(results, 'continuous')} usable blocks).", f"- {_budget_text(results)}", "",
                  "| variant | server flags |", "|---|---|"]
        lines += [f"| {n} | `{' '.join(_flags(v['flags']))}` |" for n, v in results["variants"].items()]
    lines += ["", "## Machine", "",
              f"- {m.get('cpu')}, {m.get('cores')} cores; Python {m.get('python')}, JAX {m.get('jax')} "
              f"({m.get('jax_backend')}); load average {_load(results['loadavg_start'])} at start, "
              f"{_load(results['loadavg_end'])} at the end.", "", "## Plots", ""]
    lines += [f"![{p}]({p})" for p in results.get("plots", [])]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def side_by_side_md(results: dict[str, Any]) -> list[str]:
    """One table per server against the first: values, and ratios (> 1: the first is better)."""
    comp = results["analysis"]["comparison"]
    ref, lines = comp["reference"], ["## Side by side", ""]
    for name, c in comp["vs"].items():
        def row(label: str, d: dict, unit: str, scale: float = 1.0, fmt: str = "{:.3g}") -> list[str]:
            val = [None if d[k] is None else d[k] * scale for k in (ref, name)]
            return [label, _num(val[0], unit, fmt), _num(val[1], unit, fmt), _x(d["ratio"])]

        rows = [["", ref, name, f"{ref} better by"], row("output tokens/s", c["output_tokens_per_s"], "", fmt="{:.1f}")]
        for cls in ("short", "long"):
            for metric, unit, scale in (("ttft", " s", 1), ("itl", " ms", 1000), ("tpot", " ms", 1000), ("e2e", " s", 1)):
                for q in ("p50", "p99"):
                    rows.append(row(f"{cls} {metric.upper()} {q}", c[cls][metric][q], unit, scale))
        g = c["greedy_texts"]
        lines += [f"### {ref} vs {name}", "", _md_table(rows), "",
                  f"Ratios: output tokens/s {ref} / {name}; latencies {name} / {ref}. Greedy texts: "
                  f"{g['identical']} of {g['compared']} requests identical"
                  + (f" (common prefix, over all requests: {100 * g['mean_common_prefix']:.0f}% of the longer text on "
                     "average)" if g["first_difference"] and g["mean_common_prefix"] is not None else "")
                  + (f"; first difference in request {g['first_difference']['request']} after "
                     f"{g['first_difference']['common_prefix_chars']} characters: {g['first_difference']['a']!r} vs "
                     f"{g['first_difference']['b']!r}" if g["first_difference"] else "") + ". Prompt tokens (usage): "
                  + (f"the same count on both in {g['prompt_tokens_equal']} of {g['prompt_tokens_compared']} requests."
                     if g["prompt_tokens_equal"] is not None else "not reported by both servers."), ""]
    return lines


FIELD = {"include_usage": "stream_options.include_usage", "logprobs": "logprobs=0"}


def server_text(v: dict) -> str:
    """In words: how the bench talked to this server, and what it could not measure there."""
    if "capabilities" not in v:
        return f"not measured: {v.get('error', 'no figures')}"
    caps, said = v["capabilities"], []
    said.append(f"model `{caps['model']}`" if caps["model"] else "no model name from /v1/models (requests name none)")
    said.append(f"{caps['prompts']} prompts")
    for f, answer in caps["refused"].items():
        said.append(f"refused {FIELD.get(f, f)} ({answer[:120]})")
    missing = []
    fr = ", ".join(f"{k} {n}" for k, n in v["finish_reasons"].items())
    lengths = (f"finish reasons {fr}; mean output tokens short "
               f"{_num(_p(v, 'short', 'output_tokens', 'mean'), '', '{:.1f}')}, "
               f"long {_num(_p(v, 'long', 'output_tokens', 'mean'), '', '{:.1f}')}")
    if caps["ignore_eos"]:
        said.append("ignore_eos sent" + (", output lengths exact" if v["exact_lengths"] else
                                         f", but output lengths were not exact ({lengths}): the server ignored it"))
    else:
        said.append(f"no ignore_eos sent, so output lengths follow the model ({lengths})")
    if not caps["usage"]:
        missing.append("usage: prompt tokens not known, output tokens counted from the streamed chunks "
                       "(a chunk may hold several tokens)")
    elif v.get("prompt_tokens"):
        said.append(f"prompt tokens from usage: mean {v['prompt_tokens']['mean']:.0f}, "
                    f"total {v['prompt_tokens']['total']:.0f}")
    if caps["timing"] == "chunks":
        missing.append("per-token ITL (timed per streamed chunk)")
    if not caps["metrics"]:
        missing.append("running / waiting / KV usage / preemptions (no /metrics with a series the bench knows; "
                       "the timeline shows the client's view)")
    elif not v["metrics"]["waiting_by_reason_s"]:
        missing.append("why requests waited (no waiting-by-reason series)")
    if v.get("error"):
        missing.append(f"the run: {v['error']}")
    return "; ".join(said) + ". Not measured: " + ("; ".join(missing) if missing else "nothing") + "."


def _flags(flags: dict) -> list[str]:
    return [f"--{k.replace('_', '-')} {v}" for k, v in flags.items()]


def _blocks(results: dict, name: str) -> str:
    v = results["variants"].get(name) or {}
    n = v.get("metrics", {}).get("num_kv_blocks")
    return "?" if n is None else f"{n:.0f}"


def _load(la: Any) -> str:
    return "/".join(f"{x:.1f}" for x in la)


TIMING_TEXT = {"text": "one chunk per token, from the stream's text chunks",
               "logprobs": "each token's chunk; requests ask for logprobs=0 because some tokens (most of a random "
                           "model's) decode to no text, and a server sends no chunk for those otherwise",
               "chunks": "per SSE chunk (approximate: the server may merge tokens into one chunk, and sends no usage "
                         "or no per-token count to check it by)"}


def _timing_text(results: dict) -> str:
    by = {n: v["token_timing"] for n, v in results["variants"].items() if v.get("token_timing")}
    kinds = set(by.values())
    if len(kinds) <= 1:
        return TIMING_TEXT.get(next(iter(kinds), ""), "none")
    return "; ".join(f"{n}: {TIMING_TEXT[t]}" for n, t in by.items())


# ---- plots -------------------------------------------------------------------------

def write_plots(results: dict[str, Any], out_dir: str) -> list[str]:
    """cdf_short_e2e.png (all variants) and timeline-<variant>.png; the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, v in results["variants"].items():
        xs = sorted(r["e2e"] for r in v.get("per_request", []) if r["class"] == "short" and r["e2e"] is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set(xscale="log", xlabel="short-request end-to-end latency (s, log)", ylabel="fraction of short requests",
           title=f"CDF of short-request (max_tokens={results['settings']['short']}) e2e latency")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "cdf_short_e2e.png"), dpi=110)
    plt.close(fig)
    written.append("cdf_short_e2e.png")

    for name, v in results["variants"].items():
        tl = v.get("timeline")
        if not tl or not tl["t"]:  # no /metrics: what the client saw
            if client_view(v):
                fig, ax = plt.subplots(figsize=(9, 4))
                _plot_client_view(ax, v)
                ax.set(title=f"{name}: no /metrics, the client's view", xlabel="seconds since the first request")
                fig.tight_layout()
                fname = f"timeline-{name.replace('/', '-')}.png"
                fig.savefig(os.path.join(out_dir, fname), dpi=110)
                plt.close(fig)
                written.append(fname)
            continue
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(2, 1))
        t = tl["t"]
        reasons = {r: col for r, col in tl["waiting_by_reason"].items() if any(col)}
        if reasons:
            top.stackplot(t, *reasons.values(), labels=[f"waiting: {r}" for r in reasons], alpha=0.5, step="post")
        elif any(x is not None for x in tl["waiting"]):
            top.step(t, [x or 0 for x in tl["waiting"]], where="post", label="waiting")
        top.step(t, [x or 0 for x in tl["running"]], where="post", color="black", label="running")
        top.set_ylabel("requests")
        top.set_title(f"{name}\n{_flags_short(v)}", fontsize=10)
        top.legend(fontsize=8, loc="upper right")
        top.grid(True, alpha=0.3)
        kv = [100 * x if x is not None else math.nan for x in tl["kv_usage"]]
        bottom.step(t, kv, where="post", color="tab:red", label="KV cache usage")
        pre = [x for x in tl["preemptions"] if x is not None]
        bottom.set(ylabel="KV usage %", xlabel="seconds since the first request", ylim=(0, 105),
                   title=f"preemptions: {pre[-1]:.0f}" if pre else None)
        bottom.grid(True, alpha=0.3)
        fig.tight_layout()
        fname = f"timeline-{name.replace('/', '-')}.png"
        fig.savefig(os.path.join(out_dir, fname), dpi=110)
        plt.close(fig)
        written.append(fname)
    side = [t["name"] for t in results["settings"].get("targets") or [] if client_view(results["variants"][t["name"]])]
    if len(side) >= 2:
        fig, axes = plt.subplots(len(side), 1, figsize=(9, 2.6 * len(side)), sharex=True, sharey=True, squeeze=False)
        for ax, name in zip(axes[:, 0], side):
            v = results["variants"][name]
            _plot_client_view(ax, v)
            tl = v.get("timeline") or {}
            if any(x is not None for x in tl.get("running") or []):
                ax.step(tl["t"], [x or 0 for x in tl["running"]], where="post", color="black", lw=1,
                        label="running (server /metrics)")
                ax.legend(fontsize=8, loc="upper right")
            ax.set_title(f"{name}: {v['output_tokens_per_s']:.1f} output tok/s", fontsize=10)
        axes[-1, 0].set_xlabel("seconds since the first request")
        fig.suptitle("The same workload, one server after the other (client's view)", fontsize=11)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "timeline_side_by_side.png"), dpi=110)
        plt.close(fig)
        written.append("timeline_side_by_side.png")
    return written


def client_view(v: dict, points: int = 300) -> dict[str, list[float]] | None:
    """Requests in flight over time as the client saw them: waiting for their first token,
    and streaming (first token in, not finished). Needs no server metrics."""
    reqs = [r for r in v.get("per_request") or [] if r["e2e"] is not None]
    if not reqs:
        return None
    end = max(r["start"] + r["e2e"] for r in reqs)
    ts = [end * i / points for i in range(points + 1)]
    first = [r["start"] + (r["ttft"] if r["ttft"] is not None else r["e2e"]) for r in reqs]
    return {"t": ts,
            "awaiting": [sum(r["start"] <= t < f for r, f in zip(reqs, first)) for t in ts],
            "streaming": [sum(f <= t < r["start"] + r["e2e"] for r, f in zip(reqs, first)) for t in ts]}


def _plot_client_view(ax: Any, v: dict) -> None:
    cv = client_view(v)
    ax.stackplot(cv["t"], cv["streaming"], cv["awaiting"], step="post", alpha=0.6,
                 labels=["streaming tokens", "waiting for the first token"])
    ax.set_ylabel("requests")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")


def _flags_short(v: dict) -> str:
    f = v.get("flags") or {}
    keys = ("scheduling", "kv_admission", "max_model_len", "num_kv_blocks", "max_num_seqs")
    return ", ".join(f"{k} {f[k]}" for k in keys if k in f) or "the server as it runs"
