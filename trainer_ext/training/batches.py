"""What ExtTrainer refuses in the batches it is given, checked at the first training and evaluation batch: batches
whose samples would attend to each other in silence."""

from __future__ import annotations

import torch

MIXED_PACKED_SAMPLES = (
    "a batch holds packed samples (position_ids restart inside a row) and a 2-D attention_mask: transformers then masks "
    "only padding, so each sample attends to the samples packed before it; drop attention_mask from the collator's "
    "batches (transformers then separates the samples by their position_ids, as DataCollatorWithFlattening and "
    "trainer_ext's packing do), or pass a 4-D mask of your own")


def mixed_packed_samples(inputs) -> bool:
    """Packed rows (`position_ids` restarting inside a row) given with a 2-D attention mask: transformers (5.x,
    masking_utils) builds each sample's own mask from the positions only when there is no attention mask, so with one
    every sample of a row attends to the samples before it, and the loss still falls. A restart next to a masked token
    (padding) is not one."""
    if not hasattr(inputs, "get"):
        return False
    positions, mask = inputs.get("position_ids"), inputs.get("attention_mask")
    if not (torch.is_tensor(positions) and torch.is_tensor(mask)) or mask.dim() != 2 or positions.dim() not in (1, 2):
        return False
    positions = positions.expand(mask.shape[0], -1) if positions.dim() == 1 else positions
    if positions.shape != mask.shape or positions.shape[1] < 2:
        return False
    attended = mask[:, 1:].bool() & mask[:, :-1].bool()
    return bool(((positions[:, 1:] - positions[:, :-1] != 1) & attended).any())
