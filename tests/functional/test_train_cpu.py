"""Tiny end-to-end runs of the trainer on CPU, checked against metric thresholds (real components throughout)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from procs import FAST_TINY, THREADS
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"
REQUIRED = (
    "train/reward_mean",
    "train/entropy",
    "train/kl",
    "train/constraint_active",
    "train/objective",
    "train/zero_variance_share",
    "train/response_length_mean",
    "timing/step",
    "timing/generate",
    "timing/train",
    "timing/refit",
    "mismatch/kl_k3",
    "mismatch/max_abs_logprob_diff",
)


def _env() -> dict[str, str]:
    return {**os.environ, **THREADS, "PYTHONUNBUFFERED": "1"}


def _train(run_dir: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), f"logging.run_dir={run_dir}"]
    return subprocess.run(
        cmd + FAST_TINY + list(overrides), capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=timeout
    )


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in records]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


DAPO_DATA_SIDE = [
    "loss.clip_eps_high=0.28",
    "algorithm.dynamic_sampling=true",
    "algorithm.max_sampling_rounds=2",
    "algorithm.overlong_buffer_tokens=4",
]


GPG_SAMPLER = ["algorithm.dynamic_sampling=true", "algorithm.min_valid_share=0.6", "algorithm.max_sampling_rounds=2"]


@pytest.mark.parametrize(
    ("loss", "extra"),
    [
        ("disco", []),
        ("drpo", []),  # DisCO's coupling: the same update plan
        ("grpo", []),
        ("dapo", DAPO_DATA_SIDE),
        ("gpg", GPG_SAMPLER),
        ("trpa", []),  # builds the forward-only reference policy
        ("grpo", ["loss.kl_coef=0.001"]),  # the GRPO family's KL regulariser: the reference policy too
    ],
)
def test_three_steps_metrics_finite_and_parameters_change(tmp_path, loss, extra):
    run = tmp_path / loss
    res = _train(run, "algorithm.steps=3", f"loss.name={loss}", "checkpoint.save_every=3", *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    records = _metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for key in REQUIRED:
            assert key in r, key
            assert r[key] is not None and math.isfinite(r[key]), (key, r[key])
        # Overlong shaping subtracts up to overlong_penalty (1.0) from a {0, 1} reward.
        assert (-1.0 if extra == DAPO_DATA_SIDE else 0.0) <= r["train/reward_mean"] <= 1.0
        assert r["timing/generate"] + r["timing/train"] <= r["timing/step"] + 1e-6
        # Transformers generator and policy, both fp32: the rollout/training mismatch is ~0.
        assert r["mismatch/max_abs_logprob_diff"] < 1e-3
        # 2 updates per step of whole questions, forwards in units of the step's batch: the first update in one
        # pass (it makes its own old log-probs: the no-grad forward covers the second mini-batch only, 1/2);
        # DisCO's KL hinge couples the second update's mini-batch (two passes), the others' coefficients do not.
        hinge = loss in ("disco", "drpo")
        assert r["update/one_pass_updates"] == (1 if hinge else 2)
        assert r["update/forward_passes"] == 0.5 + 0.5 + (1.0 if hinge else 0.5)
    init = _weights(run / "init_model")
    final = _weights(run / "checkpoints" / "step_3" / "policy")
    changed = [k for k in init if not torch.equal(init[k], final[k])]
    assert len(changed) >= len(init) // 2, "most parameter tensors should move"
    saved = (run / "checkpoints" / "step_3" / "config.yaml").read_text()
    assert f"name: {loss}" in saved
    if "algorithm.dynamic_sampling=true" in extra:  # dynamic sampling ran (1 or 2 rounds)
        assert all(r["train/sampling_rounds"] in (1.0, 2.0) for r in records)
        # A step stops after one round only when the target share of informative questions was reached.
        target = 0.6 if extra == GPG_SAMPLER else 1.0
        assert all(r["train/informative_share"] >= target for r in records if r["train/sampling_rounds"] == 1.0)
    if extra == DAPO_DATA_SIDE:  # overlong shaping penalised long responses
        assert any(r["train/reward_mean"] < 0 for r in records)


def test_plot_overlays_runs(tmp_path):
    """`nemo-disco plot` writes one PNG with several runs overlaid; a run without metrics is one clear line."""
    import shutil

    for name, shift in (("a", 0.0), ("b", 0.1)):
        d = tmp_path / name
        d.mkdir()
        lines = [{"step": s, "train/reward_mean": 0.2 + shift + 0.01 * s, "train/kl": 1e-5} for s in range(1, 6)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "both.png"
    cmd = [sys.executable, "-m", "nemo_disco.cli", "plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    shutil.rmtree(tmp_path / "b")
    (tmp_path / "b").mkdir()
    bad = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "no metrics.jsonl records" in bad.stderr and bad.stderr.count("\n") == 1


def test_plot_of_several_runs_goes_to_its_own_file_and_says_where(tmp_path):
    """Without --out, `plot A B` writes compare-A-B.png in the current folder; A's own curves.png is not replaced."""
    for name in ("a", "b"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        lines = [{"step": s, "train/reward_mean": 0.1 * s, "train/kl": 1e-5} for s in range(1, 4)]
        (tmp_path / "runs" / name / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    own = tmp_path / "runs" / "a" / "curves.png"
    own.write_bytes(b"the run's own plot")
    cmd = [sys.executable, "-m", "nemo_disco.cli", "plot", "runs/a", "runs/b"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "wrote compare-a-b.png (training curves of runs/a, runs/b)\n"
    assert (tmp_path / "compare-a-b.png").read_bytes()[:4] == b"\x89PNG"
    assert own.read_bytes() == b"the run's own plot"
    one = subprocess.run(cmd[:-1], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert one.returncode == 0 and one.stdout.startswith("wrote runs/a/curves.png")
    assert own.read_bytes()[:4] == b"\x89PNG"


def test_sigkill_at_a_random_step_then_resume_is_bit_exact(tmp_path):
    steps = ["algorithm.steps=5", "checkpoint.save_every=1", "checkpoint.keep_last=5"]
    ref = tmp_path / "ref"
    res = _train(ref, *steps)
    assert res.returncode == 0, res.stderr[-3000:]
    expected = _comparable(_metrics(ref))

    run = tmp_path / "killed"
    kill_after = random.Random(os.getpid()).randint(1, 3)
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), f"logging.run_dir={run}"]
    proc = subprocess.Popen(
        cmd + FAST_TINY + steps, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 600
    while time.time() < deadline:
        ckpts = list((run / "checkpoints").glob("step_*")) if (run / "checkpoints").is_dir() else []
        if any(p.name == f"step_{kill_after}" for p in ckpts):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    res = _train(run, *steps)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout + res.stderr
    assert _comparable(_metrics(run)) == expected


def test_sigterm_saves_a_checkpoint_and_the_run_resumes(tmp_path):
    run = tmp_path / "term"
    # Enough steps that the run cannot finish between its first metrics line and the signal (a 4-step run could).
    total = 20
    steps = [f"algorithm.steps={total}", "checkpoint.save_every=0"]
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), f"logging.run_dir={run}"]
    proc = subprocess.Popen(
        cmd + FAST_TINY + steps, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.time() + 600
    while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and _metrics(run)):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    saved = sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and saved[0] < total
    res = _train(run, *steps)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["step"] for r in _metrics(run)] == list(range(1, total + 1))


