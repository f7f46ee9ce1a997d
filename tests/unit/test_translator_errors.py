"""Every conflict and bad input is reported before training, naming the field, both values and the fix."""

import copy
import json

import pytest

from trainer_ext.deepspeed_config import (DeepSpeedConfigError, build_deepspeed_config, finish_deepspeed_config,
                                          load_deepspeed_config, resolve_deepspeed_config, resolve_world_size)


def problems(flags, config, **kwargs):
    kwargs.setdefault("world_size", 2)
    kwargs.setdefault("num_training_steps", 100)
    with pytest.raises(DeepSpeedConfigError) as info:
        resolve_deepspeed_config(flags, config, **kwargs)
    return info.value.problems


def test_flag_that_disagrees_with_file_names_both():
    """A silently ignored --learning_rate is the classic complaint about DeepSpeed configs."""
    [problem] = problems({"learning_rate": 1e-4}, {"optimizer": {"type": "AdamW", "params": {"lr": 3e-5}}})
    assert "optimizer.params.lr=3e-05" in problem and "--learning_rate 0.0001" in problem


def test_all_conflicts_are_reported_together():
    """One error per run-and-fix cycle would cost users a relaunch per field."""
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "weight_decay": 0.1, "eps": 1e-6}},
              "gradient_clipping": 5.0}
    found = problems({"learning_rate": 1e-4, "weight_decay": 0.01, "adam_epsilon": 1e-8, "max_grad_norm": 0.3},
                     config)
    assert len(found) == 3
    text = "\n".join(found)
    for name in ("optimizer.params.lr", "--learning_rate", "optimizer.params.weight_decay", "--weight_decay",
                 "gradient_clipping", "--max_grad_norm"):
        assert name in text
    assert "eps" not in text  # --adam_epsilon left at its default: the file's value wins


def test_betas_conflict_names_the_element():
    """--adam_beta2 clashing with the file's betas must name the element, betas[1], and both values."""
    [problem] = problems({"adam_beta2": 0.98}, {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}})
    assert "optimizer.params.betas[1]=0.95" in problem and "--adam_beta2 0.98" in problem


def test_batch_fields_that_cannot_hold_name_each_field_and_the_flag():
    """The DeepSpeed assertion 'train_batch_size is not equal to ...' does not say which flag to change."""
    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    [problem] = problems({}, config, world_size=2)
    for text in ("train_batch_size=64", "world size 2", "train_micro_batch_size_per_gpu=4",
                 "gradient_accumulation_steps=2", "= 16", "in the file set train_batch_size to 16",
                 "train_micro_batch_size_per_gpu to 16", "gradient_accumulation_steps to 8"):
        assert text in problem


def test_batch_flag_conflicting_with_file_micro_batch():
    """--per_device_train_batch_size against the file's micro batch must name both, not silently train on one."""
    [problem] = problems({"per_device_train_batch_size": 16}, {"train_micro_batch_size_per_gpu": 4})
    assert "train_micro_batch_size_per_gpu=4" in problem and "--per_device_train_batch_size 16" in problem


def test_file_with_only_train_batch_size_derives_the_micro_batch():
    """DeepSpeed derives the missing batch field; so must we, and tell the Trainer."""
    resolution = resolve_deepspeed_config({"gradient_accumulation_steps": 2}, {"train_batch_size": 32},
                                          world_size=4, num_training_steps=10)
    assert resolution.config["train_micro_batch_size_per_gpu"] == 4
    assert resolution.effective_flags["per_device_train_batch_size"] == 4


def test_numeric_strings_are_numbers_not_conflicts():
    """JSON written by scripts often quotes numbers; "8" vs 8 must not be reported as a disagreement."""
    config = {"train_micro_batch_size_per_gpu": "8", "gradient_accumulation_steps": "2",
              "optimizer": {"type": "AdamW", "params": {"lr": "5e-5", "betas": ["0.9", "0.999"]}},
              "zero_optimization": {"stage": "2", "reduce_bucket_size": "5e8"}}
    out = build_deepspeed_config({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
                                  "learning_rate": 5e-5}, world_size=2, num_training_steps=10, config=config)
    assert out["train_batch_size"] == 32
    assert out["zero_optimization"]["stage"] == 2 and out["zero_optimization"]["reduce_bucket_size"] == 5e8


