"""The DPO recipe's data and model flags (examples/run_dpo.py, trainer_ext/tasks/dpo.py), refused in one line before
any model loads: preference rows TRL would take apart later or train on silently (a missing answer, a rejected answer
equal to the chosen one, a turn without a role), a LoRA adapter folder given as the model (transformers loads one
itself only with peft >= 0.22, unreleased: a ValueError traceback), LoRA settings without a rank. The shipped pairs
are what their seeded script writes."""

import importlib.util
import json
import sys

import pytest

from conftest import REPO, user_error, write_lines

PAIR = {"prompt": [{"role": "user", "content": "What colour is the sky?"}],
        "chosen": [{"role": "assistant", "content": "The sky is blue."}],
        "rejected": [{"role": "assistant", "content": "The sky is green."}]}

BAD_PAIRS = {
    "sft row": ({"messages": PAIR["prompt"] + PAIR["chosen"]}, ["line 2", "'prompt', 'chosen' and 'rejected'",
                                                               "give them to examples/run_clm.py"]),
    "no rejected": ({"prompt": "Q", "chosen": "A"}, ["line 2", "each line needs 'prompt', 'chosen' and 'rejected'"]),
    "same answers": ({**PAIR, "rejected": PAIR["chosen"]}, ["line 2", "are the same answer"]),
    "mixed formats": ({**PAIR, "chosen": "The sky is blue."}, ["line 2", "'chosen' is", "all as lists"]),
    "bad role": ({**PAIR, "chosen": [{"role": "gpt", "content": "x"}]}, ["line 2", "role 'gpt'"]),
    "empty answer": ({"prompt": "Q: ", "chosen": " ", "rejected": "no"}, ["line 2", "'chosen' is empty"]),
    "answer not the assistant's": ({**PAIR, "rejected": [{"role": "user", "content": "x"}]},
                                   ["line 2", "must end with a non-empty assistant turn"]),
}


@pytest.mark.parametrize("case", sorted(BAD_PAIRS))
def test_a_bad_preference_row_is_one_line_naming_the_line(tmp_path, capsys, case):
    row, words = BAD_PAIRS[case]
    path = write_lines(tmp_path / "pairs.jsonl", [PAIR, row])
    err = user_error(capsys, "run_dpo", "--output_dir", tmp_path / "out", "--do_train", "--train_file", path,
                     "--use_cpu", "true")
    assert all(word in err for word in words) and str(path) in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("recipe", ["run_dpo", "run_clm"])
def test_an_adapter_folder_as_the_model_is_refused_with_the_merge_command(tmp_path, capsys, recipe):
    """transformers 5.24 loads an adapter folder into its base itself only with peft >= 0.22 (not released): a
    ValueError traceback from inside from_pretrained. Refused before loading, naming `trainer-ext merge`."""
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "base", "peft_type": "LORA"}))
    err = user_error(capsys, recipe, "--output_dir", tmp_path / "out", "--do_train", "--model_name_or_path", adapter,
                     "--use_cpu", "true")
    assert f"--model_name_or_path {adapter} holds a LoRA adapter" in err and "peft >= 0.22" in err
    assert f"trainer-ext merge {adapter} --output_dir lora-merged" in err


@pytest.mark.parametrize("flags, said", [
    (["--lora_dora"], "--lora_dora is a setting of LoRA adapters, which train only with --lora_r"),
    (["--lora_alpha", "32", "--lora_rslora"], "--lora_alpha, --lora_rslora are settings of LoRA adapters"),
    (["--lora_r", "4", "--lora_modules_to_save", "embed_token"], "embed_token (did you mean embed_tokens?)"),
])
def test_lora_settings_are_checked_before_the_model_loads(tmp_path, capsys, flags, said):
    err = user_error(capsys, "run_dpo", "--output_dir", tmp_path / "out", "--do_train", "--use_cpu", "true", *flags)
    assert said in err, err


def test_the_shipped_pairs_are_what_the_seeded_script_writes(tmp_path, monkeypatch):
    """data/preference/ edited by hand (or the script changed without rerunning it) would no longer be the documented
    set: the script, run again, writes the same bytes; every pair reads."""
    from trainer_ext.tasks.dpo import read_pairs

    spec = importlib.util.spec_from_file_location("make_preference_data", REPO / "scripts" / "make_preference_data.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", [str(REPO / "scripts"), *sys.path])
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "OUT", tmp_path)
    script.main()
    for name in ("train.jsonl", "validation.jsonl"):
        assert (tmp_path / name).read_bytes() == (REPO / "data" / "preference" / name).read_bytes()
    assert len(read_pairs(str(REPO / "data" / "preference" / "validation.jsonl"))) == 200


def test_precomputed_reference_log_probs_need_datasets_on_files_on_several_ranks(tmp_path):
    """TRL writes the precomputed reference log-probs beside the dataset's files on the main process: with an
    in-memory Dataset each rank's cache is a temporary folder of its own, and the other ranks failed
    (FileNotFoundError, measured on 2 ranks). Refused before any model work, naming the fix; one process, or a
    dataset read from files, goes on."""
    import types

    import datasets

    from trainer_ext.errors import UserError
    from trainer_ext.trl import check_precomputed_reference

    in_memory = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    write_lines(tmp_path / "pairs.jsonl", [PAIR])
    on_files = datasets.load_dataset("json", data_files=str(tmp_path / "pairs.jsonl"), split="train",
                                     cache_dir=str(tmp_path / "cache"))
    args = types.SimpleNamespace(precompute_ref_log_probs=True, world_size=2)
    with pytest.raises(UserError, match="--precompute_ref_log_probs on 2 ranks with an in-memory train_dataset"):
        check_precomputed_reference(args, {"train_dataset": in_memory})
    check_precomputed_reference(args, {"train_dataset": on_files, "eval_dataset": {"held_out": on_files}})
    check_precomputed_reference(types.SimpleNamespace(precompute_ref_log_probs=True, world_size=1),
                                {"train_dataset": in_memory})


def test_new_tokens_grow_the_embeddings_and_train_only_when_saved_whole():
    """A tokenizer with tokens the model lacks (added tokens): the model's embeddings were indexed out of range at the
    first batch holding one; under LoRA their rows would never train. They grow to the tokenizer (both ends); under
    LoRA only with embed_tokens and lm_head trained whole, else one line naming the flag."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer_ext.errors import ArgumentsError
    from trainer_ext.tasks.causal_lm import ModelArguments, fit_vocabulary

    def model():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))

    grown = [None] * 100  # a tokenizer of 100 tokens, as fit_vocabulary reads it (its length)
    with pytest.raises(ArgumentsError, match="4 tokens the model's 96 embeddings lack .* --lora_modules_to_save "
                                             "embed_tokens,lm_head"):
        fit_vocabulary(model(), grown, ModelArguments(lora_r=4), None)
    for flags, saved in (({"lora_r": 4, "lora_modules_to_save": "embed_tokens,lm_head"}, ["embed_tokens", "lm_head"]),
                         ({}, None)):
        resized = model()
        fit_vocabulary(resized, grown, ModelArguments(**flags), saved)
        assert resized.get_input_embeddings().num_embeddings == resized.get_output_embeddings().out_features == 100
