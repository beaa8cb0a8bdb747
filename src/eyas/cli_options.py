"""Command-line options generated from a config dataclass: each option is declared once, as a field.

`@options_from("eyas.train.loop:TrainConfig")` turns every field of a `kw_only` dataclass into a
typer option of the decorated command: the field name `max_new_tokens` becomes `--max-new-tokens`,
the string literal under the field becomes its --help text, its default is the option's default
(a field without one is a required option), `bool` fields become `--x/--no-x`, `list[int]` fields
take comma-separated text (`--aux-layers 2,14,27`), `list[str]` fields a repeated option, and
`Path`/`X | None` map to typer's own types. The command receives the built config (its
`__post_init__` validates every value and names the option, exit 2, before any model loads) plus
its own extra options (those that are not config fields, e.g. `eyas eval --out`).

Key trade-off: the fields are read from the class's SOURCE with `ast`, not by importing it, so
`eyas --help` and every other command stay fast (the config modules import torch). The defaults
read that way are literals (or `field(default_factory=list)`); anything else is refused when the
CLI is built, and tests/test_cli_options.py checks that the source-read defaults equal the
imported class's.

Field metadata understood: `field(default=..., metadata={"flag": "--server-url"})` spells the option
differently from the field (a repeated option named in the singular), `{"parse": "module:function"}`
takes text and turns it into the field's value (`--shard-bytes 512MiB`); any other key is refused
when the CLI is built.

One name per meaning, across commands: `--model-dtype` the dtype a model computes in (capture,
regenerate, eval, generate, train), `--store-dtype` the dtype capture stores hidden states in,
`--weights-dtype` the dtype export writes weights in, `--max-retries` the retries of one server
request (regenerate; capture's SGLang-backend options all carry the `--sglang-` prefix:
`--sglang-max-retries`). There are no hidden aliases: an old spelling is click's usual "no such
option" (exit 2).

Run: used by eyas/commands/*.py; `pytest tests/test_cli_options.py`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from eyas.config_checks import option_name, parse_int_list
from eyas.errors import EyasError

REQUIRED = ...
METADATA_KEYS = ("flag", "parse")
_TYPES = {"Path": Path, "list": list, "int": int, "float": float, "str": str, "bool": bool, "Any": Any, "None": None}


@dataclass
class FieldSpec:
    """One config field as the CLI sees it."""

    name: str
    hint: Any
    """The evaluated annotation (e.g. `list[int] | None`)."""
    default: Any
    """The literal default, REQUIRED (...) when the field has none."""
    doc: str
    flag: str
    parse: str | None = None
    """"module:function" turning the option's text into the field's value (e.g. '1GB' -> bytes)."""

    @property
    def base(self) -> Any:
        """The annotation without `| None`."""
        args = [a for a in typing.get_args(self.hint) if a is not type(None)]
        if typing.get_origin(self.hint) in (typing.Union, types.UnionType) and len(args) == 1:
            return args[0]
        return self.hint


def _literal(node: ast.expr, where: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    # constant arithmetic such as `1 << 30`: only numbers and operators, so evaluating it runs no code
    if all(isinstance(n, (ast.BinOp, ast.UnaryOp, ast.Constant, ast.operator, ast.unaryop)) for n in ast.walk(node)):
        return eval(compile(ast.Expression(node), where, "eval"), {"__builtins__": {}})  # noqa: S307
    raise TypeError(
        f"{where}: the default must be a literal for the CLI to read it from the source (got `{ast.unparse(node)}`)"
    )


def _default_of(node: ast.expr | None, where: str) -> tuple[Any, dict]:
    """(default, metadata) of a field's right-hand side."""
    if node is None:
        return REQUIRED, {}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "field":
        kw = {k.arg: k.value for k in node.keywords}
        meta = _literal(kw["metadata"], where) if "metadata" in kw else {}
        if "default" in kw:
            return _literal(kw["default"], where), meta
        factory = kw.get("default_factory")
        if factory is None:
            return REQUIRED, meta
        if isinstance(factory, ast.Name) and factory.id == "list":
            return [], meta
        if isinstance(factory, ast.Lambda):
            return _literal(factory.body, where), meta
        raise TypeError(f"{where}: default_factory `{ast.unparse(factory)}` is not readable from the source")
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "Path"
        and len(node.args) == 1
        and not node.keywords
    ):
        return Path(_literal(node.args[0], where)), {}
    return _literal(node, where), {}


