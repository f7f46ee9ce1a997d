"""Which tokens a loss counts and how an evaluation weighs its batches (training/losses.py), against counts made by
hand and torch's own cross-entropy: the causal LM's shift, padding and -100 labels, the padded last batch of N ranks,
and whether a loss reads transformers' num_items_in_batch."""

from types import SimpleNamespace

import pytest
import torch

import functools

from trainer_ext.training.losses import (EvaluationLosses, NumItemsProbe, finite_for_logging, shifts_labels, sliced,
                                         takes_num_items, target_counts, token_cross_entropy, token_labels)

# Two samples of 5 tokens: the first padded at its end (-100), the second with its prompt unlabelled (-100).
LABELS = torch.tensor([[11, 12, 13, -100, -100],
                       [-100, -100, 21, 22, 23]])


def test_target_counts_are_the_labels_left_after_the_shift_padding_and_minus_100():
    """Counted by hand: a causal LM predicts token i+1 at position i, so a sample's first label is never a target
    (11 drops: 2 and 3 targets); unshifted every label but -100 counts (3 and 3). The count weighs each batch's loss
    in the evaluation: a wrong one moves eval_loss with the batch size and the number of ranks."""
    assert target_counts({"labels": LABELS}, shift=True).tolist() == [2, 3]
    assert target_counts({"labels": LABELS}, shift=False).tolist() == [3, 3]
    # A padding-free collator's own shifted labels are taken as given (they already are the targets).
    given = torch.tensor([[12, -100, -100, -100, -100], [-100, 21, 22, 23, -100]])
    assert target_counts({"labels": LABELS, "shift_labels": given}, shift=True).tolist() == [1, 3]
    assert target_counts({"labels": LABELS[:, :, None].expand(2, 5, 2)}, shift=False).tolist() == [6, 6]


def test_per_sample_labels_have_no_token_count():
    """A classifier's labels (one per sample, or float targets) are left to transformers' mean."""
    assert target_counts({"labels": torch.tensor([0, 1])}, shift=False) is None
    assert target_counts({"labels": torch.rand(2, 3)}, shift=False) is None
    assert target_counts({"input_ids": LABELS}, shift=True) is None and token_labels([1, 2]) is None
    assert token_labels({"labels": LABELS}) is LABELS


def test_token_cross_entropy_is_the_mean_over_targets_or_their_sum_over_every_ranks_count():
    """Against torch's cross-entropy on the shifted targets written out by hand."""
    logits = torch.randn(2, 5, 30, generator=torch.Generator().manual_seed(0))
    targets = [(0, 0, 12), (0, 1, 13), (1, 1, 21), (1, 2, 22), (1, 3, 23)]  # (sample, position, next token)
    by_hand = torch.stack([torch.nn.functional.cross_entropy(logits[s, p], torch.tensor(t)) for s, p, t in targets])
    assert torch.allclose(token_cross_entropy(logits, LABELS, True, 0.0), by_hand.mean())
    assert torch.allclose(token_cross_entropy(logits, LABELS, True, 0.0, normaliser=8), by_hand.sum() / 8)
    unshifted = [(0, 0, 11), (0, 1, 12), (0, 2, 13), (1, 2, 21), (1, 3, 22), (1, 4, 23)]
    plain = torch.stack([torch.nn.functional.cross_entropy(logits[s, p], torch.tensor(t)) for s, p, t in unshifted])
    assert torch.allclose(token_cross_entropy(logits, LABELS, False, 0.0), plain.mean())
    smoothed = torch.nn.functional.cross_entropy(logits[0, :3], torch.tensor([11, 12, 13]), label_smoothing=0.1)
    assert torch.allclose(token_cross_entropy(logits[:1], LABELS[:1], False, 0.1), smoothed)
    classes = torch.randn(3, 4)
    assert torch.allclose(token_cross_entropy(classes, torch.tensor([1, 0, 3]), True, 0.0),
                          torch.nn.functional.cross_entropy(classes, torch.tensor([1, 0, 3])))


def tiny(kind):
    from transformers import (BartConfig, BartForConditionalGeneration, BertConfig, BertForSequenceClassification,
                              LlamaConfig, LlamaForCausalLM)

    small = dict(vocab_size=32, hidden_size=8, num_attention_heads=2, intermediate_size=16)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, num_key_value_heads=2, **small))
    if kind == "bart":
        return BartForConditionalGeneration(BartConfig(vocab_size=32, d_model=8, encoder_layers=1, decoder_layers=1,
                                                       encoder_attention_heads=2, decoder_attention_heads=2,
                                                       encoder_ffn_dim=16, decoder_ffn_dim=16))
    return BertForSequenceClassification(BertConfig(num_hidden_layers=1, **small))


