"""Data loading pieces shared by every backend."""
