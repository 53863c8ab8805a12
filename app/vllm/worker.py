"""Runs inside each vLLM worker process: joins the weight group and loads pushed buckets.

vLLM imports `RelayWorkerExtension` through the engine argument `worker_extension_cls`
(`app.vllm.engine.WORKER_EXTENSION`) and mixes it into its Worker, so its methods are reachable with
`collective_rpc`. Arguments travel as JSON strings (tensors passed as RPC arguments arrive as lists); tensors
travel only through the epoch's transport (app/weights/transport.py), built from the name in `GroupInfo`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from app.infra.log_filters import silence_vllm_reload_warnings
from app.vllm.fast_load import SlotLoader, plan_slots
from app.vllm.seeded_cpu import install as install_seeded_cpu_sampling
from app.weights.ack_board import answered
from app.weights.buckets import checksum
from app.weights.records import dtype_of, group_from_json, plan_from_json
from app.weights.transport import make_transport

log = logging.getLogger(__name__)
# vLLM restores each RotaryEmbedding's computed buffer after a reload and warns about it on every push
silence_vllm_reload_warnings()
# per-request seeds on the CPU worker (app/vllm/seeded_cpu.py): this module is imported in the engine-core
# process, where the model runner samples
install_seeded_cpu_sampling()


def retie_output_embedding(model: Any, hf_config: Any) -> bool:
    """After a layerwise reload, point a tied output projection back at the reloaded input embedding and
    rebuild its kernel; returns whether the model ties them.

    A tied `lm_head` loads no tensor of its own, so the reload puts back the parameter it held before (the
    old embedding) while `embed_tokens` gets the new one; on CPU its oneDNN kernel is also a copy packed
    when it was built. Without this a replica keeps sampling from the old output projection after every push
    (the trainer's and vLLM's log-probs then drift apart by about 5e-3 a step on SmolLM2-135M)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(text, "tie_word_embeddings", False) or head is None or embed is None:
        return False
    if head.weight is not embed.weight:
        head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)
    return True


def _unpadded(held: tuple[int, ...], pushed: tuple[int, ...] | None) -> tuple[int, ...]:
    """The rows of an engine parameter that hold pushed data: vLLM pads a vocabulary (embedding, lm_head) to a
    multiple of 64 rows, and the padding rows are nobody's."""
    if pushed and len(held) == len(pushed) and held[1:] == tuple(pushed[1:]) and held[0] >= pushed[0]:
        return tuple(pushed)
    return held


