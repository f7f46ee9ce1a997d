"""The planner's arguments (trainer_ext.planner.plan) in process: its defaults, and every wrong value named in one line
with the field, the value and the fix (issue 45: these mutants survived the unit run)."""
import pytest

from trainer_ext.planner import (DecoderShape, LoRA, ModelSize, PlanError, activation_note, decoder_activation_bytes,
                                 formulas, plan)

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


# A decoder whose MLP projections hold exactly ZeRO-3's persistence threshold (10·h = 320 elements each).
EDGE = DecoderShape("llama", 32, 2, 4, 2, 8, 10, 96, False)
EDGE_SIZE = ModelSize(50_000, "test", hidden_size=32, num_layers=2, num_heads=4, dropout=False, attention_dropout=False,
                      decoder=EDGE)


def test_plan_carries_each_backends_formula_and_the_run_it_was_asked_for():
    """Each row would lose its backend's flag, communication, CUDA-only mark, note or activations' settings (autocast,
    inputs kept by every Linear), or the plan the device memory, the activation note, LoRA, offload or checkpointing
    it was asked for."""
    lora = LoRA(8, ("q_proj", "v_proj"))
    got = plan(EDGE_SIZE, 2, "bf16", offload=True, batch_size=2, seq_length=16, device_memory=1e12,
               attention="eager", lora=lora, gradient_checkpointing=True, chunked_loss=False)
    rows = formulas(True)
    assert [(e.backend, e.flag, e.communication, e.cuda_only, e.note) for e in got.estimates] == [
        (f.name, f.flag, f.communication, f.cuda_only, f.note) for f in rows]
    assert [e.activations for e in got.estimates] == [
        decoder_activation_bytes(EDGE, 2, 16, 2, f.autocast, lora, True, "eager", f.linears_keep_inputs,
                                 chunked_loss=False).peak for f in rows]
    assert len({e.activations for e in got.estimates}) > 1  # autocast and kept inputs change the peak
    assert (got.device_memory, got.lora, got.offload, got.gradient_checkpointing) == (1e12, lora, True, True)
    assert got.activation_formula == activation_note(EDGE_SIZE, "eager", lora, True, True, False)


def test_an_offloaded_row_holds_its_parameters_and_optimizer_on_the_host_and_fits_at_exactly_the_device():
    """ZeRO-3 offload's host bytes would count only the parameters (or only the optimizer); a tensor of exactly the
    persistence threshold would be kept whole; a device of exactly a row's bytes would not fit it."""
    got = plan(EDGE_SIZE, 2, "bf16", offload=True, batch_size=2, seq_length=16)
    by_name = {e.backend: e for e in got.estimates}
    row = next(f for f in formulas(True) if f.name == "zero3_offload")
    terms = row.bytes(50_000, 2)
    assert by_name["zero3_offload"].host == terms["grads"] + terms["optimizer"] + terms["params"]
    zero3, plain = by_name["zero3"], next(f for f in formulas(True) if f.name == "zero3").bytes(50_000, 2)
    whole = [n for n in EDGE.parameter_tensors() if n < 320]  # the norms: 32 each; the 320-element MLPs are sharded
    assert 320 in EDGE.parameter_tensors() and zero3.params == plain["params"] + 2 * sum(whole)
    first = got.estimates[0]
    exactly = plan(EDGE_SIZE, 2, "bf16", batch_size=2, seq_length=16, device_memory=first.device_total)
    assert exactly.estimates[0].fits is True and exactly.cheapest_fitting().backend == first.backend


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_plan_gives_the_decoders_terms_and_its_note_for_the_run_asked_for(attention):
    """The plan's activation terms (the rows without autocast) would ignore the LoRA, checkpointing or attention
    asked for; autocast's rows (ddp, simple) would be counted as the others; the note would not say the loss is
    chunked; eager attention's dropout, which the terms leave out, would go unsaid (or be said for sdpa, which
    regenerates it)."""
    import dataclasses

    lora = LoRA(8, ("q_proj", "v_proj"))
    dropout = dataclasses.replace(EDGE_SIZE, attention_dropout=True)
    got = plan(dropout, 2, "bf16", batch_size=2, seq_length=16, attention=attention, lora=lora,
               gradient_checkpointing=True)
    assert got.activation_terms == decoder_activation_bytes(EDGE, 2, 16, 2, False, lora, True, attention,
                                                            chunked_loss=True)
    assert got.activation_formula == activation_note(dropout, attention, lora, True, True, True)
    assert "the loss, chunked" in got.activation_formula
    said = "the config's attention_dropout > 0: eager attention's dropout masks are not counted"
    assert (said in got.notes) == (attention == "eager")
    assert said not in plan(EDGE_SIZE, 2, "bf16", attention=attention).notes  # attention_dropout False
    rows = {e.backend: e.activations for e in plan(EDGE_SIZE, 2, "bf16", batch_size=2, seq_length=16).estimates}
    assert rows["ddp"] != rows["zero2"]  # fp32 weights under autocast keep more than bf16 weights
