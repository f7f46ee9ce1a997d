"""What DeepSpeed's ZeRO-3 module granularity does to training, on one CPU process (gloo): the tiny BERT trained 4
steps by plain PyTorch and by DeepSpeed at each threshold given; prints one JSON line per run: the leaves DeepSpeed
chose, each step's loss and gradient norm. DeepSpeed's stage-3 zero_grad calls Tensor.record_stream, which CPU tensors
lack (a GPU-only stream bookkeeping call): it is a no-op here, the only change, so the CPU runs DeepSpeed's GPU path.

    python tests/scripts/zero3_leaves.py 0 560 800 1024
"""

import json
import os
import sys

import torch

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29613"), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", DS_ACCELERATOR="cpu")
torch.Tensor.record_stream = lambda self, stream: None

from transformers import BertConfig, BertForSequenceClassification  # noqa: E402

CONFIG = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
STEPS, LR = 4, 1e-2


def batches():
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield torch.randint(0, 64, (8, 16), generator=generator), torch.randint(0, 2, (8,), generator=generator)


def model():
    torch.manual_seed(0)
    return BertForSequenceClassification(CONFIG)


def plain():
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    losses, norms = [], []
    for inputs, labels in batches():
        loss = net(input_ids=inputs, labels=labels).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"threshold": None, "leaves": [], "losses": losses, "norms": norms}


def zero3(threshold):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": threshold,
                                    "stage3_param_persistence_threshold": 0}}
    net = model()
    engine, *_ = deepspeed.initialize(model=net, config=config, model_parameters=net.parameters())
    leaves = [name or "(the model)" for name, module in net.named_modules() if getattr(module, "_z3_leaf", False)]
    losses, norms = [], []
    for inputs, labels in batches():
        loss = engine(input_ids=inputs, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return {"threshold": threshold, "leaves": leaves, "losses": losses, "norms": norms}


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    print(json.dumps(plain()), flush=True)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    for value in sys.argv[1:]:
        print(json.dumps(zero3(int(value))), flush=True)
