"""Predict per-rank training memory for each backend (DDP, DeepSpeed ZeRO-1/2/3, ZeRO-2/3 offload, FairScale `simple`,
`zero_dp_2`, `zero_dp_3`, FSDP2) from a model's parameter count and shape, full fine-tuning or LoRA, and pick the
cheapest one that fits a device; pure (no torch).

Model states follow the ZeRO paper (Rajbhandari et al., 2020, section 3.1) with Ψ parameters on N ranks, Adam:
mixed precision keeps 2Ψ bytes of 16-bit parameters, 2Ψ of 16-bit gradients and 12Ψ of fp32 master weights plus
Adam's two moments; each stage divides its share by N. Under LoRA those terms count the adapter only, and the frozen
base is held in the compute dtype (2 or 4 bytes a parameter) without gradients or optimizer state, divided by N only
where the backend shards parameters (ZeRO-3, FSDP).

Activations of a BERT-style encoder follow Korthikanti et al., 2022 (eq. 1), per layer s·b·h·(34 + 5·a·s/h) bytes
with 16-bit activations (doubled in fp32), less what today's kernels and settings do not keep: with PyTorch's fused
attention (transformers' default "sdpa") no a·s² term, without dropout no masks (s·b·h·32). Measured on one H200
(BERT-large, bf16, dropout off, 384 tokens, batch 8 and 32): the per-sample slope of peak CUDA memory matched
s·h·32·L within 1%; the paper's eager-attention term had made the estimate twice the measured one. Decoder LLMs
(Llama, Mistral, Qwen2: grouped-query attention, SwiGLU, RMSNorm, a large vocabulary) are counted tensor by tensor
from what autograd keeps for backward: see `decoder_activation_bytes`."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .backends import backend_classes
from .backends.base import BackendFormula
from .errors import UserError, closest

GIB = 2 ** 30


class PlanError(UserError):
    """Bad planner input; the message names the field and the fix."""


# A Llama-family decoder layer's linear modules, as peft's target_modules name them: (input, output) features.
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DecoderShape:
    """A decoder LLM of the Llama family (grouped-query attention with rotary embeddings, SwiGLU MLP, RMSNorm, no
    dropout), read from its config.json."""
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    biased: tuple[str, ...] = ()  # the linears built with a bias (_biased_linears: Qwen2's q/k/v, a Llama's flags)

    def parameter_tensors(self, lora: LoRA | None = None) -> list[int]:
        """The elements of each parameter tensor, the adapters' too (what ZeRO-3's persistence threshold reads)."""
        h, layer = self.hidden_size, list(self.linears().values())
        biases = [out for name, (_, out) in self.linears().items() if name in self.biased]
        adapters = [n for name, (fi, fo) in self.linears().items() if lora and name in lora.target_modules
                    for n in (lora.r * fi, lora.r * fo, *([fo] if lora.dora else []))]
        per_layer = [h, h, *(fi * fo for fi, fo in layer), *biases, *adapters]
        saved = [self.vocab_size * h] * len(lora.modules_to_save) if lora else []  # trained copies (modules_to_save)
        return [self.vocab_size * h, *per_layer * self.num_layers, h,
                *([] if self.tied_embeddings else [self.vocab_size * h]), *saved]

    def linears(self) -> dict[str, tuple[int, int]]:
        """Each decoder layer's Linear modules: name -> (input features, output features)."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass(frozen=True)
class LoRA:
    """LoRA adapters (peft) of rank `r` on `target_modules` of every layer; the base model frozen."""
    r: int
    target_modules: tuple[str, ...]
    dropout: float = 0.0  # peft's lora_dropout: > 0 keeps a dropped copy of each targeted module's input and its mask
    dora: bool = False  # weight-decomposed (use_dora): a trained magnitude per output feature, two outputs kept
    modules_to_save: tuple[str, ...] = ()  # embed_tokens / lm_head trained whole (peft keeps the frozen original too)
    quantized: bool = False  # QLoRA: the frozen base's decoder linears in 4-bit NF4 (bitsandbytes)


@dataclass(frozen=True)
class ModelSize:
    num_parameters: int
    source: str  # how the count was obtained, for the report
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    dropout: bool = True  # hidden dropout on (the config's probability > 0, or unknown): 1-byte masks kept for backward
    attention_dropout: bool = True
    decoder: DecoderShape | None = None  # a decoder LLM's shape: its activations are counted tensor by tensor


