"""The server's command line (vLLM's cli_args.py): one flag per EngineConfig field, then the
HTTP server's own, and the checks of their values that run before the model loads (minutes),
not when the server binds after it. server.py and serve_ray.py both read it."""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import decimal
import errno
import inspect
import os
import re
import socket
import ssl
import typing
from typing import Any, Literal

import chat_format
import config_file
from config import DISTRIBUTED_EXECUTOR_BACKENDS, REGISTRIES, VLLM_SPELLINGS, EngineConfig
from policy import POLICIES
from quant_methods import QUANTIZATION_METHODS
from tool_parsers import TOOL_PARSERS


_HELP = {  # EngineConfig fields; config.py says more
    "reasoning_parser": "split the model's thinking (<think>...</think>) off chat answers into the message's "
                        "`reasoning` (deepseek_r1: DeepSeek-R1 and QwQ; qwen3: Qwen3), and apply a structured-output "
                        "constraint once thinking ends, as vLLM",
    "generation_config": "the sampling defaults of requests that leave them out (repetition_penalty, temperature, "
                         "top_p, top_k, min_p, "
                         "max_new_tokens as max_tokens): auto: the model folder's generation_config.json; vllm: "
                         "none (OpenAI's defaults); or a folder holding one",
    "override_generation_config": "JSON over those defaults, e.g. '{\"temperature\": 0.5}'",
    "model": "'smollm2' (built-in SmolLM2-135M-Instruct, fetched on first use), 'tiny', 'bench' (built-in "
             "random weights), a .gguf file or a Hugging Face model directory",
    "tokenizer": "a folder holding a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json or "
                 "tokenizer.model), or a .gguf file's, used instead of the model's own: encoding, decoding, the chat "
                 "template, its EOS beside the model's stop ids, structured outputs' vocabulary; at most the model's "
                 "vocab_size ids. For a GGUF model, its base model's tokenizer (vLLM's advice). None or '': the model's",
    "dtype": "weights and KV cache dtype: float32 (or vLLM's float), bfloat16, or auto: bfloat16 for a bfloat16 "
             "checkpoint, else float32 (a float16 one too: no fp16 overflow)",
    "seed": "weights seed of the built-in models, and sampling seed of unseeded requests",
    "max_num_seqs": "slots: most sequences in one step",
    "max_model_len": "longest prompt + output, as vLLM's an integer or one such as 32k (32,000) or 32K (32,768); None: "
                     "the model's max_position_embeddings",
    "block_size": "tokens per KV cache block (a power of two)",
    "num_kv_blocks": "KV cache size in blocks, the null block 0 included; None: from the memory budget",
    "kv_cache_memory": "KV cache budget in bytes (4G: 4 GiB, 4g: 4e9); None: --gpu-memory-utilization on an "
                       "accelerator; on CPU 4 GiB, or less where max_num_seqs sequences of max_model_len need less "
                       "or the host leaves less",
    "gpu_memory_utilization": "fraction of device memory (on CPU: the host's) for weights, activations and the KV "
                              "cache",
    "max_num_batched_tokens": "token budget of one step (8k: 8,000, 8K: 8,192); None: depends on "
                              "--enable-chunked-prefill",
    "enable_chunked_prefill": "split long prompts across steps, decodes first",
    "enable_prefix_caching": "reuse the cached KV blocks of a shared prompt prefix",
    "long_prefill_token_threshold": "most prompt tokens of one sequence in a step (its chunk), so a long prompt "
                                    "shares steps with others; 0: no cap but the step's budget (vLLM's)",
    "scheduling": "how a step is composed and when a finished sequence's seat frees (policy.BATCHING)",
    "scheduling_policy": "the waiting queue's order, the KV victim, who may preempt whom (policy.POLICIES)",
    "kv_admission": "the KV blocks a sequence holds from admission (policy.KV_ADMISSION)",
    "preemption_mode": "how a preempted sequence gives up its KV: recompute (dropped, computed again) or swap "
                       "(copied to a host pool of --swap-space GiB and back; recompute when it is full)",
    "swap_space": "GiB of host memory for KV blocks swapped out by --preemption-mode swap",
    "slo_ttft_ms": f"--scheduling-policy {POLICIES.names_where(lambda p: p.uses_slo)}: a request's "
                   "time-to-first-token target when its body sets none",
    "slo_tpot_ms": f"--scheduling-policy {POLICIES.names_where(lambda p: p.uses_slo)}: a request's "
                   "time-per-output-token target when its body sets none",
    "kv_cache_dtype": "KV cache storage: auto (the model dtype), or 8 bits (fp8 = fp8_e4m3 = fp8_per_token_head, fp8_e5m2, "
                      "int8 = int8_per_token_head) with an "
                      "f32 scale per token and KV head: ~4x (from f32) or ~2x (from bf16) the blocks in the same memory",
    "attention_backend": "paged attention: auto (the first registered backend for this platform that passes its "
                         "start-up check, else the jnp reference) or a name in attention_backend.BACKENDS",
    "logprobs_mode": "what logprobs hold: raw_logprobs (the model's, before logit_bias, penalties, temperature and "
                     "top-k/top-p/min-p; a grammar's mask applies), raw_logits, processed_logprobs or processed_logits "
                     "(what the token was drawn from), as vLLM's",
    "stream_interval": "tokens per streamed chunk, as vLLM's (a request's stream_interval may raise it, not lower "
                       "it): 1 sends each step's tokens at once; more batches them, fewer chunks to encode and write "
                       "(a request's first token and its end still go out at once)",
    "max_logprobs": "most logprobs and prompt_logprobs a request may ask for (the width of the top-logprob arrays); "
                    "-1: the vocabulary, which a request then asks with -1 (as vLLM's)",
    "max_waiting_requests": "answer 503 at once while this many requests wait; None: no limit",
    "warmup": "compile every step shape before serving",
    "compilation_cache_dir": "persistent cache of compiled step programs (fast restarts); None: $TAXIRANK_CACHE/jax "
                             "(TAXIRANK_CACHE defaults to ~/.cache/taxirank); '' turns it off",
    "async_scheduling": "schedule step N+1 while the device runs step N (sampled tokens stay on the device)",
    "tensor_parallel_size": "devices the model is sharded over (Megatron-style, KV cache by KV heads)",
    "distributed_coordinator": "HOST:PORT of process 0 for a multi-host run (jax.distributed); None: one process",
    "num_processes": "processes in a multi-host run (one per host); process 0 schedules and serves HTTP",
    "process_id": "this process's rank in a multi-host run",
    "pipeline_parallel_size": "vLLM's; 1 only: taxirank does not split layers over devices (use "
                              "--tensor-parallel-size)",
    "data_parallel_size": "vLLM's; 1 only: for data parallelism run replicas (serve_ray.py --num-replicas N)",
    "distributed_executor_backend": "vLLM's; uni only (or unset): the model runs in this process, one JAX "
                                    "controller over all its devices; more hosts join through jax.distributed "
                                    "(--distributed-coordinator)",
    "quantization": "weight-only quantization of the decoder layers' linears, a method of "
                    "quant_methods.QUANTIZATION_METHODS: {methods}. None: the model dtype (a GGUF file dequantized)",
    "speculative_config": "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                          "\"prompt_lookup_max\": 4} or {\"method\": \"draft_model\", \"model\": ..., "
                          "\"num_speculative_tokens\": 4[, \"quantization\": \"int8\"]}; also disable_by_batch_size, "
                          "min_acceptance_rate "
                          "(spec_decode.SpeculativeConfig)",
}


