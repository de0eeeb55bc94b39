"""How many transformer layers each virtual pipeline stage holds (even, or fewer on the ends).

The paper (section 3.1) puts one layer fewer on the first and last stages, which also carry the
embedding and the output layer, to balance compute and memory. The schedule itself treats chunks as
opaque; this helper only decides the split and rejects ones that cannot be made.
"""

from __future__ import annotations

from l3plugin.arguments.checks import check_int


def layers_per_virtual_stage(num_layers: int, pp_size: int, vpp_size: int = 1, *,
                             first_stage: int | None = None, last_stage: int | None = None) -> list[int]:
    """Layer counts of virtual stages 0..pp*vpp-1 (stage s lives on rank s % pp, chunk s // pp).

    Without ``first_stage``/``last_stage`` the split is even and ``num_layers`` must be divisible by
    pp*vpp. With them, the first/last virtual stage get those counts and the rest are split evenly.
    """
    for name, value in (("num_layers", num_layers), ("pp_size", pp_size), ("vpp_size", vpp_size)):
        check_int(name, value)
    stages = pp_size * vpp_size
    ends = {0: first_stage, stages - 1: last_stage}
    for name, value in (("first_stage", first_stage), ("last_stage", last_stage)):
        if value is not None:
            check_int(name, value, 0, num_layers, "num_layers")
    if stages == 1:
        if first_stage not in (None, num_layers) or last_stage not in (None, num_layers):
            raise ValueError(f"with a single stage it holds all num_layers={num_layers} layers")
        return [num_layers]
    fixed = {s: n for s, n in ends.items() if n is not None}
    middle = stages - len(fixed)
    rest = num_layers - sum(fixed.values())
    if middle == 0:
        if rest != 0:
            raise ValueError(f"first_stage + last_stage = {sum(fixed.values())} must equal "
                             f"num_layers={num_layers} when there are only 2 virtual stages")
        return [fixed[0], fixed[1]]
    if rest < 0 or rest % middle:
        what = "num_layers" if not fixed else "num_layers - first_stage - last_stage"
        raise ValueError(
            f"{what} = {rest} is not divisible by the {middle} remaining virtual stages "
            f"(pp_size={pp_size} x vpp_size={vpp_size}); choose num_layers, vpp_size or "
            f"first_stage/last_stage so that it is")
    return [fixed.get(s, rest // middle) for s in range(stages)]


def layer_ranges(counts: list[int]) -> list[range]:
    """Global layer ids of each virtual stage, from its layer count."""
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out
