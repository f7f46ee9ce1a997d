"""Predict per-rank training memory for each backend (DDP, DeepSpeed ZeRO-1/2/3, ZeRO-2/3 offload, FairScale `simple`,
`zero_dp_2`, `zero_dp_3`) from a model's parameter count, and pick the cheapest one that fits a device; pure (no torch).

Model states follow the ZeRO paper (Rajbhandari et al., 2020, section 3.1) with Ψ parameters on N ranks, Adam:
mixed precision keeps 2Ψ bytes of 16-bit parameters, 2Ψ of 16-bit gradients and 12Ψ of fp32 master weights plus
Adam's two moments; each stage divides its share by N. Activations follow Korthikanti et al., 2022 (eq. 1), per layer
s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations (doubled in fp32), less what today's kernels and settings do not
keep: with PyTorch's fused attention (transformers' default "sdpa") no a·s² term, without dropout no masks (s·b·h·32).
Measured on one H200 (BERT-large, bf16, dropout off, 384 tokens, batch 8 and 32): the per-sample slope of peak CUDA
memory matched s·h·32·L within 1%; the paper's eager-attention term had made the estimate twice the measured one."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .backends import backend_classes
from .backends.base import BackendFormula
from .errors import UserError

GIB = 2 ** 30


class PlanError(UserError):
    """Bad planner input; the message names the field and the fix."""


@dataclass(frozen=True)
class ModelSize:
    num_parameters: int
    source: str  # how the count was obtained, for the report
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    dropout: bool = True  # hidden dropout on (the config's probability > 0, or unknown): 1-byte masks kept for backward
    attention_dropout: bool = True


def formulas(mixed: bool) -> list[BackendFormula]:
    """Every backend's model-state bytes per parameter (each backend declares its own), cheapest first."""
    return sorted((formula for backend in backend_classes() for formula in backend.memory_formulas(mixed)),
                  key=lambda formula: formula.preference)


@dataclass
class Estimate:
    backend: str
    flag: str
    params: float
    grads: float
    optimizer: float
    activations: float | None
    host: float  # bytes in CPU memory instead of the device (offload)
    communication: float
    cuda_only: bool
    note: str = ""
    fits: bool | None = None

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def device_total(self) -> float:
        return self.model_states + (self.activations or 0)


@dataclass
class Plan:
    model: ModelSize
    world_size: int
    precision: str
    estimates: list[Estimate]
    device_memory: float | None = None
    activation_formula: str = ""
    notes: list[str] = field(default_factory=list)
    offload: bool = False

    def cheapest_fitting(self) -> Estimate | None:
        return next((e for e in self.estimates if e.fits), None)


ATTENTION = ("sdpa", "eager")


def activation_bytes(size: ModelSize, batch_size: int, seq_length: int, mixed: bool,
                     attention: str = "sdpa") -> float | None:
    """Korthikanti et al. 2022, eq. 1, term by term, bytes per layer with 16-bit activations (fp32: ×2): s·b·h·32 for
    the linear layers, GELU and LayerNorms; + s·b·h·2 for the two dropout masks when dropout is on; eager attention
    adds a·s²·b·2 for the softmax output, + a·s²·b·3 for its dropout mask and output. PyTorch's fused attention
    ("sdpa", flash or memory-efficient) keeps only O(s) statistics and regenerates its dropout mask."""
    if not (size.hidden_size and size.num_layers and size.num_heads):
        return None
    s, b, h, a = seq_length, batch_size, size.hidden_size, size.num_heads
    per_layer = s * b * h * (32 + (2 if size.dropout else 0))
    if attention == "eager":
        per_layer += a * s * s * b * (2 + (3 if size.attention_dropout else 0))
    return size.num_layers * per_layer * (1 if mixed else 2)


def plan(size: ModelSize, world_size: int, precision: str = "fp32", offload: bool = False,
         batch_size: int = 8, seq_length: int = 512, device_memory: float | None = None,
         attention: str = "sdpa") -> Plan:
    """Per-rank bytes for every backend; `device_memory` (bytes) marks which fit and `cheapest_fitting()` names the
    first in order of preference; ZeRO-2 and ZeRO-3 with offload are candidates only with `offload`."""
    problems = []
    if not isinstance(world_size, int) or world_size < 1:
        problems.append(f"--world_size must be a positive integer, got {world_size!r}")
    if precision not in ("fp32", "fp16", "bf16"):
        problems.append(f"precision must be fp32, fp16 or bf16, got {precision!r}")
    if attention not in ATTENTION:
        problems.append(f"--attention must be {' or '.join(ATTENTION)}, got {attention!r}")
    if batch_size < 1 or seq_length < 1:
        problems.append(f"--per_device_train_batch_size ({batch_size}) and --max_seq_length ({seq_length}) must be "
                        "positive")
    if problems:
        raise PlanError("; ".join(problems))
    mixed = precision != "fp32"
    activations = activation_bytes(size, batch_size, seq_length, mixed, attention)
    estimates = []
    for formula in formulas(mixed):
        terms = formula.bytes(size.num_parameters, world_size)
        host = 0.0
        if formula.host_optimizer:
            host = terms["grads"] + terms["optimizer"]
            terms["grads"] = terms["optimizer"] = 0.0
        if formula.host_params:
            host += terms["params"]
            terms["params"] = 0.0
        for part, extra in (formula.extra(size.num_parameters, world_size) if formula.extra else {}).items():
            terms[part] += extra
        estimates.append(Estimate(formula.name, formula.flag, terms["params"], terms["grads"], terms["optimizer"],
                                  activations, host, formula.communication, formula.cuda_only, formula.note))
    if device_memory is not None:
        for estimate in estimates:
            # Offloading trades step time for device memory: a candidate only when asked for (--offload).
            if offload or estimate.host == 0:
                estimate.fits = estimate.device_total <= device_memory
    result = Plan(size, world_size, precision, estimates, device_memory,
                  activation_note(size, attention),
                  offload=offload)
    if activations is None:
        result.notes.append("activations not estimated: the model's hidden size, layers and heads are unknown "
                            "(give a folder or config.json with them)")
    return result


