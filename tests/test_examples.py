"""The README's main job and the benchmark scripts, run as a user runs them (subprocesses, real files)."""

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trl import ModelConfig, TrlParser

from trl_fp8 import FP8GRPOConfig, convert_to_fp8
from trl_fp8.demo.families import available
from trl_fp8.demo.task import accuracy_reward


pytestmark = pytest.mark.xdist_group("examples")  # the `scripts` fixture starts every run its selected tests read
ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def script_commands(out: Path) -> dict[str, list[str]]:
    """The commands the tests below run as a user does, each writing into its own folder under `out`."""
    python, bench = sys.executable, ROOT / "benchmarks"
    return {
        "demo": [
            python, "-m", "accelerate.commands.launch", "--num_processes", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", str(ROOT / "examples" / "grpo_fp8.py"),
            "--config", str(ROOT / "recipes" / "demo_cpu.yaml"),
            "--output_dir", str(out / "demo"), "--max_steps", "2", "--per_device_train_batch_size", "16",
        ],
        "mismatch": [python, str(bench / "mismatch.py"), "--quick", "--output_dir", str(out / "mismatch")],
        "lora_mismatch": [python, str(bench / "lora_mismatch.py"), "--quick", "--output_dir", str(out / "lora_mismatch")],
        "families": [python, str(bench / "families.py"), "--quick", "--output_dir", str(out / "families")],
        # --bf16: TRL's default precision, where bf16 rounding alone separates learner and sampler.
        "families_bf16": [
            python, str(bench / "families.py"), "--bf16", "--steps", "2", "--families", "qwen3",
            "--output_dir", str(out / "families_bf16"),
        ],
        "gemma4_mismatch": [
            python, str(bench / "gemma4_mismatch.py"), "--bf16", "--steps", "2", "--variants", "sweep", "sweep_scaled",
            "--output_dir", str(out / "gemma4_mismatch"),
        ],
        # The GPU benchmark's plumbing, on tiny shapes (on CPU it times the emulated backend: the figures mean nothing).
        "gpu_bench": [python, str(bench / "gpu_bench.py"), "--smoke", "--output_dir", str(out / "gpu_bench")],
    }  # fmt: skip


# Which of those each test reads.
SCRIPT_RUNS = {
    "test_demo_runs_through_accelerate_launch": ["demo"],
    "test_mismatch_benchmark_quick": ["mismatch"],
    "test_lora_mismatch_benchmark_quick": ["lora_mismatch"],
    "test_families_benchmark_quick": ["families", "families_bf16"],
    "test_gemma4_mismatch_falls_with_scaled_attention_scores": ["gemma4_mismatch"],
    "test_gpu_bench_smoke": ["gpu_bench"],
}


@pytest.fixture(scope="module")
def scripts(request, tmp_path_factory):
    """`scripts(name) -> (returncode, stdout, stderr, output folder)` of `script_commands()[name]`. Every command the
    selected tests of this module read starts when the first of them asks: each runs on one core (OMP_NUM_THREADS=1),
    so together they keep the machine's cores busy where one after another they would leave all but one idle."""
    out = tmp_path_factory.mktemp("scripts")
    commands = script_commands(out)
    selected = {item.originalname for item in request.session.items if getattr(item, "module", None) is request.module}
    running = {}
    for name in sorted({n for test in selected for n in SCRIPT_RUNS.get(test, [])}):
        (out / name).mkdir()
        logs = [open(out / name / f"{stream}.txt", "w") for stream in ("stdout", "stderr")]  # pipes could fill up
        proc = subprocess.Popen(commands[name], env=ENV, stdout=logs[0], stderr=logs[1], text=True, cwd=out / name)
        running[name] = proc, logs

    def result(name: str) -> tuple[int, str, str, Path]:
        proc, logs = running[name]
        proc.wait(timeout=900)
        for log in logs:
            log.close()
        stdout, stderr = ((out / name / f"{stream}.txt").read_text() for stream in ("stdout", "stderr"))
        return proc.returncode, stdout, stderr, out / name

    yield result
    for proc, logs in running.values():
        proc.kill()
        for log in logs:
            log.close()


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_fp8", ROOT / "examples" / "grpo_fp8.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def demo_args(example, output_dir, *flags: str) -> tuple:
    """`example.main`'s arguments for the demo config, 16 prompts a step, no plot, with `flags` over them."""
    parser = TrlParser((example.ScriptArguments, FP8GRPOConfig, ModelConfig))
    common = ["--config", str(ROOT / "recipes" / "demo_cpu.yaml"), "--output_dir", str(output_dir)]
    common += ["--per_device_train_batch_size", "16", "--no_plot", "--report_to", "none"]
    return parser.parse_args_and_config(args=[*common, *flags])


