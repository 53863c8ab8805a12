"""The partial-rollout policy (`rollout.partial`): what a weight push does to the generations in flight.

One class per value, each answering the questions its users ask, so that no call site compares the string.
A role picks its policy once where it is built (`partial_policy(cfg.rollout.partial)`) and asks it:

    pause_mode           vLLM's pause mode for a push (app/vllm/engine.py `pause`); None: never pauses
    stops_at_once        the pause stops every engine step at once, so the load may go out right behind it
                         (app/vllm/engine.py `paused_call`)
    freezes              requests in flight freeze and continue under the new weights: their KV cache is
                         recomputed (`rollout.recompute_kv`) and their later tokens carry the new version
    spans_versions       one request's tokens may come from two versions: the engine must label each token
                         (`update_weight_version`, app/vllm/engine.py `check_capabilities`)
    adapter_per_version  a push adds a LoRA adapter beside the older ones (the engine needs `add_lora`)
    drains               a push first lets every request inside the replica finish under the old weights and
                         holds new ones (`GenerationGate`, app/weights/loaders.py); a replica then holds only
                         what vLLM runs at once (app/infra/resources.py `ongoing_requests`)
    resubmits            a sample a push aborted goes back as prompt + partial response until it finishes
                         (app/rollout/generator.py)
    one_version_groups   every sample of a group comes from one version: the generator generates the samples
                         older than the group's newest again (app/rollout/generator.py `_one_version`)

The choices themselves, and the config's rules between them and other keys, are the config package's
(`app.config.base.Partial`; it is the ground floor and imports no role). This module imports nothing of app/,
so the engine adapter, the weight loaders and app/infra/resources.py can all ask it.
"""

from __future__ import annotations

from typing import ClassVar


class PartialPolicy:
    """What `rollout.partial` makes of a push that lands while generations are in flight (see the module
    docstring for who asks what). Instances hold no state: `partial_policy(name)` hands out one per value."""

    name: ClassVar[str]
    pause_mode: ClassVar[str | None] = None
    stops_at_once: ClassVar[bool] = False
    freezes: ClassVar[bool] = False
    spans_versions: ClassVar[bool] = False
    adapter_per_version: ClassVar[bool] = False
    drains: ClassVar[bool] = False
    resubmits: ClassVar[bool] = False
    one_version_groups: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"partial_policy({self.name!r})"

    def __str__(self) -> str:
        return self.name

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return partial_policy, (self.name,)  # unpickled as the registry's own instance


class Keep(PartialPolicy):
    """`keep`: requests in flight freeze at the pause and continue under the new weights after it (their KV
    cache recomputed unless `rollout.recompute_kv=false`); each token keeps the version that sampled it."""

    name = "keep"
    pause_mode = "keep"
    stops_at_once = True
    freezes = True
    spans_versions = True


class Resubmit(PartialPolicy):
    """`resubmit`: the pause aborts the requests in flight; each returns its tokens so far and the generator
    sends it again as prompt + partial response, every earlier token keeping its version and log-prob."""

    name = "resubmit"
    pause_mode = "abort"
    stops_at_once = True
    resubmits = True


class Off(PartialPolicy):
    """`off`: a push drains the replica first (requests inside finish under the old weights, new ones wait),
    and a group whose samples still span versions has its older ones generated again."""

    name = "off"
    pause_mode = "wait"
    drains = True
    one_version_groups = True


class FinishOnOld(PartialPolicy):
    """`finish_on_old` (LoRA): no pause at all; the pushed adapter is added beside the older ones, requests in
    flight finish on the adapter they were admitted under and new ones take the new one."""

    name = "finish_on_old"
    adapter_per_version = True


PARTIAL_POLICIES: dict[str, PartialPolicy] = {p.name: p for p in (Off(), Keep(), Resubmit(), FinishOnOld())}


def partial_policy(name: str) -> PartialPolicy:
    """The policy of `rollout.partial=name`; a ValueError names the valid values for any other."""
    try:
        return PARTIAL_POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"rollout.partial={name!r}: use one of {', '.join(PARTIAL_POLICIES)}") from None
