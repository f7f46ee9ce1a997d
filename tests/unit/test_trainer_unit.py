"""ExtTrainer pieces checked in one process against hand computations: losses, sampler, optimizer groups."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import tiny_bert
from trainer_ext import ExtTrainer, ExtTrainingArguments, OptimizerSettings, SchedulerSettings

pytestmark = pytest.mark.oldest  # in-process, seconds: part of `make test-oldest`


def fixed_batch(labels=(0, 1, 1, 0, 1)):
    generator = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(1, 50, (len(labels), 6), generator=generator),
            "labels": torch.tensor(labels)}


def trainer_for(tmp_path, model, **kwargs):
    arg_names = {"class_weights", "label_smoothing_factor", "optim", "chunked_loss"}
    args = ExtTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                **{k: v for k, v in kwargs.items() if k in arg_names})
    return ExtTrainer(model=model, args=args, **{k: v for k, v in kwargs.items() if k not in arg_names})


def logits_of(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"]).logits


def test_default_loss_is_the_models_own(tmp_path):
    """With no custom loss options the loss must be the model's own, exactly what stock Trainer trains on."""
    model, batch = tiny_bert(), fixed_batch()
    loss = trainer_for(tmp_path, model).compute_loss(model, dict(batch))
    assert torch.allclose(loss, F.cross_entropy(logits_of(model, batch), batch["labels"]))


def test_class_weights_match_hand_computation(tmp_path):
    """--class_weights 1.0,3.0: weighted mean of per-example losses, weights of the true classes as divisor."""
    model, batch = tiny_bert(), fixed_batch()
    loss = trainer_for(tmp_path, model, class_weights="1.0,3.0").compute_loss(model, dict(batch))
    log_probs = torch.log_softmax(logits_of(model, batch), dim=-1)
    weights = torch.tensor([1.0, 3.0])[batch["labels"]]
    nll = -log_probs[torch.arange(5), batch["labels"]]
    assert torch.allclose(loss, (weights * nll).sum() / weights.sum(), atol=1e-6)
    assert not torch.allclose(loss, nll.mean(), atol=1e-4)


def test_label_smoothing_matches_hand_computation(tmp_path):
    """--label_smoothing_factor 0.1 must give the textbook smoothed cross-entropy, not a differently scaled loss."""
    model, batch = tiny_bert(), fixed_batch()
    loss = trainer_for(tmp_path, model, label_smoothing_factor=0.1).compute_loss(model, dict(batch))
    log_probs = torch.log_softmax(logits_of(model, batch), dim=-1)
    nll = -log_probs[torch.arange(5), batch["labels"]].mean()
    smooth = -log_probs.mean(dim=-1).mean()
    assert torch.allclose(loss, 0.9 * nll + 0.1 * smooth, atol=1e-6)


def test_user_loss_fn_needs_no_subclass(tmp_path):
    """The classic 'subclass and override compute_loss' use case, as one argument."""
    def margin_loss(outputs, labels):
        return F.relu(1.0 - (outputs.logits[:, 1] - outputs.logits[:, 0]) * (2 * labels.float() - 1)).mean()

    model, batch = tiny_bert(), fixed_batch()
    loss = trainer_for(tmp_path, model, loss_fn=margin_loss).compute_loss(model, dict(batch))
    logits = logits_of(model, batch)
    expected = F.relu(1.0 - (logits[:, 1] - logits[:, 0]) * (2 * batch["labels"].float() - 1)).mean()
    assert torch.allclose(loss, expected)


def test_class_weights_must_match_the_number_of_classes(tmp_path):
    """Refused when the trainer is built, before any step, with an exception the caller can catch (a ValueError)."""
    model = tiny_bert(num_labels=3)
    with pytest.raises(ValueError, match="--class_weights has 2 values but the model has 3 classes"):
        trainer_for(tmp_path, model, class_weights="1,2")


def test_class_weights_with_a_loss_fn_are_refused(tmp_path, monkeypatch):
    """The loss_fn computes the loss, so the weights would be silently ignored."""
    monkeypatch.setenv("TRAINER_EXT_DEBUG", "1")
    with pytest.raises(ValueError, match="--class_weights and a loss_fn were both given"):
        trainer_for(tmp_path, tiny_bert(), class_weights="1,2", loss_fn=lambda outputs, labels: outputs.logits.sum())


