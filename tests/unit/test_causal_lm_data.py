"""The causal-LM recipe's data, in this process: labels checked token by token against the chat template's text,
best-fit packing, packed training equal to padded training step by step, and each bad input as one line before the
model loads (examples/run_clm.py's main)."""

import json

import pytest

from conftest import REPO, user_error, write_lines

pytest.importorskip("peft")
SHIPPED = REPO / "data" / "causal_lm"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1?"},
        {"role": "assistant", "content": "A1."}, {"role": "user", "content": "Q2?"},
        {"role": "assistant", "content": "A2 here."}]


@pytest.fixture(scope="module")
def tokenizer():
    from trainer_ext.tasks.causal_lm import byte_tokenizer

    return byte_tokenizer()


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TRAINER_EXT_CACHE", str(tmp_path_factory.getbasetemp() / "trainer_ext_cache"))


def labelled_runs(ids, labels):
    """The runs of consecutive labelled tokens, as (first index, token ids)."""
    runs, current = [], None
    for index, (token, label) in enumerate(zip(ids, labels)):
        if label == -100:
            current = None
            continue
        assert label == token  # aligned with the inputs: the model shifts them
        if current is None:
            current = (index, [])
            runs.append(current)
        current[1].append(token)
    return runs


@pytest.mark.parametrize("template", ["tokenizer's", "default"])
def test_chat_labels_are_exactly_each_assistant_turn_and_its_end_marker(tokenizer, template):
    """Token by token: the labelled tokens are the tokenization of each assistant content followed by the template's
    end of turn (<|im_end|>, and for the default template the eos token), and nothing else is labelled."""
    from trainer_ext.tasks.chat_data import DEFAULT_CHAT_TEMPLATE, encode, render

    text = tokenizer.chat_template if template == "tokenizer's" else DEFAULT_CHAT_TEMPLATE
    ids, labels = encode({"messages": CHAT}, tokenizer, text, completion_only=True)
    assert ids == tokenizer(render(tokenizer, text, CHAT), add_special_tokens=False)["input_ids"]
    end = "<|im_end|>" + ("</s>" if template == "default" else "") + "\n"
    expected = [tokenizer(answer + end, add_special_tokens=False)["input_ids"] for answer in ("A1.", "A2 here.")]
    runs = labelled_runs(ids, labels)
    assert [tokens for _, tokens in runs] == expected
    for start, _ in runs:  # each run starts right after "<|im_start|>assistant\n"
        before = tokenizer.decode(ids[:start])
        assert before.endswith("<|im_start|>assistant\n")
    everything, _ = encode({"messages": CHAT}, tokenizer, text, completion_only=False)
    assert everything == ids


def test_prompt_completion_and_text_labels(tokenizer):
    from trainer_ext.tasks.chat_data import encode

    ids, labels = encode({"prompt": "Question: hi\nAnswer: ", "completion": "yes"}, tokenizer, None, True)
    assert tokenizer.decode(ids) == "Question: hi\nAnswer: yes</s>"
    assert tokenizer.decode([label for label in labels if label != -100]) == "yes</s>"
    ids, labels = encode({"text": "hello"}, tokenizer, None, True)
    assert labels == ids and tokenizer.decode(ids) == "hello</s>"


def test_conversational_prompt_completion_trains_the_completion_turns_only(tokenizer):
    from trainer_ext.tasks.chat_data import checked, encode

    row = checked("f.jsonl", 0, "prompt_completion", {
        "prompt": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "Old."},
                   {"role": "user", "content": "And?"}],
        "completion": [{"role": "assistant", "content": "New."}]})
    ids, labels = encode(row, tokenizer, tokenizer.chat_template, True)
    assert tokenizer.decode([label for label in labels if label != -100]) == "New.<|im_end|>\n"


def test_best_fit_packing_fills_rows_without_overflow():
    from trainer_ext.data.packing import pack, packed_row

    lengths = [9, 2, 7, 3, 5, 5, 1, 8]
    rows = pack(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert len(rows) == 4 == sum(lengths) // 10  # 40 tokens in 4 full rows of 10: none wasted
    assert pack(lengths, 10) == rows  # deterministic
    with pytest.raises(ValueError):
        pack([11], 10)
    row = packed_row([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}])
    assert row == {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, -100, 9], "position_ids": [0, 1, 2, 0, 1]}


