"""The rollout side: the rollouter actor and the pipeline's parts, each part testable without Ray.

rollouter.py       `Rollouter`, the Ray actor (a facade) that composes the parts below
prompt_files.py    prompt files (`.jsonl`, `.parquet`) into typed, validated rows; `DataError`
dataset.py         the prompt files as Ray Data datasets: streamed, validated, tokenized
prompt_stream.py   `PromptStream`: epoch position, outstanding prompts, retries, snapshot
generator.py       `GroupGenerator`: a group's GenerateRequest (or one per sample) through a `GenerateFn`
episode.py         multi-turn episodes: trajectories with loss masks
producer.py        `AsyncProducer`, the fully_async producer: admission, bounded queue
admission.py       pure functions of the fully async stream: admission, staleness bound, partial merge
partial.py         `rollout.partial` as one policy object per value (`partial_policy`), asked by every role
filtering.py       dynamic sampling: a group whose samples all got the same reward is dropped
serve_generate.py  the `GenerateFn` over the Serve deployment (app/serve_rollout.py)
reference.py       reference log-probs off the trainer (`RefPool`)
start_watch.py     `RolloutStartWatch`: the rollout application's start watched while the run goes on
"""

from app.rollout.generator import Frozen, GenerateFn, GroupGenerator
from app.rollout.producer import AsyncProducer
from app.rollout.prompt_stream import PromptStream

__all__ = [
    "AsyncProducer",
    "Frozen",
    "GenerateFn",
    "GroupGenerator",
    "PromptStream",
]
