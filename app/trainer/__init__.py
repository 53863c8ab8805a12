"""The trainer's parts, one small module each; the loop itself is app/train_loop.py.

    learner.py       `Learner`: this rank's FSDP2 shard of the policy, its optimizer and one step
    model_build.py   the policy built and sharded with FSDP2 (`fully_shard`), LoRA frozen in
    batch_tensors.py a batch's groups as rows and micro-batches (`Row`, `collate`, `split_rows`)
    logprobs.py      the scored forward: response log-probs and entropies of a micro-batch
    update_metrics.py one update's sums over micro-batches and ranks, and its metrics
    batch_metrics.py the batch's own metrics (rewards, lengths, staleness), torch-free
    hf_export.py     the final model (or LoRA adapter) as an HF folder
    push_gather.py   full tensors of many FSDP2 parameters in one all-gather (the push's gather)
    grpo.py          pure GRPO math: advantages, clipped loss, KL estimators, corrections
    losses.py        the policy-loss registry `LOSSES` (`algorithm.correction`)
    packing.py       packed micro-batches (sequences side by side, varlen attention)
    compiled.py      torch.compile of the norms and MLPs of each decoder layer
    warm_up.py       the compiled kernels built while the first batch generates (`train.warm_up`)
    sources/         where batches come from, one `BatchSource` per `algorithm.mode` (registry `SOURCES`)
    state.py         `RunState` (the counters a checkpoint keeps) and `restore_or_start`
    step_metrics.py  the per-step metrics, a pure function
    accounting.py    `trained_groups.jsonl`: every trained group, once
    validation.py    validation on the replicas, logged to the tracker
    monitor.py       phase reporting to the watchdog and the run control's heartbeat; `stall_report`
    saving.py        one checkpoint through Ray Train
    checkpoint.py    whole-pipeline checkpoints: DCP shards, RNGs, the stream's state, the manifest
    resume_check.py  what `--resume` checks before Ray starts: the new run against the saved one
    comm.py          rank-0-to-all broadcast and waits on the other roles with a deadline
    parts.py         `Trainer`: the pieces the loop runs with

Rank 0 talks to the rollouter, the run control and MLflow; every rank trains its share and takes part in
the gathers of each push and in each checkpoint.
"""
