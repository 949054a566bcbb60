"""``kivi serve``'s API key: what a key may hold, and the check that answers before routing.

A key is printable ASCII without spaces (``!`` to ``~``, 0x21-0x7E), the characters of a Bearer token
(RFC 6750 allows fewer): HTTP headers are bytes that Starlette decodes as latin-1, so a key with any other
character could never be sent and matched (the openai client refuses non-ASCII headers), and the server
would start with a key nobody can use.

:class:`RequireKey` wraps the whole app (pure ASGI, before routing): every path but ``/health`` without
``Authorization: Bearer <key>`` gets the 401, whatever its method or trailing slash; with the key, the
router answers (405 for a method a route lacks, 307 to drop a trailing slash, 404). Nothing here imports
fastapi: ``kivi serve`` checks a key before it imports the serve extra.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from .errors import ApiError

#: the paths that stay open with a key set (a load balancer's health check has no key)
OPEN_PATHS = frozenset({"/health"})


def api_key_problem(key: str) -> str | None:
    """Why ``key`` cannot be an API key (empty, or a character outside printable ASCII), or ``None``."""
    if not key:
        return "is empty"
    bad = next((c for c in key if not "!" <= c <= "~"), None)
    if bad is not None:
        return (f"holds {bad!r} (U+{ord(bad):04X}) at index {key.index(bad)}: a key is printable ASCII without "
                "spaces ('!' to '~'), as a Bearer token is")
    return None


def check_api_key(key: str | None) -> str | None:
    """``key`` when it can be an API key (``None``: no key); ``ValueError`` naming the problem otherwise."""
    if key is None:
        return None
    problem = api_key_problem(key)
    if problem is not None:
        raise ValueError(f"api_key {problem}")
    return key


def _unauthorized() -> ApiError:
    return ApiError(401, "invalid or missing API key: send the server's key as 'Authorization: Bearer <key>' "
                    "(kivi serve --api-key / KIVI_API_KEY)", code="invalid_api_key")


class RequireKey:
    """ASGI middleware: HTTP requests outside :data:`OPEN_PATHS` need ``Authorization: Bearer <api_key>``
    (a constant-time comparison of the bytes), else a 401 with ``WWW-Authenticate: Bearer``; ``api_key=None``
    lets every request through."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        key = check_api_key(api_key)
        self.expected = None if key is None else key.encode("ascii")

    def _authorized(self, scope: dict[str, Any]) -> bool:
        value = b""
        for name, header in scope.get("headers", ()):
            if name.lower() == b"authorization":
                value = header
                break
        scheme, _, given = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.expected)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (self.expected is None or scope["type"] != "http" or scope.get("path") in OPEN_PATHS
                or self._authorized(scope)):
            await self.app(scope, receive, send)
            return
        error = _unauthorized()
        body = json.dumps(error.body()).encode("utf-8")
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


__all__ = ["OPEN_PATHS", "RequireKey", "api_key_problem", "check_api_key"]