def test_the_demo_reward_is_an_exact_match_up_to_surrounding_spaces():
    """The demo vocabulary has a space token: a sampled " 68" or "68 " is the right answer, "6 8" is not."""
    completions = [" 68", "68 ", "68<eos>", "6 8", "69"]
    assert accuracy_reward(completions, ["68"] * 5) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_every_recipe_parses_into_fp8_grpo_config(tmp_path):
    example = load_example()
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        parser = TrlParser((example.ScriptArguments, FP8GRPOConfig, ModelConfig))
        # GPU recipes ask for bf16, which TrainingArguments refuses without a GPU unless told it is a CPU run.
        script_args, training_args, _ = parser.parse_args_and_config(
            args=["--config", str(path), "--output_dir", str(tmp_path), "--use_cpu", "true"]
        )
        assert isinstance(training_args, FP8GRPOConfig), path.name
        assert training_args.resolved_fp8_recipe is not None
        assert all(callable(example.import_reward(p)) for p in script_args.reward_funcs), path.name
        # The accelerate config a GPU recipe names exists.
        for word in path.read_text().split():
            if word.startswith("examples/accelerate_configs/"):
                assert (ROOT / word).exists(), (path.name, word)


@pytest.mark.parametrize("q_lora_rank", [128, None], ids=["q_lora", "full_rank_q"])
def test_the_moonlight_recipe_keeps_exactly_mlas_low_rank_projections_in_high_precision(tmp_path, q_lora_rank):
    """NeMo RL keeps every linear whose name holds `a_proj` or `b_proj` in BF16; MLA has q_a_proj / q_b_proj only
    where the config sets q_lora_rank (DeepSeek-V2-Lite-style configs have a full-rank q_proj): no pattern may then
    match nothing (a warning), and nothing else may be kept."""
    from trl_fp8.demo.tiny_moe import MOONLIGHT_RECIPE, tiny_deepseek_v3
    from trl_fp8.quant.convert import select_fp8_linears

    parser = TrlParser((load_example().ScriptArguments, FP8GRPOConfig, ModelConfig))
    path = ROOT / "recipes" / "moonlight_16b_a3b_fp8.yaml"
    args = parser.parse_args_and_config(
        args=["--config", str(path), "--output_dir", str(tmp_path), "--use_cpu", "true"]
    )
    recipe = args[1].resolved_fp8_recipe
    assert recipe.modules_to_not_convert == MOONLIGHT_RECIPE.modules_to_not_convert  # the tests' copy is the recipe's
    model = tiny_deepseek_v3(q_lora_rank=q_lora_rank)
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in name]
    mla = {n for n in linears if n.rsplit(".", 1)[1] in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")}
    assert len(mla) == (8 if q_lora_rank else 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "match no module", or anything else kept
        converted, kept = select_fp8_linears(model, recipe)
        convert_to_fp8(model, recipe)
    assert not kept and mla.isdisjoint(converted)
    assert set(converted) == {n for n in linears if n not in mla and not n.endswith("mlp.gate")}


def test_demo_runs_through_accelerate_launch(scripts):
    returncode, stdout, stderr, out = scripts("demo")
    assert returncode == 0, stderr[-4000:]
    assert "token_mult_prob_error" in stdout
    assert (out / "training_curves.png").stat().st_size > 10_000
    assert (out / "fp8_recipe.json").exists() and (out / "model.safetensors").exists()


def test_the_example_trains_lora_with_trls_model_config_flags(tmp_path, capsys):
    example = load_example()
    flags = ["--max_steps", "2", "--use_peft", "--lora_target_modules", "all-linear", "--lora_dropout", "0"]
    example.main(*demo_args(example, tmp_path, *flags))
    assert "token_mult_prob_error: mean 1.0000" in capsys.readouterr().out  # one FP8 grid with LoRA too
    assert (tmp_path / "adapter_model.safetensors").exists() and not (tmp_path / "model.safetensors").exists()


def test_the_example_resumes_from_a_checkpoint_as_trls_scripts_do(tmp_path, capsys):
    """`--resume_from_checkpoint` (TRL's scripts pass it to `train()`): a run interrupted after its checkpoint at
    step 1 and resumed from it ends with the weights of the run that went straight through."""
    example = load_example()
    parser = TrlParser((example.ScriptArguments, FP8GRPOConfig, ModelConfig))

    def run(output_dir, *flags):
        args = parser.parse_args_and_config(
            args=[
                "--config", str(ROOT / "recipes" / "demo_cpu.yaml"), "--output_dir", str(output_dir),
                "--per_device_train_batch_size", "16", "--no_plot", "--report_to", "none",
                "--lr_scheduler_type", "constant", *flags,
            ]
        )  # fmt: skip
        example.main(*args)
        return load_file(output_dir / "model.safetensors")

    straight = run(tmp_path / "straight", "--max_steps", "2")
    assert capsys.readouterr().out.count("'loss':") == 2  # a log line per step
    # (The interrupted run's schedule is 1 step long: equal to the straight run's only as the demo's LR is constant.)
    run(tmp_path / "resumed", "--max_steps", "1", "--save_strategy", "steps", "--save_steps", "1")
    capsys.readouterr()
    checkpoint = tmp_path / "resumed" / "checkpoint-1"
    resumed = run(tmp_path / "resumed", "--max_steps", "2", "--resume_from_checkpoint", str(checkpoint))
    assert capsys.readouterr().out.count("'loss':") == 1  # step 2 only: it went on from step 1
    assert straight.keys() == resumed.keys()
    for name, t in straight.items():
        assert torch.equal(resumed[name], t), f"{name} differs after resuming"


def test_the_example_takes_trls_grpo_script_arguments(tmp_path, capsys):
    """The flags and YAML keys of TRL's `trl grpo` script carry over: its reward names (with its settings), a
    reward model, and an evaluation split when `eval_strategy` asks for one (the demo's: other problems)."""
    import trl.rewards

    example = load_example()
    assert example.import_reward("think_format_reward") is trl.rewards.think_format_reward
    assert example.import_reward("trl_fp8.demo.task.accuracy_reward") is accuracy_reward
    with pytest.raises(ValueError, match=r"reward_funcs: 'my_reward' is neither one of \['accuracy_reward'"):
        example.import_reward("my_reward")
    parser = TrlParser((example.ScriptArguments, FP8GRPOConfig, ModelConfig))
    args = parser.parse_args_and_config(
        args=[
            "--config", str(ROOT / "recipes" / "demo_cpu.yaml"), "--output_dir", str(tmp_path), "--max_steps", "1",
            "--per_device_train_batch_size", "16", "--no_plot", "--report_to", "none",
            "--reward_funcs", "trl_fp8.demo.task.accuracy_reward", "get_soft_overlong_punishment",
            "--eval_strategy", "steps", "--eval_steps", "1", "--per_device_eval_batch_size", "256",
            "--num_generations_eval", "2",
        ]
    )  # fmt: skip
    assert args[0].dataset_test_split == "test" and args[0].reward_model_name_or_path is None
    example.main(*args)
    out = capsys.readouterr().out
    # Both rewards score the training and the evaluation rollouts (256 other problems, 2 completions each).
    for key in ("'rewards/accuracy_reward/mean':", "'eval_rewards/accuracy_reward/mean':", "'eval_reward':"):
        assert key in out, key
    assert "'rewards/soft_overlong_punishment_reward/mean':" in out


def test_the_examples_model_init_kwargs_set_over_the_model_flags(tmp_path):
    """As in TRL's script: what `model_init_kwargs` sets wins over ModelConfig's flags, whose defaults (dtype
    float32) had silently replaced it."""
    example = load_example()
    example.main(*demo_args(example, tmp_path, "--max_steps", "1", "--model_init_kwargs", '{"dtype": "bfloat16"}'))
    assert {t.dtype for t in load_file(tmp_path / "model.safetensors").values()} == {torch.bfloat16}


def test_the_example_refuses_what_trls_script_would_load_otherwise(tmp_path, monkeypatch):
    """Off the demo, no reward is added unasked (TRL then names what is missing); a 4-bit policy (`--load_in_4bit`,
    QLoRA's) is refused before it is loaded; a reward module beside the launch directory imports, as with TRL."""
    example = load_example()
    parser = TrlParser((example.ScriptArguments, FP8GRPOConfig, ModelConfig))
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(8)))

    config = tmp_path / "no_reward.yaml"  # the demo's, less its reward
    config.write_text((ROOT / "recipes" / "demo_cpu.yaml").read_text().replace(
        "reward_funcs:\n  - trl_fp8.demo.task.accuracy_reward\n", ""))  # fmt: skip
    assert "reward_funcs" not in config.read_text()

    def main(*flags):
        args = parser.parse_args_and_config(
            args=["--config", str(config), "--output_dir", str(tmp_path / "out"),
                  "--max_steps", "1", "--per_device_train_batch_size", "8", "--no_plot", *flags]
        )  # fmt: skip
        example.main(*args)

    with pytest.raises(ValueError, match="No reward source provided"):
        main("--dataset_name", str(data))
    with pytest.raises(ValueError, match=r"quantization_config \(the trainer's argument\): the policy is quantized"):
        main("--load_in_4bit")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(
        "def length(completions, **kwargs):\n    return [len(c) for c in completions]\n"
    )
    assert example.import_reward("my_rewards.length")(["ab", "c"]) == [2, 1]


