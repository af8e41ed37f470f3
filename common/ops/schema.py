"""torch_npu op schemas: load the committed npu_schemas.txt, bind a call to it, find torch_npu calls in source.

A call binds the way torch_npu's generated Python bindings bind it: positional arguments fill the parameters
before `*` in order, parameters after `*` only by keyword, every parameter without a default must be given
(a `Tensor?` without default too), no unknown keywords, and the schema's `self` is spelled `input` as a keyword.
Both the conformance test (static, from the AST) and the emulator (at call time, with light type checks) use `bind`.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import torch

SCHEMA_FILE = Path(__file__).with_name("npu_schemas.txt")
_SKIP_DIRS = {"__pycache__", "build", "dist", "node_modules", "site-packages"}


def load_schemas(path: Path = SCHEMA_FILE) -> dict[str, list[torch.FunctionSchema]]:
    """Op name -> its overloads, parsed with torch._C.parse_schema (the file needs no clean-up)."""
    schemas: dict[str, list[torch.FunctionSchema]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            schema = torch._C.parse_schema(line)
            schemas.setdefault(schema.name, []).append(schema)
    return schemas


def bind(overloads: list[torch.FunctionSchema], args, kwargs, check_types: bool = True) -> dict:
    """Parameter name -> value (defaults filled) for the first overload the call fits; TypeError if none fits."""
    errors = []
    for schema in overloads:
        try:
            return _bind_one(schema, args, kwargs, check_types)
        except TypeError as e:
            errors.append(str(e))
    raise TypeError(" | ".join(errors))


def _keyword(name: str) -> str:
    return "input" if name == "self" else name


def _bind_one(schema, args, kwargs, check_types):
    op = f"torch_npu.{schema.name}{'.' + schema.overload_name if schema.overload_name else ''}"
    params = {p.name: p for p in schema.arguments}
    positional = [p.name for p in schema.arguments if not p.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{op}() takes {len(positional)} positional arguments but {len(args)} were given")
    bound = dict(zip(positional, args))
    for key, value in kwargs.items():
        name = "self" if key == "input" else key
        if name not in params or key == "self":
            raise TypeError(f"{op}() got an unexpected keyword argument '{key}'")
        if name in bound:
            raise TypeError(f"{op}() got multiple values for argument '{key}'")
        bound[name] = value
    for name, p in params.items():
        if name not in bound:
            if not p.has_default_value():
                raise TypeError(f"{op}() missing required argument '{_keyword(name)}'")
            bound[name] = p.default_value
        elif check_types and not _fits(p.type, bound[name]):
            raise TypeError(f"{op}() argument '{_keyword(name)}' must be {p.type}, not {type(bound[name]).__name__}")
    return bound


def _fits(kind, value) -> bool:
    """Light type check of a runtime value against a schema type (ScalarType parses as int: dtypes pass as int)."""
    name = kind.kind()
    if name == "OptionalType":
        return value is None or _fits(kind.getElementType(), value)
    if name == "ListType":
        return isinstance(value, (list, tuple)) and all(_fits(kind.getElementType(), v) for v in value)
    if name == "TensorType":
        return isinstance(value, torch.Tensor)
    if name in ("IntType", "SymIntType"):
        return isinstance(value, (int, torch.dtype)) and not isinstance(value, bool)
    if name == "FloatType":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "BoolType":
        return isinstance(value, bool)
    if name == "StringType":
        return isinstance(value, str)
    return True


@dataclass
class Call:
    """One `torch_npu.<op>(...)` call site."""

    path: Path
    line: int
    op: str
    n_positional: int
    keywords: list[str]
    starred: bool  # *args / **kwargs: cannot be checked statically


def find_torch_npu_calls(root: Path) -> list[Call]:
    """Every `torch_npu.<op>(...)` call in the .py files under root (hidden folders such as .venv / .git skipped)."""
    calls = []
    for path in sorted(Path(root).rglob("*.py")):
        parts = path.relative_to(root).parts[:-1]
        if any(p.startswith(".") or p in _SKIP_DIRS or p.endswith(".egg-info") for p in parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if getattr(node.func.value, "id", None) == "torch_npu":
                keywords = [k.arg for k in node.keywords if k.arg is not None]
                starred = any(isinstance(a, ast.Starred) for a in node.args) or len(keywords) < len(node.keywords)
                calls.append(Call(path, node.lineno, node.func.attr, len(node.args), keywords, starred))
    return calls
