"""Every paper recipe loads, validates, and carries the paper's numbers (each checked against a table here).

Sources of the table: arXiv 2505.12366 §6 / app. A and the authors' scripts/train/*.sh (shared reference notes).
A recipe added under recipes/ without a row here fails ``test_every_recipe_has_a_row``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from nemo_disco import config, parts

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# The exemplar and the CPU demo are specified and tested elsewhere (tests/unit/test_config.py, tests/functional).
NOT_PAPER_RUNS = {"disco", "tiny-cpu"}
# Asynchronous-rollout variants of another recipe (docs/async.md): the same run, the generator on its own processes.
ASYNC_VARIANTS = {"tiny-cpu-async": "tiny-cpu", "disco-logl-r1qwen7b-async-2n8g-8k": "disco-logl-r1qwen7b-2n8g-8k"}
NOT_PAPER_RUNS |= set(ASYNC_VARIANTS)

QWEN_1_5B = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
QWEN_7B = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
LLAMA_8B = "deepseek-ai/DeepSeek-R1-Distill-Llama-8B"
DEEPSCALER = "agentica-org/DeepScaleR-Preview-Dataset"
#: What _get gives for a key the chosen loss does not have (its section holds only the loss's own parameters).
ABSENT = "<absent>"

# Shared by every paper run (paper §6, every script): 128 questions x 8 rollouts per step, mini-batches of 32
# questions (so 128 / 32 = 4 updates per step), temperature 0.6, prompts <= 1024 tokens (script), 8k responses.
SHARED = {
    "algorithm.prompts_per_step": 128,
    "algorithm.rollouts_per_prompt": 8,
    "algorithm.minibatch_prompts": 32,
    "generation.temperature": 0.6,
    "generation.top_p": 1.0,
    "generation.max_prompt_tokens": 1024,
    "generation.max_response_tokens": 8192,
    "policy.grad_clip": 1.0,
    "loss.kl": "k1",
}
# The trust region of every DisCO / DisCO-b run (paper §6, scripts): delta 1e-4, beta 1e3.
CONSTRAINT = {"loss.delta": 1e-4, "loss.beta": 1e3}


def _disco(model: str, lr: float, steps: int, score: str, tau: float | None, nodes: int = 1, **extra) -> dict:
    row = {
        **SHARED,
        **CONSTRAINT,
        "policy.model_path": model,
        "policy.lr": lr,
        "algorithm.steps": steps,
        "loss.score": score,
        "data.train": DEEPSCALER,
        "cluster.nodes": nodes,
        "cluster.gpus_per_node": 8,
        "loss.official_compat": False,
    }
    if tau is not None:
        row["loss.tau"] = tau
    return {**row, **extra}


def _baseline(name: str, **extra) -> dict:
    # Baselines share the 1.5B DisCO run's setup (paper §6): lr 2e-6, 1400 steps, 1 x 8 GPUs.
    row = {
        **SHARED,
        "policy.model_path": QWEN_1_5B,
        "policy.lr": 2e-6,
        "algorithm.steps": 1400,
        "data.train": DEEPSCALER,
        "cluster.nodes": 1,
        "cluster.gpus_per_node": 8,
        "loss.name": name,
    }
    return {**row, **extra}


DRPO = {
    "loss.name": "drpo",
    "loss.drpo_lambda": 0.1,
    "data.val": "aime",
    "data.val_every": 20,
    "data.val_samples": 8,
    "generation.max_response_tokens": 8192,  # L_max of the length weights (the script's data.max_response_length)
}

EXPECTED: dict[str, dict] = {
    # tau: 10 for log-L, 1 for L-ratio (paper §6); lr 2e-6 for 1.5B, 1e-6 for 7B (scripts); steps 1400 / 1000 (§6).
    "disco-logl-r1qwen1.5b-1n8g-8k": _disco(QWEN_1_5B, 2e-6, 1400, "logl", 10.0, **{"loss.name": "disco"}),
    "disco-lratio-r1qwen1.5b-1n8g-8k": _disco(QWEN_1_5B, 2e-6, 1400, "lratio", 1.0, **{"loss.name": "disco"}),
    "disco-logl-r1qwen7b-2n8g-8k": _disco(QWEN_7B, 1e-6, 1000, "logl", 10.0, nodes=2, **{"loss.name": "disco"}),
    "disco-lratio-r1qwen7b-2n8g-8k": _disco(QWEN_7B, 1e-6, 1000, "lratio", 1.0, nodes=2, **{"loss.name": "disco"}),
    # No 8B script: lr and steps of the 7B runs (the recipe says so).
    "disco-logl-r1llama8b-2n8g-8k": _disco(LLAMA_8B, 1e-6, 1000, "logl", 10.0, nodes=2, **{"loss.name": "disco"}),
    # DisCO-b (eq. 7): tau unused, so not checked.
    "discob-logl-r1qwen1.5b-1n8g-8k": _disco(QWEN_1_5B, 2e-6, 1400, "logl", None, **{"loss.name": "discob"}),
    "discob-lratio-r1qwen1.5b-1n8g-8k": _disco(QWEN_1_5B, 2e-6, 1400, "lratio", None, **{"loss.name": "discob"}),
    # App. A.3: the same 1.5B log-L run on DAPO-Math-17k.
    "disco-logl-r1qwen1.5b-1n8g-8k-dapomath": _disco(
        QWEN_1_5B, 2e-6, 1400, "logl", 10.0, **{"loss.name": "disco", "data.train": "BytedTsinghua-SIA/DAPO-Math-17k"}
    ),
    # The authors' code: half constraint gradient + log-sum-exp, DeepScaleR grader, AIME validation every 20 steps x 8.
    "disco-logl-r1qwen1.5b-1n8g-8k-official": _disco(
        QWEN_1_5B,
        2e-6,
        1400,
        "logl",
        10.0,
        **{
            "loss.name": "disco",
            "loss.official_compat": True,
            "reward.grader": "deepscaler",
            "data.val_every": 20,
            "data.val_samples": 8,
        },
    ),
    # DRPO (arXiv 2510.04474): the DRPO authors' run_drpo_{1.5b,7b}_8k.sh: Lambda 0.1, tau 10, 1002 steps, AIME
    # validation every 20 steps x 8 samples; otherwise the DisCO runs' values.
    "drpo-r1qwen1.5b-1n8g-8k": _disco(QWEN_1_5B, 2e-6, 1002, "logl", 10.0, **DRPO),
    "drpo-r1qwen7b-2n8g-8k": _disco(QWEN_7B, 1e-6, 1002, "logl", 10.0, nodes=2, **DRPO),
    # GRPO: KL regulariser 0.001 (paper §6), clip 0.2.
    "grpo-r1qwen1.5b-1n8g-8k": _baseline("grpo", **{"loss.kl_coef": 0.001, "loss.clip_eps": 0.2}),
    "dr-grpo-r1qwen1.5b-1n8g-8k": _baseline("dr_grpo", **{"loss.kl_coef": 0.0, "loss.clip_eps": 0.2}),
    # DAPO: clip-higher 0.28 over eps_low 0.2, no KL, dynamic sampling, overlong shaping 8192 * 4096 / 20480 = 1638.
    "dapo-r1qwen1.5b-1n8g-8k": _baseline(
        "dapo",
        **{
            "loss.clip_eps": 0.2,
            "loss.clip_eps_high": 0.28,
            "loss.kl_coef": ABSENT,  # DAPO's loss has no KL term
            "algorithm.dynamic_sampling": True,
            "algorithm.overlong_buffer_tokens": 1638,
        },
    ),
    "grpo-er-r1qwen1.5b-1n8g-8k": _baseline(
        "grpo_er", **{"loss.kl_coef": 0.001, "loss.entropy_coef": 0.001, "loss.clip_eps": 0.2}
    ),
    # GPG (arXiv 2504.02546): F_norm = 1 (eq. 6), alpha = B / (B - M) (eq. 7-8), eq. 5's per-question tokens.
    "gpg-r1qwen1.5b-1n8g-8k": _baseline(
        "gpg",
        **{
            "loss.adv_std_norm": False,
            "loss.alpha_correction": True,
            "loss.token_norm": "question",
            "loss.kl_coef": ABSENT,  # GPG's loss has no KL term (no reference model)
            "algorithm.dynamic_sampling": True,  # Alg. 1: resample until beta_th of the questions are informative
            "algorithm.min_valid_share": 0.6,  # beta_th, tab. 1
            "algorithm.max_sampling_rounds": 20,  # the authors' max_resample_attempts
        },
    ),
    # TRPA (arXiv 2504.04524): the TRPA authors' main_TRPA.sh values.
    "trpa-r1qwen1.5b-1n8g-8k": _baseline(
        "trpa",
        **{"loss.trpa_beta": 0.1, "loss.trpa_anisotropy": 2.5, "loss.tr_kl_coef": 0.001, "loss.kl_coef": ABSENT},
    ),
}

# Model-family recipes (not paper runs): the paper's objective and data on the families users train now, with the
# values their sources give (model cards, NeMo-RL and verl recipes; each recipe line cites its source).
FAMILY_EXPECTED: dict[str, dict] = {
    "disco-logl-qwen3-4b-1n8g-16k": {
        "policy.model_path": "Qwen/Qwen3-4B",
        "policy.lr": 1e-6,
        "generation.max_response_tokens": 16384,
        "data.chat_template_kwargs": {"enable_thinking": True},
        "cluster.nodes": 1,
    },
    "disco-logl-qwen3-8b-2n8g-16k": {
        "policy.model_path": "Qwen/Qwen3-8B",
        "policy.lr": 1e-6,
        "policy.tensor_parallel_size": 2,
        "generation.max_response_tokens": 16384,
        "data.chat_template_kwargs": {"enable_thinking": True},
        "cluster.nodes": 2,
    },
    # NeMo-RL's Qwen3-30B-A3B recipe: lr 3e-7, vLLM TP 4 at 0.7 of the GPU; router frozen, no balance loss.
    "disco-logl-qwen3-30ba3b-4n8g-16k": {
        "policy.model_path": "Qwen/Qwen3-30B-A3B",
        "policy.lr": 3e-7,
        "policy.expert_parallel_size": 8,
        "policy.freeze_router": True,
        "policy.router_aux_loss_coef": 0.0,
        "generation.tensor_parallel_size": 4,
        "generation.gpu_memory_utilization": 0.7,
        "data.chat_template_kwargs": {"enable_thinking": True},
        "cluster.nodes": 4,
    },
    # Qwen2.5-Math-7B's context is 4096 tokens: 1024 prompt + 3072 response.
    "disco-logl-qwen2.5math7b-1n8g-3k": {
        "policy.model_path": "Qwen/Qwen2.5-Math-7B",
        "policy.lr": 1e-6,
        "generation.max_prompt_tokens": 1024,
        "generation.max_response_tokens": 3072,
        "cluster.nodes": 1,
    },
    # NeMo-RL's Llama-3.1-8B-Instruct recipe: lr 5e-7, PP 2, 4096 tokens in all, 500 steps.
    "disco-logl-llama3.1-8b-instruct-1n8g-3k": {
        "policy.model_path": "meta-llama/Llama-3.1-8B-Instruct",
        "policy.lr": 5e-7,
        "policy.pipeline_parallel_size": 2,
        "generation.max_response_tokens": 3072,
        "algorithm.steps": 500,
        "cluster.nodes": 1,
    },
}
PAPER_RECIPES = sorted(
    p.stem for p in RECIPES.glob("*.yaml") if p.stem not in NOT_PAPER_RUNS and p.stem not in FAMILY_EXPECTED
)
# <algo>-<score>-<model>-<N>n<G>g-<maxlen>[-variant]; baselines have no score.
NAME = re.compile(
    r"^(disco|discob|drpo|grpo|dr-grpo|dapo|grpo-er|gpg|trpa)(-(logl|lratio))?-r1(qwen1\.5b|qwen7b|llama8b)-\d+n\d+g-\d+k\b"
)


def _get(cfg: config.RunConfig, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part, ABSENT)
    return value


def test_every_recipe_has_a_row():
    assert PAPER_RECIPES, "no recipes found"
    assert set(PAPER_RECIPES) == set(EXPECTED), "recipes/ and the EXPECTED table must list the same runs"
    assert all((RECIPES / f"{name}.yaml").is_file() for name in FAMILY_EXPECTED)


FAMILY_NAME = re.compile(
    r"^disco-(logl|lratio)-(qwen3-4b|qwen3-8b|qwen3-30ba3b|qwen2\.5math7b|llama3\.1-8b-instruct)-\d+n\d+g-\d+k$"
)


@pytest.mark.parametrize("name", sorted(FAMILY_EXPECTED))
def test_family_recipe_values_form_and_layout(name):
    """The cited values, the paper's objective kept, a name of the recipe form, a layout that fits the cluster."""
    cfg = parts.load(RECIPES / f"{name}.yaml")
    mismatches = {k: (_get(cfg, k), v) for k, v in FAMILY_EXPECTED[name].items() if _get(cfg, k) != v}
    assert mismatches == {}, f"{name}: (recipe, expected) per key"
    for key, value in {**CONSTRAINT, "loss.name": "disco", "loss.tau": 10.0, "data.train": DEEPSCALER}.items():
        assert _get(cfg, key) == value, key  # the paper's objective and data (exemplar values)
    assert FAMILY_NAME.match(name), name
    assert cfg.logging.run_dir == f"runs/{name}"
    nodes, gpus = map(int, re.search(r"-(\d+)n(\d+)g-", name).groups())
    assert (cfg.cluster.nodes, cfg.cluster.gpus_per_node) == (nodes, gpus)
    assert f"-{cfg.generation.max_response_tokens // 1024}k" in name
    text = (RECIPES / f"{name}.yaml").read_text()
    for line in text.splitlines():  # a source (or "our choice" / "assumption") on every value it sets
        body = line.split("#", 1)[0]
        if re.match(r"^\s+[\w.]+:\s*\S", body) and not body.strip().startswith("-"):
            assert "#" in line, f"{name}: no source comment on {line.strip()!r}"


