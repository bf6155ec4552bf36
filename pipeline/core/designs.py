"""Which design of a menu a workflow follows, pure: the menu design whose code is most like the workflow's,
by the similarity of their token sequences (difflib's ratio, 2 x matches / total tokens, over Python tokens with
comments and layout dropped), or `other` below MIN_SIMILARITY. A generator that composes or departs from the
examples writes `other`; one that copies an example writes that example's design. The rollout stores it per
workflow (`generations.design`, beside `generations.example`, the design its prompt showed), so how the designs'
shares move round over round, and whether a query's group spans designs, are SQL over the store
(pipeline.store.views: DESIGN_SPAN_SQL, DESIGN_SHARES_SQL).

Where the generator chooses (rollout.menu_choice policy), its workflow opens with a `# design: <name>` line, and
`declared_choice` reads which design it says it uses: a menu name, `combined` (two or more menu names), or `own`
(anything else, or no such line). Stored as `generations.choice`; `design` then checks whether the code follows
what it declared."""

from __future__ import annotations

import ast
import difflib
import io
import math
import random
import re
import tokenize
from collections.abc import Mapping, Sequence

MIN_SIMILARITY = 0.6  # below it a workflow follows none of the menu's designs closely enough to carry its name
OTHER = "other"
OWN = "own"  # a declared choice that names no menu design (or no declaration)
COMBINED = "combined"  # a declared choice naming two or more menu designs
_DECLARATION = re.compile(r"^\s*#\s*design\s*:(.*)$", re.IGNORECASE | re.MULTILINE)
_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
         tokenize.ENDMARKER}


def tempered_log_probs(logprobs: Sequence[float], temperature: float) -> list[float]:
    """log softmax(logprobs / temperature) over the candidates alone: the policy's odds renormalised over the designs'
    label tokens, flattened (temperature > 1) or sharpened (< 1)."""
    if not logprobs or temperature <= 0:
        raise ValueError(f"need candidates and temperature > 0; got {len(logprobs)}, {temperature}")
    scaled = [lp / temperature for lp in logprobs]
    top = max(scaled)
    if top == -math.inf:
        raise ValueError("every candidate has probability 0")
    log_norm = top + math.log(sum(math.exp(s - top) for s in scaled))
    return [s - log_norm for s in scaled]


def tempered_draws(logprobs: Sequence[float], temperature: float, draws: int, seed: int) -> list[tuple[int, float]]:
    """`draws` candidates drawn with replacement from `tempered_log_probs`, each as (index, its log-probability
    there: the probability the sample was drawn with); seeded, so a rollout draws the same designs again.
    Temperature 0 is greedy, as a sampler's: the likeliest candidate every time, with probability 1."""
    if draws < 1:
        raise ValueError(f"need draws >= 1, got {draws}")
    if temperature == 0 and logprobs:
        return [(max(range(len(logprobs)), key=lambda i: logprobs[i]), 0.0)] * draws
    log_probs = tempered_log_probs(logprobs, temperature)
    picks = random.Random(seed).choices(range(len(log_probs)), weights=[math.exp(lp) for lp in log_probs], k=draws)
    return [(i, log_probs[i]) for i in picks]


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


def declared_choice(text: str, names: Sequence[str], labels: Mapping[str, str] | None = None) -> str:
    """The design a workflow's first `# design:` line names: one of `names` (by its name or its label in `labels`,
    name -> label), COMBINED when it names two or more of them, else OWN. A name matches as a whole word, case aside
    ("mixed_pot", "pot", "mixed_pot + steps")."""
    found = _DECLARATION.search(text)
    if found is None:
        return OWN
    said = found.group(1).lower()

    def says(word: str) -> bool:
        return re.search(rf"(?<![\w]){re.escape(word.lower())}(?![\w])", said) is not None

    named = [n for n in names if says(n) or (labels is not None and says(labels.get(n, n)))]
    return named[0] if len(named) == 1 else COMBINED if named else OWN


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _calls_llm(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "llm" for n in ast.walk(node))


def reply_independent(code: str) -> bool | None:
    """Whether the workflow's returned answer can depend on no executor reply, read statically: no `return` of
    `solve` mentions a call to `llm` or a name that a reply flows into (assignments, augmented assignments, `for`
    targets and `name.method(reply)` calls such as `answers.append(reply)`, followed to a fixed point). True for a
    workflow that computes its answer from the query alone (e.g. the query's numbers written into the code) or calls
    the executor only for show; None when the code does not parse. A name tainted in one branch counts everywhere
    (the check over-approximates what flows)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    solve = next((n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef)
                  and n.name == "solve"), tree)
    flows: list[tuple[set[str], ast.AST]] = []  # (names assigned, the value they are assigned from)
    for node in ast.walk(solve):
        if isinstance(node, ast.Assign):
            flows.append((set().union(*(_names(t) for t in node.targets)), node.value))
        elif isinstance(node, ast.AugAssign | ast.AnnAssign) and node.value is not None:
            flows.append((_names(node.target), node.value))
        elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
            flows.append((_names(node.target), node.iter))
        elif isinstance(node, ast.NamedExpr):
            flows.append((_names(node.target), node.value))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and isinstance(node.func.value, ast.Name)):
            flows.append(({node.func.value.id}, ast.Tuple(elts=[*node.args, *(k.value for k in node.keywords)])))
    tainted: set[str] = set()
    changed = True
    while changed:
        changed = False
        for targets, value in flows:
            if not targets <= tainted and (_calls_llm(value) or _names(value) & tainted):
                tainted |= targets
                changed = True
    returns = [n.value for n in ast.walk(solve) if isinstance(n, ast.Return) and n.value is not None]
    return not any(_calls_llm(r) or _names(r) & tainted for r in returns)
