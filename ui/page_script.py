"""A script the page runs before Gradio's own code, put into the HTML the app serves.

Gradio 6.31's status tracker (its ``statustracker-*.js``) ticks the elapsed-time text of a pending event with a
``requestAnimationFrame`` loop that stops only when the event's status changes; a tracker removed while pending
(the loading screen's, at every page load) keeps its loop for the life of the page. An idle page then asks for
60 frames a second, each a style, layout and compositor pass: Chromium used 10.2-10.4% of a core of the 2-core
AVX2 EPYC on the idle page, 5.0-6.4% with that loop held to 4 frames a second (A/B in one app, interleaved).

``FRAME_PACING_JS`` holds the animation frames Gradio's status tracker asks for itself to one per
``TRACKER_FRAME_MS``: its elapsed time shows tenths of a second, and nothing else of the page is slowed (its
loading spinner's frames, asked for through Svelte's animation loop, are not held: delaying the first one left
Svelte's loop running at ~30 frames a second). ``HeadScript`` is the ASGI
middleware that puts it first in the page's ``<head>`` (Gradio's ``head=`` runs after its modules, too late:
the tracker keeps its own reference to ``requestAnimationFrame`` from when its module loaded).
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: the status tracker's frames, at most one per this many milliseconds
TRACKER_FRAME_MS = 250

FRAME_PACING_JS = """(() => {
  const frame = window.requestAnimationFrame.bind(window);
  window.requestAnimationFrame = function (callback) {
    const caller = (new Error().stack || "").split("\\n")[2] || "";  // (the line after this function's own)
    if (caller.includes("statustracker")) {
      setTimeout(() => frame(callback), %d);
      return 0;
    }
    return frame(callback);
  };
})();""" % TRACKER_FRAME_MS


class HeadScript:
    """ASGI middleware: every HTML page the app answers to a GET starts its ``<head>`` with ``script`` (other
    responses, and compressed ones, pass unchanged)."""

    def __init__(self, app: ASGIApp, script: str = FRAME_PACING_JS):
        self.app = app
        self.tag = f"<script>{script}</script>".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "GET":
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] = {}
        body: list[bytes] = []

        async def patched(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                html = headers.get(b"content-type", b"").startswith(b"text/html")
                if not html or b"content-encoding" in headers:
                    await send(message)
                    return
                start.update(message)  # held until the body is complete: its length changes
                return
            if message["type"] != "http.response.body" or not start:
                await send(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            page = b"".join(body).replace(b"<head>", b"<head>" + self.tag, 1)
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(page)).encode())]})
            await send({"type": "http.response.body", "body": page, "more_body": False})

        await self.app(scope, receive, patched)


def launch_app_kwargs() -> dict[str, Any]:
    """``app_kwargs`` for ``Blocks.launch``: the FastAPI app it builds serves its pages with ``FRAME_PACING_JS``."""
    from starlette.middleware import Middleware

    return {"middleware": [Middleware(HeadScript)]}
