"""Validation of the flags (trainer_ext's own: --sharded_ddp, --fp16_backend, --warmup_ratio; and the values
transformers accepts but fails on later); pure, no torch."""

from __future__ import annotations

import difflib
import importlib.util
import json

from .errors import UserError

SHARDED_DDP_OPTIONS = ("simple", "zero_dp_2", "zero_dp_3", "offload")
FP16_BACKENDS = ("auto", "amp", "apex")
FP16_OPT_LEVELS = ("O0", "O1", "O2", "O3")


class ArgumentsError(UserError):
    """Flags that cannot work together; raised before any training starts."""


def parse_sharded_ddp(value) -> list[str]:
    """`--sharded_ddp "zero_dp_2 offload"` (or a list) -> ["zero_dp_2", "offload"], with transformers v4 rules."""
    if value is None or value is False or value == "":
        return []
    words = value.split() if isinstance(value, str) else [w for item in value for w in str(item).split()]
    problems = []
    for word in words:
        if word not in SHARDED_DDP_OPTIONS:
            hint = difflib.get_close_matches(word, SHARDED_DDP_OPTIONS, n=1)
            problems.append(f"--sharded_ddp: unknown option {word!r}"
                            + (f", did you mean {hint[0]!r}?" if hint else "")
                            + f" (valid: {', '.join(SHARDED_DDP_OPTIONS)})")
    if problems:
        raise ArgumentsError("\n".join(problems))
    if len(set(words)) != len(words):
        raise ArgumentsError(f"--sharded_ddp {' '.join(words)!r}: an option is repeated")
    if "simple" in words and len(words) > 1:
        raise ArgumentsError(f"--sharded_ddp {' '.join(words)!r}: 'simple' takes no other option; "
                             "use 'simple' alone, or 'zero_dp_2'/'zero_dp_3' [offload]")
    if "zero_dp_2" in words and "zero_dp_3" in words:
        raise ArgumentsError("--sharded_ddp: 'zero_dp_2' and 'zero_dp_3' exclude each other; choose one")
    if "offload" in words and not ({"zero_dp_2", "zero_dp_3"} & set(words)):
        raise ArgumentsError("--sharded_ddp offload needs 'zero_dp_2' or 'zero_dp_3' "
                             "(e.g. --sharded_ddp \"zero_dp_2 offload\")")
    return words


def check_sharded_ddp_machine(options: list[str], cuda_available: bool, mixed_precision: bool) -> None:
    """The FullyShardedDataParallel options need CUDA, and FairScale offloads only in mixed precision."""
    flag = f"--sharded_ddp {' '.join(options)}"
    if ({"zero_dp_2", "zero_dp_3"} & set(options)) and not cuda_available:
        raise ArgumentsError(f"{flag}: FairScale's FullyShardedDataParallel needs CUDA and this machine has none; "
                             "use --sharded_ddp simple (optimizer state sharded, works on CPU)")
    if "offload" in options and not mixed_precision:
        raise ArgumentsError(f"{flag}: FairScale offloads parameters to the CPU only in mixed precision (its FP32 "
                             "master shard lives there); add --fp16 or --bf16")


def check_fp16_device(fp16: bool, cuda_available: bool, from_deepspeed_file: bool) -> None:
    if fp16 and not cuda_available:
        raise ArgumentsError(
            "fp16 needs a CUDA device and this machine has none: use --bf16 (or fp32) on CPU"
            + (" — fp16 comes from the DeepSpeed file's fp16.enabled: set it to \"auto\" (or use "
               "--deepspeed zero2_minimal)" if from_deepspeed_file else ""))


def check_fp16_backend(backend: str, opt_level: str) -> None:
    if backend not in FP16_BACKENDS:
        raise ArgumentsError(f"--fp16_backend {backend!r}: choose one of {', '.join(FP16_BACKENDS)}")
    if opt_level not in FP16_OPT_LEVELS:
        raise ArgumentsError(f"--fp16_opt_level {opt_level!r}: choose one of {', '.join(FP16_OPT_LEVELS)}")
    if backend == "apex" and importlib.util.find_spec("apex") is None:
        raise ArgumentsError("--fp16_backend apex: NVIDIA apex is not installed "
                             "(install it from https://github.com/NVIDIA/apex, or use --fp16_backend amp)")