def test_bad_class_weights_are_rejected_at_parse_time(tmp_path):
    """Malformed or negative --class_weights must stop the script at parse time, not after the model is loaded."""
    from trainer_ext import ArgumentsError

    for value in ("1.0;3.0", "1.0", "1.0,-2"):
        with pytest.raises(ArgumentsError, match="--class_weights"):
            ExtTrainingArguments(output_dir=str(tmp_path), class_weights=value)


def forwards_counted(model):
    """A list that gets one entry per forward of `model`."""
    calls = []
    model.register_forward_hook(lambda module, args, output: calls.append(1))
    return calls


def test_plain_mean_models_are_told_apart_from_token_count_losses(tmp_path):
    """The 2x-loss bug: a classifier's loss ignores num_items_in_batch, a causal LM's divides by it. Learnt inside the
    first training step with no forward of its own (two extra forwards outside the engine crashed TRL under ZeRO-3)."""
    bert, batch = tiny_bert().train(), fixed_batch()
    trainer, forwards = trainer_for(tmp_path, bert), forwards_counted(bert)
    loss = trainer.compute_loss(bert, dict(batch), num_items_in_batch=torch.tensor(7))
    assert trainer._model_uses_num_items is False and trainer.model_accepts_loss_kwargs is False
    assert len(forwards) == 1 and trainer.loss_is_scaled_for_ga is False
    assert torch.allclose(loss, F.cross_entropy(logits_of(bert, batch), batch["labels"]))  # the batch's own mean
    torch.manual_seed(0)
    gpt = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0)).train()
    ids = fixed_batch()["input_ids"]
    # the model's own loss (ExtTrainer's chunked one, the default, reads the count by construction: test_chunked_loss)
    trainer, forwards = trainer_for(tmp_path / "lm", gpt, chunked_loss=False), forwards_counted(gpt)
    loss = trainer.compute_loss(gpt, {"input_ids": ids, "labels": ids}, num_items_in_batch=torch.tensor(7))
    assert trainer._model_uses_num_items is True and trainer.model_accepts_loss_kwargs is True
    assert len(forwards) == 1 and trainer.loss_is_scaled_for_ga is None
    logits = logits_of(gpt, {"input_ids": ids})[:, :-1]
    expected = F.cross_entropy(logits.reshape(-1, 50), ids[:, 1:].reshape(-1), reduction="sum") / 7
    assert torch.allclose(loss, expected, atol=1e-5)  # normalised by every rank's targets, as transformers does


def test_label_smoothing_shifts_the_labels_of_a_peft_causal_lm(tmp_path):
    """A LoRA-wrapped causal LM (PeftModelForCausalLM, not a causal-LM class by name) was smoothed on unshifted labels:
    a silent wrong loss. Each position must be scored against the next token, normalised by num_items_in_batch."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    gpt = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0))
    model = peft.get_peft_model(gpt, peft.LoraConfig(r=2, target_modules=["c_attn"], task_type="CAUSAL_LM")).train()
    ids = fixed_batch()["input_ids"]
    labels = ids.clone()
    labels[:, :2] = -100  # a prompt without targets
    trainer = trainer_for(tmp_path, model, label_smoothing_factor=0.1)
    loss = trainer.compute_loss(model, {"input_ids": ids, "labels": labels}, num_items_in_batch=torch.tensor(19))
    log_probs = torch.log_softmax(logits_of(model, {"input_ids": ids})[:, :-1].float(), dim=-1)
    targets = labels[:, 1:]
    kept = targets != -100
    nll = -log_probs.gather(-1, targets.clamp(min=0)[..., None])[..., 0][kept].sum()
    smooth = -log_probs.mean(dim=-1)[kept].sum()
    assert torch.allclose(loss, (0.9 * nll + 0.1 * smooth) / 19, atol=1e-6)
    assert trainer.loss_is_scaled_for_ga is True  # normalised over the accumulated batch: not divided again


def test_optimizer_has_no_weight_decay_on_bias_and_layernorm(tmp_path):
    """Stock Trainer spares biases and LayerNorm weights from weight decay; decaying them shifts every fine-tune."""
    model = tiny_bert()
    trainer = trainer_for(tmp_path, model, optimizer_settings=OptimizerSettings(lr=1e-3, weight_decay=0.01))
    optimizer = trainer.create_optimizer()
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = [names[id(p)] for p in optimizer.param_groups[0]["params"]]
    plain = [names[id(p)] for p in optimizer.param_groups[1]["params"]]
    assert optimizer.param_groups[0]["weight_decay"] == 0.01 and optimizer.param_groups[1]["weight_decay"] == 0.0
    assert all("bias" not in n and "LayerNorm" not in n for n in decayed)
    assert any("bias" in n for n in plain) and any("LayerNorm" in n for n in plain)
    assert len(decayed) + len(plain) == len(list(model.parameters()))


def test_optim_flag_picks_the_optimizer_as_the_trainer_does(tmp_path):
    """--optim was ignored (always the slow for-loop AdamW); transformers' own mapping is the oracle."""
    from transformers import Trainer
    from transformers.optimization import Adafactor

    for optim, expected_cls, expected_options in (("adamw_torch_fused", torch.optim.AdamW, {"fused": True}),
                                                  ("adamw_torch", torch.optim.AdamW, {"fused": None}),
                                                  ("adafactor", Adafactor, {"relative_step": False})):
        trainer = trainer_for(tmp_path, tiny_bert(), optim=optim, optimizer_settings=OptimizerSettings(lr=1e-3))
        optimizer = trainer.create_optimizer()
        assert type(optimizer) is expected_cls is Trainer.get_optimizer_cls_and_kwargs(trainer.args)[0]
        group = optimizer.param_groups[0]
        assert group["lr"] == 1e-3 and all(group[k] == v for k, v in expected_options.items())


