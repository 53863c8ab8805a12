"""Process-level helpers of the GPU tier: spawned ranks, a trainer that pushes weights, receivers.

Every function that runs in a child process is defined here at module level (spawn pickles it by name).
Children report through a JSON file (`guarded`) or a multiprocessing queue (the control channel of the
weight push); the parent asserts. Nothing here imports Ray or vLLM.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CTX = mp.get_context("spawn")
HOST = "127.0.0.1"
# RELAY_GPU_DRY_RUN_CPU=1 runs this harness on CPU over gloo: a quick check of the harness itself, off-GPU
DRY_RUN_CPU = os.environ.get("RELAY_GPU_DRY_RUN_CPU") == "1"
BACKEND = "gloo" if DRY_RUN_CPU else "nccl"


def use_device(index: int) -> torch.device:
    if DRY_RUN_CPU:
        return torch.device("cpu")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---------------------------------------------------------------- process plumbing


def guarded(fn: Any, out_path: str, *args: Any) -> None:
    """Run `fn(*args)` in a child; write {"ok", "result"|"error"} to `out_path` (the parent reads it)."""
    try:
        res = fn(*args)
        Path(out_path).write_text(json.dumps({"ok": True, "result": res}))
    except BaseException:
        Path(out_path).write_text(json.dumps({"ok": False, "error": traceback.format_exc()}))
        raise SystemExit(1) from None


def run_children(targets: list[tuple[Any, tuple]], out_dir: Path, timeout_s: float) -> list[dict]:
    """Start one guarded child per (fn, args), join all under one deadline, kill leftovers.

    Returns each child's report, with its `exitcode` added. A child that did not finish in time is killed and
    reported as {"ok": False, "error": "timed out ..."}.
    """
    procs, paths = [], []
    for i, (fn, args) in enumerate(targets):
        path = out_dir / f"child{i}.json"
        path.unlink(missing_ok=True)
        p = CTX.Process(target=guarded, args=(fn, str(path), *args))
        p.start()
        procs.append(p)
        paths.append(path)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    reports = []
    for p, path in zip(procs, paths, strict=True):
        if p.is_alive():
            p.kill()
            p.join(10)
            rep = {"ok": False, "error": f"timed out after {timeout_s:.0f}s"}
            if path.exists():  # it finished its work but did not exit
                rep["report_before_hang"] = json.loads(path.read_text())
        elif path.exists():
            rep = json.loads(path.read_text())
        else:
            rep = {"ok": False, "error": "no report (killed?)"}
        rep["exitcode"] = p.exitcode
        reports.append(rep)
    return reports


def free_port() -> int:
    from app.weights.group import free_port as fp

    return fp()


# ---------------------------------------------------------------- a local Qwen2 model


def build_model_dir(path: Path, hidden: int = 256, layers: int = 4, inter: int = 768, seed: int = 0) -> str:
    """A randomly initialised Qwen2 model plus the embedded character tokenizer, saved to `path`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from app.tasks import tiny

    tok = tiny.build_tokenizer()
    base = tiny.model_config(len(tok))  # the embedded model's config, made wider and deeper
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,  # head_dim 64
        num_key_value_heads=2,
        max_position_embeddings=base.max_position_embeddings,
        tie_word_embeddings=False,
        rms_norm_eps=base.rms_norm_eps,
        bos_token_id=None,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


def fixed_batch(
    vocab: int, groups: int = 4, n: int = 4, prompt_len: int = 6, resp_len: int = 6, seed: int = 0
):
    """A deterministic Batch: random prompt/response ids and fixed rewards (half 1, half 0 per group)."""
    from app.records import Batch, Group, Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(groups):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        samples = []
        for si in range(n):
            resp = torch.randint(3, vocab, (resp_len,), generator=g).tolist()
            samples.append(
                Sample(
                    token_ids=resp,
                    logprobs=[0.0] * resp_len,
                    versions=[0] * resp_len,
                    finish_reason="stop",
                    reward=float(si % 2 == 0),
                )
            )
        out.append(Group(uid=f"g{gi}", prompt_ids=prompt, answer="", samples=samples))
    return Batch(groups=out)


