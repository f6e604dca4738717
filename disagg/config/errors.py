"""Config errors: one line naming the field's dotted path, what is wrong and how to fix it.

msgspec validates a config against the schema; :func:`translate` turns its
``ValidationError`` (``Expected `int` >= 1 - at `$.consumer.x```) into that line, worded
from the schema itself: :func:`describe` says what a field takes, the field's
``Meta(examples=...)`` (else its default) gives the "e.g.", an unknown key gets a
did-you-mean from the section's own keys, and a field whose type parses its own syntax
(a size, an endpoint: a type with a ``parse(value, field)`` classmethod) words its own error.
"""

from __future__ import annotations

import difflib
import re
import sys
import typing
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import msgspec.inspect as mi

# The upper bound of a float field that must be finite (msgspec's bounds must be finite
# themselves, and ``gt=0`` alone lets ``inf`` through); describe() leaves it unsaid.
FLOAT_MAX = sys.float_info.max

Token = str | int


class ConfigError(ValueError):
    """A configuration problem; the message names the field (dotted path) and the fix."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def err(field: str, message: str) -> ConfigError:
    return ConfigError(f"{field}: {message}", field)


def choice_error(value: Any, choices: Sequence[Any], field: str) -> ConfigError:
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return err(field, f"unknown value {value!r}{hint}; valid values: {', '.join(names)}")


def unknown_key_error(key: Any, valid: Sequence[str], field: str) -> ConfigError:
    if not isinstance(key, str):
        return err(field, f"keys must be strings; valid keys here: {', '.join(valid)}")
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = (
        f"did you mean '{close[0]}'?" if close else f"valid keys here: {', '.join(sorted(valid))}"
    )
    return err(field, f"unknown key '{key}'; {hint}")


def dotted(tokens: Sequence[Token]) -> str:
    """``["consumer", "producers", 1]`` -> ``consumer.producers[1]``."""
    out = ""
    for t in tokens:
        out += f"[{t}]" if isinstance(t, int) else (f".{t}" if out else t)
    return out


# --------------------------------------------------------------------------- wording


def inline(value: Any) -> str:
    """A value as one would write it in the YAML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(inline(v) for v in value) + "]"
    return str(value)


def _bounds(t: Any, integer: bool) -> str:
    low = (">=", t.ge) if t.ge is not None else (">", t.gt) if t.gt is not None else None
    high = (
        ("<=", t.le)
        if t.le is not None and t.le != FLOAT_MAX
        else ("<", t.lt)
        if t.lt is not None
        else None
    )
    if integer and low and high and low[0] == ">=" and high[0] == "<=":
        return f" {low[1]}-{high[1]}"
    return "".join(
        f" {op} {v:g}" if i == 0 else f" and {op} {v:g}"
        for i, (op, v) in enumerate(b for b in (low, high) if b)
    )


def describe(t: mi.Type, article: bool = True) -> str:
    """What a value of schema type ``t`` must be, e.g. ``an integer >= 1 or null``
    (``article=False``: ``integer >= 1 or null``, for a table)."""
    parts = _parts(t)
    if not article:
        parts = [re.sub(r"^(an?|one of) ", "", p) for p in parts]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _parts(t: mi.Type) -> list[str]:
    """The alternatives ``t`` allows, each in words; null last."""
    unit = None
    if isinstance(t, mi.Metadata):
        unit = (t.extra or {}).get("unit")
        t = t.type
    if isinstance(t, mi.UnionType):
        ordered = sorted(t.types, key=lambda x: isinstance(x, mi.NoneType))
        return [p for x in ordered for p in _parts(x)]
    if isinstance(t, mi.BoolType):
        return ["true", "false"]
    if isinstance(t, mi.IntType):
        return ["an integer" + _bounds(t, integer=True)]
    if isinstance(t, mi.FloatType):
        return ["a number" + (f" of {unit}" if unit else "") + _bounds(t, integer=False)]
    if isinstance(t, mi.StrType):
        return ["a non-empty string" if t.min_length or t.pattern else "a string"]
    if isinstance(t, mi.LiteralType):
        return ["one of " + ", ".join(str(v) for v in t.values)]
    if isinstance(t, (mi.VarTupleType, mi.ListType)):
        item = describe(t.item_type)
        if t.min_length == 1:
            return [f"a list of at least one entry, each {item}"]
        return [f"a list, each entry {item}"]
    if isinstance(t, mi.StructType):
        return ["a mapping (a section)"]
    if isinstance(t, mi.CustomType):
        return [str(getattr(t.cls, "what", t.cls.__name__))]
    if isinstance(t, mi.NoneType):
        return ["null"]
    return ["a value"]


