"""The command line (:mod:`nemo_disco.cli`): the demo's end-of-run summary (held-out pass@1 before and after RL, the
paired gain, their standard errors), `--version`, the help texts and the one-line errors of each subcommand."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_disco import cli, config

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"
# Per-problem pass@1 of 4 problems (4 samples each) at steps 0, 10 and 20.
BEFORE = [0.0, 0.25, 0.5, 1.0]  # mean 1.75 / 4 = 0.4375
MIDDLE = [0.0, 0.0, 0.0, 0.0]  # ignored: before is the first record, after the last
AFTER = [0.5, 0.25, 1.0, 1.0]  # mean 2.75 / 4 = 0.6875


def _run_dir(tmp_path: Path, warmup: dict | None) -> Path:
    run = tmp_path / "run"
    (run / "init_model").mkdir(parents=True)
    vals = [(0, BEFORE), (10, MIDDLE), (20, AFTER)]
    (run / "validation.jsonl").write_text("".join(json.dumps({"step": s, "per_problem": v}) + "\n" for s, v in vals))
    metrics = [{"step": s, "val/pass@1": sum(v) / 4, "train/reward_mean": 0.5} for s, v in vals]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if warmup is not None:
        (run / "init_model" / "warmup.json").write_text(json.dumps(warmup))
    return run


def test_summary_hand_computed(tmp_path):
    s = cli.validation_summary(_run_dir(tmp_path, None))
    assert s["step_before"] == 0 and s["step_after"] == 20 and s["problems"] == 4
    assert s["accuracy_before"] == 0.4375 and s["accuracy_after"] == 0.6875
    # before: deviations -0.4375, -0.1875, 0.0625, 0.5625; squares sum 0.19140625 + 0.03515625 + 0.00390625
    # + 0.31640625 = 0.546875; sample variance 0.546875 / 3; se = sqrt(variance / 4)
    assert s["accuracy_before_se"] == pytest.approx(math.sqrt(0.546875 / 3 / 4))
    # gain paired by problem: differences 0.5, 0, 0.5, 0 -> mean 0.25; variance 4 x 0.0625 / 3; se sqrt(var / 4)
    assert s["gain"] == 0.25
    assert s["gain_se"] == pytest.approx(math.sqrt(0.25 / 3 / 4))  # 0.1443
    assert s["gain_se"] < math.hypot(s["accuracy_before_se"], s["accuracy_after_se"])  # pairing helps


def test_no_validation_no_summary(tmp_path):
    assert cli.validation_summary(tmp_path) is None


def test_report_prints_the_gain_and_writes_demo_json(tmp_path, capsys):
    warmup = {"status": "in_band", "steps": 600, "accuracy": 0.42, "message": "warm-up: held-out greedy accuracy 0.420"}
    run = _run_dir(tmp_path, warmup)
    cfg = config.load(RECIPE, [f"logging.run_dir={run}", "loss.name=grpo"])
    cli._report(cfg)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == warmup["message"]
    assert out[1] == "held-out pass@1 on 4 problems x 4 samples (+- one standard error):"
    assert out[2] == "  before RL (step 0): 0.438 +- 0.213"  # se sqrt(0.546875 / 12) = 0.2135
    # after: deviations -0.1875, -0.4375, 0.3125, 0.3125; squares sum 0.421875; se sqrt(0.421875 / 12) = 0.1875
    assert out[3] == "  after RL (step 20): 0.688 +- 0.188"
    assert out[4] == "  gain: +0.250 +- 0.144 (paired by problem: 1.7 standard errors)"  # 0.25 / 0.1443 = 1.73
    assert out[5].startswith("curves: ") and (run / "curves.png").is_file()
    demo = json.loads((run / "demo.json").read_text())
    assert demo["accuracy_before"] == 0.4375 and demo["accuracy_after"] == 0.6875 and demo["gain"] == 0.25
    assert demo["steps"] == 20 and demo["samples"] == 4 and demo["loss"] == "grpo" and demo["warmup"] == warmup


def test_a_run_from_a_given_model_writes_no_demo_json(tmp_path, capsys):
    run = _run_dir(tmp_path, None)
    cfg = config.load(RECIPE, [f"logging.run_dir={run}", f"policy.model_path={tmp_path}"])
    cli._report(cfg)
    assert "gain: +0.250" in capsys.readouterr().out
    assert not (run / "demo.json").exists()


def test_output_folders_that_cannot_be_written_fail_in_one_line(tiny_qwen2, tmp_path, capsys):
    """Every command that writes: exit code 2 and one line naming the path, before any work.

    Root ignores permission bits, so the unwritable place is below a regular file (ENOTDIR for everyone).
    """
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    bad = blocker / "out"
    recipe = str(RECIPE)
    commands = {
        "train": ["train", "--config", recipe, f"logging.run_dir={bad}"],
        "convert": ["convert", "--from-hf", str(tiny_qwen2), "--out", str(bad)],
        "eval": ["eval", "--model", str(tiny_qwen2), "--backend", "hf", "--benchmarks", "aime", "--out", str(bad)],
        "data prepare": ["data", "prepare", "deepscaler", "--out", str(bad / "d.jsonl")],
        "plot": ["plot", str(tmp_path), "--out", str(bad / "curves.png")],
    }
    for name, argv in commands.items():
        assert cli.main(argv) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"nemo-disco {name}: error: cannot write"), (name, err)
        assert str(bad) in err[0] and str(blocker) in err[0], (name, err)


def test_benchmark_lists_accept_spaces_and_version(tmp_path, capsys):
    assert cli._names(" aime, math ,,amc") == ["aime", "math", "amc"]
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("nemo-disco 0.")
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["eval"].format_help()
    for flag in ("--samples", "--temperature", "--top-p", "--max-tokens", "--backend", "--grader", "--seed", "--out"):
        assert flag in help_text
    assert help_text.count("default:") >= 12


ASYNC_ONE_MACHINE = ["algorithm.async_rollouts=true", "cluster.generation_gpus_per_node=1"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")


@pytest.fixture
def bare_env(monkeypatch):
    """No launcher and no OpenMP settings in the environment; torch's thread count restored afterwards."""
    import torch

    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(threads)


