"""The code behind the suite's fixtures, by concern (tests/conftest.py keeps pytest's hooks and fixtures and re-exports
these names, so test files keep `from conftest import X`): environment.py (this interpreter, its folders, what a
child inherits; imported first, before torch loads), shared.py (the session's folder shared by the xdist workers),
ops.py (DeepSpeed's ops built once in the background), markers.py (the check that keeps the markers true),
order.py (the file order for the two workers), processes.py (real processes in their own group and their timing
report), launches.py (the examples under the real launchers), outputs.py (what a run left: logs, weights,
checkpoints), references.py (the session-wide reference runs), sample_order.py (record_order.py's runs),
models.py (tiny models for in-process tests), examples.py (an example's main in this process) and
deepspeed_oracle.py (DeepSpeed's own config parser)."""

from . import environment  # first: OMP_WAIT_POLICY and PATH before any module loads torch

__all__ = ["environment"]
