# The mixed task (the headroom menu, configs/mixed-learn.yaml): the executor answers directly, asked for the answer
# only; the workflow returns its reply's last line.
# design: answer directly: the helper gives the answer only, no reasoning
#   pipeline baseline configs/mixed-learn.yaml --method program:configs/programs/mixed_direct.py
# ruff: noqa: F821 (llm is the sandbox's helper)
async def solve(problem):
    reply = (await llm(problem + "\nReply with the answer only."))[0]
    lines = [x.strip() for x in reply.splitlines() if x.strip()]
    return lines[-1] if lines else reply
