"""DeepSpeed ZeRO-3 on real launchers (2 CPU ranks): presets and the translator's stage-3 fields as DeepSpeed parses
them; checkpoints and output_dir holding a Hugging Face model; the same training as one process, DDP and ZeRO-2;
resume on the same and on another world size; SIGTERM; evaluation; loading partitioned; the planner's bytes. The
reference run and the SIGTERM run use the deepspeed launcher (README's command), the others torchrun with --deepspeed
(the launcher is not their point, and costs ~3 s of CPU more per run)."""

import json
import subprocess

import pytest

from conftest import (ACCUMULATE, BIN, GLUE, GLUE_COMMON, PLAIN, PYTHON, REPO, STEPS, TINY_TRAIN, assert_continues,
                      assert_same_training, copy_checkpoint, free_port, launch, logged, max_weight_difference, run,
                      scratch, signal_at_step, weights)
from trainer_ext.checkpoints.format import loadable_weights
from trainer_ext.deepspeed_config import (PRESETS, DeepSpeedConfigError, explain, finish_deepspeed_config,
                                          resolve_deepspeed_config)

ZERO3 = ["--deepspeed", "zero3"]
HIDDEN = 384  # MiniLM's


# -- the translator, checked by DeepSpeed's own parser ---------------------------------------------------------------

@pytest.mark.deepspeed
@pytest.mark.parametrize("preset", ["zero3", "zero3_offload"])
@pytest.mark.parametrize("precision", [{}, {"bf16": True}])
def test_presets_resolve_to_what_deepspeed_parses_as_stage_3(deepspeed_accepts, preset, precision):
    """A stage-3 preset DeepSpeed rejects, or one that leaves its model-sized fields or the consolidated save off,
    would fail (or save no loadable model) for every ZeRO-3 user."""
    assert preset in PRESETS
    flags = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, **precision}
    resolution = resolve_deepspeed_config(flags, preset, world_size=8, num_training_steps=100, hidden_size=HIDDEN)
    zero = deepspeed_accepts(resolution.config, 8).zero_config
    assert zero.stage == 3 and zero.gather_16bit_weights_on_model_save is True
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == (
        HIDDEN * HIDDEN, int(0.9 * HIDDEN * HIDDEN), 10 * HIDDEN)  # transformers' rules
    offloaded = preset == "zero3_offload"
    assert (zero.offload_param is not None, zero.offload_optimizer is not None) == (offloaded, offloaded)
    if offloaded:
        assert zero.offload_param.device == zero.offload_optimizer.device == "cpu"


@pytest.mark.deepspeed
def test_stage_3_fields_wait_for_the_model_then_explain_says_why(deepspeed_accepts):
    """Without a model the hidden-size fields must stay pending (not DeepSpeed's defaults baked in), be filled from
    the model when training starts, and --explain must name the rule and what ZeRO-3 costs."""
    first = resolve_deepspeed_config({}, {"zero_optimization": {"stage": 3}}, world_size=2, final=False)
    assert {"zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.reduce_bucket_size",
            "zero_optimization.stage3_param_persistence_threshold"} <= set(first.pending)
    finished = finish_deepspeed_config(first, {}, 2, 10, hidden_size=HIDDEN)
    zero = deepspeed_accepts(finished.config, 2).zero_config
    assert zero.prefetch_bucket_size == int(0.9 * HIDDEN * HIDDEN) and zero.gather_16bit_weights_on_model_save
    text = explain(finished)
    assert "hidden size h = 384 (transformers' rule: 0.9·h² elements fetched ahead of use)" in text
    assert "0.13-0.19x plain samples/s at DeepSpeed's defaults" in text and "trainer-ext plan" in text
    assert zero.module_granularity_threshold == 0  # DeepSpeed's: h² made BERT one leaf that learnt nothing