class Groups:
    """The packed rows' samples, one training item per row: padded into a batch (the oracle) or packed."""

    def __init__(self, samples, groups, packed):
        from trainer_ext.data.packing import packed_row

        self.items = [packed_row([samples[i] for i in group]) if packed else [samples[i] for i in group]
                      for group in groups]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_training_equals_padded_training_step_by_step(tmp_path, tokenizer, attention):
    """The same samples per step, packed into rows (positions restarting, no attention mask) or padded as a batch:
    each step's loss and the final weights agree to 1e-5 (fp32, no dropout) — so no packed sample saw another.
    (Measured: 9.5e-7 in the losses, 3.4e-6 in the weights; at 10x the learning rate Adam's normalised steps carry
    the summation-order differences of the two shapes to 3.4e-5 in the weights, the losses still 9.5e-7 apart.)"""
    import torch

    from trainer_ext import ExtTrainer, ExtTrainingArguments
    from trainer_ext.data.packing import CausalLMCollator, pack
    from trainer_ext.tasks.chat_data import encode, read_rows
    from trainer_ext.tasks.causal_lm import tiny_llama

    rows = read_rows(SHIPPED / "train.jsonl", "train").rows[:48]
    samples = [dict(zip(("input_ids", "labels"), encode(r, tokenizer, tokenizer.chat_template, True))) for r in rows]
    groups = pack([len(s["input_ids"]) for s in samples], 256)
    assert len(groups) < len(samples) / 2  # several samples per row
    collate = CausalLMCollator(tokenizer.pad_token_id, length=256)
    runs = {}
    for packed in (True, False):
        model, _ = tiny_llama()
        model.config._attn_implementation = attention
        model.config.use_cache = False
        args = ExtTrainingArguments(output_dir=str(tmp_path / str(packed)), per_device_train_batch_size=1,
                                    learning_rate=3e-4, max_steps=len(groups), logging_steps=1, save_strategy="no",
                                    report_to="none", seed=3, disable_tqdm=True)
        trainer = ExtTrainer(model=model, args=args, train_dataset=Groups(samples, groups, packed),
                             data_collator=(lambda batch: collate(batch)) if packed else
                             (lambda batch: collate(batch[0])))
        trainer.train()
        runs[packed] = ([log["loss"] for log in trainer.state.log_history if "loss" in log],
                        {k: v.detach().clone() for k, v in model.state_dict().items()})
    (packed_losses, packed_weights), (padded_losses, padded_weights) = runs[True], runs[False]
    assert len(packed_losses) == len(groups)
    assert max(abs(a - b) for a, b in zip(packed_losses, padded_losses)) < 1e-5
    assert max((packed_weights[k] - padded_weights[k]).abs().max().item() for k in packed_weights) < 1e-5
    assert torch.isfinite(torch.tensor(packed_losses)).all()


# -- bad inputs: one line each, before the model loads ------------------------------------------------------------
def chat(*turns):
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


GOOD = chat(("user", "Hi?"), ("assistant", "Hello."))
BAD_ROWS = {
    "unknown role": ([GOOD, chat(("user", "Hi?"), ("asistant", "Hello."))],
                     ["line 2", "role 'asistant'", "did you mean 'assistant'"]),
    "no assistant turn": ([GOOD, chat(("system", "S."), ("user", "Hi?"))], ["line 2", "no assistant turn"]),
    "sharegpt without an answer": ([{"conversations": [{"from": "human", "value": "Hi"}]}],
                                   ["line 1", "conversations has no assistant turn"]),
    "sharegpt turns under messages": ([{"messages": [{"from": "human", "value": "Hi"}]}],
                                      ["line 1", "needs 'role' and 'content'", "--dataset_columns conversations"]),
    "image part": ([GOOD, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x.png"}]},
                                        {"role": "assistant", "content": "A cat."}]}],
                   ["line 2", "turn 1 (user): content part 1", "image_url", "text alone"]),
    "alpaca without output": ([{"instruction": "Say hi.", "input": ""}], ["line 1", "'instruction' but no 'output'"]),
    "empty completion": ([{"prompt": "Q: ", "completion": ""}], ["line 1", "'completion' is empty"]),
    "mixed formats": ([GOOD, {"text": "plain"}], ["line 2", "a text row in a file of messages rows"]),
    "no known field": ([{"question": "Q", "answer": "A"}], ["line 1", "'messages'", "'prompt' and 'completion'"]),
    "not json": (None, ["line 2 is not JSON"]),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_bad_row_is_one_line_naming_the_line(tmp_path, capsys, case):
    rows, words = BAD_ROWS[case]
    path = tmp_path / "train.jsonl"
    if rows is None:
        path.write_text(json.dumps(GOOD) + "\n{'role': oops\n")
    else:
        write_lines(path, rows)
    err = user_error(capsys, "run_clm", "--output_dir", tmp_path / "out", "--do_train", "--train_file", path)
    assert all(word in err for word in words), err
    assert str(path) in err and not (tmp_path / "out").exists()


