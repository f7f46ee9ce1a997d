"""Translation: the BLEU metric, and examples/run_translation.py as real processes (one process, DeepSpeed ZeRO-3
and FairScale sharded DDP on 2 CPU ranks), its tokenization cache and config-built models."""

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import BIN, PYTHON, REPO, free_port, run, scratch, tiny_bart_config

TRANSLATION = REPO / "examples" / "run_translation.py"
EVAL_SAMPLES = 19  # odd, and 5 batches of 4 on 2 ranks: accelerate pads the last one with repeated samples
COMMON = ["--max_source_length", 32, "--max_target_length", 32, "--dropout", 0, "--report_to", "none",
          "--disable_tqdm", "true", "--seed", 7, "--predict_with_generate", "--per_device_eval_batch_size", 4,
          "--max_eval_samples", EVAL_SAMPLES, "--save_strategy", "no", "--logging_steps", 1]


def translate(kind, output_dir, *flags, cache, timeout=1800):
    """Run examples/run_translation.py on one process or 2 launched ranks; fail with the log on error."""
    launchers = {"single": [PYTHON],
                 "deepspeed": [BIN / "deepspeed", "--num_gpus", 2, "--master_port", free_port()],
                 "launch": [PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node", 2, "--master_port",
                            free_port()]}
    # One thread per process, as the launchers give each rank: the same kernels, so the same numerics (and no
    # oversubscribed OpenMP threads spinning on a shared CPU).
    out = run([*launchers[kind], TRANSLATION, "--output_dir", output_dir, *COMMON, *flags], timeout=timeout,
              env={"HF_DATASETS_CACHE": str(cache), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, f"{kind} failed:\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
    return out


def generated(output_dir, name):
    return (Path(output_dir) / name).read_text(encoding="utf-8").splitlines()


def results(output_dir, prefix):
    return json.loads((Path(output_dir) / f"{prefix}_results.json").read_text())


def bleu_of(output_dir, name):
    """sacrebleu's corpus BLEU of a run's generated texts against the shipped references (the oracle for the score the
    run reported: the texts it wrote must be the ones it scored, in dataset order)."""
    import sacrebleu

    rows = (REPO / "data" / "translation" / "validation.jsonl").read_text(encoding="utf-8").splitlines()
    references = [json.loads(row)["translation"]["de"] for row in rows[:EVAL_SAMPLES]]
    return sacrebleu.corpus_bleu(generated(output_dir, name), [references]).score


@pytest.fixture(scope="module")
def runs(request):
    """A short single-process fine-tuning, then ZeRO-2, ZeRO-3 and sharded DDP runs that start from its weights: their
    evaluation before training sees exactly the weights the single process ended with."""
    root = scratch(request, "translation")
    cache = root / "datasets-cache"
    translate("single", root / "single", "--do_train", "--do_eval", "--evaluate_before_training", "--max_steps", 8,
              "--max_train_samples", 64, "--per_device_train_batch_size", 8, "--learning_rate", 3e-4, cache=cache)
    trained = ["--model_name_or_path", root / "single", "--evaluate_before_training", "--do_train", "--do_eval",
               "--max_steps", 2, "--max_train_samples", 32, "--per_device_train_batch_size", 4]
    translate("deepspeed", root / "zero3", *trained, "--deepspeed", "zero3", cache=cache)
    translate("launch", root / "sharded", *trained, "--sharded_ddp", "simple", cache=cache)
    return root


@pytest.mark.model_package
def test_bleu_metric_matches_sacrebleu():
    """If this fails, reported BLEU is not sacrebleu's corpus BLEU of the decoded texts (or -100 leaks into them)."""
    import sacrebleu
    from transformers import AutoTokenizer, EvalPrediction

    from trainer_ext.tasks.translation import bleu_metrics, shipped_model

    tokenizer = AutoTokenizer.from_pretrained(shipped_model())
    hypotheses = ["der alte mann sah den hund", "die katze fand ein buch im garten", "dann kaufte er das auto"]
    references = ["der alte mann sah den kleinen hund", "die katze fand ein buch im garten", "dann malte er ein bild"]

    def ids(texts, pad):
        rows = [tokenizer(text)["input_ids"] for text in texts]
        width = max(map(len, rows)) + 3  # room for padding after every row
        return np.array([row + [pad] * (width - len(row)) for row in rows])

    predictions = ids(hypotheses, tokenizer.pad_token_id)
    predictions[0, -1] = -100  # padding between ranks reads as padding too
    metrics = bleu_metrics(EvalPrediction(predictions=predictions, label_ids=ids(references, -100)), tokenizer)
    expected = sacrebleu.corpus_bleu(hypotheses, [references]).score
    assert 0 < expected < 100
    assert metrics["bleu"] == pytest.approx(expected, abs=1e-9)


@pytest.mark.model_package
@pytest.mark.deepspeed
@pytest.mark.launch
def test_single_process_generates_and_scores(runs):
    """If this fails, one-process training or generation during evaluation (--predict_with_generate) is broken."""
    single = runs / "single"
    assert len(generated(single, "generated_eval.txt")) == EVAL_SAMPLES
    assert len(generated(single, "generated_eval_before.txt")) == EVAL_SAMPLES
    assert results(single, "eval")["eval_bleu"] == pytest.approx(bleu_of(single, "generated_eval.txt"), abs=1e-6)
    before = results(single, "eval_before")["eval_before_bleu"]
    assert before == pytest.approx(bleu_of(single, "generated_eval_before.txt"), abs=1e-6)
    assert (single / "model.safetensors").is_file() and (single / "tokenizer.json").is_file()


@pytest.mark.model_package
@pytest.mark.deepspeed
@pytest.mark.launch
@pytest.mark.parametrize("backend", ["zero3", "sharded"])
def test_two_ranks_generate_what_one_process_generates(runs, backend):
    """If this fails, generation on 2 ranks (DeepSpeed ZeRO-3, sharded DDP) returns predictions out of dataset order,
    with the padding duplicates, or different from one process for the same weights. Under ZeRO-3 both ranks must keep
    generating until the longest sequence ends (synced_gpus), or the other rank hangs in a gather. (ZeRO-2 generates
    through the same gather as sharded DDP, with whole weights: its run was dropped for CI's time.)"""
    single, launched = runs / "single", runs / backend
    assert generated(launched, "generated_eval_before.txt") == generated(single, "generated_eval.txt")
    assert results(launched, "eval_before")["eval_before_bleu"] == pytest.approx(results(single, "eval")["eval_bleu"])
    # after training, evaluation generates through the backend's trained model
    assert len(generated(launched, "generated_eval.txt")) == EVAL_SAMPLES
    assert results(launched, "eval")["eval_bleu"] == pytest.approx(bleu_of(launched, "generated_eval.txt"), abs=1e-6)


def cache_files(cache):
    return {p: p.stat().st_mtime_ns for p in Path(cache).rglob("cache-*.arrow")}


@pytest.mark.launch
def test_config_builds_small_model_and_second_run_reuses_tokenization(tmp_path):
    """If this fails, a config-named model does not build with the shipped tokenizer, or tokenization is not
    fingerprinted stably (every run tokenizes again instead of reading the datasets cache)."""
    config = tiny_bart_config(tmp_path / "tiny_bart.json")
    cache = tmp_path / "datasets-cache"
    flags = ["--model_name_or_path", config, "--do_train", "--do_eval", "--max_steps", 2, "--max_train_samples", 16,
             "--per_device_train_batch_size", 8, "--generation_max_length", 8, "--config_overrides", "d_model=16"]
    translate("single", tmp_path / "first", *flags, cache=cache)
    first = cache_files(cache)
    assert len(first) >= 2, f"no tokenization cache files under {cache}"  # train and validation
    translate("single", tmp_path / "second", *flags, cache=cache)
    assert cache_files(cache) == first
    saved = json.loads((tmp_path / "first" / "config.json").read_text())
    assert saved["model_type"] == "bart" and saved["d_model"] == 16 and saved["vocab_size"] == 30522
    assert len(generated(tmp_path / "first", "generated_eval.txt")) == EVAL_SAMPLES


@pytest.mark.model_package
@pytest.mark.launch
def test_missing_data_file_is_named(tmp_path):
    """If this fails, a missing data file surfaces as a datasets traceback (or later), not as a message naming it."""
    missing = tmp_path / "nowhere" / "train.jsonl"
    out = run([PYTHON, TRANSLATION, "--output_dir", tmp_path / "out", "--do_train", "--train_file", missing,
               "--report_to", "none"], timeout=300)
    assert out.returncode != 0
    assert f"--train_file: no such file {missing}" in out.stderr
    assert "Traceback" not in out.stderr
