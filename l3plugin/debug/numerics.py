"""Bitwise numerics parity (paper section 6.2): tell implementation bugs from accumulation order.

A parallel run cannot match a plain sequential run bit for bit: floating-point addition is not
associative, and parallelism splits sums into chunks reduced in another order. So compare it instead
with a reference that *accumulates in the same order* (same microbatches, same order of gradient
accumulation, same reduction tree). Then any difference, even one ulp, is a bug, and the report names
the first tensor that diverged (in module/parameter order), by how much, and at which step. Once the
implementation is right, ``accumulation_error`` / ``relative_error_vs_fp64`` measure the remaining
gap against an fp64 reference, which is how the paper chose the buffers that need fp32 accumulation
(the DP gradient reduce-scatter and PP's microbatch gradient accumulation).

How to run it on your own model
-------------------------------
1. Make the run deterministic: same initial weights and data, dropout off, ``torch.use_deterministic_
   algorithms(True)``, TF32 off (``torch.backends.cuda.matmul.allow_tf32 = False``).
2. Parallel run: after the backward of step ``k``, collect ``grads_snapshot(model, loss)`` (loss first,
   then ``<param>.grad`` in ``named_parameters`` order) on every rank and assemble full tensors on
   one rank (TP shards: ``torch.cat`` along the partitioned dim; ZeRO: gather the flat buffer and
   unflatten; PP: merge the stages' dicts in layer order).
3. Same-order reference, on one process, e.g. for a pipeline with 4 microbatches::

       ref = copy.deepcopy(initial_model)          # the weights the parallel run started from
       total = torch.zeros(())
       for mb in microbatches:                     # the order the schedule ran their backward
           loss = loss_fn(ref(mb["x"]), mb["y"]) / len(microbatches)
           loss.backward()                         # param.grad += microbatch grad, as PP accumulates
           total = total + loss.detach()           # the pipeline's loss sum, same order
       expected = grads_snapshot(ref, total)
       assert_bitwise_equal(actual, expected, step=k)   # or compare_bitwise(...) for a report

   Keep in the reference the splits you cannot replay serially and remove only the one under test: the
   paper checks PP against a DP x TP run with the same microbatching, because TP's row-parallel GEMMs
   sum partial products across ranks. With DP, the reference sums the per-replica gradients in the
   reduction's order (for two replicas ``a + b`` is exact in either order; for more, replay the ring).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Mismatch:
    name: str
    kind: str                        # "value", "dtype", "shape", "missing" or "unexpected"
    detail: str
    count: int = 0                   # elements whose bits differ
    numel: int = 0
    first_index: tuple = ()
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    max_ulp: float = 0.0


@dataclass
class ParityReport:
    equal: bool
    step: int | None
    compared: int                    # tensors compared
    first: Mismatch | None = None    # the first diverging tensor, in the reference's order
    mismatched: list = field(default_factory=list)  # names of every diverging tensor, same order

    def __str__(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        if self.equal:
            return f"bitwise equal{at}: {self.compared} tensors"
        m = self.first
        head = (f"bitwise mismatch{at}: first diverging tensor {m.name!r} ({len(self.mismatched)} of "
                f"{self.compared} tensors differ: {', '.join(self.mismatched[:8])}"
                + (", ..." if len(self.mismatched) > 8 else "") + ")")
        if m.kind != "value":
            return f"{head}\n  {m.detail}"
        return (f"{head}\n  {m.count} of {m.numel} elements differ, first at index {m.first_index}: {m.detail}"
                f"\n  max abs diff {m.max_abs_diff:.6g}, max rel diff {m.max_rel_diff:.6g}, "
                f"max {m.max_ulp:.6g} ulp")


def _as_tensor(x) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    return t.detach().cpu()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that -0.0 != 0.0 and a NaN equals the same NaN, as "bit for bit" means."""
    t = t.contiguous()
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    if t.is_floating_point():
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """Sign-magnitude float bits -> integers in the floats' order, so their difference counts ulps."""
    x = bits.to(torch.int64)
    width = bits.element_size() * 8
    magnitude = x & ((1 << (width - 1)) - 1)
    return torch.where(x < 0, -magnitude, magnitude)


def _ulp_distance(bits_a: torch.Tensor, bits_b: torch.Tensor) -> torch.Tensor:
    oa, ob = _ordered(bits_a), _ordered(bits_b)
    # Same sign: the exact integer difference (fits in int64). Opposite signs: it may not, and such a
    # distance is astronomically large anyway, so a float sum is precise enough.
    same_sign = (oa >= 0) == (ob >= 0)
    return torch.where(same_sign, (oa - ob).abs().double(), oa.double().abs() + ob.double().abs())