def test_warmup_is_a_step_count_from_one_and_a_ratio_of_the_total_below():
    """--warmup_steps 3 warms up 3 steps, 0.1 of 50 steps 5 (rounded up: 0.1 of 41 is 5), 0 none; a ratio waits for the
    total (None while it is unknown)."""
    from trainer_ext.config.optimizer import warmup_steps

    assert SchedulerSettings("cosine", 0.1).warmup_for(50) == 5 and SchedulerSettings("linear", 3).warmup_for(50) == 3
    assert [warmup_steps(w, 41) for w in (0, 0.1, 1, 1.5, 12)] == [0, 5, 1, 1, 12]
    assert warmup_steps(0.1, None) is None and warmup_steps(4, None) == 4 and warmup_steps(0, None) == 0


def test_the_v4_warmup_ratio_becomes_a_warmup_below_one():
    """--warmup_ratio R (transformers 4) is --warmup_steps R in transformers 5; both given, or R outside [0, 1), is
    refused in one line."""
    from trainer_ext.config.optimizer import merge_warmup_ratio
    from trainer_ext.errors import ArgumentsError

    assert merge_warmup_ratio(0, 0.25) == 0.25 and merge_warmup_ratio(7, 0) == 7 and merge_warmup_ratio(7, None) == 7
    assert merge_warmup_ratio(0, 0.0) == 0
    with pytest.raises(ArgumentsError, match=r"^--warmup_ratio 0.1 and --warmup_steps 5 both set the warmup: give "
                                             r"only one$"):
        merge_warmup_ratio(5, 0.1)
    for ratio in (1, 1.5, -0.5):
        with pytest.raises(ArgumentsError, match=rf"^--warmup_ratio {ratio}: a ratio must be in \[0, 1\)$"):
            merge_warmup_ratio(0, ratio)


def test_settings_come_from_the_flags_a_user_gave(tmp_path):
    """ExtTrainer trains with --learning_rate, --adam_beta1/2, --adam_epsilon, --weight_decay, --lr_scheduler_type,
    --warmup_steps and --lr_scheduler_kwargs unless the script passes its own settings."""
    args = ExtTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, learning_rate=3e-4,
                                adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.01,
                                lr_scheduler_type="cosine_with_restarts", warmup_steps=0.2,
                                lr_scheduler_kwargs={"num_cycles": 2})
    assert OptimizerSettings.from_args(args) == OptimizerSettings(3e-4, (0.8, 0.95), 1e-6, 0.01)
    assert SchedulerSettings.from_args(args) == SchedulerSettings("cosine_with_restarts", 0.2, {"num_cycles": 2})
    assert f"{SchedulerSettings.from_args(args).type}" == "cosine_with_restarts"  # the name, not SchedulerType.COS...
    stock = SimpleNamespace(lr_scheduler_type="cosine", warmup_steps=3, lr_scheduler_kwargs=None)  # a name as given
    assert SchedulerSettings.from_args(stock) == SchedulerSettings("cosine", 3, {})
    assert SchedulerSettings() == SchedulerSettings("linear", 0, {}) and OptimizerSettings().lr == 5e-5


