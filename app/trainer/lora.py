"""LoRA: low-rank adapters on a model's linear layers, saved in PEFT's format.

A small module of ours rather than `peft` (not a dependency; its `LoraLayer` keeps the base weight under a
renamed `base_layer.` path): `LoraLinear` *is* an `nn.Linear` whose `weight` and `bias` keep their names, so
the base's parameter names (checkpoints, pushes of full weights, `save_hf`) do not change, plus two adapter
matrices `lora_A` (r x in) and `lora_B` (out x r):

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T

`B` starts at zero (PEFT's init), so a freshly adapted model computes exactly what its base computes. The base is
frozen; only `lora_A`/`lora_B` train. `disabled(model)` zeroes the adapter path for a block (the KL reference is
the base model, with no second copy). Adapters are applied before FSDP2's `fully_shard` (app/trainer/model_build.py).

On disk an adapter is PEFT's layout, which vLLM's `LoRARequest(lora_path=...)` and `peft.PeftModel` load:
`adapter_config.json` and `adapter_model.safetensors` whose keys are
`base_model.model.<module path>.lora_A.weight` / `.lora_B.weight`.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt: `rank` (r), `alpha` (the update is scaled by alpha / r), `dropout` on the adapter's
    input, and `targets`, the linear layers' own names (`q_proj`, ...; PEFT's `target_modules`)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, lora_cfg: Any) -> LoraSpec | None:
        """The spec of `cfg.model.lora`, or None with `rank=0` (full fine-tuning)."""
        if int(lora_cfg.rank) <= 0:
            return None
        return cls(
            rank=int(lora_cfg.rank),
            alpha=float(lora_cfg.alpha),
            dropout=float(lora_cfg.dropout),
            targets=tuple(parse_targets(lora_cfg.targets)),
        )


def parse_targets(text: str) -> list[str]:
    """`q_proj,k_proj, v_proj` -> ['q_proj', 'k_proj', 'v_proj'] (order kept, blanks and repeats dropped)."""
    out: list[str] = []
    for t in str(text).split(","):
        t = t.strip()
        if t and t not in out:
            out.append(t)
    return out


class LoraLinear(nn.Linear):
    """A frozen `nn.Linear` plus a trainable low-rank update (see the module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kw = {"device": base.weight.device, "dtype": torch.float32}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kw)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)
        self.rank, self.scaling = rank, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapter_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return y
        h = self.dropout(x).to(self.lora_A.weight.dtype)
        return y + (self.lora_B(self.lora_A(h)) * self.scaling).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        """The update merged into `weight`: scaling * B @ A (out x in)."""
        return self.scaling * (self.lora_B.weight @ self.lora_A.weight)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (`q_proj`, `lm_head`, ...), sorted."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and n})


def check_targets(model: nn.Module, targets: tuple[str, ...] | list[str]) -> None:
    """Raise ValueError naming the model's linear layers when a target is not one of them."""
    have = linear_names(model)
    unknown = [t for t in targets if t not in have]
    if unknown or not targets:
        what = f"unknown target(s) {', '.join(unknown)}" if unknown else "no targets"
        raise ValueError(
            f"model.lora.targets: {what}; this model's linear layers are {', '.join(have)} "
            "(e.g. model.lora.targets=q_proj,k_proj,v_proj,o_proj)"
        )


def check_model_targets(model_path: str, targets: tuple[str, ...] | list[str]) -> None:
    """`check_targets` for the HF model at `model_path`, built without weights (on the meta device): refuses
    an unknown target before Ray starts, naming the model's linear layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    check_targets(model, targets)


def apply_lora(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Replace every linear layer named in `spec.targets` by a `LoraLinear` and freeze everything else.

    Returns the adapted modules' paths. Call before FSDP2's `fully_shard` (the adapters are then sharded with
    their layer). Raises ValueError (naming the model's linear layers) for an unknown target."""
    check_targets(model, spec.targets)
    for p in model.parameters():
        p.requires_grad_(False)
    adapted: list[str] = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in spec.targets and type(child) is nn.Linear:
                setattr(module, child_name, LoraLinear(child, spec.rank, spec.alpha, spec.dropout))
                adapted.append(f"{name}.{child_name}" if name else child_name)
    return adapted


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoraLinear]]:
    for name, m in model.named_modules():
        if isinstance(m, LoraLinear):
            yield name, m


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def trainable_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer steps: those that require a gradient (the adapters, with LoRA)."""
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[None]:
    """The base model for the block: every adapter path is skipped (the KL reference)."""
    mods = [m for _, m in lora_modules(model)]
    for m in mods:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.adapter_enabled = True


# ---------------------------------------------------------------- PEFT format


def peft_key(name: str) -> str:
    """Our parameter name -> PEFT's key: `model.layers.0.self_attn.q_proj.lora_A.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name


def our_key(key: str) -> str:
    return key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key


def peft_config(spec: LoraSpec, base_model: str = "") -> dict[str, Any]:
    """adapter_config.json for `spec` (the fields PEFT and vLLM's PEFTHelper read)."""
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_adapter(
    path: str | Path, tensors: Mapping[str, torch.Tensor], spec: LoraSpec, base_model: str = ""
) -> Path:
    """Write `tensors` (our names or PEFT keys; adapter tensors only) as a PEFT adapter folder."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    sd = {peft_key(n): t.detach().to("cpu").contiguous() for n, t in tensors.items() if is_adapter_param(n)}
    if not sd:
        raise ValueError(f"no adapter tensors (.lora_A./.lora_B.) to save in {out}")
    save_file(sd, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(peft_config(spec, base_model), indent=2) + "\n")
    return out


def load_adapter(path: str | Path) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """A PEFT adapter folder -> (its spec, tensors under our names)."""
    from safetensors.torch import load_file

    p = Path(path)
    cfg = json.loads((p / CONFIG_FILE).read_text())
    targets = cfg.get("target_modules") or []
    spec = LoraSpec(
        rank=int(cfg["r"]),
        alpha=float(cfg["lora_alpha"]),
        dropout=float(cfg.get("lora_dropout", 0.0)),
        targets=tuple([targets] if isinstance(targets, str) else targets),
    )
    return spec, {our_key(k): v for k, v in load_file(str(p / WEIGHTS_FILE)).items()}


def load_adapter_into(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy adapter tensors (our names) into an adapted model; every adapter parameter must be given."""
    params = {n: p for n, p in model.named_parameters() if is_adapter_param(n)}
    missing = sorted(set(params) - set(tensors))
    extra = sorted(set(tensors) - set(params))
    if missing or extra:
        raise ValueError(f"adapter does not fit the model: missing {missing[:4]}, unexpected {extra[:4]}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n].to(p.dtype))


def merged_state_dict(state: Mapping[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """A full state dict (base + adapter tensors, our names) -> the base's names with W + (alpha/r) B A merged
    in, adapter tensors dropped: a plain HF checkpoint that vLLM loads alone."""
    out = {n: t for n, t in state.items() if not is_adapter_param(n)}
    for n, a in state.items():
        if not n.endswith(".lora_A.weight"):
            continue
        module = n[: -len(".lora_A.weight")]
        b = state[f"{module}.lora_B.weight"]
        w = out[f"{module}.weight"]
        out[f"{module}.weight"] = (w.float() + spec.scaling * (b.float() @ a.float())).to(w.dtype)
    return out
