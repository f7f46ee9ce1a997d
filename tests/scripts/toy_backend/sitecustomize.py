"""On PYTHONPATH: registers toy_backend.py's backend in trainer_ext's registry, the one line a new backend adds to
trainer_ext/backends/__init__.py (here from outside the package, for the test)."""
import trainer_ext.backends

trainer_ext.backends.BACKENDS["toy"] = ("toy_backend", "NoSyncEveryOtherStep")