def test_async_without_a_launcher_gives_the_trainer_every_core_and_each_generator_its_share(bare_env):
    import torch

    cfg = config.load(str(RECIPE), ASYNC_ONE_MACHINE)
    cores = cli.usable_cores()
    assert cli._share_cores(cfg) == {"OMP_WAIT_POLICY": "passive", "OMP_NUM_THREADS": str(max(1, cores // 2))}
    assert (os.environ["OMP_NUM_THREADS"], os.environ["OMP_WAIT_POLICY"]) == (str(cores), "passive")
    assert torch.get_num_threads() == cores  # torch was loaded already here: the count still applies


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is a Linux call")
def test_the_cores_shared_are_those_the_process_may_run_on(tmp_path):
    """A process pinned to one core (taskset, a Slurm step, a container) shares that core, not the machine's."""
    code = (
        "import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
        "from nemo_disco import cli, config; print(cli.usable_cores(), os.cpu_count());"
        f"print(cli._share_cores(config.load({str(RECIPE)!r}, {ASYNC_ONE_MACHINE!r})), os.environ['OMP_NUM_THREADS'])"
    )
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    cores, shares = out.splitlines()
    assert cores == f"1 {os.cpu_count()}"  # one core usable on a machine of more
    assert shares == "{'OMP_WAIT_POLICY': 'passive', 'OMP_NUM_THREADS': '1'} 1"


def test_the_users_openmp_settings_and_launched_or_synchronous_runs_are_left_alone(bare_env):
    bare_env.setenv("OMP_NUM_THREADS", "3")
    assert cli._share_cores(config.load(str(RECIPE), ASYNC_ONE_MACHINE)) == {"OMP_WAIT_POLICY": "passive"}
    assert os.environ["OMP_NUM_THREADS"] == "3"
    bare_env.setenv("OMP_WAIT_POLICY", "active")
    assert cli._share_cores(config.load(str(RECIPE), ASYNC_ONE_MACHINE)) == {}
    assert os.environ["OMP_WAIT_POLICY"] == "active"
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):
        bare_env.delenv(name)
    assert cli._share_cores(config.load(str(RECIPE), [])) == {}  # synchronous: OpenMP's defaults
    bare_env.setenv("RANK", "0")
    bare_env.setenv("WORLD_SIZE", "2")  # torchrun started the generator's rank: nothing to share here
    assert cli._share_cores(config.load(str(RECIPE), ASYNC_ONE_MACHINE)) == {}
    assert "OMP_NUM_THREADS" not in os.environ and "OMP_WAIT_POLICY" not in os.environ


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--temperature", "-1"], "--temperature -1.0: must be greater than 0 (as generation.temperature in a recipe)"),
        (["--top-p", "2"], "--top-p 2.0: must be less than or equal to 1 (as generation.top_p in a recipe)"),
        (["--max-tokens", "0"], "--max-tokens 0: must be greater than or equal to 1 (as generation.max_response_"),
        (["--tp", "0"], "--tp 0: must be greater than or equal to 1 (as generation.tensor_parallel_size in a recipe)"),
        (["--workers", "0"], "--workers 0: must be greater than or equal to 1 (as reward.workers in a recipe)"),
        (["--max-problems", "0"], "--max-problems 0: must be greater than or equal to 1 (as data.max_problems in a "),
        (["--chunk-problems", "0"], "--chunk-problems 0: must be greater than or equal to 1 (as generation.chunk_prob"),
        (["--bootstrap", "-1"], "--bootstrap -1: must be greater than or equal to 0 (as bootstrap.replicates in a "),
    ],
)
def test_eval_refuses_what_training_refuses_before_any_work(tiny_qwen2, tmp_path, capsys, argv, line):
    """The ranges are the keys' own (config.check_value on config.EvalConfig, whose sampling keys take training's
    ranges); nothing is generated or written."""
    out = tmp_path / "out"
    base = ["eval", "--model", str(tiny_qwen2), "--backend", "hf", "--benchmarks", "aime", "--max-problems", "1"]
    assert cli.main([*base, "--samples", "1", "--max-tokens", "2", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"nemo-disco eval: error: {line}"), err
    assert not out.exists()


def test_eval_and_training_share_their_ranges():
    """A value training refuses is refused by eval in the same words, and one it takes is taken."""
    with pytest.raises(config.ConfigError, match=r"^generation.temperature=-1: Input should be greater than 0$"):
        config.load(str(RECIPE), ["generation.temperature=-1"])
    assert config.check_value("generation.temperature", 0.6, "--temperature") == 0.6
    assert config.check_value("data.val_max_problems", None, "--max-problems") is None


# ----------------------------------------------------------------------------------------------------------------------
# eval's backend: auto by default, a missing vLLM named in one line


def _tiny_eval(tiny_qwen2, tmp_path, *argv: str) -> list[str]:
    bench = tmp_path / "arith.json"
    bench.write_text(json.dumps([{"problem": "1+1", "answer": 2}, {"problem": "2+5", "answer": 7}]))
    small = ["--samples", "1", "--max-tokens", "2", "--workers", "1", "--bootstrap", "0", "--no-chat-template"]
    return [
        "eval",
        "--model",
        str(tiny_qwen2),
        "--benchmarks",
        str(bench),
        *small,
        "--out",
        str(tmp_path / "out"),
        *argv,
    ]


def test_eval_without_vllm_picks_the_transformers_backend_by_default_and_says_so(
    tiny_qwen2, tmp_path, capsys, monkeypatch
):
    from nemo_disco.generation import factory

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as where it is not installed
    assert cli.main(_tiny_eval(tiny_qwen2, tmp_path)) == 0
    err = capsys.readouterr().err
    assert err.count("evaluation backend:") == 1 and "evaluation backend: hf (auto: vLLM is not installed)\n" in err
    assert (tmp_path / "out" / "responses.jsonl").is_file()
    assert json.loads((tmp_path / "out" / "summary.json").read_text())  # a finished result
    # Where vLLM imports and finds a device, auto is vLLM; hf asked for is hf without looking for vLLM.
    monkeypatch.setattr(factory, "vllm_problem", lambda: None)
    assert factory.choose_backend("auto") == ("vllm", "auto: vLLM is usable here")
    monkeypatch.setattr(factory, "vllm_problem", lambda: pytest.fail("hf needs no vLLM probe"))
    assert factory.choose_backend("hf") == ("hf", "asked for")
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["eval"].format_help()
    assert "(default: auto)" in " ".join(help_text.split())


def test_eval_with_vllm_asked_for_where_it_is_missing_fails_in_one_line_before_any_work(
    tiny_qwen2, tmp_path, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as where it is not installed
    assert cli.main(_tiny_eval(tiny_qwen2, tmp_path, "--backend", "vllm")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("nemo-disco eval: error: --backend vllm: vLLM is not installed (") and "--backend hf" in err
    assert not (tmp_path / "out").exists()  # nothing written: no partial/ to refuse the --backend hf retry
    assert cli.main(_tiny_eval(tiny_qwen2, tmp_path, "--backend", "hf")) == 0


def test_the_real_probe_names_a_missing_vllm():
    """In this environment (tests run without vLLM; .venv-vllm has it): the probe agrees with the import."""
    import importlib.util

    from nemo_disco.generation import factory

    if importlib.util.find_spec("vllm.sampling_params") is None:
        assert factory.vllm_problem() == "vLLM is not installed"  # tests/vllm, a folder on the path, is not it
        assert factory.choose_backend("auto")[0] == "hf"
        with pytest.raises(config.ConfigError, match=r"^--backend vllm: vLLM is not installed \("):
            factory.choose_backend("vllm")


# ----------------------------------------------------------------------------------------------------------------------
# eval --responses: the benchmarks come from the results


def _synthetic_results(folder: Path) -> Path:
    """A results folder as the demo's eval writes it: synthetic:arithmetic-heldout records, graded."""
    from nemo_disco.evaluation.records import benchmark_problems

    problems = benchmark_problems("synthetic:arithmetic-heldout")[:3]
    records = [
        {"benchmark": "synthetic:arithmetic-heldout", "problem_index": p.index, "sample_index": j,
         "response": str(p.answer) if j == 0 else "no", "score": 1.0 if j == 0 else 0.0, "answer": p.answer,
         "finish_reason": "stop", "response_tokens": 3}
        for p in problems for j in range(2)
    ]  # fmt: skip
    folder.mkdir(parents=True)
    (folder / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_eval_responses_of_the_demo_need_no_benchmarks_flag(tmp_path, capsys):
    results = _synthetic_results(tmp_path / "tiny-cpu" / "eval")
    assert cli.main(["eval", "--responses", str(results), "--bootstrap", "0", "--out", str(tmp_path / "again")]) == 0
    assert "| synthetic:arithmetic-heldout | 3 | 2 | 50.00 " in capsys.readouterr().out
    # Re-graded: the gold answers come from the benchmark the records name.
    argv = ["eval", "--responses", str(results), "--regrade", "--workers", "1", "--bootstrap", "0"]
    assert cli.main([*argv, "--out", str(tmp_path / "regraded")]) == 0
    summary = json.loads((tmp_path / "regraded" / "summary.json").read_text())
    assert "synthetic:arithmetic-heldout" in json.dumps(summary) and "50.0" in capsys.readouterr().out
    # Several results, none with --benchmarks: the mean and spread across them.
    other = _synthetic_results(tmp_path / "tiny-grpo" / "eval2")
    assert cli.main(["eval", "--responses", str(results), str(other), "--bootstrap", "0",
                     "--out", str(tmp_path / "runs")]) == 0  # fmt: skip
    assert (tmp_path / "runs" / "runs.md").is_file()
    capsys.readouterr()
    assert cli.main(["eval", "--responses", str(results), "--benchmarks", " , ", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == "nemo-disco eval: error: --benchmarks ' , ': no benchmark named\n"


def test_eval_responses_that_name_a_benchmark_file_to_regrade_ask_for_it_in_one_line(tmp_path, capsys):
    results = tmp_path / "res"
    results.mkdir()
    record = {"benchmark": "arith", "problem_index": 0, "sample_index": 0, "response": "2"}
    (results / "responses.jsonl").write_text(json.dumps(record) + "\n")
    assert cli.main(["eval", "--responses", str(results), "--workers", "1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{results / 'responses.jsonl'}:1: benchmark 'arith'" in err, err
    assert err.rstrip().endswith("name its file with --benchmarks"), err
    bench = tmp_path / "arith.json"
    bench.write_text(json.dumps([{"problem": "1+1", "answer": 2}]))
    assert cli.main(["eval", "--responses", str(results), "--benchmarks", str(bench), "--workers", "1",
                     "--bootstrap", "0", "--out", str(tmp_path / "o")]) == 0  # fmt: skip


@pytest.mark.parametrize("flag", ["--tp", "--pp"])
def test_convert_refuses_a_layout_of_zero_instead_of_writing_one(tiny_qwen2, tmp_path, capsys, flag):
    out = tmp_path / "mcore"
    assert cli.main(["convert", "--from-hf", str(tiny_qwen2), "--out", str(out), flag, "0"]) == 2
    key = {"--tp": "policy.tensor_parallel_size", "--pp": "policy.pipeline_parallel_size"}[flag]
    err = capsys.readouterr().err
    assert err == f"nemo-disco convert: error: {flag} 0: must be greater than or equal to 1 (as {key} in a recipe)\n"
    assert not out.exists()


def _torchrun(tmp_path: Path, nproc: int, recipe: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node N -m nemo_disco.cli train`` in a session of its own (killed whole on timeout)."""
    from procs import free_port, run_group

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-port", str(free_port()), "-m", "nemo_disco.cli", "train", "--config", str(recipe)]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env = {**env, "OMP_NUM_THREADS": "1"}
    return run_group([*cmd, f"logging.run_dir={tmp_path / 'run'}"], timeout=timeout, env=env, cwd=RECIPE.parents[1])


def test_an_async_recipe_launched_as_one_process_is_refused_instead_of_hanging(tmp_path):
    """torchrun's one process used to start the generator itself and wait for ever on torchrun's rendezvous."""
    res = _torchrun(tmp_path, 1, RECIPE.with_name("tiny-cpu-async.yaml"))
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if line.startswith("nemo-disco train: error: ")]
    assert lines == [
        "nemo-disco train: error: the launcher started 1 process(es) but the recipe expects 1 for the trainer + 1 "
        "for the generator (cluster.* with algorithm.async_rollouts=true): run torchrun --nproc-per-node 2 -m "
        "nemo_disco.cli train ... or no launcher at all (the trainer then starts the generator's processes itself)"
    ]
    assert "asynchronous run without a launcher" not in res.stderr
    assert not (tmp_path / "run").exists()


def test_a_world_size_the_recipe_does_not_allow_is_said_once_by_process_zero(tmp_path):
    res = _torchrun(tmp_path, 2, RECIPE)
    both = res.stdout + res.stderr
    assert both.count("nemo-disco train: error:") == 1, both
    assert (
        "nemo-disco train: error: the launcher started 2 process(es) but the recipe expects cluster.nodes x "
        "cluster.gpus_per_node = 1 x 1 = 1: run torchrun --nproc-per-node 1 -m nemo_disco.cli train ...\n"
    ) in res.stderr


def test_launch_ranks_other_than_zero_leave_a_job_wide_error_to_process_zero(bare_env, capsys):
    bare_env.setattr(cli, "JOB_ERROR_GRACE_S", 0.0)
    bare_env.setenv("RANK", "1")
    bare_env.setenv("WORLD_SIZE", "2")
    assert cli.main(["train", "--config", str(RECIPE), "policy.lrr=1"]) == 2
    assert capsys.readouterr().err == ""
    bare_env.setenv("RANK", "0")
    assert cli.main(["train", "--config", str(RECIPE), "policy.lrr=1"]) == 2
    assert capsys.readouterr().err.startswith("nemo-disco train: error: unknown config key 'policy.lrr'")


def test_plot_names_a_label_count_that_differs_from_the_runs(tmp_path, capsys):
    runs = [_run_dir(tmp_path / name, None) for name in ("a", "b")]
    out = tmp_path / "curves.png"
    assert cli.main(["plot", *map(str, runs), "--labels", "x,y,z", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"nemo-disco plot: error: --labels 'x,y,z' has 3 names for 2 results ({runs[0]}, {runs[1]})\n"
    assert not out.exists()


def test_convert_silences_megatron_cores_full_scope_warning_only(monkeypatch):
    import warnings

    from nemo_disco import convert

    def noisy(*args, **kwargs):
        warnings.warn("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.", stacklevel=1)
        warnings.warn("something else", stacklevel=1)
        return "config"

    monkeypatch.setattr(convert.mm, "transformer_config", noisy)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert convert._transformer_config(None, tp=1, pp=1, dtype=None) == "config"
    assert [str(w.message) for w in seen] == ["something else"]


@pytest.fixture()
def small_out(tmp_path):
    """An 8 KiB tmpfs for --out (two pages: settings.json and the first page of records fit, the rest does not)."""
    from procs import tmpfs

    with tmpfs(tmp_path / "out", "8k") as mnt:
        yield mnt


def test_eval_on_a_full_disk_names_the_file_and_keeps_the_responses_for_a_rerun(
    tiny_qwen2, tmp_path, capsys, small_out
):
    """It used to say ``[Errno 28] No space left on device`` and nothing of which file, or of what was kept."""
    bench = tmp_path / "arith.json"
    bench.write_text(json.dumps([{"problem": f"{a}+{a}", "answer": 2 * a} for a in range(40)]))
    argv = ["eval", "--model", str(tiny_qwen2), "--benchmarks", str(bench), "--samples", "1", "--max-tokens", "2",
            "--workers", "1", "--bootstrap", "0", "--no-chat-template", "--chunk-problems", "4", "--backend", "hf",
            "--out", str(small_out)]  # fmt: skip
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    partial = small_out / "partial"
    assert err.startswith(
        f"nemo-disco eval: error: cannot write {partial / 'part-0.jsonl'}: No space left on device ("
    ), err
    assert f"MiB on {partial}); the responses written so far are kept in {partial}: make room and rerun" in err
    written = len((partial / "part-0.jsonl").read_text().splitlines())
    assert written >= 4  # at least the first chunk
    # Room is made (here: the file system grows); the same command continues from the chunks written.
    subprocess.run(["mount", "-o", "remount,size=1m", str(small_out)], check=True)
    assert cli.main(argv) == 0
    assert f"resuming the evaluation in {small_out}: " in capsys.readouterr().err
    assert len((small_out / "responses.jsonl").read_text().splitlines()) == 40


# ----------------------------------------------------------------------------------------------------------------------
# eval configured like training: recipes/eval/*.yaml, key=value overrides, flags as shorthands for keys

EVAL_RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes" / "eval").glob("*.yaml"))


def _eval_config(capsys, *argv: str) -> dict:
    """``eval ... --print-config``: the resolved config, read back."""
    import yaml

    assert cli.main(["eval", *argv, "--print-config"]) == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("recipe", EVAL_RECIPES, ids=lambda p: p.stem)
def test_each_shipped_eval_recipe_prints_its_resolved_config(recipe, capsys):
    import yaml

    printed = _eval_config(capsys, "--config", str(recipe))
    assert config.EvalConfig.model_validate(printed) == config.load_eval(recipe)  # every key, validated
    stated = yaml.safe_load(recipe.read_text())
    for section, values in stated.items():  # what the recipe states is what is printed
        for key, value in values.items():
            assert printed[section][key] == value, f"{section}.{key}"


def test_the_paper_and_demo_eval_recipes_hold_their_protocols(capsys):
    paper = config.load_eval(EVAL_RECIPES[[p.stem for p in EVAL_RECIPES].index("paper")])
    g = paper.generation
    assert (g.samples, g.temperature, g.top_p, g.max_response_tokens, g.max_prompt_tokens) == (
        16,
        0.6,
        0.95,
        8192,
        1536,
    )
    assert paper.benchmark_names == list(config.PAPER_BENCHMARKS)
    # The demo's: its validation (recipes/tiny-cpu.yaml) measures with these settings.
    demo = config.load_eval(EVAL_RECIPES[[p.stem for p in EVAL_RECIPES].index("demo")])
    tiny = config.load(RECIPE)
    assert demo.benchmark_names == [tiny.data.val] and demo.data.max_problems == tiny.data.val_max_problems
    assert (
        demo.generation.samples == tiny.data.val_samples and demo.generation.temperature == tiny.generation.temperature
    )
    assert (demo.data.prompt_template, demo.data.use_chat_template) == (tiny.data.prompt_template, False)
    assert demo.generation.max_response_tokens == tiny.generation.max_response_tokens
    assert demo.generation.max_prompt_tokens == tiny.generation.max_prompt_tokens


def test_a_bad_key_or_value_in_an_eval_recipe_is_one_line_naming_file_and_line(tmp_path, capsys):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("defaults:\n  - paper\n  - _self_\n\ngeneration:\n  samples: 4\n  top_p: 2\n")
    assert cli.main(["eval", "--config", str(recipe), "--print-config"]) == 2
    assert capsys.readouterr().err == (
        f"nemo-disco eval: error: {recipe}:7: generation.top_p=2: Input should be less than or equal to 1\n"
    )
    recipe.write_text("defaults:\n  - paper\n  - _self_\n\ngeneration:\n  samplez: 4\n")
    assert cli.main(["eval", "--config", str(recipe), "--model", "m"]) == 2
    unknown = "unknown config key 'generation.samplez' (did you mean generation.samples?)"
    assert capsys.readouterr().err == f"nemo-disco eval: error: {recipe}:6: {unknown}\n"
    # The same value on the command line names the override, not the file.
    assert cli.main(["eval", "--config", str(EVAL_RECIPES[0]), "generation.top_p=2", "--print-config"]) == 2
    assert (
        capsys.readouterr().err
        == "nemo-disco eval: error: generation.top_p=2: Input should be less than or equal to 1\n"
    )
    assert cli.main(["eval", "generation.temprature=1", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown config key 'generation.temprature'" in err and "temperature?" in err


# A value for every flag that stands for a key, and that key's value in an override.
FLAG_VALUES = {
    "model": ("m/x", "m/x"),
    "out": ("o", "o"),
    "benchmarks": ("aime, math", "[aime,math]"),
    "max_problems": ("3", "3"),
    "prompt_template": ("Q: {problem}", "'Q: {problem}'"),
    "no_chat_template": (None, "false"),
    "chat_template_kwargs": ('{"enable_thinking": true}', "{enable_thinking:true}"),
    "backend": ("hf", "hf"),
    "samples": ("4", "4"),
    "temperature": ("1.0", "1.0"),
    "top_p": ("0.5", "0.5"),
    "max_tokens": ("12", "12"),
    "max_prompt_tokens": ("32", "32"),
    "seed": ("7", "7"),
    "chunk_problems": ("5", "5"),
    "tp": ("2", "2"),
    "gpu_memory_utilization": ("0.5", "0.5"),
    "enforce_eager": (None, "true"),
    "grader": ("deepscaler", "deepscaler"),
    "timeout": ("9", "9"),
    "workers": ("3", "3"),
    "bootstrap": ("10", "10"),
    "bootstrap_seed": ("5", "5"),
    "bootstrap_problems_only": (None, "false"),
}


@pytest.mark.parametrize("attr", sorted(set(cli.EVAL_FLAGS) - {"run", "checkpoint"}))
def test_each_eval_flag_is_its_key(attr, capsys):
    """A flag gives the config its key=value gives; both given must agree (the same value: taken; another: refused)."""
    flag_value, key_value = FLAG_VALUES[attr]
    key, flag = cli.EVAL_FLAGS[attr], "--" + attr.replace("_", "-")
    as_flag = [flag] if flag_value is None else [flag, flag_value]
    by_flag = _eval_config(capsys, *as_flag)
    by_key = _eval_config(capsys, f"{key}={key_value}")
    assert by_flag == by_key != _eval_config(capsys)
    assert _eval_config(capsys, *as_flag, f"{key}={key_value}") == by_key
    if key not in ("data.use_chat_template", "generation.enforce_eager", "bootstrap.resample_samples"):
        assert cli.main(["eval", *as_flag, f"{key}=0.125", "--print-config"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"nemo-disco eval: error: {flag} ") and "set the same key to two values" in err


def test_eval_defaults_live_in_the_schema_only():
    """The flags default to None (not given: the key's default); evaluate_model takes the config: one place."""
    import inspect

    from nemo_disco.evaluation.run import evaluate_model

    parser = cli.build_parser()._subparsers._group_actions[0].choices["eval"]
    defaults = {a.dest: a.default for a in parser._actions}
    assert {attr: defaults[attr] for attr in cli.EVAL_FLAGS} == dict.fromkeys(cli.EVAL_FLAGS)
    assert list(inspect.signature(evaluate_model).parameters) == ["cfg", "model_dir", "generator", "overwrite"]
    # The help shows the schema's defaults; grading's are training's reward keys.
    help_text = " ".join(parser.format_help().split())
    assert (
        "(default: 1536) [generation.max_prompt_tokens]" in help_text
        and "(default: 0.95) [generation.top_p]" in help_text
    )
    reward, grading = config.RewardConfig(), config.EvalConfig().reward
    assert (grading.grader, grading.timeout_s, grading.workers) == (reward.grader, reward.timeout_s, reward.workers)
    data = cli.build_parser()._subparsers._group_actions[0].choices["data"]
    prepare = {a.dest: a.default for a in data._subparsers._group_actions[0].choices["prepare"]._actions}
    assert (prepare["workers"], prepare["timeout"]) == (reward.workers, reward.timeout_s)
