"""What SGLang's HTTP server accepts, read from SGLang's installed source.

Importing `sglang.srt.entrypoints.http_server` needs CUDA-only packages, so its routes and request
types are read with `ast` instead, from the files of the installed `sglang` package:

- routes: every `@app.get/post/put/delete/api_route("/path", methods=[...])` (and `@router....` of
  the routers it includes) under `sglang/srt/entrypoints/`, with the handler's body type (the
  annotation of its `Annotated[X, Body()]` or plain `X` parameter) and its query parameters;
- request types: the `msgspec.Struct` classes of `sglang/srt/managers/io_struct.py` (and
  `SamplingParams`, what a generate request's `sampling_params` becomes), their fields (own and
  inherited), defaults and annotations.

A body is checked as FastAPI checks it (SGLang's types reach pydantic through
`msgspec_struct_pydantic_core_schema`: required fields, types, literals), and more strictly on one
point: a key SGLang does not declare is an error here, because SGLang would drop it without a word.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic

SGLANG_VERSION = "0.5.23"
BODY_FREE = "no body"  # a route whose handler takes no body
REQUEST_TYPE_FILES = ("srt/managers/io_struct.py", "srt/sampling/sampling_params.py")


def sglang_root() -> Path | None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Route:
    path: str
    methods: frozenset[str]
    handler: str
    body_type: str  # a request type's name, or BODY_FREE
    query: frozenset[str]
    source: str
    auth: str  # its `@auth_level(AuthLevel.X)` ("normal" without one)


@dataclass
class StructField:
    name: str
    annotation: str
    required: bool


@dataclass
class RequestType:
    name: str
    fields: dict[str, StructField] = field(default_factory=dict)


def _const_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _body_type(annotation: ast.AST | None) -> str | None:
    """`Annotated[X, Body()]`, `Optional[X]`, `X` -> "X" (None for Request and the like)."""
    if annotation is None:
        return None
    if isinstance(annotation, ast.Subscript):
        head = ast.unparse(annotation.value)
        inner = annotation.slice.elts[0] if isinstance(annotation.slice, ast.Tuple) else annotation.slice
        if head in ("Annotated", "Optional", "typing.Optional"):
            return _body_type(inner)
        return None
    name = ast.unparse(annotation)
    return name if name.endswith(("ReqInput", "Request")) and name not in ("Request", "RawRequest") else None


def _routes_of(path: Path) -> list[Route]:
    tree = ast.parse(path.read_text())
    routes = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        auth = "normal"
        for dec in node.decorator_list:
            if (isinstance(dec, ast.Call) and ast.unparse(dec.func) == "auth_level" and dec.args
                    and isinstance(dec.args[0], ast.Attribute)):
                auth = dec.args[0].attr.lower()
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args):
                continue
            verb = dec.func.attr
            route_path = _const_str(dec.args[0])
            if route_path is None or verb not in ("get", "post", "put", "delete", "api_route"):
                continue
            if verb == "api_route":
                methods = ["GET"]
                for kw in dec.keywords:
                    if kw.arg == "methods" and isinstance(kw.value, ast.List | ast.Tuple):
                        methods = [_const_str(e) or "" for e in kw.value.elts]
            else:
                methods = [verb.upper()]
            body = BODY_FREE
            query = set()
            args = node.args.args + node.args.kwonlyargs
            for arg in args:
                found = _body_type(arg.annotation)
                if found is not None:
                    body = found
                elif arg.annotation is not None and ast.unparse(arg.annotation) not in ("Request", "RawRequest"):
                    query.add(arg.arg)
            routes.append(Route(route_path, frozenset(methods), node.name, body, frozenset(query), path.name, auth))
    return routes


@functools.cache
def routes() -> dict[str, list[Route]]:
    """Path -> the routes SGLang's HTTP server declares for it."""
    root = sglang_root()
    assert root is not None, "sglang is not installed"
    out: dict[str, list[Route]] = {}
    for path in sorted((root / "srt" / "entrypoints").glob("*.py")):
        for route in _routes_of(path):
            out.setdefault(route.path, []).append(route)
    return out


