"""Record the loss and grad-norm series in loss_series.txt (run from the repository root).

    python tests/scaler/data/record_loss_series.py > tests/scaler/data/loss_series.txt

The launcher's demo job in one process: gpt_small on synthetic data, fp32, AdamW (lr 3e-3, as
trainer.lr), batch 8 x 64 tokens, seed 0, 400 steps, no guard. One line per step: the loss and
the global grad norm before the optimizer step, as the spike gate would see them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from launch.data import build_batches
from launch.models import build_model


def main() -> None:
    torch.manual_seed(0)
    model = build_model(
        {"name": "gpt_small", "vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4},
        seq_len=64,
    )
    batches = build_batches(
        {"name": "synthetic", "seq_len": 64, "batch_size": 8, "noise": 0.1},
        seed=0,
        rank=0,
        vocab_size=256,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    print(
        "# step loss grad_norm  (tests/scaler/data/record_loss_series.py, torch",
        torch.__version__ + ")",
    )
    for step in range(400):
        batch = batches(step)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        print(f"{step} {loss.item():.9g} {norm.item():.9g}")
        opt.step()


if __name__ == "__main__":
    main()
