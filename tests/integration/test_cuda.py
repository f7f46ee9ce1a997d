"""The CUDA paths, run by `make gpu-test` (part of `make gpu-check`) where a GPU is present and skipped cleanly
elsewhere: every --sharded_ddp mode, PyTorch FSDP2 (--fsdp) and DeepSpeed ZeRO-2 train under fp16 and bf16 like the
plain run in the same precision, on one GPU or two. Models come from configs (tests/scripts/tiny_train.py): a GPU
machine needs only the repository. Tolerances, against plain ExtTrainer (accelerate's autocast) in the same precision,
per-step loss: `simple` runs the same autocast, 2e-3; FairScale's FSDP, FSDP2 (16-bit copies of its fp32 shards,
MixedPrecisionPolicy) and DeepSpeed compute with the weights themselves in half precision, bf16 3e-2 and fp16 1e-2.
Gradient norms within a factor 1.5: an fp16 loss scale left in the gradients (2^16) or a norm over one shard only
would be far outside."""

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import TINY_COMMON, TINY_TRAIN, free_port, launch, launcher, logged, requires_cuda, run, scratch

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed]

RANKS = max(1, min(2, torch.cuda.device_count())) if torch.cuda.is_available() else 1
COMMON = ["--max_steps", 8, "--per_device_train_batch_size", 16 // RANKS, "--learning_rate", "1e-3",
          "--max_grad_norm", "1.0", "--save_strategy", "no"]
TOLERANCE = {"same autocast": {"bf16": 2e-3, "fp16": 2e-3}, "half weights": {"bf16": 3e-2, "fp16": 1e-2}}


def train(kind, output_dir, *flags, env=None):
    return launch(kind, output_dir, *COMMON, *flags, ranks=RANKS, script=TINY_TRAIN, env=env)


@pytest.fixture(scope="module")
def plain(request):
    """plain(precision) -> output_dir of plain ExtTrainer (DDP on 2 GPUs) in that precision, trained once."""
    root = scratch(request, "plain")

    def output_dir(precision):
        if not (root / precision / "trainer_state.json").is_file():
            train("torchrun", root / precision, f"--{precision}")
        return root / precision

    return output_dir


def assert_trains_like(reference, output_dir, precision, weights):
    """Same losses within the tolerance; gradient norms (taken after unscaling, over all shards) alike."""
    ours, theirs = logged(reference), logged(output_dir)
    assert sorted(ours) == sorted(theirs) == list(range(1, 9))
    assert max(abs(ours[step] - theirs[step]) for step in ours) < TOLERANCE[weights][precision]
    norms = [(a, b) for a, b in zip(logged(reference, "grad_norm").values(), logged(output_dir, "grad_norm").values())
             if math.isfinite(a) and math.isfinite(b) and a > 0]
    assert norms and all(1 / 1.5 < b / a < 1.5 for a, b in norms), norms


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("options", ["simple", "zero_dp_2", "zero_dp_3", "zero_dp_2 offload", "zero_dp_3 offload"])
def test_every_sharded_ddp_mode_trains_like_plain(plain, tmp_path, options, precision):
    """On an H100 `simple` ran fp32 under --fp16 (0.17x), zero_dp_2/3 died at the first step (fp16: grad_scaler
    keyword on fused AdamW; bf16: bf16 gradients beside fp32 weights) and offload asserted the model was on the GPU."""
    train("torchrun", tmp_path, f"--{precision}", "--sharded_ddp", options)
    assert_trains_like(plain(precision), tmp_path, precision,
                       "same autocast" if options == "simple" else "half weights")
    assert (tmp_path / "model.safetensors").is_file()


@requires_cuda
@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "adafactor"])
def test_fsdp_fp16_steps_with_the_optimizers_offered(plain, tmp_path, optim):
    """--optim choices under FairScale's ShardedGradScaler: fused AdamW is swapped for foreach, the others run as is,
    and each trains like plain ExtTrainer with the same optimizer."""
    train("torchrun", tmp_path / "fsdp", "--fp16", "--sharded_ddp", "zero_dp_2", "--optim", optim)
    reference = tmp_path / "plain"
    train("torchrun", reference, "--fp16", "--optim", optim)
    assert_trains_like(reference, tmp_path / "fsdp", "fp16", "half weights")


