"""Every check of the flags that no machine could fix, one line per problem, and the readers of the flags that take
text (--class_weights, --checkpoint_storage_options): ExtTrainingArguments runs them when built and `trainer-ext
ds-config` before rendering, so both accept the same flags; and the optional packages the flags' values need on this
machine (training only: a login node renders a GPU cluster's config). Pure: the arguments are read, never changed, and
packages are looked for, never imported."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
from dataclasses import dataclass

from ..errors import ArgumentsError, closest
from ..environment.sagemaker import parse_list
from .optimizer import merge_warmup_ratio
from .ranges import FLAG_RANGES, TRAINING_RANGES, out_of_range

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
    """--checkpoint_storage_options: a JSON object of fsspec options (a dict from Python). Its text is never repeated
    in an error: it may hold credentials."""
    if isinstance(text, dict):
        return dict(text)
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError as err:
        raise ArgumentsError(f"--checkpoint_storage_options is not JSON ({err}; the text is not repeated here, it may "
                             'hold credentials); e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'') from None
    if not isinstance(options, dict):
        raise ArgumentsError(f"--checkpoint_storage_options is a JSON {type(options).__name__}, not an object: give "
                             'one, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'')
    return options


HIDDEN = "<hidden>"
# An fsspec option whose name holds one of these is a credential: s3fs key/secret/token, gcsfs token, adlfs
# account_key/sas_token/connection_string/client_secret, sshfs password, client_kwargs' aws_*_key*.
SECRET_NAMES = ("key", "secret", "token", "password", "passwd", "credential", "connection_string")


def shown_storage_options(options):
    """--checkpoint_storage_options as logs, TensorBoard, experiment trackers and `--check` show them: every option
    named like a credential (SECRET_NAMES, at any depth) reads "<hidden>", as does a password inside a URL; the rest
    (endpoint_url, region_name, ...) stays, to debug with. Text that is not JSON is hidden whole."""
    if isinstance(options, str):
        try:
            options = json.loads(options) if options.strip() else options
        except ValueError:
            return HIDDEN
    return _shown("", options)


def _shown(name, value):
    if isinstance(value, dict):
        return {key: _shown(key, item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_shown(name, item) for item in value]
    if value is not None and any(part in str(name).lower() for part in SECRET_NAMES):
        return HIDDEN
    if isinstance(value, str) and "@" in value and "://" in value:
        from urllib.parse import urlsplit, urlunsplit

        try:
            parts = urlsplit(value)
            if parts.password is not None:
                host = parts.netloc.rsplit("@", 1)[1]
                return urlunsplit(parts._replace(netloc=f"{parts.username}:{HIDDEN}@{host}"))
        except ValueError:  # not a URL after all (a bad port, ...)
            return value
    return value


def shown_flags(flags: list) -> list:
    """A command line as printed: --checkpoint_storage_options' value through shown_storage_options."""
    shown, hide_next = [], False
    for word in map(str, flags):
        if hide_next:
            word, hide_next = json.dumps(shown_storage_options(word)), False
        elif word == "--checkpoint_storage_options":
            hide_next = True
        elif word.startswith("--checkpoint_storage_options="):
            word = "--checkpoint_storage_options=" + json.dumps(shown_storage_options(word.split("=", 1)[1]))
        shown.append(word)
    return shown


@dataclass(frozen=True)
class Package:
    """An optional package a flag's value needs: any of `modules` will do (found, never imported)."""

    modules: tuple[str, ...]
    install: str

    def missing(self) -> bool:
        return not any(module_found(module) for module in self.modules)

    def said(self) -> str:
        return " (or ".join(self.modules) + ")" * (len(self.modules) - 1)


def module_found(name: str) -> bool:
    """Whether `name` (dotted too) can be imported, found without importing it or its parents."""
    spec = importlib.util.find_spec(name.split(".")[0])
    for depth in range(1, name.count(".") + 1):
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(".".join(name.split(".")[:depth + 1]),
                                                         list(spec.submodule_search_locations))
    return spec is not None