@pytest.mark.deepspeed
def test_legacy_and_misplaced_stage_3_keys(deepspeed_accepts):
    """Deprecated stage-3 keys and the unprefixed spellings must be migrated (DeepSpeed would warn or keep both),
    stage-3-only keys at stage 2 named as ignored, and a top-level stage-3 key pointed to its section."""
    legacy = {"zero_optimization": {"stage": 3, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True,
                                    "stage3_gather_fp16_weights_on_model_save": True,
                                    "max_live_parameters": 2e8}}
    resolution = resolve_deepspeed_config({}, legacy, world_size=2, num_training_steps=10, hidden_size=HIDDEN)
    config = resolution.config["zero_optimization"]
    assert not {"cpu_offload_param", "cpu_offload_use_pin_memory", "stage3_gather_fp16_weights_on_model_save",
                "max_live_parameters"} & set(config)
    zero = deepspeed_accepts(resolution.config, 2).zero_config
    assert zero.offload_param.device == "cpu" and zero.offload_param.pin_memory is True
    assert zero.gather_16bit_weights_on_model_save is True and zero.max_live_parameters == 2e8
    assert len([note for note in resolution.notes if "renamed" in note or "legacy" in note]) == 4
    stage2 = resolve_deepspeed_config({}, {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
                                      world_size=2, num_training_steps=10)
    assert any("offload_param: read only at stage 3" in note for note in stage2.notes)
    with pytest.raises(DeepSpeedConfigError, match='stage3_prefetch_bucket_size is a top-level key here but belongs '
                                                   'inside "zero_optimization"'):
        resolve_deepspeed_config({}, {"stage3_prefetch_bucket_size": 5e7, "zero_optimization": {"stage": 3}},
                                 world_size=2, num_training_steps=10)
    with pytest.raises(DeepSpeedConfigError, match="stage3_max_live_parameters=1000.*keep only"):
        resolve_deepspeed_config({}, {"zero_optimization": {"stage": 3, "max_live_parameters": 10,
                                                            "stage3_max_live_parameters": 1000}},
                                 world_size=2, num_training_steps=10)


@pytest.mark.deepspeed
def test_a_written_value_is_kept_and_false_consolidation_is_said(deepspeed_accepts):
    """The user's stage-3 values stay theirs; turning the consolidated save off is allowed but its consequence said."""
    written = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000,
                                     "stage3_gather_16bit_weights_on_model_save": False}}
    resolution = resolve_deepspeed_config({}, written, world_size=2, num_training_steps=10, hidden_size=HIDDEN)
    zero = deepspeed_accepts(resolution.config, 2).zero_config
    assert zero.prefetch_bucket_size == 1000 and zero.gather_16bit_weights_on_model_save is False
    assert any("no model from_pretrained can load" in note for note in resolution.notes)


# -- training on 2 ranks ---------------------------------------------------------------------------------------------

@pytest.mark.deepspeed
def test_module_granularity_is_refused_on_cpu_ranks_only(deepspeed_accepts):
    """DeepSpeed 0.19.8's stage-3 zero_grad calls record_stream on CPU gradients when
    stage3_module_granularity_threshold > 0 ("unknown parameter type" at the first step, measured on 2 CPU ranks): a
    CPU run must be told before training, a GPU run must keep the setting."""
    file = {"zero_optimization": {"stage": 3, "module_granularity_threshold": 1e6}}  # unprefixed: migrated first
    with pytest.raises(DeepSpeedConfigError, match=r"stage3_module_granularity_threshold=1000000.0 fails on CPU ranks"):
        resolve_deepspeed_config({}, file, world_size=2, num_training_steps=10, hidden_size=HIDDEN, cpu_ranks=True)
    on_gpus = resolve_deepspeed_config({}, file, world_size=2, num_training_steps=10, hidden_size=HIDDEN)
    assert deepspeed_accepts(on_gpus.config, 2).zero_config.module_granularity_threshold == 1_000_000


