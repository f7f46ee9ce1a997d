"""What ExtTrainer adds to a training step: losses equal on any number of ranks (losses), the compute_metrics check (metrics_check), and what a long run shows (progress)."""
