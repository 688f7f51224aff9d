"""Data and models shared by the examples (small enough for 2 CPU cores; nothing is downloaded), and the hooks the
tests use to watch an elastic example train (:func:`record_steps`, :func:`log_final`)."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

if TYPE_CHECKING:
    from elastic import StepInfo

DATA = Path(__file__).parent / "data"
#: a directory where an example writes its committed steps (:func:`record_steps`) and its final loss (tests)
RECORD_ENV = "EXAMPLES_RECORD"


def setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(name)s: %(message)s")


def digits_dataset() -> TensorDataset:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped inside the package)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(
            "the digits examples need scikit-learn: pip install 'elastic-train[examples]' "
            "(scripts/setup.sh installs it)"
        ) from exc

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    return TensorDataset(x, y)


def digits_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.1),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


class CharDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of ``block`` characters from a text file; the target is the next character."""

    def __init__(self, path: Path, block: int = 32, split: str | None = None) -> None:
        """``split``: "train" (the text's first 90 %) or "val" (the rest); None: all of it."""
        text = path.read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        cut = int(0.9 * len(text))
        text = {None: text, "train": text[:cut], "val": text[cut:]}[split]
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.int64)
        self.block = block

    def __len__(self) -> int:
        return len(self.data) - self.block - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i : i + self.block + 1]
        return chunk[:-1], chunk[1:]


class TinyTransformer(nn.Module):
    """A character-level causal transformer (2 layers, 64 wide)."""

    def __init__(
        self, vocab: int, block: int = 32, width: int = 64, layers: int = 2, heads: int = 4, dropout: float = 0.1
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(block), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(h)


def get_batch(data: CharDataset, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``data``, drawn with replacement from torch's global RNG (nanoGPT's way)."""
    ix = torch.randint(len(data), (batch,)).tolist()
    return torch.stack([data[i][0] for i in ix]), torch.stack([data[i][1] for i in ix])


@torch.no_grad()
def lm_loss(model: nn.Module, data: CharDataset, ctx: Any, device: torch.device, windows: int = 64) -> float:
    """The mean next-character loss over the first ``windows`` non-overlapping windows of ``data`` (always the same
    ones: evaluations of two runs compare)."""
    was_training = model.training
    model.eval()
    idx = torch.arange(0, min(windows * data.block, len(data)), data.block)
    x = torch.stack([data[int(i)][0] for i in idx]).to(device)
    y = torch.stack([data[int(i)][1] for i in idx]).to(device)
    with ctx:
        logits = model(x)
    model.train(was_training)
    return float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))


class AugmentedImages(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Small synthetic RGB images of ``classes`` classes (a blocky colour layout per class plus noise, made from
    ``seed``), with a random horizontal flip and a random crop of the image padded by one pixel, done where the
    samples are loaded: in the DataLoader's worker processes.

    Each sample's flip and crop come from a generator seeded by (``seed``, epoch, index), not from the workers' RNG
    (seeded anew whenever a loader's iterator starts its workers, and in no checkpoint): a sample gets the same
    augmentation whichever worker loads it, and a resumed run repeats exactly what the first one did.
    :meth:`set_epoch` reaches persistent workers (the epoch is kept in shared memory)."""

    def __init__(self, n: int, seed: int = 0, size: int = 8, classes: int = 10, augment: bool = True) -> None:
        layouts = torch.rand(classes, 3, 2, 2, generator=torch.Generator().manual_seed(1234))  # the same classes
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(classes, (n,), generator=g)
        base = F.interpolate(layouts, size=(size, size), mode="nearest")[self.labels]
        self.images = base + 0.3 * torch.randn(n, 3, size, size, generator=g)
        self.seed, self.size, self.augment = seed, size, augment
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[i]
        if self.augment:
            g = torch.Generator().manual_seed((self.seed * 100_003 + int(self.epoch)) * 1_000_003 + i)
            if torch.rand((), generator=g) < 0.5:
                x = x.flip(-1)
            dy, dx = torch.randint(0, 3, (2,), generator=g).tolist()
            x = F.pad(x, (1, 1, 1, 1))[:, dy : dy + self.size, dx : dx + self.size]
        return x, self.labels[i]


def image_model(classes: int = 10) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, classes),
    )


