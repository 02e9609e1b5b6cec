"""MLflow: one MLflow run per rankflow run (found by its `rankflow.run_id` tag), metrics at the global step."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus

from .backend import RunEnd, TrackingBackend, flat_params

RUN_ID_TAG = "rankflow.run_id"
CHECKPOINT_TAG = "rankflow.checkpoint_url"
_PARAM_BATCH = 100  # MLflow's limit of params in one log_batch
_PARAM_VALUE_CHARS = 6000  # and of one param's value


class MlflowBackend(TrackingBackend):
    def start(self, params: Callable[[], Mapping[str, object]]) -> None:
        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(self.experiment)
        experiment_id = (
            experiment.experiment_id if experiment is not None else self.client.create_experiment(self.experiment)
        )
        # The oldest record of the run id: should two ever be made (a sink given up on while its create was in
        # flight), every later sink still picks the same one.
        found = self.client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{RUN_ID_TAG}` = '{self.run_id}'",
            max_results=1,
            order_by=["attributes.start_time ASC"],
        )
        if found:
            self.mlflow_run_id = found[0].info.run_id
            if found[0].info.status != RunStatus.to_string(RunStatus.RUNNING):  # a resumed run: it runs again
                self.client.update_run(self.mlflow_run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            return
        # Params are immutable in MLflow: recorded once, when the record is made (a resumed run may change only
        # how it runs, e.g. nproc_per_node, which the record need not follow). Read before the record is made, so a
        # record never lacks them.
        items = [Param(key, value[:_PARAM_VALUE_CHARS]) for key, value in flat_params(params()).items()]
        run = self.client.create_run(experiment_id, run_name=self.run_id, tags={RUN_ID_TAG: self.run_id})
        self.mlflow_run_id = run.info.run_id
        for start in range(0, len(items), _PARAM_BATCH):
            self.client.log_batch(self.mlflow_run_id, params=items[start : start + _PARAM_BATCH])

    def logged_through(self) -> int | None:
        history = self.client.get_metric_history(self.mlflow_run_id, "loss")
        return max((metric.step for metric in history), default=None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in metrics.items()]
        self.client.log_batch(self.mlflow_run_id, metrics=batch)

    def tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.mlflow_run_id, key, value)

    def end(self, status: RunEnd) -> None:
        self.client.set_terminated(self.mlflow_run_id, status)

    def close(self) -> None:
        pass  # every call above is already stored; the record stays RUNNING for the next segment (or `end`)
