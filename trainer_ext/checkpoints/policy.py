"""One run's checkpoints, as ExtTrainer uses them: which checkpoint a train() call resumes (local or from
--checkpoint_uri), whether the run is already complete, and each new checkpoint published complete when transformers
reports it saved (on_save), with its best-checkpoint record, rotation and remote copy. Every rank takes the same
decision: the main process reads the files once and shares its answer."""

from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from transformers import TrainerCallback

from .format import (AUTO, DATA_STATE, FRESH, LOSS_STATE, MARKER, NEWEST, CheckpointError, CheckpointNotFoundError,
                         check_compatible, checkpoint_folder, damage, newest_valid_checkpoint, problem_with, publish,
                         read_loss_sum, relaid_weights, resume_request, rotate, staging_dir, valid_checkpoints)
from .restarts import saved_for
from .origin import data_origin, model_origin, other_data, other_model, read_origin
from ..backends import backend_classes, given_as
from ..config.own_flags import CheckpointFlags, flags_of
from ..integrations import internals
from ..environment.sagemaker import checkpoints_to_keep

logger = logging.getLogger(__name__)


class RunCheckpoints(TrainerCallback):
    """ExtTrainer's checkpoint policy. transformers writes each checkpoint into `<run dir>/.staging` (ExtTrainer's
    _get_output_dir); `on_save`, the event transformers sends right after, publishes it under its real name. This
    callback is first in the list, so every other callback's on_save finds the checkpoint in place."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.args = trainer.args
        self.remote = None  # --checkpoint_uri
        self.run_dir = None  # the folder transformers saves the current checkpoint for (output_dir, or a trial's)
        self._origin = None  # (model, data) this train() started from, as its checkpoints record it (main process)

    # -- before training -------------------------------------------------------------------------------------------
    def open_remote(self) -> None:
        """--checkpoint_uri (checked by prepare_process, which ExtTrainer runs first)."""
        flags = flags_of(CheckpointFlags, self.args)
        if not flags.checkpoint_uri:
            return
        from .remote import RemoteCheckpoints

        self.remote = RemoteCheckpoints(flags.checkpoint_uri, flags.checkpoint_storage_options)

    def clear_staging(self) -> None:
        """Checkpoint halves a killed run left in the checkpoint folder's .staging (never published, so never resumed;
        on SageMaker, S3's copy of one comes back with a spot restart)."""
        if self.args.should_save:
            shutil.rmtree(staging_dir(checkpoint_folder(self.args)), ignore_errors=True)

    def to_resume(self, requested, fingerprint) -> str | None:
        """The checkpoint `train(resume_from_checkpoint=requested)` continues from; None: from scratch."""
        trainer, kind = self.trainer, resume_request(requested)
        self._origin = None  # read again for each train(): the model and data may have been replaced
        if kind == FRESH or (kind == AUTO and flags_of(CheckpointFlags, self.args).fresh_start):
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
            if not (Path(checkpoint) / "trainer_state.json").is_file():
                raise CheckpointNotFoundError(not_a_checkpoint(Path(checkpoint)))
            damaged = self.decided_by_main_process(lambda: damage(Path(checkpoint)))
            if damaged:
                raise CheckpointError(f"--resume_from_checkpoint {checkpoint}: {damaged}; resume from another "
                                      "checkpoint, or pass --resume_from_checkpoint auto to take the newest intact one")
            problem = problem_with(Path(checkpoint))
            if problem and trainer.is_world_process_zero():
                logger.warning("resuming from %s although %s", checkpoint, problem)
        if checkpoint:
            check_compatible(checkpoint, fingerprint)
            self._check_origin(Path(checkpoint), explicit=kind not in (AUTO, NEWEST))
            self._say_if_relaid(Path(checkpoint))
        return checkpoint

    def origin(self) -> tuple[dict, dict | None]:
        """(the model, the data) this train() started from (origin.py), read once per train() by the main process."""
        if self._origin is None:
            trainer = self.trainer
            module = trainer.user_model()
            self._origin = (model_origin(module), data_origin(trainer.train_dataset)
                            if trainer.train_dataset is not None else None)
        return self._origin

    def _check_origin(self, checkpoint: Path, explicit: bool) -> None:
        """Before training: a checkpoint trained from another model than this run's is refused (named on purpose, it
        continues, said); other training data of the same length is said."""
        def compare():
            (model, data), (saved_model, saved_data) = self.origin(), read_origin(checkpoint)
            return other_model(checkpoint, saved_model, model, explicit), other_data(checkpoint, saved_data, data)

        model_line, data_line = self.decided_by_main_process(compare)
        if model_line and not explicit:
            raise CheckpointError(model_line)
        if self.trainer.is_world_process_zero():
            for line in (model_line, data_line):
                if line:
                    logger.warning(line)

    def check_training_state(self, checkpoint: Path) -> bool:
        """Before a resume trains (a finished run's re-run needs only the weights): a checkpoint whose optimizer state
        this run's backend cannot read (saved with --save_only_model, or written by another backend) is refused in one
        line (transformers would start a new optimizer in silence, or fail deep inside the engine); with
        --resume_weights_only its weights and step continue, said: returns True then. A missing random state is said
        too."""
        backend, step = self.trainer.backend, json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
        writer, weights_only = writing_backend(checkpoint), flags_of(CheckpointFlags, self.args).resume_weights_only
        present = all(any(checkpoint.glob(pattern)) for pattern in backend.optimizer_state)
        if present and (writer is None or writer.optimizer_state == backend.optimizer_state):
            if other_optimizer := self._other_optimizer(checkpoint, step):
                if not weights_only or not backend.resumes_weights_only:
                    raise CheckpointError(other_optimizer)
                if self.trainer.is_world_process_zero():
                    logger.warning("--resume_weights_only: %s holds another optimizer's state; its weights and step "
                                   "%d continue, the optimizer state starts anew", checkpoint, step)
                return True
            if not any(checkpoint.glob("rng_state*")) and self.trainer.is_world_process_zero():
                logger.warning("resuming from %s, which holds no rng_state*.pth: the data order continues exactly "
                               "(trainer_ext's own), the random state of dropout and augmentations does not",
                               checkpoint)
            return False
        other = writer is not None and writer.optimizer_state != backend.optimizer_state
        described = backend.settings().description
        holds = (f"was written by {writer_text(checkpoint)}, whose optimizer state {described} cannot read"
                 if other else "holds no optimizer state (saved with --save_only_model)")
        if weights_only:
            if not backend.resumes_weights_only:
                raise CheckpointError(
                    f"--resume_weights_only: {checkpoint} {holds}, and {described} resumes only from its own "
                    f"checkpoints: start a new run from its weights (--model_name_or_path {checkpoint} in the "
                    "examples, from_pretrained in a script), or resume it without "
                    f"{given_as(backend, self.args)}")
            if self.trainer.is_world_process_zero():
                logger.warning("--resume_weights_only: %s %s; its weights and step %d continue, the optimizer state "
                               "starts anew", checkpoint, holds, step)
            return True
        if other:
            how = (f"resume it without {given_as(backend, self.args)} (plain DDP wrote it), " if writer.flag is None
                   else f"resume it with --{writer.flag}, as it was written, ")
        raise CheckpointError(
            f"{checkpoint} {holds}: {how if other else ''}pass "
            f"--resume_weights_only to continue its weights and step {step} with a new optimizer state (the "
            "learning-rate schedule continues at that step), or --fresh_start to start over")

    def _other_optimizer(self, checkpoint: Path, step: int) -> str | None:
        """A checkpoint's optimizer state read by another optimizer (--optim adafactor after AdamW's, another
        DeepSpeed optimizer.type): refused before the model trains (transformers loaded it into the new optimizer,
        which failed at the first step with a KeyError traceback, or read the moments wrongly): the one line, or None
        when it is the same optimizer (or either is unknown)."""
        try:
            written = json.loads((checkpoint / MARKER).read_text()).get("optimizer")
        except (OSError, ValueError):
            return None
        now = optimizer_record(self.trainer)
        if not isinstance(written, dict) or not now or written.get("state") == now["state"]:  # one state format
            return None
        # How the written one is chosen again (a marker written before "back" was recorded: its --optim or type).
        back = written.get("back") or (f"give --optim {written['optim']}" if written.get("optim") else
                                       f"set the optimizer.type back to {written.get('type')}")
        weights = (f", pass --resume_weights_only to continue its weights and step {step} with a new {now['name']} "
                   "state" if self.trainer.backend.resumes_weights_only else "")
        return (f"{checkpoint} holds the optimizer state of {written.get('name')} ({written.get('given')}), and this run "
                f"trains with {now['name']} ({now['given']}): to continue it, {back}{weights}, or --fresh_start to "
                "start over")

    def continue_with_this_runs_settings(self, checkpoint: Path) -> None:
        """After a resume loaded the optimizer and scheduler (transformers', or the engine's): the optimizer's
        hyperparameters are this run's flags (loading a checkpoint restores its own: a raised --learning_rate or
        another --weight_decay was ignored in silence), and the learning rate of the next step is the one this run's
        schedule gives at the resumed step (a finished run continued with a raised --max_steps held the old schedule's
        last rate, 0 for linear decay; a --resume_weights_only scheduler would restart at step 1). Schedules that are a
        function of the step are laid out again (transformers' LambdaLR ones, DeepSpeed's). Said once, with what
        changed."""
        trainer, step = self.trainer, self.trainer.state.global_step
        try:
            saved_total = json.loads((checkpoint / "trainer_state.json").read_text()).get("max_steps")
        except (OSError, ValueError):
            saved_total = None
        engine = trainer.model_wrapped
        scheduler = getattr(engine, "lr_scheduler", None) or trainer.lr_scheduler
        scheduler = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler wraps it
        optimizer = getattr(engine, "optimizer", None) if getattr(engine, "lr_scheduler", None) else trainer.optimizer
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        if optimizer is None:
            return
        own = trainer.backend.settings().optimizer  # an optimizer the backend builds from its own settings
        fresh = [dict(own) for _ in optimizer.param_groups] if own else trainer.fresh_optimizer_groups or []
        changed = restore_hyperparameters(optimizer.param_groups, fresh, scheduler)
        rates = laid_out_rates(scheduler, step)
        before = [group["lr"] for group in optimizer.param_groups]
        if rates is not None and (saved_total != trainer.state.max_steps or "learning rate" in changed
                                  or any(abs(a - b) > 1e-12 * max(abs(b), 1e-30) for a, b in zip(before, rates))):
            for group, rate in zip(optimizer.param_groups, rates):
                group["lr"] = rate
            if hasattr(scheduler, "lr_lambdas"):  # a scheduler started anew (weights only) counts from the resumed step
                scheduler.last_epoch = step
            internals.set_last_learning_rates(scheduler, rates)  # what get_last_lr() returns: the rate transformers logs
        else:
            rates = None
        if (changed or rates) and trainer.is_world_process_zero():
            said = [f"{name} {old} -> {new}" for name, (old, new) in changed.items()]
            if rates:
                total = f"{trainer.state.max_steps} steps (it was written by a run of {saved_total})" \
                    if saved_total and saved_total != trainer.state.max_steps else f"{trainer.state.max_steps} steps"
                said.append(f"the learning-rate schedule is laid out again for {total}, from step {step + 1} on: step "
                            f"{step + 1} trains at {rates[0]:g} (instead of {before[0]:g})")
            logger.warning("resuming from %s with this run's settings: %s", checkpoint, "; ".join(said))

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
        internals.load_callback_state(trainer)  # stateful callbacks (early stopping, ...) as a resume restores them
        if self.args.auto_find_batch_size and state.train_batch_size:
            internals.set_train_batch_size(trainer, state.train_batch_size)  # what transformers' resume restores too
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
        module = trainer.user_model()
        model, data = self.origin()
        final = publish(staged, run_dir, {"step": state.global_step, "world_size": self.args.world_size,
                                          "backend": trainer.backend.settings().description,
                                          "backend_name": trainer.backend.name,
                                          "optimizer": optimizer_record(trainer),
                                          "model": trainer.backend.fingerprint(module),
                                          "saved_for": saved_for(trainer), "trained_from": model, "data": data})
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


