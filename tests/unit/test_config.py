import re
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_disco import config, parts
from nemo_disco.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXEMPLAR = ROOT / "recipes" / "disco.yaml"


def _recipe(tmp_path: Path, name: str, text: str) -> Path:
    (tmp_path / "disco.yaml").write_text(EXEMPLAR.read_text())
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    return p


def test_exemplar_loads_with_paper_values():
    cfg = config.load(EXEMPLAR)
    # paper §6 / the authors' 1.5B log-L script
    assert cfg.loss.name == "disco" and cfg.loss.score == "logl"
    assert (cfg.loss.tau, cfg.loss.delta, cfg.loss.beta) == (10.0, 1e-4, 1e3)
    assert (cfg.algorithm.prompts_per_step, cfg.algorithm.rollouts_per_prompt, cfg.algorithm.minibatch_prompts) == (
        128,
        8,
        32,
    )
    assert cfg.updates_per_step == 4  # 128 / 32
    assert cfg.policy.lr == 2e-6 and cfg.generation.temperature == 0.6
    assert cfg.generation.max_response_tokens == 8192


def test_exemplar_states_every_schema_field():
    """disco.yaml is the spec: it lists every field of the schema (so it reads as documentation)."""
    import yaml

    raw = yaml.safe_load(EXEMPLAR.read_text())

    def leaves(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    stated = set(leaves(raw))
    schema = {k for k, sec in config._KEYS.items() if sec is None and not k.startswith("policy.tiny.")}
    assert schema - stated == set(), "fields missing from recipes/disco.yaml"


def test_defaults_list_composition_and_override_order(tmp_path):
    child = _recipe(
        tmp_path,
        "child",
        "defaults:\n  - disco\n  - _self_\nloss:\n  score: lratio\n  tau: 1.0\nalgorithm:\n  steps: 7\n",
    )
    cfg = config.load(child)
    assert cfg.loss.score == "lratio" and cfg.loss.tau == 1.0 and cfg.algorithm.steps == 7
    assert cfg.loss.beta == 1e3  # inherited from disco.yaml
    # Command-line overrides win over the recipe.
    cfg = config.load(child, ["loss.tau=5", "algorithm.steps=3"])
    assert cfg.loss.tau == 5.0 and cfg.algorithm.steps == 3


def test_nested_defaults(tmp_path):
    _recipe(tmp_path, "mid", "defaults:\n  - disco\n  - _self_\nloss:\n  tau: 2.0\n")
    leaf = tmp_path / "leaf.yaml"
    leaf.write_text("defaults:\n  - mid\n  - _self_\nloss:\n  delta: 0.5\n")
    cfg = config.load(leaf)
    assert (cfg.loss.tau, cfg.loss.delta) == (2.0, 0.5)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("loss.betta=1", "unknown config key 'loss.betta'"),
        ("loss.tau=-1", "loss.tau=-1"),
        ("loss.tau=0", "loss.tau=0"),
        ("loss.delta=-0.1", "loss.delta=-0.1"),
        ("loss.beta=-1", "loss.beta=-1"),
        ("loss.name=ppo", "unknown loss 'ppo'"),
        ("loss.tau=abc", "loss.tau='abc'"),
        (
            "algorithm.minibatch_prompts=30",
            "algorithm.prompts_per_step=128 must be divisible by algorithm.minibatch_prompts=30",
        ),
        ("algorithm.prompts_per_step=0", "algorithm.prompts_per_step=0"),
        ("generation.temperature=0", "generation.temperature=0"),
        ("generation.top_p=1.5", "generation.top_p=1.5"),
        ("policy.tensor_parallel_size=3", "must divide cluster.nodes x cluster.gpus_per_node = 8"),
        ("generation.tensor_parallel_size=3", "generation.tensor_parallel_size=3 must divide"),
        ("reward.timeout_s=0", "reward.timeout_s=0"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last=0"),
        ("data.on_bad_row=ignore", "data.on_bad_row='ignore'"),
        ("data.val_every=5", "data.val_every=5 needs data.val"),
        ("policy.expert_parallel_size=3", "policy.expert_parallel_size=3 must divide the ranks of a pipeline stage"),
        ("policy.router_dtype=bfloat16", "policy.router_dtype='bfloat16'"),
        ("policy.tiny.hidden_size=62", "hidden_size=62 must be divisible by num_attention_heads=4 (or set head_dim)"),
        ("policy.tiny.num_experts_per_tok=5", "num_experts_per_tok=5 must not exceed num_experts=4"),
        ("data.chat_template_kwargs=3", "data.chat_template_kwargs=3"),
        ("nonsense=1", "unknown config key 'nonsense'"),
        ("loss", "is not of the form key=value"),
    ],
)
def test_every_validation_rule_names_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        parts.load(EXEMPLAR, [override])  # the loss section checked by the chosen loss's model too
    msg = str(err.value)
    assert fragment in msg
    assert "\n" not in msg


