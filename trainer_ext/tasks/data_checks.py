"""A user's data checked as it is read, before any training: files that do not parse or hold no rows, missing or
null texts, label sets a classifier cannot learn from, SQuAD files and answers, translation pairs. One line per
problem, naming the file, the row and the column, and the fix."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from ..errors import ArgumentsError, main_process

logger = logging.getLogger(__name__)


class DataError(ArgumentsError):
    """A data file cannot be trained or evaluated on as it is: its content, not a flag, needs the fix."""


def say_once(message: str) -> None:
    """A fact the user should know (shipped data in use, rows left out): printed by the main process only."""
    if main_process():
        print(f"trainer_ext: {message}", flush=True)


def row(file, index: int) -> str:
    """Where row `index` (0-based) of a file is, as its user finds it in an editor."""
    suffix = Path(str(file)).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return f"{file} line {index + 1}"
    if suffix in (".csv", ".tsv"):
        return f"{file} row {index + 1} (line {index + 2})"
    return f"{file} row {index + 1}"


# -- reading ----------------------------------------------------------------------------------------------------------
def first_problem(path) -> str | None:
    """Why a data file cannot be read, found by reading it ourselves (datasets' own errors do not name the file or
    the line): empty, or the first JSON line that does not parse."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # a BOM (Windows editors) is fine: datasets reads it
    except UnicodeDecodeError as err:
        return f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8"
    except OSError as err:
        return f"{path}: cannot be read ({err.strerror})"
    if not text.strip():
        return f"{path} is empty: it needs one example per line"
    if path.suffix.lower() in (".csv", ".tsv"):
        return table_problem(path, text)
    if path.suffix.lower() not in (".json", ".jsonl"):
        return None
    stripped = text.lstrip()
    if stripped.startswith("["):  # one JSON array of rows
        try:
            rows = json.loads(text)
        except ValueError as err:
            return f"{path}: not valid JSON ({err})"
        return None if rows else f"{path} is an empty list: it needs at least one example"
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as err:
            return (f"{path} line {number} is not JSON ({err.msg}, column {err.colno}): each line must be one JSON "
                    "object such as {\"sentence\": \"...\", \"label\": 1}")
        if not isinstance(value, dict):
            return f"{path} line {number} is a JSON {type(value).__name__}, not an object with named fields"
    return None


def table_problem(path: Path, text: str) -> str | None:
    """A CSV whose fields are separated by tabs (or a TSV by commas) reads as one column named by the whole header
    line; a header without rows made datasets say 'Instruction "train" corresponds to no data!'."""
    lines = [line for line in text.splitlines() if line.strip()]
    header, tabs = lines[0], path.suffix.lower() == ".tsv"
    if not tabs and "\t" in header and "," not in header:
        return (f"{path}: its header line is separated by tabs, not commas ({header!r}): name the file .tsv, or "
                "separate the fields with commas")
    if tabs and "," in header and "\t" not in header:
        return f"{path}: its header line is separated by commas, not tabs ({header!r}): name the file .csv"
    if len(lines) < 2:
        return f"{path} has a header line ({header!r}) but no rows: add one example per line below it"
    return None


def check_datasets_cache(cache_dir=None) -> None:
    """datasets writes its cache and lock files under HF_DATASETS_CACHE (else HF_HOME/datasets, else
    ~/.cache/huggingface/datasets; `cache_dir` when given): a folder this process cannot write failed inside
    load_dataset with filelock's `OSError: [Errno 30] Read-only file system` traceback. One probe file, removed."""
    import os
    import tempfile

    import datasets.config

    folder = Path(cache_dir or datasets.config.HF_DATASETS_CACHE)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".trainer-ext-probe-")
        os.close(handle)
        os.unlink(probe)
        return
    except OSError as err:
        reason = err.strerror or type(err).__name__
    if cache_dir:
        named, fix = f"the datasets cache {folder}", "give a cache folder you can write"
    elif "HF_DATASETS_CACHE" in os.environ:
        named, fix = f"HF_DATASETS_CACHE={folder}", "point HF_DATASETS_CACHE at a folder you can write, or unset it"
    elif "HF_HOME" in os.environ:
        named, fix = (f"HF_HOME={os.environ['HF_HOME']} (datasets caches in {folder})",
                      "set HF_DATASETS_CACHE to a folder you can write")
    else:
        named, fix = f"datasets' cache {folder}", "set HF_DATASETS_CACHE to a folder you can write"
    raise ArgumentsError(f"{named}: cannot write there ({reason}), and datasets writes its cache and lock files there "
                         f"as it reads the data: {fix}")