@pytest.mark.parametrize("key,hint", [("zero_optimisation", "zero_optimization"),
                                      ("gradient_acumulation_steps", "gradient_accumulation_steps"),
                                      ("train_micro_batch_size", "train_micro_batch_size_per_gpu")])
def test_unknown_key_gets_the_closest_known_key(key, hint):
    """DeepSpeed silently ignores unknown keys: a misspelled section would silently turn ZeRO off."""
    [problem] = problems({}, {key: {"stage": 2} if "zero" in key else 4})
    assert repr(key) in problem and repr(hint) in problem


def test_unknown_nested_key_gets_the_closest_known_key():
    """A typo inside a section (overlap_com) is ignored by DeepSpeed; it must be named with the right spelling."""
    [problem] = problems({}, {"zero_optimization": {"stage": 2, "overlap_com": True}})
    assert "zero_optimization.overlap_com" in problem and "zero_optimization.overlap_comm" in problem


@pytest.mark.parametrize("key,home", [("offload_optimizer", "zero_optimization"), ("stage", "zero_optimization"),
                                      ("loss_scale", "fp16"), ("lr", "optimizer.params"),
                                      ("warmup_num_steps", "scheduler.params")])
def test_key_at_the_wrong_level_says_where_it_belongs(key, home):
    """A key put at the top level (stage, lr, loss_scale) is ignored by DeepSpeed; say which section it belongs in."""
    [problem] = problems({}, {key: 1})
    assert key in problem and f'inside "{home}"' in problem


def test_invalid_json_reports_file_line_and_column(tmp_path):
    """A broken DeepSpeed file must be reported with its path, line and column, not a bare JSONDecodeError."""
    path = tmp_path / "ds.json"
    path.write_text('{\n  "zero_optimization": {\n    "stage": 2\n  \n}\n')  # a closing brace missing
    with pytest.raises(DeepSpeedConfigError) as info:
        load_deepspeed_config(str(path))
    assert str(path) in str(info.value) and "line 6" in str(info.value) and "column 1" in str(info.value)


def test_comments_and_trailing_commas_are_read_as_deepspeed_reads_them(tmp_path):
    """DeepSpeed reads config files as HJSON: a file it accepts must not be rejected here."""
    path = tmp_path / "ds.json"
    path.write_text('{\n  // ZeRO-2, as on the cluster\n  "zero_optimization": {"stage": 2, "overlap_comm": true,},\n}\n')
    config, _ = load_deepspeed_config(str(path))
    assert config == {"zero_optimization": {"stage": 2, "overlap_comm": True}}


@pytest.mark.parametrize("text", ['{"train_batch_size": 8, "train_batch_size": 16}',
                                  '{\n  // comment\n  "fp16": {"enabled": true, "enabled": false},\n}'])
def test_duplicate_keys_are_refused_naming_the_key(tmp_path, text):
    """A key written twice in a file silently keeps the last value; it must be refused, naming the key."""
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(DeepSpeedConfigError, match="duplicate key '(train_batch_size|enabled)'"):
        load_deepspeed_config(str(path))


def test_invalid_inline_json_reports_line_and_column():
    """Broken inline --deepspeed JSON must be reported as such with line and column, so the typo can be found."""
    with pytest.raises(DeepSpeedConfigError, match=r"inline --deepspeed JSON, line 1, column \d+"):
        load_deepspeed_config('{"zero_optimization": {"stage": 2}')


@pytest.mark.parametrize("config,field", [
    ({"train_batch_size": "abc"}, "train_batch_size"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu"),
    ({"gradient_accumulation_steps": -2}, "gradient_accumulation_steps"),
    ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu"),
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}}, "optimizer.params.betas"),
    ({"fp16": {"enabled": "maybe"}}, "fp16.enabled"),  # "yes" DeepSpeed's model reads as true
    ({"fp16": True}, "fp16 must be a JSON object"),
    ({"scheduler": {"type": "WarmupLinear"}}, "scheduler.type"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, "scheduler.params.warmup_num_steps"),
])
def test_wrong_types_and_non_positive_sizes_are_rejected(config, field):
    """A wrong type or a zero/negative size in the file must be named before training, not crash inside DeepSpeed."""
    assert any(field in problem for problem in problems({}, config))


