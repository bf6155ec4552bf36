"""Studies built on the stages: held-out evaluation (`evaluate.py`), the seeded learning experiment
(`experiment.py`), the objective ablation (`ablation.py`), inference-time references (`baselines.py`, `smc.py`)
and the HTML report (`report.py`)."""
