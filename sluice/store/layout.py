"""Where each expert's bytes are: (layer, expert) -> byte ranges that land in one slot buffer, and how they are stored.

The unit of streaming is one expert of one layer. Three checkpoint layouts are read:
- per expert (hub, `save_pretrained` default): `{p}.experts.{e}.gate_proj.weight [I, H]`, `up_proj [I, H]`,
  `down_proj [H, I]` (Mixtral: w1 / w3 / w2) -> three ranges; six for FP8 experts (DeepSeek-V3, Kimi K2, Qwen3 FP8:
  each projection's e4m3 codes and its `weight_scale_inv`, checkpoint/fp8_index.py);
- fused (`save_pretrained(save_original_format=False)`, GGUF `ffn_gate_up_exps`): `{p}.experts.gate_up_proj
  [E, 2I, H]` and `{p}.experts.down_proj [E, H, I]` -> expert e is one contiguous slice of each, two ranges;
- stacked (GGUF `ffn_{gate,up,down}_exps`, see checkpoint/gguf_index.py; MLX `switch_mlp`, mlx_index.py):
  `{p}.experts.gate_proj [E, I, H]`, `up_proj [E, I, H]`, `down_proj [E, H, I]` -> one contiguous slice of each,
  three ranges; nine for MLX affine experts (the slices of each projection's packed weight, scales and biases).

A slot is one uint8 buffer holding the expert's bytes as stored (`ExpertFormat`): gate, then up, then down, each a
`QuantSpec` (quant/spec.py) -- plain BF16/F16/F32 rows, GGUF blocks (Q4_K, Q6_K, ...), whole blocks per row,
MLX affine weight / scales / biases, or FP8 codes / block scales, each in its QuantSpec part (typed views need
aligned parts: quantized projections and slots start at 64-byte offsets).
gpt-oss (`BiasedGluFormat`, read by models/gpt_oss.py expert_layer): `{p}.experts.gate_up_proj_blocks/_scales`
[E, 2I, H/32, 16] / [E, 2I, H/32] and `down_proj_blocks/_scales` in MXFP4 as shipped, or the dequantized
`gate_up_proj [E, H, 2I]` / `down_proj [E, I, H]` (`save_pretrained`), plus `gate_up_proj_bias [E, 2I]` and
`down_proj_bias [E, H]`: expert e is one contiguous slice of each tensor, four ranges (six in MXFP4) into one slot;
a GGUF's stacked gate / up / down [E, I, H] / [E, H, I] and their three biases: six ranges.
Nothing converts them between the read and the math: the kernels compute from the stored bytes. Formats may differ
between layers (a Q4_K_M file stores some layers' down projections as Q6_K); slots are sized for the largest.
When every layer's experts are one plain dtype (`plain_dtype`), gate and up are back to back, so the store can
view a slot as gate_up [2I, H] and down [H, I] of that dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from ..checkpoint.index import CheckpointIndex
from ..checkpoint.ref import TensorRef
from ..errors import CheckpointError
from ..io.ranges import ReadRange
from ..quant import QuantSpec, UnsupportedFormat
from ..quant.spec import Part

class ExpertShapes(Protocol):
    """What the layout reads of a model's Spec (models/spec.py, above this layer): the shapes every expert must have."""

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    moe_layers: list[bool]


#: the plain stored dtypes, by their names
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
ALIGN = 64  # quantized projections start at 64-byte offsets inside a slot (SIMD loads of whole blocks)


@dataclass(frozen=True)
class ExpertPart:
    """One contiguous byte range of one expert: lands at byte `dest_offset` of the expert's slot."""

    proj: str  # "gate" | "up" | "down" | "gate_up" (fused: gate and up rows in one range) | gpt-oss: the tensor's
    # last name ("gate_up_proj_blocks", "down_proj_bias", ...)
    dest_offset: int
    range: ReadRange