def test_only_decoder_causal_lms_shift_their_labels():
    """A causal LM (also wrapped as PEFT wraps it) shifts; an encoder-decoder and a classifier do not."""
    llama = tiny("llama")
    assert shifts_labels(llama) and shifts_labels(SimpleNamespace(get_base_model=lambda: llama))
    assert not shifts_labels(tiny("bart")) and not shifts_labels(tiny("bert"))


def test_a_users_own_causal_lm_shifts_when_its_loss_is_transformers_causal_lm_loss():
    """A model class transformers does not list (a user's own, trust_remote_code) whose loss_type names transformers'
    ForCausalLMLoss shifts like one; a module without a config or loss_type does not."""
    class MyLM(torch.nn.Module):
        loss_type = "ForCausalLM"

    class MyClassifier(torch.nn.Module):
        loss_type = "ForSequenceClassification"

    assert shifts_labels(MyLM()) and not shifts_labels(MyClassifier()) and not shifts_labels(torch.nn.Linear(2, 2))
    with_config = MyLM()
    with_config.config = SimpleNamespace(model_type="mine")  # a config that does not say is_encoder_decoder
    assert shifts_labels(with_config)


class Ranks:
    """What EvaluationLosses reads of a trainer: the model, the rank's place, the dataloader's end, and accelerate's
    sum over ranks (over the simulated ranks' totals, given as `others`)."""

    def __init__(self, world_size=1, rank=0, remainder=None, others=(), nan_filter=True):
        model = tiny("llama")
        self.model = model
        self.args = SimpleNamespace(world_size=world_size, process_index=rank, logging_nan_inf_filter=nan_filter)
        self.others = list(others)
        state = SimpleNamespace(end_of_dataloader=False, remainder=remainder)
        self.accelerator = SimpleNamespace(gradient_state=state, reduce=self.reduce)

    def user_model(self):
        return self.model

    def reduce(self, totals, reduction):
        assert reduction == "sum"
        return totals + sum(torch.tensor(other, dtype=totals.dtype) for other in self.others)


def test_the_evaluation_loss_is_the_mean_over_every_target_token_not_over_batches():
    """Batch token means 2.0 over 2+3 targets and 0.1 over 1: (2.0·5 + 0.1·1) / 6, summed in float64 (float32 sums
    drift over a large set; transformers' mean of the batch means, 1.05, moves with the eval batch size). One target
    token is a loss too."""
    losses = EvaluationLosses(Ranks())
    losses.add({"labels": LABELS}, torch.tensor(2.0), evaluate_first=None)
    losses.add({"labels": torch.tensor([[-100, 5]])}, torch.tensor(0.1), evaluate_first=None)
    assert losses.loss() == (2.0 * 5 + torch.tensor(0.1).item() * 1) / 6
    single = EvaluationLosses(Ranks())
    single.add({"labels": torch.tensor([[-100, 5]])}, torch.tensor(0.25), evaluate_first=None)
    assert single.loss() == 0.25


def test_a_non_finite_batch_loss_is_left_out_as_transformers_leaves_it_out():
    """--logging_nan_inf_filter (the default) drops a non-finite batch from the loss; off, it reaches it."""
    for nan_filter, expected in ((True, 2.0), (False, float("inf"))):
        losses = EvaluationLosses(Ranks(nan_filter=nan_filter))
        losses.add({"labels": LABELS}, torch.tensor(2.0), evaluate_first=None)
        losses.add({"labels": LABELS}, torch.tensor(float("inf")), evaluate_first=None)
        assert losses.loss() == expected


