"""Under torchrun with 2 ranks: the process group's collectives time out after 2 s, and each machine's main process
works 5 s in data/cache.py's on_each_machine while the other rank waits; then a second call whose work refuses the
data. Prints what each rank got, for tests/integration/test_data_cache.py."""
import datetime
import os
import sys
import time
from types import SimpleNamespace

import torch.distributed as dist

from trainer_ext.data.cache import on_each_machine
from trainer_ext.errors import UserError


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
    rank = dist.get_rank()
    args = SimpleNamespace(world_size=dist.get_world_size(), local_process_index=int(os.environ["LOCAL_RANK"]))

    def slow():
        time.sleep(5)
        return f"built by rank {rank}"

    started = time.monotonic()
    print(f"rank {rank} got {on_each_machine(args, slow, 'builds the data')!r} after "
          f"{time.monotonic() - started:.0f} s", flush=True)

    def refuse():
        raise UserError("train.jsonl line 7: a bad row")

    try:
        on_each_machine(args, refuse, "builds the data")
    except UserError as err:
        print(f"rank {rank} refused: {err}", flush=True)
    dist.barrier()  # the training group still works
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