@dataclass(frozen=True)
class ExpertFormat:
    """How one expert of one layer is stored in its slot: the three projections and where each starts."""

    gate: QuantSpec  # [I, H]
    up: QuantSpec  # [I, H]
    down: QuantSpec  # [H, I]
    up_offset: int
    down_offset: int
    nbytes: int  # one expert's slot bytes (the stored bytes, plus alignment padding between quantized projections)

    @staticmethod
    def of(gate: QuantSpec, up: QuantSpec, down: QuantSpec) -> "ExpertFormat":
        # gate and up of one ggml format stay back to back: [gate; up] is one [2I, H] matrix of whole rows, one
        # matmul (or one kernel call) for both; plain experts of one dtype keep down right after them too. An MLX
        # projection is three parts (weight, scales, biases): gate's and up's do not concatenate into one matrix
        ggml = all(s.family == "ggml" for s in (gate, up, down))
        up_offset = gate.nbytes if up.name == gate.name and gate.family == "ggml" else _aligned(gate.nbytes)
        end = up_offset + up.nbytes
        down_offset = end if gate.plain and down.name == gate.name == up.name else _aligned(end)
        end = down_offset + down.nbytes  # MLX: slots of whole 64 bytes, so every slot's int32 / float parts align
        return ExpertFormat(gate, up, down, up_offset, down_offset, end if ggml else _aligned(end))

    @property
    def gate_up(self) -> QuantSpec | None:
        """[gate; up] as one [2I, H] weight when both are stored in one format, back to back; else None."""
        if self.gate.family != "ggml" or self.up.name != self.gate.name or self.up_offset != self.gate.nbytes:
            return None
        return QuantSpec.ggml(self.gate.name, 2 * self.gate.out_features, self.gate.in_features)

    def spec(self, proj: str) -> QuantSpec:
        return {"gate": self.gate, "up": self.up, "down": self.down}[proj]

    def offset(self, proj: str) -> int:
        return {"gate": 0, "up": self.up_offset, "down": self.down_offset}[proj]

    @property
    def plain_dtype(self) -> torch.dtype | None:
        """The torch dtype when all three projections are plain and of one dtype, else None."""
        names = {self.gate.name, self.up.name, self.down.name}
        return PLAIN[self.gate.name] if len(names) == 1 and self.gate.plain else None

    @property
    def stored_nbytes(self) -> int:
        """Bytes read from disk for one expert (no padding)."""
        return sum(p.nbytes for s in (self.gate, self.up, self.down) for p in s.parts)

    @property
    def specs(self) -> tuple[QuantSpec, ...]:
        return self.gate, self.up, self.down


