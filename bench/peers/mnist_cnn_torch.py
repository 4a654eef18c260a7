"""The quickstart recipe (experiments/mnist-cnn.toml) as a short PyTorch script.

The peer pipe-bd is compared against: what a user of this field would write
by hand. Same data (the IDX files in data/mnist, normalised with the
teacher's mean and std), same frozen teacher (data/teachers/mnist-cnn.pth),
same four student blocks, losses (MSE on blocks 1-3, soft-target
cross-entropy at temperature 1 on the logits), Adam (lr 0.002, eps 1e-5)
with a per-step cosine decay to 0, batch 128, a shuffled epoch order. Each
block trains on the teacher's own input to it (blockwise distillation, the
`ideal` schedule: one device, blocks one after another per batch).

    bash bench/peers/setup.sh                   # once: torch into bench/peers/.venv
    bench/peers/.venv/bin/python bench/peers/mnist_cnn_torch.py --epochs 1 --threads 2
    python3 bench/peers/mnist_cnn_torch.py --epochs 1 --device cuda   # on a GPU

With `--device cuda` the data set, teacher and students live on the GPU from
the start, each batch is gathered there by index, and the loop never waits
for the GPU: the per-step losses stay on the device until training ends, and
the clock is read after a `torch.cuda.synchronize()`. Per-block times come
from CUDA events on every 10th step.

Prints one JSON object: samples/s while training, per-block final losses
(mean of the last 20 steps, as pipe-bd reports them), the teacher's and the
stitched student's test accuracy.
"""

import argparse
import gzip
import json
import math
import os
import statistics
import struct
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

PIXEL_MEAN, PIXEL_STD = 0.1307, 0.3081
STAGE_CHANNELS = [32, 64, 128]


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    dims = magic & 0xFF
    shape = struct.unpack(">" + "I" * dims, data[4 : 4 + 4 * dims])
    return torch.frombuffer(bytearray(data[4 + 4 * dims :]), dtype=torch.uint8).reshape(shape)


def find(dir_, stem):
    for name in (stem, stem + ".gz"):
        path = os.path.join(dir_, name)
        if os.path.exists(path):
            return path
    sys.exit(f"{os.path.join(dir_, stem)}: not found (run scripts/setup-data.sh)")


def load_split(dir_, prefix, limit):
    images = read_idx(find(dir_, f"{prefix}-images-idx3-ubyte")).float()
    labels = read_idx(find(dir_, f"{prefix}-labels-idx1-ubyte")).long()
    if limit:
        images, labels = images[:limit], labels[:limit]
    images = (images / 255.0 - PIXEL_MEAN) / PIXEL_STD
    return images.unsqueeze(1), labels


class Teacher(nn.Module):
    """The published MNIST CNN: three conv 3x3 + ReLU + max-pool stages and a 2-layer head."""

    def __init__(self):
        super().__init__()
        chans = [1] + STAGE_CHANNELS
        self.conv_layers = nn.ModuleList(nn.Conv2d(chans[i], chans[i + 1], 3, padding=1) for i in range(3))
        self.fc_layers = nn.ModuleList([nn.Linear(128 * 3 * 3, 256), nn.Linear(256, 10)])

    def blocks(self):
        stages = [lambda x, c=c: F.max_pool2d(F.relu(c(x)), 2) for c in self.conv_layers]
        head = lambda x: self.fc_layers[1](F.relu(self.fc_layers[0](x.flatten(1))))
        return stages + [head]


class ConvStudent(nn.Module):
    """conv 3x3 (c_in -> width) -> ReLU -> conv 1x1 (width -> out) -> ReLU -> max-pool 2."""

    def __init__(self, c_in, width, out):
        super().__init__()
        self.spatial = nn.Conv2d(c_in, width, 3, padding=1)
        self.project = nn.Conv2d(width, out, 1)

    def forward(self, x):
        return F.max_pool2d(F.relu(self.project(F.relu(self.spatial(x)))), 2)


class BottleneckStudent(nn.Module):
    """conv 1x1 (c_in -> rank) -> conv 3x3 (rank -> rank) -> conv 1x1 (rank -> out) -> ReLU -> max-pool 2."""

    def __init__(self, c_in, rank, out):
        super().__init__()
        self.reduce = nn.Conv2d(c_in, rank, 1)
        self.spatial = nn.Conv2d(rank, rank, 3, padding=1)
        self.expand = nn.Conv2d(rank, out, 1)

    def forward(self, x):
        return F.max_pool2d(F.relu(self.expand(self.spatial(self.reduce(x)))), 2)


class HeadStudent(nn.Module):
    """flatten -> linear (features -> hidden) -> ReLU -> linear (hidden -> classes)."""

    def __init__(self, features, hidden, classes):
        super().__init__()
        self.hidden = nn.Linear(features, hidden)
        self.output = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.output(F.relu(self.hidden(x.flatten(1))))


def published_to_ours(state):
    """The published state dict names layers by their index in nn.Sequential
    stacks (conv, ReLU, pool, ...): conv_layers.0/3/6, fc_layers.0/2."""
    renames = {"conv_layers.3.": "conv_layers.1.", "conv_layers.6.": "conv_layers.2.", "fc_layers.2.": "fc_layers.1."}
    out = {}
    for key, value in state.items():
        for old, new in renames.items():
            if key.startswith(old):
                key = new + key[len(old) :]
        out[key] = value
    return out


def load_params(module, path):
    """Copies flat parameters (burn's layouts: linear weights [in, out]) into `module`."""
    with open(path) as f:
        params = json.load(f)["params"]
    ours = list(module.parameters())
    if len(ours) != len(params):
        sys.exit(f"{path}: {len(params)} tensors, the module has {len(ours)}")
    with torch.no_grad():
        for p, r in zip(ours, params):
            t = torch.tensor(r["values"]).reshape(r["shape"])
            p.copy_(t if t.shape == p.shape else t.t())