def test_mismatch_benchmark_quick(scripts):
    returncode, _, stderr, out = scripts("mismatch")
    assert returncode == 0, stderr[-4000:]
    table = (out / "mismatch.md").read_text()
    for row in ("BF16/BF16, no IS", "FP8 gen + BF16 train, token TIS C=2", "FP8/FP8, token TIS C=2"):
        assert f"| {row} |" in table, row
    assert (out / "mismatch.png").stat().st_size > 10_000
    assert (out / "mismatch.json").exists()


def test_lora_mismatch_benchmark_quick(scripts):
    """The LoRA ablation: PEFT's additive forward over an FP8 base samples from another grid than it learns on."""
    returncode, _, stderr, out = scripts("lora_mismatch")
    assert returncode == 0, stderr[-4000:]
    runs = json.loads((out / "lora_mismatch.json").read_text())["runs"]

    def error(label):
        (history,) = runs[f"LoRA {label}, token TIS C=2"]
        return max(log["sampling/token_mult_prob_error"] for log in history)

    assert error("BF16/BF16") < 1.0001
    assert error("FP8/FP8 merged weight (trl-fp8)") < 1.001 < 1.003 < error("FP8/FP8 additive (ablation)")
    assert (out / "lora_mismatch.png").stat().st_size > 10_000 and (out / "lora_mismatch.md").exists()


