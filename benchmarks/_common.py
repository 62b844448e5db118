"""Helpers shared by the benchmark scripts: machine facts, child processes, statistics, nemo_disco runs.

Every measured run happens in a fresh child process (``python benchmarks/<script>.py --child ...``) that prints
one ``BENCH_RESULT {json}`` line; the parent interleaves the runs it compares and takes medians.

Run as a script, this file is the generator process of an asynchronous run (:func:`nd_async_steps` starts it)::

    python benchmarks/_common.py generator --run-dir DIR --threads 1 [--fixed-length] -- OVERRIDES...
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"
RESULTS = ROOT / "runs" / "bench"
MARKER = "BENCH_RESULT "

if str(ROOT) not in sys.path:  # the scripts run as `python benchmarks/x.py` from anywhere
    sys.path.insert(0, str(ROOT))


# ----------------------------------------------------------------------------------------------------------------------
# Machine and environment


def machine_info() -> dict[str, Any]:
    """CPU model, cores, load, library versions and the date: what docs/benchmarks.md records with each figure."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for name in ("torch", "transformers", "trl", "accelerate"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_model": model,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_avg": os.getloadavg(),
        "python": platform.python_version(),
        **versions,
    }


THREADS_HELP = (
    "OMP_NUM_THREADS of every child (default 1: on a shared 2-core machine two OpenMP threads per process "
    "slow a small matmul 20-60x whenever another process is busy; 0 = torch's default)"
)


def bench_env(threads: int | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a child run: offline, quiet, ``threads`` intra-op threads (None = leave torch's default).

    ``extra`` is set last (for example ``OMP_WAIT_POLICY``).
    """
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
        env["MKL_NUM_THREADS"] = str(threads)
    return {**env, **(extra or {})}


def set_threads(threads: int) -> int:
    """Set torch's intra-op threads of this process (as its ``OMP_NUM_THREADS`` says); returns the count in effect."""
    import torch

    torch.set_num_threads(threads)
    return torch.get_num_threads()


def emit(result: dict[str, Any]) -> None:
    """Print a child's result line (the parent reads the last one)."""
    print(MARKER + json.dumps(result), flush=True)


def cpu_busy(window_s: float = 1.0) -> float:
    """Share of all cores busy over the next ``window_s`` seconds (from /proc/stat; 0.0 where unreadable)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    try:
        t0, i0 = sample()
        time.sleep(window_s)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def _cpu_ticks() -> tuple[int, int]:
    """Clock ticks of all CPUs since boot: (busy, steal); busy leaves out idle, iowait and steal."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]  # guest time is in user
    steal = f[7] if len(f) > 7 else 0
    return sum(f) - f[3] - (f[4] if len(f) > 4 else 0) - steal, steal


def _children_cpu_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def wait_for_quiet(max_busy: float = 0.5, timeout_s: float = 60.0) -> float:
    """Wait until other processes leave about one core idle (a shared machine); returns the last busy share.

    Gives up after ``timeout_s`` (the run then goes ahead and its result records how busy the machine was).
    """
    end = time.monotonic() + timeout_s
    busy = cpu_busy()
    while busy > max_busy and time.monotonic() < end:
        busy = cpu_busy(2.0)
    return busy


def run_child(
    script: Path,
    args: Sequence[str],
    *,
    timeout: float,
    threads: int | None = None,
    env: dict[str, str] | None = None,
    quiet: bool = True,
    quiet_timeout_s: float = 60.0,
    quiet_max_busy: float = 0.5,
) -> dict[str, Any]:
    """Run ``python script args`` in a fresh process and return its ``BENCH_RESULT``.

    Args:
        script: the benchmark script (its ``--child`` mode prints the result line).
        args: its arguments.
        timeout: seconds before the child is killed.
        threads: OMP_NUM_THREADS of the child (None or 0: torch's default).
        env: more environment variables of the child (set last).
        quiet: first wait (up to ``quiet_timeout_s``) until other processes use at most ``quiet_max_busy`` of
            the CPUs (default: they leave at least one of two cores idle).
        quiet_timeout_s: how long to wait for that before running anyway.
        quiet_max_busy: the share of all CPUs other processes may use.

    Returns:
        The child's result plus ``child_wall_s``, ``cpu_busy_before`` (share of the CPUs other processes
        used just before the run), ``load_avg_before`` (the 1-minute load average then), ``others_cpu_share``
        (share of the CPUs used during the run by processes outside the child's tree: the machine's busy time
        minus the child's and its waited-for descendants' CPU time) and ``steal_share`` (CPU time the
        hypervisor gave elsewhere, same unit).

    Raises:
        RuntimeError: the child failed or printed no result (its stderr tail is in the message).
    """
    busy = wait_for_quiet(max_busy=quiet_max_busy, timeout_s=quiet_timeout_s) if quiet else float("nan")
    load = os.getloadavg()[0]
    cmd = [sys.executable, str(script), *args]
    ticks0, steal0 = _cpu_ticks()
    own0 = _children_cpu_s()
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=bench_env(threads, env), cwd=ROOT, timeout=timeout)
    wall = time.perf_counter() - t0
    ticks1, steal1 = _cpu_ticks()
    own = _children_cpu_s() - own0
    hz, cores = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    others = max(0.0, (ticks1 - ticks0) / hz - own) / (wall * cores)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(MARKER)]
    if res.returncode != 0 or not lines:
        tail = (res.stderr or res.stdout)[-2500:]
        raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode} without a result:\n{tail}")
    out = json.loads(lines[-1][len(MARKER) :])
    out["child_wall_s"] = wall
    out["cpu_busy_before"] = busy
    out["load_avg_before"] = load
    out["others_cpu_share"] = others
    out["steal_share"] = (steal1 - steal0) / hz / (wall * cores)
    return out


