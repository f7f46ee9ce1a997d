"""The one set-up step of a process before training (prepare: the backend, the launcher's world, SageMaker, remote
checkpoints), and what ExtTrainer adds to a training step: losses equal on any number of ranks (losses), the compute_metrics check (metrics_check), and what a long run shows (progress)."""