def lora_parameters(shape: DecoderShape, lora: LoRA) -> int:
    """Trainable parameters of LoRA adapters: r·(in + out) for each targeted Linear(in, out) of each layer, + out for
    DoRA's magnitude, + the vocabulary × hidden copy of each module to save (embed_tokens, lm_head)."""
    adapters = shape.num_layers * sum(lora.r * (features_in + features_out) + (features_out if lora.dora else 0)
                                      for name, (features_in, features_out) in shape.linears().items()
                                      if name in lora.target_modules)
    return adapters + len(lora.modules_to_save) * shape.vocab_size * shape.hidden_size


def decoder_linear_parameters(shape: DecoderShape) -> int:
    """The decoder layers' Linear weights (what 4-bit quantization stores in NF4; embeddings, norms and lm_head stay)."""
    return shape.num_layers * sum(fi * fo for fi, fo in shape.linears().values())


# bitsandbytes' NF4: half a byte a weight, plus one fp32 scale (absmax) a block of 64.
NF4_BYTES = 0.5 + 4 / 64
SAVABLE = ("embed_tokens", "lm_head")


def lora_settings(shape: DecoderShape | None, r: int, target_modules: str | None = None, dropout: float = 0.0,
                  dora: bool = False, modules_to_save: str | None = None, quantized: bool = False) -> LoRA:
    """A LoRA from the CLI's values, checked against the model's module names ("all-linear" as peft reads it); without
    target modules, peft's default for the family (q_proj and v_proj)."""
    if shape is None:
        raise PlanError("--lora_r needs the model's layers: give --model with a config.json of model_type "
                        f"{', '.join(DECODER_TYPES)} (not --num_parameters)")
    if not isinstance(r, int) or r < 1:
        raise PlanError(f"--lora_r {r}: the adapters' rank must be a positive integer, such as 8 or 16")
    if not 0 <= dropout < 1:
        raise PlanError(f"--lora_dropout {dropout}: a probability from 0 (peft's default) to below 1, such as 0.05")
    names = [name.strip() for name in (target_modules or "q_proj,v_proj").split(",") if name.strip()]
    if names == ["all-linear"]:
        names = list(DECODER_LINEARS)
    unknown = [name for name in names if name not in DECODER_LINEARS]
    if unknown or not names:
        hints = [f"{name} (did you mean {hint}?)" if (hint := closest(name, DECODER_LINEARS)) else name
                 for name in unknown]
        verb = "is not a module" if len(hints) == 1 else "are not modules"
        what = f"{', '.join(hints)} {verb} of a {shape.model_type} layer" if hints else "no module named"
        raise PlanError(f"--lora_target_modules {target_modules!r}: {what}; choose among "
                        f"{', '.join(DECODER_LINEARS)}, or all-linear")
    saved = tuple(dict.fromkeys(name.strip() for name in (modules_to_save or "").split(",") if name.strip()))
    if unknown := [name for name in saved if name not in SAVABLE]:
        raise PlanError(f"--lora_modules_to_save {modules_to_save!r}: the planner counts {' and '.join(SAVABLE)} "
                        f"(the embeddings new tokens need), not {', '.join(unknown)}")
    return LoRA(r, tuple(dict.fromkeys(names)), dropout, dora, saved, quantized)


@dataclass(frozen=True)
class DecoderActivations:
    """A decoder's activation bytes at the two moments that can be a training step's peak (decoder_activation_bytes):
    the cross entropy's backward, when everything kept in the forward is still held, and, with checkpointing, a
    layer's recomputation."""
    layers: float  # what the layers keep (with checkpointing: their inputs)
    head: float  # token ids, final RMSNorm, lm_head's input
    loss: float  # log-softmax's output, the two gradients of its backward, the targets
    recomputed_layer: float = 0.0  # checkpointing: one layer's tensors while it is recomputed

    @property
    def peak(self) -> float:
        return self.layers + max(self.head + self.loss, self.recomputed_layer)


def formulas(mixed: bool) -> list[BackendFormula]:
    """Every backend's model-state bytes per parameter (each backend declares its own), cheapest first."""
    return sorted((formula.at_precision(mixed) for backend in backend_classes()
                   for formula in backend.memory_formulas), key=lambda formula: formula.preference)


