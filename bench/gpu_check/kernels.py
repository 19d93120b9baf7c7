"""gpu_check part `kernels`: every Triton kernel against its torch twin at real shapes.

Each check runs the Triton kernel in the check's dtype and the torch twin in fp32 on the same
rounded inputs (rms_norm: the twin in the same dtype, since its rounding is the definition), and
compares under the tolerance stated in kernel_shapes.TOLERANCES. On the GPU it also times
the Triton kernel against the twin in the same dtype (a ratio, reported, never asserted) and reports
the twin's own error in that dtype beside the Triton kernel's, so a reader sees whether a deviation
is the dtype's or the kernel's.

The kernels are the fields of `KernelSet` plus the Triton-only `align_block_size` (the grouped
GEMM's tile schedule) and `skinny_matmul` (the CPU fast path, which must hand back F.linear's
result on any other device). The `coverage` check fails when a KernelSet kernel has no check here.

FP8 weights run both Triton schemes (moe_runtime/kernels/triton_impl/fp8_scheme.py) whatever the device's own
pick: the dequantize path against the torch twin (the checks named plainly), and the FP8-activation
path (`.../fp8_tiles`: fp8 x fp8 tiles with per-block scales, native on sm89+, the dot emulated in
the dry run and on older GPUs) against a float64 reference that quantizes the activations as the
kernel does (tests/fp8_activation_reference.py). The masked layout's checks compare the rows below
each count only (the Triton kernels leave the rest undefined) and fail on any host read or an
output-sized fill during the Triton call (tests/host_reads.py).
"""
from __future__ import annotations

from dataclasses import asdict, fields

import torch
import torch.nn.functional as F

import fp8_activation_reference as fp8_reference     # tests/: the FP8-activation scheme in float64
from host_reads import HostReadWatch                 # tests/: host reads and fills during a call
from moe_runtime.kernels import KernelSet, get_kernels
from moe_runtime.kernels.skinny_matmul import batched_linear_rows, linear_rows
from moe_runtime.kernels.triton_impl.fp8_scheme import Fp8Scheme
from moe_runtime.kernels.triton_impl.kernel_set import triton_kernel_set
from triton_kernel_cases import moe_inputs          # the edge-case suite's input generator

from .kernel_shapes import (FP8, INT4, INT8, MXFP4, ROUTING_TIE_MARGIN, TOLERANCES, AttentionShape, ExpertWeights,
                            KernelShapes, NormShape, QuantizedExpertWeights, QuantizedFormat, RoutingCase, best_ms,
                            compare, distinct_logits, routing_margins, shapes_for)
from .report import Outcome, RunMode, judged

EXTRA_KERNELS = ("align_block_size", "skinny_matmul")
ROUTING_BIAS_STD = 0.3


