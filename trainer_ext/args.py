"""ExtTrainingArguments: transformers' TrainingArguments plus the v4 flags our users still type, every flag validated at
parse time (all problems at once), and the chosen backend's settings resolved before transformers sees them. Values
only: building them touches nothing transformers' own TrainingArguments does not (trainer_ext.prepare_process sets the
process up)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import typing
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import HfArgumentParser, TrainingArguments

from .backends import (RunSettings, backend_class, flag_classes, missing_library, rank_written, run_settings,
                       selection_problems, settle)
from .checkpoints.format import PATH, CheckpointNotFoundError, resume_request
from .checkpoints.restarts import resumed_order_state
from .config import checks
from .config.batch import split_batch
from .config.checks import REPORT_TO_NAMES, hub_problems, package_problems, read_text_flags, shown_storage_options
from .config.own_flags import OWN_FLAGS
from .config.removed import advice
from .config.settings import write
from .environment.launcher import check_fp16_device, check_rank_variables, prepare_cpu_ranks, resolve_world_size
from .environment.sagemaker import prepare_arguments as prepare_sagemaker
from .environment.sagemaker import spread_lists
from .errors import ArgumentsError, CommandParser, UserError, debugging, unrecognized_arguments

logger = logging.getLogger(__name__)

# The ExtArgumentParser whose command line is being turned into dataclasses right now (it passes every field).
_PARSING: ContextVar[ExtArgumentParser | None] = ContextVar("trainer_ext_parsing", default=None)


def fields_given(cls, args: tuple, kwargs: dict) -> frozenset[str] | None:
    """The fields the user gave to this construction: those on the command line when ExtArgumentParser builds it,
    else the arguments passed (an experiment file, a call from Python). A construction passing every field (plain
    HfArgumentParser, a rebuild from to_dict()) says nothing about what was typed: None."""
    parser = _PARSING.get()
    if parser is not None:
        return parser.flags_given
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    given = frozenset(names[:len(args)]) | frozenset(kwargs)
    return None if given >= set(names) else given


def flag_problems(args) -> list[str]:
    """Every check of the flags that no machine could fix, each backend's own among them (the arguments sit above the
    backends: config/checks.py, below them, is handed the backends' checks)."""
    return checks.flag_problems(args, selection_problems)


