"""Running an evaluation: end to end with the transformers generator, resumed after an interruption, chunk seeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_disco.config import EvalConfig, nested
from nemo_disco.evaluation.records import RESPONSES_FILE, grade_responses_file
from nemo_disco.evaluation.run import chunk_seed, evaluate_model

ROOT = Path(__file__).resolve().parents[2]


def _cfg(model, benchmarks, out, **keys) -> EvalConfig:  # noqa: ANN001
    """``model`` on ``benchmarks`` into ``out``; ``keys``: other dotted keys of the config (``generation.samples``)."""
    flat = {"model": str(model), "data.benchmarks": [str(b) for b in benchmarks], "out": str(out), **keys}
    return EvalConfig.model_validate(nested(flat))


# ----------------------------------------------------------------------------------------------------------------------
# End to end with the transformers generator


@pytest.mark.skipif(not (ROOT / "nemo_disco" / "generation" / "hf.py").is_file(), reason="HF generator not present")
def test_evaluate_model_tiny_hf(tiny_qwen2, tmp_path):
    bench = tmp_path / "arith.json"
    bench.write_text(json.dumps([{"problem": "1+1", "answer": 2}, {"problem": "2+5", "answer": 7},
                                 {"problem": "3+3", "answer": 6}]))  # fmt: skip
    out = tmp_path / "eval"
    keys = {"generation.samples": 2, "generation.temperature": 1.0, "generation.top_p": 1.0,
            "generation.max_response_tokens": 6, "generation.backend": "hf", "reward.grader": "math_verify",
            "generation.seed": 0, "data.max_problems": 2, "data.prompt_template": "{problem}=",
            "data.use_chat_template": True, "reward.workers": 1}  # fmt: skip
    summary = evaluate_model(_cfg(tiny_qwen2, [bench], out, **keys))
    records = [json.loads(line) for line in (out / RESPONSES_FILE).read_text().splitlines()]
    assert [(r["problem_index"], r["sample_index"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["benchmark"] == "arith" and 1 <= r["response_tokens"] <= 6 for r in records)
    assert {r["finish_reason"] for r in records} <= {"stop", "length"}
    assert [(r.benchmark, r.problems, r.samples) for r in summary.rows] == [("arith", 2, 2)]
    # The table on disk is the one re-grading the written file gives.
    assert grade_responses_file(out / RESPONSES_FILE, [str(bench)], regrade=True, workers=1).to_dict() == (
        summary.to_dict()
    )


# ----------------------------------------------------------------------------------------------------------------------
# Written as it goes: an interrupted evaluation continues


class _StopAfter:
    """The real HFGenerator, with Ctrl-C arriving during its generate call number ``stop_at`` (1-based)."""

    def __init__(self, inner, stop_at: int | None = None) -> None:
        self.inner, self.stop_at, self.calls = inner, stop_at, 0

    def generate(self, prompt_token_ids, n, sampling):  # noqa: ANN001, ANN201
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        return self.inner.generate(prompt_token_ids, n, sampling)

    def shutdown(self) -> None:
        pass


def _arith_bench(tmp_path):
    bench = tmp_path / "arith.json"
    rows = [{"problem": f"{a}+{b}", "answer": a + b} for a in range(1, 4) for b in range(1, 3)]  # 6 problems
    bench.write_text(json.dumps(rows))
    return bench


def test_interrupted_evaluation_continues_to_the_uninterrupted_result(tiny_qwen2, tmp_path, capsys):
    from nemo_disco.generation.hf import HFGenerator

    bench = _arith_bench(tmp_path)
    kwargs = {"generation.samples": 2, "generation.temperature": 1.0, "generation.top_p": 1.0,
              "generation.max_response_tokens": 6, "generation.backend": "hf", "data.prompt_template": "{problem}=",
              "reward.workers": 1, "generation.chunk_problems": 2, "bootstrap.replicates": 50,
              "data.max_problems": 6}  # fmt: skip
    generator = HFGenerator(tiny_qwen2)
    # 2 benchmarks x 3 chunks of 2 problems; Ctrl-C during the 4th chunk (the first of the second benchmark).
    stopped = _StopAfter(generator, stop_at=4)
    with pytest.raises(KeyboardInterrupt):
        evaluate_model(_cfg(tiny_qwen2, [bench, "aime"], tmp_path / "resumed", **kwargs), generator=stopped)
    assert "interrupted: the responses written so far are kept in" in capsys.readouterr().err
    partial = tmp_path / "resumed" / "partial"
    written = [json.loads(line) for f in partial.glob("part-*.jsonl") for line in f.read_text().splitlines()]
    assert len(written) == 3 * 2 * 2  # three whole chunks (2 problems x 2 samples each), nothing of the 4th
    assert not (tmp_path / "resumed" / RESPONSES_FILE).exists()
    # A cut-short last line (a kill in the middle of a write) is skipped, not fatal.
    with (partial / "part-0.jsonl").open("a") as f:
        f.write('{"benchmark": "aime", "problem_in')
    # A rerun with other settings is refused in one line, naming the setting.
    with pytest.raises(ValueError, match=r"holds an interrupted evaluation with samples=2 \(this command: 3\)"):
        evaluate_model(_cfg(tiny_qwen2, [bench, "aime"], tmp_path / "resumed", **{**kwargs, "generation.samples": 3}),
                       generator=stopped)  # fmt: skip
    counted = _StopAfter(generator)
    resumed = evaluate_model(_cfg(tiny_qwen2, [bench, "aime"], tmp_path / "resumed", **kwargs), generator=counted)
    assert "resuming the evaluation in" in capsys.readouterr().err
    assert counted.calls == 3  # only the 3 chunks not written before
    plain = evaluate_model(_cfg(tiny_qwen2, [bench, "aime"], tmp_path / "plain", **kwargs),
                           generator=_StopAfter(generator))  # fmt: skip
    assert (tmp_path / "resumed" / RESPONSES_FILE).read_text() == (tmp_path / "plain" / RESPONSES_FILE).read_text()
    assert resumed.to_dict() == plain.to_dict()
    assert not partial.exists()  # merged into responses.jsonl
    # A finished result is not overwritten silently.
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'plain'} already holds an evaluation .*--overwrite"):
        evaluate_model(_cfg(tiny_qwen2, [bench], tmp_path / "plain", **kwargs), generator=counted)
    again = evaluate_model(_cfg(tiny_qwen2, [bench, "aime"], tmp_path / "plain", **kwargs),
                           generator=_StopAfter(generator), overwrite=True)  # fmt: skip
    assert again.to_dict() == plain.to_dict()  # seeded per chunk: the same responses


def test_chunk_seeds_depend_on_benchmark_and_chunk_only():
    seeds = {chunk_seed(0, b, k) for b in ("aime", "math") for k in range(50)}
    assert len(seeds) == 100 and all(0 <= s < 2**31 for s in seeds)
    assert chunk_seed(0, "math", 3) == chunk_seed(0, "math", 3) != chunk_seed(1, "math", 3)


# ----------------------------------------------------------------------------------------------------------------------
# A failure before the first record leaves no partial/ behind


class _Fails:
    """A generator that fails in its first generate call (an engine that runs out of memory, say)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def generate(self, prompt_token_ids, n, sampling):  # noqa: ANN001, ANN201
        raise self.error

    def shutdown(self) -> None:
        pass


