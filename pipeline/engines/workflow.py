"""The workflow contract (docs/design.md §3): Python source defining `async def solve(problem: str) -> str`.

Static checks run before a workflow is ever executed (rollout flags, scoring records `invalid`).
"""

from __future__ import annotations

import ast
import re

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The workflow source in a generation: the fenced block defining `solve`, else the first fenced
    block, else the text before a stray closing fence (code written straight into an opened assistant
    turn ends with ```), else the whole text."""
    blocks = _FENCE.findall(text)
    for b in blocks:
        if "def solve" in b:
            return b.strip("\n")
    head = text.split("```", 1)[0]
    if "```" in text and "def solve" in head:
        return head.strip("\n")
    return blocks[0].strip("\n") if blocks else text.strip("\n")


def check_workflow(code: str, max_chars: int = 20000) -> str | None:
    """None if `code` satisfies the contract statically, else the reason it does not."""
    if len(code) > max_chars:
        return f"too large: {len(code)} chars > {max_chars}"
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        return f"syntax error: {e.msg} (line {e.lineno})"
    for node in tree.body:
        if isinstance(node, ast.AsyncFunctionDef) and node.name == "solve":
            if len(node.args.args) + len(node.args.posonlyargs) < 1:
                return "solve() must take the problem as its first argument"
            return None
        if isinstance(node, ast.FunctionDef) and node.name == "solve":
            return "solve must be `async def`"
    return "no top-level `async def solve(problem)`"
