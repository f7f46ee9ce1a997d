"""`trainer-ext` command line: thin subcommands over the modules of the package."""

from __future__ import annotations

import json
import sys

USAGE = """usage: trainer-ext COMMAND [options]   (trainer-ext --version: the versions a bug report needs)

commands:
  ds-config   print the complete DeepSpeed config for a file and TrainingArguments flags
              trainer-ext ds-config --deepspeed FILE|PRESET [flags] [--world_size N]
                                    [--num_training_steps N] [--hidden_size N] [--use_cpu] [--explain]
  train       validate an experiment file, then train it (task, hyperparameters, data, backend)
              trainer-ext train experiment.yaml [--check] [--FIELD VALUE ...]   (flags override the file)
              on N ranks: torchrun --nproc_per_node N -m trainer_ext train experiment.yaml
                          deepspeed --num_gpus N --module trainer_ext train experiment.yaml
  search      hyperparameter search: each trial trains the experiment under the launcher given, in
              <study_dir>/trial-N; the study (Optuna, SQLite by default) continues after a kill
              trainer-ext search experiment.yaml [--launcher python|torchrun|deepspeed|torch.distributed.launch]
                                 [--nproc_per_node N] [--parallel_trials N] [--max_trials N] [--study_dir DIR]
                                 [--keep_checkpoints] [--check] [--FIELD VALUE ...]   (flags: every trial)
  build-ops   build DeepSpeed's ops ahead of the first run (once per environment; minutes each)
              trainer-ext build-ops [--only OP ...]
  merge       fold a LoRA adapter (a run's output or checkpoint) into its base model: a plain model folder
              trainer-ext merge ADAPTER_DIR --output_dir DIR [--base_model PATH] [--dtype float32|bfloat16|float16]
  plan        predict per-rank memory of every backend and name the cheapest that fits a device
              trainer-ext plan --model PATH|--num_parameters N --world_size N [--fp16|--bf16] [--offload]
                               [--per_device_train_batch_size N] [--max_seq_length N (packed length)]
                               [--gradient_checkpointing] [--attention sdpa|eager] [--device_memory 80GB]
                               [--lora_r R [--lora_target_modules q_proj,v_proj,...|all-linear]
                                [--lora_dropout P] [--lora_alpha A] [--lora_dora] [--lora_rslora]
                                [--lora_modules_to_save embed_tokens,lm_head] [--load_in_4bit]]
                               [--chunked_loss true|false] [--json]
"""


def ds_config(argv: list[str]) -> int:
    from .backends.deepspeed.backend import resolve_checked
    from .config.batch import split_batch
    from .environment.launcher import launched_world_size
    from .errors import UserError
    from .args import ExtArgumentParser, ExtTrainingArguments, flag_problems
    from .deepspeed_config import DeepSpeedConfigError, explain
    from .config.settings import write
    from .deepspeed_config.passes import nvme_offloads

    parser = ExtArgumentParser(ExtTrainingArguments, prog="trainer-ext ds-config",
                               description="Resolve a DeepSpeed config against TrainingArguments flags.")
    parser.add_argument("--world_size", type=int, default=None, help="data-parallel ranks of the target run")
    parser.add_argument("--num_training_steps", type=int, default=None, help="optimizer steps of the run")
    parser.add_argument("--hidden_size", type=int, default=None, help="model hidden size (sizes 'auto' buckets)")
    parser.add_argument("--explain", action="store_true", help="print each field and where its value came from")
    parser.check_unknown(argv)
    # A namespace, not TrainingArguments: rendering a config for a GPU cluster must work on a CPU login node.
    args = parser.parse_args(argv)
    write(args, {"flags_given": parser.flags_given})  # a flag typed at its default still beats the file, as in training
    problems = flag_problems(args)  # training's own checks, less those of this machine
    problems += [f"--{name} {value}: must be at least 1" for name in ("world_size", "num_training_steps", "hidden_size")
                 if (value := getattr(args, name)) is not None and value < 1]
    if problems:
        parser.error("\n".join(problems))
    try:  # --global_batch_size split over the target's ranks, as training splits it
        batch = split_batch(args, args.world_size or launched_world_size(), None)
    except UserError as err:
        parser.error(str(err))
    write(args, batch.fields())
    try:
        resolution = resolve_checked(args, args.deepspeed or {}, world_size=args.world_size,
                                     num_training_steps=args.num_training_steps, hidden_size=args.hidden_size,
                                     cpu_ranks=args.use_cpu, global_batch=batch)
    except DeepSpeedConfigError as err:
        print(f"trainer-ext ds-config: error: {err}", file=sys.stderr)
        return 2
    print(explain(resolution) if args.explain else json.dumps(resolution.config, indent=2))
    if not args.explain:  # the notes training says with its settings (--explain lists them)
        for note in resolution.notes:
            print(f"trainer-ext ds-config: note: {note}", file=sys.stderr)
    for field, path in nvme_offloads(resolution.config):  # a machine's folder: this may be a login node
        print(f"trainer-ext ds-config: note: {field} {path} is not checked here; training checks on each machine, "
              "before any work, that it is a folder there that it can write", file=sys.stderr)
    return 0


