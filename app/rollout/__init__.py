"""The rollout pipeline's parts, each testable without Ray: the prompt stream, the group generator and the
fully_async producer. `app.rollouter.Rollouter` (the Ray actor) composes them."""

from app.rollout.generator import Frozen, GenerateFn, GenSettings, GroupGenerator
from app.rollout.producer import AsyncProducer, ProducerSettings
from app.rollout.prompt_stream import PromptStream

__all__ = [
    "AsyncProducer",
    "Frozen",
    "GenSettings",
    "GenerateFn",
    "GroupGenerator",
    "ProducerSettings",
    "PromptStream",
]
