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
    return v[cls][metric].get(q)


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
            + (f" (max running {m['max_running']:.0f} of {v['flags'].get('max_num_seqs', '?')} slots)"
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
    if "server" in vs and _ok(vs["server"]):
        out["answer"].append(f"The server: {_reason_text(vs['server'])}.")
    return out


# ---- table -------------------------------------------------------------------------

COLUMNS = [  # (header, function of a variant, format)
    ("tok/s", lambda v: v["output_tokens_per_s"], "{:.0f}"),
    ("short TTFT p50/p99 s", lambda v: (_p(v, "short", "ttft", "p50"), _p(v, "short", "ttft", "p99")), "{:.2f}/{:.2f}"),
    ("short ITL mean/p50/p99 ms", lambda v: tuple(1000 * (_p(v, "short", "itl", q) or math.nan)
                                                  for q in ("mean", "p50", "p99")), "{:.0f}/{:.0f}/{:.0f}"),
    ("short e2e p50/p90/p99 s", lambda v: tuple(_p(v, "short", "e2e", q) for q in ("p50", "p90", "p99")),
     "{:.1f}/{:.1f}/{:.1f}"),
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
    lines = ["# Mixed short/long online bench", "",
             f"{results['started']}, {results['total_s'] / 60:.1f} minutes. Generated by `python bench/mixed.py`.", "",
             "## Answer", ""] + [f"- {a}" for a in an["answer"]] + [""]
    lines += [f"A \"sharp fall\" is short-request p99 e2e at least {SHARP}x lower at half max_model_len. Waiting "
              "reasons are request-seconds integrated from the server's "
              "`taxirank:num_requests_waiting_by_reason` samples (~10 per second), not inferred.", "",
              "## Results", "", _md_table(table_rows(results)), "",
              "TTFT, ITL and e2e as the client measured them (streamed tokens); tok/s: output tokens over the time "
              "from the first request sent to the last token. `waited on`: the reason with the most waiting "
              "request-seconds. `server cores`: the server process's CPU seconds over the run's wall time; a "
              "variant that got fewer cores than its peers ran while something else competed for the machine.", ""]
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
    lines += ["## Settings", "",
              f"- Workload: {st['num_requests']} requests, half max_tokens={st['short']} and half {st['long']}, "
              f"shuffled (seed {st['seed']}); prompts of {st['prompt_len'].replace(',', '..')} random token ids "
              f"(vocabulary {st['vocab_size']}); temperature 0, ignore_eos, streamed; "
              + (f"Poisson arrivals at {st['rate']} requests/s." if st["rate"] else "all sent at once."),
              f"- Token timing: {_timing_text(results)}."]
    if st["url"]:
        info = results.get("server", {}).get("model", {})
        lines.append(f"- Server: {st['url']}, model `{info.get('id', '?')}`"
                     + (f", max_model_len {info['max_model_len']}" if info.get("max_model_len") else "")
                     + f", {_blocks(results, 'server')} KV blocks (from /metrics; ? where it has no such gauge).")
    else:
        lines += [f"- Model `{st['model']}`; every variant: max_num_seqs {st['max_num_seqs']}, block size "
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


def _flags(flags: dict) -> list[str]:
    return [f"--{k.replace('_', '-')} {v}" for k, v in flags.items()]


def _blocks(results: dict, name: str) -> str:
    v = results["variants"].get(name) or {}
    n = v.get("metrics", {}).get("num_kv_blocks")
    return "?" if n is None else f"{n:.0f}"


def _load(la: Any) -> str:
    return "/".join(f"{x:.1f}" for x in la)


def _timing_text(results: dict) -> str:
    t = {v.get("token_timing") for v in results["variants"].values()} - {None}
    return {"text": "one chunk per token, from the stream's text chunks",
            "logprobs": "each token's chunk; requests ask for logprobs=0 because most of the random model's tokens "
                        "decode to no text, and a server sends no chunk for those otherwise",
            "chunks": "per SSE chunk (approximate: this server merges or drops tokens)"}.get(
        next(iter(t), ""), ", ".join(sorted(t)) or "none")


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
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "cdf_short_e2e.png"), dpi=110)
    plt.close(fig)
    written.append("cdf_short_e2e.png")

    for name, v in results["variants"].items():
        tl = v.get("timeline")
        if not tl or not tl["t"]:
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
    return written


def _flags_short(v: dict) -> str:
    f = v.get("flags") or {}
    keys = ("scheduling", "kv_admission", "max_model_len", "num_kv_blocks", "max_num_seqs")
    return ", ".join(f"{k} {f[k]}" for k in keys if k in f) or "the server as it runs"
