"""`python -m trainer_ext COMMAND ...` (and `torchrun -m trainer_ext train experiment.yaml`): the trainer-ext CLI."""

from .cli import run

run()
