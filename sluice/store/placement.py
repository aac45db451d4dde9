"""Where a streaming store puts each layer's experts in its slot rows (store/streaming.py): shifted so an O_DIRECT
reader moves whole blocks straight into the slots, when that costs little."""

from __future__ import annotations

import torch

from ..io.ranges import PAGE
from .layout import ExpertLayout


# A placed slot is up to one O_DIRECT block (the files' alignment, io/odirect.py DIO_ALIGNS) longer, its row rounded up
# to whole pages (the prompt's loan gives whole slots back to the kernel, store/budget.py PromptLoan); slots are placed
# where that costs at most this share of a slot (paid in slots; small slots keep the stored layout, and their small
# reads save little copying). The issue-30 model's 249 KiB slots: 3 KiB more at a 512-byte alignment (1.2%); the peers
# Q4_K_M file's 996 KiB slots: up to 8 KiB at 4096.
PLACED_MAX_COST = 1 / 32


# A shifted slot still gives typed views of every part (MLX's uint32 codes and float scales, plain experts): 8 bytes
# covers them. GGUF tensors start at 32-byte offsets, safetensors' data at 8. The native kernels use unaligned loads.
VIEW_ALIGN = 8


def _page_shifts(layout: ExpertLayout, align: int = PAGE) -> dict[int, int]:
    """Per MoE layer, the byte of an `align`-aligned slot row its experts start at: the residue modulo `align` (the
    files' O_DIRECT alignment) that most of the layer's parts' bytes have (their file offsets minus where each lands
    in the slot), among the residues its typed views may start at. In a GGUF file a layer's stacked expert tensors
    share one residue modulo 512 (tensor and expert sizes are whole 512-byte blocks: 256 x 256 values of Q4_K or
    Q6_K are); modulo a 4 KiB page they often do not (the issue-30 model's gate and up tensors sit 2 KiB apart, and
    its Q6_K experts of 105 KiB start at four residues). A part at another residue is still read right, through
    staging."""
    item = torch.tensor([], dtype=layout.plain_dtype).element_size() if layout.plain_dtype is not None else 1
    shifts = {}
    for layer in layout.layers:
        votes: dict[int, int] = {}
        for e in range(layout.spec.num_experts):
            for part in layout.parts(layer, e):
                r = (part.range.offset - part.dest_offset) % align
                votes[r] = votes.get(r, 0) + part.range.nbytes
        votes = {r: n for r, n in votes.items() if r % max(item, VIEW_ALIGN) == 0}  # typed views must start there
        shifts[layer] = max(votes, key=votes.__getitem__) if votes else 0
    return shifts


def _alignment(layout: ExpertLayout, reader) -> int:
    """The O_DIRECT alignment of the files that hold the experts (reader.alignment), 0 when the reader does not read
    them with O_DIRECT."""
    if not getattr(reader, "odirect", False) or not hasattr(reader, "alignment"):
        return 0
    paths = {part.range.path for L in layout.layers for e in range(layout.spec.num_experts)
             for part in layout.parts(L, e)}
    return reader.alignment(sorted(paths))
