"""Causal-LM data: JSON lines of `text` (plain language modelling), `messages` (chat: role/content turns) or
`prompt`/`completion`, read and checked line by line before the model loads, then tokenized with labels: every token
for `text`, only the assistant's (or the completion's) tokens with completion-only loss. Labels are aligned with the
input ids (the model shifts them); -100 carries no loss."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .data_checks import DataError, first_problem, row

ROLES = ("system", "user", "assistant", "tool")
KINDS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "text": ("text",)}
# Said once when the tokenizer has none: ChatML's markers as text, each assistant turn closed by the eos token so the
# model learns to stop (TRL and Axolotl default to ChatML too).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SHAREGPT_FIX = ("ShareGPT rows: rename 'conversations' to 'messages', 'from' to 'role' (human -> user, gpt -> "
                "assistant) and 'value' to 'content'")


@dataclass
class Rows:
    """One file's checked rows and their format ("messages", "prompt_completion" or "text")."""

    path: str
    kind: str
    rows: list
    lines: list  # each row's 0-based line number in the file (its index in a JSON array)


def read_rows(path, split: str) -> Rows:
    """Every line parsed and checked (one format per file, named fields, roles, an assistant turn); the first problem
    raises DataError naming the file, the line and the fix."""
    problem = first_problem(path)
    if problem:
        raise DataError(problem)
    text = Path(path).read_text(encoding="utf-8-sig")
    if text.lstrip().startswith("["):
        values = json.loads(text)
        if not all(isinstance(value, dict) for value in values):
            raise DataError(f"{path}: a JSON array must hold one object per example")
        numbered = list(enumerate(values))
    else:
        numbered = [(number, json.loads(line)) for number, line in enumerate(text.splitlines()) if line.strip()]
    if not numbered:
        raise DataError(f"{path} ({split}) has no rows: give a file with at least one example")
    kind = row_kind(path, *numbered[0])
    rows = []
    for number, value in numbered:
        if row_kind(path, number, value) != kind:
            raise DataError(f"{row(path, number)}: a {row_kind(path, number, value)} row in a file of {kind} rows "
                            f"(line {numbered[0][0] + 1}): give each format in its own file")
        rows.append(checked(path, number, kind, value))
    return Rows(str(path), kind, rows, [number for number, _ in numbered])


def row_kind(path, number: int, value: dict) -> str:
    for kind, keys in KINDS.items():
        if all(key in value for key in keys):
            return kind
    if "conversations" in value:
        raise DataError(f"{row(path, number)}: 'conversations' is ShareGPT's format; this recipe reads 'messages' "
                        f"({SHAREGPT_FIX})")
    hint = ("; it has 'prompt' but no 'completion'" if "prompt" in value else
            "; it has 'completion' but no 'prompt'" if "completion" in value else "")
    raise DataError(f"{row(path, number)}: fields {sorted(value)}; each line needs 'messages' (a list of "
                    "{\"role\", \"content\"}), 'prompt' and 'completion', or 'text'" + hint)


def checked(path, number: int, kind: str, value: dict) -> dict:
    where = row(path, number)
    if kind == "text":
        return {"text": _text(where, "text", value["text"])}
    if kind == "prompt_completion":
        prompt, completion = value["prompt"], value["completion"]
        if isinstance(prompt, list) or isinstance(completion, list):  # conversational prompt/completion (TRL's)
            messages = _messages(where, "prompt", prompt, need_assistant=False) + _messages(
                where, "completion", completion, need_assistant=False)
            return {"messages": _with_assistant(where, messages, "completion"),
                    "prompt_turns": len(prompt)}
        return {"prompt": _text(where, "prompt", prompt, empty_ok=True),
                "completion": _text(where, "completion", completion)}
    return {"messages": _messages(where, "messages", value["messages"], need_assistant=True)}


