"""The one step that readies this process to train with given arguments, which are values (building them touches no
variable, file or process group): ExtTrainer runs it first, and so do sharded_loading and the task recipes before
they load a model; a second call in the same process changes nothing (RunSettings.prepared_in)."""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import replace

from ..backends import Backend, backend_class, import_libraries_quietly, rank_written, run_settings, settle
from ..checkpoints.restarts import resumed_order_state
from ..config.batch import split_batch
from ..config.own_flags import CheckpointFlags, flags_of
from ..config.settings import write
from ..environment.launcher import (bound_collective_waits, cpu_ranks, form_process_group, rendezvous_store_problem,
                                    resolve_world_size, share_cores_between_cpu_ranks, signal_when_the_agent_dies)
from ..environment.sagemaker import prepare_arguments as prepare_sagemaker_arguments
from ..environment.sagemaker import prepare_environment as prepare_sagemaker_environment

logger = logging.getLogger(__name__)

# This process among all (RunSettings.prepared_in): its id alone would repeat in containers, where every start gets
# the same small pid, and a training_args.bin loaded there would pass for prepared.
_THIS_PROCESS = uuid.uuid4().hex


def this_process() -> str:
    """This process's name for RunSettings.prepared_in: a forked child (another pid) is another process."""
    return f"{os.getpid()}-{_THIS_PROCESS}"


def prepare_process(args) -> None:
    """What training with `args` needs of this process, in one place: a SageMaker job's TensorBoard folder (and its
    model and checkpoint folders on stock TrainingArguments), each CPU rank's share of the cores, the process group
    formed for a backend that needs one before a model is built (a 1-rank one when no launcher started it), the
    backends' libraries imported where installed (as accelerate would, without what their import says or sets),
    stock TrainingArguments settled as parsing settles ExtTrainingArguments (the global batch over this start's
    ranks first), the selected backend's own set-up (its prepare_process), --ddp_timeout bounding the group's
    collectives on CPU ranks too, a torchrun worker stopping with its agent, and --checkpoint_uri taking a write
    (main process: one probe object, then deleted) before any model is loaded."""
    if args is None or run_settings(args).prepared_in == this_process():
        return  # the recipes, sharded_loading and ExtTrainer each call it: the work is done once
    # ExtTrainingArguments did when built; stock TrainingArguments not
    write(args, prepare_sagemaker_arguments(args, flags_of(CheckpointFlags, args).checkpoint_dir, rank_written(args)))
    prepare_sagemaker_environment()
    backend = backend_class(args)
    import_libraries_quietly(backend)
    if cpu_ranks(args):
        share_cores_between_cpu_ranks()
    if backend.needs_process_group:
        form_process_group(args)
    if not run_settings(args).backend:  # stock TrainingArguments: settled as parsing settles ExtTrainingArguments
        write(args, settle(args, split_batch(args, resolve_world_size(), resumed_order_state(args)), parsing=False))
    write(args, backend.prepare_process(args))  # also what transformers built before that, and what the process knows
    bound_collective_waits(args)  # a peer's node lost: the collectives fail after --ddp_timeout, then a restart
    signal_when_the_agent_dies()  # a torchrun worker whose agent is killed checkpoints and stops with its group
    if (problem := rendezvous_store_problem()) and args.process_index == 0:
        logger.warning(problem)
    check_checkpoint_uri(args)
    write(args, {"run_settings": replace(run_settings(args), prepared_in=this_process())})


def check_checkpoint_uri(args) -> None:
    """--checkpoint_uri takes a write, a listing and a read (by the process that saves): bad credentials, an
    unreachable endpoint or a missing bucket fail now, not at the first checkpoint hours later."""
    flags = flags_of(CheckpointFlags, args)
    if not flags.checkpoint_uri or not args.should_save:
        return
    from ..checkpoints.remote import RemoteCheckpoints

    RemoteCheckpoints(flags.checkpoint_uri, flags.checkpoint_storage_options).check()


def sharded_loading(args):
    """`with sharded_loading(args): model = AutoModel....from_pretrained(...)`: the process prepared (prepare_process),
    then the selected backend's model construction context, so one script serves every backend. ZeRO-3 builds and
    loads the model partitioned (also `from_config`; a model class called directly is built whole), so no rank ever
    holds all of it; FSDP2 with `--fsdp_config cpu_ram_efficient_loading true` loads it on rank 0 only, the other ranks
    build it empty (also `from_config` and a class called directly) and receive their shards after fully_shard; any
    other backend changes nothing."""
    if args is None:
        return Backend.model_sharded_context(args)
    prepare_process(args)
    return backend_class(args).model_sharded_context(args)