@pytest.mark.deepspeed
@pytest.mark.parametrize("where,file,expected", [
    ("GPUs", {}, 0),  # h² here made BERT-large one leaf: no gradient reached the optimizer (test below)
    ("CPU ranks", {}, 0),  # DeepSpeed fails there with any value > 0
    ("GPUs", {"stage3_module_granularity_threshold": "auto"}, 0),
    ("GPUs", {"stage3_module_granularity_threshold": 5e5}, 500_000),  # a value the file gives is kept (and checked
])                                                                    # against the model when training starts)
def test_module_granularity_default_is_deepspeeds_everywhere(deepspeed_accepts, where, file, expected):
    """ZeRO-3's module granularity stays DeepSpeed's 0 unless the file sets it (h² on GPUs made the whole model one
    leaf that learnt nothing), as DeepSpeed's own parser reads the resolved config."""
    config = {"zero_optimization": {"stage": 3, **file}}
    resolution = resolve_deepspeed_config({}, config, world_size=2, num_training_steps=10, hidden_size=1024,
                                          cpu_ranks=where == "CPU ranks")
    assert resolution.config["zero_optimization"]["stage3_module_granularity_threshold"] == expected
    assert deepspeed_accepts(resolution.config, 2).zero_config.module_granularity_threshold == expected