def test_grpo_er_takes_its_entropy_bonus_from_the_loss_unless_set_to_zero():
    # GRPO-ER's own default (0.001) applies when the recipe leaves it out; an explicit 0 is refused by its model.
    assert parts.load(EXEMPLAR, ["loss.name=grpo_er"]).loss.entropy_coef == 1e-3
    with pytest.raises(ConfigError, match="loss.entropy_coef=0: input should be greater than 0"):
        parts.load(EXEMPLAR, ["loss.name=grpo_er", "loss.entropy_coef=0"])


def test_data_parallel_must_divide_minibatch_rollouts():
    # 2 nodes x 8 GPUs, TP 1 -> DP 16; 1 prompt x 8 rollouts per mini-batch is not divisible by 16.
    with pytest.raises(ConfigError, match="must be divisible by the data-parallel size 16"):
        config.load(EXEMPLAR, ["cluster.nodes=2", "algorithm.minibatch_prompts=1", "algorithm.prompts_per_step=4"])


def test_unknown_key_in_recipe_file_is_named(tmp_path):
    bad = _recipe(tmp_path, "bad", "defaults:\n  - disco\n  - _self_\nloss:\n  betta: 3\n")
    with pytest.raises(ConfigError) as err:
        parts.load(bad)
    # The file and the line that set it, the closest key and the loss's keys, as for a command-line override.
    assert str(err.value).startswith(
        f"{bad}:5: unknown config key 'loss.betta' (did you mean loss.beta?); disco takes:"
    )


