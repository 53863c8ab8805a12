"""Comments, docs and configs state the present: no file of the repository names the numbered stretches of
work, the borrowed machines or the accelerator budgets through which the project was built (git keeps that).

Every text file git tracks, or would track (untracked files that .gitignore does not exclude), is read and
searched case-insensitively; binary files are skipped. The patterns are assembled from fragments so that this
file's own source does not match them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_SES, _LEA, _LOA, _DEV, _WORK, _SPR = (
    "sess" + "ion",
    "lea" + "se",
    "lo" + "an",
    "dev" + "ice",
    "wo" + "rk",
    "spr" + "int",
)
PATTERNS = [
    rf"\b{_SES}s? \d+",
    rf"\b{_SES} \d+'s",
    rf"\b{_LEA}[ds]?\b",
    rf"\b{_LOA}(s|ed)?\b",
    rf"{_DEV} time",
    rf"{_WORK} period",
    rf"\b{_SPR}\b",
]
HISTORY = re.compile("|".join(f"(?:{p})" for p in PATTERNS), re.IGNORECASE)


def repository_files() -> list[Path]:
    """The files git tracks plus the untracked ones it does not ignore, relative to the repository root."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    names = sorted({n for n in out.decode("utf-8", "surrogateescape").split("\0") if n})
    return [Path(n) for n in names if (ROOT / n).is_file()]


def history_hits(rel: Path) -> list[str]:
    """`path:line: text` for each line of a text file that names a history word; none for a binary file."""
    data = (ROOT / rel).read_bytes()
    if b"\0" in data[:8192]:
        return []
    text = data.decode("utf-8", "replace")
    return [
        f"{rel}:{i}: {line.strip()[:160]}"
        for i, line in enumerate(text.splitlines(), 1)
        if HISTORY.search(line)
    ]


def test_the_patterns_match_history_words_and_not_their_neighbours():
    words = [
        "sess" + "ion 25",
        "Sess" + "ions 3",
        "sess" + "ion 27's",
        "a lea" + "se",
        "LEA" + "SED",
        "lo" + "ans",
    ]
    words += ["dev" + "ice time", "Wo" + "rk periods", "a spr" + "int"]
    for w in words:
        assert HISTORY.search(w), w
    for w in [
        "release",
        "pleased",
        "an agent session",
        "sessions of the agent",
        "device_time_total",
        "sprinter",
    ]:
        assert not HISTORY.search(w), w


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)
def test_no_file_names_the_history_of_its_making():
    hits = [hit for rel in repository_files() for hit in history_hits(rel)]
    assert not hits, "history words (state the present; git keeps the history):\n" + "\n".join(hits)