# Composed, not declared here: our own flags in groups by concern (config/own_flags.py: each module reads its group
# with flags_of, from stock TrainingArguments too), then the backends' own (FairScale's --sharded_ddp), all before
# TrainingArguments, so transformers' fields come first, then the backends', then ours.
@dataclass
class ExtTrainingArguments(*OWN_FLAGS, *flag_classes(), TrainingArguments):
    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # `class MyArgs(ExtTrainingArguments, SFTConfig)`: dataclass takes each field from the first base listing it,
        # and this class lists every TrainingArguments field with transformers' default, so TRL's defaults (SFTConfig's
        # learning rate 2e-5, logging_steps 10, bf16 None, ...) were lost in silence. Each field gets the default of the
        # class nearest in the MRO that declares it, as Python's own attribute lookup would.
        declared = cls.__dict__.get("__annotations__", {})
        redeclared = {}  # name -> (the nearest declaring class, its Field)
        for name in {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)
                     for f in dataclasses.fields(base)} - set(declared):
            owner = next(base for base in cls.__mro__[1:] if name in base.__dict__.get("__annotations__", {}))
            taken = next(base for base in cls.__mro__[1:] if name in getattr(base, "__dataclass_fields__", {}))
            nearest = owner.__dataclass_fields__[name]
            if nearest is not taken.__dataclass_fields__[name]:
                redeclared[name] = (owner, nearest)
        if redeclared:
            # The type as its owner's module reads it (a string annotation would be read in the subclass's module).
            cls.__annotations__ = {**{name: typing.get_type_hints(owner)[name] for name, (owner, _) in
                                      redeclared.items()}, **declared}
            for name, (_, nearest) in redeclared.items():
                setattr(cls, name, dataclasses.field(
                    default=nearest.default, default_factory=nearest.default_factory, init=nearest.init,
                    repr=nearest.repr, hash=nearest.hash, compare=nearest.compare, metadata=nearest.metadata,
                    kw_only=nearest.kw_only))

    def __new__(cls, *args, **kwargs):
        # __new__, not __init__: it sees the constructor's arguments in every dataclass subclass too (each generates
        # its own __init__), before __post_init__ resolves the DeepSpeed file against the flags.
        if unreached := unreached_fields(cls):
            raise ArgumentsError(unreached)
        self = super().__new__(cls)
        # What the user gave, before anything settles (deepspeed_config.flag_given reads it as `flags_given`).
        write(self, {"run_settings": RunSettings(flags_given=fields_given(cls, args, kwargs))})
        return self

    def __post_init__(self):
        if self.bf16 is None:  # TRL's configs default bf16 to None: on unless fp16, settled before any check reads it
            write(self, {"bf16": not self.fp16})
        check_rank_variables()  # leftover WORLD_SIZE/RANK without a launcher: seconds, not a wait for peers forever
        # In a SageMaker job: where the model and checkpoints go (nothing elsewhere).
        write(self, prepare_sagemaker(self, self.checkpoint_dir, rank_written(self)))
        # What this machine cannot change (trainer-ext ds-config runs the same), then what the flags need here (packages,
        # the Hub).
        if problems := flag_problems(self) + package_problems(self) + hub_problems(self):
            raise ArgumentsError("\n".join(problems))
        write(self, read_text_flags(self))
        # Settled once: the global batch over this start's ranks (--global_batch_size, or the resumed run's), before
        # transformers and accelerate read the per-device batch and accumulation, and the selected backend's settings
        # (DeepSpeed: the config resolved against these flags and that batch), handed to it in run_settings.
        write(self, settle(self, split_batch(self, resolve_world_size(), resumed_order_state(self)), parsing=True))
        if missing := missing_library(backend_class(self), self):  # before transformers or accelerate import it
            raise ArgumentsError(missing)
        check_fp16_device(self.fp16, torch.cuda.is_available())
        self.check_output_dir()
        self.check_paths()
        write(self, prepare_cpu_ranks(self))
        super().__post_init__()
        write(self, backend_class(self).arguments_ready(self))

    def __setstate__(self, state):
        # A training_args.bin saved before 2026-11-28 kept the flags given and the global batch as attributes of their
        # own: they join run_settings, where everything reads them now.
        old = {name: state.pop(name) for name in ("flags_given", "global_batch") if name in state}
        if old and state.get("run_settings") is not None:
            state["run_settings"] = dataclasses.replace(state["run_settings"], **old)
        self.__dict__.update(state)

    def to_dict(self):
        # What TensorBoard's hparams, W&B, MLflow and to_json_string record: credentials in the storage options hidden,
        # as transformers hides hub_token (the run itself uses self.checkpoint_storage_options, unchanged).
        values = super().to_dict()
        if values.get("checkpoint_storage_options"):
            values["checkpoint_storage_options"] = shown_storage_options(values["checkpoint_storage_options"])
        return values

    def __str__(self):
        # transformers' rendering (every field sorted, *_token hidden), the storage options' credentials hidden too.
        values = {key: f"<{key.upper()}>" if key.endswith("_token") else value
                  for key, value in dataclasses.asdict(self).items()}
        if values.get("checkpoint_storage_options"):
            values["checkpoint_storage_options"] = shown_storage_options(values["checkpoint_storage_options"])
        return f"{type(self).__name__}(\n" + "".join(f"{key}={value},\n" for key, value in sorted(values.items())) + ")"

    __repr__ = __str__

    @property
    def flags_given(self) -> frozenset[str] | None:
        """The fields the user gave (RunSettings.flags_given): a flag typed at its default still beats a DeepSpeed
        file."""
        return run_settings(self).flags_given

    @property
    def place_model_on_device(self):
        # transformers' hook for integrations: the backend may need the model where it was built (offload), as it
        # settled (RunSettings).
        decided = run_settings(self).place_model_on_device  # None: while transformers' own __post_init__ runs
        return decided if decided is not None else super().place_model_on_device

    def check_output_dir(self) -> None:
        """--output_dir (and --checkpoint_dir) is a folder this process can write (or create), checked before any
        training."""
        for flag in ("output_dir", "checkpoint_dir"):
            output = Path(getattr(self, flag)) if getattr(self, flag) else None
            if output is not None and output.exists() and not output.is_dir():
                raise ArgumentsError(f"--{flag} {output}: is a file, not a folder")
            if output is not None:
                existing = next(p for p in (output, *output.parents) if p.exists())
                if not existing.is_dir():  # p1/README.md/run: a folder cannot be made inside a file
                    raise ArgumentsError(f"--{flag} {output}: {existing} is a file, so no folder can be made inside "
                                         "it: give a path whose folders are folders")
                if not os.access(existing, os.W_OK | os.X_OK):
                    raise ArgumentsError(f"--{flag} {output}: {existing} is not writable")

    def check_paths(self) -> None:
        """An explicit checkpoint exists, checked before the model is loaded (seconds to minutes on a big model);
        --checkpoint_uri takes a write once the process is prepared (prepare_process)."""
        resume = self.resume_from_checkpoint
        if isinstance(resume, str) and resume_request(resume) == PATH and not os.path.isdir(resume):
            raise CheckpointNotFoundError(f"--resume_from_checkpoint {resume}: no such folder (give a checkpoint-N "
                                          "folder, or auto for the newest complete one in --output_dir)")


