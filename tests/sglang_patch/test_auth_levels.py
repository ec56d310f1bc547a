"""lorapub's state route and its engine-side staging routes are admin-level exactly like SGLang's own
LoRA admin routes, in every
supported release and both forms of the patch, judged by each release's own auth code.

* diff form: the release's ``http_server.py`` with lorapub's diffs applied marks
  ``/lorapub/state`` with the same ``@auth_level`` as ``/load_lora_adapter``;
* runtime form: ``add_state_route`` on a FastAPI app, behind the release's own
  ``add_api_key_middleware``, lets in exactly the callers SGLang lets into its LoRA routes;
* the contract double marks its routes as the release's ``http_server.py`` does and decides
  like the release's ``decide_request_auth``.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import os
import sys
import types

import pytest

from lorapub.sglang_patch import PatchMismatch, targets
from lorapub.sglang_patch.routes import add_staging_routes, add_state_route
from lorapub.testing import sglang_double
from lorapub.wire.routes import CLEANUP_ROUTE, ROUTES
from tests import sglang_real
from tests.sglang_patch.test_lifecycle_gaps import RELEASES, patched_root, root_of

LORA_ROUTES = ("/load_lora_adapter", "/unload_lora_adapter")
LORAPUB_ROUTES = (("GET", targets.STATE_ROUTE), *ROUTES)
# SGLang's own middleware answers with ORJSONResponse, which recent FastAPI marks deprecated
pytestmark = pytest.mark.filterwarnings("ignore:ORJSONResponse is deprecated")


def route_levels(http_server_py: str) -> dict[tuple[str, str], str]:
    """``(method, path) -> level`` for every route of an SGLang ``http_server.py``, read from its
    decorators as SGLang's middleware reads them (no ``@auth_level``: NORMAL)."""
    tree = ast.parse(open(http_server_py).read())
    levels = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        level, routes = "normal", []
        for dec in node.decorator_list:
            if not isinstance(dec, ast.Call) or not isinstance(dec.func, (ast.Attribute, ast.Name)):
                continue
            name = dec.func.attr if isinstance(dec.func, ast.Attribute) else dec.func.id
            if name == "auth_level":
                level = dec.args[0].attr.lower()
            elif name in ("get", "post", "put", "delete", "api_route") and dec.args and isinstance(dec.args[0], ast.Constant):
                methods = [name.upper()]
                for kw in dec.keywords:
                    if kw.arg == "methods":
                        methods = [m.value for m in kw.value.elts]
                routes += [(m, dec.args[0].value) for m in methods]
        for route in routes:
            levels[route] = level
    return levels


def release_auth(release: str) -> types.ModuleType:
    """The release's own ``srt/utils/auth.py`` (standard library imports only)."""
    path = os.path.join(root_of(release), "srt", "utils", "auth.py")
    name = f"lorapub_test_auth_{release.replace('.', '_')}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("release", RELEASES)
def test_the_diff_form_marks_the_state_route_like_sglangs_lora_routes(release, tmp_path):
    pristine = route_levels(os.path.join(root_of(release), targets.HTTP_FILE))
    patched = route_levels(os.path.join(patched_root(release), targets.HTTP_FILE))
    lora = {pristine[("POST", r)] for r in LORA_ROUTES}
    assert lora == {"admin_optional"}, lora  # what SGLang itself does in this release
    for route in LORAPUB_ROUTES:
        assert patched[route] == "admin_optional", route
    assert {k: v for k, v in patched.items() if k not in LORAPUB_ROUTES} == pristine  # nothing else moved


class _FakeTokenizerManager:
    """What ``state_of`` reads from SGLang's TokenizerManager."""

    def __init__(self, registry_module) -> None:
        self.lora_registry = registry_module.LoRARegistry()
        self.server_args = types.SimpleNamespace(max_loaded_loras=3)
        self.pending_lora_unloads: dict = {}

    def _resolve_lora_path(self):  # its globals carry no get_lora: 0.5.17's server_args path
        return None


@pytest.fixture
def sglang_auth_importable(monkeypatch):
    """``from sglang.srt.utils.auth import AuthLevel`` resolves to ``release``'s own module."""

    def install(release: str) -> types.ModuleType:
        auth = release_auth(release)  # loaded before ``sglang`` is stubbed
        for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        monkeypatch.setitem(sys.modules, "sglang.srt.utils.auth", auth)
        return auth

    return install


async def asgi_get(app, path: str, authorization: str | None, method: str = "GET", body: bytes = b"") -> tuple[int, object]:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    if body:
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