@dataclass
class Estimate:
    backend: str
    flag: str
    params: float  # trainable parameters as the backend holds them, plus a LoRA's frozen base
    grads: float
    optimizer: float
    activations: float | None
    host: float  # bytes in CPU memory instead of the device (offload)
    communication: float
    cuda_only: bool
    note: str = ""
    fits: bool | None = None  # None: not considered (offload not asked for), or its activations are unknown
    considered: bool = False  # weighed against the device's memory

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
    trainable_parameters: int = 0
    lora: LoRA | None = None
    gradient_checkpointing: bool = False
    seq_length: int = 0
    batch_size: int = 0
    activation_terms: DecoderActivations | None = None  # a decoder's, for the rows without autocast

    def cheapest_fitting(self) -> Estimate | None:
        return next((e for e in self.estimates if e.fits), None)

    def cheapest_states_fitting(self) -> Estimate | None:
        """Without activations (the model's shape unknown) nothing is called a fit: the cheapest whose model states
        alone fit, and so might."""
        return next((e for e in self.estimates if e.fits is None and e.activations is None and e.considered), None)


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


def decoder_activation_bytes(shape: DecoderShape, batch_size: int, seq_length: int, compute_bytes: int,
                             autocast: bool = False, lora: LoRA | None = None, checkpointing: bool = False,
                             attention: str = "sdpa", linears_keep_inputs: bool = False,
                             dropout_mask_bytes: float = 1, chunked_loss: bool = False) -> DecoderActivations:
    """Peak bytes of a Llama-family decoder's activations in a training step, term by term: each is a tensor a torch op
    keeps for backward in transformers' LlamaForCausalLM, for b sequences of s tokens packed without padding (t = b·s
    tokens). Checked tensor by tensor (torch's saved-tensor hooks, deduplicated by storage) on CPU in
    tests/integration/test_planner.py: exact for fp32, 16-bit and autocast, sdpa and eager, full, LoRA and
    checkpointing.

    Shapes: h hidden, q = heads·head_dim and kv = kv_heads·head_dim (grouped-query attention), i intermediate, a
    heads, V vocabulary, L layers, r the LoRA rank; c is the compute dtype's bytes (2 for bf16/fp16, 4 for fp32) and
    e the residual stream's: c, except 4 under torch autocast over fp32 weights (DDP and `simple` in mixed precision,
    full fine-tuning: the embeddings' output is fp32). Per token, a layer keeps:
      each of its 2 RMSNorms (when its input needs a gradient): the input in fp32 (4h: the upcast copy, or the fp32
        input itself) and 1/rms (4); the normalised output (e·h) only when the norm's weight is trained (not LoRA);
      q/k/v projections: their common input (e·h), once, when one of them is trained; under autocast each trained
        one keeps its own 16-bit copy (2h apiece), as do gate_proj and up_proj of theirs;
      rotary embeddings: the products keep cos and sin only (2·s·head_dim·e bytes once per forward);
      sdpa attention (flash: no a·s² term): q and k after rotary, v, its output and the fp32 log-sum-exp:
        c·(2q + 2kv) + 4a, the output being o_proj's input too; eager attention instead keeps, as QKᵀ and P·V keep
        each side for the other's gradient, q and k, v repeated to every head (c·3q), the fp32 softmax (4·a·s) and its
        16-bit copy (c·a·s, mixed precision only), and o_proj's input (c·q);
      SwiGLU: gate_proj's output (SiLU's input), SiLU's output and up_proj's output (the product's inputs): 3c·i,
        and down_proj's input (c·i) when down_proj is trained;
      LoRA: each targeted module's rank-r activation (c·r, kept by lora_B); lora_A keeps the module's input (shared as
        above), but its own copy under autocast (peft casts it to the fp32 adapter, autocast back to 16 bits: c·in)
        and, with lora_dropout, its dropped copy and mask ((c + 1)·in, CUDA's mask being 1 byte); frozen projections
        keep no input (except under DeepSpeed's ZeRO-3 Linear: `linears_keep_inputs`);
      under autocast, 16-bit copies of the trained weights (2 bytes a parameter, cached by autocast).
      DoRA: each targeted module's base output and adapter output (2·c·out), which the magnitude's scaling keeps
        (peft's identity matrix and weight product serve a detached norm and are freed in the forward);
    A tensor no gradient flows through keeps nothing: under LoRA without checkpointing the first layer's input needs
    no gradient (frozen embeddings, unless trained whole: modules_to_save), so its input RMSNorm keeps nothing, and of
    a product only the side whose partner needs a gradient is kept. Outside the layers (head), per token: the token
    ids (8, for the embeddings' gradient) when trained, the final RMSNorm, lm_head's input (e·h, its own 2h copy under
    autocast, and a 16-bit copy of lm_head's weight) when trained. The loss, per token: log-softmax's fp32 output
    (4V), kept by the cross entropy, and the int64 targets (8); its backward then holds the gradient it receives and
    the one it returns, fp32 too: 12V in all, the largest term for a large vocabulary. The 16-bit logits (c·V, what
    the model returns) and their fp32 upcast (4V, transformers' ForCausalLMLoss `logits.float()`) exist only during
    the forward: at most 10V with the 4V kept, less than the backward's 12V, and freed by then. With `chunked_loss`
    (ExtTrainer's default, training/chunked_loss.py) the loss keeps per token only a copy of lm_head's input (e·h) and
    the targets (8), and at its peak one chunk of C tokens is recomputed in backward: its logits (c), their fp32 copy
    (4, mixed precision), log-softmax's output and its backward's two gradients (12): (12 + c [+ 4])·C·V, C =
    training.chunked_loss.chunk_tokens(V) (261 tokens at 128k: 0.6 GiB in bf16), whatever the batch.

    Without checkpointing the peak is the cross entropy's backward: layers + head + loss. With checkpointing
    (transformers' gradient checkpointing) each layer keeps only its input (e·h per token), and the peak is the larger
    of that moment and a layer's recomputation (the loss's tensors are freed by then): layer inputs + max(head + loss,
    one layer). Not counted, as in Korthikanti et al.: the layers' gradient buffers, and scalars."""
    h, i, a, d = shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.head_dim
    q, kv, vocab, s = shape.num_heads * d, shape.num_kv_heads * d, shape.vocab_size, seq_length
    tokens = batch_size * seq_length
    c, mixed, full = compute_bytes, compute_bytes < 4, lora is None
    autocast = autocast and mixed
    stream = 4 if (not mixed or (autocast and full)) else c
    trained = set(DECODER_LINEARS) if full else set(lora.target_modules)
    embeddings_trained = full or "embed_tokens" in lora.modules_to_save
    head_trained = full or "lm_head" in lora.modules_to_save

    def norm() -> float:
        return 4 * h + 4 + (stream * h if full else 0)

    def kept_input(modules, features: int, dtype_bytes: int, kept_already: bool, casts_under_autocast: bool,
                   input_grad: bool) -> float:
        """What `modules` keep of their common input (`features` a token): the trained ones, or all of them where
        every Linear keeps its input (when that input needs a gradient)."""
        count = len(trained & set(modules))
        dropout = not full and lora.dropout > 0
        copies = dropout or (autocast and (not full or casts_under_autocast))
        kept = count * (c + (dropout_mask_bytes if dropout and input_grad else 0)) * features if copies else 0
        shared = (count and not copies) or (linears_keep_inputs and input_grad)
        return kept + (dtype_bytes * features if shared and not kept_already else 0)

    def layer(input_grad: bool) -> float:
        """Bytes one layer keeps for the step's tokens; `input_grad`: whether its input needs a gradient."""
        grad = {name: input_grad or name in trained for name in ("q_proj", "k_proj", "v_proj")}
        attention_grad = any(grad.values())
        kept = norm() if input_grad else 0
        kept += kept_input(("q_proj", "k_proj", "v_proj"), h, stream, False, True, input_grad)
        if attention == "sdpa":
            kept += c * (2 * q + 2 * kv) + 4 * a if attention_grad else 0
        else:  # QKᵀ and P·V keep each side for the other's gradient; softmax keeps its fp32 output
            scores_grad = grad["q_proj"] or grad["k_proj"]
            kept += c * q * (grad["k_proj"] + grad["q_proj"] + scores_grad)
            kept += 4 * a * s if scores_grad or (grad["v_proj"] and not mixed) else 0
            kept += c * a * s if mixed and grad["v_proj"] else 0
        kept += kept_input(("o_proj",), q, c, attention == "sdpa" and attention_grad, False, attention_grad)
        stream_grad = attention_grad or "o_proj" in trained
        kept += norm() if stream_grad else 0
        kept += kept_input(("gate_proj", "up_proj"), h, stream, False, True, stream_grad)
        gate_grad, up_grad = stream_grad or "gate_proj" in trained, stream_grad or "up_proj" in trained
        kept += c * i * (2 * gate_grad + up_grad)  # SiLU keeps its input; the product each side for the other's
        kept += kept_input(("down_proj",), i, c, False, False, gate_grad or up_grad)
        kept += 0 if full else c * lora.r * len(trained)
        if not full and lora.dora:  # the magnitude's scaling keeps the base output and the adapter's output
            kept += 2 * c * sum(fo for name, (_, fo) in shape.linears().items() if name in trained)
        if not autocast:
            return kept * tokens
        # autocast keeps the 16-bit copy of a weight where the Linear's input needs a gradient (lora_B's always)
        input_grads = {"q_proj": input_grad, "k_proj": input_grad, "v_proj": input_grad, "o_proj": attention_grad,
                       "gate_proj": stream_grad, "up_proj": stream_grad, "down_proj": gate_grad or up_grad}
        copies = sum(fi * fo if full else lora.r * (fi * input_grads[name] + fo)
                     for name, (fi, fo) in shape.linears().items() if name in trained)
        return kept * tokens + 2 * copies

    rotary = 2 * s * d * stream
    head = norm() + ((8 + (2 if autocast else stream) * h) if full else
                     (8 if embeddings_trained else 0) + (stream * h if head_trained or linears_keep_inputs else 0))
    head_bytes = head * tokens + (2 * vocab * h if full and autocast else 0)
    if chunked_loss:
        from .training.chunked_loss import chunk_tokens

        loss = (stream * h + 8) * tokens + (12 + c + (4 if mixed else 0)) * min(tokens, chunk_tokens(vocab)) * vocab
    else:
        loss = (12 * vocab + 8) * tokens
    if checkpointing:  # an fp32 stream: the recomputed first RMSNorm keeps the very input the checkpoint holds
        recomputed = layer(True) + rotary - (4 * h * tokens if stream == 4 else 0)
        return DecoderActivations(shape.num_layers * stream * h * tokens, head_bytes, loss, recomputed)
    layers = layer(embeddings_trained) + (shape.num_layers - 1) * layer(True) + rotary
    return DecoderActivations(layers, head_bytes, loss)


