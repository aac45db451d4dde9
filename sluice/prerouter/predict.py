"""Prerouters: guess the next MoE layer's experts early so their reads overlap this layer's compute.

Predictions only drive prefetch; the true router always decides, so output never depends on them.
  - RouterPrerouter (`prefetch="router"`): training-free, the next layer's router on the current residual stream.
  - LearnedPrerouter (`prefetch="learned"`): one small head per layer, fit by `sluice prerouter fit`
    (sluice/tools/prerouter_fit.py) and read from MODEL/prerouter.safetensors:
        heads.{L}.weight [E, H], heads.{L}.bias [E]      (+ heads.{L}.up.weight [D, H], heads.{L}.down.weight [E, D]
                                                           for kind "mlp")
    where L is the layer whose post-attention x the head reads; it predicts the next MoE layer after L. The
    metadata holds the format, the kind, and the model's fingerprint (shapes, config.json hash, routers' hash),
    so heads fit for another model are refused instead of silently prefetching the wrong experts.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint.ref import TensorRef
from ..checkpoint.safetensors import read_header, write_safetensors
from ..errors import CheckpointError
from ..quant.native import _lib as native
from ..quant.native.decode import Guess, router_probs_bf16
from ..quant.tensor import read_tensor
from ..models.layers.norm import Norm
from ..models.routing import selection_scores
from ..models.spec import Spec, Weights


#: rows of a prompt's x a guess ranks at most (evenly spaced): the guess only orders the next layer's read-ahead, and
#: a long prompt's rows pick nearly every expert; 2,048 rows took 3.68 ms a layer on the float32 GEMM, 256 rows 0.78
#: (the peers Q4_K_M, Intel Xeon capped at AVX2, 2 threads: `benchmarks/quantized/prompt_guess.py`,
#: benchmarks/results/quantized/breakdown/prompt-guess.txt)
GUESS_ROWS = 256


class RouterPrerouter:
    """Training-free: apply layer L+1's router (and its post-attention norm) to the residual stream after layer
    L's attention, and take the top `k + margin` experts of the token(s) (of at most GUESS_ROWS of a prompt's)."""

    def __init__(self, spec: Spec, weights: Weights, margin: int = 0, path: int | None = None, bf16: bool = True):
        """path: the native kernels' path (the compute's) for a decode token's guess through decode.c's router
        call; None keeps torch's F.linear. bf16: the model's Compute.bf16_gemm, as the true router takes it (a
        prompt's guess ranks [T, H] @ [H, E] logits: on torch's bf16 GEMM without bf16 dot products, AVX2, it took
        3.1% of the CPU of the peers Q4_K_M's 2,048-token prompt at 1 GiB, `perf record -a`, Intel Xeon capped at
        AVX2; benchmarks/results/quantized/breakdown/prompt-stream-perf.txt)."""
        self.spec, self.w, self.margin, self.bf16 = spec, weights, margin, bf16
        self.next_moe = next_moe_layers(spec)  # layer -> the first MoE layer after it
        self.norms = {M: Norm.of(spec, weights.layers[M].post_norm) for M in set(self.next_moe.values())}
        # A decode token's guess in one native call (the router's softmax: the same ranking as its logits), as the
        # true router's (models/layers/moe.py: ~10 us where F.linear and softmax took ~60)
        self.path = path if path is not None and native.available() and spec.router == "softmax" else None
        # ... and where the next layer's norm is the zero-centred one (Qwen3.5 / 3.6, Qwen3-Next), norm, router and
        # top-k in one call (decode.c sluice_guess_bf16): the same guess, ~25 us less of the model's thread a layer
        # (2.98-3.39 -> 2.38-2.43 ms of a streamed token of the issue-30 UD file: results/hybrid/fused-guess.txt)
        self._guess: dict[int, Guess] = {}
        if self.path is not None:
            k = min(spec.num_experts, spec.top_k + margin)
            for M, norm in self.norms.items():
                lw = weights.layers[M]
                if (norm.zero_centred and norm.group is None and lw.router_bias is None and k <= 64
                        and isinstance(lw.router, torch.Tensor) and lw.router.dtype is torch.bfloat16):
                    self._guess[M] = Guess(norm.weight.contiguous(), norm.eps, lw.router.contiguous(), k, self.path,
                                           norm.path)

    def native(self, layer: int, x: torch.Tensor) -> tuple[int, Guess] | None:
        """(next MoE layer, its native Guess) where predict(layer, x) of this one token is that Guess's call (which
        a streaming store may make later, in C: StreamingExpertStore.guess_later), else None."""
        nxt = self.next_moe.get(layer)
        guess = self._guess.get(nxt) if nxt is not None else None
        if guess is None or not (x.shape[0] == 1 and x.dtype is torch.bfloat16 and x.is_contiguous()):
            return None
        return nxt, guess

    @staticmethod
    def chosen(guess: Guess, got: list[int] | torch.Tensor) -> list[int]:
        """A Guess's result (its ids, or the probabilities torch.topk ranks) as predict returns it: ascending."""
        if isinstance(got, list):
            return sorted(got)
        return sorted(torch.topk(got, guess.k, dim=-1).indices[0].tolist())

    def predict(self, layer: int, x: torch.Tensor) -> tuple[int, list[int]] | None:
        """(next MoE layer, predicted expert ids) from x [T, H] after `layer`'s attention, or None at the end."""
        nxt = self.next_moe.get(layer)
        if nxt is None:
            return None
        lw = self.w.layers[nxt]
        if x.shape[0] > GUESS_ROWS:
            x = x[:: -(-x.shape[0] // GUESS_ROWS)].contiguous()  # [<= GUESS_ROWS, H]
        guess = self._guess.get(nxt)
        if guess is not None and x.shape[0] == 1 and x.dtype is torch.bfloat16 and x.is_contiguous():
            # the k ids, or (a NaN; ties without topk.cc) the probabilities for torch.topk
            return nxt, self.chosen(guess, guess(x))
        h = self.norms[nxt](x)  # [T, H]
        if (self.path is not None and h.shape[0] == 1 and h.dtype is torch.bfloat16 and lw.router_bias is None
                and lw.router.dtype is torch.bfloat16):
            scores = router_probs_bf16(h, lw.router.contiguous(), path=self.path)  # [1, E] float32
        else:  # ranked as the layer's own router ranks (its bias, groups): models/routing.py
            scores = selection_scores(self.spec, lw, h, self.bf16)  # [T, E]
        k = min(self.spec.num_experts, self.spec.top_k + self.margin)
        if scores.shape[0] == 1:  # one token: its k ids ascending, what the ranking by counts below gives it
            return nxt, sorted(torch.topk(scores, k, dim=-1).indices[0].tolist())
        ids, counts = torch.topk(scores, k, dim=-1).indices.flatten().unique(return_counts=True)
        # the experts most tokens pick first: a prompt's read-ahead fills the free slots in this order
        return nxt, ids[torch.argsort(counts, descending=True, stable=True)].tolist()


# -- learned heads -------------------------------------------------------------------------------------------------
PREROUTER_FILE = "prerouter.safetensors"  # beside the model's config.json; `--prefetch learned` reads it
FORMAT = "sluice-prerouter/1"
HEAD_KINDS = ("linear", "mlp")


def next_moe_layers(spec: Spec) -> dict[int, int]:
    """Source layer L -> the first MoE layer after it, for every L that has one (dense layers are skipped)."""
    moe = [i for i, s in enumerate(spec.moe_layers) if s]
    out = {L: next((m for m in moe if m > L), None) for L in range(spec.n_layers)}
    return {L: m for L, m in out.items() if m is not None}


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] in float32 scaled to unit RMS: the heads' input (the norm's weight is folded into each head)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


