"""A decode token's MoE block in two native calls per layer (moe_decode.c), for models/layers/moe_decode.py:

    route = DecodeRoute(router, k, norm, bf16_weights, ties, path)   # one per layer, its buffers made once
    if not route(x): ...torch ranks route.probs...                     # 0: a NaN, or a tie torch.topk must order
    ex = DecodeExperts(call, extra, gate, k, planes, path)            # one per layer
    ex.run(raw, slots, rows, x, widen, shared, n_sum, w, at, out)     # experts (+ shared), then the weighted sum
    ex.start(raw, slots, x, w, at, out); ...; ex.finish()             # the same, the pool's workers starting alone

Each is the composition of the calls the block made one at a time (decode.c, q8.c, ops.c): the same bits."""

from __future__ import annotations

import ctypes

import torch

from ._lib import BEST, LIB as _LIB
from .decode import _TOPK_FN, _bf16, ties_exact
from .q8 import ExpertCall, _planes

if _LIB is not None:
    _i64, _ptr, _i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    # E, H, x, w, probs, k, norm, bf16, ties, ids, wf, wb, sorted, at, path
    _LIB.sluice_moe_route_bf16.argtypes = [_i64, _i64, _ptr, _ptr, _ptr, _i64, _i32, _i32, _ptr, _ptr, _ptr, _ptr,
                                           _ptr, _ptr, _i32]
    _LIB.sluice_moe_route_bf16.restype = _i32
    _LIB.sluice_moe_experts.argtypes = [_ptr, _ptr, _i32]  # state, moe_args, run to the end
    _LIB.sluice_moe_experts.restype = _i32
    _LIB.sluice_moe_finish.argtypes = [_ptr]
    _LIB.sluice_moe_finish.restype = None
    _LIB.sluice_moe_args_size.restype = ctypes.c_size_t
    _LIB.sluice_moe_state_size.restype = ctypes.c_size_t
    _LIB.sluice_shared_weight_bf16.argtypes = [_i64, _ptr, _ptr, _i32]  # H, x, gate, path
    _LIB.sluice_shared_weight_bf16.restype = ctypes.c_uint16

#: the most experts one call takes (moe_decode.c MOE_MAX_K)
MAX_K = 64