class KernelsPart:
    def __init__(self, mode: RunMode):
        self.mode = mode
        self.device = torch.device(mode.device)
        self.shapes: KernelShapes = shapes_for(mode.dry_run, mode.tiny)
        self.dtypes = self.shapes.dtypes or (mode.kernel_low_precision,)
        self.triton: KernelSet = get_kernels(self.device, "triton")
        self.twin: KernelSet = get_kernels(self.device, "torch")
        native = self.triton.fp8_linear.__self__.scheme.native_loads          # the device's own pick: sm89+
        self.fp8_schemes: dict[str, KernelSet] = {   # check suffix -> the Triton family with that FP8 scheme
            "": triton_kernel_set(Fp8Scheme(native_loads=native)),
            "/fp8_tiles": triton_kernel_set(Fp8Scheme(native_loads=native, fp8_activations=True, native_dot=native)),
        }
        self._weights: dict[str, ExpertWeights] = {}
        self._quantized_weights: dict[tuple[str, str], QuantizedExpertWeights] = {}   # by (format, dtype)
        self._checks = self._plan()

    # ------------------------------------------------------------------------------------- the plan

    def _plan(self) -> dict:
        s = self.shapes
        e = s.experts
        checks = {"coverage/kernel_set": self._coverage}
        for case in s.routing:
            for tokens in s.routing_tokens:
                for dtype in s.routing_dtypes:
                    checks[f"select_experts/{case.name}/T{tokens}/{dtype}"] = (
                        lambda c=case, t=tokens, d=dtype: self._select_experts(c, t, d))
        for tokens in s.expert_tokens:
            checks[f"permute_by_expert/{e.name}/T{tokens}"] = lambda t=tokens: self._permute(t, masked=False)
        tokens = max(s.expert_tokens)
        checks[f"permute_by_expert/{e.name}/T{tokens}_masked_slots"] = lambda t=tokens: self._permute(t, masked=True)
        for block_m in (16, 64):
            checks[f"align_block_size/{e.name}/T{tokens}/block_m{block_m}"] = (
                lambda t=tokens, b=block_m: self._align(t, b))
        for dtype in self.dtypes:
            for tokens in s.expert_tokens:
                checks[f"fused_moe/{e.name}/T{tokens}/{dtype}"] = lambda t=tokens, d=dtype: self._fused_moe(t, d)
                checks[f"expert_mlp/{e.name}/T{tokens}/{dtype}"] = lambda t=tokens, d=dtype: self._expert_mlp(t, d)
            tokens = max(s.expert_tokens)
            checks[f"expert_mlp/dense_one_expert/T{tokens}/{dtype}"] = lambda t=tokens, d=dtype: self._dense(t, d)
            checks[f"unpermute_reduce/{e.name}/T{tokens}/{dtype}"] = lambda t=tokens, d=dtype: self._unpermute(t, d)
            checks[f"masked_expert_mlp/{s.masked.name}/{dtype}"] = lambda d=dtype: self._masked(d)
            # int8 and int4: the Triton family runs the torch kernels (no Triton kernel for them yet); FP8: both
            # schemes; MXFP4: Triton decodes the fp4 tile in registers
            for fmt, scheme in ((FP8, ""), (FP8, "/fp8_tiles"), (INT8, ""), (MXFP4, ""), (INT4, "")):
                checks[f"{fmt.name}_expert_mlp/{e.name}/T{tokens}/{dtype}{scheme}"] = (
                    lambda f=fmt, t=tokens, d=dtype, c=scheme: self._quantized_expert_mlp(f, t, d, c))
                checks[f"{fmt.name}_masked_expert_mlp/{s.masked.name}/{dtype}{scheme}"] = (
                    lambda f=fmt, d=dtype, c=scheme: self._quantized_masked(f, d, c))
                for rows in s.skinny_rows:
                    checks[f"{fmt.name}_linear/rows{rows}/{dtype}{scheme}"] = (
                        lambda f=fmt, r=rows, d=dtype, c=scheme: self._quantized_linear(f, r, d, c))
            for norm in s.norms:
                for tokens in s.norm_tokens:
                    checks[f"rms_norm/{norm.name}/T{tokens}/{dtype}"] = (
                        lambda n=norm, t=tokens, d=dtype: self._rms_norm(n, t, d, fused=False))
                checks[f"fused_add_rms_norm/{norm.name}/T{max(s.norm_tokens)}/{dtype}"] = (
                    lambda n=norm, t=max(s.norm_tokens), d=dtype: self._rms_norm(n, t, d, fused=True))
            for pair_tokens in (1, 2):   # a decode step's rows; eager, the form gathers [T*K, 2I, H] weights
                checks[f"pair_expert_mlp/{e.name}/T{pair_tokens}/{dtype}"] = (
                    lambda t=pair_tokens, d=dtype: self._pair_experts(t, d))
            for rows in s.skinny_rows:
                checks[f"linear_rows/rows{rows}/{dtype}"] = lambda r=rows, d=dtype: self._family_linear_rows(r, d)
                checks[f"skinny_matmul/linear_rows/rows{rows}/{dtype}"] = (
                    lambda r=rows, d=dtype: self._skinny(r, d, batched=False))
            rows = min(max(s.skinny_rows), 8)
            checks[f"skinny_matmul/batched_linear_rows/rows{rows}/{dtype}"] = (
                lambda r=rows, d=dtype: self._skinny(r, d, batched=True))
            for shape in s.attention:
                checks[f"paged_decode_attention/{shape.name}/B{len(s.context_lens)}/{dtype}"] = (
                    lambda a=shape, d=dtype: self._attention(a, d))
        return checks

    def check_names(self) -> list[str]:
        return list(self._checks)

    def run(self, name: str) -> Outcome:
        return self._checks[name]()

    def close(self) -> None:
        self._weights.clear()
        self._quantized_weights.clear()

    def _coverage(self) -> Outcome:
        kernels = [f.name for f in fields(KernelSet) if f.name != "name"] + list(EXTRA_KERNELS)
        planned = {name.split("/")[0] for name in self._checks}
        missing = [k for k in kernels if k not in planned]
        return judged([f"no check for {', '.join(missing)}"] if missing else [], kernels=kernels,
                      checks=len(self._checks) - 1, dtypes=list(self.dtypes),
                      triton_mode="interpreter" if self.mode.dry_run else "compiled")

    # -------------------------------------------------------------------------------------- helpers

    def _dtype(self, name: str) -> torch.dtype:
        return getattr(torch, name)

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _randn(self, *shape, dtype: str, seed: int, scale: float = 1.0) -> torch.Tensor:
        out = torch.randn(*shape, generator=self._generator(seed), device=self.device, dtype=self._dtype(dtype))
        return out.mul_(scale) if scale != 1.0 else out

    def _expert_weights(self, dtype: str) -> ExpertWeights:
        if dtype not in self._weights:
            self._weights.clear()          # one dtype at a time: the real layer is 22.5 GB in bf16
            self._quantized_weights.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            e = self.shapes.experts
            w13 = self._randn(e.experts, 2 * e.intermediate, e.hidden, dtype=dtype, seed=1, scale=e.hidden ** -0.5)
            w2 = self._randn(e.experts, e.hidden, e.intermediate, dtype=dtype, seed=2, scale=e.intermediate ** -0.5)
            self._weights[dtype] = ExpertWeights(w13, w2, w13.float(), w2.float())
        return self._weights[dtype]

    def _quantized_expert_weights(self, fmt: QuantizedFormat, dtype: str) -> QuantizedExpertWeights:
        weights = self._expert_weights(dtype)
        if (fmt.name, dtype) not in self._quantized_weights:
            self._quantized_weights[fmt.name, dtype] = QuantizedExpertWeights.of(weights, fmt)
        return self._quantized_weights[fmt.name, dtype]

    def _routing(self, tokens: int):
        """(weights [T, K] fp32, ids [T, K]) on the device, from the edge-case suite's generator."""
        e = self.shapes.experts
        _, _, _, weights, ids = moe_inputs(tokens=tokens, top_k=e.top_k, experts=e.experts, hidden=1,
                                           intermediate=1, seed=tokens)
        return weights.to(self.device), ids.to(self.device)

    def _timing(self, triton_call, twin_call, repeats: int = 5) -> dict:
        if not self.shapes.timed:
            return {"timing": "not measured (Triton interpreter)"}
        triton_ms, twin_ms = best_ms(triton_call, self.device, repeats), best_ms(twin_call, self.device, repeats)
        return {"triton_ms": triton_ms, "torch_twin_ms": twin_ms, "speedup_vs_torch_twin": twin_ms / triton_ms}

    def _judge(self, kernel: str, dtype: str, got, want, twin_low=None, extra_problems=(), **details) -> Outcome:
        tolerance = TOLERANCES[kernel][dtype]
        result = compare(got, want, tolerance)
        problems = [p for p in [result.problem(kernel), *extra_problems] if p]
        if twin_low is not None:
            twin = compare(twin_low, want, tolerance)
            details["torch_twin_same_dtype"] = {"max_abs_err": twin.max_abs_err, "rel_l2_err": twin.rel_l2_err}
        return judged(problems, kernel=kernel, dtype=dtype, tolerance=str(tolerance),
                      max_abs_err=result.max_abs_err, comparison=result.as_details(), **details)

    # --------------------------------------------------------------------------------------- checks

    def _select_experts(self, case: RoutingCase, tokens: int, dtype: str) -> Outcome:
        generator = torch.Generator().manual_seed(tokens)
        logits = distinct_logits(tokens, case.experts, generator).to(self.device, self._dtype(dtype))
        bias = (torch.randn(case.experts, generator=generator) * ROUTING_BIAS_STD).to(self.device) \
            if case.correction_bias else None
        got = self.triton.select_experts(logits, case.config, bias)
        want = self.twin.select_experts(logits.float(), case.config, bias)
        got_ids, got_order = got.ids.sort(dim=-1)
        want_ids, want_order = want.ids.sort(dim=-1)
        same = (got_ids == want_ids).all(dim=-1)                                   # [T]
        ambiguous = routing_margins(logits.float(), case.config, bias) < ROUTING_TIE_MARGIN
        wrong = int((~same & ~ambiguous).sum())
        tolerance = TOLERANCES["select_experts"][dtype]
        weights = compare(got.weights.gather(1, got_order)[same], want.weights.gather(1, want_order)[same], tolerance)
        problems = [f"{wrong} of {tokens} tokens chose other experts (no near-tie)"] if wrong else []
        if weights.problem("weights"):
            problems.append(weights.problem("weights"))
        return judged(problems, kernel="select_experts", dtype=dtype, experts=case.experts,
                      config=asdict(case.config), correction_bias=case.correction_bias, tokens=tokens,
                      ids=f"equal (tokens with a near-tie < {ROUTING_TIE_MARGIN:g} excepted)", tolerance=str(tolerance),
                      max_abs_err=weights.max_abs_err, near_tie_tokens=int(ambiguous.sum()),
                      near_tie_tokens_differing=int((~same & ambiguous).sum()), comparison=weights.as_details(),
                      **self._timing(lambda: self.triton.select_experts(logits, case.config, bias),
                                     lambda: self.twin.select_experts(logits, case.config, bias), repeats=10))

    def _permute(self, tokens: int, masked: bool) -> Outcome:
        e = self.shapes.experts
        _, _, _, _, ids = moe_inputs(tokens=tokens, top_k=e.top_k, experts=e.experts, hidden=1, intermediate=1,
                                     masked=0.3 if masked else 0.0, seed=tokens)
        ids = ids.to(self.device)
        got = self.triton.permute_by_expert(ids, e.experts)
        want = self.twin.permute_by_expert(ids, e.experts)
        problems = [f"{field} differs" for field in ("token_index", "flat_index", "counts", "offsets")
                    if not torch.equal(getattr(got, field), getattr(want, field))]
        return judged(problems, kernel="permute_by_expert", tokens=tokens, experts=e.experts, top_k=e.top_k,
                      masked_slots=masked, rows=want.num_rows, tolerance="equal",
                      **self._timing(lambda: self.triton.permute_by_expert(ids, e.experts),
                                     lambda: self.twin.permute_by_expert(ids, e.experts), repeats=10))

    def _align(self, tokens: int, block_m: int) -> Outcome:
        from moe_runtime.kernels.triton_impl.align import align_block_size   # Triton-only: no twin, invariants instead

        e = self.shapes.experts
        _, ids = self._routing(tokens)
        aligned = align_block_size(ids, e.experts, block_m)
        rows = aligned.schedule.padded_rows.cpu()
        tiles = aligned.schedule.block_expert.cpu()
        flat_ids = ids.reshape(-1).cpu()
        problems = []
        for tile, expert in enumerate(tiles.tolist()):
            live = rows[tile * block_m:(tile + 1) * block_m]
            live = live[live >= 0]
            if (expert < 0) != (live.numel() == 0) or (expert >= 0 and not torch.all(flat_ids[live] == expert)):
                problems.append(f"tile {tile} (expert {expert}) holds rows of other experts or is misplaced")
                break
        valid = ((flat_ids >= 0) & (flat_ids < e.experts)).nonzero().flatten()
        if sorted(rows[rows >= 0].tolist()) != valid.tolist():
            problems.append("the padded rows are not exactly the valid (token, k) pairs")
        slots = aligned.padded_slot.cpu()
        if not torch.equal(rows[slots[slots >= 0]], (slots >= 0).nonzero().flatten()):
            problems.append("padded_slot does not invert padded_rows")
        if not torch.equal(aligned.counts.cpu(), torch.bincount(flat_ids[valid], minlength=e.experts)):
            problems.append("counts differ from a bincount of the ids")
        return judged(problems, kernel="align_block_size", tokens=tokens, experts=e.experts, block_m=block_m,
                      tiles=len(tiles), tolerance="invariants hold exactly")

    def _fused_moe(self, tokens: int, dtype: str) -> Outcome:
        e, w = self.shapes.experts, self._expert_weights(dtype)
        x = self._randn(tokens, e.hidden, dtype=dtype, seed=tokens)
        weights, ids = self._routing(tokens)
        got = self.triton.fused_moe(x, w.w13, w.w2, weights, ids)
        want = self.twin.fused_moe(x.float(), w.w13_fp32, w.w2_fp32, weights, ids)
        twin_low = self.twin.fused_moe(x, w.w13, w.w2, weights, ids)
        problems = [] if got.dtype == x.dtype else [f"output dtype {got.dtype}, expected {x.dtype}"]
        return self._judge("fused_moe", dtype, got, want, twin_low, problems, tokens=tokens, hidden=e.hidden,
                           intermediate=e.intermediate, experts=e.experts, top_k=e.top_k,
                           experts_hit=int(torch.unique(ids).numel()),
                           **self._timing(lambda: self.triton.fused_moe(x, w.w13, w.w2, weights, ids),
                                          lambda: self.twin.fused_moe(x, w.w13, w.w2, weights, ids), repeats=3))

    def _expert_mlp(self, tokens: int, dtype: str) -> Outcome:
        e, w = self.shapes.experts, self._expert_weights(dtype)
        x = self._randn(tokens, e.hidden, dtype=dtype, seed=tokens)
        _, ids = self._routing(tokens)
        plan = self.twin.permute_by_expert(ids, e.experts)
        x_sorted = x[plan.token_index]
        got = self.triton.expert_mlp(x_sorted, plan.counts, w.w13, w.w2)
        want = self.twin.expert_mlp(x_sorted.float(), plan.counts, w.w13_fp32, w.w2_fp32)
        twin_low = self.twin.expert_mlp(x_sorted, plan.counts, w.w13, w.w2)
        return self._judge("expert_mlp", dtype, got, want, twin_low, tokens=tokens, rows=plan.num_rows,
                           layout="contiguous (grouped by expert)",
                           **self._timing(lambda: self.triton.expert_mlp(x_sorted, plan.counts, w.w13, w.w2),
                                          lambda: self.twin.expert_mlp(x_sorted, plan.counts, w.w13, w.w2),
                                          repeats=3))

    def _dense(self, tokens: int, dtype: str) -> Outcome:
        """DenseMLP's call (dense layers, shared experts): every token to the one expert, counts on the device."""
        e, w = self.shapes.experts, self._expert_weights(dtype)
        x = self._randn(tokens, e.hidden, dtype=dtype, seed=tokens + 1)
        counts = torch.tensor([tokens], dtype=torch.long, device=self.device)
        w13, w2 = w.w13[:1], w.w2[:1]
        got = self.triton.expert_mlp(x, counts, w13, w2)
        want = self.twin.expert_mlp(x.float(), counts, w.w13_fp32[:1], w.w2_fp32[:1])
        twin_low = self.twin.expert_mlp(x, counts, w13, w2)
        return self._judge("expert_mlp", dtype, got, want, twin_low, tokens=tokens, layout="one expert (DenseMLP)",
                           **self._timing(lambda: self.triton.expert_mlp(x, counts, w13, w2),
                                          lambda: self.twin.expert_mlp(x, counts, w13, w2)))

    def _unpermute(self, tokens: int, dtype: str) -> Outcome:
        e = self.shapes.experts
        weights, ids = self._routing(tokens)
        plan = self.twin.permute_by_expert(ids, e.experts)
        out_sorted = self._randn(plan.num_rows, e.hidden, dtype=dtype, seed=3)
        got = self.triton.unpermute_reduce(out_sorted, plan, weights, tokens)
        want = self.twin.unpermute_reduce(out_sorted.float(), plan, weights, tokens)
        twin_low = self.twin.unpermute_reduce(out_sorted, plan, weights, tokens)
        return self._judge("unpermute_reduce", dtype, got, want, twin_low, tokens=tokens, rows=plan.num_rows,
                           **self._timing(lambda: self.triton.unpermute_reduce(out_sorted, plan, weights, tokens),
                                          lambda: self.twin.unpermute_reduce(out_sorted, plan, weights, tokens)))

    def _masked(self, dtype: str) -> Outcome:
        m, w = self.shapes.masked, self._expert_weights(dtype)
        x, counts = self._masked_inputs(dtype)
        w13, w2 = w.w13[:m.local_experts], w.w2[:m.local_experts]
        got, problems = self._watched(lambda: self.triton.masked_expert_mlp(x, counts, w13, w2), x.numel())
        want = self.twin.masked_expert_mlp(x.float(), counts, w.w13_fp32[:m.local_experts],
                                           w.w2_fp32[:m.local_experts])
        twin_low = self.twin.masked_expert_mlp(x, counts, w13, w2)
        valid = self._valid_rows(counts)
        return self._judge("masked_expert_mlp", dtype, got[valid], want[valid], twin_low[valid], problems,
                           local_experts=m.local_experts, capacity=m.capacity, rows=int(counts.sum()),
                           stale_rows="NaN; output rows past a count undefined, not compared",
                           **self._timing(lambda: self.triton.masked_expert_mlp(x, counts, w13, w2),
                                          lambda: self.twin.masked_expert_mlp(x, counts, w13, w2), repeats=3))

    def _valid_rows(self, counts: torch.Tensor) -> torch.Tensor:
        """[E, M] bool: the masked layout's rows below each expert's count."""
        return torch.arange(self.shapes.masked.capacity, device=self.device)[None, :] < counts[:, None]

    def _watched(self, call, output_elements: int) -> tuple[torch.Tensor, list[str]]:
        """A masked-layout Triton call's result, and a problem for each host read or output-sized fill in it."""
        with HostReadWatch(min_fill_elements=output_elements) as watch:
            got = call()
        return got, ([f"host reads during the call: {watch.host_reads}"] if watch.host_reads else []) + (
            [f"output-sized fills during the call: {watch.fills}"] if watch.fills else [])

    def _masked_inputs(self, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [E, M, H] with NaN in the rows past each count, counts [E]): an idle expert and a full one."""
        m, e = self.shapes.masked, self.shapes.experts
        x = self._randn(m.local_experts, m.capacity, e.hidden, dtype=dtype, seed=4)
        counts = torch.randint(0, m.capacity + 1, (m.local_experts,), generator=torch.Generator().manual_seed(5))
        counts[0], counts[-1] = 0, m.capacity
        for expert, count in enumerate(counts.tolist()):
            x[expert, count:] = float("nan")                           # stale rows, as DeepEP leaves them
        return x, counts.to(self.device)

    def _quantized_expert_mlp(self, fmt: QuantizedFormat, tokens: int, dtype: str, scheme: str) -> Outcome:
        """Experts kept quantized: FP8's Triton grouped GEMM dequantizes per tile (or, `scheme` /fp8_tiles,
        multiplies fp8 tiles), the twin per row chunk; int8 converts each row chunk and scales the output; int4
        decodes each row chunk's codes with its groups' scales and zero points."""
        e, q = self.shapes.experts, self._quantized_expert_weights(fmt, dtype)
        x = self._randn(tokens, e.hidden, dtype=dtype, seed=tokens)
        _, ids = self._routing(tokens)
        plan = self.twin.permute_by_expert(ids, e.experts)
        x_sorted = x[plan.token_index]
        args = (*q.first(e.experts), *fmt.kernel_args)
        triton, twin = fmt.kernel(self.fp8_schemes[scheme], "expert_mlp"), fmt.kernel(self.twin, "expert_mlp")
        got = triton(x_sorted, plan.counts, *args)
        twin_low = twin(x_sorted, plan.counts, *args)
        want, details = self._quantized_reference(fmt, scheme, fp8_reference.fp8_activation_expert_mlp, twin,
                                                  x_sorted, plan.counts, *args)
        return self._judge(f"{fmt.name}_expert_mlp", dtype, got, want, twin_low, tokens=tokens, rows=plan.num_rows,
                           **dict(fmt.details), **details,
                           **self._timing(lambda: triton(x_sorted, plan.counts, *args),
                                          lambda: twin(x_sorted, plan.counts, *args), repeats=3))

    def _quantized_reference(self, fmt: QuantizedFormat, scheme: str, fp8_activation_kernel, twin, x,
                             *args) -> tuple[torch.Tensor, dict]:
        """The reference of a quantized check: the torch twin in fp32, or for /fp8_tiles the float64 math of
        the FP8-activation scheme (activations quantized 1x128 as the kernel does)."""
        if scheme:
            return fp8_activation_kernel(x, *args), {"fp8_scheme": "fp8 activations (1x128) x fp8 weight blocks",
                                                     "reference": "float64, activations quantized as the kernel"}
        return twin(x.float(), *args), {"fp8_scheme": "dequantize"} if fmt is FP8 else {}

    def _quantized_masked(self, fmt: QuantizedFormat, dtype: str, scheme: str) -> Outcome:
        m, q = self.shapes.masked, self._quantized_expert_weights(fmt, dtype)
        x, counts = self._masked_inputs(dtype)
        args = (*q.first(m.local_experts), *fmt.kernel_args)
        triton = fmt.kernel(self.fp8_schemes[scheme], "masked_expert_mlp")
        twin = fmt.kernel(self.twin, "masked_expert_mlp")
        # int8 and int4 have no Triton kernel: the Triton family's is the torch one, whose host reads are not
        # watched here
        got, problems = self._watched(lambda: triton(x, counts, *args), x.numel()) if fmt.triton_kernel else (
            triton(x, counts, *args), [])
        want, details = self._quantized_reference(fmt, scheme, fp8_reference.fp8_activation_masked_expert_mlp, twin,
                                                  x, counts, *args)
        twin_low = twin(x, counts, *args)
        valid = self._valid_rows(counts)
        return self._judge(f"{fmt.name}_masked_expert_mlp", dtype, got[valid], want[valid], twin_low[valid],
                           problems, local_experts=m.local_experts, capacity=m.capacity, rows=int(counts.sum()),
                           **details, **self._timing(lambda: triton(x, counts, *args), lambda: twin(x, counts, *args),
                                                     repeats=3))

    def _quantized_linear(self, fmt: QuantizedFormat, rows: int, dtype: str, scheme: str) -> Outcome:
        """A quantized projection (attention q/k/v/o): one expert's gate/up stack as the weight."""
        e, q = self.shapes.experts, self._quantized_expert_weights(fmt, dtype)
        x = self._randn(rows, e.hidden, dtype=dtype, seed=15)
        args = (q.w13[0], q.w13_scale[0], *fmt.kernel_args)
        triton, twin = fmt.kernel(self.fp8_schemes[scheme], "linear"), fmt.kernel(self.twin, "linear")
        got = triton(x, *args)
        want, details = self._quantized_reference(fmt, scheme, fp8_reference.fp8_activation_linear, twin, x, *args)
        twin_low = twin(x, *args)
        return self._judge(f"{fmt.name}_linear", dtype, got, want, twin_low, rows=rows, **dict(fmt.details),
                           **details, **self._timing(lambda: triton(x, *args), lambda: twin(x, *args)))

    def _rms_norm(self, norm: NormShape, tokens: int, dtype: str, fused: bool) -> Outcome:
        x = self._randn(tokens, norm.hidden, dtype=dtype, seed=6)
        weight = 1.0 + self._randn(norm.hidden, dtype=dtype, seed=7, scale=0.1)
        eps = 1e-6
        if not fused:
            return self._judge("rms_norm", dtype, self.triton.rms_norm(x, weight, eps),
                               self.twin.rms_norm(x, weight, eps), tokens=tokens, hidden=norm.hidden,
                               reference="torch twin in the same dtype (HF rounding)",
                               **self._timing(lambda: self.triton.rms_norm(x, weight, eps),
                                              lambda: self.twin.rms_norm(x, weight, eps), repeats=10))
        residual = self._randn(tokens, norm.hidden, dtype=dtype, seed=8)
        got = self.triton.fused_add_rms_norm(x, residual, weight, eps)
        want = self.twin.fused_add_rms_norm(x, residual, weight, eps)
        problems = [] if torch.equal(got.residual, want.residual) else ["the residual sums differ"]
        return self._judge("fused_add_rms_norm", dtype, got.out, want.out, None, problems, tokens=tokens,
                           hidden=norm.hidden, reference="torch twin in the same dtype (HF rounding)",
                           **self._timing(lambda: self.triton.fused_add_rms_norm(x, residual, weight, eps),
                                          lambda: self.twin.fused_add_rms_norm(x, residual, weight, eps), repeats=10))

    def _attention(self, shape: AttentionShape, dtype: str) -> Outcome:
        lens = list(self.shapes.context_lens)
        bs = shape.block_size
        needed = [(n + bs - 1) // bs for n in lens]
        num_blocks = sum(needed) + 2
        k_cache = self._randn(num_blocks, bs, shape.kv_heads, shape.head_dim, dtype=dtype, seed=9)
        v_cache = k_cache[..., :shape.v_dim] if shape.shared_kv else self._randn(
            num_blocks, bs, shape.kv_heads, shape.v_dim, dtype=dtype, seed=10)
        free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(11)).tolist()
        tables = torch.full((len(lens), max(needed) + 1), -1, dtype=torch.int32)
        for seq, need in enumerate(needed):
            tables[seq, :need] = torch.tensor([free.pop() for _ in range(need)], dtype=torch.int32)
        tables = tables.to(self.device)
        context_lens = torch.tensor(lens, dtype=torch.int32, device=self.device)
        q = self._randn(len(lens), shape.q_heads, shape.head_dim, dtype=dtype, seed=12)
        # MLA (DeepSeek): softmax scale from qk_head_dim = nope 128 + rope 64, not from the 576-dim latent.
        scale = (192 if shape.shared_kv and shape.head_dim == 576 else shape.head_dim) ** -0.5
        k32 = k_cache.float()
        v32 = k32[..., :shape.v_dim] if shape.shared_kv else v_cache.float()
        got = self.triton.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale)
        want = self.twin.paged_decode_attention(q.float(), k32, v32, tables, context_lens, scale)
        twin_low = self.twin.paged_decode_attention(q, k_cache, v_cache, tables, context_lens, scale)
        return self._judge("paged_decode_attention", dtype, got, want, twin_low, q_heads=shape.q_heads,
                           kv_heads=shape.kv_heads, head_dim=shape.head_dim, v_dim=shape.v_dim, block_size=bs,
                           shared_kv=shape.shared_kv, batch=len(lens), max_context=max(lens),
                           **self._timing(
                               lambda: self.triton.paged_decode_attention(q, k_cache, v_cache, tables, context_lens,
                                                                          scale),
                               lambda: self.twin.paged_decode_attention(q, k_cache, v_cache, tables, context_lens,
                                                                        scale)))

    def _pair_experts(self, tokens: int, dtype: str) -> Outcome:
        """The captured step's routed experts (one GEMV per (token, expert) pair) against fused_moe in fp32."""
        e, w = self.shapes.experts, self._expert_weights(dtype)
        x = self._randn(tokens, e.hidden, dtype=dtype, seed=tokens + 7)
        weights, ids = self._routing(tokens)
        got = self.triton.pair_expert_mlp(x, ids, weights, w.w13, w.w2)
        want = self.twin.fused_moe(x.float(), w.w13_fp32, w.w2_fp32, weights, ids)
        twin_low = self.twin.fused_moe(x, w.w13, w.w2, weights, ids)
        problems = [] if got.dtype == x.dtype else [f"output dtype {got.dtype}, expected {x.dtype}"]
        return self._judge("pair_expert_mlp", dtype, got, want, twin_low, problems, tokens=tokens, top_k=e.top_k,
                           reference="fused_moe of the twin family, fp32 and in the same dtype")

    def _family_linear_rows(self, rows: int, dtype: str) -> Outcome:
        """The family's few-row projection (`KernelSet.linear_rows`) against F.linear in fp32."""
        e, w = self.shapes.experts, self._expert_weights(dtype)
        x = self._randn(rows, e.hidden, dtype=dtype, seed=rows + 21)
        weight = w.w13[0]
        got = self.triton.linear_rows(x, weight)
        want, twin_low = F.linear(x.float(), weight.float()), F.linear(x, weight)
        return self._judge("linear_rows", dtype, got, want, twin_low, rows=rows,
                           reference="F.linear, fp32 and in the same dtype")

    def _skinny(self, rows: int, dtype: str, batched: bool) -> Outcome:
        """No Triton twin: the CPU fast path must give F.linear's answer on any device and dtype."""
        e, w = self.shapes.experts, self._expert_weights(dtype)
        if batched:
            experts = min(self.shapes.masked.local_experts, e.experts)
            x = self._randn(experts, rows, e.hidden, dtype=dtype, seed=13)
            weight = w.w13[:experts]
            got, want = batched_linear_rows(x, weight), torch.bmm(x, weight.transpose(1, 2))
        else:
            x = self._randn(rows, e.hidden, dtype=dtype, seed=14)
            weight = w.w13[0]
            got, want = linear_rows(x, weight), F.linear(x, weight)
        return self._judge("skinny_matmul", dtype, got, want, rows=rows, batched=batched,
                           reference="F.linear / torch.bmm in the same dtype")

