"""The app's pages start with its frame pacing (``ui.page_script``); nothing else it serves changes."""

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from ui.page_script import FRAME_PACING_JS, HeadScript, launch_app_kwargs

PAGE = "<!doctype html><html><head><meta charset='utf-8'></head><body>x</body></html>"


def _client() -> TestClient:
    routes = [Route("/", lambda r: HTMLResponse(PAGE)),
              Route("/config", lambda r: JSONResponse({"head": "<head>"})),
              Route("/form", lambda r: HTMLResponse(PAGE), methods=["POST"])]
    return TestClient(Starlette(routes=routes, middleware=[Middleware(HeadScript)]))


def test_a_page_starts_its_head_with_the_pacing_script_and_says_its_new_length():
    r = _client().get("/")
    assert r.text.startswith(f"<!doctype html><html><head><script>{FRAME_PACING_JS}</script><meta")
    assert r.text.count("<script>") == 1
    assert int(r.headers["content-length"]) == len(r.content)


def test_other_responses_pass_unchanged():
    c = _client()
    assert c.get("/config").json() == {"head": "<head>"}
    assert c.post("/form").text == PAGE


def test_the_launch_arguments_install_it():
    (middleware,) = launch_app_kwargs()["middleware"]
    assert middleware.cls is HeadScript
