"""`GenerationGate` (rollout.partial=off): a push waits for every request inside the replica, new requests wait
for the push. Pure asyncio: the requests are coroutines that hold the gate until told to finish."""

from __future__ import annotations

import asyncio
import logging

from app.weights.loaders import GenerationGate


async def _request(gate: GenerationGate, log: list[str], name: str, finish: asyncio.Event) -> None:
    async with gate.admit():
        log.append(f"{name} in")
        await finish.wait()
        log.append(f"{name} out")


def test_a_drain_waits_for_requests_inside_and_holds_new_ones():
    async def scenario() -> list[str]:
        gate, log = GenerationGate(), []
        done = {k: asyncio.Event() for k in ("a", "b", "c")}
        inside = [asyncio.create_task(_request(gate, log, k, done[k])) for k in ("a", "b")]
        while gate.inside < 2:
            await asyncio.sleep(0)

        async def push() -> None:
            async with gate.drained(timeout_s=30, what="test push"):
                log.append("load")

        pushing = asyncio.create_task(push())
        await asyncio.sleep(0)
        late = asyncio.create_task(_request(gate, log, "c", done["c"]))  # arrives while the push drains
        for _ in range(20):
            await asyncio.sleep(0)
        assert "load" not in log and "c in" not in log  # a and b still generate: no load, no admission
        done["a"].set()
        done["b"].set()
        await asyncio.wait_for(pushing, timeout=10)
        await asyncio.wait_for(asyncio.gather(*inside), timeout=10)
        while "c in" not in log:
            await asyncio.sleep(0)
        done["c"].set()
        await asyncio.wait_for(late, timeout=10)
        return log

    log = asyncio.run(scenario())
    assert log.index("load") > max(log.index("a out"), log.index("b out"))  # both finished first
    assert log.index("c in") > log.index("load")  # the late request entered after the load


def test_a_drain_past_its_deadline_loads_anyway(caplog):
    async def scenario() -> bool:
        gate, log = GenerationGate(), []
        stuck = asyncio.Event()
        req = asyncio.create_task(_request(gate, log, "stuck", stuck))
        while not gate.inside:
            await asyncio.sleep(0)
        async with gate.drained(timeout_s=0.2, what="test push"):
            loaded = gate.inside == 1  # the stuck request is still inside: the load went ahead
        stuck.set()
        await asyncio.wait_for(req, timeout=10)
        return loaded

    with caplog.at_level(logging.WARNING, logger="app.sync"):
        assert asyncio.run(scenario())
    assert "1 requests still generating after 0.2s; loading anyway" in caplog.text
