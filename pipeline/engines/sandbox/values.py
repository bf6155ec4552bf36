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


def encode(value: object, depth: int = 0) -> object:
    """A JSON-able form of `value`; raises NotPlain for anything but exact plain types."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is float:
        return value
    if kind is int:
        return value if -_BIG < value < _BIG else {"i": format(value, "x")}
    if kind is list:
        return [encode(x, depth + 1) for x in value]
    if kind is tuple or kind is set or kind is frozenset:
        return {kind.__name__: [encode(x, depth + 1) for x in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in value.items()]}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    if kind is bytes:
        return {"bytes": value.hex()}
    raise NotPlain(f"a {kind.__module__}.{kind.__qualname__} object" if kind.__module__ != "builtins"
                   else f"a {kind.__name__}")


def dumps(v: object) -> str:
    return json.dumps(encode(v), separators=(",", ":"))


def decode(o: object) -> object:
    """The plain value of an encoded form; ValueError on anything else (a forged or broken message)."""
    try:
        return _decode(o, 0)
    except (TypeError, RecursionError) as e:  # e.g. a list as a set member or dict key
        raise ValueError(f"not an encoded plain value: {e}") from None


def _decode(encoded: object, depth: int) -> object:
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    kind = type(encoded)
    if encoded is None or kind is bool or kind is str or kind is float or kind is int:
        return encoded
    if kind is list:
        return [_decode(x, depth + 1) for x in encoded]
    if kind is not dict or len(encoded) != 1:
        raise ValueError(f"not an encoded plain value: {kind.__name__}")
    (tag, payload), = encoded.items()
    if tag == "i" and type(payload) is str:
        return int(payload, 16)
    if tag in ("tuple", "set", "frozenset", "dict") and type(payload) is list:
        items = [_decode(x, depth + 1) for x in payload]
        if tag == "tuple":
            return tuple(items)
        if tag == "dict":
            if not all(type(kv) is list and len(kv) == 2 for kv in items):
                raise ValueError("a dict entry is not a [key, value] pair")
            return {k: x for k, x in items}
        return set(items) if tag == "set" else frozenset(items)
    if (tag == "complex" and type(payload) is list and len(payload) == 2
            and all(type(x) in (int, float) for x in payload)):
        return complex(payload[0], payload[1])
    if tag == "bytes" and type(payload) is str:
        return bytes.fromhex(payload)
    raise ValueError(f"unknown value tag {tag!r}")


def loads(s: str | bytes) -> object:
    try:
        o = json.loads(s)
    except RecursionError:
        raise ValueError("nested too deep") from None
    return decode(o)
