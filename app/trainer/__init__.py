"""The trainer's loop and its parts, one small module each.

    loop.py          the loop: get a batch, train, push, log, checkpoint; `finish` at the end
    sources/         where batches come from, one `BatchSource` per `algorithm.mode` (registry `SOURCES`)
    state.py         `RunState` (the counters a checkpoint keeps) and `restore_or_start`
    step_metrics.py  the per-step metrics, a pure function
    accounting.py    `trained_groups.jsonl`: every trained group, once
    validation.py    validation on the replicas, logged to the tracker
    monitor.py       phase reporting to the watchdog and the run control's heartbeat; `stall_report`
    saving.py        one checkpoint through Ray Train
    comm.py          rank-0-to-all broadcast and waits on the other roles with a deadline

Rank 0 talks to the rollouter, the run control and MLflow; every rank trains its share and takes part in
the gathers of each push and in each checkpoint.
"""