def test_a_failure_before_the_first_record_leaves_no_partial_and_a_retry_with_other_settings_runs(
    tiny_qwen2, tmp_path, capsys, monkeypatch
):
    from nemo_disco.evaluation import run
    from nemo_disco.generation.hf import HFGenerator

    bench = _arith_bench(tmp_path)
    kwargs = {"generation.samples": 2, "generation.temperature": 1.0, "generation.top_p": 1.0,
              "generation.max_response_tokens": 4, "data.prompt_template": "{problem}=", "reward.workers": 1,
              "generation.chunk_problems": 2, "bootstrap.replicates": 0, "data.max_problems": 4}  # fmt: skip
    out = tmp_path / "eval"

    # The engine fails to start: no partial/ (and no settings in it) stays behind.
    def broken_engine(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("the engine did not start")

    monkeypatch.setattr(run, "build_generator", broken_engine)
    with pytest.raises(RuntimeError, match="the engine did not start"):
        evaluate_model(_cfg(tiny_qwen2, [bench], out, **kwargs, **{"generation.backend": "hf"}))
    assert not (out / "partial").exists()
    # The first generate call fails, or is interrupted: the same.
    with pytest.raises(RuntimeError, match="out of memory"):
        evaluate_model(_cfg(tiny_qwen2, [bench], out, **kwargs), generator=_Fails(RuntimeError("out of memory")))
    assert not (out / "partial").exists()
    with pytest.raises(KeyboardInterrupt):
        evaluate_model(_cfg(tiny_qwen2, [bench], out, **kwargs), generator=_Fails(KeyboardInterrupt()))
    assert f"interrupted before any response was written: {out / 'partial'} removed" in capsys.readouterr().err
    assert not (out / "partial").exists()
    # A partial/ holding settings but no record (left by an older version, or a kill before the first chunk) does
    # not refuse a retry with another backend: it starts over.
    (out / "partial").mkdir(parents=True)
    (out / "partial" / "settings.json").write_text(json.dumps({"backend": "vllm", "samples": 2}))
    (out / "partial" / "part-0.jsonl").write_text('{"benchmark": "arith", "problem_in')  # cut short: no record
    monkeypatch.undo()
    summary = evaluate_model(_cfg(tiny_qwen2, [bench], out, **kwargs), generator=HFGenerator(tiny_qwen2))
    assert [(r.benchmark, r.problems, r.samples) for r in summary.rows] == [("arith", 4, 2)]
    assert (out / RESPONSES_FILE).is_file() and not (out / "partial").exists()


def test_a_failure_after_records_keeps_them_to_continue(tiny_qwen2, tmp_path):
    """A failure after the first chunk keeps partial/ (the resume of an interrupted evaluation is unchanged)."""
    from nemo_disco.generation.hf import HFGenerator

    bench = _arith_bench(tmp_path)
    kwargs = {"generation.samples": 2, "generation.temperature": 1.0, "generation.top_p": 1.0,
              "generation.max_response_tokens": 4, "data.prompt_template": "{problem}=", "reward.workers": 1,
              "generation.chunk_problems": 2, "bootstrap.replicates": 0, "data.max_problems": 4}  # fmt: skip
    out = tmp_path / "eval"

    class _FailsSecond(_StopAfter):
        def generate(self, prompt_token_ids, n, sampling):  # noqa: ANN001, ANN201
            if self.calls == 1:
                raise RuntimeError("out of memory")
            return super().generate(prompt_token_ids, n, sampling)

    generator = HFGenerator(tiny_qwen2)
    with pytest.raises(RuntimeError, match="out of memory"):
        evaluate_model(_cfg(tiny_qwen2, [bench], out, **kwargs), generator=_FailsSecond(generator))
    assert len((out / "partial" / "part-0.jsonl").read_text().splitlines()) == 2 * 2  # the first chunk
    with pytest.raises(ValueError, match=r"holds an interrupted evaluation with samples=2 \(this command: 3\)"):
        evaluate_model(_cfg(tiny_qwen2, [bench], out, **{**kwargs, "generation.samples": 3}),
                       generator=_FailsSecond(generator))  # fmt: skip
    again = _FailsSecond(generator)
    again.calls = 2  # fails no more
    summary = evaluate_model(_cfg(tiny_qwen2, [bench], out, **kwargs), generator=again)
    assert again.calls == 3 and [(r.problems, r.samples) for r in summary.rows] == [(4, 2)]  # one chunk was left