def train(argv: list[str]) -> int:
    import logging

    from .experiment import ExperimentError, load_experiment
    from .errors import CommandParser

    parser = CommandParser(prog="trainer-ext train",
                           description="Validate an experiment file, then train it.",
                           epilog="Relative paths in the file are relative to its folder. Any other flag "
                                  "of the task's model, data or training arguments (those of its script in "
                                  "examples/) overrides the file's value, e.g. --max_steps 5 --learning_rate "
                                  "1e-4; paths given as flags are relative to the current directory.")
    parser.add_argument("experiment", help="YAML file with task, hyperparameters, data and a backend")
    parser.add_argument("--check", action="store_true", help="validate only: print the resolved values")
    args, flags = parser.parse_known_args(experiment_first(argv))
    flags, misspelled = own_flags_misspelled(parser, flags)
    if misspelled:
        parser.error("; ".join(misspelled))
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    try:
        experiment = load_experiment(args.experiment, flags)
    except ExperimentError as err:
        print(f"trainer-ext train: error: {err}\nnothing was trained", file=sys.stderr)
        return 2
    if args.check:
        import yaml

        from .config.checks import shown_storage_options

        # through JSON: enums (lr_scheduler_type) and paths become the strings a YAML file holds
        resolved = json.loads(json.dumps(experiment.resolved(), default=str))
        if resolved["training"].get("checkpoint_storage_options"):  # printed without its credentials
            resolved["training"]["checkpoint_storage_options"] = shown_storage_options(
                resolved["training"]["checkpoint_storage_options"])
        print(yaml.safe_dump(resolved, sort_keys=False), end="")
        return 0
    from .search.callback import trial_callback
    from .tasks.driver import report

    trial = trial_callback()  # a trial of `trainer-ext search`: its evaluations reach the study's pruner
    metrics = experiment.run(callbacks=[trial] if trial else [])
    if experiment.training_args.process_index == 0:
        print(json.dumps(metrics, indent=2, default=str))
    report(experiment.task, metrics, experiment.training_args)  # the recipe's last lines, as its example prints them
    return 0


def experiment_first(argv: list[str]) -> list[str]:
    """The experiment file first: argparse would read `--max_steps 5 exp.yaml`'s 5 as the file, since the task's own
    flags (which take a value) are unknown to it. One .yaml/.yml word is the file, wherever it stands."""
    files = [word for word in argv if not word.startswith("-") and word.lower().endswith((".yaml", ".yml"))]
    if len(files) != 1:
        return argv
    rest = list(argv)
    rest.remove(files[0])
    return [files[0], *rest]


def search_parser():
    """`trainer-ext search`'s own flags (every other flag goes to the trials)."""
    from .errors import CommandParser

    parser = CommandParser(prog="trainer-ext search",
                           description="Search the hyperparameters of an experiment file's search section.",
                           epilog="Any other flag of `trainer-ext train` is given to every trial, e.g. "
                                  "--max_steps 200. A stopped or killed search continues when the same "
                                  "command runs again.")
    parser.add_argument("experiment", help="YAML file with a search section")
    parser.add_argument("--launcher", default="python", help="python (one process, default), torchrun, deepspeed "
                                                             "or torch.distributed.launch")
    parser.add_argument("--nproc_per_node", "--num_gpus", type=int, default=1, help="ranks of each trial")
    parser.add_argument("--parallel_trials", type=int, help="trials at a time (default: the file's, else 1)")
    parser.add_argument("--max_trials", type=int, help="trials in the study (default: the file's, else 10)")
    parser.add_argument("--study_dir", help="folder of study.db and trial-N (default: the file's, else "
                                            "<output_dir>/search)")
    parser.add_argument("--storage", help="the study's database as an SQLAlchemy URL, e.g. postgresql://user@host/db "
                                          "(default: the file's, else SQLite in the study folder); every worker of a "
                                          "study on several machines gives the same one")
    parser.add_argument("--keep_checkpoints", action="store_true", help="keep every trial's checkpoints and "
                                                                       "weights (default: the best trial's only)")
    parser.add_argument("--check", action="store_true", help="validate only: print the search and a trial's command")
    return parser