class RelayWorkerExtension:
    """Mixed into vLLM's Worker. `self` is the worker: it has get_model(), model_config, device, rank."""

    def _relay_device(self) -> torch.device:
        dev = getattr(self, "device", None)
        return dev if isinstance(dev, torch.device) else torch.device("cpu")

    def relay_join(self, group_json: str, first_rank: int) -> dict[str, Any]:
        """Join epoch `info.epoch` as rank `first_rank` + this worker's rank, through its transport."""
        info = group_from_json(group_json)
        self.relay_leave()
        rank = first_rank + int(getattr(self, "rank", 0) or 0)
        t0 = time.perf_counter()
        transport = make_transport(info.transport)
        transport.join(info, rank, self._relay_device())
        self._relay_transport = transport
        # whether this worker can answer pushes into the epoch's store itself (`relay_receive`'s ack_epoch)
        store = getattr(getattr(transport, "group", None), "store", None) is not None
        return {"rank": rank, "join_s": time.perf_counter() - t0, "store": store}

    def relay_receive(
        self,
        plan_json: str,
        load: str | None = None,
        adapter_dir: str | None = None,
        adapter_json: str = "",
        ack_epoch: int | None = None,
    ) -> dict[str, Any]:
        """Receive and load one push; returns the per-bucket checksums, timings and how it loaded.

        `load` (None: decide here): `layerwise` wraps `load_weights` in vLLM's layerwise reload, needed where
        the engine post-processes loaded weights (on CPU linear layers pre-pack their weights and drop
        `.weight`, so a plain load_weights crashes; quantized layers repack). Unquantized weights on a GPU
        skip it (its bookkeeping was 120-140 ms of a 1.5B push): `slots` copies each tensor straight into
        its place (app/vllm/fast_load.py) where the model keeps its parameters whole, else `weights` calls
        `load_weights`.

        `adapter_dir` (LoRA): the pushed tensors are a LoRA adapter (`adapter_json`: its LoraSpec); they are
        written to that folder in PEFT format (`receive_adapter`) and the model is left as it is.

        `ack_epoch`: also answer the trainer straight into that epoch's store (`_relay_answered`)."""
        transport = self._relay_joined("relay_receive")
        plan = plan_from_json(plan_json)
        if adapter_dir is not None:
            return self._relay_receive_adapter(transport, plan, adapter_dir, adapter_json)

        def receive() -> dict[str, Any]:
            model = self.get_model()
            how, loader = self._relay_loader(model, plan, load)
            t0 = time.perf_counter()
            with self._relay_reload(model, how == "layerwise"):
                checksums, timing = transport.receive(plan, loader, self._relay_device())
            return {"checksums": checksums, **timing, "load": how, "receive_s": time.perf_counter() - t0}

        return self._relay_answered(transport, plan.version, ack_epoch, receive)

    def _relay_answered(
        self, transport: Any, version: int, ack_epoch: int | None, receive: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        """Run `receive` (a load of push `version`); with `ack_epoch`, this worker also answers the trainer
        straight into that epoch's store the moment the load is done (`ack_board.answered`)."""
        if ack_epoch is None:
            return receive()
        return answered(transport.group.store, transport.group.rank, ack_epoch, version, receive)

    def relay_stage(self, plan_json: str, notify: str) -> dict[str, Any]:
        """Start receiving one push in a thread into this worker's staging buffers (`app/weights/staging.py`) and
        return at once: the engine keeps generating with the old weights meanwhile. The thread sends one line
        to the Unix socket `notify` when it is done; `relay_swap` then loads what it received."""
        from app.weights.staging import StagedPush

        transport = self._relay_joined("relay_stage")
        if not hasattr(self, "_relay_buffers"):
            self._relay_buffers: dict[str, torch.Tensor] = {}
        self._relay_stage = StagedPush(
            transport, plan_from_json(plan_json), self._relay_device(), self._relay_buffers
        )
        self._relay_stage.start(notify)
        return {"staging": True}

    def relay_swap(self, timeout_s: float = 60.0, ack_epoch: int | None = None) -> dict[str, Any]:
        """Load the staged push into the model (generation is paused by the caller); returns what
        `relay_receive` returns: the received buckets' checksums, timings (`load_s`: this copy) and the load;
        `ack_epoch` as there."""
        stage = getattr(self, "_relay_stage", None)
        if stage is None:
            raise RuntimeError("relay_swap without a staged push (relay_stage first)")
        self._relay_stage = None

        def swap() -> dict[str, Any]:
            model = self.get_model()
            load, loader = self._relay_loader(model, stage.plan, None)
            t0 = time.perf_counter()
            with self._relay_reload(model, load == "layerwise"):
                res = stage.load(loader, timeout_s)
            return {**res, "load": f"staged {load}", "receive_s": time.perf_counter() - t0}

        return self._relay_answered(self._relay_joined("relay_swap"), stage.plan.version, ack_epoch, swap)

    def _relay_joined(self, method: str) -> Any:
        """This worker's end of the weight group's transport; raises where `method` came before a join."""
        transport = getattr(self, "_relay_transport", None)
        if transport is None:
            raise RuntimeError(f"{method} before relay_join: this worker is not in the weight group")
        return transport

    def _relay_loader(self, model: Any, plan: Any, load: str | None) -> tuple[str, Callable[[list], None]]:
        """How this push loads (`relay_receive`'s `load`) and the loader of one bucket's tensors; notes the
        pushed tensors (`relay_loaded_checksums` reads them back)."""
        self._relay_pushed = {t.name: (tuple(t.shape), t.dtype) for b in plan.buckets for t in b.tensors}
        if load is None:
            load = "layerwise" if self._relay_needs_reload() else "slots"
        loader = self._relay_slot_loader(model, plan) if load == "slots" else None
        if loader is None:
            load = "layerwise" if load == "layerwise" else "weights"
            loader = lambda items: model.load_weights(items)  # noqa: E731
        return load, loader

    def _relay_receive_adapter(self, transport: Any, plan: Any, adapter_dir: str, adapter_json: str) -> dict:
        """Receive an adapter push into host memory and write it as a PEFT folder (worker rank 0; every
        tensor-parallel worker receives the same tensors, and vLLM loads the folder itself)."""
        import json

        from app.trainer.lora import LoraSpec, save_adapter

        received: dict[str, torch.Tensor] = {}

        def keep(items: list) -> None:
            for name, t in items:  # views into the bucket's buffer: copied out
                received[name] = t.detach().to("cpu", copy=True)

        t0 = time.perf_counter()
        checksums, timing = transport.receive(plan, keep, self._relay_device())
        if int(getattr(self, "rank", 0) or 0) == 0:
            d = json.loads(adapter_json)
            spec = LoraSpec(d["rank"], d["alpha"], d.get("dropout", 0.0), tuple(d["targets"]))
            save_adapter(adapter_dir, received, spec, base_model=d.get("base_model", ""))
        out = {"checksums": checksums, **timing, "load": "adapter", "receive_s": time.perf_counter() - t0}
        return out | {"path": adapter_dir}

    def _relay_needs_reload(self) -> bool:
        quantized = getattr(getattr(self, "model_config", None), "quantization", None) is not None
        return self._relay_device().type != "cuda" or quantized

    def _relay_slot_loader(self, model: Any, plan: Any) -> Callable[[list], None] | None:
        """A loader that copies each tensor into its slot, or None where `plan_slots` cannot place them all
        (the slots are worked out once per set of pushed names)."""
        key = tuple(t.name for b in plan.buckets for t in b.tensors)
        params = dict(model.named_parameters())  # each push: a layerwise reload may replace parameters
        if getattr(self, "_relay_slots_key", None) != key:
            shapes = {t.name: tuple(t.shape) for b in plan.buckets for t in b.tensors}
            self._relay_slots = self._relay_plan_slots(model, params, shapes)
            self._relay_slots_key = key
            if self._relay_slots is None:
                log.info("pushed tensors do not map onto whole parameters: loading through load_weights")
        slots = self._relay_slots
        if slots is None:
            return None
        held = getattr(self, "_relay_slot_loader_obj", None)  # kept while the parameters are the same objects
        if (
            held is None
            or held.slots is not slots
            or held.params.keys() != params.keys()
            or any(a is not b for a, b in zip(held.params.values(), params.values(), strict=True))
        ):
            held = self._relay_slot_loader_obj = SlotLoader(params, slots)
        return held

    def _relay_plan_slots(self, model: Any, params: dict[str, Any], shapes: dict[str, tuple]) -> Any:
        """`plan_slots` for this engine: pushed `shapes` onto its parameters (a padded vocabulary's pushed rows,
        packed parameters, a tied lm_head skipped)."""
        tied = bool(getattr(getattr(self.model_config, "hf_config", None), "tie_word_embeddings", False))
        return plan_slots(
            shapes,
            {n: _unpadded(tuple(p.shape), shapes.get(n)) for n, p in params.items()},
            getattr(model, "packed_modules_mapping", {}) or {},
            skip=("lm_head.",) if tied else (),
        )

    def relay_loaded_checksums(self) -> dict[str, Any]:
        """What the engine holds for each tensor of the last push, read back from its place in the model (a
        packed parameter's rows included) in the pushed dtype: {"checksums": {name: checksum}, "skipped": [names
        not held separately, e.g. a tied lm_head]}. Whatever way the push was loaded, these must equal the
        trainer's checksums of the tensors it pushed (the GPU tier asserts it). Needs whole parameters (tensor
        parallel size 1, unquantized): elsewhere {"checksums": {}, "why": ...}."""
        pushed = getattr(self, "_relay_pushed", None)
        if not pushed:
            return {"checksums": {}, "why": "nothing pushed yet"}
        model = self.get_model()
        params = dict(model.named_parameters())
        slots = self._relay_plan_slots(model, params, {n: shape for n, (shape, _) in pushed.items()})
        if slots is None:
            return {
                "checksums": {},
                "why": "the engine's parameters are not whole copies of the pushed tensors",
            }
        out, skipped = {}, []
        for name, slot in slots.items():
            if slot is None:
                skipped.append(name)
                continue
            held = params[slot.param].detach().narrow(0, slot.start, slot.rows)
            out[name] = checksum(held.to(dtype_of(pushed[name][1])).reshape(-1))
        return {"checksums": out, "skipped": skipped}

    def relay_pid(self) -> int:
        """This worker's process id (for an operator, or a fault test that kills the engine)."""
        import os

        return os.getpid()

    def relay_params_digest(self) -> dict[str, str]:
        """Checksum of every parameter of the engine's model (names as vLLM holds them; for tests)."""
        return {n: checksum(p.detach().reshape(-1)) for n, p in self.get_model().named_parameters()}

    @contextlib.contextmanager
    def _relay_reload(self, model: Any, layerwise: bool) -> Iterator[None]:
        if not layerwise:
            yield
            return
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(model)
        try:
            yield
        finally:
            finalize_layerwise_reload(model, self.model_config)
            retie_output_embedding(model, self.model_config.hf_config)

    def relay_leave(self) -> None:
        transport = getattr(self, "_relay_transport", None)
        if transport is not None:
            transport.close()
            self._relay_transport = None

    def relay_param_checksum(self, name: str) -> str:
        """Checksum of one loaded parameter (for tests); names as the vLLM model holds them."""
        return checksum(dict(self.get_model().named_parameters())[name].detach().float().reshape(-1))