def test_non_positive_batch_flag_is_rejected():
    """--per_device_train_batch_size 0 must be refused by name, not turned into a train_batch_size of 0."""
    assert any("--per_device_train_batch_size" in p for p in problems({"per_device_train_batch_size": 0}, {}))


def test_fp16_and_bf16_together():
    """fp16 on in the file and --bf16 on the command line must be refused, asking the user to choose one."""
    [problem] = problems({"bf16": True}, {"fp16": {"enabled": True}})
    assert "fp16.enabled" in problem and "bf16.enabled" in problem and "--bf16" in problem
    assert problems({}, {"fp16": {"enabled": True}, "bf16": {"enabled": True}}) == [
        "fp16.enabled and bf16.enabled are both true (fp16 from file (--fp16 left at default false, now true), bf16 "
        "from file (--bf16 left at default false, now true)): choose one precision"]


def test_fp16_typed_with_use_cpu_is_the_flags_mistake_not_the_files():
    """--fp16 --use_cpu is refused by the flag check, naming the two flags; the DeepSpeed file's message (set
    fp16.enabled to "auto") is for an fp16 that only the file turned on."""
    from types import SimpleNamespace

    typed = SimpleNamespace(fp16=True, use_cpu=True, flags_given={"fp16"})
    assert resolve_deepspeed_config(typed, {"fp16": {"enabled": "auto"}}, world_size=1).config["fp16"]["enabled"]
    [problem] = problems(SimpleNamespace(use_cpu=True, flags_given=set()), {"fp16": {"enabled": True}})
    assert problem.startswith("fp16 needs a CUDA device and --use_cpu trains on the CPU — fp16 comes from the "
                              "DeepSpeed file's fp16.enabled")


def test_a_dynamic_fp16_loss_scale_needs_a_positive_window_and_floor():
    """DeepSpeed's dynamic loss scale (fp16.loss_scale 0) divides by loss_scale_window and floors at min_loss_scale: 0
    in either fails inside the engine once the model is built; a static scale reads neither."""
    def fp16(**block):
        return {"fp16": {"enabled": True, "loss_scale": 0, **block}}

    rule = ("must be > 0 while the loss scale is dynamic (fp16.loss_scale 0), as DeepSpeed requires: fix the value, or "
            "remove the key for the default")
    assert problems({}, fp16(loss_scale_window=0)) == [f"fp16.loss_scale_window=0: {rule} 1000"]
    assert problems({}, fp16(min_loss_scale=0, loss_scale_window=1)) == [f"fp16.min_loss_scale=0: {rule} 1"]
    static = fp16(loss_scale=128, loss_scale_window=0, min_loss_scale=0)
    assert resolve_deepspeed_config({}, static, world_size=1).config["fp16"]["loss_scale_window"] == 0


def test_apex_backend_is_rejected_with_the_alternative():
    """DeepSpeed 0.19 has no Apex AMP: a v4 --fp16_backend apex must be refused, pointing to --fp16_backend amp."""
    [problem] = problems({"fp16": True, "fp16_backend": "apex"}, {})
    assert "--fp16_backend apex" in problem and "--fp16_backend amp" in problem


def test_legacy_amp_block_is_rejected_with_the_replacement():
    """An old file's "amp" block is rejected by DeepSpeed 0.19; the message must say to use the "fp16" block."""
    [problem] = problems({}, {"amp": {"enabled": True, "opt_level": "O1"}})
    assert problem.startswith("amp:") and '"fp16"' in problem


def test_scheduler_type_conflicting_with_flag():
    """--lr_scheduler_type cosine against the file's WarmupLR must be refused, not train on the file's schedule."""
    [problem] = problems({"lr_scheduler_type": "cosine"}, {"scheduler": {"type": "WarmupLR", "params": {}}})
    assert "scheduler.type=WarmupLR" in problem and "--lr_scheduler_type cosine" in problem


