"""Translation task: fine-tune a sequence-to-sequence model on JSON-lines parallel text and score it with BLEU."""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ArgumentsError
from .common import ModelArguments as CommonModelArguments
from .common import apply_config_overrides, check_sample_limits, nearby, reading, shipped_model, with_channels
from .driver import run_task

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
SHIPPED_DATA = REPO / "data" / "translation"
EVAL_METRICS = ("loss", "bleu", "gen_len")  # bleu and gen_len with --predict_with_generate
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "spiece.model")
# Every dropout probability name used by the configs this task builds (BERT, BART, Marian, T5, encoder-decoder).
DROPOUT_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout", "dropout",
                  "attention_dropout", "activation_dropout", "dropout_rate")


class DataFileError(ArgumentsError):
    """A data file named by a flag (or the shipped default) is missing or lacks the expected fields."""


@dataclass
class ModelArguments(CommonModelArguments):
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "A trained model folder, or a config JSON / config folder without weights (builds a new model "
                "from it with the shipped tokenizer); default: encoder-decoder warm-started from the shipped MiniLM."})
    config_overrides: str | None = field(default=None, metadata={
        "help": "Comma-separated config changes, e.g. d_model=64,encoder_layers=2 (for the warm-started "
                "MiniLM they apply to its encoder and decoder configs)."})


@dataclass
class DataArguments:
    train_file: str | None = field(default=None, metadata={"help": "JSON lines of {\"translation\": {lang: text}}; "
                                                                   "default: data/translation/train.jsonl."})
    validation_file: str | None = field(default=None)
    test_file: str | None = field(default=None)
    source_lang: str = field(default="en")
    target_lang: str = field(default="de")
    max_source_length: int = field(default=64)
    max_target_length: int = field(default=64)
    source_prefix: str = field(default="", metadata={"help": "Prepended to every source text (T5: 'translate "
                                                             "English to German: ')."})
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)
    max_predict_samples: int | None = field(default=None)
    num_beams: int | None = field(default=None, metadata={"help": "Beams for generation during evaluate/predict; "
                                                                  "default: --generation_num_beams."})
    preprocessing_num_workers: int | None = field(default=None)
    overwrite_cache: bool = field(default=False, metadata={"help": "Tokenize again instead of using the cache."})
    evaluate_before_training: bool = field(default=False, metadata={"help": "Report validation metrics first."})

    def __post_init__(self):
        check_sample_limits(self)
        if self.source_lang == self.target_lang:
            raise ArgumentsError(f"--source_lang and --target_lang are both {self.source_lang!r}: give two languages")
        for name in ("max_source_length", "max_target_length"):
            if getattr(self, name) < 2:
                raise ArgumentsError(f"--{name} {getattr(self, name)}: needs room for at least one token and the end "
                                 "token (give 2 or more)")


# -- data ------------------------------------------------------------------------------------------------------
def data_files(data_args: DataArguments, training_args) -> dict[str, str]:
    """The files this run reads, checked before anything loads: the splits it uses plus any file named (a SageMaker
    job's channels fill splits no flag names); the shipped ones only when no file at all is given (never beside a file
    of the user's)."""
    from .common import check_needed_splits, needed_splits, shipped_data_note

    given = with_channels({"train": data_args.train_file, "validation": data_args.validation_file,
                           "test": data_args.test_file}, (".jsonl", ".json"))
    needed = needed_splits(data_args, training_args)
    shipped = not any(given.values())
    if not shipped:
        check_needed_splits(needed, {split: path for split, path in given.items() if path})
    files, missing = {}, []
    for split, path in given.items():
        if path is None and not (shipped and needed[split]):
            continue
        path = Path(path) if path is not None else SHIPPED_DATA / f"{split}.jsonl"
        if not path.is_file():
            source = f"--{split}_file" if given[split] is not None else f"the shipped default for --{split}_file"
            missing.append(f"{source}: no such file {path}{nearby(path)}")
        files[split] = str(path)
    if missing:
        raise DataFileError("; ".join(missing) + " (give existing JSON lines files, one {\"translation\": "
                            "{source_lang: text, target_lang: text}} per line)")
    other = [f"--{split}_file {path}" for split, path in files.items()
             if not path.lower().endswith((".jsonl", ".json"))]
    if other:  # datasets' JSON reader said only "JSON parse error: Invalid value. in row 0"
        raise DataFileError(f"{', '.join(other)}: translation reads JSON lines (.jsonl), one {{\"translation\": "
                            f"{{\"{data_args.source_lang}\": \"...\", \"{data_args.target_lang}\": \"...\"}}}} per "
                            "line; convert the file to that")
    if shipped and files:
        shipped_data_note(SHIPPED_DATA)
    return files


