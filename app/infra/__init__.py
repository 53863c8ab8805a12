"""What every role stands on, none of it RL: the cluster, storage, tracking, logging and watchdogs.

ray_compat.py   every private, experimental or unstable Ray API Relay uses, in one place
import_path.py  Relay's `app` first on every worker's import path: a user's `app` never shadows it
resources.py    what each role asks of the cluster, checked before anything starts
storage.py      where a run keeps its results (`run_dir`)
tracking.py     MLflow tracking that never holds training
tracking_store.py  the MLflow store and run at start: probed, created or reopened; the run folder's record
tracking_sinks.py  TensorBoard and W&B beside MLflow (`tracking.sinks`), fed by the same calls
metrics.py      Prometheus metrics through `ray.util.metrics`
log_filters.py  logging set-up and filters for known-harmless third-party warnings
train_log_callback.py  the filter installed in Ray Train's controller (its late clean-up timeout at DEBUG)
run_lock.py     one run at a time per run folder; file locks for what concurrent runs share
watchdog.py     the trainer's watchdog: stall reports, no silent hang
"""
