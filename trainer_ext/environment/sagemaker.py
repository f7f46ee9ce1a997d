"""SageMaker training jobs, recognised by the variables AWS's training toolkit gives the entry point: the final model is
saved in SM_MODEL_DIR, checkpoints go to the folder SageMaker syncs with checkpoint_s3_uri, TensorBoard to the job's
output, data from the SM_CHANNEL_* folders, hyperparameters read as the toolkit writes them; outside a job nothing here
acts."""

from __future__ import annotations

import ast
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ArgumentsError, main_process
from .variables import set_variables

logger = logging.getLogger(__name__)

DEFAULT_ROOT = "/opt/ml"
ROOT_ENV = "SAGEMAKER_BASE_DIR"  # the toolkit's own stand-in for /opt/ml (local runs, tests)
TRANSFORMERS_OUTPUT_DIR = "trainer_output"  # what transformers 5 writes to when no output_dir is given
TENSORBOARD_ENV = "TENSORBOARD_LOGGING_DIR"  # transformers' TensorBoardCallback writes there when it is set
SPLITS = ("train", "validation", "test")  # data channels SM_CHANNEL_TRAIN, SM_CHANNEL_VALIDATION, SM_CHANNEL_TEST
# What a job refused for smdistributed should use instead.
TORCH_DISTRIBUTED = ("distribution={'torch_distributed': {'enabled': True}} (DDP, or --deepspeed zero2 / --sharded_ddp "
                     "simple among the hyperparameters)")


@dataclass(frozen=True)
class Job:
    """The running job's folders and settings, as the toolkit describes them to the entry point."""

    root: Path  # /opt/ml
    model_dir: Path  # uploaded as model.tar.gz when the job ends
    output_data_dir: Path  # uploaded as output.tar.gz
    input_config_dir: Path
    hyperparameters: dict  # what the estimator passed (sagemaker_* settings excluded)
    hosts: tuple[str, ...]
    current_host: str

    @property
    def checkpoint_dir(self) -> Path:
        """The estimator's checkpoint_local_path (SageMaker writes it to checkpointconfig.json, as smdebug reads
        it), else SageMaker's default: the folder synced with checkpoint_s3_uri and copied back on a spot restart."""
        return self._local_path("checkpointconfig.json") or self.root / "checkpoints"

    @property
    def tensorboard_dir(self) -> Path:
        """The estimator's TensorBoardOutputConfig local path, else a folder of the job's output data."""
        return self._local_path("tensorboardoutputconfig.json") or self.output_data_dir / "tensorboard"

    def _local_path(self, name: str) -> Path | None:
        try:
            value = json.loads((self.input_config_dir / name).read_text()).get("LocalPath")
        except (OSError, ValueError, AttributeError):
            return None
        return Path(value) if value else None


def current_job(environ=None) -> Job | None:
    """The SageMaker job this process runs in, or None (SM_TRAINING_ENV / SM_MODEL_DIR are set only inside one)."""
    environ = os.environ if environ is None else environ
    if "SM_TRAINING_ENV" not in environ and "SM_MODEL_DIR" not in environ:
        return None
    root = Path(environ.get(ROOT_ENV) or DEFAULT_ROOT)
    hosts = _json(environ.get("SM_HOSTS"), [])
    return Job(root=root,
               model_dir=Path(environ.get("SM_MODEL_DIR") or root / "model"),
               output_data_dir=Path(environ.get("SM_OUTPUT_DATA_DIR") or root / "output" / "data"),
               input_config_dir=Path(environ.get("SM_INPUT_CONFIG_DIR") or root / "input" / "config"),
               hyperparameters=_json(environ.get("SM_HPS"), {}),
               hosts=tuple(hosts), current_host=environ.get("SM_CURRENT_HOST", hosts[0] if hosts else ""))


def _json(text, default):
    try:
        return json.loads(text) if text else default
    except ValueError:
        return default


# -- at start ------------------------------------------------------------------------------------------------------
def refuse_smdistributed(environ=None) -> None:
    """smdistributed data or model parallelism replaces torch.distributed with AWS's own libraries (launched by MPI):
    trainer_ext's backends cannot run under them, so the job stops before anything loads."""
    environ = os.environ if environ is None else environ
    framework = _json(environ.get("SM_FRAMEWORK_PARAMS"), {})
    if framework.get("sagemaker_distributed_dataparallel_enabled"):
        raise ArgumentsError("this SageMaker job enables smdistributed data parallelism (estimator distribution="
                             "{'smdistributed': {'dataparallel': {'enabled': True}}}), which trainer_ext does not run "
                             f"under: use {TORCH_DISTRIBUTED}")
    if _json(environ.get("SM_HP_MP_PARAMETERS"), {}):
        raise ArgumentsError("this SageMaker job enables smdistributed model parallelism (estimator distribution="
                             "{'smdistributed': {'modelparallel': ...}}), which trainer_ext does not run under: use "
                             f"{TORCH_DISTRIBUTED}, with --deepspeed zero3 for a model bigger than one device")


