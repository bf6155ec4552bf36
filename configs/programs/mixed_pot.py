# The mixed task (the headroom menu): program of thought, one greedy Python expression evaluated in the workflow (the
# whole first line, else what precedes its "="); the reply when it does not evaluate.
# design: program of thought: the helper writes one Python expression, the workflow evaluates it exactly
#   pipeline baseline configs/mixed-learn.yaml --method program:configs/programs/mixed_pot.py
# ruff: noqa: E501, F821 (llm is the sandbox's helper)
async def solve(problem):
    reply = (await llm(problem + "\nWrite one Python expression that computes the answer. Reply with the expression only."))[0]
    lines = [x.strip() for x in reply.replace("`", "").splitlines() if x.strip() and x.strip() != "python"]
    for expression in ([lines[0], lines[0].split("=")[0]] if lines else []):
        try:
            value = eval(expression, {"__builtins__": {}}, {})
            return str(int(value)) if float(value).is_integer() else str(value)
        except Exception:
            pass
    return reply