@pytest.mark.parametrize("name", PAPER_RECIPES)
def test_recipe_loads_with_paper_values(name):
    cfg = parts.load(RECIPES / f"{name}.yaml")
    mismatches = {k: (_get(cfg, k), v) for k, v in EXPECTED[name].items() if _get(cfg, k) != v}
    assert mismatches == {}, f"{name}: (recipe, expected) per key"
    assert cfg.updates_per_step == 4  # 128 prompts / 32 per mini-batch
    assert cfg.world_size == cfg.cluster.nodes * 8


@pytest.mark.parametrize("name", PAPER_RECIPES)
def test_recipe_form(name):
    """`defaults: [disco, _self_]`, a name of the form <algo>-<score>-<model>-<N>n<G>g-<len>, its own run folder,
    and a source comment on every value it sets (STYLE principle 5)."""
    text = (RECIPES / f"{name}.yaml").read_text()
    raw = yaml.safe_load(text)
    assert raw["defaults"] == ["disco", "_self_"]
    assert NAME.match(name), name
    cfg = parts.load(RECIPES / f"{name}.yaml")
    assert cfg.logging.run_dir == f"runs/{name}"
    nodes, gpus = map(int, re.search(r"-(\d+)n(\d+)g-", name).groups())
    assert (cfg.cluster.nodes, cfg.cluster.gpus_per_node) == (nodes, gpus)
    assert f"-{cfg.generation.max_response_tokens // 1024}k" in name
    for line in text.splitlines():
        body = line.split("#", 1)[0]
        is_value = re.match(r"^\s+[\w.]+:\s*\S", body)
        if is_value and not body.strip().startswith("-"):
            assert "#" in line, f"{name}: no source comment on {line.strip()!r}"