def plan(size: ModelSize, world_size: int, precision: str = "fp32", offload: bool = False,
         batch_size: int = 8, seq_length: int = 512, device_memory: float | None = None,
         attention: str = "sdpa", lora: LoRA | None = None, gradient_checkpointing: bool = False,
         chunked_loss: bool = True) -> Plan:
    """Per-rank bytes for every backend; `device_memory` (bytes) marks which fit and `cheapest_fitting()` names the
    first in order of preference; ZeRO-2 and ZeRO-3 with offload are candidates only with `offload`. `seq_length` is
    the packed length: each rank's batch is `batch_size` sequences of that many tokens. `chunked_loss`: ExtTrainer's
    loss through lm_head a chunk at a time (its default; --chunked_loss false builds the whole logits)."""
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
    if lora is not None and size.decoder is None:
        problems.append("LoRA needs the model's layers: give --model with a config.json of model_type "
                        f"{', '.join(DECODER_TYPES)}")
    if problems:
        raise PlanError("; ".join(problems))
    mixed = precision != "fp32"
    compute_bytes = 2 if mixed else 4
    trainable = lora_parameters(size.decoder, lora) if lora else size.num_parameters
    frozen = size.num_parameters if lora else 0
    # The frozen base's bytes: the compute dtype, or NF4 for the decoder linears of a 4-bit base.
    quantized = decoder_linear_parameters(size.decoder) if lora and lora.quantized else 0
    frozen_bytes = (frozen - quantized) * compute_bytes + quantized * NF4_BYTES

    def activations(formula: BackendFormula) -> float | None:
        if size.decoder is not None:
            return decoder_activation_bytes(size.decoder, batch_size, seq_length, compute_bytes, formula.autocast,
                                            lora, gradient_checkpointing, attention,
                                            formula.linears_keep_inputs, chunked_loss=chunked_loss).peak
        per_model = activation_bytes(size, batch_size, seq_length, mixed, attention)
        if per_model is None or not gradient_checkpointing:
            return per_model
        # Each layer keeps its input (s·b·h in the compute dtype); one layer's activations exist while recomputed.
        return (size.num_layers * seq_length * batch_size * size.hidden_size * compute_bytes
                + per_model / size.num_layers)

    estimates = []
    for formula in formulas(mixed):
        terms = formula.bytes(trainable, world_size)
        # A LoRA's frozen base: compute-dtype weights, no gradient, no optimizer state; sharded only with the rest.
        terms["params"] += frozen_bytes / (world_size if formula.frozen_sharded else 1)
        host = 0.0
        if formula.host_optimizer:
            host = terms["grads"] + terms["optimizer"]
            terms["grads"] = terms["optimizer"] = 0.0
        if formula.host_params:
            host += terms["params"]
            terms["params"] = 0.0
        extras = formula.extra(trainable, world_size, trainable + frozen, compute_bytes) if formula.extra else {}
        for part, extra in extras.items():
            terms[part] += extra
        if formula.whole_below and size.decoder is not None:
            threshold = formula.whole_below(size.decoder.hidden_size)
            terms["params"] += compute_bytes * sum(n for n in size.decoder.parameter_tensors(lora) if n < threshold)
        estimates.append(Estimate(formula.name, formula.flag, terms["params"], terms["grads"], terms["optimizer"],
                                  activations(formula), host, formula.communication, formula.cuda_only,
                                  formula.note))
    if device_memory is not None:
        for estimate in estimates:
            # Offloading trades step time for device memory: a candidate only when asked for (--offload).
            if offload or estimate.host == 0:
                estimate.considered = True
                # Model states alone over the device: no fit. Under it with activations unknown: not known.
                fits = estimate.device_total <= device_memory
                estimate.fits = fits if estimate.activations is not None or not fits else None
    result = Plan(size, world_size, precision, estimates, device_memory,
                  activation_note(size, attention, lora, gradient_checkpointing, mixed, chunked_loss), offload=offload,
                  trainable_parameters=trainable, lora=lora,
                  gradient_checkpointing=gradient_checkpointing, seq_length=seq_length, batch_size=batch_size)
    if estimates[0].activations is None:
        result.notes.append("activations not estimated: the model's hidden size, layers and heads are unknown "
                            "(give a folder or config.json with them)")
    if size.decoder is not None:
        result.activation_terms = decoder_activation_bytes(size.decoder, batch_size, seq_length, compute_bytes, False,
                                                           lora, gradient_checkpointing, attention,
                                                           chunked_loss=chunked_loss)
        if attention == "eager" and size.attention_dropout:
            result.notes.append("the config's attention_dropout > 0: eager attention's dropout masks are not counted")
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