# -- parameter counts ------------------------------------------------------------------------------------------
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def _bert_like(c: dict) -> int:
    h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    embeddings = (vocab + c.get("max_position_embeddings", 512) + c.get("type_vocab_size", 2)) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * inter + inter) + (inter * h + h) + 2 * h
    pooler = h * h + h
    return embeddings + layers * layer + pooler


def _gpt2(c: dict) -> int:
    h, layers, vocab = c["n_embd"], c["n_layer"], c["vocab_size"]
    inner = c.get("n_inner") or 4 * h
    layer = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * inner + inner) + (inner * h + h)
    return (vocab + c.get("n_positions", 1024)) * h + layers * layer + 2 * h


def _llama_like(c: dict) -> int:
    h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads", heads) * head_dim
    q = heads * head_dim
    bias = c.get("attention_bias", c.get("model_type") == "qwen2")
    attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if bias else 0)
    layer = attention + 3 * h * inter + 2 * h
    head = 0 if c.get("tie_word_embeddings", False) else vocab * h
    return vocab * h + layers * layer + h + head


# model_type -> (parameter count from config fields, names of hidden size / layers / heads)
CONFIG_FAMILIES = {
    **{t: (_bert_like, ("hidden_size", "num_hidden_layers", "num_attention_heads"))
       for t in ("bert", "roberta", "xlm-roberta", "camembert")},
    "gpt2": (_gpt2, ("n_embd", "n_layer", "n_head")),
    **{t: (_llama_like, ("hidden_size", "num_hidden_layers", "num_attention_heads"))
       for t in ("llama", "mistral", "qwen2")},
}


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PlanError(f"--model {path}: cannot read it as a JSON model config ({err})") from None
    if not isinstance(config, dict):
        raise PlanError(f"--model {path}: a model config is a JSON object, got {type(config).__name__}")
    return config


def _shape_fields(config: dict) -> dict:
    family = CONFIG_FAMILIES.get(config.get("model_type"))
    names = family[1] if family else ("hidden_size", "num_hidden_layers", "num_attention_heads")
    values = [config.get(name) for name in names]
    return dict(zip(("hidden_size", "num_layers", "num_heads"), values))


def _count_from_config(config: dict, where: str) -> int:
    model_type = config.get("model_type")
    if model_type not in CONFIG_FAMILIES:
        raise PlanError(f"--model {where}: cannot count parameters of model_type {model_type!r} from its config "
                        f"(known: {', '.join(sorted(CONFIG_FAMILIES))}); give the model folder with its "
                        ".safetensors weights, or --num_parameters")
    count, _ = CONFIG_FAMILIES[model_type]
    try:
        return count(config)
    except KeyError as err:
        raise PlanError(f"--model {where}: the config has no {err.args[0]!r}, needed to count a {model_type} "
                        "model's parameters") from None


