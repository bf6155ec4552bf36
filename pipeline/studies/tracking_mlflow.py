"""`tracking: [mlflow]`: the run's figures (pipeline.studies.tracking's scalars) in a local MLflow store, no server.

The store is `sqlite:///<store>/mlflow.db`: MLflow 3.17 refuses its `./mlruns` file store unless an environment
variable opts back in, and SQLite is its local default. Only the client (`mlflow-skinny`, the `mlflow` extra) is
installed here: the full `mlflow` package (with the UI) needs pyarrow<26 and would downgrade the pinned stack's
pyarrow, so view the file from any other environment: `mlflow ui --backend-store-uri sqlite:///<abs path>`.
Each sync deletes the run's previous MLflow run (found by its `pipeline.run_id` tag) and logs a new one, so a
resumed round never repeats points (as for TensorBoard).
"""

from __future__ import annotations

from pipeline.store import Store

EXPERIMENT = "workflow-grpo"
RUN_TAG = "pipeline.run_id"


class MlflowStoreError(RuntimeError):
    pass


def mlflow_uri(store: Store) -> str:
    if store.remote:
        raise MlflowStoreError(f"tracking: [mlflow] writes a local SQLite file; the store {store.root} is on object "
                               "storage: use tensorboard there, or a local store")
    return f"sqlite:///{store.root / 'mlflow.db'}"


def write_mlflow(store: Store, run_id: str, scalars: list) -> str:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    uri = mlflow_uri(store)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    exp_id = exp.experiment_id if exp else client.create_experiment(EXPERIMENT)
    for old in client.search_runs([exp_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'"):
        client.delete_run(old.info.run_id)
    run = client.create_run(exp_id, run_name=run_id, tags={RUN_TAG: run_id})
    metrics = [Metric(s.tag, float(s.value), 0, int(s.step)) for s in scalars]
    for i in range(0, len(metrics), 1000):  # MLflow's log_batch limit
        client.log_batch(run.info.run_id, metrics=metrics[i:i + 1000])
    client.set_terminated(run.info.run_id)
    return uri
