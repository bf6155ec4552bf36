# The mixed task (the headroom menu): self-consistency, five step-by-step answers at temperature 0.7 in one call; the
# most frequent final answer (the text after "Answer:", case and a trailing period ignored) wins.
# design: sample and vote: five step-by-step answers at temperature 0.7, the most frequent final answer
#   pipeline baseline configs/mixed-learn.yaml --method program:configs/programs/mixed_vote.py
# ruff: noqa: F821 (llm is the sandbox's helper)
async def solve(problem):
    replies = await llm(problem + "\nSolve it step by step. End with a line 'Answer: <answer>'.", temperature=0.7, n=5)
    votes = [r.split("Answer:")[-1].strip().strip(".").strip("*").strip().lower() for r in replies if "Answer:" in r]
    return max(votes, key=votes.count) if votes else replies[0]