@functools.cache
def request_types() -> dict[str, RequestType]:
    root = sglang_root()
    assert root is not None, "sglang is not installed"
    classes: dict[str, ast.ClassDef] = {}
    for rel in REQUEST_TYPE_FILES:
        tree = ast.parse((root / rel).read_text())
        classes.update({n.name: n for n in tree.body if isinstance(n, ast.ClassDef)})
    out: dict[str, RequestType] = {}

    def build(name: str) -> RequestType:
        if name in out:
            return out[name]
        node = classes[name]
        rt = RequestType(name)
        for base in node.bases:
            base_name = ast.unparse(base)
            if base_name in classes:
                rt.fields.update(build(base_name).fields)
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                annotation = ast.unparse(stmt.annotation)
                if annotation.startswith(("ClassVar", "typing.ClassVar")):
                    continue
                rt.fields[stmt.target.id] = StructField(stmt.target.id, annotation, stmt.value is None)
        out[name] = rt
        return rt

    for name in classes:
        build(name)
    return out


_TYPING = {name: getattr(typing, name) for name in ("Any", "Dict", "List", "Literal", "Optional", "Tuple", "Union")}


def _python_type(annotation: str) -> Any:
    """An annotation's type for pydantic; a name this module cannot resolve (one of SGLang's own
    classes) is `Any`, so only what is certain is checked."""
    try:
        return eval(annotation, {"__builtins__": {}}, {**_TYPING, "str": str, "int": int, "float": float,  # noqa: S307
                                                       "bool": bool, "list": list, "dict": dict, "None": None})
    except (NameError, AttributeError, TypeError, SyntaxError):
        return Any


@functools.cache
def body_model(type_name: str) -> type[pydantic.BaseModel]:
    rt = request_types()[type_name]
    fields: dict[str, Any] = {}
    for f in rt.fields.values():
        fields[f.name] = (_python_type(f.annotation), ... if f.required else None)
    return pydantic.create_model(type_name, __config__=pydantic.ConfigDict(extra="forbid"), **fields)


def route_for(method: str, path: str) -> Route | None:
    for route in routes().get(path, []):
        if method in route.methods:
            return route
    return None


def problems(method: str, path: str, query: dict[str, str], body: Any) -> list[str]:
    """What SGLang would refuse, or silently ignore, in this request; [] when it takes it as sent."""
    candidates = routes().get(path)
    if not candidates:
        return [f"{path}: SGLang {SGLANG_VERSION} has no such endpoint"]
    route = route_for(method, path)
    if route is None:
        allowed = sorted(set().union(*(r.methods for r in candidates)))
        return [f"{method} {path}: SGLang allows only {allowed}"]
    out = [f"{path}: query parameter {q!r} is not one of {sorted(route.query)}" for q in query if q not in route.query]
    if route.body_type == BODY_FREE:
        if body not in (None, {}):
            out.append(f"{path}: SGLang takes no body here, so {sorted(body) if isinstance(body, dict) else body} "
                       "would be ignored")
        return out
    if route.body_type not in request_types():
        return out + [f"{path}: body type {route.body_type} not found in io_struct.py"]
    out += _validate(path, route.body_type, body if body is not None else {})
    if route.body_type == "GenerateReqInput" and isinstance((body or {}).get("sampling_params"), dict):
        out += _validate(path, "SamplingParams", body["sampling_params"])
    return out


def _validate(path: str, type_name: str, body: Any) -> list[str]:
    out = []
    try:
        body_model(type_name).model_validate(body)
    except pydantic.ValidationError as exc:
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                out.append(f"{path}: {type_name} has no field {where!r} (SGLang would ignore it)")
            else:
                out.append(f"{path}: {type_name}.{where}: {err['msg']}")
    return out
