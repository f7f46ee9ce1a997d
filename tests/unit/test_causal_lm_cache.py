"""The causal-LM recipe's data at scale, in this process: best-fit packing on arrays equal to the list-based packing it
replaced, the tokenized data cache (built once, reused, rebuilt for what changes its samples or when damaged), a bad
row deep in a large file named before the model loads, and --streaming (the map-style run's first steps on the same
order; a stream resumed from its saved position continues item for item)."""

import bisect
import json
import random

import numpy as np
import pytest

from conftest import REPO, example, user_error, write_lines

pytest.importorskip("peft")
SHIPPED = REPO / "data" / "causal_lm"


@pytest.fixture(scope="module")
def tokenizer():
    from trainer_ext.tasks.causal_lm import byte_tokenizer

    return byte_tokenizer()


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_EXT_CACHE", str(tmp_path / "cache"))


def list_packing(lengths, max_length):
    """The packing the recipe shipped before (bisect.insort over a sorted list of rooms: O(n²)), kept as the oracle."""
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    rows, free = [], []
    for index in order:
        at = bisect.bisect_left(free, (lengths[index], -1))
        if at == len(free):
            rows.append([index])
            room, number = max_length - lengths[index], len(rows) - 1
        else:
            room, number = free.pop(at)
            rows[number].append(index)
            room -= lengths[index]
        if room > 0:
            bisect.insort(free, (room, number))
    return [sorted(row) for row in rows]


