"""The README's table "the answer in both regimes" is the committed tables' paired differences: each row's seeds and its
three Δ cells (HN mean, i2t R@1, t2i R@1) recomputed by `pairs_table` from the `summary.json` it quotes, so a table
replaced at more seeds fails here until the README is brought along."""
from pathlib import Path

import pytest

from powerclip.experiments import pairs_table
from powerclip.report import load_comparison

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# the README row's closing words -> (the committed table, row, control)
ROWS = {"PowerCLIP-R - CLIP": ("plateau_cpu/T1600", "PowerCLIP-R", "CLIP"),
        "PowerCLIP-R (avg) - CLIP (avg)": ("plateau_cpu/T1600", "PowerCLIP-R (avg)", "CLIP (avg)"),
        "PowerCLIP-R ft - CLIP ft": ("finetune_cpu/T1600", "PowerCLIP-R ft", "CLIP ft"),
        "PowerCLIP-R (SigLIP) - SigLIP": ("sigmoid_cpu/T1600", "PowerCLIP-R (SigLIP)", "SigLIP"),
        "C2LIP (SigLIP) - SigLIP ft": ("sigmoid_cpu/T1600", "C2LIP (SigLIP)", "SigLIP ft")}


def _cells(line: str) -> list[str]:
    "A Markdown table row's cells."
    return [c.strip() for c in line.strip("|").split("|")]


def _readme_rows() -> dict[str, list[str]]:
    "The table's rows by the words after its last colon: [seeds, Δ HN mean, Δ i2t R@1, Δ t2i R@1, verdict]."
    text = (ROOT / "README.md").read_text()
    head = "| a loss against its control | seeds |"
    assert head in text, "the README's table of both regimes has moved or changed its header"
    rows = {}
    for line in text[text.index(head):].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        rows[cells[0].rsplit(": ", 1)[-1]] = cells[1:]
    return rows


def test_every_row_is_checked():
    assert set(_readme_rows()) == set(ROWS)


@pytest.mark.parametrize("label", list(ROWS))
def test_row_is_the_committed_table(label):
    folder, row, control = ROWS[label]
    if not (RESULTS / folder / "summary.json").is_file():
        pytest.fail(f"{folder}/summary.json is not committed")
    table = pairs_table(load_comparison(RESULTS / folder), ((row, control),))
    line = next(l for l in table.splitlines() if l.startswith(f"| {row} | {control} |"))
    seeds, hn, i2t, t2i = _cells(line)[2:6]
    readme = _readme_rows()[label]
    assert readme[0].split(",")[0] == seeds, (label, readme[0], seeds)
    assert readme[1:4] == [hn, i2t, t2i], (label, readme[1:4], [hn, i2t, t2i])