FSDP2 = ["--fsdp", "full_shard auto_wrap", "--fsdp_config",
         '{"transformer_layer_cls_to_wrap": ["BertLayer"], "cpu_ram_efficient_loading": true}']


def fsdp2_reports(output_dir):
    return [json.loads(path.read_text()) for path in sorted(Path(output_dir, "report").glob("rank*.json"))]


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fsdp2_trains_like_plain(plain, tmp_path, precision):
    """FSDP2 on the GPU: the mesh on cuda over nccl, 16-bit compute over fp32 shards (fp16 with the loss scale taken
    out before the norm, one overflow verdict for all ranks), the shards on the GPU, fp32 weights saved, and on 2 GPUs
    only rank 0 holding parameters while the model is built (cpu_ram_efficient_loading). Not run yet: no GPU was lent
    when it was written (docs/gpus.md)."""
    out = train("torchrun", tmp_path, f"--{precision}", *FSDP2, "--report_dir", tmp_path / "report")
    assert f"fully_shard on a cuda mesh of {RANKS} rank(s) (process group: nccl)" in out.stdout + out.stderr
    assert_trains_like(plain(precision), tmp_path, precision, "half weights")
    reports = fsdp2_reports(tmp_path)
    assert len(reports) == RANKS and all(report["params_devices"] == ["cuda"] for report in reports)
    assert reports[0]["load_peak_params_bytes"] == 4 * reports[0]["num_parameters"]
    assert all(report["load_peak_params_bytes"] == 0 for report in reports[1:])
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(tmp_path / "model.safetensors")).values()} == {torch.float32}


@requires_cuda
def test_fsdp2_offload_keeps_the_shards_in_cpu_memory(plain, tmp_path):
    """`--fsdp "full_shard offload"` (CPUOffloadPolicy: shards and the optimizer step in CPU memory, each layer
    copied to the GPU to compute) would leave the shards on the GPU, or train otherwise than plain bf16. Not run yet:
    no GPU was lent when it was written (docs/gpus.md)."""
    train("torchrun", tmp_path, "--bf16", "--fsdp", "full_shard offload auto_wrap", "--report_dir", tmp_path / "report")
    assert_trains_like(plain("bf16"), tmp_path, "bf16", "half weights")
    assert all(report["params_devices"] == ["cpu"] for report in fsdp2_reports(tmp_path))


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero2_defaults_train_like_plain(plain, tmp_path, precision):
    """ZeRO-2 with our GPU defaults (no bucket copy, overflow found from the gradient norm) follows the plain run."""
    out = train("deepspeed", tmp_path, f"--{precision}", "--deepspeed", "zero2_minimal")
    assert_trains_like(plain(precision), tmp_path, precision, "half weights")
    resolved = json.loads((tmp_path / "ds_config.resolved.json").read_text())
    assert resolved["zero_optimization"]["contiguous_gradients"] is False
    assert resolved["zero_optimization"]["overlap_comm"] is (RANKS > 1)
    if precision == "bf16":
        assert resolved["bf16"]["check_grad_overflow"] is True  # kept on: ExtTrainer makes it free
    assert "no per-parameter scan" in out.stdout + out.stderr


@requires_cuda
def test_zero2_builds_its_op_with_an_arch_letter_in_torch_cuda_arch_list(tmp_path):
    """Hopper images set TORCH_CUDA_ARCH_LIST=9.0a; DeepSpeed 0.19's FusedAdam build died on int('0a')."""
    major, minor = torch.cuda.get_device_capability(0)
    out = train("deepspeed", tmp_path, "--bf16", "--deepspeed", "zero2_minimal",
                env={"TORCH_CUDA_ARCH_LIST": f"{major}.{minor}a"})
    assert f"TORCH_CUDA_ARCH_LIST='{major}.{minor}a' -> '{major}.{minor}'" in out.stdout + out.stderr  # said
    assert len(logged(tmp_path)) == 8