def with_behaviour_logprobs(learner: Any, batch: Any) -> Any:
    """Set every sample's behaviour log-probs to the learner's own (a collective: every rank calls it)."""
    for grp in batch.groups:
        for s in grp.samples:
            s.logprobs = learner.logprobs_of(grp.prompt_ids, s.token_ids)
    return batch


def gpu_config(*extra: str) -> Any:
    from app.config import load_config

    return load_config(
        None,
        [
            "model.dtype=bfloat16",
            "train.use_gpu=true",
            "train.lr=1e-4",
            "train.micro_batch_size=4",
            "train.workers=2",
            *extra,
        ],
    )


# ---------------------------------------------------------------- FSDP2 training over NCCL (one rank)


def train_rank(rank: int, world: int, port: int, model_dir: str, ckpt_dir: str, steps: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from app.trainer.learner import Learner
    from app.trainer.model_build import param_name

    device = use_device(rank)
    dist.init_process_group(
        BACKEND,
        init_method=f"tcp://{HOST}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
        device_id=None if DRY_RUN_CPU else device,
    )
    try:
        cfg = gpu_config()
        torch.manual_seed(0)
        learner = Learner(cfg, model_dir, device)
        mp_policy = learner.model._get_fsdp_state()._mp_policy
        seen: dict[str, str] = {}
        layer0 = learner.model.model.layers[0]

        def hook(mod: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            # on the MLP, not its gate_proj: on a GPU the compiled layers (app/trainer/compiled.py) call the MLP's
            # weights directly, so a hook on the Linear submodule never fires
            seen["weight"] = str(mod.gate_proj.weight.dtype)
            seen["input"] = str(args[0].dtype)

        handle = layer0.mlp.register_forward_hook(hook)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        batch = with_behaviour_logprobs(learner, fixed_batch(vocab))
        metrics = [learner.step(batch) for _ in range(steps)]
        handle.remove()
        pg = layer0._get_fsdp_state()._fsdp_param_group
        reduce_dtype = str(getattr(pg, "_reduce_dtype", None))

        learner.save_hf(ckpt_dir, model_dir)  # collective; rank 0 writes
        dist.barrier()
        full = get_model_state_dict(
            learner.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        res: dict[str, Any] = {
            "losses": [m["loss/policy"] for m in metrics],
            "grad_norms": [m["actor/grad_norm"] for m in metrics],
            "skipped": sum(m["train/skipped_steps"] for m in metrics),
            "mp_param_dtype": str(mp_policy.param_dtype),
            "mp_reduce_dtype": str(mp_policy.reduce_dtype),
            "group_reduce_dtype": reduce_dtype,
            "compute_weight_dtype": seen.get("weight"),
            "compute_input_dtype": seen.get("input"),
            "sharded_param_dtype": str(next(learner.model.parameters()).dtype),
        }
        if rank == 0:
            from safetensors import safe_open
            from transformers import AutoModelForCausalLM, AutoTokenizer

            # the export is in model.dtype (bf16 here): compare with the float32 master weights cast to it
            dt = getattr(torch, learner.cfg.model.dtype)
            with safe_open(str(Path(ckpt_dir) / "model.safetensors"), "pt") as f:
                res["ckpt_dtype"] = str(f.get_tensor(next(iter(f.keys()))).dtype)
            loaded = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).state_dict()
            ours = {param_name(k): v.to(dt).float() for k, v in full.items()}
            res["ckpt_tensors"] = len(ours)
            res["ckpt_missing"] = sorted(set(ours) - set(loaded))
            res["ckpt_unequal"] = sorted(
                k for k, v in ours.items() if k in loaded and not torch.equal(loaded[k], v)
            )
            init = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
            res["changed_vs_init"] = sum(1 for k, v in ours.items() if not torch.equal(init[k], v))
            res["tokenizer_vocab"] = len(AutoTokenizer.from_pretrained(ckpt_dir))
        return res
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the weight push: receiver side


def receiver_main(
    rid: str,
    device_index: int,
    port: int,
    epoch: int,
    timeout_s: float,
    behaviour: str,
    model_dir: str | None,
    inbox: Any,
    acks: Any,
) -> None:
    """One receiver (a stand-in for a vLLM worker): join the group, then receive every announced plan.

    behaviour: "ok"; "die" (SIGKILL itself after loading two buckets of a push); "stuck" (joins the group and
    acknowledges the join, then never takes part in a broadcast).
    Messages on `acks` (the control channel): {"kind": "ready"|"join"|"push", "key", "rid", "ok", ...}.
    """
    from app.weights.broadcast import receive_buckets
    from app.weights.buckets import checksum
    from app.weights.group import StatelessGroup

    dev = use_device(device_index)
    torch.zeros(1, device=dev)  # CUDA context up before the join
    params: dict[str, torch.Tensor] = {}
    if model_dir:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev)
        params = {n: p.detach() for n, p in model.named_parameters()}
    acks.put({"kind": "ready", "key": epoch, "rid": rid, "ok": True})
    try:
        group = StatelessGroup(HOST, port, 1, 2, BACKEND, timeout_s, epoch, dev)
    except Exception as e:
        acks.put({"kind": "join", "key": epoch, "rid": rid, "ok": False, "error": str(e)})
        return
    acks.put({"kind": "join", "key": epoch, "rid": rid, "ok": True})
    while True:
        plan = inbox.get()
        if plan is None:
            break
        if behaviour == "stuck":
            time.sleep(3600)
        loaded = [0]

        def load(items: list[tuple[str, torch.Tensor]], loaded: list[int] = loaded) -> None:
            with torch.no_grad():
                for name, t in items:
                    if name in params:
                        params[name].copy_(t)
                    else:
                        params[name] = t.clone()
            loaded[0] += 1
            if behaviour == "die" and loaded[0] == 2:
                sync(dev)
                os.kill(os.getpid(), signal.SIGKILL)

        try:
            cks, timing = receive_buckets(plan, group, load, dev)
            sync(dev)
            per_param = {n: checksum(params[n].reshape(-1)) for n in plan.names}
            acks.put(
                {
                    "kind": "push",
                    "key": plan.version,
                    "rid": rid,
                    "ok": True,
                    "version": plan.version,
                    "checksums": cks,
                    "params": per_param,
                    **timing,
                }
            )
        except Exception as e:
            err = f"{e!r}\n{traceback.format_exc()}"
            acks.put({"kind": "push", "key": plan.version, "rid": rid, "ok": False, "error": err})
    group.close()


# ---------------------------------------------------------------- the weight push: trainer side


def wait_msgs(acks: Any, kind: str, key: int, rids: list[str], deadline: float) -> dict[str, Any]:
    """Collect (kind, key) messages from `rids` until all arrived or the deadline."""
    got: dict[str, Any] = {}
    while set(got) != set(rids):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            msg = acks.get(timeout=min(left, 0.5))
        except queue.Empty:
            continue
        if msg["kind"] == kind and msg["key"] == key and msg["rid"] in rids:
            got[msg["rid"]] = msg
    return got


def expect(msgs: dict[str, Any], rid: str, what: str, checksums: list[str] | None = None) -> dict[str, Any]:
    """The receiver's answer, or SyncError naming it (this transport-level harness has no hub: the real
    push's acknowledgements are tested on the real hub in test_disagg_gpu.py)."""
    from app.weights.records import SyncError

    msg = msgs.get(rid)
    if msg is None:
        raise SyncError(f"replica {rid} did not acknowledge {what} (dead or stuck)")
    if not msg["ok"]:
        raise SyncError(f"replica {rid} failed {what}: {msg.get('error')}")
    if checksums is not None and msg["checksums"] != checksums:
        raise SyncError(f"replica {rid} loaded different bytes for {what} (checksum mismatch)")
    return msg


class Epoch:
    """One epoch of the weight group: a fresh receiver process on GPU1 plus rank 0's StatelessGroup."""

    def __init__(
        self, epoch: int, behaviour: str, timeout_s: float, dev: torch.device, model_dir: str | None = None
    ) -> None:
        from app.weights.group import StatelessGroup

        self.epoch, self.timeout_s, self.dev = epoch, timeout_s, dev
        self.rid = f"replica-e{epoch}-{behaviour}"
        self.port = free_port()
        self.inbox, self.acks = CTX.Queue(), CTX.Queue()
        self.proc = CTX.Process(
            target=receiver_main,
            args=(self.rid, 1, self.port, epoch, timeout_s, behaviour, model_dir, self.inbox, self.acks),
            daemon=True,
        )
        self.proc.start()
        ready = wait_msgs(self.acks, "ready", epoch, [self.rid], time.monotonic() + 120)
        expect(ready, self.rid, f"ready {epoch}")
        t0 = time.monotonic()
        self.group = StatelessGroup(HOST, self.port, 0, 2, BACKEND, timeout_s, epoch, dev)
        joined = wait_msgs(self.acks, "join", epoch, [self.rid], t0 + timeout_s)
        expect(joined, self.rid, f"join {epoch}")
        self.join_s = time.monotonic() - t0

    def push(self, plan: Any, gather: Any, deadline_s: float) -> tuple[Any, dict, float]:
        """Announce, send, and wait for the acknowledgement; SyncError (naming the replica) on any failure."""
        from app.weights.broadcast import send_buckets
        from app.weights.records import SyncError

        t0 = time.monotonic()
        self.inbox.put(plan)  # the announcement (WeightHub.announce in the real system)
        stats, send_err = None, None
        try:
            stats = send_buckets(plan, gather, self.group, self.dev)
        except SyncError as e:
            send_err = e
        acks = wait_msgs(self.acks, "push", plan.version, [self.rid], t0 + deadline_s)
        try:
            expect(acks, self.rid, f"push {plan.version}", stats.checksums if stats else None)
        except SyncError as e:
            raise SyncError(f"{e}" + (f" [sender: {send_err}]" if send_err else "")) from None
        if send_err is not None:
            raise send_err
        return stats, acks[self.rid], time.monotonic() - t0

    def close(self, kill: bool = False) -> None:
        self.group.close()
        if self.proc.is_alive() and not kill:
            self.inbox.put(None)
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def param_checksums(names: list[str], gather: Any) -> dict[str, str]:
    from app.weights.buckets import checksum

    return {n: checksum(t.reshape(-1)) for n, t in zip(names, gather(names), strict=True)}


def plain_state(kind: str, dev: torch.device) -> dict[str, torch.Tensor]:
    """bf16 tensors standing in for a model: "mixed" (Qwen2-0.5B-like layers plus odd sizes) or "big"
    (eight 64 MiB tensors: every bucket is large enough that NCCL cannot buffer it for a dead peer)."""
    g = torch.Generator(device=dev).manual_seed(0)
    shapes: dict[str, tuple[int, ...]] = {}
    if kind == "big":
        shapes = {f"w{i}": (4096, 8192) for i in range(8)}
    else:
        h, kv, inter = 896, 128, 4864
        shapes["model.embed_tokens.weight"] = (151936, h)
        for i in range(4):
            p = f"model.layers.{i}."
            shapes.update(
                {
                    p + "self_attn.q_proj.weight": (h, h),
                    p + "self_attn.q_proj.bias": (h,),
                    p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.v_proj.bias": (kv,),
                    p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (inter, h),
                    p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter),
                    p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,),
                }
            )
        shapes["odd.a"] = (3, 1001)  # odd element counts: buckets whose byte size is not a multiple of 8
        shapes["odd.b"] = (7,)
        shapes["model.norm.weight"] = (h,)
    return {n: torch.randn(s, generator=g, device=dev).to(torch.bfloat16) for n, s in shapes.items()}