def soft_target_ce(logits, target_logits, temperature=1.0):
    target = F.softmax(target_logits / temperature, dim=1)
    return -(target * F.log_softmax(logits / temperature, dim=1)).sum(1).mean()


def accuracy(blocks, images, labels, chunk=1000):
    correct = 0
    with torch.no_grad():
        for i in range(0, len(images), chunk):
            x = images[i : i + chunk]
            for block in blocks:
                x = block(x)
            correct += (x.argmax(1) == labels[i : i + chunk]).sum().item()
    return correct / len(images)


# On CUDA, the steps whose per-block times are recorded (with CUDA events).
CUDA_TIMING_EVERY = 10


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/mnist")
    parser.add_argument("--teacher", default="data/teachers/mnist-cnn.pth")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--train-limit", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2,
                        help="CPU threads (torch.set_num_threads): training's with --device cpu, only the data "
                        "loading's with cuda")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (everything on that GPU)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--init", help="start the students from the weights `pipebd export-init` wrote into "
                        "this folder (block-K.json), i.e. exactly where pipe-bd starts them")
    parser.add_argument("--metrics", help="write step,block,loss,lr of every step to this CSV (on CUDA from the "
                        "losses kept on the GPU, so asking for it adds no per-step sync)")
    args = parser.parse_args()

    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        sys.exit(f"--device {args.device}: expected cpu or cuda[:N]")
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit(f"--device {args.device}: this torch {torch.__version__} sees no CUDA GPU")
    torch.set_num_threads(args.threads)
    train_x, _ = load_split(args.data, "train", args.train_limit)
    test_x, test_y = load_split(args.data, "t10k", 0)
    train_x, test_x, test_y = train_x.to(device), test_x.to(device), test_y.to(device)

    teacher = Teacher()
    teacher.load_state_dict(published_to_ours(torch.load(args.teacher, map_location="cpu")))
    teacher.eval().requires_grad_(False).to(device)
    teacher_blocks = teacher.blocks()
    # Seeded after the teacher is built: the generator's first draws are the
    # students' (pipe-bd's `generator = "torch"` draws the same students from
    # the same seed), then one randperm per epoch.
    torch.manual_seed(args.seed)
    students = [
        ConvStudent(1, 6, 32),
        BottleneckStudent(32, 16, 64),
        BottleneckStudent(64, 24, 128),
        HeadStudent(128 * 3 * 3, 128, 10),
    ]
    if args.init:
        for k, student in enumerate(students):
            load_params(student, os.path.join(args.init, f"block-{k + 1}.json"))
    for student in students:
        student.to(device)
    losses = [F.mse_loss] * 3 + [soft_target_ce]
    optimizers = [torch.optim.Adam(s.parameters(), lr=args.lr, eps=1e-5) for s in students]
    per_epoch = len(train_x) // args.batch_size
    total = per_epoch * args.epochs
    history = [[] for _ in students]  # per block and step: the loss (a GPU tensor on CUDA)
    lrs = []
    timings = [([], []) for _ in students]  # per block: teacher forward, student step (seconds)
    events = [[] for _ in students]  # CUDA: per block, (start, teacher done, step done) events

    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step = 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(train_x)).to(device)
        for b in range(per_epoch):
            lr = 0.5 * args.lr * (1 + math.cos(math.pi * step / total))
            lrs.append(lr)
            x = train_x[order[b * args.batch_size : (b + 1) * args.batch_size]]
            timed = cuda and step % CUDA_TIMING_EVERY == 0
            for k, (t, s, loss_fn, opt) in enumerate(zip(teacher_blocks, students, losses, optimizers)):
                if timed:
                    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                    marks[0].record()
                t0 = time.perf_counter()
                with torch.no_grad():
                    y = t(x)
                t1 = time.perf_counter()
                if timed:
                    marks[1].record()
                for group in opt.param_groups:
                    group["lr"] = lr
                loss = loss_fn(s(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if cuda:
                    history[k].append(loss.detach())
                    if timed:
                        marks[2].record()
                        events[k].append(marks)
                else:
                    history[k].append(loss.item())
                    timings[k][0].append(t1 - t0)
                    timings[k][1].append(time.perf_counter() - t1)
                x = y
            step += 1
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if cuda:
        history = [torch.stack(h).tolist() for h in history]
        timings = [([1e-3 * a.elapsed_time(b) for a, b, _ in e], [1e-3 * b.elapsed_time(c) for _, b, c in e])
                   for e in events]

    if args.metrics:
        rows = [f"{i},{k + 1},{h[i]},{lrs[i]}" for i in range(total) for k, h in enumerate(history)]
        with open(args.metrics, "w") as f:
            f.write("step,block,loss,lr\n" + "\n".join(rows) + "\n")
    for s in students:
        s.eval()
    print(
        json.dumps(
            {
                "peer": f"pytorch {torch.__version__} eager"
                + (f" on {device} ({torch.cuda.get_device_name(device)})" if cuda else ""),
                "threads": args.threads,
                "epochs": args.epochs,
                "train_samples": len(train_x),
                "steps": total,
                "train_seconds": seconds,
                "samples_per_second": total * args.batch_size / seconds,
                "final_losses": [sum(h[-20:]) / len(h[-20:]) for h in history],
                "block_ms": [
                    {"teacher_forward": 1e3 * statistics.median(f), "student_step": 1e3 * statistics.median(s)}
                    for f, s in timings
                ],
                "teacher_accuracy": accuracy(teacher_blocks, test_x, test_y),
                "student_accuracy": accuracy(students, test_x, test_y),
            }
        )
    )


if __name__ == "__main__":
    main()
