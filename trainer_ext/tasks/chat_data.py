"""Causal-LM data: JSON lines of chat `messages` (role/content turns), ShareGPT `conversations` (from/value), Alpaca
`instruction`/`input`/`output`, `prompt`/`completion` or plain `text` (other column names mapped by
--dataset_text_field / --dataset_columns), read in one streaming pass that checks every row and keeps its line number,
then tokenized a batch at a time with labels: every token for `text`, only the assistant's (or the completion's)
tokens with completion-only loss, cut from the rendered text by character spans and the fast tokenizer's offsets.
Labels are aligned with the input ids (the model shifts them); -100 carries no loss."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from pathlib import Path

import numpy as np

from ..data.packing import IGNORE
from ..errors import ArgumentsError, closest
from .data_checks import DataError, row

ROLES = ("system", "user", "assistant", "tool")
# The fields that make a row of each format, in the order a row is matched; the columns holding them can be renamed.
FORMATS = {"messages": ("messages",), "sharegpt": ("conversations",), "alpaca": ("instruction", "output"),
           "prompt_completion": ("prompt", "completion"), "text": ("text",)}
FIELDS = ("messages", "conversations", "instruction", "input", "output", "system", "history", "prompt", "completion",
          "text")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "observation": "tool", "tool": "tool"}
TEXT_PARTS = ("text", "input_text")  # OpenAI's and TRL's content parts that hold text; joined by a newline
# Said once when the tokenizer has none: ChatML's markers as text, each assistant turn closed by the eos token so the
# model learns to stop (TRL and Axolotl default to ChatML too).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# -- which column holds what ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Columns:
    """The column each field is read from: its own name unless --dataset_text_field / --dataset_columns map it."""

    mapping: tuple = ()  # ((field, column), ...), sorted

    def __getitem__(self, name: str) -> str:
        return self._columns.get(name, name)

    @cached_property
    def _columns(self) -> dict:
        return dict(self.mapping)

    @classmethod
    def from_flags(cls, text_field: str | None, columns) -> "Columns":
        mapping = {}
        if isinstance(columns, dict):  # an experiment file's YAML mapping
            pairs = [(str(k), str(v)) for k, v in columns.items()]
        else:
            pairs = [(part.partition("=")[0].strip(), part.partition("=")[2].strip()) for part in
                     (columns or "").split(",") if part.strip()]
        for name, column in pairs:
            if name not in FIELDS:
                hint = closest(name, FIELDS)
                raise ArgumentsError(f"--dataset_columns {columns}: {name!r} is not a field this recipe reads"
                                     + (f" (did you mean {hint!r}?)" if hint else "")
                                     + f"; give FIELD=COLUMN pairs, FIELD one of {', '.join(FIELDS)}")
            if not column:
                raise ArgumentsError(f"--dataset_columns {columns}: {name!r} names no column: give FIELD=COLUMN, "
                                     f"e.g. {name}=my_{name}")
            mapping[name] = column
        if text_field is not None:
            if mapping.get("text", text_field) != text_field:
                raise ArgumentsError(f"--dataset_text_field {text_field} and --dataset_columns text={mapping['text']} "
                                     "name two columns for the text: give one")
            mapping["text"] = text_field
        return cls(tuple(sorted((name, column) for name, column in mapping.items() if name != column)))

    def example(self, fmt: str) -> str:
        """One row of `fmt` as this file would hold it (its column names)."""
        values = {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}],
                  "conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}],
                  "instruction": "...", "input": "...", "output": "...", "prompt": "...", "completion": "...",
                  "text": "..."}
        names = FORMATS[fmt] + (("input",) if fmt == "alpaca" else ())
        ordered = [name for name in FIELDS if name in names]
        return json.dumps({self[name]: values[name] for name in ordered})


def row_format(path, number: int, value: dict, columns: Columns) -> str:
    for fmt, names in FORMATS.items():
        if all(columns[name] in value for name in names):
            return fmt
    absent = [(name, column) for name, column in columns.mapping if column not in value]
    if absent:  # a column the flags name that the file does not have: most likely mistyped
        name, column = absent[0]
        hint = closest(column, [key for key in value if key not in dict(columns.mapping).values()])
        flag = "--dataset_text_field" if name == "text" else f"--dataset_columns {name}={column}"
        raise DataError(f"{row(path, number)}: {flag} reads column {column!r}, which this row does not have"
                        + (f" (did you mean {hint!r}?)" if hint else "") + f"; its fields: {sorted(value)}")
    has = lambda name: columns[name] in value  # noqa: E731
    hint = ("; it has 'prompt' but no 'completion'" if has("prompt") else
            "; it has 'completion' but no 'prompt'" if has("completion") else
            "; it has 'instruction' but no 'output' (Alpaca)" if has("instruction") else "")
    texts = [key for key, field_value in value.items() if isinstance(field_value, str)]  # in the file's order
    turns = [key for key, field_value in value.items() if isinstance(field_value, list)]
    mapping = (f"--dataset_text_field {texts[0]}" if len(texts) == 1 and not turns else
               f"--dataset_columns prompt={texts[0]},completion={texts[1]}" if len(texts) == 2 and not turns else
               f"--dataset_columns messages={turns[0]}" if len(turns) == 1 else "--dataset_columns FIELD=COLUMN,...")
    raise DataError(f"{row(path, number)}: fields {sorted(value)}; each line needs 'messages' (a list of {{\"role\", "
                    "\"content\"}), 'prompt' and 'completion', or 'text' (or ShareGPT's 'conversations', Alpaca's "
                    f"'instruction' and 'output'){hint}; for columns of other names give e.g. {mapping}")


# -- reading, row by row ----------------------------------------------------------------------------------------------
@dataclass
class Row:
    line: int  # 0-based line number in the file (its index in a JSON array)
    example: dict  # checked and normalised: messages (+ prompt_turns), prompt and completion, or text
    end: int  # byte offset after the line (index + 1 in a JSON array): where reading continues


@dataclass
class ChatFile:
    """One data file, read a row at a time: its format (from its first row) and every row checked as it is read."""

    path: str
    columns: Columns = field(default_factory=Columns)
    format: str = ""
    chat: bool = False  # its rows render through the chat template
    array: bool = False  # one JSON array rather than JSON lines
    size: int = 0
    first_line: int = 0

    def __post_init__(self):
        self.path = str(self.path)
        try:
            self.size = Path(self.path).stat().st_size
            with open(self.path, "rb") as stream:
                head = stream.read(64).lstrip(b"\xef\xbb\xbf").lstrip()
        except OSError as err:
            raise DataError(f"{self.path}: cannot be read ({err.strerror})") from None
        if not head:
            raise DataError(f"{self.path} is empty: it needs one example per line")
        self.array = head.startswith(b"[")
        values = self._values(0, 0)
        first = next(values, None)
        values.close()
        if first is None:
            raise DataError(f"{self.path} has no rows: give a file with at least one example")
        number, value, _ = first
        self.format = row_format(self.path, number, value, self.columns)
        self.chat = self.format != "text" and not (self.format == "prompt_completion" and not _conversational(
            value, self.columns))
        self.first_line = number

    def rows(self, start: int = 0, line: int = 0):
        """Each row from byte `start` (line `line`), checked: the first problem raises DataError naming its line."""
        for number, value, end in self._values(start, line):
            fmt = row_format(self.path, number, value, self.columns)
            chat = fmt != "text" and not (fmt == "prompt_completion" and not _conversational(value, self.columns))
            if (fmt, chat) != (self.format, self.chat):
                what = lambda f, c: ("conversational " if c and f == "prompt_completion" else "") + f  # noqa: E731
                raise DataError(f"{row(self.path, number)}: a {what(fmt, chat)} row in a file of "
                                f"{what(self.format, self.chat)} rows (line {self.first_line + 1}): give each format "
                                "in its own file")
            yield Row(number, checked(self.path, number, fmt, value, self.columns), end)

    def _values(self, start: int, line: int):
        if self.array:
            yield from self._array_values(start)
            return
        with open(self.path, "rb") as stream:
            stream.seek(start)
            offset = start
            for number, raw in enumerate(stream, line):
                offset += len(raw)
                if number == 0:
                    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a BOM (Windows editors)
                if not raw.strip():
                    continue
                try:
                    value = json.loads(raw)
                except UnicodeDecodeError as err:
                    raise DataError(f"{self.path} line {number + 1}: not UTF-8 text ({err.reason} at byte "
                                    f"{offset - len(raw) + err.start} of the file); save it as UTF-8") from None
                except ValueError as err:
                    raise DataError(f"{self.path} line {number + 1} is not JSON ({err.msg}, column {err.colno}): "
                                    f"each line must be one JSON object such as {self._example()}") from None
                if not isinstance(value, dict):
                    raise DataError(f"{self.path} line {number + 1} is a JSON {type(value).__name__}, not an object "
                                    f"with named fields such as {self._example()}")
                yield number, value, offset

    def _array_values(self, start: int):
        try:
            values = json.loads(Path(self.path).read_bytes().removeprefix(b"\xef\xbb\xbf"))
        except ValueError as err:
            raise DataError(f"{self.path}: not valid JSON ({err})") from None
        if not isinstance(values, list) or not all(isinstance(value, dict) for value in values):
            raise DataError(f"{self.path}: a JSON array must hold one object per example")
        for index in range(start, len(values)):
            yield index, values[index], index + 1

    def _example(self) -> str:
        if self.format:
            return self.columns.example(self.format)
        return (f"{self.columns.example('messages')}, {self.columns.example('prompt_completion')} or "
                f"{self.columns.example('text')}")


def _conversational(value: dict, columns: Columns) -> bool:
    return isinstance(value.get(columns["prompt"]), list) or isinstance(value.get(columns["completion"]), list)


@dataclass
class Rows:
    """One file's checked rows and their format, all in memory (small files: tests, benchmarks)."""

    path: str
    kind: str
    rows: list
    lines: list


