"""The request-body bound of the HTTP servers (`serve.app`, `serve.router`): ASGI middleware that
answers 413 for a body over its limit, reading the rest of a moderately long body first so that
the client, done sending, reads the answer."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from serve.protocol import ApiError

DRAIN_MAX_BYTES = 64 << 20  # the most an over-limit body is read for its 413 (8x the limit below that)


class BodyLimit:
    """ASGI middleware: 413 for bodies over `max_bytes` (by Content-Length, or while reading);
    `paths`: other bounds for some paths (file uploads). Before the 413 the rest of the body is read
    and discarded up to `drain_bound` bytes (so the client, done sending, reads the answer); a
    longer body is not read and its connection is closed after the 413."""

    def __init__(self, app, max_bytes: int, paths: dict[str, int] | None = None):
        self.app, self.max_bytes, self.paths = app, max_bytes, dict(paths or {})

    @staticmethod
    def drain_bound(max_bytes: int) -> int:
        """How much of an over-limit body is read before its 413: 8x the limit, at most 64 MiB."""
        return min(8 * max_bytes, DRAIN_MAX_BYTES)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        max_bytes = self.paths.get(scope.get("path"), self.max_bytes)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > max_bytes):
            drained = length.isdigit() and int(length) <= self.drain_bound(max_bytes) \
                and await _drain(receive, 0, self.drain_bound(max_bytes))
            return await self._too_large(send, max_bytes, close=not drained)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    if message.get("more_body", False):
                        await _drain(receive, seen, self.drain_bound(max_bytes))
                    raise ApiError(413, f"request body exceeds {max_bytes} bytes")
            return message

        await self.app(scope, limited_receive, send)

    @staticmethod
    async def _too_large(send, max_bytes: int, close: bool):
        """The 413 (with `Connection: close` when the body was not read to its end)."""
        headers = {"Connection": "close"} if close else None
        response = JSONResponse(ApiError(413, f"request body exceeds {max_bytes} bytes").body(), 413, headers=headers)
        await response({"type": "http"}, None, send)


async def _drain(receive, seen: int, bound: int) -> bool:
    """Reads and discards request body messages to the body's end; False if the body passed `bound`
    bytes in all (`seen`: bytes read before) or the client disconnected first."""
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return False
        seen += len(message.get("body", b""))
        if seen > bound:
            return False
        more = message.get("more_body", False)
    return True