def test_unknown_key_is_named_in_the_inherited_recipe_that_sets_it(tmp_path):
    (tmp_path / "mid.yaml").write_text("defaults:\n  - disco\n  - _self_\nalgorithm:\n  step: 3\nloss:\n  tau: 2\n")
    leaf = tmp_path / "leaf.yaml"
    leaf.write_text("defaults:\n  - mid\n  - _self_\nlosss:\n  tau: 1\n")
    with pytest.raises(ConfigError) as err:
        config.load(leaf)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'mid.yaml'}:5: unknown config key 'algorithm.step' (did you mean ")
    assert message.endswith("(and 1 more: losss)")
    assert "\n" not in message


def test_a_wrong_value_is_named_with_the_file_and_line_that_set_it(tmp_path):
    """As an unknown key is: the recipe (here one a recipe inherits) and the line; an override: the override."""
    for name, text in [
        ("mid", "defaults: [disco, _self_]\ngeneration:\n  top_p: 1.5\n"),
        ("leaf", "defaults: [mid]\n"),
    ]:
        (tmp_path / f"{name}.yaml").write_text(text)
    message = "generation.top_p=1.5: Input should be less than or equal to 1"
    with pytest.raises(ConfigError, match=f"^{re.escape(str(tmp_path / 'mid.yaml'))}:3: {re.escape(message)}$"):
        config.load(tmp_path / "leaf.yaml")
    with pytest.raises(ConfigError, match=r"^generation.top_p=2: Input should be less than or equal to 1$"):
        config.load(tmp_path / "leaf.yaml", ["generation.top_p=2"])


def test_an_evaluation_composes_like_a_recipe_and_takes_a_runs_prompt_and_lengths(tmp_path):
    """Schema defaults < eval recipe < the run's saved values < the command line (overrides and flags)."""
    run_cfg = config.load(EXEMPLAR, ["data.prompt_template='Q {problem}'", "generation.max_response_tokens=64"])
    config.save(run_cfg, tmp_path / "config.yaml")
    values = config.run_values(tmp_path / "config.yaml")
    assert set(values) == set(config.RUN_KEYS) and values["generation.max_response_tokens"] == 64
    recipe = tmp_path / "e.yaml"
    recipe.write_text("generation:\n  max_response_tokens: 100\n  max_prompt_tokens: 50\n  samples: 3\n")
    cfg = config.load_eval(
        recipe, ["generation.max_prompt_tokens=7"], run=values, flags={"generation.seed": ("--seed 4", 4)}
    )
    assert cfg.data.prompt_template == "Q {problem}" and cfg.generation.max_response_tokens == 64  # the run's
    assert (cfg.generation.max_prompt_tokens, cfg.generation.seed, cfg.generation.samples) == (7, 4, 3)
    assert cfg.generation.top_p == 0.95 and cfg.reward == config.GradingConfig()  # the schema's
    with pytest.raises(ConfigError, match=r"^model=m and run=r: evaluate one"):
        config.load_eval(None, ["model=m", "run=r"])
    with pytest.raises(ConfigError, match=r"^checkpoint=step_2 needs run"):
        config.load_eval(None, ["checkpoint=step_2"])


def test_a_recipe_outside_recipes_inherits_the_shipped_ones(tmp_path):
    """``defaults: [disco]`` in any folder: the shipped disco.yaml, unless the recipe's folder has its own."""
    mine = tmp_path / "exp" / "my.yaml"
    mine.parent.mkdir()
    mine.write_text("defaults:\n  - disco\n  - _self_\nloss:\n  tau: 1.0\n")
    cfg = config.load(mine, ["algorithm.steps=5"])
    shipped = config.load(EXEMPLAR)
    assert cfg.loss.tau == 1.0 and cfg.algorithm.steps == 5
    assert cfg.loss.beta == shipped.loss.beta and cfg.policy.model_path == shipped.policy.model_path
    # Two levels: a shipped recipe that itself inherits disco.yaml.
    (tmp_path / "exp" / "tiny.yaml").write_text("defaults:\n  - tiny-cpu\n  - _self_\nalgorithm:\n  steps: 3\n")
    tiny = config.load(tmp_path / "exp" / "tiny.yaml")
    assert tiny.algorithm.steps == 3 and tiny.policy.backend == "hf" and tiny.loss.delta == shipped.loss.delta
    # A disco.yaml beside the recipe wins over the shipped one.
    (tmp_path / "exp" / "disco.yaml").write_text(EXEMPLAR.read_text().replace("tau: 10.0", "tau: 3.0", 1))
    (tmp_path / "exp" / "other.yaml").write_text("defaults:\n  - disco\n  - _self_\n")
    assert config.load(tmp_path / "exp" / "other.yaml").loss.tau == 3.0


def test_a_missing_defaults_entry_names_where_the_loader_looked(tmp_path):
    mine = tmp_path / "my.yaml"
    mine.write_text("defaults:\n  - dsico\n  - _self_\n")
    with pytest.raises(ConfigError) as err:
        config.load(mine)
    assert str(err.value) == (
        f"{mine}: defaults entry 'dsico' not found: looked for dsico.yaml in {tmp_path} and "
        f"{config.SHIPPED_RECIPES} (did you mean disco?)"
    )


def test_wrong_type_in_recipe_file_is_named(tmp_path):
    bad = _recipe(tmp_path, "bad", "defaults:\n  - disco\n  - _self_\nalgorithm:\n  steps: many\n")
    with pytest.raises(ConfigError, match=r"algorithm\.steps='many'"):
        config.load(bad)


def test_missing_and_malformed_recipe(tmp_path):
    with pytest.raises(ConfigError, match="recipe file not found"):
        config.load(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("loss: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:\d+: invalid YAML"):
        config.load(broken)


def test_config_is_frozen():
    cfg = config.load(EXEMPLAR)
    with pytest.raises(Exception):  # noqa: B017  (pydantic raises ValidationError for frozen models)
        cfg.loss.tau = 3.0


def test_saved_config_round_trips(tmp_path):
    cfg = config.load(EXEMPLAR, ["loss.tau=3", "policy.tiny.num_layers=3", "data.val=math"])
    path = tmp_path / "config.yaml"
    config.save(cfg, path)
    again = config.load_resolved(path)
    assert again == cfg
    assert config.to_yaml(again) == path.read_text()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nemo_disco.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_cli_print_config_and_one_line_errors():
    ok = _cli("train", "--config", "recipes/disco.yaml", "--print-config")
    assert ok.returncode == 0, ok.stderr
    assert "tau: 10.0" in ok.stdout and "prompts_per_step: 128" in ok.stdout
    for override, key in (("loss.betta=1", "loss.betta"), ("loss.tau=-1", "loss.tau")):
        bad = _cli("train", "--config", "recipes/disco.yaml", "--print-config", override)
        assert bad.returncode == 2
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and key in lines[0] and "Traceback" not in bad.stderr


def test_generation_engines_fit_a_node():
    base = config.RunConfig().model_dump(mode="json")
    raw = {**base, "generation": {**base["generation"], "tensor_parallel_size": 3}}
    with pytest.raises(
        config.ConfigError, match=r"generation.tensor_parallel_size=3 must divide cluster.gpus_per_node=8"
    ):
        config.validate(raw)
    # Policy TP 2 with generation TP 1 (the 7B / 8B recipes) is a valid pairing: generation is split by engine.
    raw = {**base, "policy": {**base["policy"], "tensor_parallel_size": 2}}
    assert config.validate(raw).generation.tensor_parallel_size == 1


def test_chat_template_kwargs_take_entries_from_overrides():
    cfg = config.load(EXEMPLAR, ["data.chat_template_kwargs.enable_thinking=false"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert config.load(EXEMPLAR).data.chat_template_kwargs == {}
    with pytest.raises(ConfigError, match="unknown config key 'data.chat_template_kwarg.enable_thinking'"):
        config.load(EXEMPLAR, ["data.chat_template_kwarg.enable_thinking=false"])


def test_tiny_qwen3_may_set_head_dim_apart_from_hidden_over_heads():
    cfg = config.load(
        EXEMPLAR, ["policy.tiny.architecture=qwen3", "policy.tiny.hidden_size=62", "policy.tiny.head_dim=32"]
    )
    assert (cfg.policy.tiny.hidden_size, cfg.policy.tiny.head_dim) == (62, 32)


def test_async_rollout_layouts():
    """Where the generator's processes go (ranks after the trainer's) and the layouts that are refused."""

    def load(*overrides: str) -> config.RunConfig:
        return config.load(EXEMPLAR, ["algorithm.async_rollouts=true", *overrides])

    same_node = load("cluster.gpus_per_node=4", "cluster.generation_gpus_per_node=4")
    assert (same_node.world_size, same_node.generation_world_size, same_node.launch_layout) == (4, 4, (1, 8))
    own_nodes = load("cluster.nodes=2", "cluster.generation_nodes=1")
    assert (own_nodes.world_size, own_nodes.generation_world_size, own_nodes.launch_layout) == (16, 8, (3, 8))
    assert own_nodes.launch_world_size == 24 and own_nodes.rollout_correction == "seq_tis"
    # Generation TP counts the generator's processes, not the trainer's.
    tp2 = load("cluster.gpus_per_node=1", "cluster.generation_gpus_per_node=2", "generation.tensor_parallel_size=2")
    assert tp2.generation_world_size == 2
    sync = config.load(EXEMPLAR, ["cluster.generation_nodes=1"])  # ignored without async rollouts
    assert (sync.generation_world_size, sync.launch_layout, sync.rollout_correction) == (0, (1, 8), "none")
    for overrides, fragment in [
        ((), "cluster.generation_gpus_per_node=K"),
        (("cluster.nodes=2", "cluster.generation_gpus_per_node=8"), "set cluster.generation_nodes"),
        (("cluster.generation_nodes=1", "cluster.generation_gpus_per_node=4"), "must be 0 or cluster.gpus_per_node"),
        (("cluster.generation_gpus_per_node=3", "generation.tensor_parallel_size=2"), "must divide the generator"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            load(*overrides)


def test_the_readmes_training_examples_each_have_their_own_run_folder():
    """Every `nemo-disco train` line of the README that runs the demo recipe writes a run folder of its own (the
    demo's is runs/tiny-cpu): a shared folder would resume the other run, or stop on the resume guard."""
    import re
    import shlex

    readme = (ROOT / "README.md").read_text()
    lines = re.findall(r"nemo-disco train --config (recipes/tiny-cpu\.yaml[^`#\n]*)", readme)
    assert len(lines) >= 2, lines
    folders = {"make demo": config.load(ROOT / "recipes" / "tiny-cpu.yaml").logging.run_dir}
    for line in lines:
        recipe, *overrides = shlex.split(line)
        run_dir = config.load(ROOT / recipe, overrides).logging.run_dir
        assert run_dir not in folders.values(), (line, folders)
        folders[line] = run_dir


def test_activation_checkpointing_is_false_selective_or_full_and_true_reads_as_full(tmp_path):
    base = [f"logging.run_dir={tmp_path}"]
    assert config.load(EXEMPLAR, base).policy.activation_checkpointing is False
    assert (
        config.load(EXEMPLAR, [*base, "policy.activation_checkpointing=true"]).policy.activation_checkpointing == "full"
    )
    assert config.load(
        EXEMPLAR, [*base, "policy.activation_checkpointing=selective"]
    ).policy.activation_checkpointing == ("selective")
    with pytest.raises(config.ConfigError, match=r"^policy.activation_checkpointing='layers': Input should be"):
        config.load(EXEMPLAR, [*base, "policy.activation_checkpointing=layers"])
    with pytest.raises(
        config.ConfigError, match=r"^policy.activation_checkpointing=selective needs policy.backend=megatron"
    ):
        config.load(EXEMPLAR, [*base, "policy.activation_checkpointing=selective", "policy.backend=hf"])


def test_an_override_with_non_ascii_characters_needs_no_quotes():
    cfg = config.load(EXEMPLAR, ["logging.run_dir=runs/données", "data.chat_template_kwargs.name=é"])
    assert cfg.logging.run_dir == "runs/données" and cfg.data.chat_template_kwargs == {"name": "é"}
    assert config.load(EXEMPLAR, ["logging.run_dir='runs/été'"]).logging.run_dir == "runs/été"


def test_an_override_hydra_cannot_parse_is_blamed_not_the_recipe():
    with pytest.raises(config.ConfigError) as err:
        config.load(EXEMPLAR, ["data.chat_template_kwargs.x=[é,b]"])
    assert str(err.value).startswith("override 'data.chat_template_kwargs.x=[é,b]' cannot be parsed: quote a value")
