"""The compiled trainer's warm-up: its kernels compiled while the first batch is still being generated.

With `train.compile` on (the GPU default), `torch.compile` builds the layers' and the chunked log-probs'
kernels at their first forward and backward (app/trainer/compiled.py), and builds them again at the first
micro-batch of another length, then with dynamic token dimensions. Left to the first step, that compile sits
on the loop's critical path: the trainer only starts it once the first batch has arrived. `warm_up` runs those
passes on two synthetic micro-batches of different lengths as soon as the mode's stream has started, so the
compile overlaps the first batch's generation; the first real step then finds every graph built.

The warm-up changes no trained state: it runs forward and backward only (every rank the same passes, as
FSDP2's collectives need), then drops the gradients. No optimizer step, no scheduler step, no weight push.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from app.trainer.batch_tensors import Row

log = logging.getLogger("app.train")

PROMPT = 8  # prompt tokens of each synthetic row


def warm_up_lengths(chunk_tokens: int, budget: int, max_response: int) -> list[list[int]]:
    """The response lengths of each synthetic micro-batch's rows (each at most `max_response`).

    Two micro-batches of different lengths (and row counts): the first as long as a real pass may be (about
    `budget` tokens, prompts included: torch's compiled graphs guard on a range of lengths around the ones they
    were traced at, so a warm-up at short lengths would leave a real pass to compile again), the second about
    half that. With chunked log-probs (`chunk_tokens` > 0) the first ends in a chunk of 2 rows, the second in
    a chunk of 1 (a size torch specializes): the kinds of chunk a real pass's scored tokens split into."""
    chunk, rests = (chunk_tokens, (2, 1)) if chunk_tokens > 0 else (1, (0, 1))
    return [
        _rows_of(_fit(share, chunk, rest, max_response), max_response)
        for share, rest in zip((budget, budget // 2), rests, strict=True)
    ]


def _fit(budget: int, chunk: int, rest: int, max_response: int) -> int:
    """The most response tokens `k * chunk + rest` (k >= 1) whose rows, prompts included, fit `budget`."""
    k = 1
    while (n := (k + 1) * chunk + rest) + PROMPT * _row_count(n, max_response) <= budget:
        k += 1
    return k * chunk + rest


def _row_count(n: int, max_response: int) -> int:
    """Rows of at most `max_response` response tokens that `n` tokens take (at least one)."""
    return max(1, -(-n // max(1, max_response)))


def _rows_of(n: int, max_response: int) -> list[int]:
    """`n` response tokens in rows of at most `max_response`, as evenly as possible."""
    k = _row_count(n, max_response)
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def warm_up_rows(vocab_size: int, lengths: list[list[int]]) -> list[list[Row]]:
    """The rows of each synthetic micro-batch, of `lengths` response tokens each after a prompt of `PROMPT`
    (token ids in `[2, vocab_size)`, advantage 0, with reference log-probs so a KL penalty's path runs too)."""
    if vocab_size < 3:
        raise ValueError(f"a vocabulary of {vocab_size} tokens is too small to warm up on")
    out = []
    for mb in lengths:
        rows = []
        for i, n in enumerate(mb):
            ids = [2 + (7 * i + k) % (vocab_size - 2) for k in range(PROMPT + n)]
            lps = [-1.0] * n
            rows.append(Row(ids[:PROMPT], ids[PROMPT:], lps, 0.0, [0] * n, ref_logprobs=list(lps)))
        out.append(rows)
    return out


def wants_warm_up(learner: Any, setting: str) -> bool:
    """`train.warm_up`: `auto` warms up a trainer whose layers are compiled, `on` any trainer, `off` none."""
    return setting == "on" or (setting == "auto" and bool(getattr(learner.model, "relay_compiled", False)))


def warm_up(learner: Any, setting: str = "auto") -> float:
    """Run `learner`'s forward and backward on the synthetic micro-batches and drop the gradients
    (collective: every rank calls it); returns the seconds taken (0.0 where `setting` skips it)."""
    if not wants_warm_up(learner, setting):
        return 0.0
    t0 = time.perf_counter()
    vocab = int(learner.model.config.vocab_size)
    t, r = learner.cfg.train, learner.cfg.rollout
    budget = t.micro_batch_tokens if learner.packed else max(1, t.micro_batch_size) * r.max_model_len
    lengths = warm_up_lengths(t.logprob_chunk_tokens, budget, r.max_tokens)
    mbs = [learner.collate(rows) for rows in warm_up_rows(vocab, lengths)]
    learner.backward_only(mbs)
    took = time.perf_counter() - t0
    log.log(
        logging.INFO if learner.rank == 0 else logging.DEBUG,
        "trainer warmed up in %.1fs (%d compiled forward/backward passes)",
        took,
        len(mbs),
    )
    return took
