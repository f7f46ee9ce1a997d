"""`make gpu-check`'s first step: this python must see a CUDA GPU through a CUDA build of torch; one line and exit
status 2 otherwise, before anything is installed or run."""

import sys

try:
    import torch
except ImportError:
    sys.exit(f"make gpu-check: {sys.executable} has no torch: install a CUDA build of torch, or set GPU_PY to a python "
             "that has one (make gpu-check GPU_PY=/path/to/python)")
if not torch.cuda.is_available():
    sys.exit(f"make gpu-check: no CUDA GPU visible to {sys.executable} (torch {torch.__version__}): run it on a GPU "
             "machine, or set GPU_PY to a python with a CUDA build of torch")
names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
print(f"{torch.cuda.device_count()} GPU(s): {', '.join(names)}; torch {torch.__version__}, CUDA {torch.version.cuda}")
