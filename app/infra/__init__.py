"""What every role stands on, none of it RL: the cluster, storage, tracking, logging and watchdogs.

ray_compat.py   every private, experimental or unstable Ray API Relay uses, in one place
resources.py    what each role asks of the cluster, checked before anything starts
storage.py      where a run keeps its results (`run_dir`)
tracking.py     MLflow tracking that never holds training
metrics.py      Prometheus metrics through `ray.util.metrics`
log_filters.py  logging set-up and filters for known-harmless third-party warnings
run_lock.py     one run at a time per run folder; file locks for what concurrent runs share
watchdog.py     the trainer's watchdog: stall reports, no silent hang
"""
