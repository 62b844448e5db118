"""Plots of several results: pass@k against k, accuracy against response length (and the CLI's plot of them)."""

from __future__ import annotations

import pytest
from graded_records import COUNTS_A, LENGTHS_A, LENGTHS_B, RUNS, graded, timed

from nemo_disco import cli
from nemo_disco.evaluation.plots import plot_length_accuracy, plot_pass_at_k
from nemo_disco.evaluation.records import write_results
from nemo_disco.evaluation.summary import summarize


def test_plot_pass_at_k(tmp_path):
    summaries = [summarize(graded(RUNS[k])) for k in ("a", "c")]
    out = plot_pass_at_k(summaries, ["a", "c"], tmp_path / "p" / "passk.png")
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no result has benchmark"):
        plot_pass_at_k(summaries, ["a", "c"], tmp_path / "x.png", benchmarks=["aime"])


def test_plot_length_accuracy(tmp_path):
    summaries = [summarize(timed(t), replicates=0) for t in (LENGTHS_A, LENGTHS_B)]
    out = plot_length_accuracy(summaries, ["drpo", "disco"], tmp_path / "p" / "len.png")
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no response lengths"):
        plot_length_accuracy([summarize(graded(COUNTS_A), replicates=0)], ["old"], tmp_path / "x.png")
    write_results(timed(LENGTHS_A), tmp_path / "a", replicates=0)
    write_results(timed(LENGTHS_B), tmp_path / "b", replicates=0)
    assert cli.main(["plot", "--length-accuracy", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    write_results(graded(COUNTS_A), tmp_path / "old", replicates=0)
    assert cli.main(["plot", "--length-accuracy", str(tmp_path / "old"), "--out", str(tmp_path / "y.png")]) == 2
