"""Fit the learned prerouter (`sluice prerouter fit`): record, train one head per layer, report recall, save.

Recording changes no model code path: a `Recorder` takes the Transformer's prerouter slot. The Transformer calls
`prerouter.predict(L, x)` right after layer L's attention for every one-token step, with the residual stream x that
layer L's MoE block normalizes and routes next. So the recorder sees both halves of a training pair:
  - the feature of source layer L: x after L's attention;
  - the truth of MoE layer M: top-k of M's router on rms_norm(x after M's attention), recomputed with the same
    ops as the MoE block (models/layers/moe.py), so the ids are the router's own choice, bit for bit (a test checks
    them against the store's routing counts).
It returns None, so nothing is prefetched and the forward pass is the plain one. Tokens are fed one at a time
(the slot is consulted only when T == 1), teacher-forced over a corpus.

The heads are fit with a multi-label loss on top-k membership and start at the training-free router (see `Head`),
so training moves away from the router only where the data says so. The last `holdout` share of the recorded
tokens (the tail of the corpus) is never trained on and gives the recall of `learned` vs `router`.

Measured (held-out recall@k, router -> learned, 4096 tokens unless said): tiny qwen3_moe (hidden 64, 8 experts
top-2): linear 81.3% -> 84.3%, mlp -> 85.9%; with 16384 tokens 76.7% -> 82.8% (linear), 84.2% (mlp). Random-weight
synthetic models (make-model, 64 experts top-8) route almost by token embedding, the router already gets 96-98%
and the heads stay at it (epoch 0). Linear is the default: smaller file, 2-3x faster to fit, and on 3.7k tokens of
a hidden-256 model an unselected MLP overfit to 77% where the router had 96%.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..engine import Model, load
from ..errors import ConfigError
from ..units import format_bytes
from ..models.layers.norm import Norm
from ..models.routing import route, selection_scores
from ..models.spec import Spec, Weights
from ..prerouter.predict import (HEAD_KINDS, PREROUTER_FILE, Head, model_fingerprint, next_moe_layers, save_heads,
                      unit_rms)
from ..host.memory import available_memory
from ..models.weights import resident_refs


@dataclass
class FitOptions:
    """How the heads are fit.

    tokens:   tokens recorded (teacher-forced one at a time) over the corpus; the last `holdout` share is held out.
              The recording holds tokens x layers x hidden values in the compute dtype (4096 tokens of a 48-layer,
              hidden-2048 bf16 model: 0.8 GB).
    seq_len:  tokens per sequence (each starts from an empty KV cache), capped by the model's context.
    kind:     "linear" (one [E, H] matrix + bias per layer on unit-RMS x) or "mlp" (linear + a SiLU MLP of `hidden`).
    epochs:   passes over the training tokens; batch: tokens per Adam step; lr: Adam's learning rate.
    hidden:   the MLP's width (kind "mlp").
    margin:   the report's recall@(k + margin); default top_k // 2 (at least 1). The runtime margin is the load
              option `prefetch_margin`, not this.
    holdout:  share of recorded tokens held out for the report; the same share of the rest picks each head's epoch.
    seed:     random ids (models without a tokenizer), batch order and MLP init.
    """

    tokens: int = 4096
    seq_len: int = 256
    kind: str = "linear"
    epochs: int = 20
    batch: int = 128
    lr: float = 1e-3
    hidden: int = 256
    margin: int | None = None
    holdout: float = 0.1
    seed: int = 0

    def __post_init__(self):
        if self.kind not in HEAD_KINDS:
            raise ConfigError(f"kind: {self.kind!r} is not one of {', '.join(HEAD_KINDS)}")
        for name in ("tokens", "seq_len", "epochs", "batch", "hidden"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.margin is not None and self.margin < 0:
            raise ConfigError(f"margin: must be >= 0, got {self.margin}")
        if not 0 < self.holdout < 1:
            raise ConfigError(f"holdout: must be in (0, 1), got {self.holdout}")


# -- corpus --------------------------------------------------------------------------------------------------------
def corpus_ids(model: Model, prompts: str | os.PathLike | None, tokens: int, seed: int = 0) -> list[int]:
    """Up to `tokens` ids: the prompts file (documents separated by blank lines) or the built-in corpus (stdlib
    docstrings, `tokenizer_train.default_corpus`) through the model's tokenizer; random ids without a tokenizer."""
    V = model.spec.vocab_size
    if model.tokenizer is None:
        if prompts is not None:
            raise ConfigError(f"{model.path} has no tokenizer.json, so --prompts cannot be tokenized; "
                              "leave it out to record random token ids")
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, V, (tokens,), generator=g).tolist()
    if prompts is not None:
        try:
            text = Path(prompts).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--prompts {prompts}: cannot read: {e.strerror or e}") from e
        texts = [t.strip() for t in text.split("\n\n") if t.strip()]
    else:
        from ..tools.tokenizer_train import default_corpus

        texts = default_corpus(max_chars=max(300_000, 8 * tokens))
    ids: list[int] = []
    for t in texts:
        ids += [i for i in model.tokenizer.encode(t, add_special_tokens=False) if i < V]
        if len(ids) >= tokens:
            break
    if not ids:
        raise ConfigError(f"--prompts {prompts}: no text to record")
    return ids[:tokens]


