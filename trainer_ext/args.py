"""ExtTrainingArguments: transformers' TrainingArguments plus the v4 flags our users still type, every flag validated at
parse time (all problems at once), and the chosen backend's settings resolved before transformers sees them. Values
only: building them touches nothing transformers' own TrainingArguments does not (trainer_ext.prepare_process sets the
process up)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import sys
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser, TrainingArguments

from .backends import backend_class, selection_problems
from .backends.fairscale import OPTIONS as SHARDED_DDP_OPTIONS
from .deepspeed_config import FLAG_RANGES, out_of_range
from .checkpoint import CheckpointNotFoundError
from .errors import ArgumentsError, UserError, closest, debugging, main_process
from .runtime import check_fp16_device, check_rank_variables, prepare_cpu_ranks
from .sagemaker import parse_list
from .sagemaker import prepare_arguments as prepare_sagemaker
from .sagemaker import spread_lists
from .settings import merge_warmup_ratio

logger = logging.getLogger(__name__)

FP16_BACKENDS = ("auto", "amp", "apex")
FP16_OPT_LEVELS = ("O0", "O1", "O2", "O3")


def check_fp16_backend(backend: str, opt_level: str) -> None:
    if backend not in FP16_BACKENDS:
        raise ArgumentsError(f"--fp16_backend {backend!r}: choose one of {', '.join(FP16_BACKENDS)}")
    if opt_level not in FP16_OPT_LEVELS:
        raise ArgumentsError(f"--fp16_opt_level {opt_level!r}: choose one of {', '.join(FP16_OPT_LEVELS)}")
    if backend == "apex" and importlib.util.find_spec("apex") is None:
        raise ArgumentsError("--fp16_backend apex: NVIDIA apex is not installed "
                             "(install it from https://github.com/NVIDIA/apex, or use --fp16_backend amp)")


def parse_class_weights(value) -> list[float] | None:
    """`--class_weights 1.0,3.0`, a JSON list `[1.0, 3.0]` (how SageMaker passes a list hyperparameter) or a list ->
    [1.0, 3.0]; every weight positive."""
    if value is None or value == "" or value == []:
        return None
    try:
        if isinstance(value, str) and value.strip().startswith("["):
            items = parse_list(value.strip())
        else:
            items = value.split(",") if isinstance(value, str) else list(value)
        weights = [float(item) for item in items]
    except (ValueError, TypeError):
        raise ArgumentsError(f"--class_weights {value!r}: give numbers separated by commas, e.g. 1.0,3.0") from None
    if len(weights) < 2 or any(w <= 0 for w in weights):
        raise ArgumentsError(f"--class_weights {value!r}: need one positive weight per class (at least two)")
    return weights


def parse_storage_options(text: str | dict | None) -> dict:
    """--checkpoint_storage_options: a JSON object of fsspec options (a dict from Python)."""
    if isinstance(text, dict):
        return dict(text)
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError as err:
        raise ArgumentsError(f"--checkpoint_storage_options {text!r} is not JSON ({err}); e.g. "
                             '\'{"endpoint_url": "http://127.0.0.1:9000"}\'') from None
    if not isinstance(options, dict):
        raise ArgumentsError(f"--checkpoint_storage_options {text!r} must be a JSON object")
    return options


def flag_problems(args) -> list[str]:
    """Every check of the flags that does not depend on this machine, one line per problem: ExtTrainingArguments
    runs it at parse time and `trainer-ext ds-config` before rendering, so both accept the same flags; each backend
    checks its own. Normalises in place (--sharded_ddp to a list, --warmup_ratio into --warmup_steps, --class_weights
    to numbers, --checkpoint_storage_options to a dict)."""
    problems: list[str] = []

    def checked(parse, *values, otherwise=None):
        try:
            return parse(*values)
        except ArgumentsError as err:
            problems.append(str(err))
            return otherwise

    checked(check_fp16_backend, args.fp16_backend, args.fp16_opt_level)
    if getattr(args, "use_cpu", False) and args.fp16:  # whatever this machine has: a preview says it too
        problems.append("--fp16 with --use_cpu: fp16 needs a CUDA device and --use_cpu trains on the CPU; use --bf16 "
                        "(or fp32) on CPU, or drop --use_cpu")
    given = getattr(args, "flags_given", None) or ()
    if {"warmup_steps", "warmup_ratio"} <= set(given) and args.warmup_ratio and not args.warmup_steps:
        # --warmup_steps 0 typed beside a ratio: two answers to one question, whichever value the steps have
        problems.append(f"--warmup_ratio {args.warmup_ratio} and --warmup_steps {args.warmup_steps:g} both set the "
                        "warmup: give only one")
    args.warmup_steps = checked(merge_warmup_ratio, args.warmup_steps, args.warmup_ratio, otherwise=args.warmup_steps)
    args.class_weights = checked(parse_class_weights, args.class_weights)
    args.checkpoint_storage_options = checked(parse_storage_options, args.checkpoint_storage_options, otherwise={})
    return problems + selection_problems(args) + value_problems(args)


STEPS = "a whole number of steps, or a ratio in (0, 1) of the training steps"
# Values transformers would silently replace or ignore (TrainingArguments.__post_init__ and the Trainer, 5.23): each
# flag -> (holds for the value, what it must be). None (unset) always holds.
TRAINING_RANGES = {
    "logging_steps": (lambda v: v > 0, f"must be > 0 ({STEPS}); transformers would log at negative multiples"),
    "eval_steps": (lambda v: v > 0, f"must be > 0 ({STEPS}); transformers would use --logging_steps instead (leave "
                                    "it unset for that)"),
    "save_steps": (lambda v: v > 0, f"must be > 0 ({STEPS}); transformers would never save (--save_strategy no "
                                    "says that)"),
    "save_total_limit": (lambda v: v >= 1, "must be at least 1; transformers would keep every checkpoint (leave it "
                                           "unset for that)"),
    "max_steps": (lambda v: v == -1 or v > 0, "must be a positive number of steps, or -1 to train "
                                              "--num_train_epochs (transformers would ignore it)"),
    "num_train_epochs": (lambda v: v >= 0, "must be >= 0"),
    "eval_delay": (lambda v: v >= 0, "must be >= 0 (steps or epochs before the first evaluation)"),
    "label_smoothing_factor": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "dataloader_num_workers": (lambda v: v >= 0, "must be >= 0 (0: load in the main process)"),
    "eval_accumulation_steps": (lambda v: v >= 1, "must be at least 1"),
    "seed": (lambda v: 0 <= v < 2 ** 32, "must be in [0, 2**32) (numpy's seed range)"),
    "data_seed": (lambda v: 0 <= v < 2 ** 32, "must be in [0, 2**32) (numpy's seed range)"),
}


def value_problems(args) -> list[str]:
    """Flags out of FLAG_RANGES or TRAINING_RANGES, and a training run with nothing to train."""
    problems = [f"--{flag} {getattr(args, flag)}: {why}" for flag in FLAG_RANGES
                if (why := out_of_range(flag, getattr(args, flag)))]
    for flag, (holds, requirement) in TRAINING_RANGES.items():
        value = getattr(args, flag, None)
        if value is not None and isinstance(value, (int, float)) and not isinstance(value, bool) and not holds(value):
            problems.append(f"--{flag} {value:g}: {requirement}")
    if args.do_train and args.max_steps <= 0 and args.num_train_epochs <= 0:
        problems.append(f"--num_train_epochs {args.num_train_epochs} and --max_steps {args.max_steps}: nothing "
                        "to train; give a positive --num_train_epochs or --max_steps")
    return problems


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


@dataclass
class ExtTrainingArguments(TrainingArguments):
    sharded_ddp: list[str] | None = field(
        default=None,
        metadata={"help": "FairScale sharded DDP: 'simple', or 'zero_dp_2'/'zero_dp_3' optionally with 'offload' "
                          f"(space separated). Options: {', '.join(SHARDED_DDP_OPTIONS)}."},
    )
    fp16_backend: str = field(
        default="auto", metadata={"help": "Mixed precision backend for --fp16.", "choices": list(FP16_BACKENDS)}
    )
    fp16_opt_level: str = field(
        default="O1", metadata={"help": "Apex AMP optimisation level.", "choices": list(FP16_OPT_LEVELS)}
    )
    warmup_ratio: float = field(
        default=0.0, metadata={"help": "transformers v4 spelling: warm up over this fraction of the training steps."}
    )
    fresh_start: bool = field(
        default=False, metadata={"help": "Start over even if output_dir holds checkpoints (by default a run "
                                         "resumes from the newest complete one)."}
    )
    class_weights: str | None = field(
        default=None, metadata={"help": "Classification loss weight per class, comma separated, e.g. 1.0,3.0."}
    )
    checkpoint_uri: str | None = field(
        default=None, metadata={"help": "Copy every complete checkpoint here (any fsspec URL: s3://bucket/prefix, "
                                        "gs://..., a local path); start from the newest one when output_dir has none."}
    )
    repeat_small_dataset: bool = field(
        default=False, metadata={"help": "Train although one global batch is larger than the training data (each "
                                         "step then repeats its samples); refused otherwise."}
    )
    checkpoint_storage_options: str | None = field(
        default=None, metadata={"help": "fsspec options for --checkpoint_uri as JSON, e.g. "
                                        '\'{"endpoint_url": "http://127.0.0.1:9000"}\'.'}
    )
    checkpoint_dir: str | None = field(
        default=None, metadata={"help": "Write checkpoints here and resume from here (default: output_dir; in a "
                                        "SageMaker job, the folder synced with checkpoint_s3_uri)."}
    )

    def __new__(cls, *args, **kwargs):
        # __new__, not __init__: it sees the constructor's arguments in every dataclass subclass too (each generates
        # its own __init__), before __post_init__ resolves the DeepSpeed file against the flags.
        self = super().__new__(cls)
        self.flags_given = fields_given(cls, args, kwargs)  # deepspeed_config.flag_given reads it
        return self

    def __post_init__(self):
        check_rank_variables()  # leftover WORLD_SIZE/RANK without a launcher: seconds, not a wait for peers forever
        prepare_sagemaker(self)  # in a SageMaker job: where the model and checkpoints go; nothing elsewhere
        if problems := flag_problems(self):  # what this machine cannot change; trainer-ext ds-config runs the same
            raise ArgumentsError("\n".join(problems))
        self.deepspeed_resolution = None  # set by the DeepSpeed backend: the config resolved against these flags
        backend_class(self).prepare_arguments(self)
        if missing := backend_class(self).missing_library(self):  # before transformers or accelerate import it
            raise ArgumentsError(missing)
        check_fp16_device(self.fp16, torch.cuda.is_available(), from_deepspeed_file=False)
        self.check_output_dir()
        self.check_paths()
        prepare_cpu_ranks(self)
        super().__post_init__()
        backend_class(self).arguments_ready(self)

    @property
    def place_model_on_device(self):
        # transformers' hook for integrations: the backend may need the model where it was built (offload).
        decided = backend_class(self).places_model_on_device(self)
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
                if not os.access(existing, os.W_OK | os.X_OK):
                    raise ArgumentsError(f"--{flag} {output}: {existing} is not writable")

    def check_paths(self) -> None:
        """An explicit checkpoint exists, checked before the model is loaded (seconds to minutes on a big model);
        --checkpoint_uri takes a write once the process is prepared (prepare_process)."""
        from .checkpoint import PATH, resume_request

        resume = self.resume_from_checkpoint
        if isinstance(resume, str) and resume_request(resume) == PATH and not os.path.isdir(resume):
            raise CheckpointNotFoundError(f"--resume_from_checkpoint {resume}: no such folder (give a checkpoint-N folder, or "
                                 "auto for the newest complete one in --output_dir)")


class ExtArgumentParser(HfArgumentParser):
    """HfArgumentParser that reports bad flags as `error: ...` with exit status 2, before any work starts:
    misspelled flags get the closest valid one, invalid combinations name the option. Abbreviated flags are
    refused: argparse would silently read a typo like --learning_rat as --learning_rate. It records the flags the
    command line names (`flags_given`), so a flag typed at its default still beats a DeepSpeed file."""

    def __init__(self, dataclass_types, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(dataclass_types, **kwargs)

    def error(self, message):
        # argparse would print a usage line of ~150 flags first; the message is what the user needs, once on N ranks.
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help for all flags)\n" if main_process()
                  else None)

    def check_unknown(self, argv) -> None:
        messages = self.unrecognized(argv)
        if messages:
            self.error("; ".join(messages))

    def unrecognized(self, argv) -> list[str]:
        """One message per word of argv this parser does not take, with the closest valid flag."""
        _, unknown = self.parse_known_args(argv)
        flags = [word.split("=")[0] for word in unknown if word.startswith("-")]
        valid = [option for action in self._actions for option in action.option_strings]
        messages = []
        for word in flags or unknown:
            hint = closest(word, valid)
            messages.append(f"unrecognized argument {word}" + (f" (did you mean {hint}?)" if hint else ""))
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