def safetensors_parameters(path: Path) -> int:
    """Floating-point elements stored in one .safetensors file, read from its JSON header (no tensor data)."""
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise PlanError(f"--model {path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 * 2 ** 20:
            raise PlanError(f"--model {path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(handle.read(length))
        except json.JSONDecodeError as err:
            raise PlanError(f"--model {path}: not a safetensors file ({err})") from None
    # Integer tensors (BERT's position_ids) are buffers, not trained parameters.
    return sum(math.prod(entry["shape"]) for name, entry in header.items()
               if name != "__metadata__" and entry.get("dtype") in FLOAT_DTYPES)


def activation_note(size: ModelSize, attention: str) -> str:
    """How the activations column was computed, for the report."""
    terms = "32" + (" + 2 (dropout masks)" if size.dropout else "")
    attention_term = (f" + a*s^2*b*{5 if size.attention_dropout else 2} (eager attention)" if attention == "eager"
                      else " (fused attention, sdpa: no a*s^2 term; --attention eager adds it)")
    return (f"per layer s*b*h*({terms}) bytes{attention_term}, 16-bit (x2 in fp32); Korthikanti et al. 2022 less "
            "what fused attention and dropout off do not keep")


def _dropout_fields(config: dict) -> dict:
    """Whether the config's hidden and attention dropout are on (unknown: on, the larger estimate)."""
    def on(*names):
        values = [config[name] for name in names if isinstance(config.get(name), (int, float))]
        return not values or any(value > 0 for value in values)

    return {"dropout": on("hidden_dropout_prob", "resid_pdrop", "hidden_dropout", "dropout"),
            "attention_dropout": on("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")}


def model_size(model: str, num_labels: int = 0) -> ModelSize:
    """Parameter count (and shape for activations) of a model folder, a config.json or a .safetensors file.

    A folder's .safetensors weights give the exact count; without them its config.json is counted by formula.
    `num_labels` adds a classification head (hidden×labels + labels), which pretrained checkpoints lack."""
    path = Path(model)
    if not path.exists():
        raise PlanError(f"--model {model}: no such file or folder (give a model folder, its config.json, a "
                        ".safetensors file, or --num_parameters)")
    config_path = path / "config.json" if path.is_dir() else path if path.suffix == ".json" else None
    config = _read_config(config_path) if config_path is not None and config_path.is_file() else {}
    weights = sorted(path.glob("*.safetensors")) if path.is_dir() else [path] if path.suffix == ".safetensors" else []
    if weights:
        count = sum(safetensors_parameters(w) for w in weights)
        source = f"safetensors header{'s' if len(weights) > 1 else ''} of {', '.join(w.name for w in weights)}"
    elif config:
        count = _count_from_config(config, str(config_path))
        source = f"{config.get('model_type')} formula from {config_path.name}"
    elif path.is_dir():
        raise PlanError(f"--model {model}: the folder has neither config.json nor .safetensors weights")
    else:
        raise PlanError(f"--model {model}: expected a model folder, a config.json or a .safetensors file")
    shape = _shape_fields(config)
    if num_labels and shape["hidden_size"]:
        count += shape["hidden_size"] * num_labels + num_labels
        source += f" + classification head ({num_labels} labels)"
    return ModelSize(count, source, **shape, **_dropout_fields(config))


# -- sizes and the report --------------------------------------------------------------------------------------
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_bytes(text: str) -> float:
    """'16GB' -> 16e9, '80GiB' -> 80·2^30, '1.5e9' -> 1.5e9."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise PlanError(f"--device_memory {text!r}: expected a size such as 16GB, 80GiB or 24e9")
    return float(match.group(1)) * _UNITS[unit]


def parse_count(text: str) -> int:
    """'7e9', '7B', '350M', '22713216' -> an integer parameter count."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kKmMbB]?)\s*", str(text))
    if not match:
        raise PlanError(f"--num_parameters {text!r}: expected a count such as 22713216, 350M or 7e9")
    scale = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9}[match.group(2).upper()]
    return int(float(match.group(1)) * scale)


def render(result: Plan) -> str:
    """The plan as a text table (GiB per rank, MiB for small models) with the cheapest fitting backend named last."""
    size = result.model
    largest = max(e.device_total + e.host for e in result.estimates)
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", 2 ** 20)

    def _size(value: float) -> str:
        return f"{value / scale:.2f}"

    header = (f"model: {size.num_parameters:,} parameters ({size.source}); {result.world_size} ranks, "
              f"{result.precision}; {unit} per rank")
    columns = ["backend", "params", "grads", "optimizer", "model states", "activations", "device total",
               "host", "comm", "fits", "flag"]
    rows = []
    for e in result.estimates:
        fits = "yes" if e.fits else "no" if e.fits is not None else "-"
        rows.append([e.backend + (" (CUDA)" if e.cuda_only else ""), _size(e.params), _size(e.grads),
                     _size(e.optimizer), _size(e.model_states),
                     "?" if e.activations is None else _size(e.activations), _size(e.device_total),
                     _size(e.host) if e.host else "0", f"{e.communication:g}x", fits, e.flag])
    widths = [max(len(str(row[i])) for row in [columns, *rows]) for i in range(len(columns))]
    lines = [header, "", "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    lines.append(f"activations: {result.activation_formula}")
    lines.append("comm: communication volume per step relative to DDP's all-reduce (ZeRO paper)")
    lines += [f"{e.backend}: {e.note}" for e in result.estimates if e.note]
    lines += [f"note: {note}" for note in result.notes]
    if result.device_memory is not None and not result.offload and result.cheapest_fitting() is None:
        lines.append("note: without --offload, ZeRO-2 and ZeRO-3 with offload to CPU memory are not considered")
    if result.device_memory is not None:
        best = result.cheapest_fitting()
        if best is None:
            lines.append(f"nothing fits in {_size(result.device_memory)} {unit}: lower --per_device_train_batch_size or "
                         "--max_seq_length, or add ranks")
        else:
            lines.append(f"cheapest that fits in {_size(result.device_memory)} {unit}: {best.backend} "
                         f"({_size(best.device_total)} {unit} per rank): {best.flag}")
    return "\n".join(lines)
