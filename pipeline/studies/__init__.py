"""Studies built on the stages: held-out evaluation (`evaluate.py`), the seeded learning experiment
(`experiment.py`), the objective ablation (`ablation.py`), the methods side by side (`methods.py`), inference-time
references (`baselines.py`, `smc.py`), their results as typed records (`summaries.py`) read as text one way
(`formatting.py`), and the HTML report (`report.py`)."""
