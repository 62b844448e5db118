"""The sbatch scripts without a cluster: syntax, shellcheck, and the dry run / early checks of train.sbatch.

``NEMO_DISCO_DRY_RUN=1 bash slurm/train.sbatch ...`` runs the script's real code path up to the launch (recipe
validation, layout checks, the srun command), so these tests pin the launch layout of every recipe.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from nemo_disco import config

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["slurm/train.sbatch", "slurm/eval.sbatch", "slurm/convert.sbatch", "slurm/common.sh"]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
ASYNC = ["algorithm.async_rollouts=true"]


def _env(**extra: str) -> dict[str, str]:
    """The test's environment without any Slurm or GPU variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "NEMO_DISCO_"))}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU unless a test says so (SLURM_GPUS_ON_NODE wins over it)
    return {**env, **extra}


def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", script, *args], cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    done = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_shellcheck_clean(shellcheck):
    # -x follows `source slurm/common.sh`; every warning, info and style note counts.
    done = subprocess.run([shellcheck, "-x", *SCRIPTS], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_dry_run_layout_of_every_recipe(recipe):
    """Each recipe on the allocation it names: world size, ranks per node, TP x PP x DP and the exact srun line."""
    cfg = config.load(recipe)
    nodes, per_node = cfg.launch_layout  # with async rollouts: the trainer's and the generator's processes
    cpu = recipe.stem.startswith("tiny-cpu")
    gpu = {} if cpu else {"SLURM_GPUS_ON_NODE": str(per_node)}
    done = _run("slurm/train.sbatch", str(recipe), NEMO_DISCO_DRY_RUN="1", SLURM_NNODES=str(nodes), **gpu)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    world = cfg.launch_world_size
    assert world == nodes * per_node
    device = "CPU, gloo" if cpu else "GPU, NCCL"
    assert f"layout: {nodes} node(s) x {per_node} process(es) = world {world} ({device})" in out
    if cfg.algorithm.async_rollouts:
        trainer = cfg.world_size
        assert f"): trainer ranks 0-{trainer - 1}, generator ranks {trainer}-{world - 1} (async rollouts, " in out
    p = cfg.policy
    assert f"TP {p.tensor_parallel_size} x PP {p.pipeline_parallel_size} x DP {cfg.data_parallel_size};" in out
    # One line per node; the last node ends with rank world - 1.
    ranks = re.findall(r"node (\d+) node\d+: ranks (\d+)-(\d+)", out)
    assert [int(n) for n, _, _ in ranks] == list(range(nodes))
    assert (int(ranks[0][1]), int(ranks[-1][2])) == (0, world - 1)
    command = shlex.split(out.split("command: ", 1)[1].splitlines()[0])
    assert command[:6] == [
        "srun",
        f"--nodes={nodes}",
        f"--ntasks={world}",
        f"--ntasks-per-node={per_node}",
        command[4],
        "--kill-on-bad-exit=0",
    ]
    assert command[-5:] == ["-m", "nemo_disco.cli", "train", "--config", str(recipe)]
    assert "dry run: nothing started" in out


def test_dry_run_passes_overrides_and_container_flags_verbatim():
    overrides = ["cluster.nodes=2", "logging.run_dir=/tmp/a run", "loss.tau=1"]
    done = _run(
        "slurm/train.sbatch",
        "recipes/tiny-cpu.yaml",
        *overrides,
        NEMO_DISCO_DRY_RUN="1",
        SLURM_NNODES="2",
        NEMO_DISCO_CONTAINER="nvcr.io/nvidia/pytorch:25.01-py3",
        NEMO_DISCO_MOUNTS="/lustre:/lustre",
    )
    assert done.returncode == 0, done.stderr
    command = shlex.split(done.stdout.split("command: ", 1)[1].splitlines()[0])
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3" in command
    assert "--container-mounts=/lustre:/lustre" in command
    # Inside the container the job runs the container's python; the overrides arrive as separate words.
    assert command[-9:] == ["python", "-m", "nemo_disco.cli", "train", "--config", "recipes/tiny-cpu.yaml", *overrides]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["recipes/disco.yaml"], {"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8"}, "add the override cluster.nodes=2"),
        (["recipes/disco.yaml"], {"SLURM_GPUS_ON_NODE": "4"}, "4 GPU(s) but the recipe has cluster.gpus_per_node=8"),
        (["recipes/tiny-cpu.yaml"], {"NEMO_DISCO_PROCS_PER_NODE": "2"}, "NEMO_DISCO_PROCS_PER_NODE=2 but the recipe"),
        (["recipes/tiny-cpu.yaml", "loss.taux=1"], {}, "unknown config key 'loss.taux'"),
        (["recipes/nope.yaml"], {}, "recipe file not found"),
        ([], {}, "usage: sbatch"),
        (
            ["recipes/tiny-cpu.yaml", *ASYNC, "cluster.generation_nodes=1"],
            {"SLURM_NNODES": "1"},
            "the job has 1 node(s) (SLURM_NNODES) but the recipe needs 2: cluster.nodes=1 + cluster.generation_nodes=1",
        ),
        (
            ["recipes/disco.yaml", *ASYNC, "cluster.generation_nodes=1"],
            {"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4"},
            "4 GPU(s) but the recipe needs 8 per node: cluster.gpus_per_node=8 on the trainer's and the generator's",
        ),
        (
            ["recipes/disco.yaml", *ASYNC, "cluster.gpus_per_node=4", "cluster.generation_gpus_per_node=4"],
            {"SLURM_GPUS_ON_NODE": "4"},
            "needs 8 per node: cluster.gpus_per_node=4 + cluster.generation_gpus_per_node=4; submit with --gres=gpu:8",
        ),
        (
            ["recipes/tiny-cpu.yaml", *ASYNC, "cluster.generation_gpus_per_node=1"],
            {"NEMO_DISCO_PROCS_PER_NODE": "1"},
            "needs 2 process(es) per node (on CPU): cluster.gpus_per_node=1 + cluster.generation_gpus_per_node=1",
        ),
    ],
    ids=[
        "nodes",
        "gpus",
        "procs-per-node",
        "bad-key",
        "no-recipe",
        "no-args",
        "async-nodes",
        "async-gpus",
        "async-gpus-one-node",
        "async-procs-per-node",
    ],
)
def test_bad_layout_or_recipe_fails_early_with_one_line(args, env, message):
    done = _run("slurm/train.sbatch", *args, NEMO_DISCO_DRY_RUN="1", **env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.sbatch: error: ") and message in lines[0], done.stderr
    assert "command:" not in done.stdout


@pytest.mark.parametrize(
    ("overrides", "env", "layout", "nodes"),
    [
        # 2 nodes x 8 GPUs: the 1-node recipe's trainer on node 0 (ranks 0-7), the generator on node 1 (8-15).
        (
            ["cluster.generation_nodes=1"],
            {"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8"},
            "layout: 2 node(s) x 8 process(es) = world 16 (GPU, NCCL): trainer ranks 0-7, generator ranks 8-15 "
            "(async rollouts, max_staleness 1); policy megatron TP 1 x PP 1 x DP 8; generator vllm TP 1 (8 engine(s))",
            [
                "node 0 node0: ranks 0-7 (trainer) (LOCAL_RANK 0-7)",
                "node 1 node1: ranks 8-15 (generator) (LOCAL_RANK 0-7)",
            ],
        ),
        # One 8-GPU node: trainer ranks 0-5 (DP 6: 24 x 8 = 192 rollouts per mini-batch, 32 per rank), generator 6-7.
        (
            [
                "cluster.gpus_per_node=6",
                "cluster.generation_gpus_per_node=2",
                "algorithm.prompts_per_step=96",
                "algorithm.minibatch_prompts=24",
            ],
            {"SLURM_GPUS_ON_NODE": "8"},
            "layout: 1 node(s) x 8 process(es) = world 8 (GPU, NCCL): trainer ranks 0-5, generator ranks 6-7 "
            "(async rollouts, max_staleness 1); policy megatron TP 1 x PP 1 x DP 6; generator vllm TP 1 (2 engine(s))",
            ["node 0 node0: ranks 0-7 (trainer 0-5, generator 6-7) (LOCAL_RANK 0-7)"],
        ),
    ],
    ids=["generator-node", "shared-node"],
)
def test_dry_run_of_async_rollouts_names_each_role(overrides, env, layout, nodes):
    recipe = "recipes/disco-logl-r1qwen1.5b-1n8g-8k.yaml"
    done = _run("slurm/train.sbatch", recipe, *ASYNC, *overrides, NEMO_DISCO_DRY_RUN="1", **env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert layout in out
    assert re.findall(r"\] (node \d+ .*)", out) == nodes
    # One srun step for trainer and generator: the whole job's world, the same command on every rank.
    cfg = config.load(ROOT / recipe, [*ASYNC, *overrides])
    launch_nodes, per_node = cfg.launch_layout
    command = shlex.split(out.split("command: ", 1)[1].splitlines()[0])
    assert command[1:4] == [
        f"--nodes={launch_nodes}",
        f"--ntasks={cfg.launch_world_size}",
        f"--ntasks-per-node={per_node}",
    ]
    assert command[-len(overrides) - len(ASYNC) - 3 :] == ["train", "--config", recipe, *ASYNC, *overrides]


@pytest.mark.parametrize(
    ("recipe", "assumed", "layout"),
    [
        # The README's line, as written: 2 nodes x 8 GPUs come from the recipe, and the log says so.
        (
            "recipes/disco-logl-r1qwen7b-2n8g-8k.yaml",
            "(SLURM_NNODES=2 SLURM_GPUS_ON_NODE=8)",
            "layout: 2 node(s) x 8 process(es) = world 16 (GPU, NCCL); policy megatron TP 2 x PP 1 x DP 8;",
        ),
        (
            "recipes/disco-logl-qwen3-30ba3b-4n8g-16k.yaml",
            "(SLURM_NNODES=4 SLURM_GPUS_ON_NODE=8)",
            "layout: 4 node(s) x 8 process(es) = world 32 (GPU, NCCL);",
        ),
        # float32: the CPU demo recipe, on CPU even on a host with GPUs.
        (
            "recipes/tiny-cpu-async.yaml",
            "(SLURM_NNODES=1 no GPU (policy.dtype=float32))",
            "layout: 1 node(s) x 2 process(es) = world 2 (CPU, gloo): trainer ranks 0-0, generator ranks 1-1",
        ),
    ],
    ids=["7b-2n8g", "30ba3b-4n8g", "tiny-cpu-async"],
)
def test_dry_run_outside_slurm_assumes_the_recipes_own_layout_and_says_so(recipe, assumed, layout):
    env = _env(NEMO_DISCO_DRY_RUN="1")
    del env["CUDA_VISIBLE_DEVICES"]  # as on a login node: whatever GPUs the host has do not count
    done = subprocess.run(
        ["bash", "slurm/train.sbatch", recipe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"] dry run outside Slurm: assumed the recipe's own layout {assumed}; set SLURM_NNODES" in lines[0]
    assert layout in done.stdout
    assert lines[-1].endswith("] dry run: nothing started")
    nodes, per_node = config.load(ROOT / recipe).launch_layout
    command = shlex.split(done.stdout.split("command: ", 1)[1].splitlines()[0])
    assert command[1:4] == [f"--nodes={nodes}", f"--ntasks={nodes * per_node}", f"--ntasks-per-node={per_node}"]


def test_dry_run_outside_slurm_checks_what_it_is_given():
    """SLURM_NNODES given outside Slurm is checked as in a job: only what is missing is assumed."""
    done = _run(
        "slurm/train.sbatch", "recipes/disco-logl-r1qwen7b-2n8g-8k.yaml", NEMO_DISCO_DRY_RUN="1", SLURM_NNODES="1"
    )
    assert done.returncode == 2
    assert "the job has 1 node(s) (SLURM_NNODES) but the recipe has cluster.nodes=2" in done.stderr
    assert "assumed the recipe's own layout (SLURM_GPUS_ON_NODE=8)" in done.stdout


@pytest.mark.parametrize("script", ["slurm/train.sbatch", "slurm/eval.sbatch", "slurm/convert.sbatch"])
def test_refuses_to_run_outside_slurm(script):
    done = _run(script, "recipes/tiny-cpu.yaml")
    assert done.returncode == 2
    assert "not inside a Slurm job" in done.stderr


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("slurm/eval.sbatch", ["--model", "owner/model", "--benchmarks", "aime,math", "--samples", "16"]),
        ("slurm/convert.sbatch", ["--checkpoint", "runs/x/checkpoints/step_20", "--out", "runs/x/hf dir"]),
    ],
)
def test_thin_scripts_pass_arguments_through(script, args):
    done = _run(script, *args, NEMO_DISCO_DRY_RUN="1")
    assert done.returncode == 0, done.stderr
    command = shlex.split(done.stdout.split("command: ", 1)[1].splitlines()[0])
    sub = "eval" if "eval" in script else "convert"
    assert command[0] == "srun" and command[-len(args) - 3 :] == ["-m", "nemo_disco.cli", sub, *args]


def test_eval_checks_the_model_and_starts_one_process_per_gpu(tmp_path):
    model = tmp_path / "hf"
    for args, message in [
        (["--model", "runs/none/hf"], "--model runs/none/hf: no such folder (from "),
        (["--model", str(tmp_path)], f"--model {tmp_path} has no config.json: not a Hugging Face model folder"),
    ]:
        done = _run("slurm/eval.sbatch", *args, NEMO_DISCO_DRY_RUN="1", SLURM_GPUS_ON_NODE="8")
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"eval.sbatch: error: {message}"), lines
    model.mkdir()
    (model / "config.json").write_text("{}")
    done = _run("slurm/eval.sbatch", "--model", str(model), "--tp", "2", NEMO_DISCO_DRY_RUN="1", SLURM_GPUS_ON_NODE="8")
    assert done.returncode == 0, done.stderr
    command = shlex.split(done.stdout.split("command: ", 1)[1].splitlines()[0])
    assert command[:4] == ["srun", "--nodes=1", "--ntasks=8", "--ntasks-per-node=8"]
    assert "RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID" in " ".join(command)


def _path_without_scontrol(tmp_path: Path) -> str:
    """A PATH holding links to what the script needs, but not scontrol."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "cat", "awk", "grep", "tail", "rm", "mktemp", "nproc", "date", "python3"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def test_a_nodelist_without_scontrol_is_one_clear_line(tmp_path):
    env = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "2", "PATH": _path_without_scontrol(tmp_path)}
    done = _run("slurm/train.sbatch", "recipes/tiny-cpu.yaml", "cluster.nodes=2", NEMO_DISCO_DRY_RUN="1", **env)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "train.sbatch: error: SLURM_JOB_NODELIST=gpu[01-02] is set but scontrol is not on PATH, so the job's "
        "hosts cannot be listed"
    )


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs scontrol (Debian slurm-client)")
def test_a_nodelist_scontrol_cannot_resolve_is_one_clear_line(tmp_path):
    # No slurm.conf (SLURM_CONF names an empty file): scontrol cannot expand the list. Before, the script died
    # with `HOSTS[0]: unbound variable`.
    conf = tmp_path / "slurm.conf"
    conf.write_text("")
    env = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "2", "SLURM_CONF": str(conf)}
    done = _run("slurm/train.sbatch", "recipes/tiny-cpu.yaml", "cluster.nodes=2", NEMO_DISCO_DRY_RUN="1", **env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        "train.sbatch: error: scontrol show hostnames could not resolve SLURM_JOB_NODELIST=gpu[01-02] into 2 host(s) "
        "(got 0: scontrol: "
    )
    assert "unbound variable" not in done.stderr


def test_max_requeues_must_be_a_count():
    done = _run("slurm/train.sbatch", "recipes/tiny-cpu.yaml", NEMO_DISCO_DRY_RUN="1", NEMO_DISCO_MAX_REQUEUES="x")
    assert done.returncode == 2
    assert done.stderr.strip() == "train.sbatch: error: NEMO_DISCO_MAX_REQUEUES=x is not a non-negative integer"


def test_the_quickstarts_dry_run_works_as_written():
    """docs/quickstart-cluster.md, step 3: its preview lines, pasted into bash outside Slurm."""
    text = (ROOT / "docs" / "quickstart-cluster.md").read_text()
    block = text.split("## 3. Preview, then submit", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    preview = "".join(
        line + "\n" for line in block.splitlines() if not line.startswith(("mkdir", "HF_HUB", "    slurm"))
    )
    assert "NEMO_DISCO_DRY_RUN=1 bash slurm/train.sbatch" in preview
    done = subprocess.run(["bash", "-c", preview], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "assumed the recipe's own layout (SLURM_NNODES=1 SLURM_GPUS_ON_NODE=8)" in done.stdout
    command = shlex.split(done.stdout.split("command: ", 1)[1].splitlines()[0])
    assert command[-3:] == [
        "recipes/disco-logl-r1qwen1.5b-1n8g-8k.yaml",
        "data.train=/lustre/data/deepscaler.jsonl",
        "policy.model_path=/lustre/models/DeepSeek-R1-Distill-Qwen-1.5B",
    ]
