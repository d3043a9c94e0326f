"""Cross-origin requests (CORS), as vLLM's server answers them: its --allowed-origins,
--allow-credentials, --allowed-methods and --allowed-headers, with Starlette's
CORSMiddleware's rules (vLLM's own middleware), so a page in a browser can call the API.

A preflight (OPTIONS with Origin and Access-Control-Request-Method) is answered here,
before the API key is asked for (browsers send none with it, and vLLM skips OPTIONS too):
200 "OK", or 400 "Disallowed CORS origin, method, headers" naming what is not allowed (a
private-network request, from a public page to this host, is never allowed: vLLM's
Starlette default). Any other request with an Origin gets the Access-Control-Allow-*
headers on its answer, errors and streams included."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

# What "*" allows: Starlette's list (QUERY is RFC 9110's newer safe method with a body).
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY")
SAFELISTED_HEADERS = ("Accept", "Accept-Language", "Content-Language", "Content-Type")  # always allowed
MAX_AGE = 600  # seconds a browser may keep a preflight's answer (Starlette's default)
# A preflight's answer varies with each of these request headers.
PREFLIGHT_VARY = ("Origin, Access-Control-Request-Method, Access-Control-Request-Headers, "
                  "Access-Control-Request-Private-Network")


@dataclass(frozen=True)
class CorsPolicy:
    origins: Sequence[str] = ("*",)
    credentials: bool = False
    methods: Sequence[str] = ("*",)
    headers: Sequence[str] = ("*",)

    @classmethod
    def from_args(cls, args: Any) -> CorsPolicy:
        """The policy server.py's flags give (--allowed-origins, --allow-credentials,
        --allowed-methods, --allowed-headers)."""
        return cls(args.allowed_origins, args.allow_credentials, args.allowed_methods, args.allowed_headers)

    def __post_init__(self) -> None:
        for name in ("origins", "methods", "headers"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"allowed {name} must be a list of non-empty strings, got {value!r}"[:200])

    @property
    def any_origin(self) -> bool:
        return "*" in self.origins

    @property
    def allowed_methods(self) -> tuple[str, ...]:
        return ALL_METHODS if "*" in self.methods else tuple(m.upper() for m in self.methods)

    @property
    def allowed_headers(self) -> set[str] | None:
        """The lower-case names a request may send; None: any."""
        return None if "*" in self.headers else {h.lower() for h in (*SAFELISTED_HEADERS, *self.headers)}

    def origin_allowed(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins

    def preflight(self, request: web.Request) -> web.Response:
        origin = request.headers["Origin"]
        # The origin itself, not "*", whenever the answer depends on it (a list of origins)
        # or carries credentials (browsers refuse "*" with them).
        explicit = not self.any_origin or self.credentials
        headers = {"Vary": PREFLIGHT_VARY, "Access-Control-Allow-Methods": ", ".join(self.allowed_methods),
                   "Access-Control-Max-Age": str(MAX_AGE)}
        if not explicit:
            headers["Access-Control-Allow-Origin"] = "*"
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        failures = []
        if self.origin_allowed(origin):
            if explicit:
                headers["Access-Control-Allow-Origin"] = origin
        else:
            failures.append("origin")
        if request.headers["Access-Control-Request-Method"] not in self.allowed_methods:
            failures.append("method")
        asked = request.headers.get("Access-Control-Request-Headers")
        allowed = self.allowed_headers
        if allowed is None:
            if asked is not None:
                headers["Access-Control-Allow-Headers"] = asked
        else:
            headers["Access-Control-Allow-Headers"] = ", ".join(sorted({*SAFELISTED_HEADERS, *self.headers}))
            if asked is not None and any(h.strip().lower() not in allowed for h in asked.split(",")):
                failures.append("headers")
        if "Access-Control-Request-Private-Network" in request.headers:  # a public page asking for this host
            failures.append("private-network")
        if failures:
            return web.Response(status=400, text="Disallowed CORS " + ", ".join(failures), headers=headers)
        return web.Response(text="OK", headers=headers)

    def answer_headers(self, origin: str | None) -> dict[str, str]:
        """The CORS headers of an answer to a request from `origin` (None: not cross-origin),
        besides "Vary: Origin", which every answer carries: its content depends on the Origin."""
        if origin is None:
            return {}
        headers = {"Access-Control-Allow-Origin": "*"} if self.any_origin else {}
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        if (self.credentials or not self.any_origin) and self.origin_allowed(origin):
            headers["Access-Control-Allow-Origin"] = origin  # never "*" with credentials
        return headers

    def decorate(self, request: web.Request, response: web.StreamResponse) -> None:
        """An answer's CORS headers (before it is sent)."""
        response.headers.update(self.answer_headers(request.headers.get("Origin")))
        response.headers.add("Vary", "Origin")

    def middleware(self) -> Callable[[web.Request, Callable[[web.Request], Awaitable[web.StreamResponse]]],
                                     Awaitable[web.StreamResponse]]:
        @web.middleware
        async def cors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
            if request.method == "OPTIONS" and "Origin" in request.headers \
                    and "Access-Control-Request-Method" in request.headers:
                return self.preflight(request)
            # A streamed answer sends its headers when it is prepared, inside the handler:
            # on_response_prepare adds them there, and to every other answer alike.
            request["cors"] = self
            return await handler(request)

        return cors


async def on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp's hook before any answer's headers go out: a cross-origin request's get the
    Access-Control-Allow-* headers (streams and errors too)."""
    policy = request.get("cors")
    if policy is not None:
        policy.decorate(request, response)