DECODER_TYPES = ("llama", "mistral", "qwen2")  # one decoder layer: GQA + rotary, SwiGLU, RMSNorm, no dropout


def _llama_like(c: dict) -> int:
    h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads", heads) * head_dim
    q = heads * head_dim
    outputs = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h, "gate_proj": inter, "up_proj": inter,
               "down_proj": h}
    attention = h * q + 2 * h * kv + q * h
    layer = attention + 3 * h * inter + 2 * h + sum(outputs[name] for name in _biased_linears(c))
    head = 0 if c.get("tie_word_embeddings", False) else vocab * h
    return vocab * h + layers * layer + h + head


# model_type -> (parameter count from config fields, names of hidden size / layers / heads)
CONFIG_FAMILIES = {
    **{t: (_bert_like, ("hidden_size", "num_hidden_layers", "num_attention_heads"))
       for t in ("bert", "roberta", "xlm-roberta", "camembert")},
    "gpt2": (_gpt2, ("n_embd", "n_layer", "n_head")),
    **{t: (_llama_like, ("hidden_size", "num_hidden_layers", "num_attention_heads")) for t in DECODER_TYPES},
}


def _decoder_shape(config: dict) -> DecoderShape | None:
    """A Llama-family config's shape; None for another family or a config without the fields it needs."""
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    if config.get("model_type") not in DECODER_TYPES or not all(isinstance(config.get(f), int) for f in needed):
        return None
    h, heads = config["hidden_size"], config["num_attention_heads"]
    return DecoderShape(config["model_type"], h, config["num_hidden_layers"], heads,
                        config.get("num_key_value_heads") or heads, config.get("head_dim") or h // heads,
                        config["intermediate_size"], config["vocab_size"], bool(config.get("tie_word_embeddings")),
                        _biased_linears(config))


