"""LoRA in the learner under FSDP2 (1 and 2 gloo ranks, CPU): only the adapters train, are pushed and checkpointed;
the KL reference is the base with the adapters off; the final export is a PEFT adapter plus the merged model."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import shutil
from pathlib import Path

import pytest
import torch

from app.config import load_config
from tests.test_packed_step import _batch, _model_dir

KEYS = [
    "train.lr=0.05",
    "model.lora.rank=4",
    "model.lora.alpha=8",
    "model.lora.targets=q_proj,v_proj,down_proj",
    "model.lora.merge=true",
    "algorithm.kl_coef=0.1",
    "train.micro_batch_tokens=20",
    "train.logprob_chunk_tokens=3",
]


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from app.trainer.model_build import param_name

    return {
        param_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _rank(rank: int, world: int, port: int, path: str, out: str, q) -> None:
    import torch.distributed as dist

    from app.trainer import checkpoint, lora
    from app.trainer.learner import Learner
    from app.trainer.model_build import param_name

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        learner = Learner(load_config(None, KEYS), path, torch.device("cpu"))
        before = _full(learner.model)
        opt_ids = {id(p) for g in learner.opt.param_groups for p in g["params"]}
        trained = {param_name(n) for n, p in learner.model.named_parameters() if id(p) in opt_ids}
        m1 = learner.step(_batch())
        m2 = learner.step(_batch())
        after = _full(learner.model)
        specs = learner.push_specs()
        gathered = learner.gather([n for n, _, _ in specs])
        lp = learner.logprobs_of([3, 4, 5], [6, 7, 8])
        # each rank writes its part into its own folder, merged into one afterwards (as Ray Train does)
        checkpoint.save(
            learner, Path(out, f"ckpt-r{rank}"), rank, {"step": 2}, {"epoch": 0} if rank == 0 else None
        )
        dist.barrier()
        if rank == 0:
            for r in range(world):
                shutil.copytree(Path(out, f"ckpt-r{r}"), Path(out, "ckpt"), dirs_exist_ok=True)
        dist.barrier()
        learner.save_hf(str(Path(out, "final")), path)
        torch.manual_seed(1)
        fresh = Learner(load_config(None, KEYS), path, torch.device("cpu"))
        checkpoint.load(fresh, Path(out, "ckpt"), rank)
        restored = _full(fresh.model)
        same_opt = (
            all(
                torch.equal(sa["exp_avg"].full_tensor(), sb["exp_avg"].full_tensor())
                for sa, sb in zip(learner.opt.state.values(), fresh.opt.state.values(), strict=True)
            )
            and len(fresh.opt.state) == len(learner.opt.state) > 0
        )
        if rank == 0:
            q.put(
                {
                    "trained": sorted(trained),
                    "adapters": sorted(n for n in before if lora.is_adapter_param(n)),
                    "base_same": all(
                        torch.equal(before[n], after[n]) for n in before if not lora.is_adapter_param(n)
                    ),
                    "b_moved": all(not torch.equal(before[n], after[n]) for n in before if ".lora_B." in n),
                    "dtypes": {n: str(after[n].dtype) for n in after},
                    "kl": (m1["loss/kl"], m2["loss/kl"]),
                    "specs": specs,
                    "gathered_ok": all(
                        torch.equal(t, after[n]) for (n, _, _), t in zip(specs, gathered, strict=True)
                    ),
                    "lp": lp,
                    "restored_ok": all(torch.equal(restored[n], after[n]) for n in after),
                    "same_opt": same_opt,
                }
            )
    except BaseException as e:
        q.put(repr(e))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])  # one rank gathers the adapters without all-gathers
def test_lora_learner_under_fsdp2(tmp_path, world):
    from app.trainer import lora
    from app.weights.group import free_port

    path = _model_dir(tmp_path, tied=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, path, str(tmp_path), q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = q.get(timeout=300)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert not isinstance(got, str), got
    # the optimizer holds the adapters alone; the base never moves, the B matrices do
    assert (
        got["trained"] == got["adapters"] and len(got["adapters"]) == 2 * 2 * 3
    )  # 2 layers x 3 targets x A, B
    assert got["base_same"] and got["b_moved"]
    # B starts at zero: the first step's policy is the base, so its KL to the base is exactly 0; then not
    assert got["kl"][0] == 0.0 and got["kl"][1] > 0
    # pushed: the adapter tensors alone, in the model dtype, gathered whole
    assert sorted(n for n, _, _ in got["specs"]) == got["adapters"]
    assert {d for _, _, d in got["specs"]} == {"float32"} and got["gathered_ok"]
    # a checkpoint restores adapters and optimizer state into a fresh learner (other random adapters)
    assert got["restored_ok"] and got["same_opt"]
    # the export: a PEFT adapter, and the merged model computing what the trainer computes
    final = tmp_path / "final"
    spec, tensors = lora.load_adapter(final)
    assert spec == lora.LoraSpec(rank=4, alpha=8.0, targets=("down_proj", "q_proj", "v_proj"))
    assert sorted(tensors) == got["adapters"]
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(final / "merged", dtype=torch.float32).eval()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        logp = torch.log_softmax(merged(ids).logits[0, :-1], -1)
    want = [logp[i - 1, ids[0, i]].item() for i in (3, 4, 5)]
    assert got["lp"] == pytest.approx(want, abs=1e-4)