def tiny_models():
    """The tiny BERT of tests/scripts/zero3_leaves.py and a tiny Llama (GQA, untied head), built on the meta device."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        yield "bert", BertForSequenceClassification(BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64))
        yield "llama", LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176,
                                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))


@pytest.mark.deepspeed
def test_the_leaves_we_predict_are_the_ones_deepspeed_chooses():
    """check_granularity refuses from the leaves it predicts; a prediction that drifted from DeepSpeed's own choice
    (a DeepSpeed release changing its rule) would refuse safe values or let a whole-model leaf train nothing."""
    import sys

    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    from trainer_ext.backends.deepspeed.leaves import granularities, leaves

    for name, model in tiny_models():
        for parameter in model.parameters():
            parameter.ds_numel = parameter.numel()
        names = {id(module): path for path, module in model.named_modules()}
        values = sorted({granularity for _, granularity, _ in granularities(model).values()})
        for threshold in [0, *values, *(value - 1 for value in values)]:
            for module in model.modules():
                module._z3_leaf = False
            oracle = object.__new__(DeepSpeedZeRoOffload)  # DeepSpeed's own rule, run on the model alone
            oracle.min_granularity_value, oracle.min_granularity_layer = sys.maxsize, None
            oracle.granularity_info, oracle.z3_leaf_layers = set(), []
            if threshold > 0:
                oracle._set_z3_leaf_modules_by_threshold(model, threshold)
            theirs = [names[id(module)] for module in oracle.z3_leaf_layers]
            assert [leaf for leaf, _, _ in leaves(model, threshold)] == theirs, (name, threshold)


@pytest.mark.launch
@pytest.mark.deepspeed
def test_a_leaf_holding_the_blocks_trains_wrong_so_it_is_refused_before_training():
    """DeepSpeed 0.19.8 itself (tests/scripts/zero3_leaves.py, against plain PyTorch): leaves without a container
    train exactly, a leaf holding the encoder's ModuleList trains other weights, the whole model as a leaf nothing (the
    h² default did that to BERT). If DeepSpeed fixes it this test says so; check_granularity refuses exactly those."""
    from trainer_ext.backends.deepspeed.leaves import check_granularity, leaves

    out = run([PYTHON, REPO / "tests" / "scripts" / "zero3_leaves.py", 0, 560, 588, 800, 1024],
              env={"MASTER_PORT": str(free_port())})
    assert out.returncode == 0, out.stderr[-3000:]
    plain, *runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    by_threshold = {run_["threshold"]: run_ for run_ in runs}

    def same(run_):
        return max(abs(a - b) for a, b in zip(run_["losses"], plain["losses"])) < 1e-6

    assert same(by_threshold[0]) and same(by_threshold[560]) and same(by_threshold[588])
    assert by_threshold[560]["leaves"] == ["bert.encoder.layer.0.attention", "bert.encoder.layer.1.attention",
                                           "bert.pooler"]
    assert by_threshold[800]["leaves"][0] == "bert.encoder" and not same(by_threshold[800])
    assert by_threshold[1024]["leaves"] == ["(the model)"] and by_threshold[1024]["norms"] == [0.0] * 4

    bert = next(model for name, model in tiny_models() if name == "bert")
    for threshold in (0, 560, 588):
        check_granularity(bert, {"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": threshold}})
    for threshold, what in ((800, "bert.encoder (it holds a ModuleList)"), (1024, "the whole model")):
        with pytest.raises(DeepSpeedConfigError, match="set it to at most 588 ") as refused:
            check_granularity(bert, {"zero_optimization": {"stage": 3, "module_granularity_threshold": threshold}})
        assert f"threshold={threshold} makes {what}" in str(refused.value)
    assert not any(container for _, _, container in leaves(bert, 588))


@pytest.fixture(scope="module")
def zero3_accumulate(request):
    """ACCUMULATE under ZeRO-3 on 2 ranks (4 per rank x 2 accumulation), checkpoints every 3 steps (a resume keeps
    its checkpoint's save_steps, so the 1-rank continuation saves step 9 too)."""
    root = scratch(request, "zero3")
    launch("deepspeed", root / "run", *ACCUMULATE, "--per_device_train_batch_size", 4, *ZERO3, "--save_strategy",
           "steps", "--save_steps", 3)
    return root / "run"


@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.model_package
def test_a_finished_run_started_again_trains_nothing_and_evaluates_its_weights(zero3_accumulate, tmp_path):
    """A scheduler re-running a finished ZeRO-3 command (here asking to evaluate too) must train nothing, change no
    file, exit 0; it loads the finished weights into the partitioned model and evaluates them through an engine of its
    own: the metrics must equal one process evaluating the saved model, printed by rank 0 only. (The same command
    without --do_eval trains nothing either: test_already_complete.py, ZeRO-2 and one process.)"""
    import hashlib
    import shutil

    def contents(folder):
        return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in written}

    run_dir = tmp_path / "run"
    shutil.copytree(zero3_accumulate, run_dir)
    written = {"eval_results.json", "all_results.json"}
    before = contents(run_dir)
    flags = [*ACCUMULATE, "--per_device_train_batch_size", 4, *ZERO3, "--save_strategy", "steps", "--save_steps", 3]
    command = [BIN / "torchrun", "--nproc_per_node", 2, "--master_port", free_port(), GLUE, "--output_dir", run_dir,
               *GLUE_COMMON, *flags]
    evaluating = run([*command, "--do_eval", "--max_eval_samples", 64])
    assert evaluating.returncode == 0, evaluating.stderr[-3000:]
    assert "training already complete at step 12" in evaluating.stdout + evaluating.stderr
    assert "resuming from" not in evaluating.stdout + evaluating.stderr
    assert evaluating.stdout.count("'eval_loss'") == 1  # the finished run's saved state names rank 0 as the main one
    assert contents(run_dir) == before  # every file but the evaluation's results is byte for byte the same
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([p.name for p in zero3_accumulate.iterdir()] +
                                                               [n for n in written if not (zero3_accumulate / n).exists()])
    launch("single", tmp_path / "one", "--model_name_or_path", run_dir, "--do_eval", "--max_eval_samples", 64)
    ours, one = (json.loads((d / "eval_results.json").read_text()) for d in (run_dir, tmp_path / "one"))
    assert abs(ours["eval_loss"] - one["eval_loss"]) < 1e-6 and ours["eval_accuracy"] == one["eval_accuracy"]


@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.model_package
def test_same_training_as_one_process_ddp_and_zero2(accumulate_runs, zero3_accumulate):
    """ZeRO-3 with accumulation, clipping that bites and warmup must be the same training as one process, DDP and
    ZeRO-2: per-step losses, gradient norms and learning rates, and the final weights."""
    for reference in ("single", "ddp", "zero2"):
        assert_same_training(accumulate_runs / reference, zero3_accumulate, 12)
    for key in ("grad_norm", "learning_rate"):
        ours, theirs = logged(accumulate_runs / "single", key), logged(zero3_accumulate, key)
        assert max(abs(ours[s] - theirs[s]) for s in ours) < 1e-5 * max(1.0, max(ours.values())), key
    train_loss = [json.loads((d / "train_results.json").read_text())["train_loss"]
                  for d in (accumulate_runs / "single", zero3_accumulate)]
    assert abs(train_loss[0] - train_loss[1]) < 1e-6  # the final train_loss is the true one on 2 ranks


