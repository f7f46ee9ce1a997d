"""The old path of experiment files (now trainer_ext.config.experiment_file), kept because docs/experiments.md named
it for users' own code: `from trainer_ext.experiment import run_experiment`."""

from .config.experiment_file import Experiment, ExperimentError, load_experiment, run_experiment

__all__ = ["Experiment", "ExperimentError", "load_experiment", "run_experiment"]
