"""Extractive question answering (SQuAD v1.1 / v2.0): data preparation, post-processing, metrics and `run`."""

from __future__ import annotations

import functools
import json
import logging
import re
import string
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ArgumentsError
from .common import (REPO, ModelArguments, check_sample_limits, first, load_config, load_tokenizer, nearby,
                     shipped_model, with_channels)
from .driver import run_task

logger = logging.getLogger(__name__)

SHIPPED_DATA = REPO / "data" / "qa"
EVAL_METRICS = ("loss", "exact_match", "f1", "has_answer_exact_match", "has_answer_f1", "no_answer_exact_match")
# Prediction-only columns of the validation features: post-processing needs them, the model must not see them.
FEATURE_METADATA = ["example_id", "offset_mapping", "cls_index"]


# -- metrics (the official SQuAD evaluation script's rules) -------------------------------------------------
_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace (official order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match_score(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not predicted or not expected:  # v2: an empty answer is right only against an empty gold answer
        return float(predicted == expected)
    same = sum((Counter(predicted) & Counter(expected)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(expected)
    return 2 * precision * recall / (precision + recall)


def gold_answers(answers: dict) -> list[str]:
    """The gold texts of one question; an unanswerable one (v2) has the single gold answer ""."""
    return [text for text in answers["text"] if normalize_answer(text)] or [""]


def squad_metrics(predictions: dict[str, str], references: dict[str, list[str]]) -> dict[str, float]:
    """Exact match and F1 in percent, each the max over the gold answers; with unanswerable questions also the
    answerable / unanswerable breakdown."""
    missing = [key for key in references if key not in predictions]
    if missing:
        raise ValueError(f"no prediction for {len(missing)} of {len(references)} questions (first: {missing[0]!r})")
    exact = {key: max(exact_match_score(predictions[key], gold) for gold in golds) for key, golds in references.items()}
    f1 = {key: max(f1_score(predictions[key], gold) for gold in golds) for key, golds in references.items()}
    metrics = {"exact_match": 100 * float(np.mean(list(exact.values()))),
               "f1": 100 * float(np.mean(list(f1.values())))}
    unanswerable = {key for key, golds in references.items() if golds == [""]}
    if unanswerable:
        answerable = set(references) - unanswerable
        if answerable:
            metrics["has_answer_exact_match"] = 100 * float(np.mean([exact[key] for key in answerable]))
            metrics["has_answer_f1"] = 100 * float(np.mean([f1[key] for key in answerable]))
        metrics["no_answer_exact_match"] = 100 * float(np.mean([exact[key] for key in unanswerable]))
    return metrics


# -- data ----------------------------------------------------------------------------------------------------
def flatten_squad(articles: dict) -> dict:
    """Batched map: SQuAD's data -> paragraphs -> qas nesting -> one row per question."""
    rows = {"id": [], "title": [], "context": [], "question": [], "answers": []}
    for title, paragraphs in zip(articles.get("title") or [""] * len(articles["paragraphs"]), articles["paragraphs"]):
        for paragraph in paragraphs:
            for qa in paragraph["qas"]:
                answers = [] if qa.get("is_impossible") else (qa.get("answers") or [])
                rows["id"].append(str(qa["id"]))
                rows["title"].append(title or "")
                rows["context"].append(paragraph["context"])
                rows["question"].append(qa["question"])
                rows["answers"].append({"text": [a["text"] for a in answers],
                                        "answer_start": [a["answer_start"] for a in answers]})
    return rows


def load_squad(path, cache_dir=None, num_proc=None, load_from_cache_file=True):
    """A SQuAD-format JSON file as a dataset of rows id/title/context/question/answers{text, answer_start}."""
    import datasets

    from .data_checks import check_datasets_cache

    check_datasets_cache(cache_dir)
    articles = datasets.load_dataset("json", data_files={"data": str(path)}, field="data", cache_dir=cache_dir)["data"]
    features = datasets.Features({
        "id": datasets.Value("string"), "title": datasets.Value("string"), "context": datasets.Value("string"),
        "question": datasets.Value("string"),
        # Declared, not inferred: a batch whose questions are all unanswerable would infer list<null>.
        "answers": {"text": datasets.List(datasets.Value("string")),
                    "answer_start": datasets.List(datasets.Value("int32"))}})
    return articles.map(flatten_squad, batched=True, remove_columns=articles.column_names, features=features,
                        num_proc=num_proc, load_from_cache_file=load_from_cache_file, desc=f"Reading {Path(path).name}")


def _tokenize(examples, tokenizer, max_length, doc_stride):
    """Question + context pairs; a long context overflows into features overlapping by `doc_stride` tokens."""
    pad_on_right = tokenizer.padding_side == "right"
    # Leading spaces in questions waste tokens and make some tokenizers truncate the context too soon.
    questions = [question.lstrip() for question in examples["question"]]
    pair = (questions, examples["context"]) if pad_on_right else (examples["context"], questions)
    encoded = tokenizer(*pair, truncation="only_second" if pad_on_right else "only_first", max_length=max_length,
                        stride=doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True,
                        padding="max_length")
    return encoded, 1 if pad_on_right else 0


def _answer_positions(encoded, examples, context_index, tokenizer):
    """Start/end token of each feature's answer; the CLS token when unanswerable or outside this feature."""
    starts, ends, cls_indices = [], [], []
    for i, offsets in enumerate(encoded["offset_mapping"]):
        input_ids = encoded["input_ids"][i]
        cls_index = input_ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in input_ids else 0
        cls_indices.append(cls_index)
        answers = examples["answers"][encoded["overflow_to_sample_mapping"][i]]
        context = [t for t, sequence in enumerate(encoded.sequence_ids(i)) if sequence == context_index]
        if not answers["answer_start"]:
            starts.append(cls_index), ends.append(cls_index)
            continue
        start_char = answers["answer_start"][0]
        end_char = start_char + len(answers["text"][0])
        first, last = context[0], context[-1]
        if offsets[first][0] > start_char or offsets[last][1] < end_char:
            starts.append(cls_index), ends.append(cls_index)
            continue
        start = first
        while start <= last and offsets[start][0] <= start_char:
            start += 1
        end = last
        while end >= first and offsets[end][1] >= end_char:
            end -= 1
        starts.append(start - 1), ends.append(end + 1)
    return starts, ends, cls_indices


def prepare_train_features(examples, tokenizer, max_length: int, doc_stride: int) -> dict:
    """Batched map over questions: model inputs plus start_positions/end_positions, one row per feature."""
    encoded, context_index = _tokenize(examples, tokenizer, max_length, doc_stride)
    encoded["start_positions"], encoded["end_positions"], _ = _answer_positions(encoded, examples, context_index,
                                                                                tokenizer)
    encoded.pop("offset_mapping")
    encoded.pop("overflow_to_sample_mapping")
    return encoded


def prepare_validation_features(examples, tokenizer, max_length: int, doc_stride: int) -> dict:
    """As prepare_train_features (the labels give an eval loss, and the Trainer computes metrics only when there
    are labels), plus example_id, cls_index and offsets that are None outside the context."""
    encoded, context_index = _tokenize(examples, tokenizer, max_length, doc_stride)
    (encoded["start_positions"], encoded["end_positions"],
     encoded["cls_index"]) = _answer_positions(encoded, examples, context_index, tokenizer)
    samples = encoded.pop("overflow_to_sample_mapping")
    encoded["example_id"] = [examples["id"][sample] for sample in samples]
    encoded["offset_mapping"] = [
        [offset if sequence == context_index else None for offset, sequence in zip(offsets, encoded.sequence_ids(i))]
        for i, offsets in enumerate(encoded["offset_mapping"])]
    return encoded


# -- post-processing -----------------------------------------------------------------------------------------
def example_nbest(context: str, feature_predictions, n_best_size: int = 20, max_answer_length: int = 30):
    """The n best spans of one question over all its features, best first, and its null score.

    feature_predictions: (start_logits, end_logits, offsets, cls_index) per feature; offsets None outside the
    context. Returns ([{"text", "score", "start", "end"}], null_score) where null_score is the lowest CLS score
    over the features (the feature most sure there is an answer decides)."""
    spans, null_score = {}, None
    for start_logits, end_logits, offsets, cls_index in feature_predictions:
        feature_null = float(start_logits[cls_index] + end_logits[cls_index])
        null_score = feature_null if null_score is None else min(null_score, feature_null)
        # Logits may be longer than the feature: the Trainer pads them across batches with -100.
        length = min(len(offsets), len(start_logits))
        best_starts = np.argsort(start_logits[:length], kind="stable")[::-1][:n_best_size]
        best_ends = np.argsort(end_logits[:length], kind="stable")[::-1][:n_best_size]
        for start in best_starts:
            for end in best_ends:
                if offsets[start] is None or offsets[end] is None or end < start or end - start + 1 > max_answer_length:
                    continue
                span = (int(offsets[start][0]), int(offsets[end][1]))
                score = float(start_logits[start] + end_logits[end])
                if span not in spans or spans[span] < score:  # overlapping features see the same span twice
                    spans[span] = score
    ranked = sorted(spans.items(), key=lambda item: (-item[1], item[0]))[:n_best_size]
    return [{"text": context[a:b], "score": score, "start": a, "end": b} for (a, b), score in ranked], null_score


def postprocess_predictions(examples, features, start_logits, end_logits, n_best_size: int = 20,
                            max_answer_length: int = 30, version_2_with_negative: bool = False,
                            null_score_diff_threshold: float = 0.0) -> dict[str, str]:
    """Feature logits (in feature order) -> {example id: answer text}.

    examples: columns id, context; features: columns example_id, offset_mapping (None outside the context),
    optionally cls_index (default 0). With version_2_with_negative the answer is "" when the null score beats
    the best span's score by more than null_score_diff_threshold."""
    start_logits, end_logits = np.asarray(start_logits), np.asarray(end_logits)
    example_ids, offsets = list(features["example_id"]), list(features["offset_mapping"])
    if len(start_logits) != len(example_ids) or len(end_logits) != len(example_ids):
        raise ValueError(f"postprocess_predictions: {len(start_logits)} start and {len(end_logits)} end logit rows "
                         f"for {len(example_ids)} features; the predictions must be every feature once, in order")
    columns = features.column_names if hasattr(features, "column_names") else list(features)
    cls_indices = list(features["cls_index"]) if "cls_index" in columns else [0] * len(example_ids)
    features_of = defaultdict(list)
    for index, example_id in enumerate(example_ids):
        features_of[example_id].append(index)
    answers = {}
    for example_id, context in zip(examples["id"], examples["context"]):
        nbest, null_score = example_nbest(
            context, [(start_logits[i], end_logits[i], offsets[i], cls_indices[i]) for i in features_of[example_id]],
            n_best_size, max_answer_length)
        best = nbest[0] if nbest else None
        if version_2_with_negative and (best is None or null_score - best["score"] > null_score_diff_threshold):
            answers[example_id] = ""
        else:
            answers[example_id] = best["text"] if best else ""
    return answers


class SquadEvaluation:
    """`compute_metrics` for the Trainer: gathered logits of every feature -> answers -> EM/F1.

    The latest answers stay in `.predictions` so the caller can write them out."""

    def __init__(self, examples, features, data_args: DataArguments):
        self.examples = {"id": list(examples["id"]), "context": list(examples["context"])}
        self.features = {name: list(features[name]) for name in FEATURE_METADATA}
        self.references = {key: gold_answers(answers) for key, answers in zip(examples["id"], examples["answers"])}
        self.settings = dict(n_best_size=data_args.n_best_size, max_answer_length=data_args.max_answer_length,
                             version_2_with_negative=data_args.version_2_with_negative,
                             null_score_diff_threshold=data_args.null_score_diff_threshold)
        self.predictions: dict[str, str] = {}

    def __call__(self, prediction) -> dict[str, float]:
        start_logits, end_logits = prediction.predictions[:2]
        self.predictions = postprocess_predictions(self.examples, self.features, start_logits, end_logits,
                                                   **self.settings)
        return squad_metrics(self.predictions, self.references)


# -- the task entry point ------------------------------------------------------------------------------------
@dataclass
class DataArguments:
    train_file: str | None = field(default=None, metadata={"help": "SQuAD-format JSON; default: data/qa/."})
    validation_file: str | None = field(default=None, metadata={"help": "SQuAD-format JSON; default: data/qa/."})
    version_2_with_negative: bool = field(default=False, metadata={"help": "Some questions have no answer (v2)."})
    max_seq_length: int = field(default=384, metadata={"help": "Question + context tokens per feature."})
    doc_stride: int = field(default=128, metadata={"help": "Tokens shared by consecutive features of a context."})
    n_best_size: int = field(default=20)
    max_answer_length: int = field(default=30, metadata={"help": "Longest answer, in tokens."})
    null_score_diff_threshold: float = field(default=0.0, metadata={"help": "v2: answer '' when null - best > this."})
    max_train_samples: int | None = field(default=None, metadata={"help": "First N training questions."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "First N validation questions."})
    preprocessing_num_workers: int | None = field(default=None)
    overwrite_cache: bool = field(default=False, metadata={"help": "Tokenize again instead of using the cache."})
    evaluate_before_training: bool = field(default=False, metadata={"help": "Report validation metrics first."})
    max_misplaced_answers: float = field(default=0.01, metadata={
        "help": "Share of answers whose answer_start may miss their text (those questions are left out of "
                "training); more is refused."})

    def __post_init__(self):
        check_sample_limits(self)
        problems = []
        if not 0 <= self.max_misplaced_answers < 1:
            problems.append(f"--max_misplaced_answers {self.max_misplaced_answers}: a share in [0, 1)")
        if self.doc_stride >= self.max_seq_length:
            problems.append(f"--doc_stride {self.doc_stride} must be smaller than --max_seq_length "
                            f"{self.max_seq_length} (try --doc_stride {self.max_seq_length // 3})")
        for name in ("max_seq_length", "n_best_size", "max_answer_length"):
            if getattr(self, name) < 1:
                problems.append(f"--{name} {getattr(self, name)} must be at least 1")
        for split, path in self.data_files().items():
            if not Path(path).is_file():
                problems.append(f"--{split}_file {path}: no such file (a SQuAD-format JSON file is needed)"
                                f"{nearby(path)}")
        if problems:
            raise ArgumentsError("; ".join(problems))

    def uses_shipped_data(self) -> bool:
        return not any(self._given().values())

    def data_files(self) -> dict[str, str]:
        """The files given (a SageMaker job's channels fill splits no flag names); both shipped ones when none is
        (never a shipped file beside a file of the user's)."""
        if self.uses_shipped_data():
            suffix = "_v2" if self.version_2_with_negative else ""
            return {split: str(SHIPPED_DATA / f"{split}{suffix}.json") for split in ("train", "validation")}
        return {split: str(path) for split, path in self._given().items() if path}

    def _given(self) -> dict:
        return with_channels({"train": self.train_file, "validation": self.validation_file}, (".json",))


def checked_files(data_args: DataArguments, training_args) -> tuple[dict[str, str], set[str]]:
    """The files this run reads, each checked whole (shape, questions, answers against contexts); and the training
    questions to leave out (their answer_start misses their text)."""
    from .common import check_needed_splits, needed_splits, shipped_data_note
    from .data_checks import check_squad

    files = data_args.data_files()
    needed = {split: flag for split, flag in needed_splits(data_args, training_args).items() if split != "test"}
    check_needed_splits(needed, files)
    if data_args.uses_shipped_data():
        shipped_data_note(SHIPPED_DATA)
    left_out = set()
    for split, path in files.items():
        if needed[split]:
            misplaced = check_squad(path, data_args.version_2_with_negative, data_args.max_misplaced_answers)
            left_out |= misplaced if split == "train" else set()
    return files, left_out


STEPS = ("do_train", "do_eval")


def check(model_args: ModelArguments, data_args: DataArguments, training_args) -> None:
    if training_args.do_predict:  # it was ignored without a word
        raise ArgumentsError("--do_predict: this QA recipe has no test split; --do_eval writes the validation set's "
                             "predictions (eval_predictions.json): drop --do_predict")


def model_path(model_args: ModelArguments) -> str:
    return model_args.model_name_or_path or shipped_model()


def setup(model_args: ModelArguments, data_args: DataArguments, training_args):
    """An extractive QA model fine-tuned and/or evaluated with ExtTrainer (trainer_ext.tasks.driver runs the steps).
    Writes {eval,eval_before,train}_results.json and {eval,eval_before}_predictions.json to output_dir."""
    import transformers
    from transformers import AutoModelForQuestionAnswering, default_data_collator, set_seed

    from ..training.prepare import sharded_loading
    from ..trainer import ExtTrainer

    from .common import check_sequence_length, reading
    from .driver import Prepared

    source = model_path(model_args)  # the model given, or the shipped one
    config = load_config(source, model_args)  # --config_overrides checked before the data and weights load
    files, left_out = checked_files(data_args, training_args)
    set_seed(training_args.seed)  # the new span head is initialised identically on every backend
    tokenizer = load_tokenizer(source, model_args)
    if not tokenizer.is_fast:
        raise ArgumentsError(f"{type(tokenizer).__name__} is not a fast tokenizer: question answering needs the "
                             "offset mapping only fast tokenizers give; pass --tokenizer_name of a fast one")
    check_sequence_length("--max_seq_length", data_args.max_seq_length, config, tokenizer)
    with sharded_loading(training_args), reading("--model_name_or_path", source, "model"):
        model = AutoModelForQuestionAnswering.from_pretrained(source, config=config, **model_args.model_kwargs)
    transformers.utils.logging.set_verbosity_warning()

    evaluating = training_args.do_eval or data_args.evaluate_before_training
    tokenize = dict(tokenizer=tokenizer, max_length=data_args.max_seq_length, doc_stride=data_args.doc_stride)
    cached = dict(num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache)
    train_features = eval_examples = eval_features = None
    # Rank 0 reads and tokenizes first; the other ranks then load its cache files.
    with training_args.main_process_first(desc="read and tokenize the QA data"):
        if training_args.do_train:
            train_examples = load_squad(files["train"], **cached)
            if left_out:  # answer_start misses the answer: the span would teach the wrong tokens
                train_examples = train_examples.filter(lambda ids: [i not in left_out for i in ids],
                                                       input_columns="id", batched=True, **cached)
            train_examples = first(train_examples, data_args.max_train_samples)
            train_features = train_examples.map(prepare_train_features, batched=True, fn_kwargs=tokenize,
                                                remove_columns=train_examples.column_names,
                                                desc="Tokenizing train", **cached)
        if evaluating:
            eval_examples = first(load_squad(files["validation"], **cached), data_args.max_eval_samples)
            eval_features = eval_examples.map(prepare_validation_features, batched=True, fn_kwargs=tokenize,
                                              remove_columns=eval_examples.column_names,
                                              desc="Tokenizing validation", **cached)

    evaluation = SquadEvaluation(eval_examples, eval_features, data_args) if evaluating else None
    trainer = ExtTrainer(model=model, args=training_args, train_dataset=train_features,
                         eval_dataset=eval_features.remove_columns(FEATURE_METADATA) if evaluating else None,
                         processing_class=tokenizer, data_collator=default_data_collator, compute_metrics=evaluation)

    def evaluate(prefix: str) -> dict:
        metrics = trainer.evaluate(metric_key_prefix=prefix)
        trainer.log_metrics(prefix, metrics)
        trainer.save_metrics(prefix, metrics)
        if trainer.is_world_process_zero():
            path = Path(training_args.output_dir) / f"{prefix}_predictions.json"
            path.write_text(json.dumps(evaluation.predictions, indent=1, sort_keys=True) + "\n")
        return metrics

    return Prepared(trainer, len(train_features) if train_features is not None else None, evaluate)


def report(results: dict, training_args) -> None:
    """What the example prints on the main process: exact match and F1 before and after training, where the model
    went."""
    from .common import say_model_saved

    labels = {"eval_before": " before training", "eval": " after training" if training_args.do_train else ""}
    for prefix, label in labels.items():
        if f"{prefix}_f1" in results:
            print(f"validation{label}: exact match {results[f'{prefix}_exact_match']:.2f}, "
                  f"F1 {results[f'{prefix}_f1']:.2f}", flush=True)
    say_model_saved(training_args)


# The whole recipe, as the examples and experiment files run it (run(model_args, data_args, training_args) -> metrics).
run = functools.partial(run_task, "qa")