def read_rows(path, split: str = "train", columns: Columns = Columns()) -> Rows:
    """Every row of a (small) file, checked, in memory."""
    source = ChatFile(path, columns)
    read = list(source.rows())
    return Rows(str(path), source.format, [r.example for r in read], [r.line for r in read])


# -- checking one row -----------------------------------------------------------------------------------------------
def checked(path, number: int, fmt: str, value: dict, columns: Columns = Columns()) -> dict:
    """A row of format `fmt`, checked and normalised to messages (+ prompt_turns), prompt and completion, or text."""
    where = row(path, number)
    get = lambda name: value.get(columns[name])  # noqa: E731
    if fmt == "text":
        return {"text": _text(where, columns["text"], get("text"))}
    if fmt == "prompt_completion":
        prompt, completion = get("prompt"), get("completion")
        if isinstance(prompt, list) or isinstance(completion, list):  # conversational prompt/completion (TRL's)
            messages = _messages(where, columns["prompt"], prompt, need_assistant=False) + _messages(
                where, columns["completion"], completion, need_assistant=False)
            return {"messages": _with_assistant(where, messages, columns["completion"]), "prompt_turns": len(prompt)}
        return {"prompt": _text(where, columns["prompt"], prompt, empty_ok=True),
                "completion": _text(where, columns["completion"], completion)}
    system = get("system")
    head = [{"role": "system", "content": _text(where, columns["system"], system)}] if system else []
    if fmt == "sharegpt":
        turns = _messages(where, columns["conversations"], get("conversations"), need_assistant=False, sharegpt=True)
        return {"messages": _with_assistant(where, head + turns, columns["conversations"])}
    if fmt == "alpaca":
        instruction = _text(where, columns["instruction"], get("instruction"))
        extra = _text(where, columns["input"], get("input"), empty_ok=True) if get("input") is not None else ""
        if extra.strip():
            instruction += "\n" + extra
        turns = head + _history(where, columns["history"], get("history"))
        return {"messages": turns + [{"role": "user", "content": instruction},
                                     {"role": "assistant", "content": _text(where, columns["output"], get("output"))}]}
    return {"messages": _messages(where, columns["messages"], get("messages"), need_assistant=True)}


