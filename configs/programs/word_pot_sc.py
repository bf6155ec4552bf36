# Program of thought with self-consistency for word problems (gsm_symbolic): K = 5 samples at temperature
# design: program of thought, sampled: five Python expressions at temperature 0.7, the most frequent value
# 0.7 in one llm() call (n = K, as the `cot_sc` baseline), each a Python expression evaluated as the `pot` baseline
# evaluates its one (the whole first line, else what precedes its "="); the answer is the most frequent value
# (a tie: the first seen), else the first reply when no sample evaluates. Scored by the exact final number.
#   pipeline baseline configs/gsm-learn.yaml --method program:configs/programs/word_pot_sc.py
K = 5
ASK = "\nWrite one Python expression that computes the answer. Reply with the expression only."


def evaluate(reply):
    """The reply's value as text ("12", "2.5"), or None when its expression does not evaluate to a number."""
    lines = [x.strip() for x in reply.replace("`", "").splitlines() if x.strip() and x.strip() != "python"]
    for line in lines[:1]:
        for expression in (line, line.split("=")[0]):
            try:
                value = float(eval(expression, {"__builtins__": {}}, {}))
            except Exception:
                continue
            return str(int(value)) if value.is_integer() else str(round(value, 6))
    return None


async def solve(problem):
    replies = await llm(problem + ASK, temperature=0.7, n=K)  # noqa: F821 (llm is the sandbox's helper)
    values = [v for v in (evaluate(r) for r in replies) if v is not None]
    return max(values, key=values.count) if values else replies[0]
