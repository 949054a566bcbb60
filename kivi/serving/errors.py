"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

from typing import Any

#: HTTP status -> OpenAI error ``type``
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
               405: "invalid_request_error",
               413: "invalid_request_error", 422: "invalid_request_error",
               499: "invalid_request_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """A request the server answers with ``status`` and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": _text(message), "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": None if param is None else _text(param), "code": code}}


def _text(s: str) -> str:
    """``s`` as UTF-8-encodable text: a request's own field names and values can hold lone surrogates
    (JSON's ``\\ud800``), which no response could be encoded with; they are written ``\\ud800``."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")
