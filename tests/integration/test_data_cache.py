"""The tokenized data cache's wait across ranks (trainer_ext/data/cache.py), under torchrun on 2 CPU ranks: a build
longer than the process group's collective timeout ends no rank, the waiting rank says so once, and a refusal on the
main process is every rank's error."""

import pytest

from conftest import REPO, free_port, launcher, run

pytestmark = pytest.mark.launch


def test_a_build_longer_than_the_collective_timeout_ends_no_rank_and_a_refusal_reaches_every_rank():
    """The group's timeout is 2 s (tests/scripts/wait_for_main.py), the main process works 5 s: a barrier on that group
    would fail after 3 s (what main_process_first did, at --ddp_timeout or torch's 30 minutes)."""
    out = run([*launcher("torchrun"), "--nproc_per_node", 2, "--master_port", free_port(),
               REPO / "tests" / "scripts" / "wait_for_main.py"], timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} got 'built by rank 0' after 5 s" in out.stdout, out.stdout
        assert f"rank {rank} refused: train.jsonl line 7: a bad row" in out.stdout
    assert out.stdout.count("wait while its main process builds the data") == 1
