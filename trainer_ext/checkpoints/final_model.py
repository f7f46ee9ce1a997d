"""A SageMaker job's final model: saved in SM_MODEL_DIR (uploaded as model.tar.gz when the job ends) once training has
ended, or, for a re-run of a finished job, copied from its final checkpoint. Here, above the backends and beside the
checkpoint format, because a checkpoint's model files are told apart from each backend's training state."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..backends import checkpoint_state_patterns
from ..environment.sagemaker import current_job
from .format import MARKER, loadable_weights

# What a checkpoint holds beside the model files save_model() wrote into it: transformers' and DeepSpeed's training
# state, trainer_ext's records (*_state.json, the marker) and each backend's own (Backend.checkpoint_state).
TRAINING_STATE = ("optimizer*", "scheduler.pt", "scaler.pt", "rng_state*", "*_state.json", "latest", "zero_to_*.py")


def save_final_model(trainer, finished_before: bool = False) -> Path | None:
    """Inside a job whose output_dir is SM_MODEL_DIR, once training ended (not preempted): the final model saved there
    by every rank (under ZeRO-3 and FSDP the full weights are gathered collectively), said in one line; a script that
    never calls save_model() would leave model.tar.gz empty. `finished_before`: a re-run of a finished job (stopped
    between its last step and the save) copies the model files of its final checkpoint, only into a folder with no
    model (the script may have changed the one it saved). Returns the folder holding the final model, None where the
    script's own save_model() is due."""
    job = current_job()
    if job is None or Path(trainer.args.output_dir).resolve() != job.model_dir.resolve():
        return None
    if finished_before:
        # A copy, not save_model(): before training no engine exists, and ZeRO-3 cannot gather without one.
        if trainer.is_world_process_zero() and not holds_model(job.model_dir):
            copy_model_files(Path(trainer.training_already_complete), job.model_dir)
            print(f"trainer_ext: SageMaker job: the finished run's model ({trainer.training_already_complete}) is "
                  f"copied to {job.model_dir} (uploaded as model.tar.gz when the job ends)", flush=True)
        return job.model_dir
    trainer.save_model()
    if trainer.is_world_process_zero():
        print(f"trainer_ext: SageMaker job: the final model is saved in {job.model_dir} (uploaded as model.tar.gz when "
              "the job ends); a save_model() of the script's own writes the same files again", flush=True)
    return job.model_dir


def holds_model(folder: Path) -> bool:
    """Complete Hugging Face weights (one file, or an index and all its shards) or a PEFT adapter."""
    return loadable_weights(folder) is not None or any(folder.glob("adapter_model.*"))


def copy_model_files(checkpoint: Path, folder: Path) -> None:
    """The files save_model() wrote into a complete checkpoint (model, config, tokenizer, training_args.bin), each
    copied aside and renamed into place, the weights last: a copy cut short never looks like a model."""
    skipped = (*TRAINING_STATE, MARKER, *checkpoint_state_patterns())
    files = [path for path in checkpoint.iterdir() if path.is_file() and not any(path.match(p) for p in skipped)]
    folder.mkdir(parents=True, exist_ok=True)
    for path in sorted(files, key=lambda path: path.suffix in (".safetensors", ".bin")):
        partial = folder / f".{path.name}.partial"
        shutil.copyfile(path, partial)
        os.replace(partial, folder / path.name)
