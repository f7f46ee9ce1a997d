"""A backend written outside the package, to show what adding one takes: this folder and one registry line
(sitecustomize.py adds it). DDP whose gradients are all-reduced only at the optimizer step: under gradient
accumulation every other micro-batch runs under `no_sync`. It wraps the model in torch's DistributedDataParallel
itself, with a communication hook that counts the all-reduces, and says the count in its settings and in
`allreduces-rank<R>.json` when training ends. Selected whenever it is registered: without a flag of its own, the
last one registered is the default."""

import json
import os
from pathlib import Path

from transformers import TrainerCallback

from trainer_ext.backends.base import Backend, ResolvedSettings


class NoSyncEveryOtherStep(Backend):
    name = "toy-ddp"

    def __init__(self, args=None):
        super().__init__(args)
        self.allreduces = 0

    def setup_model_and_optimizer(self, trainer, model, optimizer):
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        if not dist.is_initialized():
            return None, optimizer.build(model)  # one process: nothing to synchronise

        def counted(state, bucket):
            if bucket.index() == 0:
                self.allreduces += 1
            return allreduce_hook(state, bucket)

        wrapped = DistributedDataParallel(model)
        wrapped.register_comm_hook(None, counted)
        return wrapped, optimizer.build(model)

    def callbacks(self, trainer) -> list:
        backend = self

        class Report(TrainerCallback):
            def on_train_end(self, args, state, control, **kwargs):
                path = Path(args.output_dir) / f"allreduces-rank{os.environ.get('RANK', '0')}.json"
                path.write_text(json.dumps({"allreduces": backend.allreduces, "steps": state.global_step}))

        return [Report()]

    def settings(self) -> ResolvedSettings:
        return ResolvedSettings(self.name, (f"gradients all-reduced at optimizer steps only ({self.allreduces} so far)",))
