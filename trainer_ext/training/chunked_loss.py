"""A causal LM's cross-entropy that never builds the whole logits: the hidden states of the target tokens go through
the model's own lm_head a chunk of tokens at a time, each chunk's loss summed, and each chunk recomputed in backward
(activation checkpointing), so a step holds one chunk's logits instead of the (batch, sequence, vocabulary) ones,
their log-softmax and both gradients (12 bytes a token and vocabulary entry in fp32: 6 GiB for one sequence of 4,096
tokens of Llama 3's 128k vocabulary).

The chunks run inside lm_head's forward, called by the model as usual: its module hooks fire, so ZeRO-3 gathers the
head's weight for the forward and again for the recomputation in backward, FSDP2 keeps it unsharded with the rest of
the model's own group, peft's wrappers (LoRA on the head, modules_to_save copies) run their own forward per chunk.
What lm_head returns is the loss; a model whose forward changes the logits after lm_head (soft-capping, scaling) is
found at the first step and named (those must build their logits: --chunked_loss false)."""

from __future__ import annotations

from ..errors import UserError

CHUNK_BYTES = 128 * 2 ** 20  # one chunk's fp32 logits; its backward holds about four such tensors (the planner's term)
CHUNKED_LOSS_OFF = "pass --chunked_loss false (the loss is then taken over the whole logits)"


class ChunkedLossError(UserError):
    """A model whose forward must build its logits (the message names the flag that turns chunking off)."""


def output_head(module):
    """The module the model's forward calls for its logits (lm_head), also inside a PEFT wrapper; None if it has
    none."""
    import torch

    from .losses import base_model

    model = base_model(module)
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, torch.nn.Module) else None


def calls_layers_with_parameters(head) -> bool:
    """Whether the head's forward runs layers of its own that hold parameters (a peft wrapper), not only its own
    weight."""
    return any(next(child.parameters(), None) is not None for child in head.children())


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk: as many as keep one chunk's fp32 logits within CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (4 * max(vocab_size, 1)))


class ChunkedHead:
    """Within this block, a call of `head` with hidden states (batch, sequence, hidden) returns the summed
    cross-entropy of `targets` (a causal LM's labels, `shifted` by one against the hidden states, or a padding-free
    collator's shift_labels as they are) as a (1, 1, 1) tensor, computed `chunk_size` target tokens at a time.
    `label_smoothing` as torch's cross_entropy reads it."""

    def __init__(self, head, targets, shifted: bool, chunk_size: int, label_smoothing: float = 0.0,
                 agree_on_chunks=None):
        from .losses import IGNORE_INDEX

        self.head, self.targets, self.shifted, self.label_smoothing = head, targets, shifted, label_smoothing
        self.chunk_size = chunk_size
        # Where the target tokens are: the one read of the device in this loss (how many), taken here, before the
        # model's forward is queued, when the GPU has only the batch's copy behind it; selecting them later by a mask
        # would wait for the whole forward, twice.
        self.rows, self.columns = targets.ne(IGNORE_INDEX).nonzero(as_tuple=True)
        # A head whose layers hold the parameters (peft's modules_to_save copy, LoRA on lm_head) is called per chunk
        # through them: under ZeRO-3 (or an FSDP unit inside) each call gathers their weights, so every rank must make
        # the same number of calls. `agree_on_chunks(count)`: the largest count of any rank (a collective).
        self.agree_on_chunks = agree_on_chunks if calls_layers_with_parameters(head) else None
        self.calls, self.returned = 0, None
        self._own_forward = None

    def __enter__(self):
        self._own_forward = self.head.__dict__.get("forward")
        self.head.forward = self.forward  # an instance attribute: nn.Module.__call__ runs the hooks, then this
        return self

    def __exit__(self, *exc):
        if self._own_forward is None:
            del self.head.forward
        else:
            self.head.forward = self._own_forward
        return False

    def forward(self, hidden, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        self.calls += 1
        if args or kwargs or hidden.dim() != 3:
            raise ChunkedLossError(f"--chunked_loss: {type(self.head).__name__} was called with other inputs than one "
                                   f"(batch, sequence, hidden) tensor; {CHUNKED_LOSS_OFF}")
        positions = (hidden.shape[0], hidden.shape[1] - 1 if self.shifted else hidden.shape[1])
        if positions != tuple(self.targets.shape):
            raise ChunkedLossError(f"--chunked_loss: the model gave {type(self.head).__name__} hidden states of "
                                   f"{positions} positions for labels of {tuple(self.targets.shape)}; "
                                   f"{CHUNKED_LOSS_OFF}")
        rows, columns = self.rows.to(hidden.device), self.columns.to(hidden.device)
        # only the target tokens go through the head (hidden state s predicts label s + 1 when shifted)
        selected, labels = hidden[rows, columns], self.targets.to(hidden.device)[rows, columns]
        size = self.chunk_size
        chunks = -(-labels.numel() // size)
        if self.agree_on_chunks is not None:  # ranks with fewer target tokens run empty chunks
            chunks = self.agree_on_chunks(chunks)
        total = hidden.reshape(-1)[0].float() * 0.0  # connected to the model: no targets backpropagate zeros
        for start in range(0, chunks * size, size):
            total = total + checkpoint(
                self._chunk, selected[start:start + size], labels[start:start + size], use_reentrant=False)
        self.returned = total.float().view(1, 1, 1)
        return self.returned

    def _chunk(self, hidden, labels):
        import torch

        logits = type(self.head).forward(self.head, hidden)  # the head's own forward (a peft wrapper's too)
        return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum",
                                                 label_smoothing=self.label_smoothing)

    def loss(self, outputs, model_name: str, compare: bool = True):
        """The summed loss from the model's outputs (the tensor the model returned as its logits: under ZeRO-3 the
        engine's hooks wrap it, DDP's forward clones it, and backward must pass through them). `compare`: whether to
        check the value is the one lm_head returned (a read of the device: the trainer asks it of a model's first
        batch only, since soft-capping or scaling is the model's, the same at every step)."""
        import torch

        head = type(self.head).__name__
        if self.calls != 1:
            what = "does not call" if self.calls == 0 else f"calls {self.calls} times"
            raise ChunkedLossError(f"--chunked_loss: {model_name}'s forward {what} its output layer {head}, so the "
                                   f"loss cannot be taken through it chunk by chunk; {CHUNKED_LOSS_OFF}")
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if not torch.is_tensor(logits) or logits.shape != (1, 1, 1) \
                or compare and not torch.equal(logits.detach().float(), self.returned.detach()):
            raise ChunkedLossError(f"--chunked_loss: {model_name}'s forward changes what {head} returns (soft-capping "
                                   f"or scaling its logits), so the loss cannot be taken through {head} chunk by "
                                   f"chunk; {CHUNKED_LOSS_OFF}")
        return logits.reshape(())
