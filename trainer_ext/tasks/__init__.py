"""Task entry points shared by the example scripts and the experiment runner."""