@dataclass
class Head:
    """One learned head: scores [T, E] = linear(xn) (+ a SiLU MLP for kind "mlp"), xn = unit_rms(x). float32.

    weight [E, H], bias [E]; mlp adds up [D, H] and down [E, D]. The fit starts the linear part at the next layer's
    router with its norm weight folded in, and the MLP's `down` at zero, so an untrained head predicts exactly what
    the training-free RouterPrerouter does.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None

    def __call__(self, xn: torch.Tensor) -> torch.Tensor:
        scores = F.linear(xn, self.weight, self.bias)  # [T, E]
        if self.up is not None:
            scores = scores + F.linear(F.silu(F.linear(xn, self.up)), self.down)  # [T, D] -> [T, E]
        return scores

    @property
    def kind(self) -> str:
        return "linear" if self.up is None else "mlp"

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.weight": self.weight, f"{prefix}.bias": self.bias}
        if self.up is not None:
            out.update({f"{prefix}.up.weight": self.up, f"{prefix}.down.weight": self.down})
        return {k: v.detach().float().contiguous() for k, v in out.items()}


def model_fingerprint(spec: Spec, config: dict, refs: dict[str, TensorRef]) -> dict[str, str]:
    """What a heads file must match: shapes, a hash of config.json, and a hash of every router's checkpoint bytes
    (so the heads of a re-made model with the same config but other weights are rejected too). `refs`: the
    resident roles of `weights.resident_refs` (`layers.{L}.router` -> TensorRef); the routers are re-read raw, in
    the checkpoint's dtype, so the hash does not depend on --dtype (measured: ~25 MB for a 48-layer, 128-expert,
    hidden-2048 bf16 model)."""
    routers = hashlib.sha256()
    for L, moe in enumerate(spec.moe_layers):
        if moe:
            routers.update(read_tensor(refs[f"layers.{L}.router"]).view(-1).view(torch.uint8).numpy().tobytes())
    cfg = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return {
        "num_layers": str(spec.n_layers),
        "hidden_size": str(spec.hidden_size),
        "num_experts": str(spec.num_experts),
        "top_k": str(spec.top_k),
        "config_sha256": hashlib.sha256(cfg).hexdigest(),
        "routers_sha256": routers.hexdigest(),
    }


def save_heads(path: str | os.PathLike, heads: dict[int, Head], fingerprint: dict[str, str],
               extra: dict[str, str] | None = None) -> Path:
    """Write `heads` (source layer -> Head) as safetensors: `heads.{L}.weight` etc., with the format, the head kind,
    the source -> target layer map and the model's fingerprint in the metadata."""
    kinds = {h.kind for h in heads.values()}
    if len(kinds) != 1:
        raise ValueError(f"all heads must be of one kind, got {sorted(kinds)}")
    tensors: dict[str, torch.Tensor] = {}
    for L in sorted(heads):
        tensors.update(heads[L].tensors(f"heads.{L}"))
    meta = {**(extra or {}), **fingerprint, "format": FORMAT, "kind": kinds.pop(),
            "layers": ",".join(str(L) for L in sorted(heads))}
    return write_safetensors(path, tensors, meta)


