r"""pass@k evaluation on math benchmarks: generate, grade, tabulate with uncertainty, compare runs.

A result is a list of records, one per (problem, sample)::

    {"benchmark": "aime", "problem_index": 3, "sample_index": 0, "response": "...", "score": 1.0, ...}

written one per line to ``responses.jsonl`` (extra fields: ``answer``, ``finish_reason``,
``response_tokens``). A sample is correct when its score is above 0.5 (graders give 1.0 / 0.0). A results
folder is a folder holding ``responses.jsonl`` (what ``nemo-disco eval --out`` writes).

pass@k uses the unbiased estimator of Chen et al. 2021 (eq. 1, :func:`nemo_disco.stats.pass_at_k`); a
benchmark's pass@k is its mean over problems. pass@1 is then the mean over problems of the share of correct
samples, as in the paper's tab. 2 (16 samples, temperature 0.6, top-p 0.95). Reported k are 1, 2, 4, ... up
to the number of samples, and that number itself; the average row is the unweighted mean over benchmarks.

Uncertainty (:mod:`nemo_disco.stats`): every pass@k comes with its standard error over problems and a
percentile bootstrap interval (problems resampled, and for pass@1 the samples within them; fixed seed);
the average's standard error combines the benchmarks' as independent, its interval averages their
replicates. Three views on top of one table:

- :func:`~nemo_disco.evaluation.compare.aggregate_runs`: several results of one setting (training seeds,
  checkpoints): per benchmark the mean, sample standard deviation, min and max over runs;
- :func:`~nemo_disco.evaluation.compare.compare_results`: two results on the same problems: the paired
  difference per benchmark with its standard error and a paired bootstrap interval ("A beats B on AIME by x
  points, 95% CI [lo, hi]");
- :func:`~nemo_disco.evaluation.plots.plot_pass_at_k`: pass@k against k for several results, one panel per
  benchmark;
- :func:`~nemo_disco.evaluation.plots.plot_length_accuracy`: pass@1 against mean response length, one point per
  result.

Mean response length (tokens, from the records' ``response_tokens``) is reported beside pass@k, over all, the
correct and the wrong samples of each benchmark; its standard error is clustered by problem as pass@k's is
(:func:`nemo_disco.stats.ratio_mean_se`), and ``compare_results`` pairs it by problem.

The modules (import from them; this package's ``__init__`` exports nothing):

- ``summary``: one result's table (``summarize``, ``EvalSummary``) and the cell and record helpers the other
  tables share;
- ``compare``: views across results: several runs of one setting, two results paired by problem;
- ``plots``: pass@k against k, and accuracy against response length;
- ``records``: results on disk: reading, checking and re-grading ``responses.jsonl``, writing the tables, and
  the partial records an evaluation appends as it goes;
- ``run``: generating and grading a model's responses (``evaluate_model``), resumable and data parallel.
"""