def merge_warmup_ratio(warmup_steps: float, warmup_ratio: float) -> float:
    """The v4 spelling --warmup_ratio R becomes transformers 5's --warmup_steps R (a float < 1 is a ratio)."""
    if warmup_ratio is None or warmup_ratio == 0:
        return warmup_steps
    if not 0 <= warmup_ratio < 1:
        raise ArgumentsError(f"--warmup_ratio {warmup_ratio}: a ratio must be in [0, 1)")
    if warmup_steps:
        raise ArgumentsError(f"--warmup_ratio {warmup_ratio} and --warmup_steps {warmup_steps} both set "
                             "the warmup: give only one")
    return warmup_ratio


def parse_class_weights(value) -> list[float] | None:
    """`--class_weights 1.0,3.0` (or a list) -> [1.0, 3.0]; every weight positive."""
    if value is None or value == "" or value == []:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        weights = [float(item) for item in items]
    except ValueError:
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
    runs it at parse time and `trainer-ext ds-config` before rendering, so both accept the same flags. Normalises in
    place (--sharded_ddp to a list, --warmup_ratio into --warmup_steps, --class_weights to numbers,
    --checkpoint_storage_options to a dict)."""
    problems: list[str] = []

    def checked(parse, *values, otherwise=None):
        try:
            return parse(*values)
        except ArgumentsError as err:
            problems.append(str(err))
            return otherwise

    args.sharded_ddp = checked(parse_sharded_ddp, args.sharded_ddp, otherwise=[])
    checked(check_fp16_backend, args.fp16_backend, args.fp16_opt_level)
    args.warmup_steps = checked(merge_warmup_ratio, args.warmup_steps, args.warmup_ratio, otherwise=args.warmup_steps)
    args.class_weights = checked(parse_class_weights, args.class_weights)
    args.checkpoint_storage_options = checked(parse_storage_options, args.checkpoint_storage_options, otherwise={})
    if args.sharded_ddp and args.deepspeed:
        problems.append(f"--sharded_ddp {' '.join(args.sharded_ddp)} and --deepspeed both choose a backend: give "
                        "only one of them")
    return problems + value_problems(args)


# Values transformers accepts at parse time and fails on later (a ZeroDivisionError at the first batch, torch's
# "Invalid learning rate" once the model is loaded): flag -> (test, what the value must be).
FLAG_RANGES = {
    **dict.fromkeys(("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"),
                    (lambda value: value >= 1, "must be a positive integer")),
    **dict.fromkeys(("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon"),
                    (lambda value: value >= 0, "must be >= 0")),
    **dict.fromkeys(("adam_beta1", "adam_beta2"), (lambda value: 0 <= value < 1, "must be in [0, 1)")),
}


def out_of_range(flag: str, value) -> str | None:
    """What a value of --flag must be, when this one is not (a DeepSpeed file's value as well as a typed one)."""
    if flag not in FLAG_RANGES:
        return None
    holds, requirement = FLAG_RANGES[flag]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number and {requirement.removeprefix('must be ')}"
    return None if holds(value) else requirement


def value_problems(args) -> list[str]:
    """Flags out of FLAG_RANGES, and a training run with nothing to train."""
    problems = [f"--{flag} {getattr(args, flag)}: {why}" for flag in FLAG_RANGES
                if (why := out_of_range(flag, getattr(args, flag)))]
    if args.do_train and args.max_steps <= 0 and args.num_train_epochs <= 0:
        problems.append(f"--num_train_epochs {args.num_train_epochs} and --max_steps {args.max_steps}: nothing "
                        "to train; give a positive --num_train_epochs or --max_steps")
    return problems