def _fit_hint(path: Path) -> str:
    return f"run `sluice prerouter fit {path.parent}` to fit heads for this model"


def load_heads(path: str | os.PathLike, spec: Spec, fingerprint: dict[str, str]) -> tuple[dict[int, Head], dict]:
    """Read and validate a heads file for the model described by `spec` and `fingerprint`.

    Returns (source layer -> Head, metadata). CheckpointError naming the file when it is missing, is not a
    prerouter file, or was fit for another model (config, shapes or router weights differ): the message says what
    differs and how to refit.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"not found; --prefetch learned needs heads fit for this model: {_fit_hint(path)}",
                              file=str(path))
    refs, meta = read_header(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"not a sluice prerouter file (format {meta.get('format')!r}, expected {FORMAT!r}); "
                              f"{_fit_hint(path)}", file=str(path))
    stale = [f"{k} {meta.get(k)!r} != {v!r}" for k, v in fingerprint.items() if meta.get(k) != v]
    if stale:
        what = "; ".join(s if "sha256" not in s else s.split(" ")[0] + " differs" for s in stale)
        raise CheckpointError(f"stale: fit for a different model ({what}); {_fit_hint(path)}", file=str(path))
    kind = meta.get("kind")
    if kind not in HEAD_KINDS:
        raise CheckpointError(f"unknown head kind {kind!r} (known: {', '.join(HEAD_KINDS)}); {_fit_hint(path)}",
                              file=str(path))
    E, H = spec.num_experts, spec.hidden_size

    def tensor(name: str, shape: tuple[int, ...] | None) -> torch.Tensor:
        if name not in refs:
            raise CheckpointError(f"missing; {_fit_hint(path)}", file=str(path), tensor=name)
        ref = refs[name]
        if shape is not None and tuple(ref.shape) != shape:
            raise CheckpointError(f"shape {list(ref.shape)} != expected {list(shape)}; {_fit_hint(path)}",
                                  file=str(path), tensor=name)
        return read_tensor(ref).float()

    heads: dict[int, Head] = {}
    for L in next_moe_layers(spec):
        p = f"heads.{L}"
        head = Head(tensor(f"{p}.weight", (E, H)), tensor(f"{p}.bias", (E,)))
        if kind == "mlp":
            head.up = tensor(f"{p}.up.weight", None)
            head.down = tensor(f"{p}.down.weight", (E, head.up.shape[0]))
            if tuple(head.up.shape[1:]) != (H,):
                raise CheckpointError(f"shape {list(head.up.shape)} != [D, {H}]", file=str(path),
                                      tensor=f"{p}.up.weight")
        heads[L] = head
    return heads, meta


class LearnedPrerouter:
    """Trained heads (`sluice prerouter fit`): after layer L's attention, head L scores the experts of the next MoE
    layer from the residual stream x; the top `k + margin` per token are prefetched. Same interface as
    RouterPrerouter; predictions never change the output."""

    def __init__(self, spec: Spec, heads: dict[int, Head], margin: int = 0):
        self.spec, self.heads, self.margin = spec, heads, margin
        self.next_moe = next_moe_layers(spec)

    @classmethod
    def load(cls, path: str | os.PathLike, spec: Spec, fingerprint: dict[str, str], margin: int = 0):
        """From a heads file (see `load_heads` for the checks)."""
        heads, _ = load_heads(path, spec, fingerprint)
        return cls(spec, heads, margin)

    def predict(self, layer: int, x: torch.Tensor) -> tuple[int, list[int]] | None:
        """(next MoE layer, predicted expert ids) from x [T, H] after `layer`'s attention, or None at the end."""
        head = self.heads.get(layer)
        if head is None:
            return None
        scores = head(unit_rms(x, self.spec.rms_norm_eps))  # [T, E]
        k = min(self.spec.num_experts, self.spec.top_k + self.margin)
        ids = torch.topk(scores, k, dim=-1).indices.flatten().unique()
        return self.next_moe[layer], ids.tolist()