def _text(where: str, name: str, value, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: '{name}' is {json.dumps(value)[:40]}, not text")
    if not value.strip() and not empty_ok:
        raise DataError(f"{where}: '{name}' is empty: there is nothing to train on (fill it in or remove the line)")
    return value


def _messages(where: str, name: str, value, need_assistant: bool) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: '{name}' must be a non-empty list of {{\"role\": ..., \"content\": ...}}")
    messages = []
    for turn, message in enumerate(value, 1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            keys = sorted(message) if isinstance(message, dict) else type(message).__name__
            fix = f" ({SHAREGPT_FIX})" if isinstance(message, dict) and "from" in message else ""
            raise DataError(f"{where}: {name} turn {turn} has {keys}; each turn needs 'role' and 'content'{fix}")
        role = message["role"]
        if role not in ROLES:
            from ..errors import closest

            hint = closest(str(role), ROLES) or {"human": "user", "gpt": "assistant", "bot": "assistant",
                                                  "model": "assistant"}.get(str(role))
            raise DataError(f"{where}: {name} turn {turn} has role {role!r}, not one of {', '.join(ROLES)}"
                            + (f" (did you mean {hint!r}?)" if hint else ""))
        content = message["content"]
        if not isinstance(content, str):
            raise DataError(f"{where}: {name} turn {turn} ({role}): 'content' is {json.dumps(content)[:40]}, not "
                            "text")
        if role == "assistant" and not content.strip():
            raise DataError(f"{where}: {name} turn {turn} (assistant) is empty: an assistant turn with nothing to "
                            "learn (fill it in or remove the turn)")
        messages.append({**message, "role": role, "content": content})
    return _with_assistant(where, messages, name) if need_assistant else messages


def _with_assistant(where: str, messages: list[dict], name: str) -> list[dict]:
    if not any(message["role"] == "assistant" for message in messages):
        roles = [message["role"] for message in messages]
        raise DataError(f"{where}: {name} has no assistant turn (roles: {', '.join(roles)}): completion-only loss "
                        "trains on the assistant's words; add the assistant's answer, or move the line to a file "
                        "of 'text' rows")
    return messages


# -- tokenizing ---------------------------------------------------------------------------------------------------
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
        upto = render(tokenizer, template, messages[:index + 1])
        if not (upto.startswith(prefix) and text.startswith(upto)):
            raise ValueError(f"the chat template renders the turns before assistant turn {index + 1} differently "
                             "once that turn follows, so its tokens cannot be told apart")
        spans.append((len(prefix), len(upto)))
    return text, spans


def encode(example: dict, tokenizer, template: str | None, completion_only: bool) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one checked row, untruncated."""
    if "messages" in example:
        text, spans = chat_spans(tokenizer, template, example["messages"], example.get("prompt_turns") or 0)
        special = False  # the template writes the special tokens (bos) itself
    elif "prompt" in example:
        text = example["prompt"] + example["completion"]
        spans, special = [(len(example["prompt"]), len(text))], True
    else:
        text, spans, special = example["text"], [(0, len(example["text"]))], True
    ids, starts = token_starts(tokenizer, text, special)
    trained = [s is not None and (not completion_only or any(begin <= s < end for begin, end in spans))
               for s in starts]
    if "messages" not in example and tokenizer.eos_token_id is not None and (not ids or ids[-1] !=
                                                                             tokenizer.eos_token_id):
        ids, trained = ids + [tokenizer.eos_token_id], trained + [True]  # the model learns to end the text
    if not completion_only and special and starts and starts[0] is None:
        trained[0] = False  # a bos token is never predicted (the shift drops it anyway)
    return ids, [token if keep else -100 for token, keep in zip(ids, trained)]


def token_starts(tokenizer, text: str, special: bool) -> tuple[list[int], list]:
    """Token ids of `text` and each token's first character (None for added special tokens such as bos)."""
    if tokenizer.is_fast:
        encoded = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        starts = [None if end == start and special and i in _special_positions(encoded, tokenizer) else start
                  for i, (start, end) in enumerate(encoded["offset_mapping"])]
        return list(encoded["input_ids"]), starts
    # A slow tokenizer has no offsets: each token starts where the text up to it ends.
    ids = tokenizer(text, add_special_tokens=special)["input_ids"]
    starts, seen = [], 0
    for i in range(len(ids)):
        starts.append(seen)
        seen = len(tokenizer.decode(ids[: i + 1], skip_special_tokens=True))
    return list(ids), starts


def _special_positions(encoded, tokenizer) -> set[int]:
    specials = set(tokenizer.all_special_ids)
    return {i for i, token in enumerate(encoded["input_ids"]) if token in specials}


def tokenize_rows(batch: dict, tokenizer, template, completion_only: bool, max_length: int) -> dict:
    """datasets.map function (top level, so its cache fingerprint is stable): each row's ids and labels, cut to
    `max_length`. `truncated`, `lost` (every target token cut off) and `problem` (a row no target token survives in,
    or one the chat template cannot render) are read by the caller, which names the line."""
    out = {"input_ids": [], "labels": [], "truncated": [], "lost": [], "problem": []}
    for serialized in batch["row"]:
        example = json.loads(serialized)
        problem = ""
        try:
            ids, labels = encode(example, tokenizer, template, completion_only)
        except Exception as err:  # noqa: BLE001 - jinja2's TemplateError, our ValueError: the row is named later
            ids, labels, problem = [], [], f"the chat template cannot render it ({str(err).splitlines()[0]})"
        if not problem and not any(label != -100 for label in labels[1:]):
            problem = ("no token carries a label: completion-only loss found no assistant/completion token in the "
                       "rendered text (check that the chat template writes each assistant turn)")
        out["problem"].append(problem)
        out["truncated"].append(len(ids) > max_length)
        out["lost"].append(not problem and not any(label != -100 for label in labels[1:max_length]))
        out["input_ids"].append(ids[:max_length])
        out["labels"].append(labels[:max_length])
    return out
