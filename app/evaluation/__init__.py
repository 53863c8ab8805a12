"""Evaluation: mean@n and pass@k per data source (`scores.py`), shared by validation during training and
`python -m app eval` (`command.py`), which evaluates a checkpoint (`checkpoints.py`) on a prompt file, with one
vLLM engine in its own process (`local.py`) or on the rollout deployment of a Ray cluster."""
