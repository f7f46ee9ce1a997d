"""The parts of transformers' Trainer that ExtTrainer relies on, checked against the installed release: every method
it overrides (private ones move between minor releases, so they are few and all in integrations/internals.py), every private
method it calls, every attribute it sets for the Trainer to read. A rename would otherwise leave an override silently
never called."""

import inspect

import pytest
import torch
from transformers import Trainer

import transformers.trainer
from conftest import REPO
from trainer_ext import ExtTrainer
from trainer_ext.integrations.internals import PrivateTrainerHooks

pytestmark = pytest.mark.oldest

# ExtTrainer's own methods; anything else it defines must override a Trainer method.
OWN = {"_custom_loss_requested", "_custom_loss", "_learn_whether_loss_reads_num_items", "_parent_computes_loss",
       "_normalised", "_on_every_rank", "_say_where_token_losses_are_normalised", "training_order_state",
       "training_loss_sum", "train_in_output_dir", "_check_batch", "_chunked_loss_applies", "_chunked_loss",
       "_largest_on_every_rank", "_optimizer_parts", "user_model", "is_backend_wrapper",
       "resumed_checkpoint"}
# The private Trainer methods ExtTrainer overrides, each with its reason in integrations/internals.py and docs/versions.md
# ("Supported versions"); everything else rides on public hooks.
PRIVATE_OVERRIDES = {"_get_output_dir", "_wrap_model", "_clip_grad_norm", "_finalize_training"}

# Trainer methods ExtTrainer calls (not overrides), with the arguments it passes them (checkpoints/policy.py's
# RunCheckpoints and data/loader.py call some of them on its behalf).
CALLS = {
    "_load_from_checkpoint": ("checkpoint",),
    "_load_callback_state": (),
    "_remove_unused_columns": ("dataset", "description"),
    "_get_collator_with_removed_columns": ("collator", "description"),
    "_save": ("output_dir", "state_dict"),
    "_save_checkpoint": ("model", "trial"),  # training/metrics_check.py: the run so far, before bad metrics
    "set_initial_training_values": ("args", "dataloader"),
    "get_decay_parameter_names": ("model",),
}

# Attributes ExtTrainer sets or reads that the Trainer's own code must use under the same name.
ATTRIBUTES = ("_tr_loss", "_total_loss_scalar", "_initial_global_step", "_created_lr_scheduler", "_train_batch_size", "model_accepts_loss_kwargs",
              "loss_is_scaled_for_ga", "compute_metrics", "is_in_train")  # the last two: training/metrics_check.py


def parameters(function):
    return [p for p in inspect.signature(function).parameters.values() if p.name != "self"]