def trainer_main(scenario: str, model_dir: str | None, timeout_s: float, deadline_s: float) -> dict:
    """Rank 0 of a trainer on GPU0 (with its own default NCCL group, as under Ray Train), pushing to
    receivers on GPU1 through app/weights/. Returns what happened; raises on anything unexpected."""
    import faulthandler
    import logging
    import sys

    from app.weights import group as weight_group
    from app.weights.buckets import plan_buckets
    from app.weights.records import SyncError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(name)s %(levelname)s %(message)s")
    faulthandler.dump_traceback_later(50, repeat=True, file=sys.stderr)  # where it hangs, if it does
    dev = use_device(0)
    dist.init_process_group(
        BACKEND,
        init_method=f"tcp://{HOST}:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=120),
        device_id=None if DRY_RUN_CPU else dev,
    )
    bucket = 64 << 20
    out: dict[str, Any] = {"events": []}
    epochs: list[Epoch] = []
    try:
        if scenario == "fsdp":
            from app.trainer.learner import Learner

            learner = Learner(gpu_config("train.workers=1"), model_dir, dev)
            specs, gather = learner.push_specs(), learner.gather
        else:
            state = plain_state("big" if scenario in ("die", "stuck", "stuck_alive") else "mixed", dev)
            specs = [(n, tuple(t.shape), t.dtype) for n, t in state.items()]

            def gather(names: list[str]) -> list[torch.Tensor]:
                return [state[n] for n in names]

        def healthy_push(epoch: Epoch, version: int) -> dict:
            plan = plan_buckets(specs, bucket, version)
            stats, ack, elapsed = epoch.push(plan, gather, deadline_s)
            mine = param_checksums(plan.names, gather)
            ev = {
                "what": "push",
                "epoch": epoch.epoch,
                "version": version,
                "acked_version": ack["version"],
                "buckets": len(plan.buckets),
                "nbytes": plan.nbytes,
                "bucket_checksums_equal": ack["checksums"] == stats.checksums,
                "param_checksums_equal": ack["params"] == mine,
                "n_params": len(mine),
                "elapsed_s": elapsed,
                "join_s": epoch.join_s,
                "param_checksums": mine,
            }
            out["events"].append(ev)
            return ev

        if scenario in ("mixed", "fsdp"):
            ep = Epoch(0, "ok", timeout_s, dev, model_dir)
            epochs.append(ep)
            healthy_push(ep, 1)
            if scenario == "fsdp":
                from transformers import AutoConfig

                vocab = AutoConfig.from_pretrained(model_dir).vocab_size
                batch = with_behaviour_logprobs(learner, fixed_batch(vocab))
                learner.step(batch)
            else:
                with torch.no_grad():
                    for t in list(state.values())[::3]:
                        t.add_(1)
            healthy_push(ep, 2)
        else:
            behaviour = "stuck" if scenario.startswith("stuck") else scenario
            bad = Epoch(0, behaviour, timeout_s, dev)
            epochs.append(bad)
            plan = plan_buckets(specs, bucket, 1)
            t0 = time.monotonic()
            try:
                bad.push(plan, gather, deadline_s)
                out["events"].append({"what": "failed_push", "raised": False})
            except SyncError as e:
                out["events"].append(
                    {
                        "what": "failed_push",
                        "raised": True,
                        "error": str(e),
                        "elapsed_s": time.monotonic() - t0,
                        "rid": bad.rid,
                    }
                )
            out["aborting_after_failure"] = len(weight_group._ABORTING)
            if scenario == "stuck_alive":
                bad.group.close()  # the stuck receiver lives on while the group forms again without it
            else:
                bad.close(kill=True)
            good = Epoch(1, "ok", timeout_s, dev)  # the group formed again, with a fresh receiver
            epochs.append(good)
            healthy_push(good, 1)
            out["aborting_after_recovery"] = len(weight_group._ABORTING)
            if scenario == "stuck_alive":
                bad.close(kill=True)
            healthy_push(good, 2)
            time.sleep(1.0)
            out["aborting_at_end"] = len(weight_group._ABORTING)
        return out
    finally:
        for ep in epochs:
            ep.close()
        dist.destroy_process_group()