def search(argv: list[str]) -> int:
    import os

    parser = search_parser()
    args, flags = parser.parse_known_args(experiment_first(argv))
    flags, misspelled = own_flags_misspelled(parser, flags)

    from .search import require_optuna
    from .search.check import validate
    from .search.launch import Launcher
    from .search.runner import Search
    from .search.space import SearchSettings

    require_optuna()
    launcher = Launcher(args.launcher, args.nproc_per_node)
    overrides = {"max_trials": args.max_trials, "parallel_trials": args.parallel_trials, "study_dir": args.study_dir,
                 "storage": args.storage}
    try:
        result = validate(args.experiment, flags, overrides)
    except KeyboardInterrupt:  # nothing started yet
        return 130
    problems = misspelled + result["problems"] + launcher.problems()
    problems += [f"--{key} {value}: must be at least 1" for key, value in overrides.items()
                 if isinstance(value, int) and value < 1]
    if problems:
        print("trainer-ext search: error: " + "\n".join(problems) + "\nnothing was trained", file=sys.stderr)
        return 2
    for warning in result["warnings"]:
        print(f"trainer-ext search: warning: {warning}", file=sys.stderr)
    settings = SearchSettings.from_dict(result["settings"])
    experiment = os.path.abspath(args.experiment)
    if args.check:
        print(search_as_checked(settings), end="")
        from .config.checks import shown_flags

        print("each trial:", *launcher.command(), "train", experiment, *shown_flags(flags), "--output_dir",
              f"{settings.study_dir}/trial-N", "--FIELD VALUE ...")
        return 0
    return Search(settings, experiment, flags, launcher, args.keep_checkpoints, result["configs"],
                  result["checkpoint_uri"], result["storage_options"]).run()


def own_flags_misspelled(parser, flags: list[str]) -> tuple[list[str], list[str]]:
    """(the flags for the task, one problem per flag that is no task's and whose closest flag among the task's and the
    command's own is the command's: `train x.yaml --chek` said "did you mean --help?", `search --max_trial` "did you
    mean --max_train_samples?", since only the task's parser saw them). A misspelled flag's value goes with it."""
    from .experiment import argument_classes
    from .tasks import TASKS
    from .args import ExtArgumentParser
    from .errors import closest

    own = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
    words = [word for word in flags if word.startswith("--")]
    if not words:
        return flags, []
    tasks = {option for task in TASKS for action in ExtArgumentParser(argument_classes(task))._actions
             for option in action.option_strings}
    near = {word: hint for word in words if word.split("=")[0] not in tasks
            and (hint := closest(word.split("=")[0], [*own, *sorted(tasks)])) in own}
    kept, skip = [], False
    for word in flags:
        if skip and not word.startswith("-"):
            skip = False
            continue
        skip = word in near and "=" not in word
        if word not in near:
            kept.append(word)
    return kept, [f"unrecognized argument {word} (did you mean {hint}?)" for word, hint in near.items()]