def test_an_unknown_scheduler_type_lists_deepspeeds_and_guesses_only_when_one_is_close():
    """A "did you mean" with nothing close would send the user to a wrong name."""
    assert problems({}, {"scheduler": {"type": "Foo"}}) == [
        'scheduler.type "Foo" is not a DeepSpeed scheduler (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, '
        'LRRangeTest)']


def test_warmup_conflict_names_both():
    """--warmup_steps against the file's warmup_num_steps must name both values, not silently keep one."""
    [problem] = problems({"warmup_steps": 10}, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 50}}})
    assert "warmup_num_steps=50" in problem and "--warmup_steps 10" in problem


def test_optimizer_and_scheduler_peak_rate_disagree():
    """A file whose lr and warmup_max_lr differ trains at warmup_max_lr after warmup; the mismatch must be named."""
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-5}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-4}}}
    assert problems({}, config) == [
        "optimizer.params.lr=3e-05 and scheduler.params.warmup_max_lr=0.0001 disagree (after warmup the rate is "
        'warmup_max_lr): make them equal or set both to "auto"']


def test_missing_step_count_says_how_to_give_it():
    """A schedule that needs the total step count must, without one, say to give --num_training_steps."""
    [problem] = problems({"warmup_steps": 10}, {}, num_training_steps=None)
    assert "scheduler.params.total_num_steps" in problem and "--num_training_steps" in problem


def test_max_steps_gives_the_step_count():
    """--max_steps must fill the scheduler's total_num_steps; users should not have to give the count twice."""
    config = build_deepspeed_config({"warmup_steps": 10, "max_steps": 300}, world_size=1)
    assert config["scheduler"]["params"]["total_num_steps"] == 300


def test_unfillable_auto_is_named():
    """An "auto" we cannot fill (sub_group_size) must be named, not handed to DeepSpeed as the string "auto"."""
    [problem] = problems({}, {"zero_optimization": {"stage": 2, "sub_group_size": "auto"}})
    assert "zero_optimization.sub_group_size" in problem and '"auto"' in problem


def test_unknown_preset_lists_the_presets():
    """A misspelled preset name must be answered with the list of real presets."""
    with pytest.raises(DeepSpeedConfigError) as info:
        load_deepspeed_config("zero2_ofload")
    assert "zero2_offload" in str(info.value) and "zero2_minimal" in str(info.value)


def test_caller_config_is_not_mutated():
    """Resolving twice (argument time, then training start) must see the user's config as written."""
    config = {"zero_optimization": {"stage": 2, "cpu_offload": True}, "train_batch_size": "auto"}
    before = copy.deepcopy(config)
    build_deepspeed_config({}, world_size=2, num_training_steps=10, config=config)
    assert config == before


def test_file_with_only_the_zero_section_is_complete():
    """Stock transformers rejects this file for lack of batch fields; ours fills everything from the flags."""
    config = build_deepspeed_config({"per_device_train_batch_size": 4, "warmup_steps": 5, "learning_rate": 2e-5},
                                    world_size=2, num_training_steps=50, config="zero2_minimal")
    assert config["train_batch_size"] == 8 and config["train_micro_batch_size_per_gpu"] == 4
    assert config["optimizer"]["params"]["lr"] == 2e-5 and config["scheduler"]["type"] == "WarmupDecayLR"
    assert config["zero_allow_untested_optimizer"] is True


def test_legacy_cpu_offload_is_migrated():
    """Old files with zero_optimization.cpu_offload must still offload, as offload_optimizer, with one note."""
    resolution = resolve_deepspeed_config({}, {"zero_optimization": {"stage": 2, "cpu_offload": True}},
                                          world_size=1, num_training_steps=10)
    zero = resolution.config["zero_optimization"]
    assert "cpu_offload" not in zero and zero["offload_optimizer"] == {"device": "cpu"}
    assert len([n for n in resolution.notes if "cpu_offload" in n]) == 1