def _biased_linears(config: dict) -> tuple[str, ...]:
    """The decoder linears transformers builds with a bias: Qwen2's q/k/v always (its attention_bias is not read);
    a Llama's four attention projections with attention_bias and its three MLP ones with mlp_bias; Mistral's none."""
    model_type = config.get("model_type")
    if model_type == "qwen2":
        return ("q_proj", "k_proj", "v_proj")
    if model_type != "llama":
        return ()
    return ((("q_proj", "k_proj", "v_proj", "o_proj") if config.get("attention_bias") else ())
            + (("gate_proj", "up_proj", "down_proj") if config.get("mlp_bias") else ()))


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


def activation_note(size: ModelSize, attention: str, lora: LoRA | None = None, checkpointing: bool = False,
                    mixed: bool = False, chunked_loss: bool = False) -> str:
    """How the activations column was computed, for the report."""
    if size.decoder is not None:
        shape = size.decoder
        kept = ("RMSNorm inputs in fp32, q/k/v after rotary and the attention output"
                + (", the fp32 softmax a*s" if attention == "eager" else " (sdpa: no a*s^2 term)")
                + ", SwiGLU's 3 intermediates, the inputs of the trained projections"
                + (f", each adapter's rank-{lora.r} activation" if lora else ""))
        checkpoints = ("; checkpointing: each layer keeps its input, the peak is the larger of the loss's backward "
                       "and one layer's recomputation" if checkpointing else "")
        logits = "the 16-bit logits and their fp32 upcast live" if mixed else "the fp32 logits live"
        if chunked_loss:
            from .training.chunked_loss import chunk_tokens

            loss = (f"the loss, chunked (ExtTrainer's default): lm_head's input and the targets per token, and one "
                    f"chunk of {chunk_tokens(shape.vocab_size)} tokens' logits, log-softmax and gradients at a time "
                    f"(V = {shape.vocab_size:,}; --chunked_loss false: 12V bytes a token)")
        else:
            loss = (f"the loss: log-softmax's fp32 output and its backward's two fp32 gradients, 12V bytes with V = "
                    f"{shape.vocab_size:,} ({logits} only in the forward)")
        return (f"decoder LLM ({shape.model_type}, {attention}), per token: what autograd keeps of each layer "
                f"({kept}); {loss}{checkpoints}; autocast rows (ddp, simple) "
                "keep fp32 norms and 16-bit copies of projection inputs and weights; terms: "
                "trainer_ext.planner.decoder_activation_bytes")
    terms = "32" + (" + 2 (dropout masks)" if size.dropout else "")
    attention_term = (f" + a*s^2*b*{5 if size.attention_dropout else 2} (eager attention)" if attention == "eager"
                      else " (fused attention, sdpa: no a*s^2 term; --attention eager adds it)")
    checkpoints = "; checkpointing: each layer keeps its input (s*b*h) and one layer is recomputed at a time"
    return (f"per layer s*b*h*({terms}) bytes{attention_term}, 16-bit (x2 in fp32); Korthikanti et al. 2022 less "
            "what fused attention and dropout off do not keep" + (checkpoints if checkpointing else ""))


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
    dropout = _dropout_fields(config)
    decoder = _decoder_shape(config)
    if decoder is not None:  # LlamaConfig's default attention_dropout is 0
        dropout = {"dropout": False, "attention_dropout": (config.get("attention_dropout") or 0) > 0}
    return ModelSize(count, source, **shape, **dropout, decoder=decoder)


