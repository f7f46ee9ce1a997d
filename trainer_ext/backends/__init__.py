"""Training backends: one file each; `select_backend` picks one from the arguments."""

from .base import Backend, select_backend

__all__ = ["Backend", "select_backend"]