def test_label_smoothing_on_a_causal_lm_shifts_labels(tmp_path):
    """Token-level custom losses must predict token t+1 from t, as the model's own loss does."""
    torch.manual_seed(0)
    gpt = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    ids = fixed_batch()["input_ids"]
    loss = trainer_for(tmp_path, gpt, label_smoothing_factor=0.1).compute_loss(gpt, {"input_ids": ids, "labels": ids})
    with torch.no_grad():
        logits = gpt(input_ids=ids).logits[:, :-1].reshape(-1, 50)
    expected = F.cross_entropy(logits, ids[:, 1:].reshape(-1), label_smoothing=0.1)
    assert torch.allclose(loss, expected, atol=1e-6)


def test_a_checkpoint_without_its_loss_record_gives_the_logged_sum(tmp_path):
    """A checkpoint stock transformers wrote has no loss_state.json: the sum of its steps' losses comes from the logged
    means (each over the steps since the previous log) when the last log is at its step, else it is unknown."""
    import json

    from trainer_ext.checkpoints.format import read_loss_sum

    state = {"global_step": 6, "log_history": [{"step": 2, "loss": 4.0}, {"step": 3, "eval_loss": 9.0},
                                               {"step": 6, "loss": 2.5}]}
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    assert read_loss_sum(tmp_path) == 4.0 * 2 + 2.5 * 4
    (tmp_path / "trainer_state.json").write_text(json.dumps({**state, "global_step": 7}))  # step 7 never logged
    assert read_loss_sum(tmp_path) is None
    (tmp_path / "loss_state.json").write_text(json.dumps({"global_step": 7, "loss_sum": 20.5}))
    assert read_loss_sum(tmp_path) == 20.5


def test_a_trl_trainer_given_ext_training_arguments_alone_says_which_class_to_pass(tmp_path):
    """ExtTrainer combined with TRL's SFTTrainer, given ExtTrainingArguments: TRL rebuilt them as an SFTConfig and
    failed with `unexpected keyword argument 'sharded_ddp'`; one line names the arguments class to pass instead."""
    trl = pytest.importorskip("trl")

    class MyTrainer(ExtTrainer, trl.SFTTrainer):
        pass

    args = ExtTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="MyTrainer combines ExtTrainer with TRL's SFTTrainer, which reads its own "
                                         r"arguments class: .*trl.SFTConfig \(trainer_ext.trl.ExtSFTConfig is"):
        MyTrainer(model=tiny_bert(), args=args)


def test_trainer_ext_trl_without_trl_says_what_to_install(monkeypatch):
    """Importing trainer_ext.trl where TRL is missing (hidden here as an absent module) must say which extra installs
    it, as an ImportError a script can catch, not a bare traceback from inside the package."""
    import importlib
    import sys

    from trainer_ext.errors import MissingLibraryError

    monkeypatch.setitem(sys.modules, "trl", None)  # what Python does for a module it cannot find
    monkeypatch.delitem(sys.modules, "trainer_ext.trl", raising=False)
    with pytest.raises(MissingLibraryError, match=r'trainer_ext.trl needs TRL.*pip install "trainer_ext\[trl\]"'):
        importlib.import_module("trainer_ext.trl")
    assert issubclass(MissingLibraryError, ImportError)


def test_an_iterable_dataset_with_a_length_and_no_max_steps_is_one_line_before_training(tmp_path):
    """transformers' own refusal of a stream without --max_steps misses an IterableDataset that defines __len__, which
    ExtTrainer still trains on as a stream (read in order, an epoch without an end it can count): its line, not a
    traceback from inside the training loop."""
    from trainer_ext.errors import UserError

    class Sized(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([dict(fixed_batch(), labels=torch.tensor(0))] * 8)

        def __len__(self):
            return 8

    with pytest.raises(UserError, match=r"^the training set \(Sized\) is a stream, .*: give --max_steps "):
        trainer_for(tmp_path, tiny_bert(), train_dataset=Sized())
    trainer = trainer_for(tmp_path, tiny_bert())
    trainer.train_dataset = Sized()  # given after construction: refused when training starts
    with pytest.raises(UserError, match=r"^the training set \(Sized\) is a stream, .*: give --max_steps "):
        trainer.get_train_dataloader()
