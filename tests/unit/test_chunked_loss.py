"""ExtTrainer's causal-LM loss taken through lm_head a chunk of target tokens at a time (training/chunked_loss.py): the
whole (batch, sequence, vocabulary) logits were built for every step, 12 bytes a token and vocabulary entry (6 GiB for
one 4,096-token sequence of Llama 3's vocabulary). Here the chunked loss equals the full one in fp32 (completion-only
labels, label smoothing, normalised by the count of every rank and micro-batch or by the batch's own) and so do the
gradients, under peft's wrappers too; a model whose forward changes lm_head's output is named with the flag to turn it
off. On 2 ranks under ZeRO-3 and FSDP2: tests/integration/test_lora_variants.py."""

import copy
import importlib.util

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trainer_ext.training.chunked_loss as chunked_loss
from trainer_ext import ExtTrainer, ExtTrainingArguments
from trainer_ext.errors import UserError

VOCAB = 96


def tiny_llama(cls=LlamaForCausalLM):
    torch.manual_seed(0)
    return cls(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           tie_word_embeddings=False))


def batch():
    """3 rows of 20 tokens: a 5-token prompt without labels, one row right-padded from position 15."""
    ids = torch.randint(2, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    labels, mask = ids.clone(), torch.ones_like(ids)
    labels[:, :5] = -100
    labels[2, 15:], mask[2, 15:] = -100, 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_and_gradients(model, tmp_path, chunked: bool, smoothing: float = 0.0, num_items=None, training=True):
    """One compute_loss + backward of ExtTrainer on a copy of `model`; also the shape of what lm_head returned."""
    model = copy.deepcopy(model)
    args = ExtTrainingArguments(output_dir=str(tmp_path), use_cpu=True, chunked_loss=chunked, report_to="none",
                                label_smoothing_factor=smoothing)
    trainer = ExtTrainer(model=model, args=args)
    head = chunked_loss.output_head(model)
    shapes = []
    handle = head.register_forward_hook(lambda module, inputs, output: shapes.append(tuple(output.shape)))
    model.train(training)
    loss = trainer.compute_loss(model, batch(), num_items_in_batch=num_items)
    handle.remove()
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}, shapes


@pytest.fixture
def small_chunks(monkeypatch):
    """7 target tokens a chunk: the batch's 40 target tokens in 6 chunks."""
    monkeypatch.setattr(chunked_loss, "CHUNK_BYTES", 4 * VOCAB * 7)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("num_items", [None, 57], ids=["batch-mean", "every-rank-count"])
def test_the_chunked_loss_and_gradients_equal_the_full_ones(tmp_path, small_chunks, smoothing, num_items):
    """Chunked: lm_head never returns logits (one (1, 1, 1) loss) and the loss and every gradient equal the full
    logits' within 1e-6 (fp32), with label smoothing and with transformers' count of every rank's targets."""
    model = tiny_llama()
    full, full_grads, full_shapes = loss_and_gradients(model, tmp_path, False, smoothing, num_items)
    ours, grads, shapes = loss_and_gradients(model, tmp_path, True, smoothing, num_items)
    assert full_shapes == [(3, 20, VOCAB)] and shapes == [(1, 1, 1)]
    assert abs(full - ours) < 1e-6
    assert full_grads.keys() == grads.keys() and max((full_grads[k] - grads[k]).abs().max() for k in grads) < 1e-6


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")
@pytest.mark.parametrize("wrapped", ["modules_to_save", "lora_on_lm_head"])
def test_peft_wrappers_of_lm_head_run_per_chunk(tmp_path, small_chunks, wrapped):
    """lm_head trained whole (peft's modules_to_save copy) or carrying LoRA: each chunk goes through the wrapper's own
    forward (the trained copy, the adapter), so loss and gradients equal the full logits'."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "v_proj", "lm_head"] if wrapped == "lora_on_lm_head" else ["q_proj", "v_proj"]
    saved = ["embed_tokens", "lm_head"] if wrapped == "modules_to_save" else None
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=targets, modules_to_save=saved,
                                                    init_lora_weights=False, task_type="CAUSAL_LM"))
    full, full_grads, _ = loss_and_gradients(model, tmp_path, False, 0.1, 57)
    ours, grads, shapes = loss_and_gradients(model, tmp_path, True, 0.1, 57)
    assert shapes == [(1, 1, 1)] and abs(full - ours) < 1e-6
    assert full_grads.keys() == grads.keys() and max((full_grads[k] - grads[k]).abs().max() for k in grads) < 1e-6


def test_a_batch_without_targets_gives_zero_and_zero_gradients(tmp_path):
    """A micro-batch whose every label is -100 (all prompt): loss 0, gradients 0, no crash in backward."""
    model = tiny_llama()
    trainer = ExtTrainer(model=model, args=ExtTrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                report_to="none"))
    inputs = batch()
    inputs["labels"][:] = -100
    model.train()
    loss = trainer.compute_loss(model, inputs, num_items_in_batch=torch.tensor(8))
    loss.backward()
    assert loss.item() == 0.0 and all(p.grad.abs().max() == 0 for p in model.parameters() if p.grad is not None)


class ScaledLlamaForCausalLM(LlamaForCausalLM):
    """A model whose forward changes lm_head's output (as soft-capping or logit scaling do)."""

    def forward(self, *args, **kwargs):
        outputs = super().forward(*args, **kwargs)
        outputs.logits = outputs.logits * 0.5
        return outputs


def test_a_model_that_changes_its_logits_is_named_with_the_flag(tmp_path):
    """The loss taken through lm_head would ignore what the model does to its logits afterwards: refused at the
    first step, naming the model and --chunked_loss false; with the flag off it trains on the model's own logits."""
    with pytest.raises(UserError, match="ScaledLlamaForCausalLM's forward changes what Linear returns .* "
                                        "--chunked_loss false"):
        loss_and_gradients(tiny_llama(ScaledLlamaForCausalLM), tmp_path, True)
    loss, _, shapes = loss_and_gradients(tiny_llama(ScaledLlamaForCausalLM), tmp_path, False)
    assert shapes == [(3, 20, VOCAB)] and loss > 0