def load_pairs(files: dict[str, str], data_args: DataArguments):
    from .data_checks import check_rows, load_files, row

    raw = load_files("json", files)
    for split, dataset in raw.items():
        check_rows(dataset, files[split], split)
        if "translation" not in dataset.column_names:
            raise DataFileError(f"{files[split]}: no 'translation' field (columns: {dataset.column_names}); "
                                "each line must be {\"translation\": {source_lang: text, target_lang: text}}")
        for index, pair in enumerate(dataset["translation"]):
            for flag, lang in (("--source_lang", data_args.source_lang), ("--target_lang", data_args.target_lang)):
                text = pair.get(lang) if isinstance(pair, dict) else None
                if isinstance(text, str) and text.strip():
                    continue
                if not isinstance(pair, dict) or lang not in pair or (index == 0 and text is None):
                    languages = sorted(k for k, v in pair.items() if v is not None) if isinstance(pair, dict) else []
                    raise DataFileError(f"{row(files[split], index)}: no {lang!r} text ({flag} {lang}); languages "
                                        f"there: {languages}")
                raise DataFileError(f"{row(files[split], index)}: the {lang!r} text is "
                                    f"{'empty' if text is not None else 'missing (null)'}: every pair needs both "
                                    "texts (fill it in or remove the line)")
    return raw


def tokenize_pairs(batch, tokenizer, source_lang, target_lang, source_prefix, max_source_length, max_target_length,
                   decoder_start_token_id):
    """Top-level (no closure), so datasets fingerprints it identically on every run and reuses its cache."""
    sources = [source_prefix + pair[source_lang] for pair in batch["translation"]]
    targets = [pair[target_lang] for pair in batch["translation"]]
    encoded = tokenizer(sources, max_length=max_source_length, truncation=True)
    labels = tokenizer(text_target=targets, max_length=max_target_length, truncation=True)["input_ids"]
    # A BERT tokenizer opens every target with [CLS], the decoder's start token: the decoder is fed it already
    # and would otherwise learn to emit it a second time.
    encoded["labels"] = [ids[1:] if ids and ids[0] == decoder_start_token_id else ids for ids in labels]
    return encoded


def tokenize(raw, tokenizer, model, data_args: DataArguments, training_args):
    """Limit each split, then tokenize it once (rank 0 first; the other ranks read its cache)."""
    import datasets

    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples,
              "test": data_args.max_predict_samples}
    kwargs = {"tokenizer": tokenizer, "source_lang": data_args.source_lang, "target_lang": data_args.target_lang,
              "source_prefix": data_args.source_prefix, "max_source_length": data_args.max_source_length,
              "max_target_length": data_args.max_target_length,
              "decoder_start_token_id": model.config.decoder_start_token_id}
    tokenized = {}
    with training_args.main_process_first(desc="tokenize"):
        for split, dataset in raw.items():
            if limits[split] is not None:
                dataset = dataset.select(range(min(limits[split], len(dataset))))
            # A copy per split: tokenizing with truncation changes the tokenizer's state, hence its hash.
            kwargs["tokenizer"] = copy.deepcopy(tokenizer)
            tokenized[split] = dataset.map(
                tokenize_pairs, batched=True, fn_kwargs=dict(kwargs), remove_columns=dataset.column_names,
                num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache,
                desc=f"tokenize {split}")
    return datasets.DatasetDict(tokenized)


# -- model -----------------------------------------------------------------------------------------------------
def special_token_ids(tokenizer) -> dict:
    """Decoder start, end and padding ids for a tokenizer ([CLS]/[SEP]/[PAD] for BERT ones)."""
    start = next(i for i in (tokenizer.cls_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) if i is not None)
    end = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    return {"decoder_start_token_id": start, "bos_token_id": start, "eos_token_id": end,
            "pad_token_id": tokenizer.pad_token_id}


def adjust_config(config, dropout: float | None, overrides: str | None, kwargs: dict | None = None) -> None:
    """Apply --config_kwargs, --dropout to every dropout field the config has, then --config_overrides."""
    config.update(dict(kwargs or {}))
    if dropout is not None:
        for name in DROPOUT_FIELDS:
            if hasattr(config, name):
                setattr(config, name, dropout)
    apply_config_overrides(config, overrides)


