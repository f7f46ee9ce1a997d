"""Test hooks for launched processes (this folder on PYTHONPATH), each on when its variable is set; transformers is
patched only when something imports the module a hook patches: launchers and other processes are untouched.

TRAINER_EXT_TEST_SIGNAL="STEP:RANK:SIGNAL" (e.g. "3:1:SIGTERM"): every transformers Trainer built in
this process gets a callback that sends SIGNAL to its own process when the rank RANK ends optimizer step STEP. The
preemption tests' signal then lands at the same step of every run, however fast the machine, instead of racing a log
line. The process handles it as one a scheduler sent (the same handler, the same checkpoint).

"STEP:RANK:SIGNAL:TARGET[:RESTART]" chooses whom the signal reaches instead (RANK "*": any rank; RESTART: only in the
worker a torchrun agent started after that many restarts, TORCHELASTIC_RESTART_COUNT); several comma-separated specs
each act on their own:
- "outer": the process group of the process that started this one's session (a search trial's session is led by its
  guard: the search), then wait for the SIGTERM that the search's death brings the trial;
- "agent": the torchrun agent that started this worker (a scheduler stopping a node), then wait for the SIGTERM the
  agent forwards;
- "node": the agent and this worker together (SIGKILL: the node is lost, nothing of it runs on);
- "hold": no signal sent: write `<output_dir>.held-STEP` and wait for SIGNAL to reach this worker (the agent stopping
  it because another node joins), so the elastic tests start the joining node at a known step.
The callback runs before ExtTrainer's own (it is added while transformers' Trainer is built), so every waiting
target's preemption checkpoint is STEP's on every run.

TRAINER_EXT_TEST_COUNT_TOKENIZED=FOLDER: every text a transformers tokenizer tokenizes in this process is counted in
FOLDER/rank<RANK>.<pid> (a line per call: how many texts), so a test can tell which rank of which run tokenized what,
whatever code called the tokenizer."""
import importlib.abc
import importlib.util
import os
import sys

SPEC = os.environ.get("TRAINER_EXT_TEST_SIGNAL")
COUNT_FOLDER = os.environ.get("TRAINER_EXT_TEST_COUNT_TOKENIZED")
WAITING_S = 120  # the most a waiting target waits for its signal


def install(trainer_class):
    import signal

    from transformers import TrainerCallback

    specs = [entry.split(":") for entry in SPEC.split(",")]

    class SignalAtStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            for step, rank, name, *rest in specs:
                target, restart = (rest[0] if rest else "self"), (rest[1] if len(rest) > 1 else None)
                if state.global_step != int(step) or rank not in ("*", os.environ.get("RANK", "0")):
                    continue
                if restart is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != restart:
                    continue
                signum = getattr(signal, name)
                if target == "outer":
                    wait_for(signal.SIGTERM, lambda: os.killpg(os.getpgid(session_starter()), signum))
                elif target == "agent":
                    wait_for(signal.SIGTERM, lambda: os.kill(os.getppid(), signum))
                elif target == "node":
                    os.kill(os.getppid(), signum)
                    os.kill(os.getpid(), signum)
                elif target == "hold":
                    wait_for(signum, lambda: open(f"{args.output_dir}.held-{step}", "w").close())
                else:
                    os.kill(os.getpid(), signum)

    built = trainer_class.__init__

    def __init__(self, *args, **kwargs):
        built(self, *args, **kwargs)
        self.add_callback(SignalAtStep())

    trainer_class.__init__ = __init__


def session_starter() -> int:
    """The process that started this session's leader."""
    with open(f"/proc/{os.getsid(0)}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])  # "pid (name) state ppid ..."


def wait_for(signum, act):
    """`act()`, then return once this process got `signum` (handled by the handler it had), or after WAITING_S."""
    import signal
    import time

    got, previous = [], signal.getsignal(signum)

    def note(number, frame):
        got.append(number)
        signal.signal(signum, previous)
        if callable(previous):
            previous(number, frame)

    signal.signal(signum, note)
    act()
    deadline = time.monotonic() + WAITING_S
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
