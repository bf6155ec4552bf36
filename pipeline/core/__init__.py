"""The maths, pure: functions on numbers, arrays and tensors with no I/O (no store, no model, no sandbox), each
checked against hand-computed values. GRPO advantages and the clipped/KL terms (`grpo.py`), the objective
registry (`objectives.py`), curation (`curation.py`: buckets, C(m,n) groups, screening, sharpening, two-level
advantages), rewards (`reward.py`), learning metrics and intervals (`learning.py`), two-level selection
(`selection.py`)."""