@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.model_package
def test_every_checkpoint_and_the_output_dir_hold_a_loadable_model(accumulate_runs, zero3_accumulate):
    """A ZeRO-3 checkpoint with only ZeRO shards (what DeepSpeed writes by default) gives users nothing to load: each
    must hold the consolidated weights, equal to one process's at the same step, loadable without DeepSpeed."""
    single_step6 = weights(accumulate_runs / "single" / "checkpoint-6")
    for folder in (zero3_accumulate / "checkpoint-6", zero3_accumulate / "checkpoint-12", zero3_accumulate):
        saved = weights(folder)
        assert saved.keys() == single_step6.keys(), folder  # the same names as one process writes
        assert saved["bert.embeddings.word_embeddings.weight"].shape == (30522, HIDDEN)
    assert max_weight_difference(accumulate_runs / "single" / "checkpoint-6", zero3_accumulate / "checkpoint-6") < 1e-5
    assert (zero3_accumulate / "checkpoint-6" / "global_step6").is_dir()  # the ZeRO state, to resume exactly
    resolved = json.loads((zero3_accumulate / "ds_config.resolved.json").read_text())["zero_optimization"]
    assert resolved["stage3_prefetch_bucket_size"] == int(0.9 * HIDDEN * HIDDEN)  # sized from the model
    code = ("import sys; sys.modules['deepspeed'] = None\n"
            "from transformers import AutoModelForSequenceClassification as M\n"
            f"for folder in {[str(zero3_accumulate), str(zero3_accumulate / 'checkpoint-6')]!r}:\n"
            "    m = M.from_pretrained(folder); print('loaded', sum(p.numel() for p in m.parameters()))\n")
    loaded = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True)
    assert loaded.returncode == 0 and loaded.stdout.count("loaded 22713986") == 2, loaded.stderr[-2000:]


@pytest.fixture(scope="module")
def resumed_on_one_rank(request, zero3_accumulate):
    """checkpoint-6 of the 2-rank run resumed on 1 rank with the same global batch (it saves steps 9 and 12)."""
    resumed = copy_checkpoint(zero3_accumulate, 6, scratch(request, "zero3-2to1") / "run")
    out = launch("torchrun", resumed, *ACCUMULATE, "--per_device_train_batch_size", 8, *ZERO3, "--save_strategy",
                 "steps", "--save_steps", 3, ranks=1)
    assert "saved on 2 ranks, resuming on 1" in out.stdout + out.stderr
    return resumed


@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.model_package
def test_checkpoint_from_2_ranks_resumes_on_1(zero3_accumulate, resumed_on_one_rank):
    """ZeRO-3 optimizer and parameter shards cannot load on another world size; through DeepSpeed's universal
    format the continuation must equal the uninterrupted run."""
    assert_continues(zero3_accumulate, resumed_on_one_rank, 7)


@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.model_package
def test_checkpoint_from_1_rank_resumes_on_2(zero3_accumulate, resumed_on_one_rank, tmp_path):
    """The other way: a 1-rank ZeRO-3 checkpoint (step 9) continued on 2 ranks equals the uninterrupted run."""
    resumed = copy_checkpoint(resumed_on_one_rank, 9, tmp_path / "run")
    out = launch("torchrun", resumed, *ACCUMULATE, "--per_device_train_batch_size", 4, *ZERO3, "--save_strategy",
                 "no")
    assert "saved on 1 ranks, resuming on 2" in out.stdout + out.stderr
    assert_continues(zero3_accumulate, resumed, 10)


