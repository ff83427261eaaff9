"""logger=mlflow: one MLflow run per accutrain run, in a local sqlite store beside the run directory
(`<run dir's parent>/mlflow.db`, artifacts in `mlartifacts/` next to it) unless `tracking_uri` names another; a
sweep's jobs are runs of one experiment named after the sweep. Metrics are sent in batches (every `flush_secs`, at
each checkpoint and at the end); a resumed run continues the same MLflow run and skips the steps it already has."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from accutrain.trackers.base import RunEnd, RunInfo, Tracker, needs, reach, scalars

log = logging.getLogger("accutrain")

STATUS = {"completed": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}
LAST_STEP_TAG = "accutrain.last_step"  # every step up to this one is in the store
MAX_METRICS, MAX_PARAMS = 1000, 100  # per log_batch call (MLflow's limits)
# A server's calls: MLflow's own defaults (7 retries with backoff, 120 s each) would hold training for minutes when
# the server goes away; these bound it, unless the environment sets them.
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


class MLflow(Tracker):
    def __init__(self, tracking_uri: Optional[str] = None, experiment: Optional[str] = None,
                 run_name: Optional[str] = None, tags: Optional[dict[str, str]] = None, flush_secs: float = 10.0
                 ) -> None:
        try:
            from mlflow import MlflowClient
        except ImportError:
            raise needs("mlflow", "mlflow") from None
        self.client_class, self.tracking_uri, self.experiment = MlflowClient, tracking_uri, experiment
        self.run_name, self.tags, self.flush_secs = run_name, dict(tags or {}), flush_secs
        self.client: Any = None
        self.run_id = ""
        self.stored = 0  # the store has every record up to this step: later records only are sent
        self.pending: list[Any] = []
        self.last_step, self.sent_at = 0, time.monotonic()

    def start(self, run: RunInfo) -> dict[str, Any]:
        # MLflow logs each failing SQL call with a long traceback; the tracker's one warning line says it instead.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
        uri = self.tracking_uri or f"sqlite:///{(run.run_dir.parent / 'mlflow.db').resolve()}"
        db = Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None
        reach(uri, "logger.mlflow.tracking_uri")  # a server that does not answer: switched off now, in seconds
        for name, value in HTTP_LIMITS.items():
            os.environ.setdefault(name, value)
        with creating(db):  # the client creates a new store's tables: parallel jobs must not both do it
            self.client = client = self.client_class(tracking_uri=uri)
            experiment_id = self._experiment(run, db)
        saved = run.saved if run.saved.get("tracking_uri") == uri else {}
        earlier = self._earlier_run(saved.get("run_id"))
        if earlier is not None:  # continue it
            self.run_id, experiment_id = earlier.info.run_id, earlier.info.experiment_id
            client.update_run(self.run_id, status="RUNNING")
            self.stored = int(earlier.data.tags.get(LAST_STEP_TAG, 0))
            self._params(run.params, earlier.data.params)
        else:
            tags = {"accutrain.run_dir": str(run.run_dir.resolve()), LAST_STEP_TAG: "0", **self.tags}
            if run.group is not None:
                tags.update({"accutrain.sweep": run.group, "accutrain.job": str(run.job)})
            self.run_id = client.create_run(experiment_id, run_name=self.run_name or run.name, tags=tags).info.run_id
            self.stored = 0
            self._params(run.params, {})
        for record in run.history() if run.resumed else ():
            self._add(record)  # the steps up to the checkpoint that the store lacks (none, unless it lost some)
        self.last_step, self.sent_at = run.step, time.monotonic()
        log.info(f"mlflow: run {self.run_id} in experiment {self.experiment_name(run)!r} at {uri}"
                 + (f" (view: mlflow ui --backend-store-uri {uri})" if db else ""))
        return {"tracking_uri": uri, "experiment_id": experiment_id, "run_id": self.run_id}

    def experiment_name(self, run: RunInfo) -> str:
        return self.experiment or run.group or "accutrain"

    def _experiment(self, run: RunInfo, db: Optional[Path]) -> str:
        """The experiment's id, created when new (by another job of the sweep, maybe, at the same moment)."""
        name, client = self.experiment_name(run), self.client
        found = client.get_experiment_by_name(name)
        if found is not None:
            if found.lifecycle_stage == "deleted":
                client.restore_experiment(found.experiment_id)
            return found.experiment_id
        artifacts = (db.parent / "mlartifacts").resolve().as_uri() if db else None
        try:
            return client.create_experiment(name, artifact_location=artifacts)
        except Exception:
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _earlier_run(self, run_id: Optional[str]) -> Any:
        """The MLflow run of this run directory's earlier session, if it is still there."""
        if not run_id:
            return None
        try:
            earlier = self.client.get_run(run_id)
        except Exception:
            earlier = None
        if earlier is None or earlier.info.lifecycle_stage != "active":
            log.info(f"mlflow: run {run_id} of the earlier session is gone: a new run starts")
            return None
        return earlier

    def _params(self, params: dict[str, Any], old: dict[str, str]) -> None:
        """The config as parameters. MLflow's parameters never change: a resumed run adds the new ones only (`old`:
        those it has) and says which kept their first value."""
        from mlflow.entities import Param

        values = {k: str(v) for k, v in params.items()}
        changed = sorted(k for k in values if k in old and old[k] != values[k])
        if changed:
            log.info("mlflow: parameters keep the values of the run's first session: "
                     + ", ".join(f"{k} ({old[k]}, now {values[k]})" for k in changed[:10]))
        values = {k: v for k, v in values.items() if k not in old}
        items = [Param(k, v) for k, v in values.items()]
        for i in range(0, len(items), MAX_PARAMS):
            self.client.log_batch(self.run_id, params=items[i:i + MAX_PARAMS])

    def log_step(self, record: dict[str, Any]) -> None:
        if time.monotonic() - self.sent_at >= self.flush_secs:
            self.flush()  # before this step's record: a batch always ends with a whole step and its evaluation
        self._add(record)

    def log_eval(self, record: dict[str, Any]) -> None:
        self._add(record)

    def _add(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step = record["step"]
        self.last_step = max(self.last_step, step)
        if step <= self.stored and record.get("kind") != "test":  # (the test stage comes after the last checkpoint)
            return  # the store has it from an earlier session (a resume replays the steps after its checkpoint)
        now = int(time.time() * 1000)
        self.pending += [Metric(key, value, now, step) for key, value in scalars(record).items()]

    def flush(self) -> None:
        from mlflow.entities import RunTag

        self.sent_at = time.monotonic()
        if not self.pending:
            return
        last = max(m.step for m in self.pending)
        for i in range(0, len(self.pending), MAX_METRICS):
            chunk = self.pending[i:i + MAX_METRICS]
            tags = [RunTag(LAST_STEP_TAG, str(last))] if i + MAX_METRICS >= len(self.pending) else []
            self.client.log_batch(self.run_id, metrics=chunk, tags=tags)
        self.pending, self.stored = [], max(self.stored, last)

    def finish(self, end: RunEnd) -> None:
        from mlflow.entities import Metric

        self.flush()
        now = int(time.time() * 1000)
        summary = [Metric(f"summary/{k}", v, now, self.last_step) for k, v in end.summary.items()]
        self.client.log_batch(self.run_id, metrics=summary)
        if end.loss_plot is not None:
            self.client.log_artifact(self.run_id, str(end.loss_plot))
        self.client.set_terminated(self.run_id, STATUS.get(end.status, "FINISHED"))


@contextlib.contextmanager
def creating(db: Optional[Path]) -> Iterator[None]:
    """Hold an exclusive lock beside a sqlite store while it may be created (jobs of a sweep start at once under the
    joblib or submitit launchers); nothing for other stores, or where file locks do not exist."""
    try:
        import fcntl
    except ImportError:
        fcntl = None  # type: ignore[assignment]
    if db is None or fcntl is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.parent / f".{db.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