def incompatible(ours, theirs):
    """Why `ours` cannot take every call transformers makes to `theirs` (None if it can)."""
    variadic = {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    mine, kinds = parameters(ours), {p.kind for p in parameters(ours)}
    if kinds >= variadic:
        return None  # (*args, **kwargs): passes everything on
    names = [p.name for p in mine if p.kind not in variadic]
    their_names = [p.name for p in parameters(theirs) if p.kind not in variadic]
    takes_theirs = (names[:len(their_names)] == their_names
                    or (inspect.Parameter.VAR_KEYWORD in kinds and their_names[:len(names)] == names))
    extra = [p.name for p in mine[len(their_names):] if p.kind not in variadic and p.default is inspect.Parameter.empty]
    if not takes_theirs or extra:
        return f"ExtTrainer takes ({', '.join(names)}), transformers' Trainer ({', '.join(their_names)})"
    return None


def test_every_override_and_call_matches_the_installed_trainer():
    """Fails when a transformers release renames, removes or re-signs a Trainer method ExtTrainer overrides or calls,
    or an attribute it sets for the Trainer: the range in setup.py must then exclude that release (or ExtTrainer
    follow it)."""
    version = transformers.__version__
    problems = []
    for name, ours in {**vars(PrivateTrainerHooks), **vars(ExtTrainer)}.items():
        if not callable(ours) or name.startswith("__") or name in OWN:
            continue
        theirs = getattr(Trainer, name, None)
        if theirs is None:
            problems.append(f"ExtTrainer.{name} overrides nothing: transformers {version}'s Trainer has no {name} "
                            "(renamed or removed? if it is ExtTrainer's own helper, add it to OWN)")
        elif reason := incompatible(getattr(ours, "__wrapped__", ours), theirs):
            problems.append(f"ExtTrainer.{name}: {reason}")
    for name, arguments in CALLS.items():
        theirs = getattr(Trainer, name, None)
        if theirs is None:
            problems.append(f"ExtTrainer calls Trainer.{name}, which transformers {version} does not have")
            continue
        try:
            inspect.signature(theirs).bind(None, *arguments)
        except TypeError as error:
            problems.append(f"ExtTrainer calls Trainer.{name}({', '.join(arguments)}), transformers {version} takes "
                            f"{inspect.signature(theirs)}: {error}")
    source = inspect.getsource(transformers.trainer)
    problems += [f"transformers {version}'s Trainer never uses self.{name}, which ExtTrainer relies on"
                 for name in ATTRIBUTES if f"self.{name}" not in source]
    assert not problems, "\n".join(problems)


def test_private_overrides_are_the_four_in_their_module():
    """Fails when ExtTrainer overrides a private Trainer method outside the door's PrivateTrainerHooks, or it grows: each
    private override breaks on some transformers release, so every one must be unavoidable and said why in docs/versions.md."""
    ours = {name for cls in ExtTrainer.__mro__ if cls.__module__.startswith("trainer_ext") for name in vars(cls)
            if name.startswith("_") and not name.startswith("__") and name not in OWN and hasattr(Trainer, name)}
    assert ours == PRIVATE_OVERRIDES
    assert {name for name in vars(PrivateTrainerHooks) if not name.startswith("__")} == PRIVATE_OVERRIDES
    assert not PRIVATE_OVERRIDES & set(vars(ExtTrainer))
    readme = (REPO / "docs" / "versions.md").read_text()
    assert all(f"`{name}`" in readme for name in PRIVATE_OVERRIDES)


def test_a_custom_loss_is_divided_by_the_accumulation_steps(tmp_path):
    """Fails when the Trainer stops learning that a custom loss (loss_fn, class weights, label smoothing) is a
    per-batch mean: with 2 accumulated micro-batches each step would count twice (2x the gradient)."""
    from transformers import BertConfig, BertForSequenceClassification

    from trainer_ext import ExtTrainingArguments

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config)
    args = ExtTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, class_weights="1.0,3.0",
                                gradient_accumulation_steps=2)
    trainer = ExtTrainer(model=model, args=args)
    batch = {"input_ids": torch.randint(1, 50, (5, 6), generator=torch.Generator().manual_seed(1)),
             "labels": torch.tensor([0, 1, 1, 0, 1])}
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(10))
    trainer.current_gradient_accumulation_steps = 2  # set by the training loop for each optimizer step
    assert torch.allclose(trainer.training_step(model, dict(batch), num_items_in_batch=torch.tensor(10)), loss / 2)