def check_model_config(model_args: ModelArguments) -> None:
    """Before the data loads: --model_name_or_path is a sequence-to-sequence model (an encoder-only one ended in
    "cannot read the model: Unrecognized configuration class"), and --config_overrides fit its config (or the shipped
    MiniLM's, which the warm-started encoder and decoder copy); build_model applies them to the config it loads."""
    from transformers import AutoConfig

    name = model_args.model_name_or_path
    if name is None and not model_args.config_overrides:
        return
    with reading("--model_name_or_path", name or shipped_model(), "model"):
        config = AutoConfig.from_pretrained(name or shipped_model())
    if name is not None and not getattr(config, "is_encoder_decoder", False):
        raise ArgumentsError(f"--model_name_or_path {name}: a {type(config).__name__} ({config.model_type}) is not a "
                             "sequence-to-sequence model: give a Marian, T5, BART or encoder-decoder model (or its "
                             "config), or leave --model_name_or_path unset to warm-start an encoder-decoder from the "
                             "shipped MiniLM")
    for sub in _sub_configs(config):
        adjust_config(copy.deepcopy(sub), model_args.dropout, model_args.config_overrides, model_args.config_kwargs)


def _sub_configs(config):
    return [config.encoder, config.decoder] if config.model_type == "encoder-decoder" else [config]


def _has_weights(folder: Path) -> bool:
    return any(any(folder.glob(pattern)) for pattern in WEIGHT_FILES)


def build_model(model_args: ModelArguments):
    """(model, tokenizer) from --model_name_or_path: warm-started MiniLM, a trained model, or a config only."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, EncoderDecoderModel

    name = model_args.model_name_or_path
    path = Path(name) if name else None
    if name is None:
        minilm = shipped_model()
        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or minilm, **model_args.tokenizer_kwargs)
        encoder_config = AutoConfig.from_pretrained(minilm)
        adjust_config(encoder_config, model_args.dropout, model_args.config_overrides, model_args.config_kwargs)
        decoder_config = copy.deepcopy(encoder_config)
        decoder_config.update({"is_decoder": True, "add_cross_attention": True})
        model = EncoderDecoderModel.from_encoder_decoder_pretrained(
            minilm, minilm, encoder_config=encoder_config, decoder_config=decoder_config)
        _set_token_ids(model, tokenizer, override=True)
        return model, tokenizer
    config_only = (path.is_file() and path.suffix == ".json") or (path.is_dir() and not _has_weights(path))
    folder = path.parent if path.is_file() else path
    own_tokenizer = folder.is_dir() and any((folder / f).is_file() for f in TOKENIZER_FILES)
    flag = "--tokenizer_name" if model_args.tokenizer_name else "--model_name_or_path"
    with reading(flag, model_args.tokenizer_name or name, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or (folder if own_tokenizer
                                                                                else shipped_model()),
                                                  **model_args.tokenizer_kwargs)
    with reading("--model_name_or_path", name, "model"):
        config = AutoConfig.from_pretrained(name)
    for sub in _sub_configs(config):
        adjust_config(sub, model_args.dropout, model_args.config_overrides, model_args.config_kwargs)
    if not config_only:
        with reading("--model_name_or_path", name, "model"):
            model = AutoModelForSeq2SeqLM.from_pretrained(name, config=config, **model_args.model_kwargs)
        _set_token_ids(model, tokenizer, override=False)
        return model, tokenizer
    if not own_tokenizer:  # the config was written for another vocabulary: fit it to the shipped tokenizer
        for sub in _sub_configs(config):
            for field_name in ("vocab_size", "decoder_vocab_size"):
                if getattr(sub, field_name, None) is not None:
                    setattr(sub, field_name, len(tokenizer))
    try:
        model = AutoModelForSeq2SeqLM.from_config(config)
    except ValueError as err:
        raise ArgumentsError(f"--model_name_or_path {name}: {type(config).__name__} is not a sequence-to-sequence "
                         f"config ({err}); give e.g. a Marian, T5, BART or encoder-decoder config") from None
    _set_token_ids(model, tokenizer, override=not own_tokenizer)
    return model, tokenizer


def _set_token_ids(model, tokenizer, override: bool) -> None:
    """Token ids for training and generation; `override`: the tokenizer does not come with the config, so the
    config's ids (another vocabulary's) are replaced by the tokenizer's."""
    for key, value in special_token_ids(tokenizer).items():
        for target in (model.config, model.generation_config):
            if override or getattr(target, key, None) is None:
                setattr(target, key, value)