def choices(cls: type, name: str) -> tuple[Any, ...] | None:
    """The values a Literal field ``name`` of struct ``cls`` takes, in the schema's order."""
    return _literal_args(typing.get_type_hints(cls, include_extras=True)[name])


def examples(field: mi.Field) -> list[Any]:
    """The field's ``Meta(examples=...)``, wherever in its type they were attached."""
    for t in _members(field.type):
        if isinstance(t, mi.Metadata) and (t.extra_json_schema or {}).get("examples"):
            return list(t.extra_json_schema["examples"])  # type: ignore[index]
    return []


def description(field: mi.Field) -> str:
    for t in _members(field.type):
        if isinstance(t, mi.Metadata) and (t.extra_json_schema or {}).get("description"):
            return str(t.extra_json_schema["description"])  # type: ignore[index]
    return ""


def _hint(field: mi.Field | None) -> str:
    if field is None:
        return ""
    given = examples(field)
    if given:
        return f"; e.g. {field.name}: {inline(given[0])}"
    if field.default not in (msgspec.NODEFAULT, None) and not isinstance(
        field.default, msgspec.Struct
    ):
        return f"; e.g. {field.name}: {inline(field.default)} (the default)"
    return ""


def _members(t: mi.Type) -> list[mi.Type]:
    """``t`` and, through metadata and unions, every type it is made of (one level)."""
    out = [t]
    inner = t.type if isinstance(t, mi.Metadata) else t
    if isinstance(inner, mi.UnionType):
        out += list(inner.types)
    elif inner is not t:
        out.append(inner)
    return out


def _bare(t: mi.Type) -> mi.Type:
    return t.type if isinstance(t, mi.Metadata) else t


# --------------------------------------------------------------------------- translation


class _Site:
    """Where an error points: the type there and the deepest named field on the way."""

    def __init__(self, root: mi.StructType, tokens: Sequence[Token]) -> None:
        self.type: mi.Type = root
        self.field: mi.Field | None = None
        self.owner: type | None = None  # the struct class that declares ``field``
        self.field_depth = 0
        self.exact = True  # the path ends at ``field`` (not inside it)
        for depth, tok in enumerate(tokens, 1):
            step = self._step(self.type, tok)
            if step is None:
                self.exact = False
                break
            owner = next((_bare(m) for m in _members(self.type) if _is_struct(m)), None)
            self.type, field = step
            if field is not None:
                self.field, self.field_depth = field, depth
                self.owner = owner.cls if isinstance(owner, mi.StructType) else None
        self.exact = self.exact and self.field_depth == len(tokens)

    @staticmethod
    def _step(t: mi.Type, tok: Token) -> tuple[mi.Type, mi.Field | None] | None:
        for m in _members(t):
            m = _bare(m)
            if isinstance(tok, str) and isinstance(m, mi.StructType):
                for f in m.fields:
                    if f.encode_name == tok:
                        return f.type, f
            if isinstance(tok, int) and isinstance(m, (mi.VarTupleType, mi.ListType)):
                return m.item_type, None
        return None

    def struct(self) -> mi.StructType | None:
        for m in _members(self.type):
            if isinstance(_bare(m), mi.StructType):
                return _bare(m)  # type: ignore[return-value]
        return None

    def custom(self) -> Any:
        for m in _members(self.type):
            if isinstance(_bare(m), mi.CustomType):
                return _bare(m).cls  # type: ignore[attr-defined]
        return None

    def literal(self) -> tuple[Any, ...] | None:
        """The choices of a Literal type here, in the order the schema lists them."""
        if not any(isinstance(_bare(m), mi.LiteralType) for m in _members(self.type)):
            return None
        if self.exact and self.owner is not None and self.field is not None:
            return choices(self.owner, self.field.name)
        return next(_bare(m).values for m in _members(self.type) if _is_literal(m))  # type: ignore[attr-defined]