def test_families_benchmark_quick(scripts):
    returncode, _, stderr, out = scripts("families")
    assert returncode == 0, stderr[-4000:]
    runs = json.loads((out / "families.json").read_text())["runs"]
    assert set(runs) == {"qwen3", "qwen3_5", "gpt_oss"}
    assert runs["gpt_oss"]["kept"] == [
        "mlp.experts (GptOssExperts: transposed weights, biases, gate and up interleaved)"
    ]
    for family, entry in runs.items():  # the paper's ordering, family by family
        mean = {c: sum(entry[c]["errors"]) / len(entry[c]["errors"]) for c in ("BF16/BF16", "FP8/FP8")}
        generation_only = entry["FP8 generation only"]["errors"]
        assert mean["BF16/BF16"] < 1.0001 and mean["FP8/FP8"] < sum(generation_only) / len(generation_only), family
    assert (out / "families.png").stat().st_size > 10_000 and "| qwen3_5 |" in (out / "families.md").read_text()
    # --bf16: TRL's default precision, where bf16 rounding alone separates learner and sampler (fp32 gives 1.00000).
    returncode, _, stderr, bf16 = scripts("families_bf16")
    assert returncode == 0, stderr[-4000:]
    assert "bf16=True" in (bf16 / "families.md").read_text()
    errors = json.loads((bf16 / "families.json").read_text())["runs"]["qwen3"]["BF16/BF16"]["errors"]
    assert min(errors) > 1.0005, errors


@pytest.mark.skipif(not available("gemma4"), reason="transformers has no Gemma 4")
def test_gemma4_mismatch_falls_with_scaled_attention_scores(scripts):
    """The explanation RESULTS.md gives for Gemma 4's mismatch: its unscaled attention scores (a tiny random model's
    softmax is then nearly one-hot); scaled by 1/sqrt(head_dim), both configurations fall (about 1.04 -> 1.02 in
    FP8/FP8 and 1.014 -> 1.004 in BF16/BF16 over these two steps)."""
    returncode, _, stderr, out = scripts("gemma4_mismatch")
    assert returncode == 0, stderr[-4000:]
    runs = json.loads((out / "gemma4_mismatch.json").read_text())["runs"]
    for config in ("BF16/BF16", "FP8/FP8"):
        mean = {v: sum(runs[v][config]) / len(runs[v][config]) for v in ("sweep", "sweep_scaled")}
        assert mean["sweep_scaled"] - 1 < 0.7 * (mean["sweep"] - 1), (config, mean)
    assert "| as in the sweep, scores scaled |" in (out / "gemma4_mismatch.md").read_text()