@pytest.fixture(scope="module")
def preempted_then_rerun(request):
    """PLAIN under ZeRO-3 on 2 ranks, evaluating before training (an inference engine built and released before the
    training engine): SIGTERM to rank 1 at the end of step 5, then the same command again."""
    from trainer_ext.checkpoints.format import newest_valid_checkpoint

    root = scratch(request, "zero3-sigterm")
    output_dir = root / "run"
    command = [str(c) for c in [BIN / "deepspeed", "--num_gpus", 2, "--master_port", free_port(), GLUE,
                                "--output_dir", output_dir, *GLUE_COMMON, *PLAIN, "--per_device_train_batch_size", 8,
                                *ZERO3, "--disable_tqdm", "false", "--evaluate_before_training"]]
    with open(root / "first.log", "w") as log:  # rank 1 signals itself after step 5 (the same step every run)
        first = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=signal_at_step(5, rank=1),
                               timeout=600)
    text = (root / "first.log").read_text()
    saved = newest_valid_checkpoint(output_dir)
    assert first.returncode != 0 and saved is not None and "preempted: checkpoint" in text, text[-3000:]
    assert saved.name == "checkpoint-5"  # every rank saves the step rank 1 was signalled at
    again = run(command[:4] + [str(free_port())] + command[5:], timeout=900)  # a fresh port
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-4000:]
    assert f"resuming from {saved}" in again.stdout + again.stderr
    return output_dir


@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.model_package
def test_sigterm_then_the_same_command_equals_one_process(plain_runs, preempted_then_rerun):
    """A preempted ZeRO-3 run must checkpoint (a collective consolidation on every rank) and its rerun must finish
    the single process's training: losses and final weights."""
    assert_same_training(plain_runs / "single", preempted_then_rerun, STEPS)


@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.model_package
def test_evaluation_and_predictions_on_2_ranks_equal_one_process(plain_runs, preempted_then_rerun):
    """Evaluation under ZeRO-3 runs the partitioned model (parameters gathered per layer): metrics and the 37
    predictions, in dataset order, must equal one process's."""
    import numpy as np

    single = json.loads((plain_runs / "single" / "eval_results.json").read_text())
    ours = json.loads((preempted_then_rerun / "eval_results.json").read_text())
    assert abs(ours["eval_loss"] - single["eval_loss"]) < 1e-5 and ours["eval_accuracy"] == single["eval_accuracy"]
    single, ours = (json.loads((d / "predictions.json").read_text()) for d in (plain_runs / "single",
                                                                               preempted_then_rerun))
    assert ours["predictions"] == single["predictions"] and len(ours["predictions"]) == 37
    assert np.allclose(ours["logits"], single["logits"], atol=1e-4)



@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.model_package
def test_evaluation_before_training_equals_one_process(preempted_then_rerun, tmp_path):
    """Evaluating before the training engine exists runs the pretrained weights through an inference engine of our own
    (transformers' would delete the optimizer from the config training uses): the metrics must equal one process's,
    and the training that follows is the single process's (test_sigterm_then_the_same_command_equals_one_process)."""
    launch("single", tmp_path / "one", "--do_eval", "--max_eval_samples", 64)
    one = json.loads((tmp_path / "one" / "eval_results.json").read_text())
    ours = json.loads((preempted_then_rerun / "eval_before_results.json").read_text())
    assert abs(ours["eval_before_loss"] - one["eval_loss"]) < 1e-6
    assert ours["eval_before_accuracy"] == one["eval_accuracy"]


# -- loading partitioned, tied weights, the planner ------------------------------------------------------------------

@pytest.fixture(scope="module")
def bert_folder(request):
    """A 6.6M-parameter BERT QA model saved with save_pretrained; its largest tensor is 4% of it, so a rank that
    loads only its part holds about 1/N."""
    folder = scratch(request, "bert") / "model"
    code = ("import torch, sys\nfrom transformers import BertConfig, BertForQuestionAnswering\ntorch.manual_seed(0)\n"
            "config = BertConfig(vocab_size=512, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,\n"
            "                    intermediate_size=1024, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)\n"
            "BertForQuestionAnswering(config).save_pretrained(sys.argv[1])\n")
    out = run([PYTHON, "-c", code, folder])
    assert out.returncode == 0, out.stderr[-2000:]
    return folder