def plan(argv: list[str]) -> int:
    from .errors import CommandParser
    from .planner import (PlanError, ModelSize, lora_settings, model_size, parse_bytes, parse_count, plan as make_plan,
                          render)

    parser = CommandParser(prog="trainer-ext plan",
                           description="Predict per-rank training memory of every backend from the model's parameter "
                                       "count and shape (full fine-tuning or LoRA).")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="model folder (.safetensors weights or config.json), config.json or .safetensors")
    what.add_argument("--num_parameters", help="parameter count instead of a model (22713216, 350M, 7e9)")
    parser.add_argument("--world_size", type=int, required=True, help="data-parallel ranks")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="mixed precision with fp16")
    precision.add_argument("--bf16", action="store_true", help="mixed precision with bf16")
    parser.add_argument("--offload", action="store_true", help="consider ZeRO-2 with the optimizer on the CPU")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--max_seq_length", type=int, default=512,
                        help="tokens per sequence; with packing (TRL's packing=True) the packed length: each rank's "
                             "batch is --per_device_train_batch_size sequences of exactly this many tokens")
    parser.add_argument("--gradient_checkpointing", "--activation_checkpointing", action="store_true",
                        help="transformers' gradient checkpointing: each layer keeps only its input and is recomputed "
                             "in backward")
    parser.add_argument("--num_labels", type=int, default=0, help="add a classification head with this many labels")
    parser.add_argument("--device_memory", help="memory of one device (16GB, 80GiB): name the cheapest that fits")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                        help="the model's attention: sdpa (PyTorch's fused kernels, transformers' default) keeps no "
                             "a*s^2 activations; eager does")
    lora = parser.add_argument_group("LoRA (peft): the base frozen in the compute dtype, the adapters trained")
    lora.add_argument("--lora_r", "--lora_rank", type=int,
                      help="the adapters' rank: plan a LoRA fine-tune (--lora_rank: LLaMA-Factory's name)")
    lora.add_argument("--lora_target_modules", help="comma-separated modules of each layer (default q_proj,v_proj, "
                                                    "peft's for the Llama family), or all-linear")
    lora.add_argument("--lora_dropout", type=float, default=0.0, help="peft's lora_dropout (default 0)")
    lora.add_argument("--lora_alpha", type=float, help="accepted for a training command's flags; no memory effect")
    lora.add_argument("--lora_dora", "--use_dora", action="store_true",
                      help="DoRA: a magnitude per output feature trained, each adapted module's two outputs kept")
    lora.add_argument("--lora_rslora", "--use_rslora", action="store_true",
                      help="accepted for a training command's flags (rank-stabilised scaling); no memory effect")
    lora.add_argument("--lora_modules_to_save", help="embed_tokens,lm_head: trained whole (new tokens), saved with "
                                                     "the adapter")
    lora.add_argument("--load_in_4bit", action="store_true", help="QLoRA: the frozen decoder linears in 4-bit NF4")
    parser.add_argument("--chunked_loss", choices=("true", "false"), default="true",
                        help="ExtTrainer's loss through lm_head a chunk of tokens at a time (default true: the whole "
                             "logits never built; false: 12 bytes a token and vocabulary entry)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    args = parser.parse_args(argv)
    problems = []

    def read(parse, *values):
        try:
            return parse(*values)
        except PlanError as err:
            problems.append(str(err))
            return None

    if args.num_labels < 0:
        problems.append(f"--num_labels {args.num_labels}: give the classifier's number of labels (0: no "
                        "classification head)")
    count = read(parse_count, args.num_parameters) if args.num_parameters else None
    device_memory = read(parse_bytes, args.device_memory) if args.device_memory else None
    try:
        if problems:  # every mistake in the numbers given at once
            raise PlanError("\n".join(problems))
        size = (ModelSize(count, "--num_parameters") if args.num_parameters
                else model_size(args.model, num_labels=args.num_labels))
        lora_only = [f"--{name}" for name in ("lora_target_modules", "lora_dropout", "lora_alpha", "lora_dora",
                                              "lora_rslora", "lora_modules_to_save", "load_in_4bit")
                     if getattr(args, name) not in (None, False, 0.0)]
        if args.lora_r is None and lora_only:
            raise PlanError(f"{', '.join(lora_only)} {'is a setting' if len(lora_only) == 1 else 'are settings'} of "
                            "LoRA adapters: give their rank too, e.g. --lora_r 16")
        adapters = (lora_settings(size.decoder, args.lora_r, args.lora_target_modules, args.lora_dropout,
                                  args.lora_dora, args.lora_modules_to_save, args.load_in_4bit)
                    if args.lora_r is not None else None)
        result = make_plan(size, args.world_size, "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32",
                           offload=args.offload, batch_size=args.per_device_train_batch_size,
                           seq_length=args.max_seq_length, device_memory=device_memory, attention=args.attention,
                           lora=adapters, gradient_checkpointing=args.gradient_checkpointing,
                           chunked_loss=args.chunked_loss == "true")
    except PlanError as err:
        print(f"trainer-ext plan: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        import dataclasses

        best, states = result.cheapest_fitting(), result.cheapest_states_fitting()
        print(json.dumps({**dataclasses.asdict(result), "cheapest_fitting": best.backend if best else None,
                          "cheapest_model_states_fitting": states.backend if states else None},
                         indent=2))
    else:
        print(render(result))
    return 0


def build_ops(argv: list[str]) -> int:
    import importlib.util

    from .backends.deepspeed.backend import INSTALL
    from .errors import CommandParser

    parser = CommandParser(prog="trainer-ext build-ops",
                           description="Build DeepSpeed's JIT ops (its CPU all-reduce, FusedAdam, CPU Adam) "
                                       "into this environment, so no DeepSpeed run builds them silently "
                                       "first. Once per environment; they go to $TORCH_EXTENSIONS_DIR, else "
                                       "the environment's own folder (sys.prefix/torch_extensions).")
    parser.add_argument("--only", nargs="+", metavar="OP",
                        help="build only these (fused_adam, cpu_adam): e.g. cpu_adam when every "
                             "run offloads its optimizer")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("deepspeed") is None:
        print(f"trainer-ext build-ops: error: DeepSpeed is not installed, so it has no ops to build: {INSTALL}",
              file=sys.stderr)
        return 2
    from .backends.deepspeed.leftovers import clear_stale_build_locks
    from .backends.deepspeed.ops import build_ops as build

    clear_stale_build_locks()  # a killed build's lock would make this wait forever
    return build(only=args.only)


def merge(argv: list[str]) -> int:
    from .errors import CommandParser
    from .tasks.merge import DTYPES, merge_adapter

    parser = CommandParser(prog="trainer-ext merge",
                           description="Fold a LoRA adapter into its base model's weights and save a plain "
                                       "model folder (no peft needed to load it).")
    parser.add_argument("adapter_dir", help="a LoRA run's output_dir or one of its checkpoint-N folders")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--base_model", help="default: adapter_config.json's base_model_name_or_path")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    args = parser.parse_args(argv)
    out = merge_adapter(args.adapter_dir, args.output_dir, args.base_model, args.dtype)
    print(f"trainer-ext merge: {args.adapter_dir} merged into its base model: {out}")
    return 0


COMMANDS = {"build-ops": build_ops, "ds-config": ds_config, "merge": merge, "plan": plan, "search": search,
            "train": train}


def search_as_checked(settings) -> str:
    """The search section `trainer-ext search --check` prints: as resolved, the storage URL without its password."""
    import yaml

    from .search.study import shown

    values = settings.to_dict()
    if values.get("storage"):
        values["storage"] = shown(values["storage"])
    return yaml.safe_dump(values, sort_keys=False)


def _without_local_rank(argv: list[str]) -> list[str]:
    """deepspeed and torch.distributed.launch put --local_rank=N before the command; LOCAL_RANK has it too."""
    kept, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in ("--local_rank", "--local-rank"):
            skip = True
        elif not word.startswith(("--local_rank=", "--local-rank=")):
            kept.append(word)
    return kept


# What a bug report needs: this package and the libraries that decide how a run trains (read from their metadata, so
# that --version answers in a second and works where one of them is broken).
VERSION_OF = ("torch", "transformers", "accelerate", "datasets", "deepspeed", "fairscale", "peft", "trl", "optuna",
              "safetensors", "tokenizers")


def versions() -> str:
    """`trainer-ext --version`: trainer_ext's version and path, Python's, and each library of VERSION_OF (or "not
    installed"); torch's local version names its build (+cpu, +cu128)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    from . import __version__

    lines = [f"trainer_ext {__version__} ({Path(__file__).resolve().parent})",
             f"python {platform.python_version()} ({platform.platform()})"]
    for name in VERSION_OF:
        try:
            lines.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            lines.append(f"{name} not installed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = _without_local_rank(sys.argv[1:] if argv is None else list(argv))
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("--version", "-V", "version"):
        print(versions())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        from .errors import closest

        hint = closest(command, [*COMMANDS, "--version"])
        print(f"trainer-ext: error: unknown command {command!r}" + (f", did you mean {hint!r}?" if hint else "")
              + f"\n{USAGE}", file=sys.stderr)
        return 2
    from .errors import user_errors

    with user_errors(f"trainer-ext {command}"):
        return COMMANDS[command](rest)


def run() -> None:
    """The `trainer-ext` command: main's status, ending the process as errors.exit_process does (a launched run's
    rank that finished is not aborted by the interpreter's teardown)."""
    from .errors import exit_process

    exit_process(main())


if __name__ == "__main__":
    run()