# -- recording -----------------------------------------------------------------------------------------------------
class Recorder:
    """A prerouter-slot stand-in that records (x after layer L's attention, true top-k of the next MoE layer) and
    predicts nothing. Buffers are allocated up front; `at` is the row the next one-token step writes."""

    def __init__(self, spec: Spec, weights: Weights, n: int, dtype: torch.dtype):
        self.spec, self.w = spec, weights
        self.targets = next_moe_layers(spec)  # source L -> target MoE layer M
        self.x = {L: torch.empty((n, spec.hidden_size), dtype=dtype) for L in self.targets}  # [N, H] each
        self.ids = {M: torch.empty((n, spec.top_k), dtype=torch.long) for M in set(self.targets.values())}  # [N, k]
        self.at = 0

    def predict(self, layer: int, x: torch.Tensor) -> None:
        if layer in self.x:
            self.x[layer][self.at] = x[0]
        if layer in self.ids:  # the true router of this layer, as the MoE block computes it
            lw = self.w.layers[layer]
            self.ids[layer][self.at] = route(self.spec, lw, Norm.of(self.spec, lw.post_norm)(x))[1][0]
        return None


def _check_recording_fits(model: Model, tokens: int) -> None:
    """A ConfigError, before anything is allocated, when the recording of `tokens` cannot fit in the memory left
    (--tokens 10^9 asked for terabytes)."""
    s = model.spec
    targets = next_moe_layers(s)
    itemsize = torch.tensor([], dtype=model.dtype).element_size()
    per_token = len(targets) * s.hidden_size * itemsize + len(set(targets.values())) * s.top_k * 8 + 40  # + the id
    room = available_memory()
    if tokens * per_token > room.bytes:
        raise ConfigError(f"--tokens {tokens}: recording them needs {format_bytes(tokens * per_token)}, more than the "
                          f"{format_bytes(room.bytes)} of memory available ({room.source}): record fewer tokens")


def record(model: Model, ids: list[int], seq_len: int, progress: bool = True) -> Recorder:
    """Teacher-force `ids` one token at a time in sequences of `seq_len` (each from position 0) with a Recorder in
    the prerouter slot; the model's own prerouter is put back afterwards."""
    seq_len = min(seq_len, model.cache.max_context)
    rec = Recorder(model.spec, model.model.w, len(ids), model.dtype)
    saved, model.model.prerouter = model.model.prerouter, rec
    model.forget_cache()  # the cache is overwritten below: no prefix of it may be reused later
    try:
        with torch.inference_mode(), tqdm(total=len(ids), desc="recording", unit="tok", disable=not progress) as bar:
            for i, token in enumerate(ids):
                rec.at = i
                model.model.forward(torch.tensor([token], dtype=torch.long), i % seq_len)
                bar.update(1)
    finally:
        model.model.prerouter = saved
    return rec


# -- training ------------------------------------------------------------------------------------------------------
def recall_at(scores: torch.Tensor, true_ids: torch.Tensor, m: int) -> float:
    """Mean over tokens of |top-m(scores) & true| / k; scores [N, E], true_ids [N, k]."""
    top = torch.topk(scores.float(), min(m, scores.shape[1]), dim=-1).indices  # [N, m]
    hit = (top[:, :, None] == true_ids[:, None, :]).any(dim=1)  # [N, k]
    return hit.float().mean().item()