def word_or_bool(text: str):
    """A `str | bool` flag's value: true/false (and argparse's other spellings of them) as booleans, other words as
    they are (the field's own check reads them)."""
    from transformers.hf_argparser import string_to_bool

    try:
        return string_to_bool(text)
    except Exception:  # noqa: BLE001 - argparse's ArgumentTypeError: not a boolean word
        return text


def unreached_fields(cls) -> str | None:
    """A subclass combining ExtTrainingArguments with another arguments dataclass (TRL's DPOConfig) without being a
    dataclass itself: its constructor is ExtTrainingArguments', which never sets the other class's fields, and their
    first use failed far from the cause (DPOConfig: `AttributeError: ... no attribute 'loss_type'`)."""
    ours = cls.__dataclass_fields__
    missing = {base.__name__: [name for name in base.__dataclass_fields__ if name not in ours]
               for base in cls.__mro__[1:] if "__dataclass_fields__" in base.__dict__}
    missing = {name: fields for name, fields in missing.items() if fields}
    if not missing:
        return None
    owner, fields = next(iter(missing.items()))
    shown = ", ".join(fields[:3]) + (", ..." if len(fields) > 3 else "")
    return (f"{cls.__name__} combines ExtTrainingArguments with {owner} but is not a dataclass itself, so {owner}'s "
            f"fields ({shown}) are never set: put @dataclass (from dataclasses) above `class {cls.__name__}`")


class ExtArgumentParser(CommandParser, HfArgumentParser):
    """HfArgumentParser that reports bad flags as `error: ...` with exit status 2, before any work starts (as every
    trainer-ext command: CommandParser): misspelled flags get the closest valid one, invalid combinations name the
    option. Abbreviated flags are refused: argparse would silently read a typo like --learning_rat as
    --learning_rate. It records the flags the command line names (`flags_given`), so a flag typed at its default still
    beats a DeepSpeed file."""

    def __init__(self, dataclass_types, **kwargs):
        super().__init__(dataclass_types, **kwargs)
        # HfArgumentParser reads a `str | bool` field as a bool: --include_num_input_tokens_seen non_padding (or all)
        # was refused at parsing ("Truthy value expected"). Such a field takes its words and true/false alike.
        words_or_bool = {field.name for cls in (dataclass_types if isinstance(dataclass_types, (list, tuple))
                                                else [dataclass_types])
                         for field in dataclasses.fields(cls) if typing.get_type_hints(cls).get(field.name) == str | bool}
        for action in self._actions:
            if action.dest in words_or_bool:
                action.type = word_or_bool

    def check_unknown(self, argv) -> None:
        messages = self.unrecognized(argv)
        if messages:
            self.error("; ".join(messages))

    def unrecognized(self, argv) -> list[str]:
        """One message per word of argv this parser does not take: what to type instead of a flag transformers 5
        removed (or another tool's spelling), else the closest valid flag."""
        _, unknown = self.parse_known_args(argv)
        flags = [word.split("=")[0] for word in unknown if word.startswith("-")]
        valid = [option for action in self._actions for option in action.option_strings]
        messages = []
        for word in flags or unknown:
            instead = advice(word) if word.startswith("-") else None
            if instead:
                messages.append(f"unrecognized argument {word}: {instead}")
            elif word in REPORT_TO_NAMES and "--report_to" in valid:  # v4 took --report_to a b
                messages.append(f"unrecognized argument {word}: --report_to takes one word; give several "
                                "integrations separated by commas, e.g. --report_to tensorboard,wandb")
            else:
                messages += unrecognized_arguments([word], valid)
        return messages

    def flags_named(self, argv) -> frozenset[str]:
        """The fields argv names in any spelling the parser accepts (--flag value, --flag=value, --flag-name,
        --no_flag), whatever the value: a flag typed at its default is given."""
        given = set()
        for word in argv:
            if word == "--":
                break
            action = self._option_string_actions.get(str(word).split("=", 1)[0])
            if action is not None:
                given.add(action.dest)
        return frozenset(given)

    def list_flags(self) -> set[str]:
        """The option strings that take several words (nargs + or *)."""
        return {option for action in self._actions if action.nargs in ("+", "*") for option in action.option_strings}

    def parse_known_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)  # with any .args file's words HfArgumentParser added
        argv = spread_lists(argv, self.list_flags())  # a SageMaker list hyperparameter arrives as one word
        self.flags_given = self.flags_named(argv)
        return super().parse_known_args(argv, namespace)

    def parse_args_into_dataclasses(self, args=None, **kwargs):
        argv = sys.argv[1:] if args is None else list(args)
        if not kwargs.get("return_remaining_strings"):
            self.check_unknown(argv)
        parsing = _PARSING.set(self)
        try:
            return super().parse_args_into_dataclasses(args=argv, **kwargs)
        except (UserError, ValueError) as err:  # a bad flag, file or path (or transformers' own checks): exit 2
            if debugging():
                raise
            self.error(str(err))
        finally:
            _PARSING.reset(parsing)