class _Args(ctypes.Structure):
    """moe_decode.c moe_args: every field 64 bits, pointers as addresses."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "n", "slots", "rows", "base", "stride", "parts", "extra", "extra_row", "H", "I", "x", "xf", "widen", "ys", "P",
        "n_sum", "w", "w_f32", "at", "has_shared", "gate", "out", "scalar")]


if _LIB is not None and _LIB.sluice_moe_args_size() != ctypes.sizeof(_Args):
    raise ImportError("sluice.quant.native: moe_decode.c's moe_args and moe_decode.py's _Args differ: rebuild the "
                      "extension (make install)")


def shared_weight(x: torch.Tensor, gate: torch.Tensor, *, path: int = BEST) -> torch.Tensor:
    """A decode token's shared-expert weight, bf16 [1, 1]: sigmoid(x . gate) with the dot rounded to bf16 and the
    sigmoid to bf16 (moe_decode.c), torch.sigmoid(F.linear(x, gate))'s up to the dot's order; x [1, H] and gate
    [1, H] bf16."""
    H = gate.numel()
    bits = _LIB.sluice_shared_weight_bf16(H, _bf16(x, "x", H), _bf16(gate, "shared gate", H), path)
    return torch.tensor([[bits - 65536 if bits >= 32768 else bits]], dtype=torch.int16).view(torch.bfloat16)


class DecodeRoute:
    """A softmax router's top k of one bf16 token (moe_decode.c sluice_moe_route_bf16): the probabilities, the k
    largest, their weights (normalised when `norm`; bf16 when `bf16_weights`, else float32) and the ids ascending
    with their positions among the k, into buffers made once (one token at a time, on the model's thread)."""

    def __init__(self, router: torch.Tensor, k: int, norm: bool, bf16_weights: bool, ties: bool | None = None, *,
                 path: int = BEST):
        E, H = router.shape
        _bf16(router, "router", E * H)
        if not 1 <= k <= min(MAX_K, E):
            raise ValueError(f"DecodeRoute: k must be in 1..{min(MAX_K, E)}, got {k}")
        self.E, self.H, self.k, self.norm, self.bf16, self.path = E, H, k, bool(norm), bool(bf16_weights), path
        self.router = router
        self.ties = _TOPK_FN if (ties_exact() if ties is None else ties) else None
        self.probs = torch.empty(1, E, dtype=torch.float32)
        self.ids = torch.empty(1, k, dtype=torch.int64)
        self.wf = torch.empty(1, k, dtype=torch.float32)
        self.wb = torch.empty(1, k, dtype=torch.bfloat16)
        self.sorted = torch.empty(k, dtype=torch.int64)  # the ids ascending
        self.at = torch.empty(k, dtype=torch.int64)  # each one's position in ids (its weight's)
        self.weights = self.wb if self.bf16 else self.wf
        self._sorted_np = self.sorted.numpy()
        self._args = (E, H, None, router.data_ptr(), self.probs.data_ptr(), k, int(self.norm), int(self.bf16),
                      self.ties, self.ids.data_ptr(), self.wf.data_ptr(), self.wb.data_ptr(), self.sorted.data_ptr(),
                      self.at.data_ptr(), path)

    def __call__(self, x: torch.Tensor) -> bool:
        """x [1, H] bf16 contiguous; True with ids, weights, sorted and at written, False where torch.topk has to
        rank self.probs (a NaN; a tie without topk.cc)."""
        a = self._args
        return bool(_LIB.sluice_moe_route_bf16(a[0], a[1], _bf16(x, "x", self.H), *a[3:]))

    def sorted_ids(self) -> list[int]:
        return self._sorted_np.tolist()


class DecodeExperts:
    """The experts of one layer on one decode token and the block's weighted sum (moe_decode.c
    sluice_moe_experts), for experts of one stored layout (call: q8.ExpertCall); `extra`: q8.expert_args of
    a shared expert of the same H and I computed in the same call (row k of the outputs), `gate` its bf16 [1, H]
    sigmoid gate (None: weight 1), added after the routed ones; holds its float32 x and outputs."""

    def __init__(self, call: ExpertCall, extra: tuple | None, gate: torch.Tensor | None, k: int, planes: int, *,
                 path: int = BEST):
        if not 1 <= k <= MAX_K:
            raise ValueError(f"DecodeExperts: k must be in 1..{MAX_K}, got {k}")
        if extra is not None and len(extra) != 9:
            raise ValueError(f"DecodeExperts: a shared expert needs 9 call values, got {len(extra)}")
        self.h, self.i, self.k, self.nbytes = call.h, call.i, k, call.nbytes
        if gate is not None:
            _bf16(gate, "shared gate", self.h)
        self.gate, self.planes, self.path = gate, _planes(planes), path
        self.xf = torch.empty(1, self.h, dtype=torch.float32)
        self.ys = torch.empty(k + 1, self.h, dtype=torch.float32)  # row j: the j-th expert by id; row k: the shared
        self._parts = (ctypes.c_int64 * 9)(*(v for part in call.parts for v in part))
        self._extra = None if extra is None else (ctypes.c_int64 * 9)(*extra)
        self._slots, self._rows = (ctypes.c_int64 * k)(), (ctypes.c_int64 * k)()
        self._raw: torch.Tensor | None = None  # the last slot stack checked (kept: its id stays its own)
        self._state = ctypes.create_string_buffer(_LIB.sluice_moe_state_size())  # a started call's (start)
        self._started: tuple | None = None  # what a started call reads until finish: kept alive
        a = self._args = _Args()  # the call's arguments: those below fixed, the rest set by each call
        a.slots, a.rows, a.parts = (ctypes.addressof(v) for v in (self._slots, self._rows, self._parts))
        a.extra_row, a.H, a.I, a.xf, a.ys, a.P = k, self.h, self.i, self.xf.data_ptr(), self.ys.data_ptr(), self.planes
        a.has_shared, a.gate, a.scalar = int(extra is not None), 0 if gate is None else gate.data_ptr(), path
        self._extra_at = 0 if self._extra is None else ctypes.addressof(self._extra)
        # prepared()'s context: the two functions, the state, the arguments, the slots (another C library calls them)
        self._ctx = (ctypes.c_int64 * 5)(*(ctypes.cast(f, ctypes.c_void_p).value
                                           for f in (_LIB.sluice_moe_experts, _LIB.sluice_moe_finish)),
                                         ctypes.addressof(self._state), ctypes.addressof(a),
                                         ctypes.addressof(self._slots))
        self._ctx_at = ctypes.addressof(self._ctx)
        self._prepared: tuple | None = None  # (raw, w, at) of the last prepared(), while its arguments stand

    def check_raw(self, raw: torch.Tensor) -> None:
        """raw: uint8 [S, >= nbytes], rows contiguous (checked once per stack)."""
        if raw is self._raw:
            return
        if not (raw.dtype is torch.uint8 and raw.dim() == 2 and raw.stride(1) == 1 and raw.shape[1] >= self.nbytes
                and raw.stride(0) >= raw.shape[1]):
            raise ValueError(f"expert slots: need uint8 [S, >= {self.nbytes}] with contiguous rows, got {raw.dtype} "
                             f"{list(raw.shape)}")
        self._raw = raw

    def run(self, raw: torch.Tensor, slots: list[int], rows: list[int], x: torch.Tensor, widen: bool,
            shared: bool, n_sum: int = 0, w: torch.Tensor | None = None, at: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> None:
        """Experts in rows `slots` of raw (checked by check_raw) on x [1, H] bf16 (widened into xf when `widen`;
        later calls of the same token pass False), expert e into ys[rows[e]], and the shared expert into ys[k] when
        `shared` (the token's first call), in one sluice_experts_q8 call; then, with n_sum > 0, out (bf16 [1, H]) =
        the sum of ys rows 0..n_sum-1 weighted by w[0, at[j]] (w bf16 or float32 [1, k], at int64 [n_sum]), plus
        the shared row times its weight where there is a shared expert. Each row bitwise what ExpertCall.many
        writes, the sum what ops.combine_bf16 adds."""
        if self._started is not None:
            raise RuntimeError("DecodeExperts.run: the call started before has not finished")
        self._call(True, raw, slots, rows, x, widen, shared, n_sum, w, at, out)

    def start(self, raw: torch.Tensor, slots: list[int], x: torch.Tensor, w: torch.Tensor, at: torch.Tensor,
              out: torch.Tensor) -> None:
        """run(raw, slots, range(len(slots)), x, True, True, len(slots), w, at, out) in two halves: this returns with
        the experts' gate and up rows started on the native pool's workers (moe_decode.c; run here where the pool
        cannot start a job), so this thread can do other work meanwhile; finish() does the rest. Nothing else may
        use this object's buffers, nor x, w, at, out, raw's slots, until then."""
        if self._started is not None:
            raise RuntimeError("DecodeExperts.start: the call started before has not finished")
        n = len(slots)
        self._call(False, raw, slots, list(range(n)), x, True, True, n, w, at, out)
        self._started = (raw, x, w, at, out)

    def prepared(self, raw: torch.Tensor, x: torch.Tensor, w: torch.Tensor, at: torch.Tensor, out: torch.Tensor
                 ) -> int:
        """start(raw, slots, x, w, at, out) and finish() for k slots not known yet, made by another C library
        (store/stream.c sluice_stream_layer: it writes the k slots, then calls sluice_moe_experts(state, args, 0) and
        sluice_moe_finish(state)): the address of that context, int64 [5] (the two functions, the state, the
        arguments, the slots array). Nothing else may use this object, x, w, at or out until that call returns."""
        if self._started is not None:
            raise RuntimeError("DecodeExperts.prepared: the call started before has not finished")
        if self._prepared is not None and self._prepared[0] is raw and self._prepared[1] is w and \
                self._prepared[2] is at:  # the arguments as the last prepared() left them: only x and out move
            h = self.h
            if not (x.dtype is out.dtype is torch.bfloat16 and x.is_contiguous() and out.is_contiguous()
                    and x.numel() == out.numel() == h):
                raise ValueError(f"DecodeExperts: x and out need contiguous bf16 [1, {h}], got {x.dtype} "
                                 f"{list(x.shape)} and {out.dtype} {list(out.shape)}")
            self._args.x, self._args.out = x.data_ptr(), out.data_ptr()
            return self._ctx_at
        self._set(raw, [0] * self.k, list(range(self.k)), x, True, True, self.k, w, at, out)
        self._prepared = (raw, w, at)
        return self._ctx_at

    def finish(self) -> None:
        """The rest of the call start() began, and the sum into its out."""
        if self._started is None:
            return
        _LIB.sluice_moe_finish(self._state)
        self._started = None

    def _call(self, to_end: bool, raw: torch.Tensor, slots: list[int], rows: list[int], x: torch.Tensor,
              widen: bool, shared: bool, n_sum: int, w: torch.Tensor | None, at: torch.Tensor | None,
              out: torch.Tensor | None) -> None:
        self._set(raw, slots, rows, x, widen, shared, n_sum, w, at, out)
        self._prepared = None  # the arguments are this call's now
        rc = _LIB.sluice_moe_experts(self._state, ctypes.byref(self._args), to_end)
        if rc:
            raise MemoryError(f"native decode experts failed (code {rc}): no memory for {len(slots)} experts' scratch")

    def _set(self, raw: torch.Tensor, slots: list[int], rows: list[int], x: torch.Tensor, widen: bool, shared: bool,
             n_sum: int, w: torch.Tensor | None, at: torch.Tensor | None, out: torch.Tensor | None) -> None:
        """The call's arguments (self._args), checked."""
        n, k, a = len(slots), self.k, self._args
        if n > k or len(rows) != n:
            raise ValueError(f"DecodeExperts: {n} experts into {len(rows)} rows, at most {k}")
        if not (x.dtype is torch.bfloat16 and x.is_contiguous() and x.numel() == self.h):
            raise ValueError(f"DecodeExperts x: need a contiguous bf16 [1, {self.h}], got {x.dtype} {list(x.shape)}")
        self._slots[:n], self._rows[:n] = slots, rows
        a.n_sum = a.w = a.w_f32 = a.at = a.out = 0
        if n_sum:
            if not (0 < n_sum <= k and w is not None and w.dtype in (torch.bfloat16, torch.float32)
                    and w.is_contiguous() and w.numel() >= k and at is not None and at.dtype is torch.int64
                    and at.is_contiguous() and at.numel() >= n_sum and out is not None
                    and out.dtype is torch.bfloat16 and out.is_contiguous() and out.numel() == self.h):
                raise ValueError("DecodeExperts: the sum needs w bf16/float32 [1, k], at int64 [n] and out bf16 [1, H]")
            a.n_sum, a.w, a.w_f32, a.at, a.out = n_sum, w.data_ptr(), w.dtype is torch.float32, at.data_ptr(), \
                out.data_ptr()
        a.n, a.base, a.stride, a.x, a.widen = n, raw.data_ptr(), raw.stride(0), x.data_ptr(), widen
        a.extra = self._extra_at if shared else 0