def model_state_reports(report_dir):
    return [json.loads((report_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.model_package
def test_loading_under_zero3_holds_about_1_over_n_and_the_planner_predicts_the_states(bert_folder, tmp_path):
    """from_pretrained under ZeRO-3 must build and load each rank's part only (the peak is 1/N plus the one tensor
    being loaded), and the planner's zero3 row must be within 5% of what a real rank holds."""
    from trainer_ext.planner import ModelSize, plan

    out = run([BIN / "torchrun", "--nproc_per_node", 2, "--master_port", free_port(), REPO / "benchmarks" / "train.py",
               "--trainer", "ext", "--model_dir", bert_folder, "--report_dir", tmp_path / "report", "--output_dir",
               tmp_path / "out", "--max_steps", 2, "--max_seq_length", 32, "--per_device_train_batch_size", 4,
               "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", *ZERO3], timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    reports = model_state_reports(tmp_path / "report")
    psi = reports[0]["num_parameters"]
    largest = 256 * 1024  # an intermediate dense weight
    for report in reports:
        assert 4 * psi / 2 <= report["load_peak_params_bytes"] <= 4 * (psi / 2 + largest) * 1.01, report
    predicted = next(e for e in plan(ModelSize(psi, "run"), 2, "fp32").estimates if e.backend == "zero3")
    measured = [r["params_bytes"] + r["grads_bytes"] + r["moments_bytes"] + r["master_bytes"] for r in reports]
    assert abs(max(measured) / predicted.model_states - 1) < 0.05, (measured, predicted)
    assert all(abs(2 * r["moments_bytes"] - 8 * psi) <= 64 for r in reports)  # Adam's moments: 1/N of DDP's


@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.model_package
def test_zero3_offload_tied_weights_and_the_planner(tmp_path):
    """zero3_offload (parameters and optimizer in CPU memory) must train, save a model whose tied decoder and word
    embeddings are still one tensor after from_pretrained in one CPU process, and hold what the planner predicts;
    the model is built as a stock script builds it (from_config, no sharded_loading): transformers' zero.Init must
    see the 2-rank group, not fail its batch check as 1 rank."""
    from trainer_ext.planner import ModelSize, plan

    output = tmp_path / "lm"
    launch("torchrun", output, "--model_size", "small", "--head", "lm", "--report_dir", tmp_path / "report",
           "--max_steps", 3, "--per_device_train_batch_size", 4, "--save_strategy", "no", "--deepspeed",
           "zero3_offload", "--plain_loading", script=TINY_TRAIN)
    reports = model_state_reports(tmp_path / "report")
    psi = reports[0]["num_parameters"]
    predicted = next(e for e in plan(ModelSize(psi, "run"), 2, "fp32", offload=True).estimates
                     if e.backend == "zero3_offload")
    assert predicted.model_states == 0  # on CPU ranks device and host are one memory: compare the sum
    measured = [r["params_bytes"] + r["grads_bytes"] + r["moments_bytes"] + r["master_bytes"] for r in reports]
    assert abs(max(measured) / predicted.host - 1) < 0.05, (measured, predicted)
    code = ("import sys, torch; sys.modules['deepspeed'] = None\n"
            "from transformers import BertForMaskedLM\n"
            "m = BertForMaskedLM.from_pretrained(sys.argv[1])\n"
            "out, emb = m.get_output_embeddings().weight, m.get_input_embeddings().weight\n"
            "assert out is emb, 'untied'\n"
            "from safetensors.torch import load_file\n"
            "saved = load_file(sys.argv[1] + '/model.safetensors')\n"
            "assert torch.equal(saved['bert.embeddings.word_embeddings.weight'], emb.detach()), 'values'\n"
            "print('tied', len(saved))\n")
    loaded = run([PYTHON, "-c", code, output])
    assert loaded.returncode == 0 and "tied" in loaded.stdout, loaded.stdout + loaded.stderr[-3000:]


@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.model_package
def test_sharded_loading_is_public_and_a_no_op_elsewhere():
    """The one-liner for users' own scripts must be importable from trainer_ext and change nothing without ZeRO-3
    (one script for every backend)."""
    code = ("import trainer_ext\n"
            "from transformers import TrainingArguments\n"
            "args = TrainingArguments(output_dir='/tmp/x', report_to='none')\n"
            "with trainer_ext.sharded_loading(args):\n"
            "    pass\n"
            "print('ok', args.deepspeed)\n")
    out = run([PYTHON, "-c", code])
    assert out.returncode == 0 and "ok None" in out.stdout, out.stderr[-2000:]


@pytest.mark.deepspeed
@pytest.mark.parametrize("shard", [None, "20KB"])
def test_consolidated_weights_load_into_a_model_built_whole(tmp_path, shard):
    """A finished ZeRO-3 run started again from an own script whose model was built whole (no zero.Init): every
    rank, not only the main one, must fill its parameters from model.safetensors or its shards, tied weights through
    the name the file kept; a file that lacks a parameter is named before any collective."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertForMaskedLM

    from trainer_ext.backends.deepspeed.backend import load_consolidated_weights

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    torch.manual_seed(0)
    saved = BertForMaskedLM(config)
    saved.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    torch.manual_seed(1)
    model = BertForMaskedLM(config)
    load_consolidated_weights(model, tmp_path, main_process=False)
    expected = saved.state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in model.state_dict().items())
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    if not shard:
        weights = load_file(tmp_path / "model.safetensors")
        del weights["bert.encoder.layer.1.output.dense.bias"]
        save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(RuntimeError, match="no bert.encoder.layer.1.output.dense.bias"):
            load_consolidated_weights(model, tmp_path, main_process=True)


@pytest.mark.launch
@pytest.mark.deepspeed
def test_without_consolidation_the_run_says_what_it_saved_once_and_torchs_deprecations_once(tmp_path, tiny_bert_dir):
    """ZeRO-3 with stage3_gather_16bit_weights_on_model_save false: a 2-step run printed torch's reduce_scatter_tensor
    FutureWarning 62 times and ended "model saved to out" with no model from_pretrained loads. Fails when the run does
    not say once what it saved and how to get a model (the command it gives is run here, and the model then loads),
    or when torch's deprecation of the collectives DeepSpeed calls comes more than once each."""
    out_dir = tmp_path / "out"
    config = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}}
    done = run([BIN / "torchrun", "--nproc_per_node", 2, "--master_port", free_port(), GLUE, "--output_dir", out_dir,
                "--model_name_or_path", tiny_bert_dir, "--do_train", "--max_steps", 1, "--save_strategy", "no", *GLUE_COMMON,
                "--deepspeed", json.dumps(config)])
    said = done.stdout + done.stderr
    assert done.returncode == 0, done.stderr[-3000:]
    assert said.count("`torch.distributed.reduce_scatter_tensor` is deprecated") <= 1
    assert said.count("`torch.distributed.all_gather_into_tensor` is deprecated") <= 1
    line = f"{out_dir} gets DeepSpeed's partitioned ZeRO-3 checkpoint (global_step1/), not a model from_pretrained loads"
    assert said.count(line) == 1 and "model saved to" not in said
    command = said.split(line)[1].split("`")[1].split()  # `python <out>/zero_to_fp32.py <out> <out> ...`
    assert command == ["python", f"{out_dir}/zero_to_fp32.py", str(out_dir), str(out_dir), "--safe_serialization"]
    assert loadable_weights(out_dir) is None
    rebuilt = run([PYTHON, *command[1:]], env={"DS_ACCELERATOR": "cpu"})
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert loadable_weights(out_dir) == "model.safetensors" and (out_dir / "config.json").is_file()
    from transformers import BertForSequenceClassification

    assert BertForSequenceClassification.from_pretrained(out_dir).num_parameters() > 0