def test_gpu_bench_smoke(scripts):
    returncode, _, stderr, out = scripts("gpu_bench")
    assert returncode == 0, stderr[-4000:]
    report = json.loads((out / "gpu_bench.json").read_text())
    assert {"gemm", "linear", "quantize", "train_step", "targets_met"} <= report.keys()
    assert report["errors"] == {} and report["skipped"] == {} and "running" not in report
    for backend in report["backends"]:
        assert all(
            min(r[backend]["sqnr_vs_emulated_db"], r[backend]["sqnr_1x128_vs_emulated_db"]) > 45
            for r in report["gemm"]
        )
        assert report["train_step"][backend]["ratio"] > 0
    assert (out / "gpu_bench.md").read_text().startswith("Device:")
    assert (out / "gpu_targets.png").read_bytes()[:4] == b"\x89PNG"
    # (h): where the step's time went, per precision (on CPU ops where there are no kernels).
    profile = report["profile"]
    assert list(profile) == ["shape", "bf16", *report["backends"]]
    for label in ("bf16", *report["backends"]):
        p = profile[label]
        assert (
            p["time_base"].startswith(("cpu ops", "cuda kernels")) and p["step_ms"] > 0 and p["step_ms_unprofiled"] > 0
        )
        assert {"gemm", "fp8 quantize", "other"} <= p["categories"].keys() and p["categories"]["gemm"]["ms"] > 0
        assert 0 < sum(c["share"] for c in p["categories"].values()) <= p["busy_share"] * 1.001
        assert isinstance(p["host_syncs"], int) and p["host_syncs"] >= 0 and p["launches_per_step"] > 0
        assert 0 < len(p["top"]) <= 15 and all(len(t["name"]) <= 80 and t["ms_per_step"] >= 0 for t in p["top"])
    assert profile["bf16"]["categories"]["fp8 quantize"]["ms"] == 0
    # Plain aten ops: only their Python callers tell them from the rest, where the profiler records those frames.
    if "emulated" in profile and profile["emulated"]["time_base"] == "cpu ops":
        assert profile["emulated"]["categories"]["fp8 quantize"]["ms"] > 0
    md = (out / "gpu_bench.md").read_text()
    assert "(h) where a training step's time goes" in md
    assert f"(h) where a training step's time goes, 1 x {report['train_step']['shape'].split()[2]} tokens" in md
    assert f"| category | {' | '.join(['bf16', *report['backends']])} |" in md
    assert "Bound on (d): GEMMs are" in md
    # (i): host time per linear; the null kernels' extra is over the CPU's tiny nn.Linear, measured in the same run.
    host = report["host"]
    assert {"nn.Linear, CPU, tiny", "null kernels"} <= host.keys() and host["null kernels"]["qkv_us"] > 0
    assert "(i) host time per forward + backward" in md and "| q/k/v (FP8: stacked) |" in md
    assert host["per_call_us"]["aten add (one small kernel)"] > 0 and "| aten add (one small kernel) | " in md
    # Emulated on a CPU often "beats" CPU BF16: a smoke run must not report targets as met.
    assert report["targets_met"] == {} and "Targets: not judged (a --smoke run" in md and " met" not in md
    first = report["backends"][0]
    # What stacking q/k/v gives, and what stacking gate/up as well would.
    assert all(report["train_step"][f"{first} {v}"]["ratio"] > 0 for v in ("unfused", "mlp-stacked"))
    # The 8B-layer step: its own model, every backend, in the report and the figure's (d) panel.
    assert all(report["train_step_8b"][b]["ratio"] > 0 for b in report["backends"])
    assert "(d, e) training step, two Llama-3.1-8B layers" in md
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_report import plot_panels

    step_bars = plot_panels(report)[3]["bars"]["step"]
    assert {
        f"{b}, 8B layers": report["train_step_8b"][b]["ratio"] for b in report["backends"]
    }.items() <= step_bars.items()
