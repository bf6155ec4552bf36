"""Golden tests of the non-code metrics: equivalent and non-equivalent answers, normalisation edge cases."""

import threading

import pytest

from pipeline.engines.benchmarks import metrics
from pipeline.engines.benchmarks.metrics import (
    f1_score,
    gsm8k_gold,
    last_boxed,
    last_number,
    math_score,
    normalize_answer,
    numeric_score,
    token_f1,
)

# ---------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", "42"),  # sentence-final dot is not a decimal point
        ("She pays $1,234.50 in total", "1234.50"),  # "$" and thousands commas dropped
        ("-7 apples", "-7"),
        ("x = −3", "-3"),  # unicode minus
        ("The total is $-12", "-12"),
        ("10-5", "5"),  # subtraction, not a negative number
        ("3 - 5 = -2", "-2"),
        ("3 - 5", "5"),
        ("1,2,3", "3"),  # a list, not a thousands group
        ("about 50%", "50"),
        ("It is .5", "0.5"),
        ("1,000,000 ants", "1000000"),
        ("first 12 then 7.25", "7.25"),
        ("no digits here", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


@pytest.mark.parametrize(
    ("answer", "gold", "score"),
    [
        ("The answer is 1,000.", "1000", 1.0),
        ("1000", "1,000", 1.0),
        ("So we get -5", "-5", 1.0),
        ("So we get 5", "-5", 0.0),  # sign matters
        ("2.50", "2.5", 1.0),
        ("2.5000001", "2.5", 1.0),  # within the 1e-6 relative tolerance
        ("2.51", "2.5", 0.0),
        ("$18 per day, so $126 a week", "126", 1.0),  # the LAST number counts
        ("126 a week, i.e. 18 per day", "126", 0.0),
        ("50%", "50", 1.0),
        ("I cannot tell", "7", 0.0),
    ],
)
def test_numeric_score(answer, gold, score):
    assert numeric_score(answer, gold).score == score


def test_numeric_score_details_and_tolerance():
    r = numeric_score("Total: $1,500.", "1500")
    assert r.details == {"extracted": "1500", "gold": "1500", "exact_match": True}
    assert numeric_score("I cannot tell", "7").details["extracted"] is None
    assert numeric_score("100.5", "100", rel_tol=0.01).score == 1.0  # |diff| 0.5 <= 0.01 * 100.5
    assert numeric_score("102", "100", rel_tol=0.01).score == 0.0
    with pytest.raises(ValueError, match="no number"):
        numeric_score("3", "none")


def test_gsm8k_gold():
    assert gsm8k_gold("She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7") == "7"
    assert gsm8k_gold("Total 1000 + 234\n#### 1,234") == "1234"
    assert gsm8k_gold("no marker 12") is None


# ---------------------------------------------------------------- \boxed{}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{\frac{1}{\sqrt{2}}}.", r"\frac{1}{\sqrt{2}}"),  # nested braces
        (r"\boxed{1} then \boxed{2}", "2"),  # the last box
        (r"\boxed{a + \boxed{b}}", r"a + \boxed{b}"),  # a box inside a box belongs to the outer one
        (r"$\boxed 5$", "5"),  # brace-less form
        (r"\fbox{x}", "x"),
        (r"\boxed{unclosed", None),
        ("plain 3", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


# ---------------------------------------------------------------- MATH


@pytest.mark.parametrize(
    ("answer", "gold", "equivalent"),
    [
        ("0.5", r"\frac{1}{2}", True),
        (r"The answer is $\boxed{\dfrac{1}{2}}$.", r"\frac{1}{2}", True),
        (r"\boxed{\frac12}", r"\frac{1}{2}", True),
        ("so it is 1/2", r"\frac{1}{2}", True),
        (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", True),
        ("0.25", r"\frac{1}{2}", False),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", True),  # nested box content, rationalised
        (r"\boxed{\sqrt{3}}", r"\frac{1}{\sqrt{2}}", False),
        (r"first \boxed{3}, finally \boxed{4}", "4", True),  # the candidate's last box
        (r"first \boxed{4}, finally \boxed{3}", "4", False),
        (r"\boxed{x^2+2x+1}", "(x+1)^2", True),
        ("I do not know", "7", False),
    ],
)
def test_math_score(answer, gold, equivalent):
    r = math_score(answer, gold)
    assert r.score == float(equivalent), r.details
    assert r.details["equivalent"] is equivalent


def test_a_math_verify_timeout_is_tried_again_then_said_never_read_as_a_wrong_answer(monkeypatch):
    """math_verify reads its own timeout as "unparsable", so on a loaded machine a right answer scored 0 (CI saw
    `\\boxed{x^2+2x+1}` vs `(x+1)^2` fail so). A parse that times out at 5 s runs once more at 30 s (the right
    verdict); one that times out at both raises MetricTimeout, which the score stage writes as `timeout`."""
    import math_verify
    from math_verify.errors import TimeoutException

    from pipeline.engines.benchmarks import metrics

    real, budgets = math_verify.parse, []

    def slow_first(text, *, parsing_timeout, raise_on_error):
        budgets.append(parsing_timeout)
        if parsing_timeout < 30:
            raise TimeoutException("slow")
        return real(text, parsing_timeout=parsing_timeout, raise_on_error=raise_on_error)

    monkeypatch.setattr(math_verify, "parse", slow_first)
    r = math_score(r"\boxed{x^2+2x+1}", "(x+1)^2")
    assert r.score == 1.0 and r.details["equivalent"] is True and budgets == [5, 30, 30]

    def always_slow(text, *, parsing_timeout, raise_on_error):
        budgets.append(parsing_timeout)
        raise TimeoutException("slow")

    budgets.clear()
    monkeypatch.setattr(math_verify, "parse", always_slow)
    with pytest.raises(metrics.MetricTimeout, match="timed out at 5 s, then at 30 s"):
        math_score(r"\boxed{x^2+2x+1}", "(x+1)^2")
    assert budgets == [5, 30]  # the gold's parse timed out each time; the whole text is not tried after a timeout
    # an unparsable answer is still a wrong one, not a timeout
    monkeypatch.setattr(math_verify, "parse", real)
    assert math_score(r"\boxed{\frac{}{", "7").score == 0.0


def test_math_score_details():
    r = math_score(r"so $\boxed{\dfrac{1}{2}}$", r"\frac{1}{2}")
    assert r.details["boxed"] == r"\dfrac{1}{2}" and r.details["gold"] == r"\frac{1}{2}"
    assert r.details["parsed"] == r.details["gold_parsed"] == r"\frac{1}{2}"  # \dfrac parsed to the same value
    plain = math_score("12", "12").details
    assert plain["boxed"] is None and plain["parsed"] == plain["gold_parsed"] == "12"


def _in_thread(fn, *args):
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def test_math_score_off_main_thread_uses_the_worker():
    # math_verify's own timeouts need the main thread: off it, the call goes to the child process
    assert _in_thread(math_score, "0.5", r"\frac{1}{2}").score == 1.0
    assert _in_thread(math_score, "0.4", r"\frac{1}{2}").score == 0.0
    assert metrics._worker._proc is not None and metrics._worker._proc.poll() is None


def test_worker_overrunning_the_wall_limit_is_killed_and_restarted():
    w = metrics._VerifyWorker(wall_timeout_s=1e-4)  # far shorter than starting Python + sympy
    try:
        res = w(r"\frac{1}{2}", "0.5")
        assert res["equivalent"] is False and res["error"].startswith("timeout")
        assert w._proc is None  # killed
        w.wall_timeout_s = 120
        assert w(r"\frac{1}{2}", "0.5")["equivalent"] is True  # a fresh child
    finally:
        w.stop()


# ---------------------------------------------------------------- token F1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  a  cat,  an owl and THE dog. ", "cat owl and dog"),
        ("well-known", "well known"),  # hyphens split tokens (DROP)
        ("2.0", "2.0"),
        ("2", "2.0"),  # numbers canonical
        ("it's", "its"),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_token_f1_hand_computed():
    # "big red dog" vs "red dog house": 2 common tokens, P = R = 2/3 -> F1 = 2/3
    assert token_f1("the big red dog", "red dog house") == pytest.approx(2 / 3)
    # "red" vs "red dog": P = 1, R = 1/2 -> F1 = 2/3
    assert token_f1("red", "a red dog") == pytest.approx(2 / 3)
    # repeated tokens count with multiplicity: "dog dog" vs "dog": common 1, P = 1/2, R = 1 -> 2/3
    assert token_f1("dog dog", "dog") == pytest.approx(2 / 3)
    assert token_f1("cat", "dog") == 0.0
    assert token_f1("", "dog") == 0.0


def test_token_f1_yes_no_must_match_exactly():
    assert token_f1("yes it is", "yes") == 0.0
    assert token_f1("Yes.", "yes") == 1.0
    assert token_f1("no", "yes") == 0.0


def test_f1_score_max_over_gold_alternatives():
    r = f1_score("the Chaz Schilens", ["Tony Scheffler", "Chaz Schilens", "Schilens"])
    assert r.score == 1.0 and r.details["exact_match"] is True and r.details["best_gold"] == "Chaz Schilens"
    r = f1_score("Schilens caught it", ["Tony Scheffler", "Chaz Schilens"])
    # vs "chaz schilens": common 1, P = 1/3, R = 1/2 -> F1 = 0.4; vs "tony scheffler": 0
    assert r.score == pytest.approx(0.4) and r.details["exact_match"] is False
    assert r.details["normalized"] == "schilens caught it"
    assert f1_score("2.0 points", ["2", "two"]).score == pytest.approx(2 / 3)  # "2.0" == "2"
    assert f1_score("3", ["2"]).score == 0.0
    with pytest.raises(ValueError, match="no gold"):
        f1_score("x", [])
