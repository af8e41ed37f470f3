"""What every HTTP handler of the server needs: OpenAI errors and their bodies, and work that stops when its client
leaves."""
from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse


class APIError(Exception):
    """An OpenAI error the app's handler answers with: status, message, type, the request field at fault."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers


def error_response(status: int, message: str, type: str, param: str | None = None, headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


async def run_unless_disconnected(raw: Request, work) -> tuple[bool, object]:
    """Await `work` unless the client disconnects first: then cancel it (which aborts its engine requests, freeing
    their blocks): (False, None); else (True, its result). Streams notice a disconnect themselves; this is for
    whole responses, which uvicorn would otherwise compute to the end for nobody."""
    task = asyncio.ensure_future(work)

    async def disconnect():
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnect())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        return False, None
    return True, task.result()
