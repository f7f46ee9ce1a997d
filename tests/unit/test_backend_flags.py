"""A backend brings its own flags: FairScale's --sharded_ddp is declared in backends/fairscale.py and composed into
ExtTrainingArguments by the registry (torchtitan's component configs), so the arguments name no backend. What it
settles from them is settled once, at parsing, and handed to its constructor (RunSettings)."""

import dataclasses
import pickle

import pytest
from transformers import TrainingArguments

from trainer_ext import ExtArgumentParser, ExtTrainingArguments
from trainer_ext.backends import RunSettings, backend_class, backend_classes, flag_classes, select_backend
from trainer_ext.backends.fsdp.settings import FSDPSettings


def test_each_backends_flags_are_composed_into_the_arguments_in_a_stable_order():
    """transformers' fields first, then the backends' own, then ExtTrainingArguments': a positional call (and a
    subclass with TRL's configs) keeps its meaning; the flag's help says its options."""
    names = [f.name for f in dataclasses.fields(ExtTrainingArguments)]
    stock = [f.name for f in dataclasses.fields(TrainingArguments)]
    brought = [f.name for cls in flag_classes() for f in dataclasses.fields(cls)]
    assert brought == ["sharded_ddp"] and [cls.flags for cls in backend_classes() if cls.flags] == list(flag_classes())
    assert names[:len(stock)] == stock and names[len(stock):len(stock) + len(brought)] == brought
    assert not set(brought) & set(ExtTrainingArguments.__dict__.get("__annotations__", {}))  # declared once, there
    parser = ExtArgumentParser(ExtTrainingArguments)
    assert "Options: simple, zero_dp_2, zero_dp_3, offload" in " ".join(parser.format_help().split())


def test_what_parsing_settled_selects_the_backend_and_reaches_its_constructor(tmp_path):
    """FSDP2: parsing settles its FSDPSettings; on one process --fsdp is then hidden from transformers' one-process
    check (prepare_process writes False); the backend is chosen by what was settled (not by the flag), its constructor
    receives the same object, and a pickled training_args.bin brings both back. Fails if, after parsing, the backend is
    chosen by its flags alone or settles them again."""
    args = ExtTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", fsdp="full_shard")
    run = args.run_settings
    assert run.backend == "fsdp" and isinstance(run.settled, FSDPSettings) and run.parsed
    assert type(args).fsdp is None and vars(args)["fsdp"]  # a field: set as prepare_process sets it on one process
    args.fsdp = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.backend = "ddp"
    backend = select_backend(args)
    assert type(backend).name == "fsdp" and backend.settled is run.settled and backend.resolved is run.settled
    loaded = pickle.loads(pickle.dumps(args))
    assert loaded.run_settings == run and backend_class(loaded) is type(backend)
    plain = ExtTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert plain.run_settings == RunSettings("ddp", None, True, flags_given=frozenset({"output_dir", "use_cpu",
                                             "report_to"}), global_batch=plain.run_settings.global_batch)
    assert plain.run_settings.global_batch.size == 8 and select_backend(plain).settled is None


def test_arguments_settled_for_a_backend_this_process_lacks_say_so(tmp_path):
    """training_args.bin of a run whose backend was registered from outside the package (as the toy one is), loaded
    where it is not: one line naming it, not a bare StopIteration from the registry."""
    from trainer_ext.errors import ArgumentsError

    args = ExtTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    args.run_settings = dataclasses.replace(args.run_settings, backend="toy-ddp")
    with pytest.raises(ArgumentsError, match="settled for the backend 'toy-ddp', which is not registered"):
        select_backend(pickle.loads(pickle.dumps(args)))


def test_arguments_keep_one_attribute_of_ours_and_old_training_args_bin_still_load(tmp_path):
    """The flags given and the global batch live in the frozen RunSettings, the arguments' one attribute of ours (they
    were attributes of their own until 2026-11-28): `flags_given` still reads them. A training_args.bin saved before
    (those two attributes, a RunSettings without the newer fields) loads, selects its backend, keeps both in
    run_settings and is prepared again where it is loaded. Fails if a settled value is kept beside run_settings, or an
    old file no longer loads, selects its backend or keeps what it recorded."""
    args = ExtTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=4)
    stock = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert set(vars(args)) - set(vars(stock)) - {f.name for f in dataclasses.fields(args)} == {"run_settings"}
    assert args.flags_given == args.run_settings.flags_given == {"output_dir", "use_cpu", "report_to",
                                                                  "per_device_train_batch_size"}
    assert args.run_settings.global_batch.size == 4 and args.run_settings.prepared_in is None
    old_run = dataclasses.replace(args.run_settings)
    for name in ("flags_given", "global_batch", "prepared_in"):  # the fields RunSettings gained on 2026-11-28
        object.__delattr__(old_run, name)
    old = pickle.loads(pickle.dumps(args))
    vars(old).update(run_settings=old_run, flags_given=frozenset({"output_dir"}),
                     global_batch=args.run_settings.global_batch)
    loaded = pickle.loads(pickle.dumps(old))
    assert backend_class(loaded).name == "ddp" and select_backend(loaded).settled is None
    assert loaded.flags_given == {"output_dir"} and loaded.run_settings.global_batch == args.run_settings.global_batch
    assert loaded.run_settings.prepared_in is None and not {"flags_given", "global_batch"} & set(vars(loaded))


def test_prepared_means_this_process_not_a_process_with_the_same_id(tmp_path):
    """prepare_process runs once a process: again on arguments marked prepared by another process, also one with the
    same pid (a container's restart, where each start gets the same small pid, loading training_args.bin). Fails if
    the mark is the process id alone."""
    import os

    from trainer_ext import prepare_process
    from trainer_ext.training.prepare import this_process

    args = ExtTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")  # DDP: no process group
    prepare_process(args)
    assert args.run_settings.prepared_in == this_process()
    args.run_settings = dataclasses.replace(args.run_settings, prepared_in=f"{os.getpid()}-an-earlier-container")
    prepare_process(args)
    assert args.run_settings.prepared_in == this_process()
