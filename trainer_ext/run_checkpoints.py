"""One run's checkpoints, as ExtTrainer uses them: which checkpoint a train() call resumes (local or from
--checkpoint_uri), whether the run is already complete, and each new checkpoint published complete when transformers
reports it saved (on_save), with its best-checkpoint record, rotation and remote copy. Every rank takes the same
decision: the main process reads the files once and shares its answer."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from transformers import TrainerCallback

from .checkpoint import (AUTO, DATA_STATE, FRESH, LOSS_STATE, MARKER, NEWEST, CheckpointError, CheckpointNotFoundError,
                         check_compatible, damage, newest_valid_checkpoint, problem_with, publish, read_loss_sum,
                         relaid_weights, resume_request, rotate, staging_dir, valid_checkpoints)
from .sagemaker import checkpoints_to_keep

logger = logging.getLogger(__name__)


def checkpoint_folder(args) -> str:
    """Where a run writes and resumes its checkpoints: --checkpoint_dir (set for a SageMaker job), else output_dir."""
    return getattr(args, "checkpoint_dir", None) or args.output_dir


class RunCheckpoints(TrainerCallback):
    """ExtTrainer's checkpoint policy. transformers writes each checkpoint into `<run dir>/.staging` (ExtTrainer's
    _get_output_dir); `on_save`, the event transformers sends right after, publishes it under its real name. This
    callback is first in the list, so every other callback's on_save finds the checkpoint in place."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.args = trainer.args
        self.remote = None  # --checkpoint_uri
        self.run_dir = None  # the folder transformers saves the current checkpoint for (output_dir, or a trial's)

    # -- before training -------------------------------------------------------------------------------------------
    def open_remote(self) -> None:
        """--checkpoint_uri (checked by prepare_process, which ExtTrainer runs first)."""
        uri = getattr(self.args, "checkpoint_uri", None)
        if not uri:
            return
        from .remote import RemoteCheckpoints

        self.remote = RemoteCheckpoints(uri, getattr(self.args, "checkpoint_storage_options", None))

    def clear_staging(self) -> None:
        """Checkpoint halves a killed run left in the checkpoint folder's .staging (never published, so never resumed;
        on SageMaker, S3's copy of one comes back with a spot restart)."""
        if self.args.should_save:
            shutil.rmtree(staging_dir(checkpoint_folder(self.args)), ignore_errors=True)

    def to_resume(self, requested, fingerprint) -> str | None:
        """The checkpoint `train(resume_from_checkpoint=requested)` continues from; None: from scratch."""
        trainer, kind = self.trainer, resume_request(requested)
        if kind == FRESH or (kind == AUTO and getattr(self.args, "fresh_start", False)):
            return None
        if kind in (AUTO, NEWEST):
            found = self.newest_intact(earlier_processes=kind == AUTO)
            if found is None and self.remote is not None:
                if self.args.should_save:
                    self.remote.download_newest(checkpoint_folder(self.args))
                trainer.accelerator.wait_for_everyone()
                found = self.newest_intact(earlier_processes=kind == AUTO)
            if found is None and kind == NEWEST:
                raise CheckpointNotFoundError(
                    f"No valid checkpoint found in output directory ({checkpoint_folder(self.args)}): "
                    f"resume_from_checkpoint="
                    f"{requested!r} asks to resume, and there is no complete, intact checkpoint-N folder there"
                    + (f" or at {self.remote.uri}" if self.remote is not None else "")
                    + "; pass the folder of the run to resume, or leave resume_from_checkpoint unset to start (and "
                      "later resume) automatically")
            if trainer.is_world_process_zero() and not found:
                logger.info("no complete checkpoint in %s: starting from scratch", checkpoint_folder(self.args))
            checkpoint = str(found) if found else None
        else:
            checkpoint = str(requested)
            if not Path(checkpoint).is_dir():
                raise CheckpointNotFoundError(
                    f"Can't find a valid checkpoint at {checkpoint} (resume_from_checkpoint): no such folder; give a "
                    "checkpoint-N folder, or auto for the newest complete one in --output_dir")
            damaged = self.decided_by_main_process(lambda: damage(Path(checkpoint)))
            if damaged:
                raise CheckpointError(f"--resume_from_checkpoint {checkpoint}: {damaged}; resume from another "
                                      "checkpoint, or pass --resume_from_checkpoint auto to take the newest intact one")
            problem = problem_with(Path(checkpoint))
            if problem and trainer.is_world_process_zero():
                logger.warning("resuming from %s although %s", checkpoint, problem)
        if checkpoint:
            check_compatible(checkpoint, fingerprint)
            self._say_if_relaid(Path(checkpoint))
        return checkpoint

    def _say_if_relaid(self, checkpoint: Path) -> None:
        if not self.trainer.is_world_process_zero():
            return
        try:
            files = json.loads((checkpoint / MARKER).read_text()).get("files", {})
        except (OSError, ValueError):
            return
        if layout := relaid_weights(checkpoint, files):
            logger.warning("resuming from %s: its weights are no longer the files written there (%s, re-saved "
                           "since); every other file is as written", checkpoint, layout)

    def newest_intact(self, earlier_processes: bool = False) -> Path | None:
        """The newest complete checkpoint whose files are all as written (sizes and checksums); with
        `earlier_processes`, only one that an earlier process wrote (a train() earlier in this process left it)."""
        return self.decided_by_main_process(lambda: newest_valid_checkpoint(
            checkpoint_folder(self.args), checksums=True, earlier_processes=earlier_processes))

    def decided_by_main_process(self, decide):
        """`decide()` run once, by the main process (reading a checkpoint's files once, not once per rank), and its
        answer shared: every rank must resume from the same checkpoint."""
        answer = decide() if self.args.process_index == 0 else None
        if self.args.world_size > 1:
            from accelerate.utils import broadcast_object_list

            answer = broadcast_object_list([answer], from_process=0)[0]
        return answer

    def already_complete(self, checkpoint, max_steps: int):
        """A re-run of a finished command (a scheduler or spot restart) finds its last checkpoint at the run's final
        step: the trainer's state (with the batch size auto_find_batch_size found) and finished weights are loaded for
        evaluation/prediction, and the TrainOutput to return is given; None when there is training left.
        (transformers would train one step more, rotate an older checkpoint away and overwrite the metrics.)"""
        from transformers import TrainerState
        from transformers.trainer import TRAINER_STATE_NAME
        from transformers.trainer_utils import TrainOutput

        if not checkpoint:
            return None
        state = TrainerState.load_from_json(str(Path(checkpoint) / TRAINER_STATE_NAME))
        if state.global_step < max_steps:
            return None
        trainer = self.trainer
        trainer.backend.load_weights(trainer, checkpoint)  # for evaluation/prediction after the re-run
        # The saved state says rank 0's is_world_process_zero: on every rank, its callbacks would print and report.
        state.is_local_process_zero, state.is_world_process_zero = (trainer.is_local_process_zero(),
                                                                    trainer.is_world_process_zero())
        trainer.state = state
        trainer._load_callback_state()  # stateful callbacks (early stopping, ...) as a resume restores them
        if self.args.auto_find_batch_size and state.train_batch_size:
            trainer._train_batch_size = state.train_batch_size  # what transformers' resume restores too
        final = Path(self.args.output_dir)
        where = final if any(final.glob("model*.safetensors")) or any(final.glob("pytorch_model*.bin")) else checkpoint
        if trainer.is_world_process_zero():
            print(f"trainer_ext: training already complete at step {state.global_step} ({checkpoint}): nothing to "
                  f"train; the model is in {where}", flush=True)
        loss_sum = read_loss_sum(checkpoint)  # the checkpoint is written before train_loss is logged
        train_loss = loss_sum / state.global_step if loss_sum is not None and state.global_step else float("nan")
        return TrainOutput(state.global_step, train_loss, {"already_complete": True, "train_loss": train_loss})

    # -- while training --------------------------------------------------------------------------------------------
    def stage(self, run_dir) -> str:
        """Where transformers writes the next checkpoint of `run_dir`: its staging folder (published by on_save). The
        run's own output_dir stands for its checkpoint folder (--checkpoint_dir; a SageMaker job's synced folder)."""
        if os.path.abspath(run_dir) == os.path.abspath(self.args.output_dir):
            run_dir = checkpoint_folder(self.args)
        self.run_dir = Path(run_dir)
        return str(staging_dir(run_dir))

    def on_save(self, args, state, control, **kwargs):
        if self.run_dir is None:
            return
        staged = staging_dir(self.run_dir) / f"checkpoint-{state.global_step}"
        trainer = self.trainer
        loss_sum = trainer.training_loss_sum()  # every rank: the loss not yet logged is a mean over ranks
        trainer.accelerator.wait_for_everyone()  # every rank has written its part
        if args.should_save and staged.is_dir():
            self.publish_staged(staged, self.run_dir, loss_sum)
        trainer.accelerator.wait_for_everyone()
        # Every rank's own record (each loads the best checkpoint at the end), as transformers keeps it on each.
        state.best_model_checkpoint = best_checkpoint(state, self.run_dir, staged)

    def publish_staged(self, staged: Path, run_dir: Path, loss_sum: float | None = None) -> Path:
        """The main process's part once every rank wrote into `staged`: the training order's position, the losses
        so far, the best checkpoint under its published path, the marker (published last, by rename), rotation, the
        remote copy."""
        trainer, state = self.trainer, self.trainer.state
        name = staged.name
        position = trainer.training_order_state()
        if position is not None:
            (staged / DATA_STATE).write_text(json.dumps(position, indent=2) + "\n")
        if loss_sum is not None:
            (staged / LOSS_STATE).write_text(json.dumps({"global_step": state.global_step, "loss_sum": loss_sum},
                                                        indent=2) + "\n")
        best = best_checkpoint(state, run_dir, staged)
        if best != state.best_model_checkpoint:  # transformers looked for it in the staging folder
            state.best_model_checkpoint = best
            state.save_to_json(str(staged / "trainer_state.json"))
        module = trainer.backend.unwrap(trainer.accelerator.unwrap_model(trainer.model))
        final = publish(staged, run_dir, {"step": state.global_step, "world_size": self.args.world_size,
                                          "backend": trainer.backend.describe(),
                                          "model": trainer.backend.model_fingerprint(module)})
        deleted = rotate(run_dir, checkpoints_to_keep(self.args.save_total_limit),
                         keep=Path(state.best_model_checkpoint) if state.best_model_checkpoint else None)
        if self.remote is not None:  # in the background: the next step does not wait for the copy
            self.remote.upload(final)
            self.remote.delete([path.name for path in deleted])
        try:
            staged.parent.rmdir()  # the staging folder, once empty
        except OSError:
            pass
        return final

    def on_train_end(self, args, state, control, **kwargs):
        # transformers keeps only the best checkpoint at the end when save_total_limit is 1 (_finalize_training);
        # it looked for the others in the staging folder.
        if (args.should_save and args.save_total_limit == 1 and state.best_model_checkpoint and self.run_dir
                and Path(state.best_model_checkpoint).is_dir()):
            for path in valid_checkpoints(self.run_dir):
                if not os.path.samefile(path, state.best_model_checkpoint):
                    logger.info("deleting older checkpoint %s (save_total_limit=1 keeps the best)", path)
                    shutil.rmtree(path, ignore_errors=True)
                    if self.remote is not None:
                        self.remote.delete([path.name])

    def wait(self) -> None:
        """Uploads still running finish (at the end, and on preemption)."""
        if self.remote is not None:
            self.remote.wait()


def best_checkpoint(state, run_dir: Path, staged: Path) -> str | None:
    """state.best_model_checkpoint as transformers records it when checkpoints are written in place (its
    _save_checkpoint: `<run dir>/checkpoint-<best_global_step>` once that folder exists), for a checkpoint about to be
    published from `staged`."""
    best = state.best_model_checkpoint
    if state.best_global_step:
        candidate = os.path.join(str(run_dir), f"checkpoint-{state.best_global_step}")
        if state.best_global_step == state.global_step or os.path.isdir(candidate):
            return candidate
    if best and Path(best).parent == staged.parent:  # recorded in the staging folder: its published name
        return os.path.join(str(run_dir), Path(best).name)
    return best

