"""The planner's LoRA settings (trainer_ext.planner.lora_settings) in process: the CLI's values become a LoRA, and each
wrong value gets one line naming the flag, the value and the fix (issue 45: these mutants survived the unit run)."""
import pytest

from trainer_ext.planner import DecoderShape, LoRA, PlanError, lora_settings

SHAPE = DecoderShape("llama", 32, 2, 4, 2, 8, 64, 96, False)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_lora_defaults_are_peft_defaults():
    """peft's defaults (q_proj and v_proj, no dropout, no DoRA, nothing saved, not quantized) would be wrong."""
    assert lora_settings(SHAPE, 8) == LoRA(8, ("q_proj", "v_proj"), 0.0, False, (), False)


def test_lora_values_are_passed_through():
    """A LoRA would not carry the CLI's rank, modules, dropout, DoRA, saved modules or quantization."""
    got = lora_settings(SHAPE, 4, " k_proj , o_proj,,k_proj", 0.05, True, "lm_head, embed_tokens,lm_head", True)
    assert got == LoRA(4, ("k_proj", "o_proj"), 0.05, True, ("lm_head", "embed_tokens"), True)


def test_lora_all_linear_is_every_decoder_linear():
    """"all-linear" would not mean every Linear of a decoder layer, as peft reads it."""
    assert lora_settings(SHAPE, 2, "all-linear").target_modules == ALL


def test_lora_without_decoder_shape_says_what_to_give():
    """--lora_r without a decoder config would not say to give --model with a llama/mistral/qwen2 config.json."""
    with pytest.raises(PlanError) as raised:
        lora_settings(None, 8)
    assert str(raised.value) == ("--lora_r needs the model's layers: give --model with a config.json of model_type "
                                 "llama, mistral, qwen2 (not --num_parameters)")


@pytest.mark.parametrize("r", [0, -1, 2.0, "8"])
def test_lora_rank_must_be_a_positive_integer(r):
    """A rank below 1 or not an int would be accepted instead of one line naming --lora_r, its value and the fix."""
    with pytest.raises(PlanError) as raised:
        lora_settings(SHAPE, r)
    assert str(raised.value) == f"--lora_r {r}: the adapters' rank must be a positive integer, such as 8 or 16"


def test_lora_rank_one_is_accepted():
    """The smallest rank, 1, would be refused."""
    assert lora_settings(SHAPE, 1).r == 1


@pytest.mark.parametrize("dropout", [1, 1.5, -0.01])
def test_lora_dropout_must_be_a_probability_below_one(dropout):
    """A dropout outside [0, 1) would be accepted instead of one line naming --lora_dropout, its value and the fix."""
    with pytest.raises(PlanError) as raised:
        lora_settings(SHAPE, 8, dropout=dropout)
    assert str(raised.value) == (f"--lora_dropout {dropout}: a probability from 0 (peft's default) to below 1, "
                                 "such as 0.05")


@pytest.mark.parametrize("dropout", [0, 0.999])
def test_lora_dropout_bounds_are_accepted(dropout):
    """A dropout of 0 or just below 1 would be refused."""
    assert lora_settings(SHAPE, 8, dropout=dropout).dropout == dropout


def test_lora_unknown_module_names_the_closest():
    """A misspelt target module would not get one line naming the flag, the value, the closest name and the choices."""
    with pytest.raises(PlanError) as raised:
        lora_settings(SHAPE, 8, "q_proj,vproj")
    assert str(raised.value) == ("--lora_target_modules 'q_proj,vproj': vproj (did you mean v_proj?) is not a module "
                                 "of a llama layer; choose among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                                 "down_proj, or all-linear")


def test_lora_unknown_modules_are_all_named():
    """Two unknown target modules would not both be named, with "are not modules" and no hint where none is close."""
    with pytest.raises(PlanError) as raised:
        lora_settings(SHAPE, 8, "xyzzy,c_attn")
    assert str(raised.value).startswith("--lora_target_modules 'xyzzy,c_attn': xyzzy, c_attn are not modules of a "
                                        "llama layer; choose among q_proj, ")


def test_lora_empty_target_modules_are_refused():
    """A list of only commas would give a LoRA on no module instead of one line saying no module was named."""
    with pytest.raises(PlanError) as raised:
        lora_settings(SHAPE, 8, " , ")
    assert str(raised.value) == ("--lora_target_modules ' , ': no module named; choose among q_proj, k_proj, v_proj, "
                                 "o_proj, gate_proj, up_proj, down_proj, or all-linear")


def test_lora_modules_to_save_outside_the_counted_ones_are_refused():
    """A module to save that the planner does not count would be accepted instead of one line naming the choices."""
    with pytest.raises(PlanError) as raised:
        lora_settings(SHAPE, 8, modules_to_save="lm_head,score,norm")
    assert str(raised.value) == ("--lora_modules_to_save 'lm_head,score,norm': the planner counts embed_tokens and "
                                 "lm_head (the embeddings new tokens need), not score, norm")
