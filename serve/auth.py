"""API-key authentication (OpenAI's and vLLM's `--api-key`): an ASGI middleware that answers 401
in OpenAI's error shape unless the request carries `Authorization: Bearer <key>`; a few paths
(/health, /metrics by default) stay open. The key is compared in constant time."""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse


def unauthorized_body() -> dict:
    """OpenAI's 401 body."""
    return {"error": {"message": "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                      "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


class ApiKeyAuth:
    """ASGI middleware: HTTP requests to paths outside `open_paths` need the bearer `api_key`."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...] = ()):
        self.app, self.open_paths = app, frozenset(open_paths)
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not secrets.compare_digest(given, self.expected):
            response = JSONResponse(unauthorized_body(), 401, headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)