def _is_struct(t: mi.Type) -> bool:
    return isinstance(_bare(t), mi.StructType)


def _is_literal(t: mi.Type) -> bool:
    return isinstance(_bare(t), mi.LiteralType)


def _literal_args(hint: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    for arg in typing.get_args(hint):
        found = _literal_args(arg)
        if found:
            return found
    return None


_MISSING = object()


def _lookup(data: Any, tokens: Sequence[Token]) -> Any:
    for tok in tokens:
        try:
            data = data[tok]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return data


def _tokens(where: str) -> list[Token]:
    return [int(i) if i else k for k, i in re.findall(r"\.([^.\[]+)|\[(\d+)\]", where)]


def translate(
    e: msgspec.ValidationError,
    data: Any,
    root: type,
    at: Sequence[Token] = (),
    lead: Sequence[Token] = (),
) -> ConfigError:
    """msgspec's error from converting ``data`` to ``root`` as one :class:`ConfigError` line.
    ``at``: where ``root`` sits in the file; ``lead``: the path from ``root`` to what was
    converted (``data`` is still given from ``root``)."""
    if isinstance(e.__cause__, ConfigError):  # a section's own check, already worded
        return e.__cause__
    msg, sep, where = str(e).rpartition(" - at `")
    if not sep:
        msg, where = str(e), "$`"
    key_error = where.startswith("key` in `")
    tokens = [*lead, *_tokens(where.removeprefix("key` in `").rstrip("`"))]
    schema = mi.type_info(root)
    assert isinstance(schema, mi.StructType)
    site = _Site(schema, tokens)

    def path(*more: Token) -> str:
        return dotted([*at, *tokens, *more])

    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", msg)
    missing = re.fullmatch(r"Object missing required field `(.*)`", msg)
    struct = site.struct()
    value = _lookup(data, tokens)
    if struct is not None and (unknown or key_error):
        valid = [f.encode_name for f in struct.fields]
        key: Any = unknown[1] if unknown else next(k for k in value if not isinstance(k, str))
        return unknown_key_error(key, valid, path(str(key)))
    if struct is not None and missing:
        field = next(f for f in struct.fields if f.encode_name == missing[1])
        allowed = _Site(schema, [*tokens, field.encode_name]).literal()
        if allowed:
            fix = f"; valid values: {', '.join(map(str, allowed))}"
        else:
            fix = _hint(field) or f": {describe(field.type)}"
        return err(path(field.encode_name), f"is required{fix}")
    parse = getattr(site.custom(), "parse", None)
    if parse is not None:  # a parsed type words its own errors
        try:
            parse(value, path())
        except ConfigError as worded:
            return worded
    allowed = site.literal()
    if allowed is not None:
        return choice_error(value, allowed, path())
    if struct is not None:
        got = type(value).__name__
        if not tokens and not at:
            return ConfigError(f"(top level): must be a mapping of keys to values, got {got}")
        return err(path(), f"must be a mapping (a section), got {got}")
    got = "" if value is _MISSING else f", got {value!r}"
    hint = _hint(site.field) if site.exact else ""
    return err(path(), f"must be {describe(site.type)}{got}{hint}")


def dec_hook(cls: type, value: Any) -> Any:
    """msgspec's hook for the schema's parsed types (a size, an endpoint...): their
    ``parse``; :func:`translate` words a failure again with the field's path."""
    parse = getattr(cls, "parse", None)
    if parse is None:
        raise NotImplementedError(cls)
    try:
        return parse(value, "")
    except ConfigError as e:
        raise ValueError(str(e)) from None


def convert(data: Any, root: type, at: Sequence[Token] = ()) -> Any:
    """``data`` as a ``root`` struct, or the ConfigError naming the field."""
    try:
        return msgspec.convert(data, root, dec_hook=dec_hook)
    except msgspec.ValidationError as e:
        raise translate(e, data, root, at) from None


def convert_field(value: Any, hint: Any, root: type, name: str, at: Sequence[Token]) -> Any:
    """``value`` as field ``name`` of ``root`` (annotated type ``hint``), or the ConfigError."""
    try:
        return msgspec.convert(value, hint, dec_hook=dec_hook)
    except msgspec.ValidationError as e:
        raise translate(e, {name: value}, root, at, lead=[name]) from None