BITSANDBYTES = Package(("bitsandbytes",), "pip install bitsandbytes")
GALORE = Package(("galore_torch",), "pip install galore-torch")
APOLLO = Package(("apollo_torch",), "pip install apollo-torch")
SCHEDULE_FREE = Package(("schedulefree",), "pip install schedulefree")
MLFLOW = Package(("mlflow",), "pip install mlflow")
# --optim values whose optimizer transformers imports from a package of its own (transformers/trainer_optimizer.py);
# the others are torch's or transformers' (OPTIM_IN_TORCH). A test walks OptimizerNames so none is missed.
OPTIM_PACKAGES = {
    **dict.fromkeys(("adamw_bnb_8bit", "adamw_8bit", "ademamix", "ademamix_8bit", "lion_8bit", "lion_32bit",
                     "paged_adamw_32bit", "paged_adamw_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit",
                     "paged_lion_32bit", "paged_lion_8bit", "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit"),
                    BITSANDBYTES),
    **dict.fromkeys(("adamw_torch_4bit", "adamw_torch_8bit"), Package(("torchao",), "pip install torchao")),
    **dict.fromkeys(("galore_adamw", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise",
                     "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise"), GALORE),
    **dict.fromkeys(("apollo_adamw", "apollo_adamw_layerwise"), APOLLO),
    **dict.fromkeys(("lomo", "adalomo"), Package(("lomo_optim",), "pip install lomo-optim")),
    **dict.fromkeys(("schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd"), SCHEDULE_FREE),
    "grokadamw": Package(("grokadamw",), "pip install grokadamw"),
    "stable_adamw": Package(("optimi",), "pip install torch-optimi"),
    "adamw_anyprecision": Package(("torchdistx",), "install it from https://github.com/pytorch/torchdistx"),
    "adamw_torch_xla": Package(("torch_xla",), "pip install torch-xla"),
    "adamw_torch_npu_fused": Package(("torch_npu",), "pip install torch-npu"),
}
OPTIM_IN_TORCH = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop")
# --report_to integrations and what transformers' callback for each requires (integrations/integration_utils.py);
# "all" takes the installed ones, "kubeflow" is an environment variable, not a package.
REPORT_TO_PACKAGES = {
    "azure_ml": (Package(("azureml.core.run",), "pip install azureml-sdk"),),
    "clearml": (Package(("clearml",), "pip install clearml"),),
    "codecarbon": (Package(("codecarbon",), "pip install codecarbon"),),
    "comet_ml": (Package(("comet_ml",), "pip install comet-ml"),),
    "dagshub": (MLFLOW, Package(("dagshub",), "pip install dagshub")),
    "dvclive": (Package(("dvclive",), "pip install dvclive"),),
    "flyte": (Package(("flytekit",), "pip install flytekit"),),
    "mlflow": (MLFLOW,),
    "neptune": (Package(("neptune",), "pip install neptune"),),
    "swanlab": (Package(("swanlab",), "pip install swanlab"),),
    "tensorboard": (Package(("tensorboard", "tensorboardX"), "pip install tensorboard"),),
    "trackio": (Package(("trackio",), "pip install trackio"),),
    "wandb": (Package(("wandb",), "pip install wandb"),),
}
LIGER_KERNEL = Package(("liger_kernel",), "pip install liger-kernel")
# Every --report_to integration transformers knows (a test holds it to transformers' INTEGRATION_TO_CALLBACK), and the
# two words that stand alone.
REPORT_TO_NAMES = (*sorted(REPORT_TO_PACKAGES), "kubeflow")
REPORT_TO_ALONE = ("all", "none")


def report_to_names(value) -> list[str]:
    """--report_to as a list of names: one word, several separated by commas (the command line takes one word since
    transformers 5), a list, or a list's text (a SageMaker job passes a list hyperparameter as str() of it)."""
    if value is None:
        return []
    if isinstance(value, str) and value.strip().startswith("[") and value.strip().endswith("]"):
        try:
            value = parse_list(value.strip())
        except ArgumentsError:
            pass  # named as it is below
    items = [value] if isinstance(value, str) else list(value)
    return [name.strip() for item in items for name in str(item).split(",") if name.strip()]


def report_to_problems(args) -> list[str]:
    """Names transformers does not report to (it fails only when the trainer is built, after the data and model
    loaded), and "all" or "none" beside other names (transformers reads them as integrations there)."""
    value = args.report_to
    names = report_to_names(value)
    shown = ",".join(names)
    problems = []
    for name in names:
        if name in REPORT_TO_ALONE and len(names) > 1:
            problems.append(f"--report_to {shown}: {name!r} stands alone; give it alone or drop it")
        elif name not in REPORT_TO_NAMES + REPORT_TO_ALONE:
            hint = closest(name, REPORT_TO_NAMES + REPORT_TO_ALONE)
            problems.append(f"--report_to {name}: not an integration transformers reports to"
                            + (f", did you mean {hint!r}?" if hint else "")
                            + f" (valid: {', '.join(REPORT_TO_ALONE + REPORT_TO_NAMES)})")
    return problems


def package_problems(args) -> list[str]:
    """Flags whose value needs an optional package this environment lacks: --use_liger_kernel, --optim, --report_to.
    transformers would fail only once the data and model are loaded (or the first trainer is built). A check of this
    machine: training runs it, `trainer-ext ds-config` does not."""
    needed = []
    if args.use_liger_kernel:
        needed.append(("--use_liger_kernel", "true", LIGER_KERNEL))
    optim = getattr(args.optim, "value", args.optim)
    if optim in OPTIM_PACKAGES:
        needed.append(("--optim", optim, OPTIM_PACKAGES[optim]))
    for name in report_to_names(args.report_to):
        needed += [("--report_to", name, package) for package in REPORT_TO_PACKAGES.get(name, ())]
    return [f"{flag} {value}: needs {package.said()}, which is not installed: {package.install}"
            for flag, value, package in needed if package.missing()]


