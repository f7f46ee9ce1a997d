"""Build ExtTrainingArguments for each backend in this fresh process (no launcher) and print, as JSON, what each
construction changed: environment variables, files under a watched folder, a stale op-build lock and /dev/shm buffer
planted there (what DeepSpeed's leftovers clean-up removes), the process group, torch's threads. Stock
TrainingArguments with the same stock flags is built just before, so what transformers changes itself is not counted
against ours. Then trainer_ext.prepare_process, the one step that sets the process up, is called for DDP, then twice
for a ZeRO-2 run, and for those arguments pickled and loaded (training_args.bin) in the same process.

usage: python args_side_effects.py WATCHED_FOLDER"""

import json
import os
import pickle
import sys
import time
from pathlib import Path

watched = Path(sys.argv[1])
REPO = Path(__file__).resolve().parents[2]
os.environ["TORCH_EXTENSIONS_DIR"] = str(watched / "torch_extensions")
os.environ["LOCAL_SIZE"] = "2"  # the deepspeed launcher's count of local ranks: CPU thread sharing acts on it
for name in ("OMP_NUM_THREADS", "DS_ACCELERATOR", "TENSORBOARD_LOGGING_DIR"):  # unset, as in a fresh notebook
    os.environ.pop(name, None)
lock = watched / "torch_extensions" / "fused_adam" / "lock"
buffer = Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_side-effects_{os.getpid()}_0"
for path in (lock, buffer):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("left by a killed job")
    os.utime(path, (time.time() - 3600, time.time() - 3600))

import torch  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from trainer_ext import ExtTrainingArguments, prepare_process  # noqa: E402


def state() -> dict:
    files = {str(p.relative_to(watched)): p.stat().st_mtime_ns for p in watched.rglob("*")}
    files[str(buffer)] = buffer.stat().st_mtime_ns if buffer.exists() else None
    return {"env": dict(os.environ), "files": files, "group": torch.distributed.is_initialized(),
            "threads": torch.get_num_threads()}


def changes(before: dict, after: dict) -> dict:
    env0, env1 = before["env"], after["env"]
    return {"env": {key: [env0.get(key), env1.get(key)] for key in env0.keys() | env1.keys()
                    if env0.get(key) != env1.get(key)},
            "files": sorted(key for key in before["files"].keys() | after["files"].keys()
                            if before["files"].get(key) != after["files"].get(key)),
            **{key: [before[key], after[key]] for key in ("group", "threads") if before[key] != after[key]}}


def measured(build) -> dict:
    before = state()
    build()
    return changes(before, state())


COMMON = {"output_dir": str(watched / "out"), "report_to": "none"}
SAGEMAKER_JOB = {"SAGEMAKER_BASE_DIR": str(watched / "job"), "SM_MODEL_DIR": str(watched / "job" / "model"),
                 "SM_OUTPUT_DATA_DIR": str(watched / "job" / "output" / "data"), "SM_HPS": "{}",
                 "SM_INPUT_CONFIG_DIR": str(watched / "job" / "input" / "config"), "SM_HOSTS": '["algo-1"]'}
CASES = {  # name -> (flags stock TrainingArguments takes too, trainer_ext's own flags, environment of the case)
    "ddp": ({}, {}, {}),
    "deepspeed zero2 file": ({"deepspeed": str(REPO / "ds_configs" / "zero2_minimal.json")}, {}, {}),
    "deepspeed zero3 file": ({"deepspeed": str(REPO / "ds_configs" / "zero3.json")}, {}, {}),
    "sharded_ddp simple": ({}, {"sharded_ddp": "simple"}, {}),
    "fsdp full_shard": ({"fsdp": "full_shard"}, {}, {}),
    "checkpoint_uri": ({}, {"checkpoint_uri": str(watched / "remote")}, {}),
    "sagemaker job": ({}, {}, SAGEMAKER_JOB),
}
report = {"stock": {}, "ext": {}}
built = {}
for name, (stock_flags, own_flags, environment) in CASES.items():
    os.environ.update(environment)
    report["stock"][name] = measured(lambda: TrainingArguments(**COMMON, **stock_flags))
    report["ext"][name] = measured(lambda: built.__setitem__(name, ExtTrainingArguments(**COMMON, **stock_flags,
                                                                                         **own_flags)))
    for key in environment:
        del os.environ[key]
# --use_cpu: a gloo group (without it accelerate would have DeepSpeed build its CPU communication op here, minutes)
zero2 = ExtTrainingArguments(**COMMON, **CASES["deepspeed zero2 file"][0], use_cpu=True)
loaded = []  # the arguments as training_args.bin brings them back in the process that prepared them
report["prepare_process"] = [measured(lambda: prepare_process(built["ddp"])), measured(lambda: prepare_process(zero2)),
                             measured(lambda: prepare_process(zero2)),
                             measured(lambda: prepare_process(loaded.append(pickle.loads(pickle.dumps(zero2)))
                                                              or loaded[0]))]
report["prepared_in"] = [zero2.run_settings.prepared_in, loaded[0].run_settings.prepared_in]
report["world_size"] = zero2.world_size
buffer.unlink(missing_ok=True)
print("REPORT " + json.dumps(report))