def test_sigusr1_exits_with_the_requeue_code(tmp_path):
    run = tmp_path / "usr1"
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), f"logging.run_dir={run}"]
    proc = subprocess.Popen(
        cmd + FAST_TINY + ["algorithm.steps=50"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.time() + 600
    while time.time() < deadline and not (run / "metrics.jsonl").is_file():
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    proc.communicate(timeout=300)
    assert proc.returncode == 3
    assert list((run / "checkpoints").glob("step_*"))


def test_world_size_disagreeing_with_the_recipe_is_one_line(tmp_path):
    res = _train(tmp_path / "r", "cluster.gpus_per_node=2")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "cluster.nodes x cluster.gpus_per_node" in res.stderr


def test_warm_up_to_a_target_then_the_summary_with_standard_errors(tmp_path):
    """The demo's path at small sizes: warm-up until held-out greedy accuracy >= 0.2, per-problem validation at
    steps 0 and 2, and the summary (before, after, paired gain with standard errors) in stdout and demo.json."""
    from nemo_disco.stats import mean_se, paired_difference

    run = tmp_path / "demo"
    res = _train(
        run,
        "algorithm.steps=2",
        "checkpoint.save_every=0",
        "data.synthetic_size=2000",
        "data.val=synthetic:arithmetic-heldout",
        "data.val_every=2",
        "data.val_max_problems=32",
        "data.val_samples=4",
        "algorithm.warmup_target=[0.2,1.0]",
        "algorithm.warmup_sft_steps=1500",
        "algorithm.warmup_eval_every=50",
        "algorithm.warmup_eval_problems=64",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    warmup = json.loads((run / "init_model" / "warmup.json").read_text())
    assert warmup["status"] == "in_band" and warmup["accuracy"] >= 0.2 and warmup["problems"] == 64
    assert warmup["steps"] < 1500 and warmup["steps"] % 50 == 0
    assert warmup["message"] in res.stderr and warmup["message"] in res.stdout  # logged, then repeated at the end

    vals = [json.loads(x) for x in (run / "validation.jsonl").read_text().splitlines()]
    assert [v["step"] for v in vals] == [0, 2]
    metrics = {r["step"]: r for r in _metrics(run)}
    for v in vals:
        assert len(v["per_problem"]) == 32 and all((4 * x).is_integer() and 0 <= x <= 1 for x in v["per_problem"])
        mean, se = mean_se(v["per_problem"])
        assert (v["pass@1"], v["pass@1_se"]) == (mean, se)
        assert (metrics[v["step"]]["val/pass@1"], metrics[v["step"]]["val/pass@1_se"]) == (mean, se)
    assert vals[0]["pass@1"] > 0  # the warm-up left questions with correct samples

    demo = json.loads((run / "demo.json").read_text())
    gain, gain_se = paired_difference(vals[1]["per_problem"], vals[0]["per_problem"])
    assert demo["accuracy_before"] == vals[0]["pass@1"] and demo["accuracy_after"] == vals[1]["pass@1"]
    assert (demo["gain"], demo["gain_se"]) == (gain, gain_se)
    assert demo["problems"] == 32 and demo["samples"] == 4 and demo["warmup"] == warmup
    assert f"before RL (step 0): {vals[0]['pass@1']:.3f} +- {vals[0]['pass@1_se']:.3f}" in res.stdout
    assert "held-out pass@1 on 32 problems x 4 samples" in res.stdout


def test_a_second_run_reuses_the_warm_up_and_gives_the_same_figures(tmp_path):
    """Same tiny model, seed and warm-up settings: the second run (another run folder beside the first) loads the
    warmed-up model from runs' .warmup-cache instead of redoing it, and its RL figures equal the first run's."""
    steps = ["algorithm.steps=2", "checkpoint.save_every=0"]
    first = _train(tmp_path / "a", *steps)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "warm-up: up to 40 supervised updates" in first.stderr and "warm-up: 25/40 updates (" in first.stderr
    (entry,) = (tmp_path / ".warmup-cache").iterdir()
    assert f"warm-up: stored for reuse in {entry}" in first.stderr

    second = _train(tmp_path / "b", *steps)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"warm-up: reused {entry}" in second.stderr and "warm-up: up to" not in second.stderr
    assert _comparable(_metrics(tmp_path / "b")) == _comparable(_metrics(tmp_path / "a"))
    a, b = _weights(tmp_path / "a" / "init_model"), _weights(tmp_path / "b" / "init_model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    off = _train(tmp_path / "c", *steps, "algorithm.warmup_cache=false")
    assert off.returncode == 0, off.stderr[-3000:]
    assert "warm-up: up to 40 supervised updates" in off.stderr and "warmup-cache" not in off.stderr
    assert _comparable(_metrics(tmp_path / "c")) == _comparable(_metrics(tmp_path / "a"))


def test_training_with_a_user_reward_function_from_the_current_folder(tmp_path):
    # Any verifier as the reward: a function in the user's folder, given the row's extra columns; a bad path
    # stops the run at start-up in one line (exit 2).
    from nemo_disco.data import synthetic_arithmetic

    rows = [{"problem": p.problem, "answer": p.answer, "kind": "arithmetic"} for p in synthetic_arithmetic(200, 0)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "my_rewards.py").write_text(
        "import re\n\n\n"
        "def exact(response, answer, *, problem, kind):\n"
        "    assert kind == 'arithmetic' and '=' not in problem\n"
        "    found = re.findall(r'\\\\boxed\\{([^{}]*)\\}', response)\n"
        "    with open('calls.log', 'a') as f:\n"
        "        f.write(repr(response) + '\\n')\n"
        "    return 1.0 if found and found[-1].strip() == answer else 0.25 if found else 0.0  # answer, format\n"
    )
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), "logging.run_dir=run"]
    cmd += FAST_TINY + ["algorithm.steps=3", "data.train=rows.json", "reward.function=my_rewards:exact"]
    env = {**_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _metrics(tmp_path / "run")
    assert len(records) == 3
    assert all(r["reward/errors"] == 0 and r["reward/timeouts"] == 0 for r in records)
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == 3 * 8 * 4  # steps x prompts x rollouts, in the grading workers
    assert min(r["train/reward_mean"] for r in records) > 0  # the warmed-up model boxes its answers
    bad = subprocess.run(
        cmd[:-1] + ["reward.function=my_rewards:nope", "logging.run_dir=run2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "reward.function='my_rewards:nope': module 'my_rewards' has no attribute 'nope'" in bad.stderr


def test_failed_rewards_are_said_each_step_and_a_step_where_all_failed_stops_the_run(tmp_path):
    # Before: a function that raised on some items left no line per step, and one returning NaN trained to the
    # end with exit code 0 (every rollout a negative).
    (tmp_path / "flaky_rewards.py").write_text(
        "import zlib\n\n\n"
        "def some(response, answer, *, problem, **fields):\n"
        "    if zlib.crc32(response.encode()) % 3 == 0:\n"
        "        raise RuntimeError('cannot grade this one')\n"
        "    return 1.0 if answer in response else 0.0\n\n\n"
        "def nan(response, answer, *, problem, **fields):\n"
        "    return float('nan')\n"
    )
    fast = [o for o in FAST_TINY if not o.startswith("algorithm.warmup_sft_steps=")]
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), *fast]
    cmd += ["algorithm.warmup_sft_steps=0", "algorithm.steps=2"]
    env = {**_env(), "PYTHONPATH": str(ROOT)}

    def train(name: str, *extra: str) -> subprocess.CompletedProcess:
        more = [f"logging.run_dir=run_{name}", f"reward.function=flaky_rewards:{name}", *extra]
        return subprocess.run(cmd + more, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)

    # Validation before step 1 and after step 2, 8 problems x 2 samples, graded by the same function.
    val = ["data.val=synthetic:arithmetic-heldout", "data.val_every=2", "data.val_max_problems=8"]
    some = train("some", *val, "data.val_samples=2")
    assert some.returncode == 0, some.stderr[-3000:]
    records = [r for r in _metrics(tmp_path / "run_some") if r["step"] > 0]  # step 0: the first validation's
    said = [line for line in some.stdout.splitlines() if line.startswith("step ") and "reward errors" in line]
    assert said == [f"step {r['step']}: reward errors {r['reward/errors']:.0f}/32 (0 timeouts)" for r in records]
    assert all(0 < r["reward/errors"] < 32 and r["reward/failed_share"] == r["reward/errors"] / 32 for r in records)
    # Before: validation graded with failing rewards said nothing (they score 0: wrong answers, a lower pass@1).
    validations = [json.loads(line) for line in (tmp_path / "run_some" / "validation.jsonl").read_text().splitlines()]
    assert [v["step"] for v in validations] == [0, 2]
    assert all(0 < v["reward_failed"] < 16 for v in validations), validations
    said = [line for line in some.stdout.splitlines() if line.startswith("validation ")]
    assert said == [
        f"validation {when}: reward errors {v['reward_failed']}/16 (0 timeouts), counted as wrong"
        for when, v in zip(["before step 1", "after step 2"], validations, strict=True)
    ]
    nan = train("nan")
    assert nan.returncode == 2, nan.stderr[-3000:]
    assert nan.stderr.strip().splitlines()[-1] == (
        "nemo-disco train: error: step 1: reward errors 32/32 (0 timeouts): every reward failed, stopping; the first: "
        "reward.function flaky_rewards:nan failed on an item: ValueError: the reward function returned nan, expected "
        "a finite float"
    )
    assert not (tmp_path / "run_nan" / "metrics.jsonl").exists()  # no step was trained on NaN rewards


def _start(run: Path, *overrides: str) -> subprocess.Popen:
    """A training run in a session of its own (a terminal's Ctrl-C signals the whole foreground group)."""
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), f"logging.run_dir={run}"]
    return subprocess.Popen(
        cmd + FAST_TINY + list(overrides),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for_metrics(run: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + 600
    while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and _metrics(run)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)


def test_ctrl_c_saves_a_checkpoint_says_so_exits_130_and_the_run_resumes(tmp_path):
    run = tmp_path / "int"
    proc = _start(run, "algorithm.steps=50", "checkpoint.save_every=0")
    _wait_for_metrics(run, proc)
    os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the trainer and its grading workers
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    saved = sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and 1 <= saved[0] < 50, saved
    step = saved[0]
    assert f"nemo-disco: Ctrl-C: finishing step {step}, then saving a checkpoint and exiting (exit code 130)" in err
    assert f"nemo-disco: checkpoint saved after SIGINT: {run}/checkpoints/step_{step} (the same command resumes" in err
    assert "Traceback" not in err
    assert [r["step"] for r in _metrics(run)] == list(range(1, step + 1))
    res = _train(run, f"algorithm.steps={step + 2}", "checkpoint.save_every=0")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {run}/checkpoints/step_{step} (step {step})" in res.stdout
    assert [r["step"] for r in _metrics(run)] == list(range(1, step + 3))


def test_a_second_ctrl_c_stops_at_once_without_a_new_checkpoint(tmp_path):
    run = tmp_path / "int2"
    # Longer steps (64 questions) so that the second Ctrl-C lands inside the step the first one let finish.
    proc = _start(run, "algorithm.steps=50", "checkpoint.save_every=0", "algorithm.prompts_per_step=64")
    _wait_for_metrics(run, proc)
    os.killpg(proc.pid, signal.SIGINT)
    first = proc.stderr.readline()
    while first and "Ctrl-C: finishing step" not in first:
        first = proc.stderr.readline()
    assert "press Ctrl-C again to stop at once without one" in first
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "nemo-disco train: interrupted (Ctrl-C): stopped without a new checkpoint" in err
    assert "Traceback" not in err
    # No complete checkpoint; at most the interrupted save's step_N.tmp, which resume ignores.
    assert not [p for p in run.glob("checkpoints/step_*") if p.name.removeprefix("step_").isdigit()]


def test_the_last_step_is_validated_and_a_shorter_resume_warns(tmp_path):
    """algorithm.steps=3 with data.val_every=2: validations at steps 0, 2 and 3; the summary's "after" is step 3."""
    run = tmp_path / "val"
    val = ["data.val=synthetic:arithmetic-heldout", "data.val_every=2", "data.val_max_problems=8", "data.val_samples=2"]
    res = _train(run, "algorithm.steps=3", "checkpoint.save_every=0", *val)
    assert res.returncode == 0, res.stderr[-3000:]
    vals = [json.loads(x) for x in (run / "validation.jsonl").read_text().splitlines()]
    assert [v["step"] for v in vals] == [0, 2, 3]
    assert "after RL (step 3): " in res.stdout
    assert "val/pass@1" in _metrics(run)[-1]
    final = (run / "final.json").read_text()
    res = _train(run, "algorithm.steps=2", "checkpoint.save_every=0", *val)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"warning: {run}/checkpoints/step_3 is at step 3, past algorithm.steps=2: nothing is trained" in res.stdout
    assert "after RL (step 3): " in res.stdout
    assert (run / "final.json").read_text() == final  # the finished run's result is kept


def test_val_every_0_validates_nothing_even_with_a_benchmark(tmp_path):
    """data.val_every=0 is "never" (config.DataConfig): not before step 1, not after the last; no summary."""
    run = tmp_path / "off"
    val = ["data.val=synthetic:arithmetic-heldout", "data.val_every=0", "data.val_max_problems=8", "data.val_samples=2"]
    res = _train(run, "algorithm.steps=1", "checkpoint.save_every=0", "algorithm.warmup_sft_steps=0", *val)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (run / "validation.jsonl").exists()
    assert "before RL" not in res.stdout and "after RL" not in res.stdout
    assert not any(k.startswith("val/") for m in _metrics(run) for k in m)


def test_output_that_is_not_a_terminal_gets_plain_step_lines(tmp_path):
    """As in a Slurm .out file (stdout and stderr are pipes): no carriage returns, short lines, a line per step."""
    run = tmp_path / "log"
    val = ["data.val=synthetic:arithmetic-heldout", "data.val_every=2", "data.val_max_problems=8", "data.val_samples=2"]
    res = _train(run, "algorithm.steps=3", "checkpoint.save_every=1", "logging.progress=true", *val)
    assert res.returncode == 0, res.stderr[-3000:]
    both = res.stdout + res.stderr
    assert "\r" not in both
    assert max(len(line) for line in both.splitlines()) < 200, max(both.splitlines(), key=len)
    # transformers' bars (the warm-up's model saves, every load, every checkpoint) are off in the CLI.
    assert "Loading weights" not in both and "Writing model shards" not in both
    steps = [line for line in res.stdout.splitlines() if re.match(r"step \d+/\d+: ", line)]  # not the plan lines
    assert steps[0].startswith("step 1/3: reward ") and " s/step, " in steps[0] and steps[0].endswith(" left")
    assert steps[-1].startswith("step 3/3: ") and "val pass@1 " in steps[-1]
    assert any(line.startswith("step 2/3: ") and "val pass@1 " in line for line in steps)  # a validation step
