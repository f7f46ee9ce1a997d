"""The planner's arguments (trainer_ext.planner.plan) in process: its defaults, and every wrong value named in one line
with the field, the value and the fix (issue 45: these mutants survived the unit run)."""
import pytest

from trainer_ext.planner import LoRA, ModelSize, PlanError, plan

SIZE = ModelSize(1000, "test", hidden_size=4, num_layers=2, num_heads=2)


def test_plan_defaults_are_fp32_batch_8_of_512_tokens():
    """A plan without options would not be fp32, 8 sequences of 512 tokens, no offload, LoRA or checkpointing."""
    got = plan(SIZE, 2)
    assert (got.model, got.world_size, got.precision, got.batch_size, got.seq_length) == (SIZE, 2, "fp32", 8, 512)
    assert (got.offload, got.lora, got.gradient_checkpointing, got.device_memory) == (False, None, False, None)
    assert got.trainable_parameters == 1000


def test_plan_one_token_sequences_and_fp16_are_accepted():
    """A batch of one sequence of one token, or fp16, would be refused."""
    got = plan(SIZE, 1, "fp16", batch_size=1, seq_length=1, attention="eager")
    assert (got.precision, got.batch_size, got.seq_length) == ("fp16", 1, 1)


def test_plan_names_every_wrong_argument_in_one_line():
    """Wrong arguments would not all be named in one line, each with its field, its value and what is allowed."""
    with pytest.raises(PlanError) as raised:
        plan(SIZE, 0, "FP32", attention="flash", batch_size=0, seq_length=5, lora=LoRA(8, ("q_proj",)))
    assert str(raised.value) == (
        "--world_size must be a positive integer, got 0; precision must be fp32, fp16 or bf16, got 'FP32'; "
        "--attention must be sdpa or eager, got 'flash'; --per_device_train_batch_size (0) and --max_seq_length (5) "
        "must be positive; LoRA needs the model's layers: give --model with a config.json of model_type llama, "
        "mistral, qwen2")


def test_plan_refuses_a_zero_sequence_length_alone():
    """A zero --max_seq_length with a valid batch size would be accepted."""
    with pytest.raises(PlanError, match=r"^--per_device_train_batch_size \(8\) and --max_seq_length \(0\) must be"):
        plan(SIZE, 1, seq_length=0)


def test_plan_without_shape_notes_activations_not_estimated():
    """A model of unknown shape would not get the note that its activations are not estimated, and how to fix it."""
    got = plan(ModelSize(1000, "test"), 1)
    assert ("activations not estimated: the model's hidden size, layers and heads are unknown "
            "(give a folder or config.json with them)") in got.notes