BAD_FLAGS = {
    "lora target": (["--lora_r", 4, "--lora_target_modules", "q_proj,v_prj"],
                    ["--lora_target_modules q_proj,v_prj", "v_prj (did you mean v_proj?)", "k_proj, o_proj"]),
    "lora flag without rank": (["--lora_alpha", 16], ["--lora_alpha", "add --lora_r"]),
    "longer than the positions": (["--max_seq_length", 5000], ["--max_seq_length 5000", "1024 positions"]),
    "packing that mixes samples": (["--packing", "--attn_implementation", "plain_kernel"],
                                   ["--packing", "'plain_kernel'", "attend to each other", "--attn_implementation sdpa"]),
    "packing with a cache": (["--packing", "--use_cache", "true"], ["--packing with --use_cache true",
                                                                     "drop --use_cache"]),
    "template file": (["--chat_template", "missing.jinja"], ["--chat_template missing.jinja", "no such file"]),
    "streaming without max_steps": (["--streaming"], ["--streaming reads the training file as a stream",
                                                      "give --max_steps"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_a_bad_flag_is_one_line_before_the_model_loads(tmp_path, capsys, case):
    """(plain_kernel: an attention function a user registered, which transformers gives no packed-sample mask.)"""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("plain_kernel", sdpa_attention_forward)
    flags, words = BAD_FLAGS[case]
    err = user_error(capsys, "run_clm", "--output_dir", tmp_path / "out", "--do_train", *flags)
    assert all(word in err for word in words), err
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_without_pad_token_pads_with_eos_and_says_so(tokenizer, capsys):
    from trainer_ext.tasks.causal_lm import check_tokenizer

    import copy

    bare = copy.deepcopy(tokenizer)
    bare.pad_token = None
    check_tokenizer(bare, "--model_name_or_path")
    assert bare.pad_token == "</s>" and "padding with its eos token '</s>'" in capsys.readouterr().out
    bare.eos_token = None
    bare.pad_token = None
    from trainer_ext.errors import ArgumentsError

    with pytest.raises(ArgumentsError, match="neither a pad nor an eos token"):
        check_tokenizer(bare, "--model_name_or_path")


def test_a_template_that_drops_the_assistant_names_the_row(tmp_path, capsys):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
                        "{% endfor %}")
    path = write_lines(tmp_path / "train.jsonl", [GOOD])
    err = user_error(capsys, "run_clm", "--output_dir", tmp_path / "out", "--do_train", "--train_file", path,
                     "--chat_template", template)
    assert "line 1: no token carries a label" in err


def test_truncation_is_counted_and_samples_without_targets_are_left_out(tmp_path, tokenizer, capsys):
    from transformers import TrainingArguments

    from trainer_ext.tasks.causal_lm import DataArguments, tokenized
    from trainer_ext.tasks.chat_data import ChatFile

    path = write_lines(tmp_path / "train.jsonl", [
        GOOD, {"messages": [{"role": "user", "content": "x" * 80}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "z" * 80}]}])
    data = DataArguments(train_file=str(path), max_seq_length=40)
    out = tokenized({"train": ChatFile(path)}, tokenizer, tokenizer.chat_template, data,
                    TrainingArguments(str(tmp_path / "o")))
    said = capsys.readouterr().out
    assert "2 of 3 samples are longer than --max_seq_length 40" in said and "1 of them lost every target" in said
    train = out["train"].dataset
    assert len(train) == 2 and all(len(ids) <= 40 for ids in train["input_ids"])


def test_lora_without_peft_installed_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    from trainer_ext.errors import MissingLibraryError
    from trainer_ext.tasks.causal_lm import ModelArguments

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(MissingLibraryError, match=r"--lora_r needs peft.*trainer_ext\[llm\]"):
        ModelArguments(lora_r=8)


def test_flattened_packed_batch_gives_the_rows_loss(tokenizer):
    """flash attention reads sample boundaries only from one flattened row (batch size 1): the collator's `flatten`
    layout must give the loss of the rows it flattens (checked here under sdpa, which reads both layouts)."""
    import torch

    from trainer_ext.data.packing import CausalLMCollator, pack, packed_row
    from trainer_ext.tasks.causal_lm import tiny_llama
    from trainer_ext.tasks.chat_data import encode, read_rows

    rows = read_rows(SHIPPED / "train.jsonl", "train").rows[:12]
    samples = [dict(zip(("input_ids", "labels"), encode(r, tokenizer, tokenizer.chat_template, True))) for r in rows]
    packed = [packed_row([samples[i] for i in group]) for group in pack([len(s["input_ids"]) for s in samples], 256)]
    model, _ = tiny_llama()
    model.config.use_cache = False
    losses = {}
    for flatten in (False, True):
        batch = CausalLMCollator(tokenizer.pad_token_id, length=256, flatten=flatten)(packed)
        assert batch["input_ids"].shape == ((1, 256 * len(packed)) if flatten else (len(packed), 256))
        assert "attention_mask" not in batch
        with torch.no_grad():
            losses[flatten] = model(**batch).loss.item()
    assert abs(losses[True] - losses[False]) < 1e-6


def test_a_users_own_model_folder_without_chat_template_trains_with_the_default_template(tmp_path, tokenizer, capsys):
    """A GPT-2 shaped model folder of the user's (Conv1D layers, tied embeddings, a tokenizer without chat template
    or pad token): the recipe says which template and pad token it uses, LoRA's default targets are peft's for GPT-2
    (c_attn), and two steps train and save the adapter."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from conftest import example

    folder = tmp_path / "my-gpt2"
    mine = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<s>", eos_token="</s>")
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=256,
                               bos_token_id=1, eos_token_id=2)).save_pretrained(folder)
    mine.save_pretrained(folder)
    data = write_lines(tmp_path / "chat.jsonl", [GOOD] * 16)
    example("run_clm")(["--output_dir", str(tmp_path / "out"), "--do_train", "--model_name_or_path", str(folder),
                        "--train_file", str(data), "--lora_r", "2", "--max_steps", "2", "--max_seq_length", "128",
                        "--per_device_train_batch_size", "4", "--report_to", "none", "--save_strategy", "no"])
    said = capsys.readouterr().out
    assert "no chat template: using ChatML's" in said and "no pad token: padding with its eos token" in said
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["c_attn"] and config["base_model_name_or_path"] == str(folder)


# -- the formats users bring (issue 47 item 8, issue 48) --------------------------------------------------------------
def test_sharegpt_and_alpaca_rows_read_as_the_chat_they_hold(tmp_path):
    """ShareGPT (from/value, human/gpt, a top-level system) and Alpaca (instruction, input, output, system, history)
    rows become the messages the same conversations are written as, so they train the same tokens."""
    from trainer_ext.tasks.chat_data import read_rows

    turns = [("user", "Q1?"), ("assistant", "A1."), ("user", "Q2?\nmore"), ("assistant", "A2.")]
    messages = [{"role": "system", "content": "Be brief."}] + [{"role": r, "content": c} for r, c in turns]
    sharegpt = {"system": "Be brief.", "conversations": [{"from": {"user": "human", "assistant": "gpt"}[r], "value": c}
                                                          for r, c in turns]}
    alpaca = {"system": "Be brief.", "history": [["Q1?", "A1."]], "instruction": "Q2?", "input": "more",
              "output": "A2."}
    for row in (sharegpt, alpaca):
        read = read_rows(write_lines(tmp_path / "rows.jsonl", [row, row]))
        assert read.rows == [{"messages": messages}] * 2, read.kind
    bare = read_rows(write_lines(tmp_path / "bare.jsonl", [{"instruction": "Hi.", "input": "", "output": "Hello."}]))
    assert bare.rows == [{"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}]


def test_other_column_names_are_read_through_the_column_flags(tmp_path, capsys):
    """--dataset_columns prompt=question,completion=answer (and --dataset_text_field, TRL's name) read columns of the
    user's names; a field this recipe does not read, a pair without a column, two columns for the text, or a mapped
    column the file lacks (a typo: the closest column named): one line."""
    from trainer_ext.tasks.chat_data import Columns, read_rows

    path = write_lines(tmp_path / "qa.jsonl", [{"question": "Q: 2+2?\nA: ", "answer": "4", "id": 7}])
    err = user_error(capsys, "run_clm", "--output_dir", tmp_path / "out", "--do_train", "--train_file", path)
    assert "line 1: fields ['answer', 'id', 'question']" in err
    assert "e.g. --dataset_columns prompt=question,completion=answer" in err, err
    mapped = read_rows(path, columns=Columns.from_flags(None, "prompt=question, completion=answer"))
    assert mapped.rows == [{"prompt": "Q: 2+2?\nA: ", "completion": "4"}]
    notes = write_lines(tmp_path / "notes.jsonl", [{"body": "Some text."}])
    assert read_rows(notes, columns=Columns.from_flags("body", None)).rows == [{"text": "Some text."}]
    for flags, words in ((["--dataset_columns", "promt=question"], "'promt' is not a field this recipe reads (did "
                                                                    "you mean 'prompt'?)"),
                         (["--dataset_columns", "prompt"], "'prompt' names no column"),
                         (["--dataset_text_field", "body", "--dataset_columns", "text=other"], "two columns"),
                         (["--dataset_columns", "prompt=questoin,completion=answer"], "line 1: --dataset_columns "
                          "prompt=questoin reads column 'questoin', which this row does not have (did you mean "
                          "'question'?)")):
        err = user_error(capsys, "run_clm", "--output_dir", tmp_path / "out", "--do_train", "--train_file", path,
                         *flags)
        assert words in err, err


def test_content_parts_are_joined_as_text(tmp_path):
    """OpenAI's and TRL's list of parts: the text parts, joined by a newline, are the turn's content."""
    from trainer_ext.tasks.chat_data import read_rows

    parts = [{"type": "text", "text": "Look:"}, {"type": "text", "text": "a cat."}]
    path = write_lines(tmp_path / "parts.jsonl", [{"messages": [{"role": "user", "content": parts},
                                                                {"role": "assistant", "content": "Yes."}]}])
    assert read_rows(path).rows[0]["messages"][0]["content"] == "Look:\na cat."


@pytest.mark.parametrize("fmt", ["alpaca", "mapped prompt/completion"])
def test_a_broken_json_line_is_explained_with_a_row_of_the_files_own_format(tmp_path, capsys, fmt):
    """(Was: a classification row {"sentence": ..., "label": 1} whatever the file held.)"""
    good, flags, example = (({"instruction": "Hi.", "input": "", "output": "Hello."}, [],
                              '{"instruction": "...", "input": "...", "output": "..."}') if fmt == "alpaca" else
                             ({"q": "Hi.", "a": "Hello."}, ["--dataset_columns", "prompt=q,completion=a"],
                              '{"q": "...", "a": "..."}'))
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(good)[:-3] + "\n")
    err = user_error(capsys, "run_clm", "--output_dir", tmp_path / "out", "--do_train", "--train_file", path, *flags)
    assert f"{path} line 2 is not JSON" in err and f"such as {example}" in err, err


def test_completion_only_loss_on_text_rows_is_refused(tmp_path, capsys):
    """Text rows have no completion to single out: the flag was ignored without a word."""
    err = user_error(capsys, "run_clm", "--output_dir", tmp_path / "out", "--do_train", "--train_file",
                     SHIPPED / "text.jsonl", "--completion_only_loss", "true")
    assert "--completion_only_loss true" in err and "holds text rows" in err and not (tmp_path / "out").exists()
