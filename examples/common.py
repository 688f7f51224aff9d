"""Data and models shared by the examples (small enough for 2 CPU cores; nothing is downloaded)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

DATA = Path(__file__).parent / "data"


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
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.1), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip


class CharDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of ``block`` characters from a text file; the target is the next character."""

    def __init__(self, path: Path, block: int = 32) -> None:
        text = path.read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.int64)
        self.block = block

    def __len__(self) -> int:
        return len(self.data) - self.block - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i : i + self.block + 1]
        return chunk[:-1], chunk[1:]


class TinyTransformer(nn.Module):
    """A character-level causal transformer (2 layers, 64 wide)."""

    def __init__(self, vocab: int, block: int = 32, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(block), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(h)