def write_json(name: str, payload: dict[str, Any], out_dir: Path = RESULTS) -> Path:
    """Write ``payload`` (with the machine facts) to ``runs/bench/<name>.json``; returns the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=1) + "\n")
    return path


# ----------------------------------------------------------------------------------------------------------------------
# Statistics


def summarize(values: Iterable[float]) -> dict[str, float]:
    """Median, min, max and count."""
    v = sorted(values)
    if not v:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(v), "min": v[0], "max": v[-1], "n": len(v)}


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least-squares line y = intercept + slope * x and the largest deviation of a point from it.

    Returns:
        slope, intercept, max_abs_deviation (in y's unit) and max_rel_deviation (over that point's y).
    """
    n = len(xs)
    if n < 2 or n != len(ys):
        raise ValueError(f"fit_line needs at least 2 matching points, got {len(xs)} x and {len(ys)} y")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_line: all x are equal")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    dev = [y - (intercept + slope * x) for x, y in zip(xs, ys, strict=True)]
    rel = [abs(d) / abs(y) if y else float("inf") for d, y in zip(dev, ys, strict=True)]
    return {
        "slope": slope,
        "intercept": intercept,
        "max_abs_deviation": max(abs(d) for d in dev),
        "max_rel_deviation": max(rel),
    }


# ----------------------------------------------------------------------------------------------------------------------
# Memory (Linux /proc)


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def rss_mb() -> float:
    """Current resident set size of this process (MiB)."""
    return _status_kb("VmRSS") / 1024


def peak_rss_mb() -> float:
    """Peak resident set size since start or the last :func:`reset_peak_rss` (MiB)."""
    return _status_kb("VmHWM") / 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (``/proc/self/clear_refs`` 5); False if refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def children_rss_mb() -> float:
    """Resident memory of this process's live children (grader workers), MiB; 0 without psutil."""
    try:
        import psutil
    except ImportError:
        return 0.0
    return sum(c.memory_info().rss for c in psutil.Process().children(recursive=True)) / 2**20


# ----------------------------------------------------------------------------------------------------------------------
# nemo_disco runs


def build_bench_model(
    out_dir: Path,
    *,
    layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    max_positions: int = 512,
    seed: int = 0,
) -> Path:
    """A random tiny Qwen2 + the character-level tokenizer as an HF folder (built once, shared by every run)."""
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    if (out_dir / "config.json").is_file():
        return out_dir
    tiny = TinyModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
    )
    return build_model(tiny, out_dir, seed=seed)


def tiny_recipe_model(out_dir: Path = RESULTS / "tiny_cpu_init") -> Path:
    """The tiny-cpu recipe's starting model (policy.tiny built and SFT-warmed exactly as the demo does), built once.

    Runs given ``policy.model_path`` of this folder then do exactly what the demo does after its set-up.
    """
    from nemo_disco.algorithm import prepare_model

    model = out_dir / "init_model"
    if not (model / "config.json").is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        from nemo_disco import config

        # The demo's own settings: its warm-up is measured on the validation split that QUIET switches off.
        prepare_model(config.load(RECIPE, [f"logging.run_dir={out_dir}"]), out_dir)
    return model


#: Overrides every benchmark run of the trainer shares: no validation, checkpoints, TensorBoard or progress bar.
QUIET = [
    "data.val=null",
    "data.val_every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "checkpoint.resume=false",
    "checkpoint.save_every=0",
]


def load_config(run_dir: Path, overrides: Sequence[str]) -> Any:
    """The tiny-cpu recipe with ``QUIET`` and ``overrides`` applied, writing under ``run_dir``."""
    from nemo_disco import config

    return config.load(RECIPE, [*QUIET, f"logging.run_dir={run_dir}", *overrides])