def load_chat_template(value: str) -> str:
    """--chat-template: a file's text, or (vLLM's rule) the value itself when it holds
    Jinja's characters; a value that names no file and looks like a path is an error."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"{value!r} is not UTF-8 text ({e})") from None
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise argparse.ArgumentTypeError(f"{value!r} looks like a file path, but it cannot be opened "
                                             f"({e.strerror})") from None
    return codecs.decode(value, "unicode_escape")  # a one-line template's \n, as vLLM reads it


def check_chat_template(template: str, tokenizer: Any) -> None:
    """A template the model's tokenizer can render with, compiled as transformers compiles it
    for apply_chat_template (chat_format.compile_template: its extensions, `{% generation %}`
    included, its filters), checked at start-up, not at the first chat request."""
    import jinja2

    if tokenizer is None or "chat_template" not in inspect.signature(tokenizer.apply_chat_template).parameters:
        raise ValueError("--chat-template needs a Hugging Face tokenizer; this model has "
                         f"{type(tokenizer).__name__ if tokenizer is not None else 'none'}")
    try:
        chat_format.compile_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e} (line {e.lineno})") from None


def uds_arg(value: str) -> str:
    """--uds: a Unix domain socket's path (on Linux also a name after a NUL: the abstract
    namespace), checked as argparse reads it: the socket is bound once the model has loaded
    and compiled (minutes), where "" would be a traceback and a missing folder one line."""
    if not value:
        raise argparse.ArgumentTypeError("the socket's path is empty")
    if "\0" in value[1:]:
        raise argparse.ArgumentTypeError(f"{value!r} holds a NUL character")
    folder = os.path.dirname(value) or "."
    if value[0] != "\0" and not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{value!r}: the folder {folder!r} does not exist")
    return value


def root_path_arg(value: str) -> str:
    """--root-path's value, checked (check_root_path) as argparse reads it."""
    try:
        return check_root_path(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--root-path ")) from None


def check_root_path(root_path: str | None) -> str:
    """--root-path: "" (none), or a path that starts with "/" and does not end with one.
    FastAPI takes any string, but a value without the leading "/" never matches a request
    path, and one with a trailing "/" strips the "/" the route starts with, so both would
    leave the prefixed paths unserved; "/" alone means none. ValueError names the flag."""
    root_path = root_path or ""
    if root_path in ("", "/"):
        return ""
    bad = "must start with '/'" if not root_path.startswith("/") else \
        "must not end with '/'" if root_path.endswith("/") else \
        "must be a URL path: no '?', '#', whitespace or control characters" \
        if any(c in "?#" or c.isspace() or not c.isprintable() for c in root_path) else None
    if bad:
        raise ValueError(f"--root-path {bad} (e.g. /llm), got {root_path!r}")
    return root_path


def check_log_flags(args: argparse.Namespace) -> None:
    """vLLM's rule (ValueError): --enable-log-outputs logs through --enable-log-requests's logger."""
    if args.enable_log_outputs and not args.enable_log_requests:
        raise ValueError("--enable-log-outputs requires --enable-log-requests")


def check_server_flags(args: argparse.Namespace) -> None:
    """The server flags' rules (ValueError naming the flag) that server.py and serve_ray.py
    both check before the model loads and compiles (minutes): vLLM's rule that auto tool
    choice needs a parser, --shutdown-timeout, --host, --api-key and the log flags. --port
    is each one's own (Ray Serve's proxy needs a fixed port). Without --api-key, the key of
    the environment's VLLM_API_KEY (if set and not empty) goes into args.api_key, as vLLM's
    build_app takes it: a deployment that keeps its key off the command line stays guarded."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:  # vLLM's rule
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    # also refuses nan; inf too: a stream that never ends would hold the shutdown forever
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise ValueError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {args.shutdown_timeout}")
    check_host(args.host, args.port)
    if args.api_key is None and os.environ.get("VLLM_API_KEY"):
        args.api_key = [os.environ["VLLM_API_KEY"]]
    api_keys(args.api_key)
    check_log_flags(args)


# vLLM's flags that take a size as 25.6k (x 1000) or 32K (x 1024) beside a plain integer
HUMAN_READABLE_INTS = ("max_model_len", "max_num_batched_tokens", "kv_cache_memory")
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """vLLM's human_readable_int: an integer, or a number with a suffix: k, m, g, t are
    powers of 1000 (25.6k: 25,600), K, M, G, T of 1024 (a whole number only: 32K)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", value.strip())
    if match is None:
        try:
            return int(value)
        except ValueError:  # (past 4,300 digits too)
            raise argparse.ArgumentTypeError(f"expected an integer, or one such as 32k or 32K, got {value[:100]!r}") \
                from None
    number, suffix = match.groups()
    if suffix in _BINARY_SUFFIXES:
        if "." in number:
            raise argparse.ArgumentTypeError(f"a decimal does not take a binary suffix ({suffix}), got {value!r}; "
                                             f"did you mean {number}{suffix.lower()}?")
        return int(number) * _BINARY_SUFFIXES[suffix]
    return int(decimal.Decimal(number) * _DECIMAL_SUFFIXES[suffix])  # exact: 1.001k is 1001


def non_negative_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    """One flag per EngineConfig field (same name, dashes for underscores), then the server's own."""
    p = argparse.ArgumentParser(description="taxirank: OpenAI-compatible server",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(EngineConfig)
    registries = {r.field: r for r in REGISTRIES}
    for f in dataclasses.fields(EngineConfig):
        kind, kw = hints[f.name], {"default": f.default, "help": _HELP.get(f.name, f"EngineConfig.{f.name}")}
        if f.name in registries:  # every registered name, read when the parser is built
            kw["choices"] = registries[f.name].choices
        elif f.name == "distributed_executor_backend":  # vLLM's names; EngineConfig says which run here
            kw["choices"] = list(DISTRIBUTED_EXECUTOR_BACKENDS)
        elif kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            kw["choices"] = typing.get_args(kind)
        else:  # int, float, str, or `X | None`; a type that parses its own text gets the text
            arg = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
            # (JSON text: a config file may write it as a YAML mapping)
            json_text = hasattr(arg, "parse") or dict in typing.get_args(kind)
            kw["type"] = config_file.json_text if json_text else \
                human_readable_int if f.name in HUMAN_READABLE_INTS else arg
        if f.name == "quantization":  # every registered method, read when the parser is built
            kw["help"] = kw["help"].format(methods="; ".join(f"{name} ({m.summary})" if m.summary else name
                                                             for name, m in QUANTIZATION_METHODS.items()))
        p.add_argument("--" + f.name.replace("_", "-"), *VLLM_SPELLINGS.get(f.name, ()), **kw)
    p.add_argument("--config", action=config_file.OneFile,
                   help="a YAML file of flags (max-model-len: 1024, ...), as vLLM's; flags given on the command line "
                        "win over the file's")
    p.add_argument("--served-model-name", nargs="+", help="name(s) clients use; default: the model's name")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s, this machine only; vLLM's default is every "
                        "interface: 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    p.add_argument("--api-key", nargs="+", help="require 'Authorization: Bearer <key>' on /v1/* and "
                   "/reset_prefix_cache, with one of these keys")
    p.add_argument("--uds", type=uds_arg,
                   help="serve on this Unix domain socket instead of --host and --port, as vLLM")
    p.add_argument("--ssl-keyfile", help="HTTPS: the private key's file (PEM), for --ssl-certfile")
    p.add_argument("--ssl-certfile", help="HTTPS: the certificate chain's file (PEM; it may hold the key too)")
    p.add_argument("--ssl-ca-certs", help="HTTPS: the CA certificates that client certificates are checked against")
    p.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                   choices=[int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED)],
                   help="client certificates: 0 not asked for, 1 checked if sent, 2 required (Python's ssl.CERT_*)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with a usage chunk, whether stream_options asks for it or not")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage carries prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache "
                        "served (off: null in a whole response, left out of a stream's usage chunk); vLLM's flag")
    p.add_argument("--root-path", type=root_path_arg, default="",
                   help="the path prefix a proxy serves this server under (e.g. /llm): a request path under it "
                        "is served as the path without it, any other path as it is (FastAPI's root_path, as vLLM)")
    p.add_argument("--allowed-origins", type=config_file.json_list, default=["*"],
                   help='origins whose pages may call the API (CORS), as a JSON list, e.g. \'["https://a.example"]\'; '
                        '["*"]: any, as vLLM')
    p.add_argument("--allow-credentials", action="store_true",
                   help="let cross-origin pages send credentials (cookies, Authorization): CORS's "
                        "Access-Control-Allow-Credentials")
    p.add_argument("--allowed-methods", type=config_file.json_list, default=["*"],
                   help='HTTP methods a cross-origin page may use, as a JSON list ("*": any)')
    p.add_argument("--allowed-headers", type=config_file.json_list, default=["*"],
                   help='request headers a cross-origin page may send, as a JSON list ("*": any)')
    p.add_argument("--enable-per-request-metrics", action="store_true",
                   help="a request with \"include_metrics\": true gets its timings and scheduling history "
                        "(metrics.RequestMetrics) in the response, or in the last chunk of a stream")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice \"auto\" (the default with tools): the model may call tools, found in its "
                        "output by --tool-call-parser")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSERS.choices,
                   help="how tool calls are written in the model's output (hermes: <tool_call>{...}</tool_call>); "
                        "used only with --enable-auto-tool-choice, as vLLM")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="tool_choice \"none\" keeps the tool definitions out of the prompt (default: the chat "
                        "template renders them, as for any other tool_choice)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="add an X-Request-Id header to every response: the request's own X-Request-Id, else a "
                        "random one (vLLM's flag)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name their tokens \"token_id:N\" (a request's return_tokens_as_token_ids wins; "
                        "vLLM's flag)")
    p.add_argument("--chat-template", type=load_chat_template,
                   help="a Jinja chat template, or the path of a file holding one, to use instead of the model's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="a request may bring its own chat_template (refused otherwise, as vLLM)")
    p.add_argument("--chat-template-content-format", choices=chat_format.CONTENT_FORMATS, default="auto",
                   help="how a message's content reaches the chat template: 'string' (its text parts joined by "
                        "newlines), 'openai' (a list of {\"type\": \"text\", \"text\": ...} parts), or 'auto': "
                        "'openai' when the template loops over a message's content (vLLM's flag)")
    p.add_argument("--default-chat-template-kwargs", type=config_file.json_object,
                   help="JSON object of chat template variables, e.g. '{\"enable_thinking\": false}', which a "
                        "request's chat_template_kwargs override key by key (vLLM's flag)")
    p.add_argument("--response-role", default="assistant",
                   help="the role of a chat answer that opens a new turn (add_generation_prompt true; otherwise "
                        "the role of the last message it continues)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="default: %(default)s")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (every 10 s: prompt and generation throughput, running and "
                        "waiting requests, preemptions, KV cache usage, prefix cache hit rate, speculative "
                        "acceptance); vLLM's flag")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request's id and sampling parameters as it arrives (at debug level also its "
                        "prompt's token ids); vLLM's flag")
    p.add_argument("--enable-log-outputs", action=argparse.BooleanOptionalAction, default=False,
                   help="also log each request's output: its text and finish reason (a stream: each chunk's and, "
                        "once complete, the whole text), at debug level also its token ids; needs "
                        "--enable-log-requests (vLLM's flag)")
    p.add_argument("--enable-log-deltas", action=argparse.BooleanOptionalAction, default=True,
                   help="with --enable-log-outputs, a stream's line per chunk ('streaming delta'); "
                        "--no-enable-log-deltas: only its line once complete (vLLM's flag)")
    p.add_argument("--max-log-len", type=non_negative_int,
                   help="most prompt token ids, output characters and output token ids a request's log lines "
                        "show; None: all (vLLM's flag)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM or SIGINT, new requests get 503 at once and those in flight get this many "
                        "seconds to finish before the rest are aborted (0: abort at once; a second signal "
                        "also aborts at once)")
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags of build_parser() describe (raises ValueError if invalid)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def api_keys(api_key: str | typing.Sequence[str] | None) -> tuple[str, ...]:
    """--api-key's keys (one or several; none: no key asked for), each a non-empty string."""
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    if not all(isinstance(k, str) and k for k in keys):
        raise ValueError("--api-key: a key must be a non-empty string")
    return keys


def check_host(host: str, port: int) -> None:
    """--host: an address this machine can bind (ValueError if it does not resolve), checked
    before the model loads and compiles (minutes)."""
    try:
        # "" binds every interface (asyncio, aiohttp and vLLM alike), as a passive lookup of None does
        socket.getaddrinfo(host or None, port, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r} does not resolve: {e}") from None


def bind_address(host: str, port: int) -> list[socket.socket]:
    """--host and --port bound as asyncio's create_server binds them: a socket per address
    they resolve to, skipping a family this machine cannot open; ValueError naming both flags
    where one does not bind. server.py binds before the model loads and compiles (minutes),
    as vLLM's setup_server, so a port another process holds is one error at once, not a
    traceback after the warm-up. It listens once it is ready (connections are refused until
    then): a server started meanwhile on the same port (SO_REUSEADDR, as asyncio's) can
    still take it, and `listen` says so."""
    socks: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # e.g. IPv6 off in this kernel: its addresses are not served
                continue
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
            if family == socket.AF_INET6:  # as asyncio: an IPv4 address has a socket of its own
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
        if not socks:
            raise OSError(errno.EAFNOSUPPORT, "no address family of it can be opened here")
    except (OSError, UnicodeError) as e:
        for sock in socks:
            sock.close()
        raise ValueError(f"--host {host} --port {port}: {listen_error(e)}") from None
    return socks


def listen_error(e: BaseException) -> str:
    """Why --host and --port cannot be served, for the one error line."""
    held = " (is another server running there?)" if getattr(e, "errno", None) == errno.EADDRINUSE else ""
    return f"cannot listen there: {getattr(e, 'strerror', None) or e}{held}"