def _text(where: str, name: str, value, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: '{name}' is {json.dumps(value)[:40]}, not text")
    if not value.strip() and not empty_ok:
        raise DataError(f"{where}: '{name}' is empty: there is nothing to train on (fill it in or remove the line)")
    return value


def _messages(where: str, name: str, value, need_assistant: bool, sharegpt: bool = False) -> list[dict]:
    """Chat turns ({"role", "content"}, or ShareGPT's {"from", "value"}) checked and read as messages."""
    keys, roles = (("from", "value"), SHAREGPT_ROLES) if sharegpt else (("role", "content"), dict(zip(ROLES, ROLES)))
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: '{name}' must be a non-empty list of {{\"{keys[0]}\": ..., \"{keys[1]}\": ...}}")
    messages = []
    for turn, message in enumerate(value, 1):
        if not isinstance(message, dict) or not all(key in message for key in keys):
            has = sorted(message) if isinstance(message, dict) else type(message).__name__
            fix = (" (ShareGPT turns: name the column 'conversations', or give --dataset_columns conversations="
                   f"{name})" if isinstance(message, dict) and "from" in message and not sharegpt else "")
            raise DataError(f"{where}: {name} turn {turn} has {has}; each turn needs '{keys[0]}' and '{keys[1]}'{fix}")
        given = message[keys[0]]
        if given not in roles:
            hint = closest(str(given), roles) or (None if sharegpt else {
                "human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}.get(str(given)))
            raise DataError(f"{where}: {name} turn {turn} has {keys[0]} {given!r}, not one of {', '.join(roles)}"
                            + (f" (did you mean {hint!r}?)" if hint else ""))
        role = roles[given]
        content = _content(f"{where}: {name} turn {turn} ({given})", message[keys[1]])
        if role == "assistant" and not content.strip():
            raise DataError(f"{where}: {name} turn {turn} ({given}) is empty: an assistant turn with nothing to "
                            "learn (fill it in or remove the turn)")
        messages.append({"role": role, "content": content} if sharegpt else {**message, "content": content})
    return _with_assistant(where, messages, name) if need_assistant else messages


def _content(where: str, content) -> str:
    """A turn's content: text, or OpenAI's list of parts whose text parts are joined by a newline."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        texts = []
        for number, part in enumerate(content, 1):
            kind = part.get("type", "text" if "text" in part else None)
            if kind not in TEXT_PARTS:
                raise DataError(f"{where}: content part {number} is {json.dumps(part)[:60]}, of type {kind!r}, not "
                                "text; this recipe trains on text alone (remove the part, or the row)")
            if not isinstance(part.get("text"), str):
                raise DataError(f"{where}: content part {number} ({kind}) has no 'text' string")
            texts.append(part["text"])
        return "\n".join(texts)
    raise DataError(f"{where}: 'content' is {json.dumps(content)[:40]}, not text (or a list of "
                    "{\"type\": \"text\", \"text\": ...} parts)")


def _history(where: str, name: str, value) -> list[dict]:
    """Alpaca's earlier turns: [[instruction, output], ...]."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(pair, list) and len(pair) == 2 and all(
            isinstance(text, str) for text in pair) for pair in value):
        raise DataError(f"{where}: '{name}' must be a list of [instruction, output] pairs of texts")
    return [{"role": role, "content": text} for pair in value for role, text in zip(("user", "assistant"), pair)]


def _with_assistant(where: str, messages: list[dict], name: str) -> list[dict]:
    if not any(message["role"] == "assistant" for message in messages):
        roles = [message["role"] for message in messages]
        raise DataError(f"{where}: {name} has no assistant turn (roles: {', '.join(roles)}): completion-only loss "
                        "trains on the assistant's words; add the assistant's answer, or move the line to a file "
                        "of 'text' rows")
    return messages


# -- tokenizing -------------------------------------------------------------------------------------------------------
def render(tokenizer, template: str, messages, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def chat_spans(tokenizer, template: str, messages: list[dict], trained_from: int = 0) -> tuple[str, list]:
    """The rendered conversation and the character spans of its assistant turns (from turn `trained_from` on):
    each span runs from the end of the generation prompt to the end of the turn, its closing marker included (the
    model learns to stop). Raises ValueError when the template renders earlier turns differently once later ones
    follow (then no span can be cut from it)."""
    text = render(tokenizer, template, messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index < trained_from:
            continue
        prefix = render(tokenizer, template, messages[:index], add_generation_prompt=True) if index else ""
        upto = text if index == len(messages) - 1 else render(tokenizer, template, messages[:index + 1])
        if not (upto.startswith(prefix) and text.startswith(upto)):
            raise ValueError(f"the chat template renders the turns before assistant turn {index + 1} differently "
                             "once that turn follows, so its tokens cannot be told apart")
        spans.append((len(prefix), len(upto)))
    return text, spans


def text_and_spans(example: dict, tokenizer, template) -> tuple[str, list, bool]:
    """The text a row is tokenized as, the character spans completion-only loss trains, and whether the tokenizer
    adds its special tokens (a chat template writes them itself)."""
    if "messages" in example:
        text, spans = chat_spans(tokenizer, template, example["messages"], example.get("prompt_turns") or 0)
        return text, spans, False
    if "prompt" in example:
        text = example["prompt"] + example["completion"]
        return text, [(len(example["prompt"]), len(text))], True
    return example["text"], [(0, len(example["text"]))], True


@dataclass
class Encoded:
    """A batch of rows tokenized, flat: sample i is the next lengths[i] tokens (cut to the maximum length); rows that
    lost every target token to the cut are left out and counted in `lost`, cut ones in `truncated`."""

    input_ids: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    truncated: int = 0
    lost: int = 0


@dataclass
class Encoder:
    """Rows -> input_ids and labels, a batch at a time through the fast tokenizer; `path` names a row's file."""

    tokenizer: object
    template: str | None
    completion_only: bool
    max_length: int
    path: str = ""

    def __call__(self, rows: list[Row], rendered: list | None = None) -> Encoded:
        """The rows' samples (`rendered`: their render(), when done ahead), cut to max_length; a row no target token
        survives in before any cut is the user's to fix (DataError naming its line), one that loses them all to the
        cut is left out."""
        ids, labels, lengths, truncated, lost = [], [], [], 0, 0
        for r, (sample, target) in zip(rows, self.samples(rows, rendered)):
            if not (target[1:] != IGNORE).any():
                raise DataError(f"{row(self.path, r.line)}: no token carries a label: completion-only loss found no "
                                "assistant/completion token in the rendered text (check that the chat template "
                                "writes each assistant turn)")
            if len(sample) > self.max_length:
                truncated += 1
                sample, target = sample[:self.max_length], target[:self.max_length]
                if not (target[1:] != IGNORE).any():
                    lost += 1
                    continue
            ids.append(sample)
            labels.append(target)
            lengths.append(len(sample))
        join = lambda parts: np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)  # noqa: E731
        return Encoded(join(ids), join(labels), np.array(lengths, dtype=np.int64), truncated, lost)

    def render(self, rows: list[Row]) -> list[tuple[str, list, bool]]:
        """Each row's text, the spans completion-only loss trains, and whether the tokenizer adds its special tokens:
        Python alone, so a thread can render a batch while the tokenizer (which releases the GIL) works."""
        return [self._render(r) for r in rows]

    def samples(self, rows: list[Row], rendered: list | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each row's ids and labels, untruncated; text and prompt/completion rows end with the eos token (the model
        learns to end the text)."""
        pieces = rendered if rendered is not None else self.render(rows)
        out = [None] * len(rows)
        for special in (False, True):
            chosen = [i for i, piece in enumerate(pieces) if piece[2] == special]
            if chosen:
                for i, pair in zip(chosen, self._tokenize([pieces[i] for i in chosen], special)):
                    out[i] = pair
        eos = self.tokenizer.eos_token_id
        for i, r in enumerate(rows):
            sample, target = out[i]
            if "messages" not in r.example and eos is not None and (not len(sample) or sample[-1] != eos):
                out[i] = np.append(sample, eos), np.append(target, eos)
        return out

    def _render(self, r: Row):
        try:
            return text_and_spans(r.example, self.tokenizer, self.template)
        except Exception as err:  # noqa: BLE001 - jinja2's TemplateError, our ValueError: the row is named
            raise DataError(f"{row(self.path, r.line)}: the chat template cannot render it "
                            f"({str(err).splitlines()[0]})") from None

    def _tokenize(self, pieces: list, special: bool) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each text's ids and labels: a token trains when it starts inside a span (or always, without
        completion-only loss), never when it is a special token the tokenizer added itself (bos)."""
        tokenizer = self.tokenizer
        texts = [text for text, _, _ in pieces]
        if not tokenizer.is_fast:  # no offsets: each token starts where the decoded text before it ends
            flat = [token_starts(tokenizer, text, special) for text in texts]
            counts = np.array([len(ids) for ids, _ in flat], dtype=np.int64)
            ids = np.array(list(chain.from_iterable(ids for ids, _ in flat)), dtype=np.int64)
            starts = np.array(list(chain.from_iterable(row_starts for _, row_starts in flat)), dtype=np.int64)
        else:
            encoded = tokenizer(texts, add_special_tokens=special, return_offsets_mapping=True, verbose=False)
            counts = np.fromiter(map(len, encoded["input_ids"]), dtype=np.int64, count=len(texts))
            total = int(counts.sum())
            ids = np.fromiter(chain.from_iterable(encoded["input_ids"]), dtype=np.int64, count=total)
            offsets = np.fromiter(chain.from_iterable(chain.from_iterable(encoded["offset_mapping"])),
                                  dtype=np.int64, count=2 * total).reshape(-1, 2)
            starts = offsets[:, 0].copy()
            if special:  # a special token the tokenizer added (bos) covers no text
                starts[(offsets[:, 0] == offsets[:, 1]) & np.isin(ids, list(tokenizer.all_special_ids))] = -1
        trained = starts >= 0
        if self.completion_only:
            # every row's spans on one axis (row r's characters at r * stride ...): one search for all the tokens
            stride = max(len(text) for text in texts) + 1
            begins = np.array([r * stride + b for r, (_, spans, _) in enumerate(pieces) for b, _ in spans] or [-1])
            ends = np.array([r * stride + e for r, (_, spans, _) in enumerate(pieces) for _, e in spans] or [-1])
            at = np.repeat(np.arange(len(texts)), counts) * stride + starts
            span = np.maximum(np.searchsorted(begins, at, side="right") - 1, 0)
            trained &= (begins[span] <= at) & (at < ends[span])
        labels = np.where(trained, ids, IGNORE)
        bounds = np.concatenate([[0], np.cumsum(counts)])
        return [(ids[b:e], labels[b:e]) for b, e in zip(bounds[:-1], bounds[1:])]


def encode(example: dict, tokenizer, template: str | None, completion_only: bool) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one checked row, untruncated."""
    ids, labels = Encoder(tokenizer, template, completion_only, max_length=0).samples([Row(0, example, 0)])[0]
    return ids.tolist(), labels.tolist()


def token_starts(tokenizer, text: str, special: bool) -> tuple[list[int], list]:
    """Token ids of `text` and each token's first character (None for added special tokens such as bos), for a
    tokenizer without offsets (a slow one): each token starts where the text up to it ends."""
    ids = tokenizer(text, add_special_tokens=special)["input_ids"]
    starts, seen = [], 0
    for i in range(len(ids)):
        starts.append(seen)
        seen = len(tokenizer.decode(ids[: i + 1], skip_special_tokens=True))
    return list(ids), starts