# Every DeepSpeed run of the CUDA tests below: config, precision, the flags it adds to COMMON. The classic file
# states its own learning rate (3e-5); a different --learning_rate is refused before training, as designed (the first
# run on an H200 found this test passing 1e-3).
DEEPSPEED_RUNS = {**{f"{config} {precision}": (config, precision, ()) for config in ("zero2_minimal", "zero2_offload")
                     for precision in ("bf16", "fp16")},
                  "classic fp16": ("ds_configs/zero2.json", "fp16", ("--learning_rate", "3e-5")),
                  "zero3 bf16": ("zero3", "bf16", ())}


@pytest.mark.parametrize("name", sorted(DEEPSPEED_RUNS))
def test_the_deepspeed_runs_of_these_tests_resolve_on_any_machine(tmp_path, name, capsys):
    """The CUDA tests' DeepSpeed flags pass the translator here, on a CPU machine: a test-side disagreement between its
    flags and a file is found without a GPU."""
    from trainer_ext.cli import main

    config, precision, flags = DEEPSPEED_RUNS[name]
    argv = ["ds-config", "--deepspeed", config, "--output_dir", str(tmp_path), *map(str, COMMON), f"--{precision}",
            *flags]
    assert main(argv) == 0, capsys.readouterr().err


@requires_cuda
@pytest.mark.parametrize("name", ["zero2_offload bf16", "classic fp16"])
def test_offload_and_the_classic_published_config_train(tmp_path, name):
    """ZeRO-2 with the optimizer on the CPU, and the classic fp16 + cpu_offload file pasted verbatim, train like plain
    ExtTrainer with the same flags."""
    config, precision, flags = DEEPSPEED_RUNS[name]
    train("deepspeed", tmp_path / "zero", f"--{precision}", "--deepspeed", config, *flags)
    train("torchrun", tmp_path / "plain", f"--{precision}", *flags)
    assert_trains_like(tmp_path / "plain", tmp_path / "zero", precision, "half weights")


@requires_cuda
def test_nonfinite_bf16_step_is_skipped_and_named_on_the_gpu(tmp_path):
    """Without DeepSpeed's per-parameter scan a bf16 step with inf/NaN gradients must still be skipped, and said."""
    out = train("deepspeed", tmp_path, "--bf16", "--deepspeed", "zero2_minimal",
                env={"TINY_TRAIN_NONFINITE_STEPS": "3"})
    assert "step 3 skipped: gradient norm" in out.stdout + out.stderr
    assert all(math.isfinite(loss) for step, loss in logged(tmp_path).items() if step != 3)


@requires_cuda
def test_fp16_overflow_lowers_the_loss_scale_and_training_goes_on(tmp_path):
    """fp16 dynamic loss scaling with overflow read from the gradient norm (our ZeRO-2 default, no per-parameter
    scan): the first two steps overflow (their logits made infinite), the scale falls as DeepSpeed's own scan makes it
    fall (the oracle: zero2_offload, where DeepSpeed keeps its scan in the gradient hooks), and the steps after train
    with finite losses, the same as the oracle's."""
    overflow = {"TINY_TRAIN_NONFINITE_STEPS": "1-2"}
    ours = train("deepspeed", tmp_path / "norm", "--fp16", "--deepspeed", "zero2_minimal", env=overflow)
    assert "overflow check: gradient norm" in ours.stdout + ours.stderr
    theirs = train("deepspeed", tmp_path / "scan", "--fp16", "--deepspeed", "zero2_offload", env=overflow)
    assert "overflow check: DeepSpeed's per-parameter scan" in theirs.stdout + theirs.stderr
    fp16 = json.loads((tmp_path / "norm" / "ds_config.resolved.json").read_text())["fp16"]
    initial = 2.0 ** fp16.get("initial_scale_power", 16)
    scales, oracle = logged(tmp_path / "norm", "loss_scale"), logged(tmp_path / "scan", "loss_scale")
    assert scales == oracle and sorted(scales) == list(range(1, 9)), (scales, oracle)
    assert scales[2] < initial and all(scales[step] == scales[2] for step in range(3, 9)), scales
    losses, oracle_losses = logged(tmp_path / "norm"), logged(tmp_path / "scan")
    assert all(math.isfinite(losses[step]) for step in range(3, 9)), losses
    assert max(abs(losses[step] - oracle_losses[step]) for step in range(3, 9)) < TOLERANCE["half weights"]["fp16"]


