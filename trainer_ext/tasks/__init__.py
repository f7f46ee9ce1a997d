"""Reusable task recipes (data preparation, metrics, `run`) shared by the example scripts and experiment runners."""