def load_files(kind: str, files: dict[str, str], **kwargs):
    """datasets.load_dataset(kind, data_files=files), with a file that cannot be read named in one line."""
    import datasets

    check_datasets_cache(kwargs.get("cache_dir"))
    for path in files.values():
        problem = first_problem(path)
        if problem:
            raise DataError(problem)
    try:
        return datasets.load_dataset(kind, data_files=files, **kwargs)
    except (datasets.exceptions.DatasetGenerationError, ValueError, StopIteration, TypeError) as err:
        cause = err.__cause__ or err.__context__ or err
        first_line = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise DataError(f"cannot read {', '.join(files.values())}: {first_line} (check that every row has the same "
                        "fields with the same kind of value)") from None


# -- columns --------------------------------------------------------------------------------------------------------
def check_rows(dataset, file, split: str) -> None:
    if len(dataset) == 0:
        raise DataError(f"{file} ({split}) has no rows: give a file with at least one example")


def check_texts(dataset, column: str, file, flag: str) -> None:
    """Every row has a text in `column`: a null or a number there ends in a tokenizer traceback otherwise."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if column not in dataset.column_names:
        raise DataError(f"{flag} {column!r}: {file} has no such column (columns: {', '.join(dataset.column_names)})")
    values = dataset.data.column(column)
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        sample = next((v for v in dataset[column][:50] if not isinstance(v, str)), None)
        index = dataset[column].index(sample) if sample is not None else 0
        raise DataError(f"{row(file, index)}: {column!r} is {sample!r}, not a text ({flag} {column!r} must name a "
                        "column of texts)")
    if values.null_count:
        index = pc.index(pc.is_null(values), True).as_py()
        raise DataError(f"{row(file, index)}: {column!r} is null ({values.null_count} row(s) of {len(dataset)} "
                        "have no text): fill them in or remove those rows")


# -- labels -----------------------------------------------------------------------------------------------------------
def label_name(value) -> str:
    """One name per label whatever the file wrote: 1, 1.0 and "1" are the same class in JSON lines and CSV."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip()


def label_order(name: str):
    try:
        return (0, float(name), name)
    except ValueError:
        return (1, 0.0, name)


def training_labels(dataset, column: str, file) -> list[str]:
    """The class names of the training data, sorted (numbers numerically); every problem a classifier cannot learn
    from refused here."""
    values = dataset[column]
    for index, value in enumerate(values):
        if value is None or (isinstance(value, str) and not value.strip()):
            raise DataError(f"{row(file, index)}: {column!r} is empty: every training row needs a label (fill it in "
                            "or remove the row)")
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise DataError(f"{row(file, index)}: {column!r} is {value!r}: a label is a class name or a whole number")
        if isinstance(value, float) and not value.is_integer():
            raise DataError(f"{row(file, index)}: {column!r} is {value}: labels must be class names or whole numbers "
                            "(this recipe classifies; a regression target is not supported)")
    names = sorted({label_name(v) for v in values}, key=label_order)
    if len(values) >= 20 and len(names) > len(values) / 2 and any(not n.lstrip("-").isdigit() for n in names):
        raise DataError(f"{file}: column {column!r} has {len(names)} different values in {len(values)} rows (e.g. "
                        f"{names[0]!r}): that is not a set of classes; check --label_column (and --text_column)")
    if len(names) < 2:
        raise DataError(f"{file}: every row has the label {names[0]!r} in column {column!r}: a classifier needs at "
                        "least two classes (check --label_column, or add examples of the other classes)")
    return names


def unlabelled(values, names: list[str]) -> bool:
    """A test split without labels: every value null, or GLUE's -1 for "no label"."""
    return all(v is None or (label_name(v) == "-1" and "-1" not in names) for v in values)


def check_known_labels(dataset, column: str, file, names: list[str], split: str) -> None:
    """Every label of an evaluation split is one the classifier was trained on (and none is missing)."""
    known = set(names)
    unknown = [(index, value) for index, value in enumerate(dataset[column])
               if value is None or label_name(value) not in known]
    if unknown:
        index, value = unknown[0]
        what = "has no label" if value is None else f"has the label {value!r}, which the training data never uses"
        raise DataError(f"{row(file, index)} ({split}) {what} ({len(unknown)} row(s) like it; the training labels are "
                        f"{', '.join(names)}): fix those labels in column {column!r}, or add training examples of them")


