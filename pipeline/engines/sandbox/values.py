"""Plain values on the wire between a candidate program and its grader (stdlib only).

Only values built from exact plain types cross: int, float, complex, str, bytes, bool, None, and list,
tuple, dict, set, frozenset of these. Subclasses (a `str` whose `__eq__` always answers True) and any other
object do not: `encode` raises `NotPlain` naming what it met. `decode` is the grader's side and trusts
nothing: whatever bytes the candidate sends, it returns fresh plain objects or raises `ValueError`, so an
object that compares equal to everything can never reach the test's `==`.

Encoding: JSON, where None/bool/int/float/str/list map to themselves and every other type is a one-key
object `{tag: payload}` (JSON objects carry nothing else, so there is no ambiguity). Large ints are hex text:
Python refuses to convert ints above 4300 digits to decimal.
"""

from __future__ import annotations

import json

MAX_DEPTH = 200
_BIG = 1 << 64


class NotPlain(TypeError):
    """A value that is not built from exact plain types."""


def encode(v: object, depth: int = 0) -> object:
    """A JSON-able form of `v`; raises NotPlain for anything but exact plain types."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}")
    t = type(v)
    if v is None or t is bool or t is str or t is float:
        return v
    if t is int:
        return v if -_BIG < v < _BIG else {"i": format(v, "x")}
    if t is list:
        return [encode(x, depth + 1) for x in v]
    if t is tuple or t is set or t is frozenset:
        return {t.__name__: [encode(x, depth + 1) for x in v]}
    if t is dict:
        return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]}
    if t is complex:
        return {"complex": [v.real, v.imag]}
    if t is bytes:
        return {"bytes": v.hex()}
    raise NotPlain(f"a {t.__module__}.{t.__qualname__} object" if t.__module__ != "builtins" else f"a {t.__name__}")


def dumps(v: object) -> str:
    return json.dumps(encode(v), separators=(",", ":"))


def decode(o: object) -> object:
    """The plain value of an encoded form; ValueError on anything else (a forged or broken message)."""
    try:
        return _decode(o, 0)
    except (TypeError, RecursionError) as e:  # e.g. a list as a set member or dict key
        raise ValueError(f"not an encoded plain value: {e}") from None


def _decode(o: object, depth: int) -> object:
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    t = type(o)
    if o is None or t is bool or t is str or t is float or t is int:
        return o
    if t is list:
        return [_decode(x, depth + 1) for x in o]
    if t is not dict or len(o) != 1:
        raise ValueError(f"not an encoded plain value: {t.__name__}")
    (tag, p), = o.items()
    if tag == "i" and type(p) is str:
        return int(p, 16)
    if tag in ("tuple", "set", "frozenset", "dict") and type(p) is list:
        items = [_decode(x, depth + 1) for x in p]
        if tag == "tuple":
            return tuple(items)
        if tag == "dict":
            if not all(type(kv) is list and len(kv) == 2 for kv in items):
                raise ValueError("a dict entry is not a [key, value] pair")
            return {k: x for k, x in items}
        return set(items) if tag == "set" else frozenset(items)
    if tag == "complex" and type(p) is list and len(p) == 2 and all(type(x) in (int, float) for x in p):
        return complex(p[0], p[1])
    if tag == "bytes" and type(p) is str:
        return bytes.fromhex(p)
    raise ValueError(f"unknown value tag {tag!r}")


def loads(s: str | bytes) -> object:
    try:
        o = json.loads(s)
    except RecursionError:
        raise ValueError("nested too deep") from None
    return decode(o)
