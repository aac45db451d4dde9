"""Where each expert's bytes are: (layer, expert) -> byte ranges that land in a slot's gate_up / down buffers.

The unit of streaming is one expert of one layer. Three checkpoint layouts are read:
- per expert (hub, `save_pretrained` default): `{p}.experts.{e}.gate_proj.weight [I, H]`, `up_proj [I, H]`,
  `down_proj [H, I]` (Mixtral: w1 / w3 / w2) -> three ranges;
- fused (`save_pretrained(save_original_format=False)`, GGUF `ffn_gate_up_exps`): `{p}.experts.gate_up_proj
  [E, 2I, H]` and `{p}.experts.down_proj [E, H, I]` -> expert e is one contiguous slice of each, two ranges;
- stacked (GGUF `ffn_{gate,up,down}_exps`, see checkpoint/gguf_index.py): `{p}.experts.gate_proj [E, I, H]`,
  `up_proj [E, I, H]`, `down_proj [E, H, I]` -> one contiguous slice of each, three ranges.
Either way a slot holds gate_up [2I, H] (gate rows, then up rows) and down [H, I] in the checkpoint's dtype; for a
block format (GGUF Q4_K, ...) the same rows as whole blocks, `ref.row_nbytes` bytes per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from ..checkpoint.index import CheckpointIndex
from ..checkpoint.ref import TensorRef
from ..errors import CheckpointError
from ..io.ranges import ReadRange
from ..models.spec import Spec


@dataclass(frozen=True)
class ExpertPart:
    """One contiguous byte range of one expert: lands at byte `dest_offset` of the slot's `proj` buffer."""

    proj: str  # "gate_up" | "down"
    dest_offset: int
    range: ReadRange


def moe_prefix(index: CheckpointIndex, arch: ModuleType, layer: int) -> str:
    """The MoE block's name prefix in this checkpoint (Mixtral: block_sparse_moe on the hub, mlp when fused)."""
    for p in arch.MOE_PREFIXES:
        name = f"model.layers.{layer}.{p}"
        if f"{name}.gate.weight" in index:
            return name
    tried = ", ".join(f"model.layers.{layer}.{p}.gate.weight" for p in arch.MOE_PREFIXES)
    raise CheckpointError(f"router weight of MoE layer {layer} not found (looked for {tried})", file=str(index.folder))


class ExpertLayout:
    """Byte ranges of every expert of every MoE layer, validated against the Spec's shapes and one dtype."""

    def __init__(self, index: CheckpointIndex, spec: Spec, arch: ModuleType):
        self.spec = spec
        H, I = spec.hidden_size, spec.moe_intermediate_size
        self.gate_up_shape, self.down_shape = (2 * I, H), (H, I)
        self.dtype: str | None = None
        self._parts: dict[tuple[int, int], list[ExpertPart]] = {}
        self.kind: str | None = None  # "per_expert" | "fused" | "stacked"
        for layer, sparse in enumerate(spec.moe_layers):
            if sparse:
                self._index_layer(index, arch, layer)
        self.fused = None if self.kind is None else self.kind != "per_expert"  # one tensor holds all experts
        if self.dtype is None:
            self.dtype = "F32"
        from ..checkpoint.ref import DTYPES

        if self.dtype not in DTYPES:
            # TODO(issue 14): the stores allocate slots in a torch dtype; quantized experts need byte slots and the
            # kernels in sluice/quant. Until then, refuse cleanly here.
            raise CheckpointError(f"experts stored as {self.dtype} (a block format) cannot be streamed yet",
                                  file=str(index.folder))
        self.itemsize = DTYPES[self.dtype][0]
        self.gate_up_nbytes = 2 * I * H * self.itemsize
        self.down_nbytes = H * I * self.itemsize

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert (all projections)."""
        return self.gate_up_nbytes + self.down_nbytes

    @property
    def layers(self) -> list[int]:
        return [i for i, s in enumerate(self.spec.moe_layers) if s]

    @property
    def total_experts(self) -> int:
        """Experts over all MoE layers."""
        return len(self.layers) * self.spec.num_experts

    def parts(self, layer: int, expert: int) -> list[ExpertPart]:
        return self._parts[(layer, expert)]

    # -- building ----------------------------------------------------------------------------------------------
    def _check(self, ref: TensorRef, shape: tuple[int, ...]) -> TensorRef:
        if tuple(ref.shape) != tuple(shape):
            raise CheckpointError(
                f"shape {list(ref.shape)} does not match config.json (expected {list(shape)})",
                file=ref.path,
                tensor=ref.name,
            )
        if self.dtype is None:
            self.dtype = ref.dtype
        elif ref.dtype != self.dtype:
            raise CheckpointError(
                f"dtype {ref.dtype} differs from the other experts' {self.dtype}; sluice needs one expert dtype",
                file=ref.path,
                tensor=ref.name,
            )
        return ref

    def _index_layer(self, index: CheckpointIndex, arch: ModuleType, layer: int) -> None:
        s = self.spec
        E, H, I = s.num_experts, s.hidden_size, s.moe_intermediate_size
        p = moe_prefix(index, arch, layer)
        fused = f"{p}.experts.gate_up_proj" in index
        if f"{p}.experts.gate_proj" in index:
            self.kind = "stacked"
            self._stacked_layer(index, p, layer)
            return
        if self.kind is None:
            self.kind = "fused" if fused else "per_expert"
        if fused:
            gu = self._check(index[f"{p}.experts.gate_up_proj"], (E, 2 * I, H))
            dn = self._check(index[f"{p}.experts.down_proj"], (E, H, I))
            gu_n, dn_n = gu.nbytes // E, dn.nbytes // E
            for e in range(E):
                self._parts[(layer, e)] = [
                    ExpertPart("gate_up", 0, ReadRange(gu.path, gu.offset + e * gu_n, gu_n)),
                    ExpertPart("down", 0, ReadRange(dn.path, dn.offset + e * dn_n, dn_n)),
                ]
            return
        g_name, u_name, d_name = arch.EXPERT_PROJ
        for e in range(E):
            base = f"{p}.experts.{e}"
            g = self._check(index[f"{base}.{g_name}.weight"], (I, H))
            u = self._check(index[f"{base}.{u_name}.weight"], (I, H))
            d = self._check(index[f"{base}.{d_name}.weight"], (H, I))
            self._parts[(layer, e)] = [
                ExpertPart("gate_up", 0, ReadRange(g.path, g.offset, g.nbytes)),
                ExpertPart("gate_up", g.nbytes, ReadRange(u.path, u.offset, u.nbytes)),
                ExpertPart("down", 0, ReadRange(d.path, d.offset, d.nbytes)),
            ]

    def _stacked_layer(self, index: CheckpointIndex, p: str, layer: int) -> None:
        s = self.spec
        E, H, I = s.num_experts, s.hidden_size, s.moe_intermediate_size
        g = self._check(index[f"{p}.experts.gate_proj"], (E, I, H))
        u = self._check(index[f"{p}.experts.up_proj"], (E, I, H))
        d = self._check(index[f"{p}.experts.down_proj"], (E, H, I))
        g_n, d_n = g.nbytes // E, d.nbytes // E  # experts are the outermost dim: expert e is one contiguous slice
        for e in range(E):
            self._parts[(layer, e)] = [
                ExpertPart("gate_up", 0, ReadRange(g.path, g.offset + e * g_n, g_n)),
                ExpertPart("gate_up", g_n, ReadRange(u.path, u.offset + e * g_n, g_n)),
                ExpertPart("down", 0, ReadRange(d.path, d.offset + e * d_n, d_n)),
            ]
