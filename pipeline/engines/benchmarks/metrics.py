"""Answer metrics of the non-code benchmarks: pure functions, each returning MetricResult(score, details).

- numeric (GSM8K): the last number of the answer vs the gold number, with a relative tolerance.
- math (MATH): `math_verify` equivalence of the candidate (its last \\boxed{} when present) and the gold
  \\boxed{} answer; timeout-safe from any thread.
- token F1 (DROP, HotpotQA): SQuAD/DROP normalisation, max over gold alternatives; exact match in details.
"""

from __future__ import annotations

import atexit
import json
import math
import re
import select
import string
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any

from pipeline.engines.benchmarks.base import MetricResult

# ---------------------------------------------------------------- numbers

# A number not glued to a preceding digit/dot; an optional sign unless it follows a digit ("10-5" and
# "3 - 5" end in 5, not -5); optional "$"; thousands groups "1,234,567" or plain digits; optional
# decimals ("42." at a sentence end is 42); or a bare ".5".
_NUMBER = re.compile(r"(?<![\d.])(?:(?<!\d\s)([-−–]))?\$?\s?(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?|(?<![\d.])([-−–]?)\.(\d+)")


def last_number(text: str) -> str | None:
    """The last number in `text`, canonical: commas, "$" and "%" dropped, unicode minus -> "-"."""
    found = None
    for m in _NUMBER.finditer(text):
        if m.group(2) is not None:
            sign, whole, frac = m.group(1), m.group(2).replace(",", ""), m.group(3) or ""
        else:
            sign, whole, frac = m.group(4), "0", "." + m.group(5)
        found = ("-" if sign else "") + whole + frac
    return found


def numbers_equal(a: float, b: float, rel_tol: float = 1e-6) -> bool:
    """Equal within rel_tol of the larger magnitude (absolute rel_tol near zero)."""
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=rel_tol)


def numeric_score(answer: str, gold: str, rel_tol: float = 1e-6) -> MetricResult:
    """1 if the last number of `answer` equals the gold number (GSM8K convention), else 0."""
    gold_num = last_number(gold)
    if gold_num is None:
        raise ValueError(f"gold answer {gold!r} contains no number")
    pred = last_number(answer)
    ok = pred is not None and numbers_equal(float(pred), float(gold_num), rel_tol)
    return MetricResult(float(ok), {"extracted": pred, "gold": gold_num, "exact_match": ok})


def gsm8k_gold(solution: str) -> str | None:
    """The gold number after "####" in a GSM8K answer field (None when the marker is missing)."""
    if "####" not in solution:
        return None
    return last_number(solution.split("####")[-1])


# ---------------------------------------------------------------- \boxed{}

_BOX = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")


def last_boxed(text: str) -> str | None:
    """Content of the last top-level \\boxed{...} (or \\fbox{...}, or "\\boxed 5"), braces balanced;
    a box nested inside a box belongs to its outer box. None if there is none (or it is unclosed)."""
    last, pos = None, 0
    while match := _BOX.search(text, pos):
        if match.group(1) is None:  # "\boxed 5": the content runs to the next space or "$"
            content = re.match(r"[^\s$]*", text[match.end() :]).group(0)
            last, pos = (content or None), match.end() + len(content)
            continue
        depth, end = 1, match.end()
        while end < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        if depth:
            break
        last, pos = text[match.end() : end - 1], end
    return last


# ---------------------------------------------------------------- MATH (math_verify)

_MATH_TIMEOUT_S = 5  # per parse / verify call inside math_verify
# A parse of "(x+1)^2" takes milliseconds, but its first call in a process builds the LaTeX parser, and on a loaded
# 2-core machine that overran 5 s: math_verify then returns "unparsable" and a right answer scored 0. A timed-out
# check is tried once more with this budget, then reported as a timeout (MetricTimeout), never as a wrong answer.
_MATH_RETRY_TIMEOUT_S = 30


class MetricTimeout(TimeoutError):
    """The metric could not decide in its time budget: the score stage writes status `timeout`, not a verdict."""


