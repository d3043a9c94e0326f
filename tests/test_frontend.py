"""vLLM's frontend flags for where and how the server listens and whom it answers:
--uds, --ssl-keyfile/--ssl-certfile/--ssl-ca-certs/--ssl-cert-reqs (HTTPS, client
certificates), several --api-key values, --enable-force-include-usage. Each is exercised
through the code `python server.py` runs (tls_context, app_from_args, listen) against a
real socket, with certificates made by the openssl command."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import subprocess

import aiohttp
import pytest
from aiohttp import web

import cli_args
import server
from conftest import tiny_async_engine


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and another one, for clients."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command makes this test's certificates")
    d = tmp_path_factory.mktemp("certs")
    out = {}
    for name in ("server", "client"):
        key, cert = str(d / f"{name}.key"), str(d / f"{name}.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                        "-days", "1", "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        out[f"{name}_key"], out[f"{name}_cert"] = key, cert
    return out


def args(*flags: str):
    return cli_args.build_parser().parse_args(["--model", "tiny", "--host", "127.0.0.1", "--port", "0", *flags])


async def serving(engine, flags: tuple[str, ...]) -> tuple[web.AppRunner, str]:
    a = args(*flags)
    runner = web.AppRunner(server.app_from_args(engine, a))
    await runner.setup()
    return runner, await server.listen(runner, a, server.tls_context(a), cli_args.bind_address(a.host, a.port))


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_https_several_api_keys_and_usage_on_every_stream(certs):
    flags = ("--ssl-certfile", certs["server_cert"], "--ssl-keyfile", certs["server_key"],
             "--api-key", "first", "second", "--enable-force-include-usage")
    trusted = ssl.create_default_context(cafile=certs["server_cert"])

    async def run(engine) -> dict:
        runner, address = await serving(engine, flags)
        got = {"address": address}
        try:
            async with aiohttp.ClientSession() as s:
                for key in ("first", "second", "third"):
                    async with s.get(f"{address}/v1/models", ssl=trusted,
                                     headers={"Authorization": f"Bearer {key}"}) as r:
                        got[key] = r.status
                with pytest.raises(aiohttp.ClientConnectorCertificateError):  # not a certificate it trusts
                    await s.get(f"{address}/health", ssl=ssl.create_default_context())
                for options in (None, {"include_usage": False}, {"include_usage": True}):
                    body = {"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True, "stream": True} | (
                        {"stream_options": options} if options is not None else {})
                    async with s.post(f"{address}/v1/completions", json=body, ssl=trusted,
                                      headers={"Authorization": "Bearer second"}) as r:
                        got[str(options)] = sse_events(await r.text())
                plain = address.replace("https://", "http://")
                try:
                    async with s.get(f"{plain}/health") as r:
                        got["plain"] = r.status
                except aiohttp.ClientError as e:  # a TLS server may drop a plain request at once
                    got["plain"] = type(e).__name__
        finally:
            await runner.cleanup()
        return got

    with tiny_async_engine() as (loop, engine):
        got = loop.run_until_complete(asyncio.wait_for(run(engine), 300))
    assert got["address"].startswith("https://127.0.0.1:")
    assert (got["first"], got["second"], got["third"]) == (200, 200, 401)
    assert got["plain"] != 200
    for options in (None, {"include_usage": False}, {"include_usage": True}):
        events = got[str(options)]
        assert events[:-1] and all(e["choices"] for e in events[:-1]), (options, events)
        assert events[-1]["choices"] == [], (options, events)  # the usage chunk, last
        assert events[-1]["usage"]["completion_tokens"] == 3 and events[-1]["usage"]["prompt_tokens"] == 2


def test_client_certificates_when_required_and_a_unix_socket(certs, tmp_path):
    required = ("--ssl-certfile", certs["server_cert"], "--ssl-keyfile", certs["server_key"],
                "--ssl-ca-certs", certs["client_cert"], "--ssl-cert-reqs", "2")
    sock = str(tmp_path / "taxirank.sock")

    async def run(engine) -> dict:
        got = {}
        runner, address = await serving(engine, required)
        try:
            with_cert = ssl.create_default_context(cafile=certs["server_cert"])
            with_cert.load_cert_chain(certs["client_cert"], certs["client_key"])
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{address}/health", ssl=with_cert) as r:
                    got["with"] = r.status
                try:
                    async with s.get(f"{address}/health", ssl=ssl.create_default_context(
                            cafile=certs["server_cert"])) as r:
                        got["without"] = r.status
                except aiohttp.ClientError as e:
                    got["without"] = type(e).__name__
        finally:
            await runner.cleanup()
        runner, address = await serving(engine, ("--uds", sock))
        try:
            got["uds_address"] = address
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock)) as s:
                async with s.get("http://localhost/v1/models") as r:
                    got["uds"] = (r.status, (await r.json())["data"][0]["id"])
        finally:
            await runner.cleanup()
        return got

    with tiny_async_engine() as (loop, engine):
        got = loop.run_until_complete(asyncio.wait_for(run(engine), 300))
    assert got["with"] == 200 and got["without"] != 200, got
    assert got["uds_address"] == f"http+unix://{sock}" and got["uds"] == (200, "tiny")


@pytest.mark.parametrize("flags, says", [
    (("--ssl-keyfile", "k.pem"), "--ssl-keyfile needs --ssl-certfile"),
    (("--ssl-cert-reqs", "2"), "--ssl-cert-reqs needs --ssl-certfile"),
    (("--ssl-certfile", "/no/such.pem"), "--ssl-certfile '/no/such.pem'"),
])
def test_tls_flags_that_cannot_work_are_refused_naming_the_flag(flags, says):
    with pytest.raises(ValueError, match=says):
        server.tls_context(args(*flags))


def test_bad_tls_files_and_empty_keys_stop_the_server_before_the_model_loads(certs, capsys, tmp_path):
    encrypted_key, cert = str(tmp_path / "encrypted.key"), str(tmp_path / "encrypted.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-keyout", encrypted_key, "-out", cert,
                    "-days", "1", "-subj", "/CN=x", "-passout", "pass:secret"], check=True, capture_output=True)
    for flags, says in [(("--ssl-certfile", cert, "--ssl-keyfile", encrypted_key), "is encrypted"),  # never a prompt
                        (("--ssl-certfile", certs["server_key"]), "--ssl-certfile"),  # a key is no certificate
                        (("--ssl-certfile", certs["server_cert"], "--ssl-keyfile", certs["server_key"],
                          "--ssl-cert-reqs", "1"), "needs --ssl-ca-certs"),
                        (("--ssl-certfile", certs["server_cert"], "--ssl-keyfile", certs["server_key"],
                          "--ssl-ca-certs", os.devnull), "--ssl-ca-certs"),
                        (("--api-key", ""), "--api-key: a key must be a non-empty string")]:
        with pytest.raises(SystemExit) as exit_:
            server.main(["--model", "no-such-model-would-load", *flags])
        assert exit_.value.code == 2 and says in capsys.readouterr().err, flags


@pytest.mark.parametrize("env, argv, keys", [("k1", [], ("k1",)), ("k1", ["--api-key", "a", "b"], ("a", "b")),
                                             ("", [], ()), (None, [], ())])
def test_vllm_api_key_in_the_environment_guards_the_api_unless_the_command_line_gives_keys(monkeypatch, env, argv,
                                                                                           keys):
    """vLLM's build_app: `args.api_key or [envs.VLLM_API_KEY]`, empty keys dropped. The keys
    the app is built with are args.api_key once the server flags are checked."""
    if env is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", env)
    parsed = args(*argv)
    cli_args.check_server_flags(parsed)
    assert cli_args.api_keys(parsed.api_key) == keys


@pytest.mark.parametrize("path, says", [("", "argument --uds: the socket's path is empty"),
                                        ("/no/such/folder/x.sock", "the folder '/no/such/folder' does not exist"),
                                        ("/tmp/a\0b.sock", "holds a NUL character")])
def test_a_socket_path_that_cannot_be_bound_stops_the_server_before_the_model_loads(capsys, path, says):
    """Checked as the flag is read: the socket is bound after the model loads and compiles,
    where "" would be a traceback (asyncio's IndexError)."""
    with pytest.raises(SystemExit) as exit_:
        server.main(["--model", "no-such-model-would-load", "--uds", path])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_a_port_another_server_takes_during_the_start_up_is_one_error_line(monkeypatch):
    """bind_address binds without listening (vLLM's setup_server), so a server started on the
    same port while the model loads (SO_REUSEADDR, as asyncio's) can still listen there first:
    listen then names the flags, which server.py prints as its one error line."""
    import socket

    a = args()
    socks = cli_args.bind_address(a.host, a.port)
    a.port = socks[0].getsockname()[1]
    thief = socket.socket()
    thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    thief.bind(("127.0.0.1", a.port))
    thief.listen()

    async def run() -> None:
        runner = web.AppRunner(web.Application())
        await runner.setup()
        try:
            await server.listen(runner, a, None, socks)
        finally:
            await runner.cleanup()
    try:
        with pytest.raises(server.CannotListen, match=f"^--host 127.0.0.1 --port {a.port}: cannot listen there: "
                                                      "Address already in use"):
            asyncio.run(run())
    finally:
        thief.close()
        for s in socks:
            s.close()

    # a family this machine cannot open (IPv6 off in its kernel) is skipped, as asyncio skips it
    real = socket.socket

    def no_ipv6(family: int = socket.AF_INET, *rest):
        if family == socket.AF_INET6:
            raise OSError(97, "Address family not supported by protocol")
        return real(family, *rest)
    monkeypatch.setattr(socket, "socket", no_ipv6)
    socks = cli_args.bind_address("", 0)
    try:
        assert [s.family for s in socks] == [socket.AF_INET]
    finally:
        for s in socks:
            s.close()
    with pytest.raises(ValueError, match="^--host ::1 --port 0: cannot listen there: no address family of it"):
        cli_args.bind_address("::1", 0)
