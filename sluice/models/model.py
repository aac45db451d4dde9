"""The decoder-only MoE model: token embeddings, the layers its architecture composes (models/<model_type>.py
`layers(b)` from the modules of models/layers/), the final norm and the head. Under hyper-connections (Spec.hc_count
> 1) the embedding enters as that many copies, one per residual stream, and the streams' final mix replaces the final
norm (models/layers/hyper.py).

Weights are plain tensors held in dataclasses (llama2.c style, spec.py), or a GGUF file's projections kept in their
stored blocks (quant/linear.py QuantLinear); expert weights are not held at all: the MoE blocks ask the
`ExpertStore` for them by (layer, ids).
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

import torch

from .layers.build import Build, Kernels, Step
from .layers.hyper import Streams
from .linear import logits


class Transformer:
    """`forward(tokens, pos)` runs T new tokens at positions pos..pos+T-1 through the layers, writing the caches in
    place, and returns the final-norm hidden states [T, H]; `logits(hidden)` applies the LM head."""

    def __init__(self, arch: ModuleType, b: Build):
        """The layers of `arch` (an architecture module: models/__init__.py) built from `b`."""
        self.arch, self.build = arch, b
        self.spec, self.w, self.store, self.cache, self.rows = b.spec, b.w, b.store, b.cache, b.rows
        self.dtype, self.compute, self.kernels = b.dtype, b.compute, b.kernels
        self.prerouter, self.prompt_prerouter = b.prerouter, b.prompt_prerouter
        self.streams = Streams(b) if b.spec.hc_count > 1 else None
        self.final_norm = b.norm(b.w.norm) if b.spec.final_norm else None
        self.layers = list(arch.layers(b))
        if len(self.layers) != self.spec.n_layers:
            raise ValueError(f"{arch.__name__}.layers built {len(self.layers)} layers for {self.spec.n_layers}")

    def rebuilt(self, kernels: Kernels) -> "Transformer":
        """The same model (weights, store, caches) built with other Kernels: tests and benchmarks compare the
        implementations a model chooses between."""
        b = self.build
        return Transformer(self.arch, Build(b.spec, b.w, b.store, b.cache, b.compute, kernels, b.rows, b.prerouter,
                                            b.prompt_prerouter, b.tables))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            return self.rows.gather(tokens)  # [T, H], already in the compute dtype
        return self.w.embed[tokens]  # [T, H]

    def forward(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """tokens [T] at positions pos.. -> final-norm hidden states [T, H]; writes the caches."""
        return self.forward_layers(tokens, pos, max(1, tokens.shape[0]))[0]

    def forward_layers(self, tokens: torch.Tensor, pos: int, chunk: int,
                       between: Callable[[], object] | None = None) -> list[torch.Tensor]:
        """tokens [T] at positions pos.. in passes of `chunk` tokens, layer by layer: every pass goes through a layer
        before any goes on to the next, so a streamed layer reads its experts once for the T tokens (the slots keep
        them between its passes) instead of once a pass. Each pass runs the operations a forward() of its own would
        run on it, in the same order for each layer's caches (KV positions, recurrent and conv states): the same
        bits as forward() pass after pass. The T hidden states stay between layers (H x streams values a token: the
        plan counts them, plan.py _prefill_chunk). `between` is called before each layer. Returns each pass's
        final-norm hidden states [t, H]."""
        T = tokens.shape[0]
        if pos + T > self.cache.max_context:
            raise ValueError(f"context overflow: {pos + T} tokens > max_context {self.cache.max_context}")
        steps = []
        for s in range(0, max(T, 1), chunk):  # one pass of no tokens for an empty call, as a plain forward had
            t = min(chunk, T - s)
            steps.append(Step(pos + s, t, self._after_mixer if self._reads_ahead(t) else None, tokens[s : s + t]))
        try:
            xs = [self.embed(st.tokens) for st in steps]
            if self.streams is not None:
                xs = [self.streams.enter(x) for x in xs]  # [t, n*H] each
            for layer in self.layers:
                if between is not None:
                    between()
                for i, st in enumerate(steps):
                    xs[i] = layer(xs[i], st)
                    if len(steps) > 1:
                        st.drop_masks()  # rebuilt at the next layer, not held for every pass at once
            if self.streams is not None:
                xs = [self.streams.leave(x) for x in xs]  # [t, H]
            return xs if self.final_norm is None else [self.final_norm(x) for x in xs]
        finally:
            self.build.workspace.release()  # a prompt's [T*K, H] rows are not held between passes

    def _reads_ahead(self, T: int) -> bool:
        s = self.spec
        return ((self.prerouter is not None and T == 1)
                or (self.prompt_prerouter is not None and T * s.top_k >= s.num_experts))

    def _after_mixer(self, L: int, x: torch.Tensor, step: Step) -> None:
        """Between layer L's mixer and its feed-forward block: read the next MoE layer's likely experts. A decode
        token's prerouter guess is read while this layer's experts run (a dense layer pins none first); a prompt
        chunk that picks at least as many experts as a layer has (shorter ones would waste some reads) leaves its
        guess in the step, read once this layer's experts are pinned (layers/moe.py)."""
        s = self.spec
        if self.prerouter is not None and step.T == 1 and self.store.guessing():
            # a MoE layer's streaming store may compute the native guess itself, while the layer's experts run
            later = getattr(self.store, "guess_later", None) if s.moe_layers[L] else None
            native = getattr(self.prerouter, "native", None) if later is not None else None
            if native is not None and (native := native(L, x)) is not None:
                later(*native, x, self.prerouter.chosen)
            elif (guess := self.prerouter.predict(L, x)) is not None:
                (self.store.prefetch_next if s.moe_layers[L] else self.store.prefetch)(*guess)
        elif self.prompt_prerouter is not None and step.T * s.top_k >= s.num_experts and s.moe_layers[L]:
            step.prompt_guess = self.prompt_prerouter.predict(L, x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> float32 logits [T, V]."""
        return logits(hidden, self.w.lm_head)
