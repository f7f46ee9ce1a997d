"""On PYTHONPATH with TRAINER_EXT_TEST_SIGNAL="STEP:RANK:SIGNAL" (e.g. "3:1:SIGTERM"): every transformers Trainer built in
this process gets a callback that sends SIGNAL to its own process when the rank RANK ends optimizer step STEP. The
preemption tests' signal then lands at the same step of every run, however fast the machine, instead of racing a log
line. The process handles it as one a scheduler sent (the same handler, the same checkpoint). transformers is patched
only when something imports it: launchers and other processes are untouched."""
import importlib.abc
import importlib.util
import os
import sys

SPEC = os.environ.get("TRAINER_EXT_TEST_SIGNAL")


def install(trainer_class):
    import signal

    from transformers import TrainerCallback

    step, rank, name = SPEC.split(":")

    class SignalAtStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == int(step) and int(os.environ.get("RANK", "0")) == int(rank):
                os.kill(os.getpid(), getattr(signal, name))

    built = trainer_class.__init__

    def __init__(self, *args, **kwargs):
        built(self, *args, **kwargs)
        self.add_callback(SignalAtStep())

    trainer_class.__init__ = __init__


class PatchTrainerOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "transformers.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            install(module.Trainer)

        spec.loader.exec_module = exec_module
        return spec


if SPEC:
    sys.meta_path.insert(0, PatchTrainerOnImport())
