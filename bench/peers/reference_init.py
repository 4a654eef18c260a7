"""Writes tests/data/torch-init.json: what PyTorch draws after
`torch.manual_seed(42)` for the quickstart's students (built as the peer builds
them) and the first two epochs' `torch.randperm(60000)`, for tests/reference.rs
to check `generator = "torch"` against.

Per parameter tensor (burn's layouts: linear weights [in, out]): its shape,
its first and last values and its sum; per epoch: the order's first 16 and
last 4 entries.

    bench/peers/.venv/bin/python bench/peers/reference_init.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import mnist_cnn_torch as peer  # noqa: E402
from reference_curves import ROOT, burn_layout  # noqa: E402

SEED, SAMPLES = 42, 60000


def main():
    torch.manual_seed(SEED)
    students = [
        peer.ConvStudent(1, 6, 32),
        peer.BottleneckStudent(32, 16, 64),
        peer.BottleneckStudent(64, 24, 128),
        peer.HeadStudent(128 * 3 * 3, 128, 10),
    ]
    blocks = []
    for student in students:
        tensors = []
        for p in burn_layout(student):
            v = p["values"]
            tensors.append({"shape": p["shape"], "first": v[:4], "last": v[-1], "sum": sum(v)})
        blocks.append(tensors)
    orders = []
    for _ in range(2):
        order = torch.randperm(SAMPLES).tolist()
        orders.append({"first": order[:16], "last": order[-4:]})
    out = {"seed": SEED, "samples": SAMPLES, "torch": torch.__version__, "blocks": blocks, "epochs": orders}
    path = os.path.join(ROOT, "tests", "data", "torch-init.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
