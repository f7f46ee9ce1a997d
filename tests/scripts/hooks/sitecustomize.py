"""Test hooks for launched processes (this folder on PYTHONPATH), each on when its variable is set; transformers is
patched only when something imports the module a hook patches: launchers and other processes are untouched.

TRAINER_EXT_TEST_SIGNAL="STEP:RANK:SIGNAL" (e.g. "3:1:SIGTERM"): every transformers Trainer built in
this process gets a callback that sends SIGNAL to its own process when the rank RANK ends optimizer step STEP. The
preemption tests' signal then lands at the same step of every run, however fast the machine, instead of racing a log
line. The process handles it as one a scheduler sent (the same handler, the same checkpoint).

"STEP:RANK:SIGNAL:outer" sends SIGNAL to the process group of the process that started this one's session instead
(a search trial's session is led by its guard: the search), then waits for the SIGTERM that the search's death brings
the trial (this callback runs before ExtTrainer's), so every rank's preemption checkpoint is STEP's on every run.

TRAINER_EXT_TEST_COUNT_TOKENIZED=FOLDER: every text a transformers tokenizer tokenizes in this process is counted in
FOLDER/rank<RANK>.<pid> (a line per call: how many texts), so a test can tell which rank of which run tokenized what,
whatever code called the tokenizer."""
import importlib.abc
import importlib.util
import os
import sys

SPEC = os.environ.get("TRAINER_EXT_TEST_SIGNAL")
COUNT_FOLDER = os.environ.get("TRAINER_EXT_TEST_COUNT_TOKENIZED")


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


def count_tokenized(base):
    tokenize = base.__call__

    def __call__(self, text=None, *args, **kwargs):
        texts = 1 if text is None or isinstance(text, str) else len(text)
        with open(os.path.join(COUNT_FOLDER, f"rank{os.environ.get('RANK', '0')}.{os.getpid()}"), "a") as record:
            record.write(f"{texts}\n")
        return tokenize(self, text, *args, **kwargs)

    base.__call__ = __call__


class PatchOnImport(importlib.abc.MetaPathFinder):
    """`install(module.<attribute>)` once the module `name` has run."""

    def __init__(self, name, attribute, install):
        self.name, self.attribute, self.install = name, attribute, install

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            self.install(getattr(module, self.attribute))

        spec.loader.exec_module = exec_module
        return spec


if SPEC:
    sys.meta_path.insert(0, PatchOnImport("transformers.trainer", "Trainer", install))
if COUNT_FOLDER:
    sys.meta_path.insert(0, PatchOnImport("transformers.tokenization_utils_base", "PreTrainedTokenizerBase",
                                          count_tokenized))
