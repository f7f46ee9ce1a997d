"""The one door to upstream internals (trainer_ext/integrations/internals.py): no other module names a private
attribute of another library, and every name the door uses still exists in the installed releases."""

import importlib
import inspect
import io
import tokenize

import pytest
import transformers.trainer
from transformers import Trainer

from conftest import REPO
from trainer_ext.integrations import internals

DOOR = REPO / "trainer_ext" / "integrations" / "internals.py"
# Private names other modules may use: trainer_ext's own (ExtTrainer's resume record, training order and class-weight
# tensor, the output folder lock's) and the standard library's at the process boundary (argparse's actions,
# threading's and atexit's exit steps, os._exit; namedtuple's _replace is its public API).
OURS = {"_resume", "_train_order", "_class_weight_tensor", "_take", "_held"}
STANDARD_LIBRARY = {"_actions", "_shutdown", "_run_exitfuncs", "_exit", "_replace"}
# Public-named attributes transformers and accelerate set for themselves: written only through the door.
WRITTEN = {"model_wrapped", "deepspeed", "is_deepspeed_enabled", "scaler", "hf_ds_config", "from_pretrained"}
SUBCLASSES = ("trainer.py", "seq2seq.py", "trl.py")  # modules whose classes extend the Trainer


def private_uses(path):
    """(line, name) of each `x._name` (x not self or cls), `getattr(x, "_name")`, and write `x.<WRITTEN> = ...`."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
              if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
    found = []
    for before, dot, name, after in zip(tokens, tokens[1:], tokens[2:], [*tokens[3:], tokens[-1]]):
        if dot.string != "." or name.type != tokenize.NAME:
            continue
        if name.string.startswith("_") and not name.string.startswith("__") and before.string not in ("self", "cls"):
            found.append((name.start[0], name.string))
        if name.string in WRITTEN and after.string == "=" and before.string != "args":  # args: the user's own
            found.append((name.start[0], f"{name.string} = (written)"))
    for call, paren, _, comma, text in zip(tokens, tokens[1:], tokens[2:], tokens[3:], tokens[4:]):
        if call.string in ("getattr", "hasattr", "setattr") and paren.string == "(" and comma.string == "," \
                and text.type == tokenize.STRING and text.string.strip("\"'").startswith("_") \
                and not text.string.strip("\"'").startswith("__"):
            found.append((text.start[0], text.string.strip("\"'")))
    return found


def test_no_module_but_the_door_names_an_upstream_internal():
    """Fails when a module outside integrations/internals.py reads, writes or calls a private name of transformers,
    accelerate, DeepSpeed, torch, datasets or Optuna (or writes one of their public-named internals): it belongs
    behind a named function in the door, where the contract test below checks it."""
    problems = []
    for path in sorted((REPO / "trainer_ext").rglob("*.py")):
        if path == DOOR:
            continue
        for line, name in private_uses(path):
            if name not in OURS | STANDARD_LIBRARY:
                problems.append(f"{path.relative_to(REPO)}:{line}: {name}")
    assert not problems, "\n".join(problems)


def test_trainer_subclasses_use_no_private_trainer_attribute_but_through_the_door():
    """Fails when ExtTrainer (or its Seq2Seq / TRL variants) reads or writes `self._x` where `_x` is the Trainer's
    own: only the four overrides in the door's PrivateTrainerHooks may."""
    source = inspect.getsource(transformers.trainer)
    problems = []
    for name in SUBCLASSES:
        path = REPO / "trainer_ext" / name
        tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
        for owner, dot, attribute in zip(tokens, tokens[1:], tokens[2:]):
            if owner.string == "self" and dot.string == "." and attribute.string.startswith("_") \
                    and not attribute.string.startswith("__") \
                    and (hasattr(Trainer, attribute.string) or f"self.{attribute.string} " in source
                         or f"self.{attribute.string}=" in source or f"self.{attribute.string}." in source):
                problems.append(f"trainer_ext/{name}:{attribute.start[0]}: self.{attribute.string}")
    assert not problems, "\n".join(problems)


def upstream_class(dotted):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("owner,name,kind", internals.UPSTREAM, ids=[f"{o}.{n}" for o, n, _ in internals.UPSTREAM])
def test_every_internal_the_door_uses_exists_in_the_installed_release(owner, name, kind):
    """Fails when an upstream release renames or drops a private method the door calls or overrides, or stops using
    an attribute under the name the door reads or writes: the door's function (and setup.py's range) must follow."""
    if owner.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
        from trainer_ext.backends.deepspeed.ops import deepspeed_imported

        with deepspeed_imported():
            cls = upstream_class(owner)
    elif owner.startswith("optuna"):
        cls = upstream_class(owner) if importlib.util.find_spec("optuna") else pytest.skip("optuna not installed")
    else:
        cls = upstream_class(owner)
    if kind == "method":
        assert callable(getattr(cls, name, None)), f"{owner} has no method {name}"
        return
    sources = [inspect.getsource(module) for module in {inspect.getmodule(c) for c in cls.__mro__}
               if module is not None and module.__name__.split(".")[0] in ("transformers", "accelerate", "torch",
                                                                          "datasets", "optuna", "deepspeed")]
    if owner == "transformers.Trainer":
        sources.append(inspect.getsource(transformers.trainer))
    if name == "_orig_mod":  # set by torch.compile's wrapper, not by Module
        sources.append(inspect.getsource(importlib.import_module("torch._dynamo.eval_frame")))
    if name == "_weight_conversions":
        sources.append(inspect.getsource(importlib.import_module("transformers.core_model_loading")))
    if name == "_is_fsdp_managed_module":  # read by transformers' generation under FSDP, set by torch's fully_shard
        sources.append(inspect.getsource(importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")))
    uses = (f".{name}", f'"{name}"')
    assert any(use in source for source in sources for use in uses) or hasattr(cls, name), \
        f"{owner}'s code no longer names {name}"


def test_the_training_loop_still_filters_the_step_loss_as_the_door_answers_it():
    """Fails when transformers' training loop no longer filters the logged loss with the expression the door's
    filtered step loss answers without a host read (internals.NAN_INF_FILTER): renamed, it would read the device again
    (two syncs a micro-batch); changed to another test, it could take the answer for a tensor."""
    assert internals.NAN_INF_FILTER in inspect.getsource(Trainer._run_epoch)
