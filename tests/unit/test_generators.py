"""The generator backends' declarations: each backend's own keys, checked by its model, and what it resolves."""

from pathlib import Path

import pytest

from nemo_disco import config, generators, parts

ROOT = Path(__file__).resolve().parents[2]
EXEMPLAR = ROOT / "recipes" / "disco.yaml"
TINY = ROOT / "recipes" / "tiny-cpu.yaml"


def test_engine_share_and_sleep_level_resolve_by_where_the_generator_runs(tmp_path):
    base = [f"logging.run_dir={tmp_path}"]
    sync = parts.load(EXEMPLAR, base)
    assert (sync.generation.gpu_memory_utilization, sync.generation.sleep_level) == ("auto", "auto")
    assert (generators.gpu_memory_utilization(sync), generators.sleep_level(sync)) == (
        config.COLOCATED_GPU_MEMORY_UTILIZATION,
        2,
    )
    assert sync.generation.enforce_eager is False
    layout = ["algorithm.async_rollouts=true", "cluster.generation_gpus_per_node=2", "cluster.gpus_per_node=6"]
    layout += ["algorithm.prompts_per_step=96", "algorithm.minibatch_prompts=24"]
    asynchronous = parts.load(EXEMPLAR, [*base, *layout])
    assert generators.gpu_memory_utilization(asynchronous) == config.OWN_GPU_MEMORY_UTILIZATION == 0.9
    assert generators.sleep_level(asynchronous) == 0
    stated = parts.load(EXEMPLAR, [*base, "generation.gpu_memory_utilization=0.5", "generation.sleep_level=1"])
    assert (generators.gpu_memory_utilization(stated), generators.sleep_level(stated)) == (0.5, 1)
    with pytest.raises(config.ConfigError, match=r"^generation.gpu_memory_utilization=1.5: input should be less"):
        parts.load(EXEMPLAR, [*base, "generation.gpu_memory_utilization=1.5"])


def test_a_key_of_another_backend_is_one_line_naming_the_backend_that_has_it(tmp_path):
    base = [f"logging.run_dir={tmp_path}"]
    with pytest.raises(config.ConfigError, match=r"^generation.hf_decode is not a parameter of vllm \(hf has it\)$"):
        parts.load(EXEMPLAR, [*base, "generation.hf_decode=generate"])
    with pytest.raises(config.ConfigError, match=r"generation.enforce_eager is not a parameter of hf \(vllm has it\)$"):
        parts.load(TINY, [*base, "generation.enforce_eager=true"])
    with pytest.raises(config.ConfigError, match=r"^unknown config key 'generation.hf_decod' \(did you mean "):
        parts.load(TINY, [*base, "generation.hf_decod=generate"])
    with pytest.raises(config.ConfigError, match=r"^generation.backend: unknown generator backend 'sglang'"):
        parts.load(TINY, [*base, "generation.backend=sglang"])
    with pytest.raises(config.ConfigError, match=r"generation.tensor_parallel_size=2 needs generation.backend=vllm"):
        parts.load(TINY, [*base, "generation.tensor_parallel_size=2", "cluster.gpus_per_node=2"])


def test_a_recipe_key_of_another_backend_is_named_with_its_file_and_line(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"defaults: [tiny-cpu, _self_]\nlogging:\n  run_dir: {tmp_path}\ngeneration:\n  sleep_level: 1\n")
    with pytest.raises(config.ConfigError) as err:
        parts.load(recipe)
    assert str(err.value) == f"{recipe}:5: generation.sleep_level is not a parameter of hf (vllm has it)"


def test_naming_another_backend_starts_the_section_afresh_and_fills_in_its_defaults(tmp_path):
    base = [f"logging.run_dir={tmp_path}"]
    tiny = parts.load(TINY, base)  # hf, hf_batch_size 256 from the recipe
    assert (tiny.generation.hf_batch_size, tiny.generation.hf_decode) == (256, "auto")
    as_vllm = parts.load(TINY, [*base, "generation.backend=vllm"])  # the recipe's hf_batch_size is dropped
    assert "hf_batch_size" not in as_vllm.generation.model_extra
    assert as_vllm.generation.sleep_level == "auto" and as_vllm.generation.temperature == tiny.generation.temperature
    assert generators.params_of(as_vllm, "hf") == generators.HFParams()  # the warm-up's decoder: the defaults
    exemplar = parts.load(EXEMPLAR, [*base, "generation.backend=hf"])  # disco.yaml's vLLM keys are dropped
    assert "sleep_level" not in exemplar.generation.model_extra and exemplar.generation.hf_batch_size == 64
    assert parts.compose(exemplar) == exemplar


def test_every_backend_declares_a_class_with_the_factorys_constructors():
    for name, backend in generators.BACKENDS.items():
        assert backend.name == name and issubclass(backend.params, generators.BackendParams)
        assert not set(backend.params.model_fields) & set(config.GenerationConfig.model_fields), name
        cls = backend.cls()
        assert callable(cls.build) and callable(cls.run_options), name
    with pytest.raises(ValueError, match="already registered"):
        generators.register_backend(generators.BACKENDS["hf"])