KEYS = [(None, None), ("k-api", None), (None, "k-admin"), ("k-api", "k-admin")]
CALLERS = [None, "Bearer k-api", "Bearer k-admin", "Bearer wrong", "k-admin"]


@pytest.mark.parametrize("release", RELEASES)
async def test_the_runtime_route_admits_exactly_whom_sglang_admits_to_its_lora_routes_or_is_not_added(
    release, sglang_auth_importable, monkeypatch
):
    fastapi = pytest.importorskip("fastapi")
    root = root_of(release)  # found before ``sglang`` is stubbed below
    registry_module = sglang_real.lora_registry_module(root)
    level_name = route_levels(os.path.join(root, targets.HTTP_FILE))[("POST", "/load_lora_adapter")]
    auth = sglang_auth_importable(release)
    lora_level = auth.AuthLevel(level_name)
    for api_key, admin_api_key in KEYS:
        app = fastapi.FastAPI()
        app.state.tokenizer_manager = _FakeTokenizerManager(registry_module)
        add_state_route(app, release)
        add_staging_routes(app, release)
        for path in [targets.STATE_ROUTE] + [p for _, p in ROUTES]:
            endpoint = next(r.endpoint for r in app.routes if getattr(r, "path", None) == path)
            assert endpoint._auth_level is lora_level, path
        auth.add_api_key_middleware(app, api_key=api_key, admin_api_key=admin_api_key)
        cleanup = json.dumps({"token": {"epoch": 1, "version_id": "A", "seq": 1}}).encode()
        for caller in CALLERS:
            expected = auth.decide_request_auth(
                method="POST", path="/load_lora_adapter", authorization_header=caller, api_key=api_key,
                admin_api_key=admin_api_key, auth_level=lora_level,
            )
            status, body = await asgi_get(app, targets.STATE_ROUTE, caller)
            staged = await asgi_get(app, CLEANUP_ROUTE, caller, "POST", cleanup)
            if expected.allowed:
                assert status == 200 and body["sglang"] == release and body["adapters"] == {}, (caller, body)
                assert staged[0] == 200 and staged[1]["incarnation"] == body["incarnation"], staged
            else:
                assert (status, body) == (expected.error_status_code, {"error": "Unauthorized"}), (caller, api_key)
                assert staged == (expected.error_status_code, {"error": "Unauthorized"}), (caller, api_key)
    # where SGLang's auth levels cannot be imported, the route is refused, never served unprotected
    monkeypatch.setitem(sys.modules, "sglang.srt.utils.auth", None)
    app = fastapi.FastAPI()
    with pytest.raises(PatchMismatch, match="auth levels"):
        add_state_route(app, release)
    with pytest.raises(PatchMismatch, match="auth levels"):
        add_staging_routes(app, release)
    assert not any(getattr(r, "path", "").startswith("/lorapub/") for r in app.routes)


# -- the contract double ------------------------------------------------------------------------
def test_the_double_marks_each_route_as_sglang_does(tmp_path):
    stock = route_levels(os.path.join(root_of("0.5.23"), targets.HTTP_FILE))
    patched = route_levels(os.path.join(patched_root("0.5.23"), targets.HTTP_FILE))
    for (method, path), level in sglang_double.ROUTE_AUTH_LEVELS.items():
        sglang = patched if path.startswith("/lorapub/") else stock
        assert sglang[(method, path)] == level, (method, path)


@pytest.mark.parametrize("release", RELEASES)
def test_the_doubles_rule_is_sglangs_decide_request_auth(release):
    auth = release_auth(release)
    paths = ["/generate", "/health", "/health_generate", "/ready", "/metrics", "/load_lora_adapter"]
    headers = [None, "Bearer a", "bearer a", "Bearer b", "Bearer a ", "Basic a", "a", "Bearer "]
    for method, path, header, api_key, admin_api_key, level in itertools.product(
        ["GET", "POST", "OPTIONS"], paths, headers, [None, "a"], [None, "b"], ["normal", "admin_optional", "admin_force"]
    ):
        if release == "0.5.17" and path == "/ready":
            continue  # 0.5.17 did not exempt /ready yet; the double follows 0.5.23
        theirs = auth.decide_request_auth(method=method, path=path, authorization_header=header, api_key=api_key,
                                          admin_api_key=admin_api_key, auth_level=auth.AuthLevel(level))
        ours = sglang_double.decide_request_auth(method=method, path=path, authorization_header=header,
                                                 api_key=api_key, admin_api_key=admin_api_key, auth_level=level)
        assert ours[0] == theirs.allowed and (theirs.allowed or ours[1] == theirs.error_status_code), (
            method, path, header, api_key, admin_api_key, level)
