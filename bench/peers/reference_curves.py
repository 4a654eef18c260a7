"""Writes tests/data/reference-curves.json: loss curves computed by PyTorch,
independently of pipe-bd, for tests/reference.rs to check pipe-bd against.

For three student blocks of the quickstart's kinds (a `conv` block 1, a
`bottleneck` block 2, a narrow `head` block 4 with the soft-target
cross-entropy), starting from PyTorch's own initial weights: 20 Adam steps
(lr 0.002, eps 1e-5, cosine to 0 over the 20 steps) on batches of 32 real
MNIST images, each block on the pretrained teacher's input to it. The file
holds the initial weights (in burn's layouts: linear weights [in, out]), the
batches' sample indices and the loss of every step.

    bench/peers/.venv/bin/python bench/peers/reference_curves.py
"""

import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import mnist_cnn_torch as peer  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
STEPS, BATCH, LR, EPS = 20, 32, 0.002, 1e-5


def burn_layout(module):
    out = []
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False):
            value = p.detach()
            if isinstance(sub, nn.Linear) and name == "weight":
                value = value.t()
            out.append({"shape": list(value.shape), "values": value.flatten().tolist()})
    return out


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    train_x, _ = peer.load_split(os.path.join(ROOT, "data/mnist"), "train", 0)
    teacher = peer.Teacher()
    weights = torch.load(os.path.join(ROOT, "data/teachers/mnist-cnn.pth"), map_location="cpu")
    teacher.load_state_dict(peer.published_to_ours(weights))
    teacher_blocks = teacher.blocks()
    order = torch.randperm(len(train_x))[: STEPS * BATCH]
    batches = [order[i * BATCH : (i + 1) * BATCH].tolist() for i in range(STEPS)]
    cases = [
        (1, {"kind": "conv", "width": 6, "out_channels": 32}, peer.ConvStudent(1, 6, 32), F.mse_loss),
        (2, {"kind": "bottleneck", "rank": 16, "out_channels": 64}, peer.BottleneckStudent(32, 16, 64), F.mse_loss),
        (4, {"kind": "head", "hidden": 8, "classes": 10}, peer.HeadStudent(128 * 3 * 3, 8, 10), peer.soft_target_ce),
    ]
    blocks = []
    for block, config, student, loss_fn in cases:
        initial = burn_layout(student)
        optimizer = torch.optim.Adam(student.parameters(), lr=LR, eps=EPS)
        losses = []
        for step, indices in enumerate(batches):
            for group in optimizer.param_groups:
                group["lr"] = 0.5 * LR * (1 + math.cos(math.pi * step / STEPS))
            with torch.no_grad():
                x = train_x[torch.tensor(indices)]
                for t in teacher_blocks[: block - 1]:
                    x = t(x)
                y = teacher_blocks[block - 1](x)
            loss = loss_fn(student(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        blocks.append({"block": block, "student": config, "params": initial, "losses": losses})
    out = {
        "generator": f"bench/peers/reference_curves.py, torch {torch.__version__}",
        "steps": STEPS,
        "lr": LR,
        "epsilon": EPS,
        "batches": batches,
        "blocks": blocks,
    }
    path = os.path.join(ROOT, "tests/data/reference-curves.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