# -- sizes and the report --------------------------------------------------------------------------------------
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_bytes(text: str) -> float:
    """'16GB' -> 16e9, '80GiB' -> 80·2^30, '1.5e9' -> 1.5e9."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise PlanError(f"--device_memory {text!r}: expected a size such as 16GB, 80GiB or 24e9")
    size = float(match.group(1)) * _UNITS[unit]
    if size <= 0:
        raise PlanError(f"--device_memory {text!r}: a device has more than 0 bytes; give its memory, e.g. 16GB or "
                        "80GiB")
    if not unit and size < 2 ** 20:  # '80' read as 80 bytes: nothing fits, and the plan said so as if it were true
        raise PlanError(f"--device_memory {text!r} reads as {size:g} bytes: give the unit, e.g. {text}GB or "
                        f"{text}GiB")
    return size


def parse_count(text: str) -> int:
    """'7e9', '7B', '350M', '22713216' -> an integer parameter count."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kKmMbB]?)\s*", str(text))
    if not match:
        raise PlanError(f"--num_parameters {text!r}: expected a count such as 22713216, 350M or 7e9")
    scale = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9}[match.group(2).upper()]
    count = int(float(match.group(1)) * scale)
    if count < 1:  # 0 planned every backend at 0 bytes and named one as fitting
        raise PlanError(f"--num_parameters {text!r}: a model has at least one parameter; give its count, e.g. "
                        "22713216, 350M or 7e9")
    return count


