"""How several training files make one epoch (`data.train` as a list, `data.train_weights`). Pure arithmetic;
app/rollout/dataset.py `TrainSet` draws the rows.

Without weights an epoch is every row of every file. With weights `w`, file i's share of an epoch is
p_i = w_i / sum(w), and the epoch is as long as the file with the fewest rows per share allows:
E = min_i(n_i / p_i) rows, file i giving floor(p_i x E) of its n_i rows (all of them for that file, a seeded
sample, different each epoch, for the others). No row repeats within an epoch, so every uid of an epoch is
distinct (the prompt stream's bookkeeping relies on it), and the proportions hold exactly.
"""

from __future__ import annotations


def epoch_counts(sizes: list[int], weights: list[float] | None = None) -> list[int]:
    """Rows drawn from each file per epoch (see the module docstring). `sizes`: each file's row count."""
    if not weights:
        return list(sizes)
    if len(weights) != len(sizes):
        raise ValueError(f"{len(weights)} weights for {len(sizes)} files")
    total = float(sum(weights))
    shares = [w / total for w in weights]
    epoch = min(n / p for n, p in zip(sizes, shares, strict=True))
    return [min(n, int(p * epoch + 1e-9)) for n, p in zip(sizes, shares, strict=True)]


def sample_seed(seed: int, epoch: int, file_index: int) -> int:
    """Seed of file `file_index`'s sample in `epoch` (data.seed based; distinct per file and epoch)."""
    return (seed * 1_000_003 + epoch * 7919 + file_index) % (2**31 - 1)