@requires_cuda
def test_zero3_trains_like_plain_and_saves_a_whole_model(plain, tmp_path):
    """ZeRO-3 at DeepSpeed's module granularity 0: the same losses and gradient norms as plain bf16 and a whole model
    gathered into model.safetensors. Its former GPU default h² made this model one leaf: grad norm 0, nothing learnt
    (failed here on an H100, 2026-11-27)."""
    train("deepspeed", tmp_path, "--bf16", "--deepspeed", "zero3")
    resolved = json.loads((tmp_path / "ds_config.resolved.json").read_text())
    assert resolved["zero_optimization"]["stage3_module_granularity_threshold"] == 0
    assert_trains_like(plain("bf16"), tmp_path, "bf16", "half weights")
    from safetensors.torch import load_file

    assert all(tensor.numel() > 0 for tensor in load_file(str(tmp_path / "model.safetensors")).values())


@requires_cuda
def test_zero3_granularity_that_makes_the_model_one_leaf_is_refused_before_training(tmp_path):
    """The tiny model's granularity is under h² = 1024: the whole model would be one leaf and learn nothing; the run
    must stop with one line naming the field and the largest safe value before step 1."""
    config = {"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 1024}}
    out = run([*launcher("deepspeed"), "--num_gpus", RANKS, "--master_port", free_port(), TINY_TRAIN, "--output_dir",
               tmp_path, *TINY_COMMON, *COMMON, "--bf16", "--deepspeed", json.dumps(config)])
    said = out.stdout + out.stderr
    assert out.returncode != 0 and "stage3_module_granularity_threshold=1024 makes the whole model" in said, said[-3000:]
    assert "set it to at most" in said and "'loss'" not in said and "Traceback" not in said


CLM = Path(__file__).resolve().parents[2] / "examples" / "run_clm.py"
CLM_FLAGS = ["--do_train", "--do_eval", "--evaluate_before_training", "--max_steps", 60, "--learning_rate", "3e-3",
             "--per_device_train_batch_size", 8, "--max_seq_length", 512, "--max_eval_samples", 64, "--packing",
             "--bf16", "--save_strategy", "no"]


@requires_cuda
@pytest.mark.parametrize("lora", [False, True])
def test_causal_lm_recipe_learns_in_bf16_with_packing_on_a_gpu(tmp_path, lora):
    """examples/run_clm.py on the GPU (the default tiny Llama and shipped chat data, packed rows, bf16, sdpa): the
    validation loss falls and next-token accuracy rises; with LoRA the base sits in bf16 and the adapter is written.
    Written without a GPU lease: not yet run on one."""
    if lora:
        pytest.importorskip("peft")
    env = {"TRAINER_EXT_CACHE": str(tmp_path / "cache")}
    launch("single", tmp_path / "out", *CLM_FLAGS, *(["--lora_r", 8, "--learning_rate", "1e-2"] if lora else []),
           script=CLM, env=env)
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert results["eval_loss"] < results["eval_before_loss"] - 0.2, results  # CPU bf16: 5.60 -> 1.67, LoRA 5.20
    assert results["eval_token_accuracy"] > results["eval_before_token_accuracy"] + 0.1, results
    written = "adapter_model.safetensors" if lora else "model.safetensors"
    assert (tmp_path / "out" / written).is_file()


@requires_cuda
def test_qlora_recipe_learns_with_a_4_bit_base_on_a_gpu(tmp_path):
    """examples/run_clm.py --load_in_4bit (bitsandbytes NF4, bf16 compute) with LoRA on the GPU, evaluated before and
    after (on CPU an evaluation is refused: bitsandbytes repacks the weights for CPU inference and training stops
    learning): the loss falls and the adapter is written. Written without a GPU lease: not yet run on one."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    env = {"TRAINER_EXT_CACHE": str(tmp_path / "cache")}
    launch("single", tmp_path / "out", *CLM_FLAGS, "--lora_r", 8, "--learning_rate", "1e-2", "--load_in_4bit",
           script=CLM, env=env)
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert results["eval_loss"] < results["eval_before_loss"] - 0.2, results
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
