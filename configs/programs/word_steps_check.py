# Word problems (the headroom menu): generate and check, resample on disagreement: one greedy step-by-step answer and
# one program-of-thought expression; when their numbers agree that is the answer, else three step-by-step samples at
# 0.7 vote with the first two.
# design: check and resample: a reasoned answer checked by a Python expression; on disagreement three more samples vote
#   pipeline baseline configs/gsm-menu.yaml --method program:configs/programs/word_steps_check.py
# ruff: noqa: E501, F821 (llm is the sandbox's helper)
import re


def final(reply):
    numbers = re.findall(r"-?\d[\d,]*\.?\d*", reply.split("Answer:")[-1].replace("`", ""))
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


async def solve(problem):
    ask = problem + "\nSolve it step by step. End with a line 'Answer: <number>'."
    first = final((await llm(ask))[0])
    expression = (await llm(problem + "\nWrite one Python expression that computes the answer. Reply with the expression only."))[0]
    try:
        value = float(eval(expression.replace("`", "").strip().splitlines()[0].split("=")[0], {"__builtins__": {}}, {}))
        check = str(int(value)) if value.is_integer() else str(round(value, 6))
    except Exception:
        check = None
    if first is not None and first == check:
        return first
    votes = [v for v in [first, check] + [final(r) for r in await llm(ask, temperature=0.7, n=3)] if v is not None]
    return max(votes, key=votes.count) if votes else ""