def test_world_size_from_environment(monkeypatch):
    """Under a launcher the batch fields must use its WORLD_SIZE, or train_batch_size is wrong for the job."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_world_size() == 4
    assert build_deepspeed_config({}, num_training_steps=10, config={})["train_batch_size"] == 32
    assert resolve_world_size(3) == 3


def test_accepts_dict_inline_json_path_and_preset(tmp_path):
    """--deepspeed must take every form users pass: a dict, inline JSON, a file path or a preset name."""
    path = tmp_path / "z.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    for value in ({"zero_optimization": {"stage": 2}}, '{"zero_optimization": {"stage": 2}}', str(path), "zero2_minimal"):
        config = build_deepspeed_config({}, world_size=1, num_training_steps=10, config=value)
        assert config["zero_optimization"]["stage"] == 2


def command_line(tmp_path, *argv):
    """ExtTrainingArguments parsed from a real argv by ExtArgumentParser (its record: the flags argv names)."""
    from trainer_ext import ExtArgumentParser, ExtTrainingArguments

    (args,) = ExtArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), *argv])
    return args


CLASSIC_OPTIMIZER = {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999]}}


# A flag typed at its transformers default, a file that says otherwise, what the problem must name, and the flag
# the file sets when nothing is typed.
WARMUP_50 = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 50}}}
TYPED_AT_DEFAULT = {
    "batch": (["--per_device_train_batch_size", "8"], {"train_batch_size": 100},
              ["train_batch_size=100", "train_micro_batch_size_per_gpu=8 (flag --per_device_train_batch_size)",
               "--per_device_train_batch_size 50"], "per_device_train_batch_size"),
    "batch, dashed spelling": (["--per-device-train-batch-size", "8"], {"train_batch_size": 100},
                               ["(flag --per_device_train_batch_size)"], "per_device_train_batch_size"),
    "lr": (["--learning_rate=5e-5"], {"optimizer": CLASSIC_OPTIMIZER},
           ["optimizer.params.lr=3e-05", "--learning_rate 5e-05"], "learning_rate"),
    "betas": (["--adam_beta1", "0.9"], {"optimizer": CLASSIC_OPTIMIZER},
              ["optimizer.params.betas[0]=0.8", "--adam_beta1 0.9"], "adam_beta1"),
    "warmup steps": (["--warmup_steps", "0"], WARMUP_50, ["warmup_num_steps=50", "--warmup_steps 0"], "warmup_steps"),
    "warmup ratio": (["--warmup_ratio", "0"], WARMUP_50, ["warmup_num_steps=50", "--warmup_ratio 0"], "warmup_steps"),
    "fp16": (["--fp16", "false"], {"fp16": {"enabled": True}}, ["fp16.enabled=true", "--fp16 false"], "fp16"),
    "bf16": (["--bf16=False"], {"bf16": {"enabled": True}}, ["bf16.enabled=true", "--bf16 false"], "bf16"),
}


@pytest.mark.parametrize("case", list(TYPED_AT_DEFAULT))
def test_a_flag_typed_at_its_default_conflicts_with_the_file(tmp_path, case):
    """A typed flag equal to transformers' default would silently lose to the file (micro-batch 50, lr 3e-5)."""
    argv, config, phrases, flag = TYPED_AT_DEFAULT[case]
    [problem] = problems(command_line(tmp_path, *argv), config)
    for phrase in phrases:
        assert phrase in problem
    untyped = resolve_deepspeed_config(command_line(tmp_path), config, world_size=2, num_training_steps=100)
    assert flag in untyped.effective_flags  # nothing typed: the file's value is taken, as before


@pytest.mark.deepspeed
def test_keyword_arguments_from_python_count_as_typed(tmp_path, monkeypatch):
    """ExtTrainingArguments(per_device_train_batch_size=8, deepspeed=...) from a script must not train on 50."""
    from trainer_ext import ExtTrainingArguments

    monkeypatch.setenv("RANK", "0")  # a launched rank: no launcher variables set for this test process
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # as torchrun sets it (rank variables without it are refused)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DeepSpeedConfigError, match=r"train_batch_size=100 .*--per_device_train_batch_size 50"):
        ExtTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                             deepspeed={"train_batch_size": 100})