def hub_problems(args) -> list[str]:
    """--push_to_hub where the Hub is switched off (HF_HUB_OFFLINE): transformers' Trainer creates the repository when
    it is built, after data and model are loaded, and failed with huggingface_hub's OfflineModeIsEnabled traceback. A
    check of this machine, as package_problems."""
    if not args.push_to_hub:
        return []
    from huggingface_hub import is_offline_mode

    if not is_offline_mode():
        return []
    return ["--push_to_hub: HF_HUB_OFFLINE is set, so nothing can reach the Hub: drop --push_to_hub (the model is saved "
            "in --output_dir; push it later with huggingface-cli upload), or unset HF_HUB_OFFLINE"]


TOKENS_SEEN = ("non_padding", "all", "no")  # --include_num_input_tokens_seen's words (or true / false)


def flag_problems(args, backend_problems) -> list[str]:
    """Every check of the flags that does not depend on this machine, one line per problem, with the backends' own
    (`backend_problems`: trainer_ext.args, a floor above the backends, passes backends.selection_problems:
    each backend's owned_flag_problems, and more than one chosen). Reads `args` only: what the text flags stand for is
    read_text_flags'."""
    problems: list[str] = []

    def checked(parse, *values):
        try:
            parse(*values)
        except ArgumentsError as err:
            problems.append(str(err))

    checked(check_fp16_backend, args.fp16_backend, args.fp16_opt_level)
    if args.fp16 and args.bf16:  # transformers refuses it too, but only after our checks, one problem per run
        problems.append("--fp16 and --bf16 both set the precision: give only one (--bf16 on CPUs and on Ampere or "
                        "newer GPUs, --fp16 on older GPUs)")
    if args.use_cpu and args.fp16:  # whatever this machine has: a preview says it too
        problems.append("--fp16 with --use_cpu: fp16 needs a CUDA device and --use_cpu trains on the CPU; use --bf16 "
                        "(or fp32) on CPU, or drop --use_cpu")
    given = getattr(args, "flags_given", None) or ()
    if {"warmup_steps", "warmup_ratio"} <= set(given) and args.warmup_ratio and not args.warmup_steps:
        # --warmup_steps 0 typed beside a ratio: two answers to one question, whichever value the steps have
        problems.append(f"--warmup_ratio {args.warmup_ratio} and --warmup_steps {args.warmup_steps:g} both set the "
                        "warmup: give only one")
    checked(merge_warmup_ratio, args.warmup_steps, args.warmup_ratio)
    sampling = getattr(args, "train_sampling_strategy", "random")
    if sampling != "random" and "train_sampling_strategy" in given:  # ExtTrainer's order asks for no sampler
        problems.append(f"--train_sampling_strategy {sampling}: ExtTrainer trains in its own order (shuffled by "
                        "--seed/--data_seed each epoch, resumed exactly), which this option would not change: drop it")
    checked(parse_class_weights, args.class_weights)
    checked(parse_storage_options, args.checkpoint_storage_options)
    tokens_seen = args.include_num_input_tokens_seen
    if not isinstance(tokens_seen, bool) and tokens_seen not in TOKENS_SEEN:  # transformers counted none, silently
        problems.append(f"--include_num_input_tokens_seen {tokens_seen}: choose non_padding (the samples' own tokens), "
                        "all (padding too) or no" + (f" (did you mean {hint}?)" if (hint := closest(
                            str(tokens_seen), TOKENS_SEEN)) else ""))
    return problems + report_to_problems(args) + backend_problems(args) + value_problems(args)


def read_text_flags(args) -> dict:
    """What the flags given as text stand for, once flag_problems found none: --warmup_ratio as transformers 5's
    --warmup_steps, --class_weights as numbers, --checkpoint_storage_options as a dict, --report_to a,b as a list,
    --include_num_input_tokens_seen true as non_padding (transformers reads True as "all", padding included)."""
    report_to = args.report_to
    if report_to is not None and not (isinstance(report_to, str) and report_to == "".join(report_to_names(report_to))):
        report_to = report_to_names(report_to)
    return {"warmup_steps": merge_warmup_ratio(args.warmup_steps, args.warmup_ratio),
            "class_weights": parse_class_weights(args.class_weights),
            "checkpoint_storage_options": parse_storage_options(args.checkpoint_storage_options),
            "report_to": report_to,
            "include_num_input_tokens_seen": "non_padding" if args.include_num_input_tokens_seen is True
            else args.include_num_input_tokens_seen}


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
