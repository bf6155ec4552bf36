"""A result as a typed record: a dataclass that reads the dict a study or a stage stores (`from_dict`, `read` of its
JSON file) and gives it back key for key (`to_dict`), so that code works on fields while JSON on disk keeps its keys
(pipeline.studies.summaries holds the studies' records; pipeline.stages.rounds.RoundsSummary the loop's)."""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import ClassVar, Self


def _plain(value):
    """A record's value as JSON holds it: records as dicts, in lists and dicts too."""
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass(kw_only=True)
class Record:
    """The dict a study stores, as a dataclass (module doc). A subclass names its nested records in NESTED (a record,
    or a list of them) and KEYED (a dict of them); a record built here (not read) gives its fields in LEAD's order
    first, then in their own, leaving out an OPTIONAL one while it holds its default (a key today's summaries only
    write where it applies)."""

    # keys no field names, in their order
    extra: dict = field(default_factory=dict)
    # the stored dict's key order, so that to_dict rebuilds it as it was; empty for a record built here
    order: tuple[str, ...] = field(default=(), repr=False, compare=False)

    NESTED: ClassVar[dict[str, type[Record]]] = {}
    KEYED: ClassVar[dict[str, type[Record]]] = {}
    LEAD: ClassVar[tuple[str, ...]] = ()
    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def names(cls) -> list[str]:
        """The stored keys a field holds, in the fields' order."""
        return [f.name for f in fields(cls) if f.name not in ("extra", "order")]

    @classmethod
    def from_dict(cls, d: dict) -> Self:
        """Read a stored dict; a key it lacks (written before that figure existed) reads as its default."""
        names = set(cls.names())
        return cls(**{k: cls._read(k, v) for k, v in d.items() if k in names},
                   extra={k: v for k, v in d.items() if k not in names}, order=tuple(d))

    @classmethod
    def read(cls, path: Path) -> Self:
        """A study's stored JSON file (experiment.json, ...)."""
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def _read(cls, name: str, value):
        if value is None:
            return None
        if name in cls.KEYED:
            return {k: cls.KEYED[name].from_dict(v) for k, v in value.items()}
        kind = cls.NESTED.get(name)
        if kind is None:
            return value
        return [kind.from_dict(v) for v in value] if isinstance(value, list) else kind.from_dict(value)

    def to_dict(self) -> dict:
        merged = {n: _plain(getattr(self, n)) for n in self.names()} | self.extra
        keys = self.order or self._built_keys()
        return {k: merged[k] for k in keys if k in merged} | {k: v for k, v in self.extra.items() if k not in keys}

    def _built_keys(self) -> list[str]:
        defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()
                    for f in fields(self) if f.name in self.OPTIONAL}
        names = [*self.LEAD, *(n for n in self.names() if n not in self.LEAD)]
        return [n for n in names if n not in defaults or getattr(self, n) != defaults[n]]

    def field_values(self) -> dict:
        """Field -> value, records kept as they are (to build a record that extends this one)."""
        return {n: getattr(self, n) for n in self.names()}