def check_lengths(config, data_args: DataArguments, training_args) -> None:
    """Source and target lengths (and generation's) within the encoder's and decoder's positions."""
    from .common import check_sequence_length

    encoder, decoder = _sub_configs(config) * (2 if config.model_type != "encoder-decoder" else 1)
    check_sequence_length("--max_source_length", data_args.max_source_length, encoder, what="encoder")
    check_sequence_length("--max_target_length", data_args.max_target_length, decoder, what="decoder")
    if training_args.generation_max_length:
        check_sequence_length("--generation_max_length", training_args.generation_max_length, decoder,
                              what="decoder")


# -- metric ----------------------------------------------------------------------------------------------------
def decode(sequences, tokenizer) -> list[str]:
    """Token ids -> text; -100 (ignored labels, padding between ranks) reads as padding."""
    ids = np.asarray(sequences)
    ids = np.where(ids != -100, ids, tokenizer.pad_token_id)
    return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]


def bleu_metrics(prediction, tokenizer) -> dict:
    """Corpus BLEU (sacrebleu) of generated sequences against the labels, and the mean generated length."""
    import sacrebleu

    sequences = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    hypotheses, references = decode(sequences, tokenizer), decode(prediction.label_ids, tokenizer)
    sequences = np.asarray(sequences)
    lengths = ((sequences != -100) & (sequences != tokenizer.pad_token_id)).sum(axis=-1)
    return {"bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score, "gen_len": float(lengths.mean())}


# -- entry point -----------------------------------------------------------------------------------------------
def setup(model_args: ModelArguments, data_args: DataArguments, training_args):
    """A translation model trained and/or evaluated with ExtSeq2SeqTrainer (trainer_ext.tasks.driver runs the steps).
    Rank 0 writes `{split}_results.json` and the generated texts (`generated_eval_before.txt`, `generated_eval.txt`,
    `generated_predictions.txt`)."""
    import transformers
    from transformers import DataCollatorForSeq2Seq, set_seed

    from ..training.prepare import sharded_loading
    from ..seq2seq import ExtSeq2SeqTrainer

    from .driver import Prepared

    transformers.utils.logging.set_verbosity_warning()
    files = data_files(data_args, training_args)
    check_model_config(model_args)  # seconds, before the data and the weights load
    pairs = load_pairs(files, data_args)  # checked before the model loads
    set_seed(training_args.seed)  # new weights (cross-attention, a config-built model) equal on every rank
    with sharded_loading(training_args):  # partitioned where the backend can (ZeRO-3)
        model, tokenizer = build_model(model_args)
    check_lengths(model.config, data_args, training_args)
    tokenized = tokenize(pairs, tokenizer, model, data_args, training_args)
    Path(training_args.output_dir).mkdir(parents=True, exist_ok=True)

    generate = training_args.predict_with_generate
    trainer = ExtSeq2SeqTrainer(
        model=model, args=training_args, train_dataset=tokenized.get("train"),
        eval_dataset=tokenized.get("validation"), processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        compute_metrics=functools.partial(bleu_metrics, tokenizer=tokenizer) if generate else None)
    generation = {"max_length": training_args.generation_max_length or data_args.max_target_length,
                  "num_beams": data_args.num_beams or training_args.generation_num_beams}

    def score(split: str, prefix: str, output_name: str) -> dict:
        output = trainer.predict(tokenized[split], metric_key_prefix=prefix, **generation)
        trainer.save_metrics(prefix, output.metrics)
        if generate and trainer.is_world_process_zero():
            texts = decode(output.predictions, tokenizer)
            (Path(training_args.output_dir) / output_name).write_text("\n".join(texts) + "\n", encoding="utf-8")
        return output.metrics

    return Prepared(trainer, len(tokenized["train"]) if "train" in tokenized else None,
                    evaluate=lambda prefix: score("validation", prefix, f"generated_{prefix}.txt"),
                    predict=lambda: score("test", "predict", "generated_predictions.txt"))


def report(results: dict, training_args) -> None:
    """What the example prints on the main process: BLEU before and after training and on the test set, where the
    model went."""
    from .common import say_model_saved

    for prefix, when in (("eval_before", "before training"), ("eval", "after training"), ("predict", "test")):
        if f"{prefix}_bleu" in results:
            print(f"validation BLEU {when}: {results[f'{prefix}_bleu']:.2f}" if prefix != "predict" else
                  f"test BLEU: {results['predict_bleu']:.2f}", flush=True)
    say_model_saved(training_args)


# The whole recipe, as the examples and experiment files run it (run(model_args, data_args, training_args) -> metrics).
run = functools.partial(run_task, "translation")
