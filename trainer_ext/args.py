"""ExtTrainingArguments: transformers' TrainingArguments plus the v4 flags our users still type, validated
at parse time, and the DeepSpeed config resolved against the flags before transformers sees it."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import sys
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser, TrainingArguments

from .cuda_arch import prepare_for_deepspeed
from .errors import UserError, debugging
from .leftovers import clear_leftovers
from .deepspeed_config import load_deepspeed_config, resolve_deepspeed_config
from .options import (FP16_BACKENDS, FP16_OPT_LEVELS, SHARDED_DDP_OPTIONS, ArgumentsError, check_fp16_device,
                      check_sharded_ddp_machine, flag_problems)

logger = logging.getLogger(__name__)


def launched_world_size() -> int:
    """Ranks the launcher (torchrun, torch.distributed.launch, deepspeed) started, from its environment."""
    value = os.environ.get("WORLD_SIZE", "1").strip()
    return int(value) if value.isdigit() else 1


def local_ranks() -> int:
    """Ranks started on this machine: torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(key, "").strip()
        if value.isdigit():
            return int(value)
    return 1


def share_cores_between_cpu_ranks() -> int | None:
    """torchrun and torch.distributed.launch give each of several ranks OMP_NUM_THREADS=1; the deepspeed launcher
    sets nothing, so each CPU rank starts one thread per core and N ranks ask for N times the machine. Give each rank
    its share of the cores, as torchrun would, unless the user chose a number (on 2 cores and MiniLM the stock
    Trainer measured the same either way: benchmarks/results/backends.md). Returns the threads set, or None."""
    ranks = local_ranks()
    if "OMP_NUM_THREADS" in os.environ or ranks < 2:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // ranks)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for processes this one starts
    torch.set_num_threads(threads)
    logger.info("%d CPU ranks on %d cores and OMP_NUM_THREADS unset: %d threads per rank (set OMP_NUM_THREADS to "
                "choose)", ranks, cores, threads)
    return threads


def launch_one_rank_without_launcher() -> bool:
    """`python script.py --deepspeed ...` with no launcher: give this process the variables the deepspeed launcher (or
    accelerate launch) would give a 1-rank job. Without them DeepSpeed looks for MPI and dies importing mpi4py.
    Returns True when it set them."""
    if any(key in os.environ for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return False
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                      MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))
    return True


def accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def quiet_deepspeed_on_cpu_machines() -> None:
    """accelerate imports DeepSpeed whenever it is installed (even for runs that do not use it), and DeepSpeed then
    warns "Setting accelerator to CPU ... we were unable to detect it" on every machine without a GPU: a warning that
    needs no action. DS_ACCELERATOR=cpu is DeepSpeed's own override for the choice it would make anyway, unwarned."""
    if "DS_ACCELERATOR" not in os.environ and not accelerator_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def cpu_ranks(args) -> bool:
    """Whether these arguments train on CPUs (before the device exists): --use_cpu, or no accelerator at all."""
    return bool(getattr(args, "use_cpu", False)) or not accelerator_available()


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
    checkpoint_storage_options: str | None = field(
        default=None, metadata={"help": "fsspec options for --checkpoint_uri as JSON, e.g. "
                                        '\'{"endpoint_url": "http://127.0.0.1:9000"}\'.'}
    )

    def __new__(cls, *args, **kwargs):
        # __new__, not __init__: it sees the constructor's arguments in every dataclass subclass too (each generates
        # its own __init__), before __post_init__ resolves the DeepSpeed file against the flags.
        self = super().__new__(cls)
        self.flags_given = fields_given(cls, args, kwargs)  # deepspeed_config.flag_given reads it
        return self

    def __post_init__(self):
        quiet_deepspeed_on_cpu_machines()
        if problems := flag_problems(self):  # what this machine cannot change; trainer-ext ds-config runs the same
            raise ArgumentsError("\n".join(problems))
        self.deepspeed_user_config = None  # the file as given; re-resolved once the step count is known
        self.deepspeed_resolution = None
        if self.deepspeed:
            launch_one_rank_without_launcher()
            clear_leftovers()  # before transformers' set-up loads DeepSpeed's communication op
            if not cpu_ranks(self):
                prepare_for_deepspeed()  # before any DeepSpeed op is built (FusedAdam, at the first train())
            self.deepspeed_user_config, origin = load_deepspeed_config(self.deepspeed)
            resolution = resolve_deepspeed_config(self, self.deepspeed_user_config, final=False,
                                                  cpu_ranks=cpu_ranks(self))
            for flag, value in resolution.effective_flags.items():
                setattr(self, flag, value)  # so logs and the Trainer tell the truth
            self.deepspeed_resolution = resolution
            self.deepspeed = resolution.config
        from_file = bool(self.deepspeed_resolution and "fp16" in self.deepspeed_resolution.effective_flags)
        check_fp16_device(self.fp16, torch.cuda.is_available(), from_file)
        if self.sharded_ddp:
            check_sharded_ddp_machine(self.sharded_ddp, torch.cuda.is_available(), bool(self.fp16 or self.bf16))
        self.check_output_dir()
        self.check_paths()
        if launched_world_size() > 1 and not self.use_cpu and not accelerator_available():
            # Without it transformers 5 leaves each CPU rank on its own: N independent runs, no error.
            logger.warning("%d ranks launched and no GPU: setting --use_cpu so the ranks form one gloo "
                           "process group", launched_world_size())
            self.use_cpu = True
        if cpu_ranks(self):
            share_cores_between_cpu_ranks()
            if not accelerator_available():
                self.dataloader_pin_memory = False  # nothing to pin for; torch would warn on every dataloader
        super().__post_init__()

    @property
    def place_model_on_device(self):
        # transformers' hook for integrations: FairScale's FSDP with offload keeps the fp32 shards where it finds the
        # model and asserts they are on the CPU, so the Trainer must not move it to the GPU first.
        return False if "offload" in (self.sharded_ddp or []) else super().place_model_on_device

    def check_output_dir(self) -> None:
        """--output_dir is a folder this process can write (or create), checked before any training."""
        output = Path(self.output_dir) if self.output_dir else None
        if output is not None and output.exists() and not output.is_dir():
            raise ArgumentsError(f"--output_dir {output}: is a file, not a folder")
        if output is not None:
            existing = next(p for p in (output, *output.parents) if p.exists())
            if not os.access(existing, os.W_OK | os.X_OK):
                raise ArgumentsError(f"--output_dir {output}: {existing} is not writable")

    def check_paths(self) -> None:
        """What can be checked before the model is loaded (seconds to minutes on a big model): an explicit checkpoint
        exists, and the remote checkpoint location takes a write (main process: one probe object, then deleted)."""
        resume = self.resume_from_checkpoint
        if isinstance(resume, str) and resume not in ("auto", "True", "true") and not os.path.isdir(resume):
            raise ArgumentsError(f"--resume_from_checkpoint {resume}: no such folder (give a checkpoint-N folder, or "
                                 "auto for the newest complete one in --output_dir)")
        self.checkpoint_uri_checked = False
        if self.checkpoint_uri and os.environ.get("RANK", "0") in ("", "0"):
            from .remote import RemoteCheckpoints

            RemoteCheckpoints(self.checkpoint_uri, self.checkpoint_storage_options).check()
            self.checkpoint_uri_checked = True


class ExtArgumentParser(HfArgumentParser):
    """HfArgumentParser that reports bad flags as `error: ...` with exit status 2, before any work starts:
    misspelled flags get the closest valid one, invalid combinations name the option. Abbreviated flags are
    refused: argparse would silently read a typo like --learning_rat as --learning_rate. It records the flags the
    command line names (`flags_given`), so a flag typed at its default still beats a DeepSpeed file."""

    def __init__(self, dataclass_types, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(dataclass_types, **kwargs)

    def error(self, message):
        # argparse would print a usage line of ~150 flags first; the message is what the user needs.
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help for all flags)\n")

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
            hint = difflib.get_close_matches(word, valid, n=1, cutoff=0.6)
            messages.append(f"unrecognized argument {word}" + (f" (did you mean {hint[0]}?)" if hint else ""))
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

    def parse_known_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)  # with any .args file's words HfArgumentParser added
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
