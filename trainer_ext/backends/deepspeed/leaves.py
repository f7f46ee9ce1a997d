"""ZeRO-3's module granularity, checked against the model before DeepSpeed builds its engine.

With `stage3_module_granularity_threshold` > 0 DeepSpeed (0.19.8, `DeepSpeedZeRoOffload`) makes "leaf" modules: each
module whose granularity (its parameters // (1 + modules under it that hold parameters), containers left out) is at
most the threshold, the outermost first, is fetched whole and hooked once. Measured (tests/scripts/zero3_leaves.py, the
tiny BERT against plain PyTorch): leaves holding no container train exactly; a leaf holding a ModuleList (BertEncoder)
trains other weights (step 2's loss 0.748145 against 0.747956), and the model itself as the leaf reduces no gradient at
all (grad norm 0, nothing learns). The model's own granularity is about its parameters per module, the same as one
transformer block's, so a threshold that reaches the blocks (h² on BERT and Llama alike) reaches the whole model:
such a value is refused here, naming the largest that is safe."""

from __future__ import annotations

import json
import sys

from ...deepspeed_config.load import DeepSpeedConfigError

KEY = "zero_optimization.stage3_module_granularity_threshold"
MAX_LEAF_SIZE = 1e9  # DeepSpeed's Z3_MAX_LEAF_SIZE: larger modules are never leaves


def _is_container(module) -> bool:
    import torch

    return type(module).__name__ in torch.nn.modules.container.__all__


def _numel(parameter) -> int:
    return getattr(parameter, "ds_numel", None) or parameter.numel()  # partitioned under ZeRO-3: ds_numel is whole


def granularities(model) -> dict:
    """id(module) -> (name, granularity, holds a container) for every module DeepSpeed could make a leaf."""
    found = {}

    def walk(module, name):
        if not any(True for _ in module.parameters()):
            return 0, 0, False
        count = sum(_numel(p) for p in module.parameters(recurse=False))
        children = list(module.named_children())
        if not children:
            return 1, count, False
        layers, container = 0, False
        for child_name, child in children:
            child_layers, child_count, child_container = walk(child, f"{name}.{child_name}" if name else child_name)
            layers, count = layers + child_layers, count + child_count
            container = container or child_container or (_is_container(child) and child_count > 0)
        if _is_container(module):
            return layers, count, container
        layers += 1
        granularity = count // layers if count <= MAX_LEAF_SIZE else sys.maxsize
        found[id(module)] = (name, granularity, container)  # "": the model itself
        return layers, count, container

    walk(model, "")
    return found


def leaves(model, threshold: float) -> list[tuple[str, int, bool]]:
    """The modules DeepSpeed makes leaves at this threshold, outermost first: (name, granularity, holds a container)."""
    table, chosen = granularities(model), []

    def visit(module):
        if not any(True for _ in module.parameters()):
            return
        entry = table.get(id(module))
        if entry and entry[1] <= threshold:
            chosen.append(entry)
            return
        for child in module.children():
            visit(child)

    if threshold > 0:
        visit(model)
    return chosen


def check_granularity(model, config: dict) -> None:
    """Refuse a ZeRO-3 config whose module granularity makes a leaf of the model or of a module holding a container
    (wrong or no gradients)."""
    zero = config.get("zero_optimization", {})
    threshold = zero.get("stage3_module_granularity_threshold", zero.get("module_granularity_threshold", 0))
    if zero.get("stage") != 3 or not isinstance(threshold, (int, float)) or threshold <= 0:
        return
    bad = [entry for entry in leaves(model, threshold) if entry[2] or not entry[0]]
    if not bad:
        return
    unsafe = [granularity for _, granularity, container in granularities(model).values() if container]
    safe = min(unsafe, default=sys.maxsize) - 1
    name, granularity, _ = bad[0]
    what = f"{name} (it holds a ModuleList)" if name else f"the whole model ({type(model).__name__})"
    raise DeepSpeedConfigError([
        f"{KEY}={json.dumps(threshold)} makes {what} one ZeRO-3 leaf (its granularity is {granularity}): DeepSpeed then trains "
        f"with wrong or no gradients (measured: grad norm 0, nothing learnt); set it to at most {safe} (leaves that "
        "hold no container train exactly), or to 0, DeepSpeed's default"])