def _compare_one(name: str, a: torch.Tensor, b: torch.Tensor) -> Mismatch | None:
    if a.dtype != b.dtype:
        return Mismatch(name, "dtype", f"dtype {a.dtype} vs expected {b.dtype}")
    if a.shape != b.shape:
        return Mismatch(name, "shape", f"shape {tuple(a.shape)} vs expected {tuple(b.shape)}")
    bits_a, bits_b = _bits(a), _bits(b)
    differ = bits_a != bits_b
    count = int(differ.sum())
    if count == 0:
        return None
    flat = differ.reshape(-1)
    first = int(flat.nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), differ.shape)) if differ.dim() else ()
    va, vb = a.reshape(-1)[first].item(), b.reshape(-1)[first].item()
    m = Mismatch(name, "value", f"actual {va!r} vs expected {vb!r}", count, differ.numel(), index)
    if a.is_floating_point() and not a.is_complex():
        sa, sb = a.reshape(-1)[flat].double(), b.reshape(-1)[flat].double()
        diff = (sa - sb).abs()
        m.max_abs_diff = float(diff.max())
        m.max_rel_diff = float((diff / sb.abs()).max())  # inf where the reference is 0
        m.max_ulp = float(_ulp_distance(bits_a.reshape(-1)[flat], bits_b.reshape(-1)[flat]).max())
    return m


def compare_bitwise(actual: Mapping, expected: Mapping, *, step: int | None = None) -> ParityReport:
    """Compare two ``name -> tensor`` dicts bit for bit (the loss can be one of the entries).

    Order: the reference (``expected``) dict's order, then names only ``actual`` has. Values may be
    tensors on any device or Python numbers.
    """
    names = list(expected) + [n for n in actual if n not in expected]
    mismatches = []
    for name in names:
        if name not in actual:
            mismatches.append(Mismatch(name, "missing", "present in the reference, missing in the run"))
        elif name not in expected:
            mismatches.append(Mismatch(name, "unexpected", "present in the run, missing in the reference"))
        else:
            m = _compare_one(name, _as_tensor(actual[name]), _as_tensor(expected[name]))
            if m is not None:
                mismatches.append(m)
    return ParityReport(equal=not mismatches, step=step, compared=len(names),
                        first=mismatches[0] if mismatches else None, mismatched=[m.name for m in mismatches])


def assert_bitwise_equal(actual: Mapping, expected: Mapping, *, step: int | None = None) -> None:
    """pytest helper: raise AssertionError with the parity report unless every tensor matches bitwise."""
    report = compare_bitwise(actual, expected, step=step)
    if not report.equal:
        raise AssertionError(str(report))


def grads_snapshot(model: torch.nn.Module, loss=None) -> dict:
    """``{"loss": loss, "<param>.grad": grad, ...}`` copied, in ``named_parameters`` (module) order.

    Parameters without a gradient are left out.
    """
    out = {}
    if loss is not None:
        out["loss"] = _as_tensor(loss).clone()
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[f"{name}.grad"] = p.grad.detach().cpu().clone()
    return out


def relative_error_vs_fp64(value, reference) -> float:
    """``||value - reference|| / ||reference||`` computed in fp64 (reference: an fp64 computation)."""
    v, r = _as_tensor(value).double(), _as_tensor(reference).double()
    if v.shape != r.shape:
        raise ValueError(f"shape {tuple(v.shape)} vs reference {tuple(r.shape)}")
    denom = torch.linalg.vector_norm(r)
    err = torch.linalg.vector_norm(v - r)
    if denom == 0:
        return 0.0 if err == 0 else float("inf")
    return float(err / denom)


def accumulation_error(parts, accum_dtype: torch.dtype) -> float:
    """Relative error of summing ``parts`` one by one in ``accum_dtype``, against their fp64 sum.

    ``parts`` are e.g. the per-microbatch gradients of one buffer (PP accumulation) or the per-rank
    contributions of a reduce-scatter (DP). Compare ``torch.bfloat16`` with ``torch.float32`` to see
    which buffers need fp32 accumulation.
    """
    parts = [_as_tensor(p) for p in parts]
    if not parts:
        raise ValueError("accumulation_error needs at least one part")
    acc = torch.zeros(parts[0].shape, dtype=accum_dtype)
    exact = torch.zeros(parts[0].shape, dtype=torch.float64)
    for p in parts:
        acc = acc + p.to(accum_dtype)
        exact = exact + p.double()
    return relative_error_vs_fp64(acc, exact)


def accumulation_error_table(named_parts: Mapping, dtypes=(torch.bfloat16, torch.float32)) -> list:
    """One row per buffer: ``{"name": ..., "bfloat16": err, "float32": err}``, worst bf16 first."""
    rows = [{"name": name, **{str(d).replace("torch.", ""): accumulation_error(parts, d) for d in dtypes}}
            for name, parts in named_parts.items()]
    first = str(dtypes[0]).replace("torch.", "")
    return sorted(rows, key=lambda r: -r[first])