# -- SQuAD files ----------------------------------------------------------------------------------------------------
SQUAD_SHAPE = ('a SQuAD file is one JSON object {"version": ..., "data": [{"title": ..., "paragraphs": [{"context": '
               '..., "qas": [{"id": ..., "question": ..., "answers": [{"text": ..., "answer_start": N}]}]}]}]}')


def check_squad(path, version_2: bool, max_misplaced: float) -> set[str]:
    """Read a SQuAD file whole and check it before datasets flattens it: its shape, every question's fields, and
    every answer against its context. Returns the ids of questions whose answer_start does not point at their answer
    (at most `max_misplaced` of the answers; more is refused)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8") from None
    if text.startswith("\ufeff"):  # datasets' JSON reader fails on it with a traceback, for a SQuAD file
        raise DataError(f"{path} starts with a byte-order mark (BOM): save it as UTF-8 without BOM")
    if not text.strip():
        raise DataError(f"{path} is empty: {SQUAD_SHAPE}")
    try:
        document = json.loads(text)
    except ValueError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(document, dict) or not isinstance(document.get("data"), list):
        top = type(document).__name__ if not isinstance(document, dict) else f"an object without a \"data\" list " \
              f"(keys: {', '.join(document) or 'none'})"
        raise DataError(f"{path} is {'a ' + top if not isinstance(document, dict) else top} at the top: {SQUAD_SHAPE}")
    questions, answers, misplaced, unanswerable = 0, 0, [], 0
    for a, article in enumerate(document["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise DataError(f"{path}: data[{a}] has no \"paragraphs\" list: {SQUAD_SHAPE}")
        for p, paragraph in enumerate(paragraphs):
            where = f"{path}: data[{a}].paragraphs[{p}]"
            context = paragraph.get("context") if isinstance(paragraph, dict) else None
            if not isinstance(context, str) or not context.strip():
                raise DataError(f"{where} has no \"context\" text (fill it in or remove the paragraph)")
            if not isinstance(paragraph.get("qas"), list):
                raise DataError(f"{where} has no \"qas\" list: {SQUAD_SHAPE}")
            for q, qa in enumerate(paragraph["qas"]):
                spot = f"{where}.qas[{q}]"
                if not isinstance(qa, dict) or qa.get("id") is None:
                    raise DataError(f"{spot} has no \"id\": every question needs one (unique)")
                spot = f"{path}: question id {qa['id']!r} ({spot.split(': ', 1)[1]})"
                if not isinstance(qa.get("question"), str) or not qa["question"].strip():
                    raise DataError(f"{spot} has no \"question\" text")
                questions += 1
                given = [] if qa.get("is_impossible") else qa.get("answers") or []
                if not isinstance(given, list):
                    raise DataError(f"{spot}: \"answers\" must be a list of {{\"text\", \"answer_start\"}}")
                if not given:
                    unanswerable += 1
                for answer in given:
                    if (not isinstance(answer, dict) or not isinstance(answer.get("text"), str)
                            or isinstance(answer.get("answer_start"), bool)
                            or not isinstance(answer.get("answer_start"), int)):
                        raise DataError(f"{spot}: each answer needs \"text\" (a string) and \"answer_start\" (a "
                                        f"character offset), got {json.dumps(answer)[:80]}")
                    answers += 1
                    start, text = answer["answer_start"], answer["text"]
                    if context[start:start + len(text)] != text or start < 0:
                        misplaced.append((qa["id"], spot, start, text, context))
    if questions == 0:
        raise DataError(f"{path} holds no questions: {SQUAD_SHAPE}")
    if unanswerable and not version_2:
        raise DataError(f"{path}: {unanswerable} of {questions} questions have no answer (SQuAD v2's is_impossible): "
                        "pass --version_2_with_negative to train and score them, or remove them")
    if misplaced:
        share = len(misplaced) / answers
        _, spot, start, text, context = misplaced[0]
        found = context.find(text)
        example = (f"first: {spot}: the context at {start} reads {context[max(0, start):start + len(text)]!r}, the "
                   f"answer is {text!r}" + (f", found at {found}" if found >= 0 else ", not in the context"))
        what = (f"{path}: {len(misplaced)} of {answers} answers ({share:.1%}) are not where their answer_start "
                f"points ({example})")
        if share > max_misplaced:
            raise DataError(f"{what}: fix answer_start (0-based character offsets into the context), or pass "
                            f"--max_misplaced_answers {math.ceil(share * 100) / 100:g} to leave those questions out of "
                            "training")
        say_once(f"{what}: left out of training (--max_misplaced_answers {max_misplaced:g})")
    return {question_id for question_id, *_ in misplaced}