def train_head(xn: torch.Tensor, true_ids: torch.Tensor, start: torch.Tensor, opts: FitOptions,
               val: tuple[torch.Tensor, torch.Tensor]) -> tuple[Head, int]:
    """Fit one head on xn [N, H] (unit RMS, float32) -> true top-k ids [N, k], starting at `start` [E, H] (the
    router); return it at the epoch with the best recall@k on `val` (xn, ids), and that epoch (0: the start).

    Loss: binary cross-entropy on top-k membership, one label per expert (the prefetch question is "will this
    expert be needed", not "which is first"). The weight is trained as temperature * V with V = start / rms(start),
    so Adam's steps are relative to the router's scale: trained directly (steps of lr on entries of ~0.02) the
    router's ranking was lost in the first epoch (held-out recall@8 99% -> 75% on a synthetic 64-expert model).
    Picking the epoch on `val` (epoch 0 included) keeps a head from ending worse than the router it starts from:
    on random-weight models the router is already near the ceiling and training only overfits.
    """
    N, H = xn.shape
    E, k = start.shape[0], true_ids.shape[1]
    g = torch.Generator().manual_seed(opts.seed)
    target = torch.zeros((N, E)).scatter_(1, true_ids, 1.0)  # [N, E]
    scale = start.pow(2).mean().sqrt().clamp_min(1e-12)
    v = (start / scale).requires_grad_()  # [E, H], unit RMS
    log_t = scale.log().requires_grad_()  # temperature: weight = exp(log_t) * v
    bias = torch.zeros(E, requires_grad=True)
    up = down = None
    if opts.kind == "mlp":
        up = (torch.randn((opts.hidden, H), generator=g) / math.sqrt(H)).requires_grad_()  # [D, H]
        down = torch.zeros((E, opts.hidden), requires_grad=True)  # [E, D]: starts as the linear head
    params = [p for p in (v, log_t, bias, up, down) if p is not None]

    def head() -> Head:
        return Head(log_t.exp() * v, bias, up, down)

    opt = torch.optim.Adam(params, lr=opts.lr)
    best: tuple[float, int, Head] | None = None
    for epoch in range(opts.epochs + 1):
        with torch.no_grad():
            h = head()
            r = recall_at(h(val[0]), val[1], k)
            if best is None or r > best[0]:
                best = (r, epoch, Head(*(t.detach().clone() if t is not None else None
                                         for t in (h.weight, h.bias, h.up, h.down))))
        if epoch == opts.epochs:
            break
        for b in torch.randperm(N, generator=g).split(opts.batch):
            loss = F.binary_cross_entropy_with_logits(head()(xn[b]), target[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    assert best is not None
    return best[2], best[1]


@dataclass
class LayerReport:
    """Held-out recall of one head against the router prerouter (mean over tokens of |predicted & true| / k)."""

    source: int  # layer whose post-attention x is the input
    target: int  # MoE layer whose experts are predicted
    router: tuple[float, float]  # recall@k, recall@(k+margin) of the training-free router prerouter
    learned: tuple[float, float]
    epoch: int = 0  # the epoch kept (0: the head stayed at the router)


@dataclass
class FitReport:
    """What `fit` did: where the heads went, token counts, per-layer held-out recall and timings."""

    path: Path
    kind: str
    top_k: int
    margin: int
    train_tokens: int
    heldout_tokens: int
    layers: list[LayerReport] = field(default_factory=list)
    record_s: float = 0.0
    fit_s: float = 0.0

    def mean(self, which: str, i: int) -> float:
        return sum(getattr(r, which)[i] for r in self.layers) / max(1, len(self.layers))

    def table(self) -> str:
        """Held-out recall per layer, learned vs router, at k and k + margin; `epoch` 0 = kept at the router."""
        k, km = self.top_k, self.top_k + self.margin
        cols = ("layer", "->", f"router@{k}", f"learned@{k}", f"router@{km}", f"learned@{km}", "epoch")
        lines = ["{:>5} {:>3} {:>10} {:>11} {:>10} {:>11} {:>5}".format(*cols)]
        for r in self.layers:
            lines.append(f"{r.source:>5} {r.target:>3} {r.router[0]:>10.1%} {r.learned[0]:>11.1%} "
                         f"{r.router[1]:>10.1%} {r.learned[1]:>11.1%} {r.epoch:>5}")
        lines.append(f"{'mean':>9} {self.mean('router', 0):>10.1%} {self.mean('learned', 0):>11.1%} "
                     f"{self.mean('router', 1):>10.1%} {self.mean('learned', 1):>11.1%}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            "path": str(self.path), "kind": self.kind, "top_k": self.top_k, "margin": self.margin,
            "train_tokens": self.train_tokens, "heldout_tokens": self.heldout_tokens,
            "record_s": round(self.record_s, 2), "fit_s": round(self.fit_s, 2),
            "mean": {"router": [self.mean("router", 0), self.mean("router", 1)],
                     "learned": [self.mean("learned", 0), self.mean("learned", 1)]},
            "layers": [{"source": r.source, "target": r.target, "router": list(r.router), "learned": list(r.learned),
                        "epoch": r.epoch} for r in self.layers],
        }


def _heldout(n: int, opts: FitOptions) -> int:
    return max(1, math.ceil(opts.holdout * n))


def _margin(spec: Spec, opts: FitOptions) -> int:
    margin = opts.margin if opts.margin is not None else max(1, spec.top_k // 2)
    return min(margin, spec.num_experts - spec.top_k)


def fit_heads(model: Model, rec: Recorder, opts: FitOptions, progress: bool = True) -> tuple[dict[int, Head], list]:
    """One head per source layer from a recording; returns the heads and the held-out LayerReports.

    Tokens split in order: [0, n_fit) trains, [n_fit, n_train) picks the epoch, [n_train, N) is held out.
    """
    s, w = model.spec, model.model.w
    N = next(iter(rec.x.values())).shape[0]
    n_train = N - _heldout(N, opts)
    n_fit = n_train - _heldout(n_train, opts)
    if n_fit < 1:
        raise ConfigError(f"{N} recorded tokens leave none to train on; record more (--tokens)")
    k = s.top_k
    km = k + _margin(s, opts)
    heads: dict[int, Head] = {}
    reports: list[LayerReport] = []
    for L, M in tqdm(rec.targets.items(), desc=f"fitting {opts.kind} heads", unit="layer", disable=not progress):
        x, y = rec.x[L], rec.ids[M]  # [N, H] in the compute dtype, [N, k]
        lw = w.layers[M]
        norm = Norm.of(s, lw.post_norm)
        start = lw.router.float() * norm.weight.float()[None, :]  # [E, H]: the router with its norm's scale folded in
        xn = unit_rms(x, s.rms_norm_eps)  # [N, H] float32
        head, epoch = train_head(xn[:n_fit], y[:n_fit], start, opts, (xn[n_fit:n_train], y[n_fit:n_train]))
        heads[L] = head
        with torch.no_grad():
            x_ho, y_ho = x[n_train:], y[n_train:]
            router = selection_scores(s, lw, norm(x_ho))  # as RouterPrerouter
            learned = head(xn[n_train:])
            reports.append(LayerReport(L, M, (recall_at(router, y_ho, k), recall_at(router, y_ho, km)),
                                       (recall_at(learned, y_ho, k), recall_at(learned, y_ho, km)), epoch))
    return heads, reports


def fit(
    path: str | os.PathLike,
    opts: FitOptions | None = None,
    *,
    prompts: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    progress: bool = True,
    **load_options,
) -> FitReport:
    """Record over a corpus, fit heads, report held-out recall and write `out` (default MODEL/prerouter.safetensors).

    `load_options` go to `sluice.load` (memory=... streams a model bigger than RAM while recording).
    """
    opts = opts or FitOptions()
    out = Path(out) if out is not None else Path(path) / PREROUTER_FILE
    load_options.setdefault("max_context", opts.seq_len)
    with load(path, progress=progress, **load_options) as model:
        s = model.spec
        if not next_moe_layers(s):
            raise ConfigError(f"{path}: no MoE layer follows another layer; there is nothing to predict")
        if s.hc_count > 1:  # the heads read a plain residual (engine.py's TODO)
            raise ConfigError(f"{path}: its {s.hc_count} residual streams (hyper-connections) are not predicted "
                              "from yet; there is no prerouter to fit for it")
        _check_recording_fits(model, opts.tokens)
        ids = corpus_ids(model, prompts, opts.tokens, opts.seed)
        t0 = time.perf_counter()
        rec = record(model, ids, opts.seq_len, progress)
        t1 = time.perf_counter()
        heads, layers = fit_heads(model, rec, opts, progress)
        t2 = time.perf_counter()
        fingerprint = model_fingerprint(s, model.index.config, resident_refs(model.index, s, model.arch))
    N, margin = len(ids), _margin(s, opts)
    n_held = _heldout(N, opts)
    report = FitReport(out, opts.kind, s.top_k, margin, N - n_held, n_held, layers, t1 - t0, t2 - t1)
    extra = {"epochs": str(opts.epochs), "report": json.dumps(report.as_dict())}  # for `sluice prerouter show`-ers
    save_heads(out, heads, fingerprint, extra)
    return report
