# The mixed task (the headroom menu): chain of thought, one greedy answer ending in "Answer: <answer>"; the workflow
# returns what follows the last "Answer:" (a number or a word).
# design: step by step: one reasoned answer at temperature 0, the text after its last "Answer:"
#   pipeline baseline configs/mixed-learn.yaml --method program:configs/programs/mixed_steps.py
# ruff: noqa: F821 (llm is the sandbox's helper)
async def solve(problem):
    reply = (await llm(problem + "\nSolve it step by step. End with a line 'Answer: <answer>'."))[0]
    return reply.split("Answer:")[-1].strip().strip(".").strip("*").strip()