def optimizer_record(trainer) -> dict | None:
    """Which optimizer's state a checkpoint of this run holds, known before the optimizer is built: {"state": what
    must match to resume it, "name": its name for a message, "given": how it was chosen, "back": how to choose it
    again, "optim" (or the backend's own field): the value to give back}. The backend's answer where it decides
    (ResolvedSettings.optimizer_state: DeepSpeed's optimizer.type); else the class transformers builds for --optim
    (adamw_torch and adamw_torch_fused alike: torch's AdamW, one state format). None for an optimizer the user passed
    to the trainer, one whose package is missing, or one the backend does not know."""
    own = trainer.backend.settings().optimizer_state
    if own is not None:
        return own if own.get("state") else None
    if getattr(trainer, "user_optimizer", False):
        return None
    from transformers import Trainer

    try:
        kind, _ = Trainer.get_optimizer_cls_and_kwargs(trainer.args)
    except Exception:  # noqa: BLE001 (a package some --optim needs is missing: the flag check names it)
        return None
    optim = getattr(trainer.args.optim, "value", trainer.args.optim)
    return {"state": f"{kind.__module__}.{kind.__qualname__}", "name": kind.__name__, "given": f"--optim {optim}",
            "optim": optim, "back": f"give --optim {optim}"}


@contextmanager
def weights_and_step(checkpoint: Path):
    """A folder holding a checkpoint's files but its optimizer, scheduler and random state (links, in a temporary
    folder of this process), for transformers to resume only the weights and the trainer's state from: it loads every
    optimizer file it finds, and another backend's (an FSDP2 stub, a DDP state under FSDP2) fails inside the step."""
    import tempfile

    skipped = ("optimizer*", "scheduler.pt", "scaler.pt", "rng_state*")
    with tempfile.TemporaryDirectory(prefix="trainer-ext-weights-") as folder:
        view = Path(folder) / checkpoint.name
        view.mkdir()
        for path in checkpoint.iterdir():
            if not any(path.match(pattern) for pattern in skipped):
                (view / path.name).symlink_to(path.resolve())
        yield view


