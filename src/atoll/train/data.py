"""Training data: token files read lazily, a per-learner shard, and a resumable batch cursor.

Three layers, each small, each in its own module; every name is importable from here:

* :class:`TokenData` (:mod:`atoll.train.tokens`) is a read-only sequence of token ids: one or
  more flat token files (nanoGPT's ``.bin``: raw little-endian uint8/uint16/uint32, no header) on
  any fsspec URL, joined end to end. Nothing is loaded up front: local files are
  ``np.memmap``-ed, remote ones are read by byte range (``fs.cat_ranges``), only the windows a
  batch needs.
* :func:`stdlib_corpus` / :func:`text_corpus` (:mod:`atoll.train.corpus`) build the default
  corpus with no download: the Python standard library's own source, as raw bytes (vocabulary
  256), split into train and validation **by file**, written once to a cache folder as token
  files, then read as above.
* :class:`BatchStream` (:mod:`atoll.train.batches`) gives learner ``i`` of ``M`` its own disjoint
  shard of the train tokens and hands out ``(x, y)`` batches in a seeded order. Its whole
  position is a small JSON-able cursor (:meth:`BatchStream.state_dict`), saved with the
  learner's state, so a learner that rejoins continues with exactly the next window: nothing
  repeated, nothing skipped.

:func:`evaluate` (this module) gives a deterministic validation loss for any model meeting the
model contract.
"""

from __future__ import annotations

import torch

from atoll.train.batches import CURSOR_FORMAT, BatchStream
from atoll.train.corpus import (
    Corpus,
    decode_bytes,
    encode_bytes,
    stdlib_corpus,
    stdlib_path,
    text_corpus,
    token_corpus,
)
from atoll.train.model import loss_fn
from atoll.train.tokens import TOKEN_DTYPES, DataError, TokenData, open_tokens, write_tokens

__all__ = [
    "DataError",
    "TOKEN_DTYPES",
    "TokenData",
    "Corpus",
    "open_tokens",
    "token_corpus",
    "text_corpus",
    "stdlib_corpus",
    "stdlib_path",
    "write_tokens",
    "BatchStream",
    "CURSOR_FORMAT",
    "evaluate",
    "encode_bytes",
    "decode_bytes",
]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    val_data: TokenData,
    *,
    batches: int = 8,
    batch_size: int = 16,
    context_tokens: int | None = None,
) -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` on ``val_data``. Deterministic.

    Uses ``batches * batch_size`` windows of ``context_tokens + 1`` tokens spread evenly over the
    whole validation set (all windows if there are fewer), the same ones on every call, so losses
    from different rounds, learners and runs compare directly. ``context_tokens`` defaults to
    ``model.config.context_tokens`` for atoll's GPT; pass it for your own model.
    """
    if context_tokens is None:
        context_tokens = getattr(getattr(model, "config", None), "context_tokens", None)
        if context_tokens is None:
            raise DataError("evaluate: pass context_tokens= (the model has no config.context_tokens)")
    T = int(context_tokens)
    available = (len(val_data) - 1) // T
    if available < 1:
        raise DataError(
            f"validation data has {len(val_data)} tokens, fewer than context_tokens + 1 = {T + 1}; "
            "lower context_tokens or supply more validation data"
        )
    wanted = min(batches * batch_size, available)
    # Evenly spaced window starts: a fixed, representative sample of the whole set.
    starts = [(k * available // wanted) * T for k in range(wanted)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        total, count = 0.0, 0
        for i in range(0, wanted, batch_size):
            w = torch.from_numpy(val_data.read_windows(starts[i : i + batch_size], T + 1)).to(device)
            n = w.shape[0]
            total += float(loss_fn(model, w[:, :-1], w[:, 1:])) * n
            count += n
    finally:
        model.train(was_training)
    return total / count