class FixedLengthGenerator:
    """Wraps a Generator so that every rollout is exactly ``max_tokens`` long (``SamplingParams.ignore_eos``).

    Fixed-length generation makes step times comparable across runs and frameworks (no EOS lottery).
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: Any) -> Any:
        """The inner generator's rollouts with EOS ignored."""
        return self.inner.generate(prompt_token_ids, n, dataclasses.replace(sampling, ignore_eos=True))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def nd_steps(cfg: Any, steps: int, warmup: int, *, fixed_length: bool, profile: Path | None = None) -> dict[str, Any]:
    """Run ``warmup + steps`` training steps of nemo_disco (setup, train_step, logging: as ``algorithm.train``).

    Args:
        cfg: a RunConfig.
        steps: measured steps.
        warmup: untimed steps first (allocator, thread pools, first-call costs).
        fixed_length: generate exactly ``generation.max_response_tokens`` tokens per rollout.
        profile: write a cProfile of the measured steps to this file.

    Returns:
        setup seconds, the per-step metrics of the measured steps, each step's wall interval (end to end,
        logging included) and the completion tokens each step generated.
    """
    from nemo_disco import algorithm

    t0 = time.perf_counter()
    tr = algorithm.setup(cfg)
    setup_s = time.perf_counter() - t0
    if fixed_length:
        tr.rollouts.ro.generator = FixedLengthGenerator(tr.rollouts.ro.generator)
    records: list[dict[str, float]] = []
    walls: list[float] = []
    profiler = None
    try:
        for i in range(warmup + steps):
            if i == warmup and profile is not None:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            t_start = time.perf_counter()
            metrics = algorithm.train_step(tr)
            tr.step += 1
            tr.logger.log(tr.step, metrics)
            wall = time.perf_counter() - t_start
            if i >= warmup:
                records.append(metrics)
                walls.append(wall)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(profile))
        tr.logger.close()
        tr.rollouts.close(None)
    rollouts = cfg.algorithm.prompts_per_step * cfg.algorithm.rollouts_per_prompt
    tokens = [m["train/response_length_mean"] * rollouts for m in records]
    ddp_config = getattr(getattr(tr.policy, "model", None), "ddp_config", None)
    return {
        "setup_s": setup_s,
        "metrics": records,
        "wall_s": walls,
        "completion_tokens": tokens,
        "optimizer": type(getattr(tr.policy, "optimizer", None)).__name__,
        "distributed_optimizer": bool(getattr(ddp_config, "use_distributed_optimizer", False)),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nd_async_steps(
    run_dir: Path, overrides: Sequence[str], steps: int, warmup: int, *, fixed_length: bool, generator_threads: int
) -> dict[str, Any]:
    """Run ``warmup + steps`` steps of an asynchronous nemo_disco run on this host, end to end.

    As ``nemo-disco train`` does without a launcher (``cli._spawn_generators``): this process is launch rank 0,
    the trainer, and runs ``algorithm.train`` unchanged; one generator process (this file as a script, launch
    rank 1) runs ``algorithm.train`` too, which serves rollouts from it. The only benchmark hooks: the trainer's
    metrics logger is wrapped to note when each step ends, and the generator's engine is wrapped in
    :class:`FixedLengthGenerator` when ``fixed_length``.

    Args:
        run_dir: the run's folder (``logging.run_dir``).
        overrides: the tiny-cpu recipe's overrides (with ``algorithm.async_rollouts=true``, one generator
            process and ``algorithm.steps = warmup + steps``); the generator loads the same.
        steps: measured steps.
        warmup: steps not measured, the pipeline's fill among them (at least 1).
        fixed_length: generate exactly ``generation.max_response_tokens`` tokens per rollout.
        generator_threads: torch threads of the generator process (its ``OMP_NUM_THREADS``).

    Returns:
        setup seconds (start to the trainer's first step), the measured steps' metrics, their wall intervals
        (from the previous step's end to this one's: the trainer's wall clock, whatever the generator does
        meanwhile), completion tokens per step and the generator's thread count.
    """
    from nemo_disco import algorithm

    cfg = load_config(run_dir, overrides)
    if not cfg.algorithm.async_rollouts or cfg.world_size != 1 or cfg.generation_world_size != 1:
        raise ValueError("nd_async_steps runs one trainer process and one generator process")
    if cfg.algorithm.steps != warmup + steps or warmup < 1:
        raise ValueError(f"algorithm.steps={cfg.algorithm.steps} must be warmup ({warmup} >= 1) + steps ({steps})")
    layout = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    os.environ.update({**layout, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"})
    cmd = [sys.executable, str(Path(__file__).resolve()), "generator", "--run-dir", str(run_dir)]
    cmd += ["--threads", str(generator_threads), *(["--fixed-length"] if fixed_length else []), "--", *overrides]
    threads = {"OMP_NUM_THREADS": str(generator_threads), "MKL_NUM_THREADS": str(generator_threads)}
    gen = subprocess.Popen(cmd, env={**os.environ, **threads, "RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0"})
    training = threading.Event()
    training.set()

    def watch() -> None:  # a generator that fails before it connects would leave the trainer waiting for it
        code = gen.wait()
        if code != 0 and training.is_set():
            print(f"the generator process exited {code} while the trainer ran", file=sys.stderr, flush=True)
            os._exit(1)

    threading.Thread(target=watch, daemon=True).start()

    ends: list[float] = []
    records: list[dict[str, float]] = []
    setup_done: list[float] = []
    setup = algorithm.setup

    def timed_setup(cfg: Any, role: Any = None) -> Any:
        tr = setup(cfg, role)
        log = tr.logger.log

        def timed_log(step: int, metrics: dict[str, float]) -> None:
            log(step, metrics)
            if step >= 1:  # (a record for step 0 would be a validation)
                ends.append(time.perf_counter())
                records.append(dict(metrics))

        tr.logger.log = timed_log
        setup_done.append(time.perf_counter())
        return tr

    algorithm.setup = timed_setup
    t0 = time.perf_counter()
    try:
        algorithm.train(cfg)
    finally:
        training.clear()
        algorithm.setup = setup
        try:
            gen.wait(timeout=120)
        except subprocess.TimeoutExpired:
            gen.kill()
            gen.wait()
    if gen.returncode != 0:
        raise RuntimeError(f"the generator process exited {gen.returncode}")
    facts = json.loads((Path(run_dir) / "generator.json").read_text())
    walls = [b - a for a, b in zip(ends[warmup - 1 : -1], ends[warmup:], strict=True)]
    rollouts = cfg.algorithm.prompts_per_step * cfg.algorithm.rollouts_per_prompt
    measured = records[warmup:]
    return {
        "setup_s": setup_done[0] - t0,
        "metrics": measured,
        "wall_s": walls,
        "completion_tokens": [m["train/response_length_mean"] * rollouts for m in measured],
        "generator_threads": facts["threads"],
    }


def _generator_main(argv: Sequence[str]) -> int:
    """The generator process of :func:`nd_async_steps`: ``algorithm.train`` as launch rank 1."""
    ap = argparse.ArgumentParser(description="generator process of an asynchronous benchmark run")
    ap.add_argument("role", choices=["generator"])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--fixed-length", action="store_true")
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.overrides = list(argv[cut + 1 :])
    threads = set_threads(args.threads)
    from nemo_disco import algorithm
    from nemo_disco.generation import factory

    if args.fixed_length:
        build = factory.build_run_generator  # serve() builds its engine through this module-level name

        def build_fixed(cfg: Any, model_dir: Path) -> FixedLengthGenerator:
            return FixedLengthGenerator(build(cfg, model_dir))

        factory.build_run_generator = build_fixed
    algorithm.train(load_config(args.run_dir, args.overrides))
    (args.run_dir / "generator.json").write_text(json.dumps({"threads": threads}))
    return 0


def step_phases(metrics: dict[str, float]) -> dict[str, float]:
    """Seconds of each phase of one step; ``other`` = step minus the timed phases."""
    names = ("generate", "grade", "old_logprobs", "train", "refit")
    out = {n: float(metrics.get(f"timing/{n}", 0.0)) for n in names}
    out["step"] = float(metrics["timing/step"])
    out["other"] = out["step"] - sum(out[n] for n in names)
    return out


def async_step_phases(metrics: dict[str, float], wall: float) -> dict[str, float]:
    """Where one step of an asynchronous run goes (seconds), seen from both processes.

    Trainer: ``wait`` (blocked on the step's rollouts), ``old_logprobs``, ``train``, ``publish`` (weights sent)
    and ``other`` (wall minus those: batch building, logging). Generator (that step's rollouts, made while the
    previous step trained): ``generate``, ``grade`` and ``generator_idle`` (wall minus both: receiving weights
    and waiting for them).
    """
    out = {n: float(metrics.get(f"timing/{n}", 0.0)) for n in ("old_logprobs", "train", "publish", "generate", "grade")}
    out["wait"] = float(metrics.get("timing/wait_rollouts", 0.0))
    out["wall"] = wall
    out["trainer_other"] = wall - out["wait"] - out["old_logprobs"] - out["train"] - out["publish"]
    out["generator_idle"] = wall - out["generate"] - out["grade"]
    out["staleness"] = float(metrics.get("rollout/staleness_mean", float("nan")))
    return out


def top_functions(profile: Path, limit: int = 25) -> str:
    """The ``limit`` functions of a cProfile dump with the most cumulative time, as text."""
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(str(profile), stream=buf).sort_stats("cumulative").print_stats(limit)
    return buf.getvalue()


if __name__ == "__main__":
    sys.exit(_generator_main(sys.argv[1:]))