def render(result: Plan) -> str:
    """The plan as a text table (GiB per rank, MiB for small models) with the cheapest fitting backend named last."""
    size = result.model
    largest = max(e.device_total + e.host for e in result.estimates)
    unit, scale = ("GiB", GIB) if largest >= GIB else ("MiB", 2 ** 20)

    def _size(value: float) -> str:
        return f"{value / scale:.2f}"

    header = (f"model: {size.num_parameters:,} parameters ({size.source}); {result.world_size} ranks, "
              f"{result.precision}; {unit} per rank")
    if result.lora:
        lora = result.lora
        kind = "DoRA" if lora.dora else "LoRA"
        saved = f", {' and '.join(lora.modules_to_save)} trained whole" if lora.modules_to_save else ""
        base = "4-bit NF4 (decoder linears), the rest in " if lora.quantized else ""
        header += (f"\ntrainable: {result.trainable_parameters:,} parameters ({kind} r={lora.r} on "
                   f"{', '.join(lora.target_modules)}{saved}; the base frozen in {base}"
                   f"{'fp32' if result.precision == 'fp32' else result.precision})")
    else:
        header += f"\ntrainable: {result.trainable_parameters:,} parameters (full fine-tuning)"
    header += (f"\nper rank and step: batch {result.batch_size} x {result.seq_length} tokens (the packed length)"
               + (", gradient checkpointing" if result.gradient_checkpointing else ""))
    columns = ["backend", "params", "grads", "optimizer", "model states", "activations", "device total",
               "host", "comm", "fits", "flag"]
    rows = []
    for e in result.estimates:
        fits = "yes" if e.fits else "no" if e.fits is not None else "?" if e.considered else "-"
        rows.append([e.backend + (" (CUDA)" if e.cuda_only else ""), _size(e.params), _size(e.grads),
                     _size(e.optimizer), _size(e.model_states),
                     "?" if e.activations is None else _size(e.activations), _size(e.device_total),
                     _size(e.host) if e.host else "0", f"{e.communication:g}x", fits, e.flag])
    widths = [max(len(str(row[i])) for row in [columns, *rows]) for i in range(len(columns))]
    lines = [header, "", "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    lines.append(f"activations: {result.activation_formula}")
    if result.activation_terms is not None:
        terms = result.activation_terms
        rows = ", ".join(e.backend for e in result.estimates if e.activations == terms.peak)
        recomputed = (f"the larger of (head {_size(terms.head)} + loss {_size(terms.loss)}) and a recomputed layer "
                      f"{_size(terms.recomputed_layer)}" if result.gradient_checkpointing
                      else f"head {_size(terms.head)} + loss {_size(terms.loss)}")
        lines.append(f"activations of {rows}: layers {_size(terms.layers)} + {recomputed} = {_size(terms.peak)} "
                     f"{unit}")
    lines.append("comm: communication volume per step relative to DDP's all-reduce (ZeRO paper)")
    lines += [f"{e.backend}: {e.note}" for e in result.estimates if e.note]
    lines += [f"note: {note}" for note in result.notes]
    states = result.cheapest_states_fitting() if result.device_memory is not None else None
    if result.device_memory is not None and not result.offload and result.cheapest_fitting() is None and not states:
        lines.append("note: without --offload, ZeRO-2 and ZeRO-3 with offload to CPU memory are not considered")
    if states is not None:
        lines.append(f"nothing is called a fit in {_size(result.device_memory)} {unit} without the activations: the "
                     f"cheapest whose model states fit is {states.backend} ({_size(states.model_states)} {unit} per "
                     f"rank, {_size(result.device_memory - states.model_states)} {unit} left for the activations); "
                     "give --model (the model's folder or config.json) to know what fits")
    elif result.device_memory is not None:
        best = result.cheapest_fitting()
        if best is None:
            lines.append(f"nothing fits in {_size(result.device_memory)} {unit}: lower --per_device_train_batch_size or "
                         "--max_seq_length, or add ranks" + ("" if result.gradient_checkpointing or
                                                             result.estimates[0].activations is None
                                                             else ", or --gradient_checkpointing"))
        else:
            lines.append(f"cheapest that fits in {_size(result.device_memory)} {unit}: {best.backend} "
                         f"({_size(best.device_total)} {unit} per rank): {best.flag}")
    return "\n".join(lines)