def test_stock_training_arguments_keep_the_differs_from_default_rule(tmp_path):
    """Stock TrainingArguments carry no record of what was typed: a flag at its default gives way to the file."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, learning_rate=5e-5)
    config = {"train_batch_size": 100, "optimizer": CLASSIC_OPTIMIZER}
    resolution = resolve_deepspeed_config(args, config, world_size=2, num_training_steps=10)
    assert resolution.effective_flags["per_device_train_batch_size"] == 50
    assert resolution.effective_flags["learning_rate"] == 3e-5


@pytest.mark.parametrize("config,phrase", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "optimizer.params.lr=-1 in the file (it would set "
                                                             "--learning_rate): must be >= 0"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}}, "optimizer.params.betas[1]=1.5"),
    ({"gradient_clipping": "x"}, "gradient_clipping=\"x\" in the file (it would set --max_grad_norm): must be a number"),
])
def test_file_values_out_of_the_flag_ranges_are_refused(config, phrase):
    """A file's negative lr would reach torch's "Invalid learning rate" after the model is loaded."""
    assert any(phrase in problem for problem in problems({}, config))


def phase_one(flags, config, world_size):
    """What ExtTrainingArguments resolves at parse time, with the file's values written onto the flags."""
    resolution = resolve_deepspeed_config(flags, config, world_size=world_size, final=False)
    flags.update(resolution.effective_flags)
    return resolution