HYPERPARAMETERS = {"weight_decay": "weight decay", "betas": "betas", "eps": "epsilon"}


def restore_hyperparameters(groups, fresh: list[dict], scheduler) -> dict:
    """This run's optimizer hyperparameters (`fresh`: each group's as built, before a checkpoint was loaded) put back
    over the checkpoint's; the learning rate as the schedule's base. Returns {what: (checkpoint's, this run's)}."""
    changed = {}
    for group, settings in zip(groups, fresh):
        for key, name in HYPERPARAMETERS.items():
            if key in settings and key in group and tuple(map(float, _values(group[key]))) != \
                    tuple(map(float, _values(settings[key]))):
                changed[name] = (group[key], settings[key])
                group[key] = settings[key]
    bases = getattr(scheduler, "base_lrs", None)
    wanted = [settings.get("initial_lr", settings.get("lr")) for settings in fresh]
    if bases and len(wanted) == len(bases) and None not in wanted and any(abs(a - b) > 1e-12 * abs(b)
                                                                           for a, b in zip(bases, wanted)):
        changed["learning rate"] = (bases[0], wanted[0])
        scheduler.base_lrs = list(wanted)
        for group, base in zip(groups, wanted):
            group["initial_lr"] = base
    return changed


def _values(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def laid_out_rates(scheduler, step: int) -> list[float] | None:
    """Each parameter group's rate for the optimizer step after `step` under this schedule, for schedules that are a
    function of the step: torch's LambdaLR (transformers' linear, cosine, polynomial, constant, ... schedules) and
    DeepSpeed's WarmupLR family; None for others (ReduceLROnPlateau follows the metric, not the total)."""
    from torch.optim.lr_scheduler import LambdaLR

    if isinstance(scheduler, LambdaLR):
        return [base * rate(step) for base, rate in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    if hasattr(scheduler, "last_batch_iteration") and hasattr(scheduler, "get_lr"):  # DeepSpeed's: from its iteration
        return list(scheduler.get_lr())
    return None


def writing_backend(checkpoint: Path):
    """The backend class that wrote a checkpoint, from its marker; None for one written without trainer_ext."""
    try:
        marker = json.loads((checkpoint / MARKER).read_text())
    except (OSError, ValueError):
        return None
    name = marker.get("backend_name") or str(marker.get("backend", "")).split(" ")[0].replace("fsdp2", "fsdp")
    return next((cls for cls in backend_classes() if cls.name == name), None)


def writer_text(checkpoint: Path) -> str:
    """How the checkpoint's marker describes the backend that wrote it, e.g. "deepspeed ZeRO-2"."""
    try:
        return json.loads((checkpoint / MARKER).read_text()).get("backend", "another backend")
    except (OSError, ValueError):
        return "another backend"


def not_a_checkpoint(folder: Path) -> str:
    """Why --resume_from_checkpoint names a folder that is not a checkpoint, and the checkpoints it holds if any."""
    inside = valid_checkpoints(folder)
    hint = (f"it holds {', '.join(path.name for path in inside)}: pass {inside[-1]}, or auto for the newest complete "
            "one in --output_dir" if inside else "give a checkpoint-N folder, or auto for the newest complete one in "
            "--output_dir")
    return f"--resume_from_checkpoint {folder}: not a checkpoint (no trainer_state.json); {hint}"


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