def _verify_once(gold: str, candidate: str, timeout_s: int) -> dict[str, Any]:
    """parse + verify with math_verify's own handling of bad input (unparsable: [], an error: not equivalent), but
    its TimeoutException (a BaseException) raised instead of being read as either."""
    from math_verify import parse, verify

    def parsed(text: str) -> list:
        try:
            return parse(text, parsing_timeout=timeout_s, raise_on_error=True)
        except Exception:  # noqa: BLE001 - unparsable, as math_verify's default (raise_on_error=False) says
            return []

    gold_parsed, pred_parsed = parsed(f"${gold}$"), parsed(candidate)
    try:
        ok = bool(gold_parsed and pred_parsed
                  and verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s, raise_on_error=True))
    except Exception:  # noqa: BLE001 - not equivalent, as math_verify's default says
        ok = False
    return {
        "equivalent": ok,
        "gold_parsed": str(gold_parsed[-1]) if gold_parsed else None,
        "parsed": str(pred_parsed[-1]) if pred_parsed else None,
    }


def _verify_now(gold: str, candidate: str) -> dict[str, Any]:
    """parse + verify in the calling (main) thread, with math_verify's signal-based timeouts; a check that times out
    at _MATH_TIMEOUT_S runs once more at _MATH_RETRY_TIMEOUT_S, then says `timed_out`."""
    from math_verify.errors import TimeoutException

    for timeout_s in (_MATH_TIMEOUT_S, _MATH_RETRY_TIMEOUT_S):
        try:
            return _verify_once(gold, candidate, timeout_s)
        except TimeoutException:
            continue
    return {"equivalent": False, "timed_out": True,
            "error": f"math_verify timed out at {_MATH_TIMEOUT_S} s, then at {_MATH_RETRY_TIMEOUT_S} s"}


def serve_math_verify() -> None:  # pragma: no cover - the child process of _VerifyWorker
    """Answer JSON lines [gold, candidate] on stdin with JSON result lines on stdout."""
    out, sys.stdout = sys.stdout, sys.stderr  # stray prints must not corrupt the protocol
    for line in sys.stdin:
        gold, candidate = json.loads(line)
        try:
            res = _verify_now(gold, candidate)
        except Exception as e:  # a metric never crashes the scorer: report it instead
            res = {"equivalent": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(res) + "\n")
        out.flush()


def stop_worker(proc: subprocess.Popen | None) -> None:
    """Kill a line-protocol worker process and close its pipes (None: nothing to stop); returns None, the stopped
    worker's new handle."""
    if proc is not None:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    return None


class _VerifyWorker:
    """math_verify's timeouts use SIGALRM, which only works in the main thread. Scoring fans out over
    threads, so off the main thread the call goes to one child Python process (its own main thread),
    killed and restarted if it overruns the wall limit. A plain subprocess (not multiprocessing) so it
    never re-imports the caller's __main__."""

    def __init__(self, wall_timeout_s: float):
        self.wall_timeout_s = wall_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> None:
        cmd = [sys.executable, "-c",
               "from pipeline.engines.benchmarks.metrics import serve_math_verify; serve_math_verify()"]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def stop(self) -> None:
        self._proc = stop_worker(self._proc)

    def __call__(self, gold: str, candidate: str) -> dict[str, Any]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self.stop()
                self._start()
            try:
                self._proc.stdin.write(json.dumps([gold, candidate]) + "\n")
                self._proc.stdin.flush()
                ready, _, _ = select.select([self._proc.stdout], [], [], self.wall_timeout_s)
                line = self._proc.stdout.readline() if ready else None
                if line:
                    return json.loads(line)
                if not ready:
                    self.stop()
                    return {"equivalent": False, "timed_out": True,
                            "error": f"timeout after {self.wall_timeout_s:.0f}s"}
                error = "math_verify worker died"
            except OSError as e:  # broken pipe: the child died (e.g. out of memory)
                error = f"math_verify worker died: {e}"
            self.stop()
            return {"equivalent": False, "error": error}


# two tries of three calls (parse, parse, verify), plus the child's start and import of sympy
_worker = _VerifyWorker(wall_timeout_s=3 * (_MATH_TIMEOUT_S + _MATH_RETRY_TIMEOUT_S) + 30)
atexit.register(_worker.stop)


def math_equivalent(gold: str, candidate: str) -> dict[str, Any]:
    """math_verify equivalence of `candidate` (free text/LaTeX) with the gold LaTeX answer; timeout-safe
    from any thread. Returns {"equivalent": bool, "gold_parsed", "parsed"} (+ "error")."""
    if threading.current_thread() is threading.main_thread():
        try:
            return _verify_now(gold, candidate)
        except Exception as e:
            return {"equivalent": False, "error": f"{type(e).__name__}: {e}"}
    return _worker(gold, candidate)


