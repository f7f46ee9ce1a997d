"""On PYTHONPATH with TRAINER_EXT_TEST_SIGNAL="STEP:RANK:SIGNAL" (e.g. "3:1:SIGTERM"): every transformers Trainer built in
this process gets a callback that sends SIGNAL to its own process when the rank RANK ends optimizer step STEP. The
preemption tests' signal then lands at the same step of every run, however fast the machine, instead of racing a log
line. The process handles it as one a scheduler sent (the same handler, the same checkpoint). transformers is patched
only when something imports it: launchers and other processes are untouched.

"STEP:RANK:SIGNAL:outer" sends SIGNAL to the process group of the process that started this one's session instead
(a search trial's session is led by its guard: the search), then waits for the SIGTERM that the search's death brings
the trial (this callback runs before ExtTrainer's), so every rank's preemption checkpoint is STEP's on every run."""
import importlib.abc
import importlib.util
import os
import sys

SPEC = os.environ.get("TRAINER_EXT_TEST_SIGNAL")


def install(trainer_class):
    import signal

    from transformers import TrainerCallback

    step, rank, name, *target = SPEC.split(":")

    class SignalAtStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == int(step) and int(os.environ.get("RANK", "0")) == int(rank):
                if target == ["outer"]:
                    signal_outer(getattr(signal, name))
                else:
                    os.kill(os.getpid(), getattr(signal, name))

    built = trainer_class.__init__

    def __init__(self, *args, **kwargs):
        built(self, *args, **kwargs)
        self.add_callback(SignalAtStep())

    trainer_class.__init__ = __init__


def signal_outer(signum):
    """`signum` to the process group of whoever started this session's leader; returns after this process got its
    SIGTERM (handled by the handler it had), or after 60 s."""
    import signal
    import time

    with open(f"/proc/{os.getsid(0)}/stat") as stat:
        starter = int(stat.read().rsplit(")", 1)[1].split()[1])  # "pid (name) state ppid ..."
    got, previous = [], signal.getsignal(signal.SIGTERM)

    def note(number, frame):
        got.append(number)
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(number, frame)

    signal.signal(signal.SIGTERM, note)
    os.killpg(os.getpgid(starter), signum)
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)


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