def test_the_padded_last_batch_of_n_ranks_counts_only_its_real_samples():
    """On 2 ranks accelerate completes the last global batch (3 real samples, 2 per rank) with a copy of the first:
    rank 0 keeps its batch, rank 1 evaluates its 1 real sample again, and the sum over ranks holds each real target
    once. Rank 1's view, with rank 0's totals (loss 2.0 over 5 targets) as the other rank's."""
    trainer = Ranks(world_size=2, rank=1, remainder=3, others=[[10.0, 5.0]])
    trainer.accelerator.gradient_state.end_of_dataloader = True
    losses = EvaluationLosses(trainer)
    asked = []
    losses.add({"labels": LABELS}, torch.tensor(9.0), evaluate_first=lambda count: asked.append(count) or
               torch.tensor(4.0))
    assert asked == [1]
    assert losses.loss() == pytest.approx((10.0 + 4.0 * 2) / (5 + 2))  # its real sample: 2 targets
    rank0 = Ranks(world_size=2, rank=0, remainder=3)
    rank0.accelerator.gradient_state.end_of_dataloader = True
    losses, asked = EvaluationLosses(rank0), []
    losses.add({"labels": LABELS}, torch.tensor(2.0), evaluate_first=lambda count: asked.append(count) or
               torch.tensor(2.0))
    assert asked == [2] and losses.loss() == pytest.approx(2.0)
    empty = Ranks(world_size=2, rank=1, remainder=2)  # every real sample on rank 0: rank 1 adds nothing
    empty.accelerator.gradient_state.end_of_dataloader = True
    losses = EvaluationLosses(empty)
    losses.add({"labels": LABELS}, torch.tensor(7.0), evaluate_first=lambda count: torch.tensor(7.0))
    assert losses.total.item() == 0.0 and losses.targets.item() == 0.0 and losses.loss() is None
    one = Ranks(world_size=2, rank=0, remainder=1)  # one real sample in the last global batch
    one.accelerator.gradient_state.end_of_dataloader = True
    losses, asked = EvaluationLosses(one), []
    losses.add({"labels": LABELS}, torch.tensor(2.0), evaluate_first=lambda count: asked.append(count) or
               torch.tensor(3.0))
    assert asked == [1] and losses.loss() == pytest.approx(3.0)


def test_a_rank_without_real_samples_adds_nothing_even_when_its_copy_is_not_finite():
    """The copies a rank re-evaluates to keep in step are never counted: a copy whose loss overflows must not turn the
    evaluation loss into NaN (0 targets times inf), also with --logging_nan_inf_filter false."""
    trainer = Ranks(world_size=2, rank=1, remainder=2, nan_filter=False)
    losses = EvaluationLosses(trainer)
    losses.add({"labels": LABELS}, torch.tensor(2.0), evaluate_first=None)
    trainer.accelerator.gradient_state.end_of_dataloader = True
    losses.add({"labels": LABELS}, torch.tensor(2.0), evaluate_first=lambda count: torch.tensor(float("inf")))
    assert losses.loss() == pytest.approx(2.0)


def test_a_batch_that_is_not_the_padded_last_one_is_taken_whole():
    """Mid-set batches, one process, and a set that divides evenly are never evaluated again."""
    for end, world_size, remainder in ((False, 2, 3), (True, 1, 3), (True, 2, 0), (True, 2, None)):
        trainer = Ranks(world_size=world_size, remainder=remainder)
        trainer.accelerator.gradient_state.end_of_dataloader = end
        losses = EvaluationLosses(trainer)
        losses.add({"labels": LABELS}, torch.tensor(2.0), evaluate_first=None)
        assert losses.loss() == pytest.approx(2.0)


def test_per_sample_labels_leave_the_evaluation_loss_to_transformers():
    """A classifier's labels: no token-weighted loss (transformers' mean of equal batches is exact)."""
    losses = EvaluationLosses(Ranks())
    assert losses.loss() is None
    losses.add({"labels": torch.tensor([0, 1])}, torch.tensor(0.3), evaluate_first=None)
    losses.add({"labels": LABELS}, torch.tensor(2.0), evaluate_first=None)
    assert losses.loss() is None


def test_sliced_keeps_the_first_samples_of_every_batch_tensor():
    """The padded batch's real samples: tensors of the batch's size are cut, anything else is kept as is."""
    batch = {"labels": LABELS, "input_ids": LABELS + 1, "scalar": torch.tensor(3), "other": torch.zeros(5), "n": 2,
             "classes": torch.tensor([4, 5])}
    cut = sliced(batch, 1, 2)
    assert cut["labels"].tolist() == [LABELS[0].tolist()] and cut["input_ids"].shape == (1, 5)
    assert cut["classes"].tolist() == [4]
    assert cut["scalar"] is batch["scalar"] and cut["other"] is batch["other"] and cut["n"] == 2


def test_the_probe_notes_arithmetic_on_num_items_but_not_moves():
    """Whether a loss reads num_items_in_batch decides how it is normalised: moving or asking the count's shape is
    not reading it; dividing by it is."""
    probe = NumItemsProbe.of(8)
    moved = probe.to("cpu").detach().float()
    assert probe.size() == () and moved.dim() == 0 and not NumItemsProbe.read
    loss = torch.tensor(4.0) / probe
    assert NumItemsProbe.read and type(loss) is torch.Tensor and loss.item() == 0.5
    assert not NumItemsProbe.of(torch.tensor(3)).read  # a new step starts unread


