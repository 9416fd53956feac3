"""A small GPT (decoder-only transformer) and the contract any user model must meet.

The model is nanoGPT's, kept in one readable file: token + position embeddings, pre-LayerNorm
blocks of causal self-attention and a GELU MLP, a final LayerNorm and a linear head.

Model contract (what the learner and synchronizer loops rely on, and nothing more)
------------------------------------------------------------------------------------
atoll never assumes its own GPT. Any ``torch.nn.Module`` works if:

1. It is built by a **zero-argument factory** ``factory() -> nn.Module``. Every learner and the
   synchronizer call the factory in their own process, so make it a module-level function (or an
   ``"package.module:function"`` string) that can be pickled, not a lambda. Give
   :func:`model_factory` a ``seed`` when every process must start from identical weights.
2. ``model(idx)`` with ``idx`` an int64 tensor of shape ``[B, T]`` (token ids in ``[0, V)``,
   ``T`` up to the context length you train with) returns logits of shape ``[B, T, V]``:
   position ``t`` predicts token ``t + 1``. For convenience :func:`loss_fn` also accepts a
   tuple/list whose first item is the logits (nanoGPT style) or an object with ``.logits``
   (Hugging Face style).
3. Its trainable state is ``model.named_parameters()`` (floating point). Tied weights are fine:
   ``named_parameters`` lists a shared tensor once. Parameters owned by ``nn.Embedding`` modules
   are treated as embeddings (plain weighted mean instead of RDA, see ``atoll.core``), so use
   ``nn.Embedding`` for embedding tables if you want that split.
4. It behaves the same in ``train()`` and ``eval()`` mode apart from dropout-like layers;
   :func:`evaluate` (in ``atoll.train.data``) switches to ``eval()`` and back.

:func:`check_model` runs a one-batch smoke test of points 2 and 3 with a clear error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atoll.core.config import ConfigError

__all__ = [
    "GPTConfig",
    "GPT",
    "build_model",
    "micro",
    "tiny",
    "mini",
    "small",
    "MODEL_PRESETS",
    "ModelFactory",
    "model_factory",
    "loss_fn",
    "logits_of",
    "check_model",
    "count_parameters",
]


# ----------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT. Frozen and keyword-only so a preset cannot be half-specified by position."""

    vocab_size: int = 256
    """V: number of token ids. 256 = raw bytes (atoll's default tokenization); 50257 = GPT-2 BPE."""

    context_tokens: int = 128
    """T_max: longest sequence the model accepts (size of the position embedding table)."""

    num_layers: int = 4
    """Transformer blocks stacked."""

    num_heads: int = 4
    """Attention heads per block; ``embed_dim`` must be divisible by it."""

    embed_dim: int = 128
    """d: width of the residual stream."""

    mlp_ratio: int = 4
    """Hidden width of each MLP as a multiple of ``embed_dim`` (GPT-2 uses 4)."""

    dropout: float = 0.0
    """Dropout probability on attention weights and residual branches (0 for pre-training)."""

    bias: bool = True
    """Biases in Linear and LayerNorm layers (GPT-2: yes; slightly faster and no worse without)."""

    tie_embeddings: bool = False
    """Share the token embedding with the output head (GPT-2 does; saves V*d parameters).

    Off by default for byte vocabularies, where the table is tiny. When on, ``state_dict()`` has
    two keys for one tensor; serialize ``named_parameters()`` instead (it lists it once)."""

    def __post_init__(self) -> None:
        def need(ok: bool, knob: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"GPTConfig.{knob}: {msg} (got {getattr(self, knob)!r})")

        def pos_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        for knob in ("vocab_size", "context_tokens", "num_layers", "num_heads", "embed_dim", "mlp_ratio"):
            need(pos_int(getattr(self, knob)), knob, "must be an integer >= 1")
        need(
            self.embed_dim % self.num_heads == 0,
            "embed_dim",
            f"must be divisible by num_heads={self.num_heads}",
        )
        need(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def replace(self, **changes: Any) -> GPTConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"GPTConfig: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


# ----------------------------------------------------------------------------------------------
# Presets: plain functions (torchtitan style) so they can be read, diffed and overridden:
# ``tiny(context_tokens=64)``.


def _preset(overrides: dict[str, Any], **defaults: Any) -> GPTConfig:
    # Overrides win over the preset's own values: tiny(context_tokens=64) is a valid config.
    return GPTConfig(**{**defaults, **overrides})


def micro(**overrides: Any) -> GPTConfig:
    """~0.14 M parameters: for unit tests (a training step takes a few ms on one CPU core)."""
    return _preset(overrides, vocab_size=256, context_tokens=64, num_layers=2, num_heads=4, embed_dim=64)


def tiny(**overrides: Any) -> GPTConfig:
    """~0.9 M parameters, byte vocabulary: CPU demos, the quality benchmark, integration tests.

    Sized for 2 CPU cores shared by several learner processes: a training step on a batch of
    16 x 128 tokens takes ~0.2 s on one core. ``tiny(embed_dim=192, num_heads=6)`` is ~1.9 M."""
    return _preset(overrides, vocab_size=256, context_tokens=128, num_layers=4, num_heads=4, embed_dim=128)


def mini(**overrides: Any) -> GPTConfig:
    """~10.9 M parameters, byte vocabulary: nanoGPT's 'shakespeare-char' shape, one small GPU."""
    return _preset(overrides, vocab_size=256, context_tokens=256, num_layers=6, num_heads=6, embed_dim=384)


def small(**overrides: Any) -> GPTConfig:
    """~124 M parameters: GPT-2 small (12 x 768, context 1024, BPE 50257, tied head). GPUs only.

    ``small(vocab_size=256, tie_embeddings=False)`` is the same body on bytes (~86 M)."""
    return _preset(
        overrides,
        vocab_size=50257,
        context_tokens=1024,
        num_layers=12,
        num_heads=12,
        embed_dim=768,
        tie_embeddings=True,
    )


MODEL_PRESETS: dict[str, Callable[..., GPTConfig]] = {
    "micro": micro,
    "tiny": tiny,
    "mini": mini,
    "small": small,
}
"""Preset name -> function returning a :class:`GPTConfig`."""


# ----------------------------------------------------------------------------------------------
# The model


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        # One matmul for q, k and v: fewer kernel launches than three Linear layers.
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim, bias=config.bias)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, heads, T, head_dim]: heads attend independently.
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2) for t in (q, k, v))
        # Fused attention (flash / memory-efficient kernels where available); is_causal masks the
        # future so position t only sees tokens <= t.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.embed_dim
        self.fc = nn.Linear(config.embed_dim, hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.embed_dim, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tanh-approximate GELU, as GPT-2 was trained with.
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.embed_dim, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.embed_dim, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-LN residual blocks: the residual stream is never normalized in place, which keeps
        # gradients well-behaved without warmup tricks at small scale.
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Decoder-only transformer: ``forward(idx [B, T] int64) -> logits [B, T, vocab_size]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # nn.Embedding (not a raw Parameter) on purpose: atoll.core finds embedding tensors by
        # module type and merges them with the plain weighted mean instead of RDA.
        self.tok_emb = nn.Embedding(config.vocab_size, config.embed_dim)
        self.pos_emb = nn.Embedding(config.context_tokens, config.embed_dim)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.embed_dim, bias=config.bias)
        self.lm_head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # The token table doubles as the output projection. named_parameters() then lists
            # it once, as "tok_emb.weight" (registered first), so it counts as an embedding.
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init: each residual branch's output projection gets std / sqrt(2 L),
        # so the residual stream's variance does not grow with depth at initialization.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.num_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.context_tokens:
            raise ValueError(
                f"sequence of {T} tokens exceeds GPTConfig.context_tokens={self.config.context_tokens}; "
                "train with a shorter context or build the model with a larger context_tokens"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(
    config: GPTConfig, *, seed: int | None = None, device: torch.device | str | None = None
) -> GPT:
    """Build a :class:`GPT` from ``config``.

    ``seed`` makes the initial weights a pure function of (config, seed) without touching the
    caller's global RNG, so every process can build the identical starting point.
    ``device="meta"`` builds the shapes only (no memory), handy for counting parameters.
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"build_model(config=...) wants a GPTConfig, got {type(config).__name__}")
    with _seeded(seed), torch.device(device) if device is not None else contextlib.nullcontext():
        return GPT(config)


# ----------------------------------------------------------------------------------------------
# Factories: how the loops get a model without knowing which one it is


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    if seed is None:
        yield
        return
    # fork_rng restores the caller's CPU RNG state afterwards: building a model must not change
    # what the caller's next torch.rand() returns.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _resolve_import(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"model={spec!r}: cannot import module {module_name!r} ({e})") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ValueError(f"model={spec!r}: module {module_name!r} has no attribute {attr!r}") from e
    return obj


@dataclass(frozen=True)
class ModelFactory:
    """A picklable zero-argument model factory: ``ModelFactory(spec, seed)() -> nn.Module``.

    Built by :func:`model_factory`; pickles as long as ``spec`` does (a preset name, a config,
    an import string or a module-level function all do), so it can be sent to learner processes.
    """

    spec: Any
    seed: int | None = None

    def __call__(self) -> nn.Module:
        spec = self.spec
        if isinstance(spec, str):
            spec = MODEL_PRESETS[spec] if spec in MODEL_PRESETS else _resolve_import(spec)
        if isinstance(spec, GPTConfig):
            return build_model(spec, seed=self.seed)
        with _seeded(self.seed):
            made = spec()
        if isinstance(made, GPTConfig):  # a preset-like function returning a config
            return build_model(made, seed=self.seed)
        if not isinstance(made, nn.Module):
            raise TypeError(
                f"model factory {self.spec!r} returned {type(made).__name__}; "
                "it must return a torch.nn.Module (or a GPTConfig)"
            )
        return made


def model_factory(spec: str | GPTConfig | Callable[[], Any], *, seed: int | None = None) -> ModelFactory:
    """Turn what a user says about the model into a zero-argument factory.

    ``spec`` may be: a preset name from :data:`MODEL_PRESETS` (``"tiny"``); a
    :class:`GPTConfig`; an import string ``"package.module:function"``; or any callable taking
    no arguments and returning an ``nn.Module`` (your own model) or a ``GPTConfig``.
    Errors surface here, not later in a learner process.
    """
    if isinstance(spec, str):
        if spec not in MODEL_PRESETS and ":" not in spec:
            raise ValueError(
                f"model={spec!r}: not a preset ({sorted(MODEL_PRESETS)}) and not an import string "
                "'package.module:function'"
            )
        if ":" in spec:
            target = _resolve_import(spec)
            if not callable(target) and not isinstance(target, GPTConfig):
                raise TypeError(f"model={spec!r} resolves to {type(target).__name__}, which is not callable")
    elif not isinstance(spec, GPTConfig) and not callable(spec):
        raise TypeError(
            f"model= wants a preset name, a GPTConfig, 'module:function' or a zero-argument callable "
            f"returning an nn.Module; got {type(spec).__name__}"
        )
    return ModelFactory(spec, seed)


# ----------------------------------------------------------------------------------------------
# Helpers every loop uses


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: a tensor, the first item of a tuple, or ``.logits``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"model output is {type(output).__name__}; the model contract wants logits [B, T, V] "
        "(a tensor, a tuple whose first item is it, or an object with .logits)"
    )


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` on inputs ``x`` [B, T] and targets ``y`` [B, T]."""
    logits = logits_of(model(x))
    if logits.dim() != 3 or logits.shape[:2] != x.shape:
        raise ValueError(
            f"model returned logits of shape {tuple(logits.shape)} for input {tuple(x.shape)}; "
            "the model contract wants [B, T, V]"
        )
    # Flatten to [B*T, V]: cross_entropy averages over every predicted position. Compute in fp32
    # even under autocast; the log-softmax over V is where low precision hurts.
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars; a tied tensor counts once (as in ``named_parameters``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_model(model: nn.Module, *, vocab_size: int, context_tokens: int, batch_size: int = 2) -> None:
    """Smoke-test the model contract on one random batch; raise a clear error if it fails."""
    params = list(model.named_parameters())
    if not params:
        raise ValueError("model has no parameters; there is nothing to train")
    bad = [n for n, p in params if not p.is_floating_point()]
    if bad:
        raise ValueError(f"model parameters must be floating point; not: {bad}")
    device = params[0][1].device
    x = torch.randint(0, vocab_size, (batch_size, context_tokens), device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = logits_of(model(x))
    finally:
        model.train(was_training)
    want = (batch_size, context_tokens, vocab_size)
    if tuple(logits.shape) != want:
        raise ValueError(
            f"model(idx [{batch_size}, {context_tokens}]) returned logits {tuple(logits.shape)}, "
            f"expected {want}; check vocab_size / context_tokens against the model"
        )