def test_phase_two_fills_only_what_was_pending():
    """The step count and the model's hidden size arrive at training start; everything else was already used."""
    flags = {"warmup_steps": 0.1}
    first = phase_one(flags, "zero2_auto", world_size=2)
    assert "scheduler.params.total_num_steps" in first.pending
    done = finish_deepspeed_config(first, flags, world_size=2, num_training_steps=50, hidden_size=64)
    assert done.config["scheduler"]["params"]["total_num_steps"] == 50
    assert done.config["scheduler"]["params"]["warmup_num_steps"] == 5
    assert done.config["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert not done.pending and done.config["train_batch_size"] == first.config["train_batch_size"]
    assert first.config["scheduler"]["params"]["total_num_steps"] == "auto"  # phase 1's own result is left alone


def test_a_batch_split_for_another_world_size_is_an_error_not_a_second_batch_size():
    """A file giving only train_batch_size is split by the launcher's WORLD_SIZE at parse time; the sampler is built
    from that micro batch. A process group of another size must stop the run, never hand DeepSpeed another batch."""
    flags = {}
    first = phase_one(flags, {"train_batch_size": 32}, world_size=2)
    assert flags["per_device_train_batch_size"] == 16  # what the sampler uses
    with pytest.raises(DeepSpeedConfigError, match="train_batch_size=32 in the file was split for 2 rank.*process "
                                                   "group has 4"):
        finish_deepspeed_config(first, flags, world_size=4, num_training_steps=10)


def test_batch_fields_from_the_flags_follow_the_real_world_size():
    """Micro batch and accumulation come from the flags: the real world size only changes the global batch."""
    flags = {"per_device_train_batch_size": 4}
    first = phase_one(flags, {}, world_size=2)
    done = finish_deepspeed_config(first, flags, world_size=3, num_training_steps=10)
    assert (done.config["train_micro_batch_size_per_gpu"], done.config["train_batch_size"]) == (4, 12)


@pytest.mark.parametrize("schedule", ["constant", "constant_with_warmup", "linear"])
def test_phase_two_never_turns_a_derived_schedule_into_a_file_value(schedule):
    """A constant schedule's DeepSpeed warmup (1 step at a constant rate) is derived, not the user's: training must not
    stop when the step count arrives (it did under `--lr_scheduler_type constant` with DeepSpeed)."""
    flags = {"lr_scheduler_type": schedule, "warmup_steps": 0 if schedule == "constant" else 4}
    first = phase_one(flags, {}, world_size=2)
    done = finish_deepspeed_config(first, flags, world_size=2, num_training_steps=30)
    assert "auto" not in json.dumps(done.config) and done.effective_flags == first.effective_flags


@pytest.mark.parametrize("flags,config,world_size,problem", [
    ({}, {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 1,
     "train_batch_size=12, train_micro_batch_size_per_gpu=4 and gradient_accumulation_steps=2 in the file cannot hold "
     "at world size 1: 4 × 2 × 1 rank = 8, not 12. To make them agree, in the file set train_batch_size to 8 or "
     "train_micro_batch_size_per_gpu to 6 or gradient_accumulation_steps to 3"),
    ({}, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2,
     "train_batch_size=8, train_micro_batch_size_per_gpu=4 and gradient_accumulation_steps=2 in the file cannot hold "
     "at world size 2: 4 × 2 × 2 ranks = 16, not 8 (they hold on 1 rank). To make them agree, in the file set "
     "train_batch_size to 16 or train_micro_batch_size_per_gpu to 2 or gradient_accumulation_steps to 1"),
    ({}, {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 32,
     "train_batch_size=64, train_micro_batch_size_per_gpu=4 and gradient_accumulation_steps=2 in the file cannot hold "
     "at world size 32: 4 × 2 × 32 ranks = 256, not 64 (they hold on 8 ranks); 64 is not a multiple of "
     "train_micro_batch_size_per_gpu × world size = 4 × 32, so no gradient_accumulation_steps can fix it. To make "
     "them agree, in the file set train_batch_size to 256 or train_micro_batch_size_per_gpu to 1"),
    ({}, {"train_batch_size": 20, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3,
     "train_batch_size=20, train_micro_batch_size_per_gpu=4 and gradient_accumulation_steps=2 in the file cannot hold "
     "at world size 3: 4 × 2 × 3 ranks = 24, not 20; 20 is not a multiple of train_micro_batch_size_per_gpu × world "
     "size = 4 × 3, so no gradient_accumulation_steps can fix it. To make them agree, in the file set "
     "train_batch_size to 24"),
    ({}, {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2,
     "train_batch_size=4, train_micro_batch_size_per_gpu=4 and gradient_accumulation_steps=2 in the file cannot hold "
     "at world size 2: 4 × 2 × 2 ranks = 16, not 4; 4 is not a multiple of train_micro_batch_size_per_gpu × world "
     "size = 4 × 2, so no gradient_accumulation_steps can fix it. To make them agree, in the file set "
     "train_batch_size to 16 or train_micro_batch_size_per_gpu to 1"),
    ({}, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2,
     "train_batch_size=16, train_micro_batch_size_per_gpu=4 and gradient_accumulation_steps=3 in the file cannot hold "
     "at world size 2: 4 × 3 × 2 ranks = 24, not 16. To make them agree, in the file set train_batch_size to 24 or "
     "gradient_accumulation_steps to 2"),
    ({}, {"train_batch_size": 64, "gradient_accumulation_steps": 3}, 2,
     "train_batch_size=64 and gradient_accumulation_steps=3 in the file cannot hold at world size 2: "
     "train_micro_batch_size_per_gpu=8 (default --per_device_train_batch_size) × 3 × 2 ranks = 48, not 64. To make "
     "them agree, in the file set train_batch_size to 48 or gradient_accumulation_steps to 4"),
    ({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}, {"train_batch_size": 8}, 2,
     "train_batch_size=8 in the file cannot hold at world size 2: train_micro_batch_size_per_gpu=4 (flag "
     "--per_device_train_batch_size) × gradient_accumulation_steps=2 (flag --gradient_accumulation_steps) × 2 ranks "
     "= 16, not 8 (they hold on 1 rank). To make them agree, set --per_device_train_batch_size 2 or "
     "--gradient_accumulation_steps 1, or in the file set train_batch_size to 16")])
def test_batch_fields_that_cannot_hold_say_which_values_would(flags, config, world_size, problem):
    """Worked by hand: the product, the rank count the fields hold on, and each value (flag or file) that makes the
    product train_batch_size, or none when the micro batch cannot divide it; a wrong one sends the user to a second
    failed launch."""
    assert problems(flags, config, world_size=world_size) == [f'{problem} (or set train_batch_size to "auto")']
    assert problems({}, {"train_batch_size": -4}) == ["train_batch_size must be a positive integer, got -4"]