@pytest.mark.parametrize("name", PAPER_RECIPES + sorted(FAMILY_EXPECTED))
def test_recipe_sets_only_what_differs_from_the_exemplar(name):
    """Each value a recipe states differs from the exemplar's, except values that document a choice in place
    (tau, clip_eps, a zero KL coefficient, overlong penalty, GPG's, TRPA's and DRPO's own keys, run_dir): restating
    those keeps a recipe readable."""
    exemplar = parts.load(RECIPES / "disco.yaml")
    raw = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    restated_on_purpose = {"loss.tau", "loss.clip_eps", "loss.kl_coef", "algorithm.overlong_penalty"}
    restated_on_purpose |= {f"loss.{k}" for k in ("adv_std_norm", "alpha_correction", "token_norm")}
    restated_on_purpose |= {f"loss.{k}" for k in ("trpa_beta", "trpa_anisotropy", "tr_kl_coef", "drpo_lambda")}
    restated_on_purpose |= {"logging.run_dir"}
    same = []
    for section, values in raw.items():
        if section == "defaults":
            continue
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if dotted not in restated_on_purpose and _get(exemplar, dotted) == value:
                same.append(dotted)
    assert same == [], f"{name} restates exemplar values"


@pytest.mark.parametrize("name", sorted(ASYNC_VARIANTS))
def test_async_variant_differs_from_its_base_only_in_the_rollout_layout(name):
    base_name = ASYNC_VARIANTS[name]
    raw = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    assert raw["defaults"] == [base_name, "_self_"]
    cfg, base = parts.load(RECIPES / f"{name}.yaml"), parts.load(RECIPES / f"{base_name}.yaml")
    assert cfg.algorithm.async_rollouts and cfg.rollout_correction == "seq_tis"
    assert cfg.generation_world_size >= 1 and cfg.launch_world_size == cfg.world_size + cfg.generation_world_size
    assert cfg.logging.run_dir == f"runs/{name}"
    layout = {"algorithm": {"async_rollouts", "max_staleness"}, "cluster": {"nodes", "generation_nodes"}}
    layout["cluster"] |= {"gpus_per_node", "generation_gpus_per_node"}
    ours, theirs = cfg.model_dump(), base.model_dump()
    differs = {
        f"{section}.{key}"
        for section, values in ours.items()
        for key, value in values.items()
        if value != theirs[section][key] and key not in layout.get(section, set()) and key != "run_dir"
    }
    assert differs == set(), differs