@dataclass(frozen=True)
class BiasedGluFormat:
    """gpt-oss experts in one slot: gate_up (gate and up as one weight of 2I output rows), down, then the gate_up
    bias [2I] and the down bias [H] in the checkpoint's dtype. The rows of gate_up (and of its bias) alternate as
    the checkpoint has them (2j is gate j, 2j+1 up j), or, where `halves`, hold gate's I rows then up's (llama.cpp's
    separate ffn_gate_exps / ffn_up_exps, read back to back).

    MXFP4 as shipped: gate_up QuantSpec.mxfp4 [2I, H], down [H, I] ([out, in], the parts blocks then scales).
    Plain (the dequantized layout `save_pretrained` writes): stored [in, out] -- gate_up [H, 2I], down [I, H] -- and
    kept so (`transposed`): the math computes x @ W from the slot, no transpose per read.
    GGUF (`halves`): any ggml type llama.cpp stores them in (its MXFP4 blocks, F32, Q8_0, ...), [out, in].
    Never viewed as typed stacks (plain_dtype None): the stores keep raw slots and models/layers/experts.py reads
    them through this format.
    """

    gate_up: QuantSpec  # mxfp4 [2I, H] | plain as stored [H, 2I] (transposed) | ggml [2I, H] (halves)
    down: QuantSpec  # mxfp4 [H, I] | plain as stored [I, H] (transposed) | ggml [H, I]
    down_offset: int
    gate_up_bias: Part  # [2I]
    down_bias: Part  # [H]
    nbytes: int
    transposed: bool = False  # plain weights stored [in, out]
    halves: bool = False  # gate's rows, then up's (else alternating)
    plain_dtype = None

    @staticmethod
    def of(gate_up: QuantSpec, down: QuantSpec, gate_up_bias: torch.dtype, down_bias: torch.dtype,
           hidden: int, inter: int, transposed: bool = False, halves: bool = False) -> "BiasedGluFormat":
        down_offset = _aligned(gate_up.nbytes)
        gb = Part("gate_up_bias", _aligned(down_offset + down.nbytes), gate_up_bias, (2 * inter,))
        db = Part("down_bias", _aligned(gb.offset + gb.nbytes), down_bias, (hidden,))
        return BiasedGluFormat(gate_up, down, down_offset, gb, db, _aligned(db.offset + db.nbytes), transposed,
                               halves)

    @property
    def stored_nbytes(self) -> int:
        """Bytes read from disk for one expert (no padding)."""
        return sum(p.nbytes for s in self.specs for p in s.parts) + self.gate_up_bias.nbytes + self.down_bias.nbytes

    @property
    def specs(self) -> tuple[QuantSpec, ...]:
        return self.gate_up, self.down


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def moe_prefix(index: CheckpointIndex, arch: ModuleType, layer: int) -> str:
    """The MoE block's name prefix in this checkpoint (Mixtral: block_sparse_moe on the hub, mlp when fused), found
    by its router `{prefix}.{arch.ROUTER}.weight` (gpt-oss: `mlp.router.weight`)."""
    router = arch.ROUTER
    for p in arch.MOE_PREFIXES:
        name = f"model.layers.{layer}.{p}"
        if f"{name}.{router}.weight" in index:
            return name
    tried = ", ".join(f"model.layers.{layer}.{p}.{router}.weight" for p in arch.MOE_PREFIXES)
    raise CheckpointError(f"router weight of MoE layer {layer} not found (looked for {tried})", file=str(index.folder))


