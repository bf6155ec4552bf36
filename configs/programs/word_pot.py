# Word problems (the headroom menu): program of thought, one greedy Python expression evaluated in the workflow (the
# whole first line, else what precedes its "="), as the `pot` baseline; else the reply.
# design: program of thought: the helper writes one Python expression, the workflow evaluates it
#   pipeline baseline configs/gsm-menu.yaml --method program:configs/programs/word_pot.py
# ruff: noqa: E501, F821 (llm is the sandbox's helper)
async def solve(problem):
    reply = (await llm(problem + "\nWrite one Python expression that computes the answer. Reply with the expression only."))[0]
    lines = [x.strip() for x in reply.replace("`", "").splitlines() if x.strip() and x.strip() != "python"]
    for expression in ([lines[0], lines[0].split("=")[0]] if lines else []):
        try:
            value = float(eval(expression, {"__builtins__": {}}, {}))
            return str(int(value)) if value.is_integer() else str(round(value, 6))
        except Exception:
            pass
    return reply