def math_score(answer: str, gold: str) -> MetricResult:
    """MATH: the candidate's last \\boxed{} content if any (else the whole answer) vs the gold answer. Raises
    MetricTimeout where math_verify could not decide in its budgets (a busy machine, not a wrong answer)."""
    boxed = last_boxed(answer)
    candidate = f"${boxed}$" if boxed is not None else answer
    res = math_equivalent(gold, candidate)
    if boxed is not None and not res["equivalent"] and res.get("parsed") is None and not res.get("timed_out"):
        res = math_equivalent(gold, answer)  # an unparsable box: let math_verify look at the whole text
    if res.get("timed_out"):
        raise MetricTimeout(f"{res['error']} (gold {gold!r}, candidate {candidate[:200]!r})")
    details = {"boxed": boxed, "gold": gold, **res}
    return MetricResult(float(res["equivalent"]), details)


# ---------------------------------------------------------------- token F1 (SQuAD / DROP)

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def _normalize_token(tok: str) -> str:
    try:
        return str(float(tok))  # DROP: "2.0" and "2" are the same number
    except ValueError:
        return "".join(ch for ch in tok if ch not in _PUNCT)


def normalize_answer(text: str) -> str:
    """SQuAD/DROP normalisation: lowercase, numbers canonical, punctuation and articles removed,
    whitespace collapsed; hyphens split tokens as in the DROP evaluator."""
    toks = [_normalize_token(t) for t in re.split(r"[\s-]+", text.lower()) if t]
    return " ".join(_ARTICLES.sub(" ", " ".join(toks)).split())


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if not pred_tokens and not gold_tokens:
        return 1.0
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


_YES_NO = {"yes", "no", "noanswer"}


def token_f1(prediction: str, gold: str) -> float:
    """Token-overlap F1 of normalised strings; yes/no answers must match exactly (HotpotQA rule)."""
    p, g = normalize_answer(prediction), normalize_answer(gold)
    if (p in _YES_NO or g in _YES_NO) and p != g:
        return 0.0
    return _f1(p.split(), g.split())


def f1_score(answer: str, golds: Iterable[str]) -> MetricResult:
    """Max token F1 (and exact match) over the gold alternatives."""
    golds = [g for g in golds if g is not None]
    if not golds:
        raise ValueError("no gold answers to compare with")
    norm = normalize_answer(answer)
    f1s = [token_f1(answer, g) for g in golds]
    best = max(range(len(golds)), key=f1s.__getitem__)
    em = any(norm == normalize_answer(g) for g in golds)
    return MetricResult(f1s[best], {"normalized": norm, "best_gold": golds[best], "f1": f1s[best], "exact_match": em})


# ---------------------------------------------------------------- choice letters

# A capital letter standing alone as a choice: "B", "(B)", "[B]", "B.", "Answer: B", "**B**"; not the "A" of "A cat"
# when a later letter stands alone, since the last one wins
_CHOICE = re.compile(r"(?:^|(?<=[\s(\[:*]))([A-Z])(?=$|[\s).\]:,*])")


def choice_letter(text: str) -> str | None:
    """The last capital letter standing alone in `text` (a multiple-choice answer), None if there is none."""
    found = _CHOICE.findall(text.strip())
    return found[-1] if found else None


# ---------------------------------------------------------------- votes (Majority@L)


def vote_key(answer: str | None, family: str) -> str | None:
    """The normalised answer a workflow votes with in Majority@L; None: no vote (no answer, or an empty one).

    code: the answer with whitespace collapsed (programs are compared as written). Otherwise the last
    \\boxed{} content (math) or the last number, canonical ("1,444.0" and "1444" agree, "-67" and "[-67]" too),
    as the numeric metrics read an answer; an answer without a number: its SQuAD/DROP normalisation."""
    if answer is None or not str(answer).strip():
        return None
    text = str(answer).strip()
    if family == "code":
        return " ".join(text.split())
    if family == "math" and (boxed := last_boxed(text)) is not None:
        return " ".join(boxed.split())
    num = last_number(text)
    if num is not None:
        value = float(num)
        return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)
    return normalize_answer(text) or None