def test_no_move_copy_view_or_question_about_the_count_reads_it():
    """Each of these on num_items_in_batch (transformers moves it to the device; a loss may copy, view or format it)
    leaves a loss that never divides by it a per-batch mean; any arithmetic reads it."""
    def untouched(use):
        probe = NumItemsProbe.of(torch.tensor(8))
        use(probe)
        return not NumItemsProbe.read

    moves = [lambda t: t.to("cpu"), lambda t: t.cpu(), lambda t: t.clone(), lambda t: t.detach(),
             lambda t: t.contiguous(), lambda t: t.view(1), lambda t: t.reshape(1), lambda t: t.view(1).squeeze(),
             lambda t: t.unsqueeze(0), lambda t: t.expand(()), lambda t: t.float(), lambda t: t.double(),
             lambda t: t.long(), lambda t: t.int(), lambda t: t.type(torch.float32), lambda t: t.dim(),
             lambda t: t.size(), lambda t: t.numel(), lambda t: t.element_size(), lambda t: t.is_floating_point(),
             lambda t: (t.shape, t.dtype), repr, lambda t: f"{t:}"]
    assert all(untouched(use) for use in moves)
    for name in ("cuda", "pin_memory"):  # a GPU's moves, by name (this machine may have none)
        def moved(tensor):
            return tensor
        moved.__name__ = name
        probe = NumItemsProbe.of(8)
        NumItemsProbe.__torch_function__(moved, (NumItemsProbe,), (probe,))
        assert not NumItemsProbe.read, name
    assert not untouched(lambda t: t + 0) and not untouched(lambda t: t.clamp(min=1)) and not untouched(
        lambda t: t.item())


def test_a_move_keeps_its_keyword_arguments_and_a_nameless_callable_reads_the_count():
    """A move passes its keywords on (`.to(dtype=...)` converts, still unread); a callable torch hands over without a
    name is not one of the moves, so it counts as a read."""
    probe = NumItemsProbe.of(8)
    assert probe.to(dtype=torch.float64).dtype == torch.float64 and not NumItemsProbe.read
    nameless = functools.partial(torch.add)
    assert NumItemsProbe.__torch_function__(nameless, (NumItemsProbe,), (probe, 1)).item() == 9
    assert NumItemsProbe.read


def _in_loop(summed=6.0, global_step=5, last_logged=2, nan_filter=True):
    """What transformers' training loop holds when a step's loss comes back: the loss summed on the device since the
    last log and the steps it will be divided by (1 + 5 - 2 = 4 here)."""
    return SimpleNamespace(_tr_loss=torch.tensor(summed), state=SimpleNamespace(global_step=global_step),
                           _globalstep_last_logged=last_logged, args=SimpleNamespace(logging_nan_inf_filter=nan_filter))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_step_loss_logs_as_the_mean_since_the_last_log(bad):
    """transformers' --logging_nan_inf_filter, done on the device: a NaN or infinite step loss counts as the mean of
    what was summed since the last log (6 / 4); the result answers transformers' own isnan/isinf check False without a
    host read."""
    out = finite_for_logging(_in_loop(), torch.tensor(bad))
    assert out.item() == 1.5 and torch.isnan(out) is False and torch.isinf(out) is False


def test_a_finite_step_loss_is_kept_and_nothing_is_filtered_when_not_asked():
    trainer = _in_loop()
    out = finite_for_logging(trainer, torch.tensor(0.25))
    assert out.item() == 0.25 and torch.isnan(out) is False
    nan = torch.tensor(float("nan"))
    assert finite_for_logging(_in_loop(nan_filter=False), nan) is nan  # --logging_nan_inf_filter false: as logged
    assert finite_for_logging(SimpleNamespace(args=trainer.args), nan) is nan  # outside transformers' loop
    assert finite_for_logging(trainer, 0.5) == 0.5  # a Python number (a custom training_step's) is left alone


def test_a_loss_fn_takes_num_items_only_when_it_names_the_parameter():
    """transformers' compute_loss_func contract: the parameter's name, not its position."""
    assert takes_num_items(lambda outputs, labels, num_items_in_batch=None: 0)
    assert not takes_num_items(lambda outputs, labels, count=None: 0)
    assert not takes_num_items(max)  # a builtin without a signature
