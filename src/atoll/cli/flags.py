"""Flags generated from atoll's typed options models (a flag per field, defaulting to the field's
default, its help the field's description), and flag defaults read from the library code that
owns the knob; the small parsers every command shares."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import math
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, Union

if typing.TYPE_CHECKING:
    from pydantic import BaseModel

M = TypeVar("M", bound="BaseModel")


class LibraryDefault:
    """A flag's default that lives in the library code owning the knob (a dataclass field or a
    function's parameter), read when it is first needed: a run of the command (:func:`atoll.cli.main`
    resolves it) or its ``--help``. Importing that code imports torch, which `atoll --help` should not."""

    def __init__(self, owner: str, name: str) -> None:
        self.owner = owner
        """``module:Name`` of a dataclass or a function."""
        self.name = name

    def value(self) -> Any:
        module, _, attr = self.owner.partition(":")
        obj = getattr(importlib.import_module(module), attr)
        if dataclasses.is_dataclass(obj):
            return next(f.default for f in dataclasses.fields(obj) if f.name == self.name)
        return inspect.signature(obj).parameters[self.name].default

    def __str__(self) -> str:  # argparse's %(default)s in --help
        return str(self.value())


def resolve_defaults(args: argparse.Namespace) -> None:
    """Replace every :class:`LibraryDefault` left in ``args`` (a flag not given) by its value."""
    for key, value in vars(args).items():
        if isinstance(value, LibraryDefault):
            setattr(args, key, value.value())


@dataclass(frozen=True)
class OptionFlag:
    """One flag generated from a field of an options model (``TrainingRunOptions``, ``SupervisorOptions`` …)."""

    path: tuple[str, ...]
    """The field: ``("segment_rounds",)``, ``("fleet", "threads")``."""
    flag: str
    dest: str
    default: Any
    """The field's default, which is the flag's."""
    annotation: Any
    description: str

    @property
    def kind(self) -> str:
        """``bool`` (--x/--no-x), ``mapping`` (repeatable KEY=VALUE) or ``scalar``."""
        if self.annotation is bool:
            return "bool"
        return "mapping" if typing.get_origin(self.annotation) is dict else "scalar"

    def scalar_type(self) -> Any:
        """The flag's argparse type: ``int | None`` parses as an int."""
        args = [a for a in typing.get_args(self.annotation) if a is not type(None)]
        return args[0] if typing.get_origin(self.annotation) in (Union, types.UnionType) else self.annotation

    def value(self, raw: Any) -> Any:
        """The field's value from what argparse parsed."""
        return kv(raw, self.flag) if self.kind == "mapping" else raw


def option_flags(model: type[BaseModel], prefix: tuple[str, ...] = (), *, skip: Iterable[str] = (),
                 names: dict[str, str] | None = None) -> list[OptionFlag]:
    """A flag per field of ``model`` (nested models' fields prefixed with the model's field,
    ``--fleet-threads``), except the top-level fields in ``skip``; ``names`` renames a flag by its
    dotted field path (``{"config_path": "--config"}``)."""
    from pydantic import BaseModel

    skipped = set(skip)
    out: list[OptionFlag] = []
    for name, info in model.model_fields.items():
        if not prefix and name in skipped:
            continue
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            out += option_flags(info.annotation, (*prefix, name), names=names)
            continue
        out.append(field_flag(model, name, prefix, names=names))
    return out


def field_flag(model: type[BaseModel], name: str, prefix: tuple[str, ...] = (), *,
               names: dict[str, str] | None = None) -> OptionFlag:
    """The flag of ``model``'s field ``name`` (``--name-with-dashes``, or ``names``' spelling)."""
    from atoll.runs.options import default_of

    info = model.model_fields[name]
    path = (*prefix, name)
    flag = (names or {}).get(".".join(path)) or "--" + "-".join(path).replace("_", "-")
    return OptionFlag(path=path, flag=flag, dest="__".join(path), default=default_of(model, name),
                      annotation=info.annotation, description=info.description or "")


def add_option_flag(group: Any, f: OptionFlag) -> None:
    """``f`` on a parser or an argument group: --x/--no-x for a bool, repeatable KEY=VALUE for a
    mapping, else one typed value; the help is the field's description with its default."""
    text = f.description.replace("%", "%%")
    if f.kind == "bool":
        group.add_argument(f.flag, dest=f.dest, action=argparse.BooleanOptionalAction, default=f.default,
                           help=f"{text} (default: {'on' if f.default else 'off'})")
    elif f.kind == "mapping":
        group.add_argument(f.flag, dest=f.dest, action="append", default=[f"{k}={v}" for k, v in f.default.items()],
                           metavar="KEY=VALUE", help=text + " Repeatable KEY=VALUE.")
    else:
        kind = f.scalar_type()
        metavar = "N" if kind is int else "S" if f.path[-1].endswith("_s") else f.path[-1].upper()
        shown = "" if f.default is None else " (default: never)" if f.default == math.inf else " (default: %(default)s)"
        group.add_argument(f.flag, dest=f.dest, type=kind, default=f.default, metavar=metavar, help=text + shown)


def options_from_args(model: type[M], flags: Sequence[OptionFlag], args: argparse.Namespace, **given: Any) -> M:
    """The ``model`` the generated ``flags`` in ``args`` set, with the fields in ``given`` (those
    whose flags are written by hand) given by the caller."""
    fields: dict[str, Any] = dict(given)
    parsed = vars(args)
    for f in flags:
        if f.dest in parsed:
            *parents, name = f.path
            target = fields
            for parent in parents:
                target = target.setdefault(parent, {})
            target[name] = f.value(parsed[f.dest])
    return model(**fields)


def kv(pairs: Sequence[str], flag: str = "--storage-option/--env") -> dict[str, str]:
    """``["k=v", ...]`` as a dict; a pair without ``=`` is a one-line error naming ``flag``."""
    out = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def bucket_options(args: argparse.Namespace) -> dict[str, str] | None:
    """The bucket's fsspec options from ``--storage-option`` (None: none given)."""
    return kv(args.storage_option) or None


def add_storage_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option of the bucket, repeatable")
