"""TRL's arguments classes combined with ExtTrainingArguments keep every TRL default: ExtSFTConfig(output_dir=…) trained
at transformers' learning rate 5e-5 (SFTConfig: 2e-5), logged every 500 steps, in fp32 without gradient checkpointing,
because dataclass took each field from ExtTrainingArguments, which lists every TrainingArguments field."""

import dataclasses
import importlib.util
import warnings

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install -e '.[test]')")


def trl_configs():
    """Every arguments class TRL exports that is a TrainingArguments (SFTConfig, DPOConfig, KTOConfig, ...): a config
    TRL adds later is compared too."""
    import trl
    from transformers import TrainingArguments

    return [getattr(trl, name) for name in sorted(dir(trl)) if name.endswith("Config")
            and isinstance(getattr(trl, name), type) and issubclass(getattr(trl, name), TrainingArguments)]


def combined(config):
    from trainer_ext import ExtTrainingArguments

    import trainer_ext.trl

    shipped = getattr(trainer_ext.trl, f"Ext{config.__name__}", None)  # ExtSFTConfig, ExtDPOConfig
    return shipped or dataclasses.dataclass(type(f"Ext{config.__name__}", (ExtTrainingArguments, config), {}))


def default(field):
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def test_every_trl_config_is_found():
    """The list the other tests walk: an import change in TRL must not leave it empty."""
    assert {"SFTConfig", "DPOConfig"} <= {config.__name__ for config in trl_configs()}


@pytest.mark.parametrize("config", trl_configs(), ids=lambda config: config.__name__)
def test_a_combined_config_declares_every_trl_default(config):
    """The class's own defaults (what --help shows and the parser fills in) are TRL's for every field TRL has."""
    ours = {field.name: field for field in dataclasses.fields(combined(config))}
    changed = {field.name: (default(ours[field.name]), default(field)) for field in dataclasses.fields(config)
               if default(ours[field.name]) != default(field)}
    assert changed == {}


@pytest.mark.parametrize("config", trl_configs(), ids=lambda config: config.__name__)
def test_a_combined_config_built_with_defaults_equals_trls(config, tmp_path):
    """Built from the same arguments, every field TRL has holds TRL's value after both __post_init__s (bf16's None
    settled to "on unless fp16" before our checks read it: the DeepSpeed file and the precision checks saw False)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, theirs = (cls(output_dir=str(tmp_path), use_cpu=True) for cls in (combined(config), config))
    differing = {field.name: (getattr(ours, field.name), getattr(theirs, field.name))
                 for field in dataclasses.fields(config) if getattr(ours, field.name) != getattr(theirs, field.name)}
    assert differing == {}
    assert ours.bf16 is True and ours.learning_rate == theirs.learning_rate != 5e-5


def test_the_command_line_gets_trls_defaults_too(tmp_path):
    """ExtArgumentParser(ExtSFTConfig) with no flags but the folder: TRL's defaults, not transformers'."""
    from trl import SFTConfig

    from trainer_ext import ExtArgumentParser
    from trainer_ext.trl import ExtSFTConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (args,) = ExtArgumentParser(ExtSFTConfig).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--use_cpu", "true"])
        stock = SFTConfig(output_dir=str(tmp_path), use_cpu=True)
    assert (args.learning_rate, args.logging_steps, args.gradient_checkpointing, args.bf16) == \
        (stock.learning_rate, stock.logging_steps, stock.gradient_checkpointing, stock.bf16) == (2e-5, 10, True, True)


def test_a_subclass_field_of_its_own_still_wins(tmp_path):
    """A user's class that declares a field itself keeps its own default (only inherited fields take TRL's)."""
    from trl import SFTConfig

    from trainer_ext import ExtTrainingArguments

    @dataclasses.dataclass
    class MyConfig(ExtTrainingArguments, SFTConfig):
        learning_rate: float = 3e-4
        my_flag: int = 7

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = MyConfig(output_dir=str(tmp_path), use_cpu=True)
    assert (args.learning_rate, args.my_flag, args.logging_steps) == (3e-4, 7, 10)


@pytest.mark.deepspeed
def test_trls_bf16_default_reaches_the_deepspeed_config(tmp_path):
    """bf16=None (TRL's "on unless fp16") was still None when the DeepSpeed file was resolved against the flags: the
    resolved config trained in fp32 while the Trainer's own precision said bf16."""
    pytest.importorskip("deepspeed")
    from trainer_ext.trl import ExtSFTConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = ExtSFTConfig(output_dir=str(tmp_path), use_cpu=True, deepspeed="zero2_minimal")
    config = args.run_settings.settled.config
    assert (args.bf16, config["bf16"]["enabled"], config["fp16"]["enabled"]) == (True, True, False)


def test_a_combined_class_without_dataclass_is_refused_naming_the_decorator(tmp_path):
    """`class MyArgs(ExtTrainingArguments, DPOConfig): pass` has ExtTrainingArguments' constructor, which never sets
    DPOConfig's fields: DPOConfig's own check failed with `AttributeError: ... no attribute 'loss_type'` (the stack
    notes' "ExtTrainer + DPOTrainer fails at construction"). One line naming the decorator instead."""
    from trl import DPOConfig

    from trainer_ext import ExtTrainingArguments
    from trainer_ext.errors import ArgumentsError

    class MyArgs(ExtTrainingArguments, DPOConfig):
        pass

    with pytest.raises(ArgumentsError, match=r"MyArgs combines ExtTrainingArguments with DPOConfig but is not a "
                                             r"dataclass itself, .* put @dataclass"):
        MyArgs(output_dir=str(tmp_path), use_cpu=True)


def test_ext_dpo_trainer_takes_dpo_trainers_arguments_in_its_order(tmp_path):
    """ExtTrainer passed its arguments on positionally, and DPOTrainer's second parameter is ref_model: it took our
    arguments for the reference model and built a DPOConfig of its own. Positionally and by name, ExtDPOTrainer now
    trains with the arguments given and the reference given."""
    import datasets
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from trainer_ext.trl import ExtDPOConfig, ExtDPOTrainer

    core = Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1, "a": 2, "b": 3, "c": 4}, unk_token="<pad>"))
    core.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
    config = LlamaConfig(vocab_size=5, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=16, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model, reference = LlamaForCausalLM(config), LlamaForCausalLM(config)
    pairs = datasets.Dataset.from_list([{"prompt": "a ", "chosen": "b <eos>", "rejected": "c <eos>"}] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = ExtDPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", beta=0.25)
        positional = ExtDPOTrainer(model, reference, args, None, pairs, processing_class=tokenizer)
        named = ExtDPOTrainer(model=model, ref_model=reference, args=args, train_dataset=pairs,
                              processing_class=tokenizer)
    for trainer in (positional, named):
        assert trainer.args is args and trainer.beta == 0.25 and trainer.ref_model is reference