class ExpertLayout:
    """Byte ranges and storage format of every expert of every MoE layer, validated against the Spec's shapes."""

    def __init__(self, index: CheckpointIndex, spec: ExpertShapes, arch: ModuleType):
        self.spec = spec
        H, I = spec.hidden_size, spec.moe_intermediate_size
        self.gate_up_shape, self.down_shape = (2 * I, H), (H, I)
        self._parts: dict[tuple[int, int], list[ExpertPart]] = {}
        self._formats: dict[int, ExpertFormat] = {}
        self.kind: str | None = None  # "per_expert" | "fused" | "stacked"
        for layer, sparse in enumerate(spec.moe_layers):
            if sparse:
                self._index_layer(index, arch, layer)
        self.fused = None if self.kind is None else self.kind != "per_expert"  # one tensor holds all experts
        formats = set(self._formats.values())
        if not formats:  # no MoE layer: nothing is ever acquired
            f32 = QuantSpec.ggml("F32", I, H)
            formats = {ExpertFormat.of(f32, f32, QuantSpec.ggml("F32", H, I))}
        self.slot_nbytes = max(f.nbytes for f in formats)
        dtypes = {f.plain_dtype for f in formats}
        #: the experts' torch dtype when every layer stores them in one plain dtype (slots then have typed views)
        self.plain_dtype: torch.dtype | None = dtypes.pop() if len(dtypes) == 1 else None
        #: the format names, e.g. {"Q4_K", "Q6_K"}: what `inspect` and the stats report
        self.format_names = sorted({s.name for f in formats for s in f.specs})

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's slot (the largest layer's): the unit of the memory budget."""
        return self.slot_nbytes

    @property
    def layers(self) -> list[int]:
        return [i for i, s in enumerate(self.spec.moe_layers) if s]

    @property
    def bits_per_weight(self) -> float | None:
        """The experts' stored bits per weight over every MoE layer (their three projections' bytes, scales
        included); None without MoE layers."""
        fmts = [self._formats[L] for L in self.layers if L in self._formats]
        if not fmts:
            return None
        nbytes = sum(s.nbytes for f in fmts for s in f.specs)
        weights = sum(s.out_features * s.in_features for f in fmts for s in f.specs)
        return 8 * nbytes / weights

    @property
    def total_experts(self) -> int:
        """Experts over all MoE layers."""
        return len(self.layers) * self.spec.num_experts

    def parts(self, layer: int, expert: int) -> list[ExpertPart]:
        return self._parts[(layer, expert)]

    def format(self, layer: int) -> ExpertFormat | BiasedGluFormat:
        return self._formats[layer]

    # -- building ----------------------------------------------------------------------------------------------
    def _spec_of(self, ref: TensorRef, shape: tuple[int, ...], stacked: bool = False) -> QuantSpec:
        """The QuantSpec of one expert's projection [out, in] stored in `ref` (whose shape is `shape`)."""
        if tuple(ref.shape) != tuple(shape):
            raise CheckpointError(
                f"shape {list(ref.shape)} does not match config.json (expected {list(shape)})",
                file=ref.path,
                tensor=ref.name,
            )
        out_features, in_features = shape[-2], shape[-1]
        if len(shape) == 3 and ref.nbytes % shape[0]:
            raise CheckpointError(f"{ref.nbytes} bytes do not split into {shape[0]} experts", file=ref.path,
                                  tensor=ref.name)
        try:
            if ref.mlx is not None:
                if not stacked:  # only the stacked path reads the scales and biases beside the codes
                    raise ValueError("MLX-quantized experts are read stacked [E, ...] as mlx-lm writes them "
                                     "(switch_mlp); re-convert the model with mlx_lm.convert")
                q = ref.mlx
                return QuantSpec.mlx(q.bits, q.group_size, out_features, in_features, q.scales.torch_dtype)
            if ref.fp8 is not None:  # the codes, then their block scales (both ranges read into the slot)
                return QuantSpec.fp8(out_features, in_features, ref.fp8.block, ref.fp8.scale.torch_dtype)
            return QuantSpec.ggml(ref.dtype, out_features, in_features)
        except (UnsupportedFormat, ValueError) as e:
            raise CheckpointError(f"experts stored as {ref.dtype}: {e}", file=ref.path, tensor=ref.name) from None

    def add_expert(self, layer: int, expert: int, parts: list[ExpertPart]) -> None:
        """The byte ranges of one expert, each landing at its offset of the slot."""
        self._parts[(layer, expert)] = parts

    def _set_format(self, layer: int, ref: TensorRef, gate: QuantSpec, up: QuantSpec,
                    down: QuantSpec) -> ExpertFormat:
        return self.keep_format(layer, ref, ExpertFormat.of(gate, up, down))

    def keep_format(self, layer: int, ref: TensorRef, fmt):
        """Record `fmt` as layer's format (CheckpointError naming `ref` when the layer already has another)."""
        old = self._formats.setdefault(layer, fmt)
        if old != fmt:
            names = ["/".join(s.name for s in f.specs) for f in (old, fmt)]
            raise CheckpointError(f"experts of layer {layer} are stored in different formats ({names[0]} and "
                                  f"{names[1]}); sluice needs one per layer", file=ref.path, tensor=ref.name)
        return fmt

    def _index_layer(self, index: CheckpointIndex, arch: ModuleType, layer: int) -> None:
        s = self.spec
        E, H, I = s.num_experts, s.hidden_size, s.moe_intermediate_size
        p = moe_prefix(index, arch, layer)
        if arch.expert_layer is not None:  # an architecture whose experts are its own (gpt_oss: models/gpt_oss.py)
            self.kind = arch.expert_layer(self, index, p, layer)
            return
        if f"{p}.experts.gate_proj" in index:
            self.kind = "stacked"
            self._stacked_layer(index, p, layer)
            return
        fused = f"{p}.experts.gate_up_proj" in index
        if self.kind is None:
            self.kind = "fused" if fused else "per_expert"
        if fused:
            gu = index[f"{p}.experts.gate_up_proj"]
            dn = index[f"{p}.experts.down_proj"]
            if gu.fp8 is not None or dn.fp8 is not None:  # a scale block may hold gate rows and up rows
                raise CheckpointError("FP8 experts in transformers' fused layout are not read; the hub's FP8 uploads "
                                      "store them per expert (experts.{e}.gate_proj.weight + weight_scale_inv): use "
                                      "such a folder", file=gu.path, tensor=gu.name)
            half = self._spec_of(gu, (E, 2 * I, H))
            gate = up = QuantSpec.ggml(half.name, I, H)  # gate rows, then up rows: one range of whole rows
            down = self._spec_of(dn, (E, H, I))
            fmt = self._set_format(layer, gu, gate, up, down)  # gate and up back to back: one range fills both
            gu_n, dn_n = gu.nbytes // E, dn.nbytes // E
            for e in range(E):
                self._parts[(layer, e)] = [
                    ExpertPart("gate_up", 0, ReadRange(gu.path, gu.offset + e * gu_n, gu_n)),
                    ExpertPart("down", fmt.down_offset, ReadRange(dn.path, dn.offset + e * dn_n, dn_n)),
                ]
            return
        g_name, u_name, d_name = arch.EXPERT_PROJ
        for e in range(E):
            base = f"{p}.experts.{e}"
            refs = {"gate": index[f"{base}.{g_name}.weight"], "up": index[f"{base}.{u_name}.weight"],
                    "down": index[f"{base}.{d_name}.weight"]}
            specs = {k: self._spec_of(r, (H, I) if k == "down" else (I, H)) for k, r in refs.items()}
            fmt = self._set_format(layer, refs["gate"], specs["gate"], specs["up"], specs["down"])
            self._parts[(layer, e)] = [ExpertPart(k, fmt.offset(k) + at, ReadRange(t.path, t.offset, t.nbytes))
                                       for k, r in refs.items() for t, at in _pieces(r, specs[k])]

    def _stacked_layer(self, index: CheckpointIndex, p: str, layer: int) -> None:
        s = self.spec
        E, H, I = s.num_experts, s.hidden_size, s.moe_intermediate_size
        refs = {"gate": index[f"{p}.experts.gate_proj"], "up": index[f"{p}.experts.up_proj"],
                "down": index[f"{p}.experts.down_proj"]}
        specs = {k: self._spec_of(r, (E, H, I) if k == "down" else (E, I, H), stacked=True) for k, r in refs.items()}
        fmt = self._set_format(layer, refs["gate"], specs["gate"], specs["up"], specs["down"])
        pieces = [(k, t, fmt.offset(k) + at) for k, r in refs.items() for t, at in _pieces(r, specs[k])]
        for e in range(E):  # experts are the outermost dim: expert e is one contiguous slice of each
            self._parts[(layer, e)] = [
                ExpertPart(k, dest, ReadRange(t.path, t.offset + e * (t.nbytes // E), t.nbytes // E))
                for k, t, dest in pieces
            ]


def shaped(ref: TensorRef, shape: tuple[int, ...], dtype: str | None = None) -> TensorRef:
    """ref itself when its shape (and dtype) are the expected ones; CheckpointError naming it otherwise."""
    if tuple(ref.shape) != tuple(shape) or (dtype is not None and ref.dtype != dtype):
        raise CheckpointError(f"{ref.dtype} {list(ref.shape)} does not match config.json (expected "
                              f"{dtype or ref.dtype} {list(shape)})", file=ref.path, tensor=ref.name)
    return ref


def _pieces(ref: TensorRef, spec: QuantSpec) -> list[tuple[TensorRef, int]]:
    """The tensors that hold a projection (of one expert, or stacked) and where each (expert's slice) lands inside
    the projection's slot bytes: the tensor itself for a ggml type; weight, scales and biases at their QuantSpec parts
    for MLX; the FP8 codes and their block scales at theirs."""
    if ref.mlx is not None:
        return [(t, part.offset) for t, part in zip((ref, ref.mlx.scales, ref.mlx.biases), spec.parts)]
    if ref.fp8 is not None:
        return [(t, part.offset) for t, part in zip((ref, ref.fp8.scale), spec.parts)]
    return [(ref, 0)]