@torch.no_grad()
def classifier_loss(model: nn.Module, data: Dataset[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    was_training = model.training
    model.eval()
    xs, ys = zip(*(data[i] for i in range(len(data))), strict=True)
    x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
    loss = float(F.cross_entropy(model(x), y))
    model.train(was_training)
    return loss


def ring_points(n: int, seed: int = 0, modes: int = 8, z_dim: int = 4) -> TensorDataset:
    """``n`` points of a ring of ``modes`` Gaussians (the real data of a 2-D GAN), each paired with the latent draw the
    generator maps for it (drawn once, from ``seed``: the data set is the same whoever loads it)."""
    g = torch.Generator().manual_seed(seed)
    angle = 2 * math.pi * torch.randint(modes, (n,), generator=g) / modes
    real = 2.0 * torch.stack([angle.cos(), angle.sin()], dim=1) + 0.05 * torch.randn(n, 2, generator=g)
    return TensorDataset(real, torch.randn(n, z_dim, generator=g))


class GAN(nn.Module):
    """A generator and a discriminator in one module, so that one DDP wrapper synchronizes both with one backward.

    ``forward(real, z)`` returns both losses: D's on the real points and on ``fake.detach()`` (so it reaches only D),
    and G's through D with D's parameters detached (``torch.func.functional_call``: it reaches only G). Their sum
    takes one ``backward()``; then each optimizer steps its half."""

    def __init__(self, z_dim: int = 4, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(
            nn.Linear(z_dim, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2)
        )
        self.d = nn.Sequential(
            nn.Linear(2, width), nn.LeakyReLU(0.2), nn.Linear(width, width), nn.LeakyReLU(0.2), nn.Linear(width, 1)
        )

    def forward(self, real: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fake = self.g(z)
        d_real, d_fake = self.d(real), self.d(fake.detach())
        frozen = {name: p.detach() for name, p in self.d.named_parameters()}
        d_on_fake = torch.func.functional_call(self.d, frozen, (fake,))
        d_loss = F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real)) + (
            F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake))
        )
        g_loss = F.binary_cross_entropy_with_logits(d_on_fake, torch.ones_like(d_on_fake))
        return d_loss, g_loss


@torch.no_grad()
def gan_loss(model: GAN, data: TensorDataset) -> float:
    """D's loss plus G's over the whole data set."""
    d_loss, g_loss = model(*data.tensors)
    return float(d_loss + g_loss)


# -- the tests' hooks -----------------------------------------------------------------------------------------------
def log_final(loss: float) -> None:
    """Log the final loss; under the tests ($EXAMPLES_RECORD) also write it to ``final.json`` there."""
    logging.getLogger("examples").info("final loss %.6f", loss)
    root = os.environ.get(RECORD_ENV)
    if root:
        Path(root, "final.json").write_text(json.dumps({"loss": loss, "pid": os.getpid()}))


def record_steps() -> Callable[[StepInfo], None] | None:
    """The trainer's ``on_step`` hook of the tests: None unless $EXAMPLES_RECORD names a directory. It appends each
    committed step this rank ran to ``<dir>/steps.<pid>.jsonl`` (step, epoch, rank, world, sample indices, ...);
    after step S it waits while ``<dir>/hold-S`` exists, and after any step at a world of W workers while
    ``<dir>/hold-world-W`` does (or until a SIGTERM comes: torchrun stopping the worker), so that a test can kill or
    grow the job where it chooses; while ``<dir>/slow`` exists each step waits the seconds it holds."""
    root = os.environ.get(RECORD_ENV)
    if not root:
        return None
    out = Path(root)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"steps.{os.getpid()}.jsonl"
    # one worker group (a rendezvous round of torchrun) is one attempt at the steps it runs
    attempt = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}:{os.environ.get('WORLD_SIZE')}"
    stopping: list[int] = []
    chained: list[bool] = []

    def chain_sigterm() -> None:  # the trainer's handler is installed by now: run it after noting the signal
        previous = signal.getsignal(signal.SIGTERM)

        def handler(signum: int, frame: Any) -> None:
            stopping.append(signum)
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, handler)
        chained.append(True)

    def on_step(info: StepInfo) -> None:
        if not chained:
            chain_sigterm()
        record = {
            "step": info.step,
            "epoch": info.epoch,
            "rank": info.rank,
            "world": info.world_size,
            "indices": list(info.indices),
            "lr": info.lr,
            "loss": info.loss,
            "late": info.late,
            "attempt": attempt if info.generation is None else f"gen{info.generation}",
            "pid": os.getpid(),
            "t": time.time(),
        }
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if info.late:
            return
        holds = (out / f"hold-{info.step}", out / f"hold-world-{info.world_size}")
        while any(h.exists() for h in holds) and not stopping:
            time.sleep(0.02)
        try:
            time.sleep(float((out / "slow").read_text() or 0.1))
        except (OSError, ValueError):
            pass

    return on_step