def read_fields(target: str) -> list[FieldSpec]:
    """The fields of `module:Class`, read from the module's source (the module is not imported)."""
    module, cls = target.split(":")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"cannot find the source of {module}")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        raise ImportError(f"{module} has no class {cls}")
    out: list[FieldSpec] = []
    body = node.body
    for i, stmt in enumerate(body):
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        name = stmt.target.id
        where = f"{target}.{name}"
        nxt = body[i + 1] if i + 1 < len(body) else None
        doc = ""
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            doc = " ".join(nxt.value.value.split())
        default, meta = _default_of(stmt.value, where)
        unknown = sorted(set(meta) - set(METADATA_KEYS))
        if unknown:
            raise TypeError(f"{where}: field metadata {unknown} not understood (expected {', '.join(METADATA_KEYS)})")
        hint = eval(ast.unparse(stmt.annotation), {"__builtins__": {}}, dict(_TYPES))  # noqa: S307 (our own source)
        out.append(
            FieldSpec(
                name=name,
                hint=hint,
                default=default,
                doc=doc,
                flag=meta.get("flag", option_name(name)),
                parse=meta.get("parse"),
            )
        )
    return out


def _typer_param(spec: FieldSpec) -> tuple[Any, Any]:
    """(annotation, typer.Option) of one field."""
    base, optional = spec.base, spec.base is not spec.hint
    default = spec.default
    if spec.parse is not None:  # text parsed in _convert; the default is shown as the field holds it
        text = default if default in (None, REQUIRED) else str(default)
        return str | None, typer.Option(text, spec.flag, help=spec.doc)
    if base is bool:
        stem = spec.flag[2:]
        return (bool | None if optional else bool), typer.Option(default, f"--{stem}/--no-{stem}", help=spec.doc)
    origin = typing.get_origin(base)
    if origin is list:
        (inner,) = typing.get_args(base)
        if inner is int:  # comma-separated text, parsed (and refused naming the option) in _convert
            text = None if default in (None, REQUIRED) else ",".join(map(str, default))
            return str | None, typer.Option(REQUIRED if default is REQUIRED else text, spec.flag, help=spec.doc)
        if inner is str:  # a repeated option
            return list[str] | None, typer.Option(
                None if default in (None, []) else default, spec.flag, help=spec.doc + " Repeatable."
            )
        raise TypeError(f"{spec.name}: list[{inner}] options are not supported")
    if base not in (int, float, str, Path):
        raise TypeError(f"{spec.name}: options of type {base} are not supported")
    return (base | None if optional or default is None else base), typer.Option(default, spec.flag, help=spec.doc)


def _convert(spec: FieldSpec, value: Any) -> Any:
    if spec.parse is not None:
        module, func = spec.parse.split(":")
        return value if value is None else getattr(importlib.import_module(module), func)(value)
    origin = typing.get_origin(spec.base)
    if origin is list and typing.get_args(spec.base) == (int,):
        return parse_int_list(value, option=spec.flag, min_value=None)
    if origin is list:
        return list(value or [])
    return value


def options_from(target: str, *, exclude: tuple[str, ...] = ()) -> Callable[[Callable[..., dict]], Callable[..., dict]]:
    """Decorate `body(cfg, *, extra options...)`: the command gets one option per field of `target`
    ("module:Class"; fields in `exclude` keep their default and are not options) followed by body's
    own keyword options; the config is built (and validated) before body runs. A ValueError from the
    config's checks becomes an EyasError (exit 2)."""

    def decorate(body: Callable[..., dict]) -> Callable[..., dict]:
        specs = [s for s in read_fields(target) if s.name not in exclude]
        extra = list(inspect.signature(body, eval_str=True).parameters.values())[1:]
        clash = {s.name for s in specs} & {p.name for p in extra}
        if clash:
            raise TypeError(f"{body.__name__}: options {sorted(clash)} are both config fields and extra options")
        params = []
        for s in specs:
            annotation, option = _typer_param(s)
            params.append(
                inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)
            )
        # the command's own options first: they are usually the required paths (--drafter, --out)
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in extra] + params

        def command(**kwargs: Any) -> dict:
            values = {s.name: _convert(s, kwargs.pop(s.name)) for s in specs}
            module, cls = target.split(":")
            config_cls = getattr(importlib.import_module(module), cls)
            try:
                cfg = config_cls(**values)
            except EyasError:
                raise
            except ValueError as exc:
                raise EyasError(str(exc)) from exc
            return body(cfg, **kwargs)

        command.__name__ = body.__name__
        command.__qualname__ = body.__qualname__
        command.__module__ = body.__module__
        command.__doc__ = body.__doc__
        command.__signature__ = inspect.Signature(params, return_annotation=dict)
        command.__annotations__ = {p.name: p.annotation for p in params} | {"return": dict}
        command.config_fields = [s.name for s in specs]
        return command

    return decorate
