"""nemo_disco.plan: the memory plan's arithmetic, its sources of model shapes, the CLI and train's start-up refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_disco import config, plan

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
R1_7B = ROOT / "recipes" / "disco-logl-r1qwen7b-2n8g-8k.yaml"


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nemo_disco.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        timeout=120,
        check=False,
    )


def test_the_plan_imports_without_torch():
    code = "import sys, nemo_disco.plan, nemo_disco.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_counts_of_the_1p5b_by_hand():
    cfg = config.load(ROOT / "recipes" / "disco.yaml")
    c = plan.rank_counts(plan.model_shapes(cfg), tp=1, pp=1, ep=1, world=8, stage=0)
    # One layer: q 1536^2 + k, v 2 x 256 x 1536 + o 1536^2 = 5,505,024; q/k/v biases 1536 + 2 x 256 = 2,048;
    # SwiGLU 3 x 8960 x 1536 = 41,287,680; two norms 3,072 -> 46,797,824 x 28 layers = 1,310,339,072.
    # Untied embedding and output 2 x 151,936 x 1,536 = 466,747,392; final norm 1,536.
    assert c.weights == 1_310_339_072 + 466_747_392 + 1_536 == 1_777_088_000
    assert c.grads == c.weights and c.dp == 8
    assert c.optimizer == 1_777_088_000 // 8


def test_tensor_parallelism_pads_the_vocabulary_to_lcm_of_128_and_tp():
    assert plan.padded_vocab(151_936, 1) == 151_936  # 1187 x 128
    assert plan.padded_vocab(151_937, 2) == 152_064
    assert plan.padded_vocab(100, 3) == 384  # lcm(128, 3) = 384


def test_json_has_the_promised_keys_and_the_peak_is_the_largest_phase():
    out = _cli("plan", "--config", str(R1_7B), "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert {"gpu", "device_bytes", "peak_bytes", "peak_phase", "fits", "terms"} <= set(d)
    assert d["gpu"] == "h100-80gb" and isinstance(d["fits"], bool)
    by_phase: dict[str, int] = {}
    for phases in d["terms"].values():
        for phase, b in phases.items():
            by_phase[phase] = by_phase.get(phase, 0) + b
    assert by_phase == d["phases"]
    assert d["peak_bytes"] == max(by_phase.values()) == by_phase[d["peak_phase"]]
    assert d["fits"] == (d["peak_bytes"] <= d["device_bytes"])
    # The engine sleeps at level 2: nothing of the policy during generation, nothing of the engine but its graphs
    # while training.
    assert "generation" not in d["terms"]["policy weights"]
    assert set(d["terms"]["vLLM KV cache"]) == {"generation"}
    assert set(d["terms"]["vLLM CUDA graphs"]) == set(plan.PHASES)


def test_the_kv_cache_is_the_share_left_by_weights_and_profile():
    cfg = config.load(R1_7B)
    p = plan.make_plan(cfg, "a100-80gb")
    terms = {t.name: t.phases for t in p.groups[0].terms}
    engine = sum(terms[n]["generation"] for n in ("vLLM weights", "vLLM KV cache", "vLLM profile"))
    assert abs(engine - 0.6 * plan.GPUS["a100-80gb"].memory_bytes) <= 3  # auto -> COLOCATED_GPU_MEMORY_UTILIZATION
    # bf16 weights of the 7.6B model at generation TP 1.
    assert terms["vLLM weights"]["generation"] == 2 * 7_615_616_512


def test_sleep_level_0_keeps_the_engine_through_training():
    cfg = config.load(R1_7B, ["generation.sleep_level=0"])
    terms = {t.name: t.phases for t in plan.make_plan(cfg).groups[0].terms}
    assert terms["vLLM KV cache"]["training"] == terms["vLLM KV cache"]["generation"] > 0


def test_recompute_and_tensor_parallelism_shrink_the_activations():
    def act(*over: str) -> int:
        p = plan.make_plan(config.load(R1_7B, list(over)))
        return next(t for t in p.groups[0].terms if t.name == "activations").phases["training"]

    none, full = act("policy.activation_checkpointing=false"), act("policy.activation_checkpointing=full")
    assert full < none / 5
    assert act("policy.activation_checkpointing=false", "policy.tensor_parallel_size=4") < none / 1.9


def test_asynchronous_layouts_plan_trainer_and_generator_gpus_apart():
    d = json.loads(_cli("plan", "--config", "recipes/disco-logl-r1qwen7b-async-2n8g-8k.yaml", "--json").stdout)
    assert set(d["groups"]) == {"trainer", "generator"}
    assert "trainer/vLLM KV cache" not in d["terms"] and "generator/policy weights" not in d["terms"]
    assert set(d["terms"]["generator/vLLM KV cache"]) == {"generator/generation"}  # sleep level 0: it never sleeps
    assert d["peak_phase"].split("/")[0] in ("trainer", "generator")


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("gpu", ["h100-80gb", "a100-80gb"])
def test_every_shipped_recipe_fits_its_80gb_gpus(name, gpu):
    p = plan.make_plan(config.load(ROOT / "recipes" / name), gpu)
    assert p.fits, plan.refusal(p)


def test_a_local_model_folder_and_the_hub_cache_are_read_before_the_shipped_copy(tmp_path, monkeypatch):
    shipped = json.loads((plan.MODEL_CONFIGS / "deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B.json").read_text())
    local = tmp_path / "my-model"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({**shipped, "num_hidden_layers": 2}))
    cfg = config.load(ROOT / "recipes" / "disco.yaml", [f"policy.model_path={local}"])
    assert plan.model_shapes(cfg).layers == 2
    snapshot = tmp_path / "hub" / "models--deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({**shipped, "num_hidden_layers": 3}))
    cfg = config.load(ROOT / "recipes" / "disco.yaml")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert plan.model_shapes(cfg).layers == 3
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert plan.model_shapes(cfg).layers == 28  # the shipped copy


def test_tiny_models_are_planned_from_their_config_section():
    cfg = config.load(ROOT / "recipes" / "tiny-cpu.yaml", ["policy.tiny.num_layers=3"])
    s = plan.model_shapes(cfg)
    assert (s.source, s.layers, s.hidden, s.vocab) == ("policy.tiny", 3, 64, plan.TINY_VOCAB)


def test_an_unknown_model_is_one_line_and_exit_2():
    out = _cli(
        "plan", "--config", "recipes/disco.yaml", "policy.model_path=nobody/nothing", HF_HUB_CACHE="/nonexistent"
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "policy.model_path=nobody/nothing" in out.stderr


def test_a_bad_key_is_one_line_and_exit_2():
    out = _cli("plan", "--config", "recipes/disco.yaml", "policy.tensor_parallel_sise=2")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "tensor_parallel_sise" in out.stderr


def test_train_refuses_the_7b_at_tp_1_on_an_a100_40gb_in_one_line():
    out = _cli("train", "--config", str(R1_7B), "policy.tensor_parallel_size=1", "--gpu", "a100-40gb")
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    line = out.stderr
    assert line.startswith("nemo-disco train: error: the memory plan needs ")
    assert "training phase" in line and "a100-40gb" in line
    assert "largest term: gradient buffers" in line and "policy.tensor_parallel_size" in line


def test_the_check_passes_what_fits_and_can_be_switched_off():
    assert plan.check_at_startup(config.load(R1_7B), "a100-80gb") is None
    tp1 = ["policy.tensor_parallel_size=1"]
    assert plan.check_at_startup(config.load(R1_7B, tp1), "a100-40gb") is not None
    assert plan.check_at_startup(config.load(R1_7B, [*tp1, "policy.memory_check=false"]), "a100-40gb") is None


def test_the_table_names_every_term_with_its_formula_and_the_verdict():
    out = _cli("plan", "--config", str(R1_7B), "--gpu", "a100-40gb", "policy.tensor_parallel_size=1")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for term in ("policy weights", "gradient buffers", "optimizer states", "activations", "logits", "vLLM KV cache"):
        assert term in text
    assert "grad_reduce_in_fp32" in text and "fits: NO" in text and "GPU-hours" in text


def test_the_docs_table_is_what_the_script_prints_now():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_table", ROOT / "benchmarks" / "plan_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = (ROOT / "docs" / "planning.md").read_text()
    stale = [line for line in module.rows(plan.DEFAULT_GPU) if line not in doc]
    assert stale == [], "docs/planning.md is stale: make plan-table, and paste its table"


def test_the_torch_free_copies_agree_with_the_package():
    from nemo_disco import tiny, weights

    assert plan.TINY_VOCAB == tiny.VOCAB_SIZE and plan.VOCAB_MULTIPLE == weights.DEFAULT_VOCAB_MULTIPLE
    for vocab in (128, 151_936, 152_064, 128_256, 100_001):
        for tp in (1, 2, 3, 4, 8):
            assert plan.padded_vocab(vocab, tp) == weights.padded_vocab_size(vocab, tp)
    for path in plan.MODEL_CONFIGS.glob("*.json"):  # every shipped config parses as the model builder reads it
        config = json.loads(path.read_text())
        spec, shapes = weights.ModelSpec.from_hf_config(config, str(path)), plan.Shapes.from_hf_config(config, "x")
        assert (spec.num_layers, spec.hidden_size, spec.num_query_groups, spec.head_dim, spec.vocab_size) == (
            shapes.layers,
            shapes.hidden,
            shapes.kv_heads,
            shapes.head_dim,
            shapes.vocab,
        )
        assert (spec.tie_word_embeddings, spec.qkv_bias, spec.qk_layernorm, spec.num_experts) == (
            shapes.tied,
            shapes.qkv_bias,
            shapes.qk_norm,
            shapes.experts,
        )


#: Parameter counts the model cards and the hub state (the 8B Llamas' and Qwen2.5-7B's to the unit).
PUBLISHED_PARAMS = {
    "deepseek-ai--DeepSeek-R1-Distill-Qwen-1.5B": 1.78e9,
    "deepseek-ai--DeepSeek-R1-Distill-Qwen-7B": 7_615_616_512,
    "Qwen--Qwen2.5-Math-7B": 7_615_616_512,
    "deepseek-ai--DeepSeek-R1-Distill-Llama-8B": 8_030_261_248,
    "meta-llama--Llama-3.1-8B-Instruct": 8_030_261_248,
    "Qwen--Qwen3-4B": 4.02e9,
    "Qwen--Qwen3-8B": 8.19e9,
    "Qwen--Qwen3-30B-A3B": 30.5e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_shipped_configs_give_the_published_parameter_counts(name):
    shapes = plan.Shapes.from_hf_config(json.loads((plan.MODEL_CONFIGS / f"{name}.json").read_text()), name)
    assert abs(plan._param_total(shapes) / PUBLISHED_PARAMS[name] - 1) < 0.003


def test_qwen3_moe_activates_about_3_billion_parameters_per_token():
    shapes = plan.Shapes.from_hf_config(json.loads((plan.MODEL_CONFIGS / "Qwen--Qwen3-30B-A3B.json").read_text()), "x")
    # The model card's 3.3B activated includes the input embedding (151,936 x 2,048 = 0.31B), which costs no FLOPs.
    assert abs((plan._active_params(shapes) + 151_936 * 2_048) / 3.3e9 - 1) < 0.02


def test_the_transformers_generator_keeps_the_policy_and_its_own_copy_resident():
    cfg = config.load(ROOT / "recipes" / "disco.yaml", ["generation.backend=hf", "generation.hf_batch_size=16"])
    terms = {t.name: t.phases for t in plan.make_plan(cfg).groups[0].terms}
    assert "vLLM KV cache" not in terms
    assert set(terms["gradient buffers"]) == set(plan.PHASES) == set(terms["generator weights"])  # nothing offloaded
    # 16 rows x (1,024 + 8,192) tokens x 2 x 28 layers x 2 KV heads x 128 x 2 B = 16 x 9,216 x 28,672 B.
    assert terms["generator KV cache"] == {"generation": 16 * 9_216 * 28_672}


def test_the_start_up_check_leaves_the_transformers_policy_alone():
    tp1 = ["policy.tensor_parallel_size=1"]
    assert plan.check_at_startup(config.load(R1_7B, [*tp1, "policy.backend=hf"]), "a100-40gb") is None


@pytest.mark.parametrize(
    ("recipe", "overrides", "reference"),
    [
        ("trpa-r1qwen1.5b-1n8g-8k.yaml", [], True),  # TRPA's preference term is a log-ratio to the reference
        ("grpo-r1qwen1.5b-1n8g-8k.yaml", ["loss.kl_coef=0.001"], True),
        ("grpo-r1qwen1.5b-1n8g-8k.yaml", ["loss.kl_coef=0"], False),
        ("disco-logl-r1qwen1.5b-1n8g-8k.yaml", [], False),
    ],
)
def test_the_reference_policy_is_planned_where_the_loss_says_it_needs_one(recipe, overrides, reference):
    # The loss decides (its needs_reference), not a list of names in the plan: TRPA was left out by such a list.
    p = plan.make_plan(config.load(ROOT / "recipes" / recipe, overrides), "h100-80gb")
    assert ("reference weights" in {t.name for t in p.groups[0].terms}) is reference