def prepare_arguments(args, checkpoint_dir: str | None, rank_written: tuple[str, str] | None = None,
                      job: Job | None = None) -> dict:
    """Inside a job: refuse smdistributed; with no --output_dir hyperparameter output_dir is SM_MODEL_DIR (the final
    model, which ExtTrainer saves there when training ends, tokenizer and *_results.json); checkpoints go to the synced
    checkpoint folder unless --checkpoint_dir (`checkpoint_dir`, its value) says otherwise (also when --output_dir is
    /opt/ml/model: they would be tarred into the model). `rank_written`: the selected backend's flag and what its ranks
    each write into a checkpoint (backends.rank_written), refused on several hosts without a shared --checkpoint_dir.
    Returns the fields to set (config.settings writes them); works on ExtTrainingArguments and on stock
    TrainingArguments (prepare_process calls it); once they are set it returns none."""
    job = job or current_job()
    if job is None:
        return {}
    refuse_smdistributed()
    changed, values = [], {}
    if args.output_dir in (None, TRANSFORMERS_OUTPUT_DIR) and "output_dir" not in job.hyperparameters:
        values["output_dir"] = str(job.model_dir)
        changed.append(f"output_dir is {job.model_dir} (SM_MODEL_DIR): ExtTrainer saves the final model there when "
                       "training ends")
    if not checkpoint_dir:
        refuse_rank_written_state(args, rank_written, job)
        values["checkpoint_dir"] = str(job.checkpoint_dir)  # an attribute of its own on stock TrainingArguments
        changed.append(f"checkpoints to {job.checkpoint_dir} (synced with checkpoint_s3_uri; resumed from there)")
    say(job, changed)
    return values


def prepare_environment(job: Job | None = None) -> None:
    """Inside a job (trainer_ext.prepare_process): TensorBoard logs to the job's output unless TENSORBOARD_LOGGING_DIR
    is set (transformers' TensorBoardCallback reads it when the trainer is built)."""
    job = job or current_job()
    if job is not None and set_variables({TENSORBOARD_ENV: str(job.tensorboard_dir)}, keep_set=True):
        say(job, [f"TensorBoard logs to {job.tensorboard_dir}"])


def say(job: Job, changed: list[str]) -> None:
    if changed and main_process():
        print(f"trainer_ext: SageMaker job on {job.current_host or 'this host'}: {'; '.join(changed)}", flush=True)


def refuse_rank_written_state(args, rank_written: tuple[str, str] | None, job: Job) -> None:
    """A backend whose ranks each write part of a checkpoint (`rank_written`, e.g. ("--deepspeed", "each rank's
    optimizer partition")) leaves each part on its own host, and only host 1 publishes a checkpoint: on several hosts with the
    per-host checkpoint folder, a spot restart could never resume. Refused before training."""
    if len(job.hosts) > 1 and rank_written and args.save_strategy != "no":  # transformers' enums are strings
        flag, state = rank_written
        raise ArgumentsError(f"{flag} on {len(job.hosts)} SageMaker hosts: {state} would stay on its own host's "
                             f"{job.checkpoint_dir} and a restart could not resume; pass --checkpoint_dir on a file "
                             "system the hosts share (FSx for Lustre, EFS), use one host, or --save_strategy no")


def checkpoints_to_keep(save_total_limit: int | None) -> int | None:
    """--save_total_limit 1 keeps the previous checkpoint too inside a job: SageMaker deletes in S3 what is deleted
    here, and the deletion can reach S3 before the new checkpoint's upload has finished."""
    if save_total_limit == 1 and current_job() is not None:
        return 2
    return save_total_limit


# -- hyperparameters as the toolkit passes them ----------------------------------------------------------------------
def spread_lists(argv: list[str], list_flags: set[str]) -> list[str]:
    """The toolkit passes a list hyperparameter as one word, str() of the list (`--report_to ['tensorboard']`,
    `--sharded_ddp ["simple"]`); a flag taking several words gets them one by one. Outside a job argv is unchanged."""
    if current_job() is None:
        return argv
    spread, words = [], list(argv)
    while words:
        word = words.pop(0)
        spread.append(word)
        if word in list_flags and words and _is_list_text(words[0]):
            spread += [str(item) for item in parse_list(words.pop(0))]
    return spread


def _is_list_text(text: str) -> bool:
    text = str(text).strip()
    return text.startswith("[") and text.endswith("]")


def parse_list(text: str) -> list:
    """A JSON list, or the Python repr of one (str() of a list of strings has single quotes)."""
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ArgumentsError(f"{text!r} is neither a JSON list nor a Python list") from None
    if not isinstance(value, list):
        raise ArgumentsError(f"{text!r} is not a list")
    return value


# -- data channels ---------------------------------------------------------------------------------------------------
def channel_files(suffixes: tuple[str, ...], environ=None) -> dict[str, str]:
    """{split: the first data file (by path, hidden files skipped) in SM_CHANNEL_<SPLIT>} for the channels this job
    has, among train/validation/test; a channel holding no file with one of `suffixes` is an error naming it."""
    environ = os.environ if environ is None else environ
    found = {}
    for split in SPLITS:
        folder = environ.get(f"SM_CHANNEL_{split.upper()}")
        if not folder:
            continue
        files = sorted(path for path in Path(folder).rglob("*") if path.is_file() and path.suffix in suffixes
                       and not any(part.startswith(".") for part in path.relative_to(folder).parts))
        if not files:
            raise ArgumentsError(f"SageMaker channel {split!r} ({folder}) holds no {'/'.join(suffixes)} file: "
                                 f"upload one to the channel's S3 prefix, or pass --{split}_file")
        found[split] = str(files[0])
    return found
