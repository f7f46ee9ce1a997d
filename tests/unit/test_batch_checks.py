"""A user's collator that packs samples (position_ids restarting inside a row) and still passes a 2-D all-ones
attention_mask made transformers 5.x skip the per-sample mask: samples attended to each other and the loss still fell.
ExtTrainer refuses such a batch at the first step, in one line; padded and padding-free batches train as before."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer_ext import ExtTrainer, ExtTrainingArguments
from trainer_ext.errors import UserError
from trainer_ext.training.batches import mixed_packed_samples

ROW = [5, 6, 7, 8, 9, 10, 11, 12]  # two samples of 4 tokens packed into one row
PACKED_POSITIONS = [0, 1, 2, 3, 0, 1, 2, 3]


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                        attn_implementation="sdpa"))


def packed_batch(mask: bool):
    batch = {"input_ids": torch.tensor([ROW, ROW]), "labels": torch.tensor([ROW, ROW]),
             "position_ids": torch.tensor([PACKED_POSITIONS, PACKED_POSITIONS])}
    if mask:
        batch["attention_mask"] = torch.ones(2, len(ROW), dtype=torch.long)
    return batch


def test_transformers_still_mixes_packed_samples_under_a_2d_mask():
    """The oracle behind the refusal: with the mask, the second sample's logits depend on the first sample (without it
    they equal the sample's own; no cache, as in training). If transformers learns to separate them, this fails and
    the refusal can go."""
    model = tiny_llama().eval()
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([ROW[4:]]), use_cache=False).logits[0]
        unmasked = model(**{k: v for k, v in packed_batch(mask=False).items() if k != "labels"}, use_cache=False).logits[0, 4:]
        masked = model(**{k: v for k, v in packed_batch(mask=True).items() if k != "labels"}, use_cache=False).logits[0, 4:]
    assert torch.allclose(unmasked, alone, atol=1e-5)
    assert not torch.allclose(masked, alone, atol=1e-3)


@pytest.mark.parametrize("batch, mixed", [
    (packed_batch(mask=True), True),
    (packed_batch(mask=False), False),  # padding-free (DataCollatorWithFlattening, trainer_ext's packing)
    # right padding whose positions stop counting in the padding: not a packed row
    ({"position_ids": torch.tensor([[0, 1, 2, 3, 3, 3]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])}, False),
    # left padding, positions restarting at the first real token
    ({"position_ids": torch.tensor([[0, 0, 0, 1, 2]]), "attention_mask": torch.tensor([[0, 0, 1, 1, 1]])}, False),
    # one position row broadcast over the batch
    ({"position_ids": torch.tensor(PACKED_POSITIONS), "attention_mask": torch.ones(3, 8, dtype=torch.long)}, True),
    ({"input_ids": torch.tensor([ROW]), "attention_mask": torch.ones(1, 8, dtype=torch.long)}, False),
], ids=["packed-with-mask", "packed-without-mask", "right-padding", "left-padding", "broadcast-positions", "plain"])
def test_which_batches_mix_samples(batch, mixed):
    """Only a restart between two attended tokens mixes samples; padding around a restart does not."""
    assert mixed_packed_samples(batch) is mixed


def trainer(tmp_path, collate, evaluation=False):
    args = ExtTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=2,
                                per_device_train_batch_size=2, save_strategy="no", learning_rate=1e-2)
    data = [{"row": i} for i in range(4)]
    return ExtTrainer(model=tiny_llama(), args=args, train_dataset=data, eval_dataset=data if evaluation else None,
                      data_collator=collate)


def test_extrainer_refuses_packed_samples_under_a_2d_mask_before_the_first_step(tmp_path):
    """train() stops at the first batch with the one line naming the fix; the weights never moved."""
    run = trainer(tmp_path, lambda features: packed_batch(mask=True))
    before = {name: value.clone() for name, value in run.model.state_dict().items()}
    with pytest.raises(UserError, match=r"^training: a batch holds packed samples .* drop attention_mask"):
        run.train()
    assert all(torch.equal(before[name], value) for name, value in run.model.state_dict().items())
    assert run.state.global_step == 0


def test_extrainer_refuses_them_in_an_evaluation_too(tmp_path):
    """The evaluation loss of mixed samples is as wrong as their training loss."""
    run = trainer(tmp_path, lambda features: packed_batch(mask=True), evaluation=True)
    with pytest.raises(UserError, match=r"^evaluation: a batch holds packed samples"):
        run.evaluate()


def test_padding_free_packed_batches_train(tmp_path):
    """The same rows without the mask (each sample masked by its positions) train as before."""
    run = trainer(tmp_path, lambda features: packed_batch(mask=False))
    assert run.train().global_step == 2
