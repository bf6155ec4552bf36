"""Which design of a menu a workflow follows, pure: the menu design whose code is most like the workflow's,
by the similarity of their token sequences (difflib's ratio, 2 x matches / total tokens, over Python tokens with
comments and layout dropped), or `other` below MIN_SIMILARITY. A generator that composes or departs from the
examples writes `other`; one that copies an example writes that example's design. The rollout stores it per
workflow (`generations.design`, beside `generations.example`, the design its prompt showed), so how the designs'
shares move round over round, and whether a query's group spans designs, are SQL over the store
(pipeline.store.views: DESIGN_SPAN_SQL, DESIGN_SHARES_SQL)."""

from __future__ import annotations

import difflib
import io
import tokenize
from collections.abc import Mapping

MIN_SIMILARITY = 0.6  # below it a workflow follows none of the menu's designs closely enough to carry its name
OTHER = "other"
_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
         tokenize.ENDMARKER}


def code_tokens(code: str) -> list[str]:
    """The code's Python tokens without comments and layout; whitespace-split words when it does not tokenize."""
    try:
        return [t.string for t in tokenize.generate_tokens(io.StringIO(code).readline) if t.type not in _SKIP]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return code.split()


def similarity(a: str, b: str) -> float:
    """difflib's ratio of the two codes' token sequences: 1.0 for the same program up to comments and layout."""
    return difflib.SequenceMatcher(None, code_tokens(a), code_tokens(b), autojunk=False).ratio()


def nearest_design(code: str, menu: Mapping[str, str], min_similarity: float = MIN_SIMILARITY) -> tuple[str, float]:
    """(the most similar design's name, its similarity), or (OTHER, the best similarity) below `min_similarity`;
    ties: the earlier design of `menu`."""
    if not menu:
        raise ValueError("nearest_design: empty menu")
    best, score = OTHER, -1.0
    for name, snippet in menu.items():
        s = similarity(code, snippet)
        if s > score:
            best, score = name, s
    return (best if score >= min_similarity else OTHER), score
