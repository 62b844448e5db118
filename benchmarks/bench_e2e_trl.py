"""End-to-end step throughput on CPU: nemo_disco (grpo, disco, disco with async rollouts) against TRL's GRPOTrainer.

Both sides get the same random tiny Qwen2 (4 layers, hidden 128; built once with nemo_disco.tiny), the same
character-level tokenizer, the same synthetic arithmetic prompts (nemo_disco.data, prompt template
``{problem}=``), 16 prompts x 8 rollouts per step, the same completion length, AdamW with the same learning
rate, betas, eps, weight decay (0), gradient clip (1.0) and constant schedule, one optimizer update per step
from one micro-batch of all 128 rollouts, the same sampling (temperature 1, no top-k / top-p), no KL /
reference model, and the same reward (nemo_disco's math grader pool). Generation is forced to exactly
``max tokens``: nemo_disco with ``SamplingParams.ignore_eos`` (the generator is wrapped), TRL with
``generation_kwargs={"min_new_tokens": max}`` (transformers masks EOS until the budget is reached). Each
completion length measured is reported, so a run that stopped early would show. Each side samples with its
own code: nemo_disco's transformers generator with its KV-cached decode loop (``generation/kv_decode.py``),
TRL with transformers' ``generate``; both on the same model in float32 on the CPU.

Kinds and their thread budget (``--cores``, default 2, the machine's two cores):

- ``nd-grpo``, ``nd-disco``: synchronous nemo_disco (generate, grade, train in turn), one process with
  ``cores`` torch threads;
- ``nd-disco-async``: DisCO with ``algorithm.async_rollouts=true``, ``max_staleness=1``: the trainer process
  and one generator process of its own, sharing the cores as ``nemo-disco train`` shares them without a
  launcher: the trainer ``cores`` threads, the generator ``cores / 2``, OpenMP's idle threads sleeping
  (``OMP_WAIT_POLICY=passive``) instead of spinning; step t's rollouts are made while step t-1 trains. Its
  step time is the trainer's wall clock from one step's end to the next (the generator works meanwhile in its
  process), in steady state (the warm-up steps, the pipeline's fill among them, are not measured);
- ``trl``: TRL's GRPOTrainer, one process with ``cores`` torch threads.

Runs alternate in one process tree (a fresh child process per run: nd-grpo, nd-disco, nd-disco-async, trl,
nd-grpo, ...), so slow phases of a shared machine hit every framework alike; the figures are medians over
rounds, the ratio is TRL's seconds per step over nemo_disco's (= completion tokens/s of nemo_disco over TRL's).

Run::

    .venv/bin/python benchmarks/bench_e2e_trl.py                 # 3 rounds at 32 and 128 tokens, every kind
    .venv/bin/python benchmarks/bench_e2e_trl.py --quick         # 1 round, 32 tokens, 2 measured steps
    .venv/bin/python benchmarks/bench_e2e_trl.py --kinds nd-disco-async trl --tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

from nemo_disco import cli, losses  # noqa: E402

PROMPTS_PER_STEP = 16
ROLLOUTS_PER_PROMPT = 8
MAX_PROMPT_TOKENS = 32
LR = 1e-5
SEED = 1
KINDS = ("nd-grpo", "nd-disco", "nd-disco-async", "trl")
ASYNC_OVERRIDES = ["algorithm.async_rollouts=true", "algorithm.max_staleness=1", "cluster.generation_gpus_per_node=1"]


def thread_budget(kind: str, cores: int) -> dict[str, int]:
    """Torch threads of each process of ``kind`` on ``cores`` cores: the trainer's, and the generator's if apart.

    The asynchronous kind shares the cores as ``nemo-disco train`` does without a launcher (``cli.thread_shares``).
    """
    if kind.endswith("-async"):
        trainer, generator = cli.thread_shares(cores, 2)
        return {"trainer": trainer, "generator": generator}
    return {"trainer": cores}


def openmp_env(kind: str) -> dict[str, str]:
    """OpenMP settings of ``kind``'s processes beyond their thread count: none, or the shared cores' wait policy."""
    return {"OMP_WAIT_POLICY": cli.SHARED_CORES_WAIT_POLICY} if kind.endswith("-async") else {}


def budget_label(budget: dict[str, int]) -> str:
    """The budget as the table shows it: 2 (1 process), or 1 + 1 (trainer + generator)."""
    if "generator" in budget:
        return f"{budget['trainer']} + {budget['generator']} (trainer + generator)"
    return f"{budget['trainer']} (1 process)"


def _rollouts() -> int:
    return PROMPTS_PER_STEP * ROLLOUTS_PER_PROMPT


def nd_overrides(model_dir: Path, loss: str, tokens: int, steps: int) -> list[str]:
    """The nemo_disco side of the comparison (tiny-cpu recipe + these)."""
    return [
        f"policy.model_path={model_dir}",
        f"loss.name={loss}",
        f"algorithm.prompts_per_step={PROMPTS_PER_STEP}",
        f"algorithm.minibatch_prompts={PROMPTS_PER_STEP}",  # one optimizer update per step, as TRL below
        f"algorithm.rollouts_per_prompt={ROLLOUTS_PER_PROMPT}",
        f"algorithm.steps={steps}",
        f"algorithm.seed={SEED}",
        f"generation.max_response_tokens={tokens}",
        f"generation.max_prompt_tokens={MAX_PROMPT_TOKENS}",
        f"generation.hf_batch_size={_rollouts()}",  # one generate call for the whole step, as TRL
        "generation.temperature=1.0",
        "generation.top_p=1.0",
        "generation.top_k=-1",
        f"policy.lr={LR}",
        "policy.weight_decay=0.0",
        "policy.grad_clip=1.0",
        "policy.lr_schedule=constant",
        # One micro-batch holding all 128 rollouts, as TRL's per_device_train_batch_size=128.
        f"policy.microbatch_tokens={_rollouts() * (MAX_PROMPT_TOKENS + tokens)}",
        # No KL regulariser, as TRL's beta=0 (a key only the losses that have one take).
        *(["loss.kl_coef=0.0"] if "kl_coef" in losses.find_loss(loss).hparams.model_fields else []),
    ]


# ----------------------------------------------------------------------------------------------------------------------
# Children


def child_nd(args: argparse.Namespace) -> dict[str, Any]:
    """One nemo_disco run: setup, warm-up steps, measured steps (asynchronous: with its generator process)."""
    kind = args.child
    budget = thread_budget(kind, args.cores)
    threads = C.set_threads(budget["trainer"])
    loss = kind.removeprefix("nd-").removesuffix("-async")
    overrides = nd_overrides(args.model_dir, loss, args.tokens, args.warmup + args.steps)
    with tempfile.TemporaryDirectory(prefix="bench_nd_") as tmp:
        if "generator" in budget:
            out = C.nd_async_steps(
                Path(tmp),
                [*overrides, *ASYNC_OVERRIDES],
                args.steps,
                args.warmup,
                fixed_length=True,
                generator_threads=budget["generator"],
            )
        else:
            cfg = C.load_config(Path(tmp), overrides)
            prof = Path(args.profile) if args.profile else None
            out = C.nd_steps(cfg, args.steps, args.warmup, fixed_length=True, profile=prof)
    res = {
        "kind": kind,
        "tokens": args.tokens,
        "threads": {"trainer": threads, **({"generator": out["generator_threads"]} if "generator" in budget else {})},
        "setup_s": out["setup_s"],
        "wall_s": out["wall_s"],
        "s_per_step": statistics.median(out["wall_s"]),
        "generate_s": statistics.median(m.get("timing/generate", 0.0) for m in out["metrics"]),
        "grade_s": statistics.median(m.get("timing/grade", 0.0) for m in out["metrics"]),
        "completion_tokens_per_step": statistics.median(out["completion_tokens"]),
    }
    if "generator" in budget:
        phases = [C.async_step_phases(m, w) for m, w in zip(out["metrics"], out["wall_s"], strict=True)]
    else:
        phases = [C.step_phases(m) for m in out["metrics"]]
    res["phases_s"] = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    return res


def _prompt_dataset(model_dir: Path, size: int) -> tuple[list[str], list[str]]:
    """The synthetic prompts exactly as nemo_disco encodes them (decoded back to text for TRL) and their answers."""
    from transformers import AutoTokenizer

    from nemo_disco.data import encode_prompts, load_problems

    cfg = C.load_config(Path(tempfile.gettempdir()), nd_overrides(model_dir, "grpo", 32, 1))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    problems, _ = load_problems(
        cfg.data.train, split=cfg.data.split, on_bad_row="error", synthetic_size=size, seed=cfg.data.seed
    )
    ids, kept, _ = encode_prompts(
        tok,
        problems,
        template=cfg.data.prompt_template,
        use_chat_template=cfg.data.use_chat_template,
        max_prompt_tokens=cfg.generation.max_prompt_tokens,
    )
    texts = [tok.decode(x) for x in ids]
    if [tok(t, add_special_tokens=False)["input_ids"] for t in texts[:50]] != [list(x) for x in ids[:50]]:
        raise RuntimeError("prompt text does not re-tokenize to nemo_disco's prompt ids")
    return texts, [problems[i].answer for i in kept]


def run_trl(
    model_dir: Path,
    tokens: int,
    steps: int,
    warmup: int,
    *,
    prompts_per_step: int = PROMPTS_PER_STEP,
    rollouts_per_prompt: int = ROLLOUTS_PER_PROMPT,
    bf16: bool = False,
) -> dict[str, Any]:
    """TRL's GRPOTrainer with the model, prompts, sizes, optimizer and grader of the nemo_disco side.

    On the CPU in float32 (``bf16=False``), or on the GPU in bf16 (``bf16=True``, CUDA required).
    ``warmup + steps`` optimizer steps; the first ``warmup`` are not timed. Torch's threads are the caller's.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nemo_disco.parts import loss_of
    from nemo_disco.rewards import GraderPool

    rollouts = prompts_per_step * rollouts_per_prompt
    cfg = C.load_config(Path(tempfile.gettempdir()), nd_overrides(model_dir, "grpo", tokens, 1))
    texts, answers = _prompt_dataset(model_dir, cfg.data.synthetic_size)
    dataset = Dataset.from_dict({"prompt": texts, "answer": answers})
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    grader = GraderPool(cfg.reward.grader, timeout_s=cfg.reward.timeout_s, workers=cfg.reward.workers)
    grade_s: list[float] = []

    def reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        t0 = time.perf_counter()
        scores, _metrics = grader.score(list(completions), list(answer))
        grade_s.append(time.perf_counter() - t0)
        return [float(s) for s in scores]

    gen_s: list[float] = []

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*a, **k)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            gen_s.append(time.perf_counter() - t0)
            return out

    ends: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            ends.append(time.perf_counter())

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None, **__: Any) -> None:
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    total = warmup + steps
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as tmp:
        targs = GRPOConfig(
            output_dir=tmp,
            use_cpu=not bf16,
            bf16=bf16,
            fp16=False,
            seed=SEED,
            max_steps=total,
            per_device_train_batch_size=rollouts,
            gradient_accumulation_steps=1,
            num_generations=rollouts_per_prompt,
            max_completion_length=tokens,
            generation_kwargs={"min_new_tokens": tokens},
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            learning_rate=LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            adam_beta1=cfg.policy.adam_beta1,
            adam_beta2=cfg.policy.adam_beta2,
            adam_epsilon=cfg.policy.adam_eps,
            max_grad_norm=1.0,
            beta=0.0,
            loss_type="grpo",
            num_iterations=1,
            epsilon=loss_of(cfg).hyperparameters["clip_eps"],  # the value nemo_disco's grpo binds
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            model_init_kwargs={"dtype": torch.bfloat16 if bf16 else torch.float32},
        )
        trainer = Timed(
            model=str(model_dir),
            reward_funcs=reward,
            args=targs,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
        t0 = time.perf_counter()
        try:
            trainer.train()
        finally:
            grader.close()
        train_s = time.perf_counter() - t0
    # A step's wall time runs from the previous step's end (the first measured step starts at the last warm-up's).
    walls = [b - a for a, b in zip(ends[warmup - 1 : -1], ends[warmup:], strict=True)]
    return {
        "kind": "trl",
        "tokens": tokens,
        "threads": {"trainer": torch.get_num_threads()},
        "train_s": train_s,
        "wall_s": walls,
        "s_per_step": statistics.median(walls),
        "generate_s": statistics.median(gen_s[warmup:]),
        "grade_s": statistics.median(grade_s[warmup:]),
        "completion_tokens_per_step": statistics.median(lengths[warmup:]) * rollouts,
    }


def child_trl(args: argparse.Namespace) -> dict[str, Any]:
    """One TRL GRPOTrainer run with the same model, prompts, sizes, optimizer and grader (CPU, float32)."""
    C.set_threads(thread_budget("trl", args.cores)["trainer"])
    return run_trl(args.model_dir, args.tokens, args.steps, args.warmup)


# ----------------------------------------------------------------------------------------------------------------------
# Parent


def _child_args(kind: str, tokens: int, model_dir: Path, args: argparse.Namespace) -> list[str]:
    return [
        "--child",
        kind,
        "--tokens",
        str(tokens),
        "--model-dir",
        str(model_dir),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--cores",
        str(args.cores),
    ]


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved rounds of every kind at every token budget; medians and ratios."""
    model_dir = C.build_bench_model(C.RESULTS / "e2e_model")
    runs: list[dict[str, Any]] = []
    discarded: list[dict[str, Any]] = []  # runs disturbed by other processes, run again
    for rnd in range(args.rounds):
        for tokens in args.tokens:
            for kind in args.kinds:
                threads = thread_budget(kind, args.cores)["trainer"]  # the child's OMP_NUM_THREADS
                for attempt in range(1 + args.reruns):
                    res = C.run_child(
                        Path(__file__),
                        _child_args(kind, tokens, model_dir, args),
                        timeout=1800,
                        threads=threads,
                        env=openmp_env(kind),
                        quiet_timeout_s=args.quiet_wait,
                        quiet_max_busy=args.max_others,
                    )
                    res["round"], res["attempt"] = rnd, attempt
                    if res["others_cpu_share"] <= args.max_others or attempt == args.reruns:
                        break
                    print(
                        f"round {rnd} {kind:14s} {tokens:4d} tokens: {res['s_per_step']:.3f} s/step with other "
                        f"processes on {res['others_cpu_share']:.0%} of the CPUs: discarded, run again",
                        flush=True,
                    )
                    discarded.append(res)
                runs.append(res)
                print(
                    f"round {rnd} {kind:14s} {tokens:4d} tokens: {res['s_per_step']:.3f} s/step "
                    f"(generate {res['generate_s']:.3f} s, {res['completion_tokens_per_step']:.0f} tokens/step, "
                    f"threads {res['threads']}, load {res['load_avg_before']:.2f}, "
                    f"others {res['others_cpu_share']:.1%}, steal {res['steal_share']:.1%})",
                    flush=True,
                )
    table: dict[str, Any] = {}
    for tokens in args.tokens:
        row: dict[str, Any] = {}
        for kind in args.kinds:
            mine = [r for r in runs if r["kind"] == kind and r["tokens"] == tokens]
            sps = C.summarize(r["s_per_step"] for r in mine)
            tps = C.summarize(r["completion_tokens_per_step"] / r["s_per_step"] for r in mine)
            row[kind] = {
                "threads": budget_label(thread_budget(kind, args.cores)),
                "s_per_step": sps,
                "completion_tokens_per_s": tps,
                "generate_s": C.summarize(r["generate_s"] for r in mine),
                "completion_tokens_per_step": C.summarize(r["completion_tokens_per_step"] for r in mine),
            }
            if mine and "phases_s" in mine[0]:  # medians over rounds of each run's median phase
                row[kind]["phases_s"] = {
                    k: statistics.median(r["phases_s"][k] for r in mine) for k in mine[0]["phases_s"]
                }
        if "trl" in args.kinds:
            for kind in args.kinds:
                if kind == "trl":
                    continue
                # Per-round ratios (same round = neighbouring runs) and the ratio of the medians.
                paired = []
                for rnd in range(args.rounds):
                    a = [r for r in runs if r["round"] == rnd and r["tokens"] == tokens and r["kind"] == kind]
                    b = [r for r in runs if r["round"] == rnd and r["tokens"] == tokens and r["kind"] == "trl"]
                    if a and b:
                        ta = a[0]["completion_tokens_per_step"] / a[0]["s_per_step"]
                        tb = b[0]["completion_tokens_per_step"] / b[0]["s_per_step"]
                        paired.append(ta / tb)
                row[kind]["tokens_per_s_vs_trl"] = {
                    "ratio_of_medians": row[kind]["completion_tokens_per_s"]["median"]
                    / row["trl"]["completion_tokens_per_s"]["median"],
                    "per_round": C.summarize(paired),
                }
        table[str(tokens)] = row
    return {
        "settings": vars(args) | {"model_dir": str(model_dir)},
        "runs": runs,
        "discarded_runs": discarded,
        "table": table,
    }


def _print_table(result: dict[str, Any]) -> None:
    print(
        "\ntokens  kind            threads                         s/step (median, min-max)  completion tok/s"
        "  generate s  vs TRL"
    )
    for tokens, row in result["table"].items():
        for kind, r in row.items():
            s = r["s_per_step"]
            ratio = r.get("tokens_per_s_vs_trl", {}).get("ratio_of_medians")
            print(
                f"{tokens:>6}  {kind:14s}  {r['threads']:30s}  {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"
                f"{'':6s}{r['completion_tokens_per_s']['median']:10.0f}   {r['generate_s']['median']:9.3f}"
                f"   {'' if ratio is None else f'{ratio:.2f}x'}"
            )
    for tokens, row in result["table"].items():
        for kind, r in row.items():
            if "phases_s" in r:
                phases = ", ".join(f"{k} {v:.3f}" for k, v in r["phases_s"].items())
                print(f"{tokens:>6}  {kind:14s}  seconds per step: {phases}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--profile", default=None, help="(child) write a cProfile of the measured nemo_disco steps here")
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 128], help="completion tokens (fixed length)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (one run of every kind per round)")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per run")
    ap.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps per run (at least 1; async: at least 2, the pipeline fills)",
    )
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="kinds to run (default: all)")
    ap.add_argument(
        "--cores",
        type=int,
        default=2,
        help="thread budget of every kind: one process with this many torch threads (nd-grpo, nd-disco, trl), or "
        "trainer and generator processes with half each (nd-disco-async)",
    )
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=60.0,
        help="seconds to wait before each run for other processes to leave a core idle (then it runs anyway and "
        "records how busy the machine was; a 2-thread process on a busy 2-core machine slows many-fold)",
    )
    ap.add_argument(
        "--max-others",
        type=float,
        default=0.1,
        help="share of the CPUs other processes may use before a run starts and during it; a run above it is "
        "run again (up to --reruns times; the last attempt is kept, its share recorded)",
    )
    ap.add_argument("--reruns", type=int, default=3, help="extra attempts of a run disturbed by other processes")
    ap.add_argument("--quick", action="store_true", help="1 round at 32 tokens, 2 measured steps, no reruns")
    args = ap.parse_args(argv)
    if args.child:
        if args.tokens and len(args.tokens) != 1:
            ap.error("--child takes one --tokens value")
        args.tokens = args.tokens[0]
        C.emit(child_nd(args) if args.child.startswith("nd-") else child_trl(args))
        return 0
    if args.warmup < 1:
        ap.error("--warmup must be at least 1")
    if any(k.endswith("-async") for k in args.kinds) and args.warmup < 2:
        ap.error("nd-disco-async needs --warmup 2 or more (step 1 waits for the first rollouts, step 2 was made ahead)")
    if args.quick:
        args.rounds, args.tokens, args.steps, args.reruns = 1, [32], 2, 0
    if "trl" in args.kinds:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("trl is not installed: pip install trl==1.16.0 (see benchmarks/README.md); nemo_disco only")
            args.kinds = [k for k in args.kinds if k != "trl"]
    result = compare(args)
    _print_table(result)
    path = C.write_json("e2e_trl", result)
    print(f"\nwrote {path}")
    print(json.dumps(result["table"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
