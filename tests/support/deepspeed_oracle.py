"""DeepSpeed's own config parser as an oracle, in the test's process: DeepSpeed initialised once on a gloo group of
one (its rank variables put back afterwards, so no later child thinks it is a rank), then DeepSpeedConfig checks a
config at any data-parallel world size through DeepSpeed's documented `mpu` interface. No JIT op is built: DeepSpeed's
communication starts without its optional shared-memory all-reduce kernel (as on a machine that cannot build it; gloo
reduces instead), which a group of one never uses and which took ~2 min of compiling in the unit subset."""

import os

from .environment import DISTRIBUTED_ENV, free_port


class DataParallelWorld:
    """DeepSpeed's documented `mpu` interface: lets DeepSpeedConfig check batch fields at world size N."""

    def __init__(self, world_size):
        self.world_size = world_size

    def get_data_parallel_world_size(self):
        return self.world_size

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0


def deepspeed_config_check():
    """Returns check(config, world_size) -> DeepSpeedConfig, parsed by DeepSpeed itself (raises if rejected)."""
    saved = {k: os.environ.get(k) for k in DISTRIBUTED_ENV}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    import importlib

    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    deepspeed_torch_comm = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm exports torch itself

    build_shm_op = deepspeed_torch_comm.build_shm_op
    deepspeed_torch_comm.build_shm_op = lambda: None  # DeepSpeed's own answer where the op is not compatible
    try:
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    finally:
        deepspeed_torch_comm.build_shm_op = build_shm_op  # later child processes must not inherit a rank from this one
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)

    def check(config, world_size):
        return DeepSpeedConfig(config, mpu=DataParallelWorld(world_size))

    return check