def test_best_fit_decreasing_on_arrays_gives_the_rows_of_the_list_based_packing():
    """200 random sets (2 to 2048 tokens a row, many ties, full rows, single-token samples): the same rows, in the
    same order, as the implementation it replaced."""
    from trainer_ext.data.packing import pack

    rng = random.Random(0)
    for _ in range(200):
        max_length = rng.choice([2, 3, 10, 64, 257, 2048])
        lengths = [rng.randint(1, max_length) if rng.random() < 0.7 else rng.choice([1, max_length,
                                                                                      max(1, max_length // 2)])
                   for _ in range(rng.randint(0, 300))]
        assert pack(lengths, max_length) == list_packing(lengths, max_length), (max_length, lengths)


# -- the tokenized data cache ---------------------------------------------------------------------------------------
class Tokenizations:
    """Counts the rows the recipe tokenizes (Encoder.samples), run by run."""

    def __init__(self, monkeypatch):
        from trainer_ext.tasks.chat_data import Encoder

        self.rows = 0
        samples = Encoder.samples

        def counted(encoder, rows, *rendered):
            self.rows += len(rows)
            return samples(encoder, rows, *rendered)

        monkeypatch.setattr(Encoder, "samples", counted)

    def since(self):
        rows, self.rows = self.rows, 0
        return rows


def prepared(path, tmp_path, tokenizer, template=None, **flags):
    """The train split as the recipe prepares it (packed), with `flags` as DataArguments."""
    from transformers import TrainingArguments

    from trainer_ext.tasks.causal_lm import DataArguments, tokenized
    from trainer_ext.tasks.chat_data import ChatFile

    data = DataArguments(train_file=str(path), **{"packing": True, "max_seq_length": 256, **flags})
    args = TrainingArguments(str(tmp_path / "out"), disable_tqdm=True)
    return tokenized({"train": ChatFile(path)}, tokenizer, template or tokenizer.chat_template, data, args)["train"]


def rows_of(split):
    return [split.dataset[i] for i in range(len(split.dataset))]


def test_the_cache_is_built_once_and_again_only_for_what_changes_the_samples(tmp_path, tokenizer, capsys,
                                                                             monkeypatch):
    """A second run tokenizes nothing (also for a copy of the file elsewhere); a changed file, template or
    --max_seq_length, and --overwrite_cache, tokenize again; each run says which cache it used or wrote."""
    counted = Tokenizations(monkeypatch)
    rows = [json.loads(line) for line in (SHIPPED / "train.jsonl").read_text().splitlines()[:40]]
    path = write_lines(tmp_path / "chat.jsonl", rows)
    first = prepared(path, tmp_path, tokenizer)
    assert counted.since() == 40 and "written to the cache" in capsys.readouterr().out
    copy = write_lines(tmp_path / "elsewhere.jsonl", rows)
    assert rows_of(prepared(copy, tmp_path, tokenizer)) == rows_of(first)
    assert counted.since() == 0 and "comes from the cache" in capsys.readouterr().out
    template = tmp_path / "t.jinja"
    template.write_text(tokenizer.chat_template.replace("<|im_end|>\n", "<|im_end|>\n\n"))
    changes = {"a row more": lambda: prepared(write_lines(path, rows + rows[:1]), tmp_path, tokenizer),
               "a template": lambda: prepared(copy, tmp_path, tokenizer, template.read_text()),
               "a length": lambda: prepared(copy, tmp_path, tokenizer, max_seq_length=200),
               "--overwrite_cache": lambda: prepared(copy, tmp_path, tokenizer, overwrite_cache=True)}
    for change, again in changes.items():
        again()
        assert counted.since() in (40, 41), change
        assert "written to the cache" in capsys.readouterr().out, change


def test_preprocessing_workers_tokenize_the_same_samples(tmp_path, tokenizer, monkeypatch):
    """--preprocessing_num_workers 2: batches of 7 rows tokenized in two processes, written in the file's order."""
    from trainer_ext.tasks import chat_datasets

    path = write_lines(tmp_path / "chat.jsonl", [json.loads(line) for line in
                                                 (SHIPPED / "train.jsonl").read_text().splitlines()[:60]])
    here = rows_of(prepared(path, tmp_path, tokenizer, packing=False))
    monkeypatch.setattr(chat_datasets, "BATCH_ROWS", 7)
    workers = prepared(path, tmp_path, tokenizer, packing=False, overwrite_cache=True, preprocessing_num_workers=2)
    assert rows_of(workers) == here and workers.manifest["rows"] == 60


def damage(folder, kind):
    """One kind of damage to a cache folder."""
    samples = folder / "samples.arrow"
    if kind == "a truncated sample file":
        samples.write_bytes(samples.read_bytes()[:-100])
    elif kind == "a changed byte":
        data = bytearray(samples.read_bytes())
        data[len(data) // 2] ^= 0xFF
        samples.write_bytes(bytes(data))
    elif kind == "an unreadable manifest":
        (folder / "manifest.json").write_text("{not json")
    else:
        (folder / "order.npy").unlink()


@pytest.mark.parametrize("kind", ["a truncated sample file", "a changed byte", "an unreadable manifest",
                                  "a missing packing file"])
def test_a_damaged_cache_is_built_again_with_one_warning(tmp_path, tokenizer, capsys, monkeypatch, kind):
    """Never a traceback, never a silently wrong sample: the next run warns once, naming the folder and what is
    wrong, tokenizes again and trains on the same rows."""
    from trainer_ext.tasks.causal_lm import cache_folder

    path = write_lines(tmp_path / "chat.jsonl", [json.loads(line) for line in
                                                 (SHIPPED / "train.jsonl").read_text().splitlines()[:24]])
    expected = rows_of(prepared(path, tmp_path, tokenizer))
    capsys.readouterr()
    (folder,) = [entry for entry in (cache_folder() / "data").iterdir() if entry.is_dir()]
    damage(folder, kind)
    counted = Tokenizations(monkeypatch)
    assert rows_of(prepared(path, tmp_path, tokenizer)) == expected
    said = capsys.readouterr().out
    assert counted.since() == 24 and said.count("warning:") == 1, said
    assert f"the tokenized data cache {folder} is damaged" in said and "building it again" in said
    assert "Traceback" not in said


# -- a bad row deep in a large file -----------------------------------------------------------------------------------
def test_a_bad_row_deep_in_a_large_file_is_named_by_its_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """50,000 lines (a blank one and Windows line ends among them), the bad one near the end: the one line names its
    line number, and no model was loaded."""
    from transformers import AutoModelForCausalLM

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the data was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_model)
    good = json.dumps({"prompt": "Q: 1+1\nA: ", "completion": "2"})
    lines = [good] * 49_998 + ["", json.dumps({"prompt": "Q: 2+2\nA: ", "completion": 4})]
    lines[100] += "\r"
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    err = user_error(capsys, "run_clm", "--output_dir", tmp_path / "out", "--do_train", "--train_file", path,
                     "--max_train_samples", 64, "--disable_tqdm", "true")
    assert f"{path} line 50000: 'completion' is 4, not text" in err, err


# -- streaming --------------------------------------------------------------------------------------------------------
STREAM_FLAGS = ["--do_train", "--max_steps", 4, "--per_device_train_batch_size", 4, "--logging_steps", 1,
                "--learning_rate", "3e-3", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
                "--seed", 5, "--max_seq_length", 256]


def test_streaming_trains_the_first_steps_of_the_map_style_run_on_the_same_order(tmp_path):
    """The stream reads the file in its order; written in the order the map-style run's sampler draws (seed 5), it
    gives that run's batches: the same losses step by step."""
    from trainer_ext.data.samplers import ResumableBatchSampler

    rows = [json.loads(line) for line in (SHIPPED / "train.jsonl").read_text().splitlines()[:64]]
    drawn = ResumableBatchSampler(len(rows), 4, seed=5).data_order(0)
    map_style = write_lines(tmp_path / "rows.jsonl", rows)
    in_order = write_lines(tmp_path / "drawn.jsonl", [rows[i] for i in drawn])
    losses = {}
    for name, flags in (("map", ["--train_file", map_style]), ("stream", ["--train_file", in_order, "--streaming"])):
        example("run_clm")([str(f) for f in ["--output_dir", tmp_path / name, *STREAM_FLAGS, *flags]])
        history = json.loads((tmp_path / name / "trainer_state.json").read_text())["log_history"]
        losses[name] = [entry["loss"] for entry in history if "loss" in entry]
    assert len(losses["map"]) == 4 and np.allclose(losses["map"], losses["stream"], rtol=0, atol=1e-6), losses


@pytest.mark.parametrize("packing", [False, True])
def test_a_stream_resumed_at_its_saved_position_continues_item_for_item(tmp_path, tokenizer, monkeypatch, packing):
    """At every position of two passes (batches of 7 rows, so positions inside and at the end of a batch), a new
    stream given the saved state yields exactly what the uninterrupted one yields next; packed, its rows are the
    best-fit rows of each batch."""
    from trainer_ext.data.stream import exact_state
    from trainer_ext.tasks import chat_datasets
    from trainer_ext.tasks.chat_data import ChatFile, Encoder

    monkeypatch.setattr(chat_datasets, "BATCH_ROWS", 7)
    monkeypatch.setattr(chat_datasets, "STREAM_PACKING_ROWS", 7)
    path = write_lines(tmp_path / "chat.jsonl", [json.loads(line) for line in
                                                 (SHIPPED / "train.jsonl").read_text().splitlines()[:17]])
    stream = lambda: chat_datasets.ChatStream(ChatFile(path), Encoder(tokenizer, tokenizer.chat_template, True, 128),
                                              packing, limit=16)  # noqa: E731
    assert exact_state(stream()) is None  # data/stream.py resumes it from its own state
    uninterrupted, states = [], []
    source = stream()
    for _ in range(2):
        for item in source:
            uninterrupted.append(item)
            states.append(source.state_dict())
    one_pass = len(uninterrupted) // 2
    assert uninterrupted[:one_pass] == uninterrupted[one_pass:] and (one_pass < 16) == packing
    for at in range(one_pass):
        resumed = stream()
        resumed.load_state_dict(json.loads(json.dumps(states[at])))
        assert list(resumed) == uninterrupted[at + 1:one_pass], at