def test_the_backend_interface_is_counted_whole_and_each_hook_is_called():
    """A backend's whole interface, its pure half (spec.py: settling its flags, the planner's formulas, the checkpoint
    fingerprint) and its runtime (base.py: preparing the process, the trainer's hooks): 4 + 11 hooks today, never more
    than 15 (25 at issue 46's filing: `selected` folded into `given_as`, which became a function of `flag` and
    `flag_takes_options`; `missing_library` a function of `library`; `places_model_on_device` a field of the
    RunSettings `settle` returns; `arguments_for_training` what `prepare_process` returns; the planner's
    `memory_formulas` data, declared for either precision; `unwrap` gone, ExtTrainer remembering the wrapper the
    backend returned; `on_train_begin` a TrainerCallback's own event, the backend's `callbacks`; `learning_rate_in_use`
    the attribute `steps_in_backward`; `build_optimizer` and `wrap_model` one `setup_model_and_optimizer`, which
    orders them itself, as Fabric's strategies do, and the attribute `wraps_before_optimizer` gone). Each is called
    from outside backends/ or by the registry (a hook nobody calls is a hook a new backend writes for nothing)."""
    from trainer_ext.backends.base import Backend
    from trainer_ext.backends.spec import BackendSpec

    def hooks(cls):
        return sorted(name for name, value in vars(cls).items()
                      if not name.startswith("_") and (isinstance(value, classmethod) or callable(value)))

    pure, runtime = hooks(BackendSpec), hooks(Backend)
    assert len(pure) + len(runtime) <= 15 and len(pure) <= 4, (pure, runtime)
    package = REPO / "trainer_ext"
    code = "\n".join(path.read_text() for path in package.rglob("*.py")
                     if "backends" not in path.parts or path == package / "backends" / "__init__.py")
    assert [hook for hook in pure + runtime if f".{hook}(" not in code] == []


def test_the_backend_s_wrapper_and_callbacks_are_handled_by_extrainer(tmp_path, monkeypatch):
    """A backend says nothing about unwrapping: ExtTrainer finds the user's model in whatever wrapper
    setup_model_and_optimizer returned (here one keeping it under a name nobody guesses), with the optimizer it built,
    and transformers never wraps that wrapper again. Its
    callbacks run before ExtTrainer's own, so a resume's backend state is loaded before this run's settings go back
    over the checkpoint's (TrainingHooks). Fails when either is undone."""
    from transformers import BertConfig, BertForSequenceClassification, TrainerCallback

    import trainer_ext.trainer
    from trainer_ext import ExtTrainingArguments
    from trainer_ext.backends.base import Backend
    from trainer_ext.trainer import TrainingHooks

    class Own(TrainerCallback):
        pass

    class Hidden(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.kept = model

    class Wrapping(Backend):
        def setup_model_and_optimizer(self, trainer, model, optimizer):
            return Hidden(model), optimizer.build(model)

        def callbacks(self, trainer):
            return [Own()]

    monkeypatch.setattr(trainer_ext.trainer, "select_backend", Wrapping)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32)
    model = BertForSequenceClassification(config)
    trainer = ExtTrainer(model=model, args=ExtTrainingArguments(output_dir=str(tmp_path), report_to="none",
                                                                use_cpu=True))
    kinds = [type(callback) for callback in trainer.callback_handler.callbacks]
    assert kinds.index(Own) < kinds.index(TrainingHooks)
    trainer.create_optimizer()
    wrapper = trainer.model_wrapped
    assert isinstance(wrapper, Hidden) and wrapper.kept is model
    built = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert built == {id(p) for p in model.parameters()}
    assert trainer.optimizer.defaults["lr"] == trainer.args.learning_rate
    assert trainer.user_model(wrapper) is model and trainer.user_model() is model
    assert trainer._wrap_model(wrapper, training=True) is wrapper


def test_a_backend_written_for_the_old_interface_is_refused_where_it_is_defined():
    """A registered backend still defining wrap_model (the interface before setup_model_and_optimizer) would never
    have it called: a sharded run training as plain DDP, in silence. Its class definition fails, naming the
    replacement."""
    from trainer_ext.backends.base import Backend

    with pytest.raises(TypeError, match=r"\.Old\.wrap_model: the backend interface has no wrap_model any more: "
                                        r"override setup_model_and_optimizer"):
        class Old(Backend):
            def wrap_model(self, trainer, model):
                return model

    class New(Backend):  # the same backend, written for today's interface
        def setup_model_and_optimizer(self, trainer, model, optimizer):
            return model, optimizer.build(model)
