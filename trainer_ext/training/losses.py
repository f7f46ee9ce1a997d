"""Losses that come out the same on any number of ranks: which tokens a model's loss counts, whether a loss is
normalised by transformers' `num_items_in_batch` (learnt inside the first real training step, with no forward of its
own), the evaluation loss of token-level losses weighted by target tokens over the whole evaluation set, and the
logged training loss kept finite on the device (no host read of a step's loss)."""

from __future__ import annotations

import inspect

import torch

from ..integrations import internals

IGNORE_INDEX = -100


def base_model(module):
    """The transformers model inside a PEFT wrapper (LoRA), else the module itself."""
    get_base_model = getattr(module, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else module


def shifts_labels(module) -> bool:
    """Whether the model's loss compares position i's prediction with label i+1 (a decoder-only causal LM, also inside
    PEFT), as transformers' own loss and label smoother decide it."""
    model = base_model(module)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return True
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    return LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss


def token_labels(inputs) -> torch.Tensor | None:
    """The batch's per-token labels (integer, one row per sample), or None when the labels are per sample."""
    labels = inputs.get("labels") if hasattr(inputs, "get") else None
    if not torch.is_tensor(labels) or labels.dim() < 2 or labels.is_floating_point():
        return None
    return labels


def target_counts(inputs, shift: bool) -> torch.Tensor | None:
    """Per sample, the tokens its loss is taken over (labels other than -100, after the shift of a causal LM; a
    padding-free collator's `shift_labels` as given); None for per-sample labels."""
    labels = token_labels(inputs)
    if labels is None:
        return None
    shifted = inputs.get("shift_labels")
    if torch.is_tensor(shifted):
        labels = shifted
    elif shift:
        labels = labels[:, 1:]
    return labels.ne(IGNORE_INDEX).flatten(1).sum(dim=1)


def token_cross_entropy(logits, labels, shift: bool, label_smoothing: float, weight=None, normaliser=None):
    """Cross-entropy over every target token of the batch (fp32): the mean over its target tokens, or their sum over
    `normaliser` (transformers' count of the targets of every rank and accumulated micro-batch)."""
    if logits.dim() > 2:
        if shift:
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        logits, labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
    reduction = "mean" if normaliser is None else "sum"
    loss = torch.nn.functional.cross_entropy(logits.float(), labels.to(logits.device), weight=weight,
                                             ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing,
                                             reduction=reduction)
    return loss if normaliser is None else loss / torch.as_tensor(normaliser, device=loss.device)


def takes_num_items(loss_fn) -> bool:
    """A user's loss_fn that names a `num_items_in_batch` parameter (transformers' compute_loss_func contract): it
    receives the targets of every rank and micro-batch and divides its sum by them."""
    try:
        return "num_items_in_batch" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return False


class NumItemsProbe(torch.Tensor):
    """transformers' `num_items_in_batch` (the same value) that notes whether the loss reads it: any arithmetic on it
    (the division that normalises a token loss, a clamp, `.item()`) counts; moving, copying or asking its shape does
    not. Not a leaf of the autograd graph: FSDP2 threads every input that requires a gradient through an autograd
    function of its own, which would connect it to any loss."""

    read = False  # set when arithmetic consumed a probe (one training step at a time)
    PASSING = frozenset({"to", "cpu", "cuda", "clone", "detach", "contiguous", "view", "reshape", "squeeze",
                         "unsqueeze", "expand", "float", "double", "long", "int", "type", "pin_memory", "__get__",
                         "__repr__", "__format__", "dim", "size", "numel", "element_size", "is_floating_point"})

    @classmethod
    def of(cls, num_items_in_batch) -> NumItemsProbe:
        cls.read = False
        return torch.as_tensor(num_items_in_batch).detach().as_subclass(cls)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in cls.PASSING:
            return super().__torch_function__(func, types, args, kwargs)  # torch's own reads None as no keywords
        cls.read = True
        with internals.torch_function_subclass_disabled():  # the result is a plain tensor: the loss stays one
            return func(*args, **(kwargs or {}))


def finite_for_logging(trainer, loss):
    """transformers' filter of the logged training loss (`--logging_nan_inf_filter`, on by default) done on the device: a
    non-finite step loss counts as the mean of the losses summed since the last log, as transformers counts it, chosen
    by torch.where instead of read on the host after every micro-batch (two syncs a step on a GPU). The loss figures
    reach the host only at a logging step."""
    running = internals.loss_since_last_log(trainer)
    if running is None or not trainer.args.logging_nan_inf_filter or not torch.is_tensor(loss):
        return loss  # outside transformers' loop, or no filter asked for
    summed, steps = running
    try:
        # loss - loss is 0 for a finite loss and NaN for a NaN or an inf, and NaN != NaN: torch.isfinite's answer in
        # two tensor ops (isfinite is four, a comparison with a Python number wraps it in a tensor first)
        difference = loss - loss
        return internals.filtered_on_device(torch.where(difference == difference, loss, summed / steps))
    except RuntimeError:  # a loss on another device than the accumulator: transformers' loop names that mistake
        return loss


def sliced(inputs, count: int, batch_size: int):
    """The batch's first `count` samples (every tensor whose first dimension is the batch)."""
    return type(inputs)({key: value[:count] if torch.is_tensor(value) and value.dim() > 0 and value.size(0) == batch_size
                         else value for key, value in inputs.items()})


class EvaluationLosses:
    """One evaluation's loss for token-level losses: each batch's token mean times its target tokens, summed over the
    whole set and every rank, over the targets. On N ranks accelerate completes the last global batch with copies of
    the first samples (dropped from the gathered predictions); their tokens are left out here too, by evaluating that
    batch's real samples again. Per-sample losses (classifiers) are left to transformers: a mean of batch means of
    equal batches is already exact."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.shift = shifts_labels(trainer.user_model())
        self.total = self.targets = None
        self.token_level = True

    def add(self, inputs, loss, evaluate_first) -> None:
        """A batch's token-mean `loss`; `evaluate_first(n)` evaluates the batch's first n samples (every rank calls it
        together: ZeRO-3 and FSDP gather parameters in each forward)."""
        trainer = self.trainer
        counts = target_counts(inputs, self.shift)
        if counts is None or not self.token_level:
            self.token_level = False
            return
        batch_size = counts.size(0)
        real = batch_size
        if self._padded_batch():  # the same answer on every rank: each evaluates again, with its real samples
            real = max(0, min(batch_size, self.trainer.accelerator.gradient_state.remainder
                              - trainer.args.process_index * batch_size))
            again = evaluate_first(max(real, 1))
            loss = again if real else torch.zeros_like(loss)
        count = counts[:real].sum().to(loss.device, torch.float64)
        product = loss.detach().to(torch.float64) * count
        if trainer.args.logging_nan_inf_filter:  # as transformers drops non-finite batch losses from its mean
            finite = torch.isfinite(product)
            product, count = torch.where(finite, product, 0.0), torch.where(finite, count, 0.0)
        self.total = product if self.total is None else self.total + product
        self.targets = count if self.targets is None else self.targets + count

    def _padded_batch(self) -> bool:
        """Whether the current batch is the last of a set that accelerate padded: it completes the last global batch
        (every rank's batch of the same size, in rank order) with copies, and keeps its first `remainder` samples."""
        state = self.trainer.accelerator.gradient_state
        return (self.trainer.args.world_size > 1 and state.end_of_dataloader and state.remainder is not None
                and state.remainder > 0)

    def loss(self) -> float | None:
        """The token-weighted loss over every rank's batches, or None when the labels were not per token."""
        if not self.token_level or self.total is None:
            return None
        totals = torch.stack([self.total, self.targets])
        if self.trainer.args.world_size > 1:
            totals = self.trainer.accelerator.reduce(totals, reduction="sum")
        total, targets = totals.tolist()
        return total / targets if targets > 0 else None
