"""Reading lowered programs in tests: where the sm90 decode schedule is computed.

:func:`schedule_sites` walks a lowered module's StableHLO (the MLIR operations, through ``func.call`` into
private functions) and returns, for every computation of the schedule, how many ``stablehlo.while`` bodies
enclose it: ``[0]`` is one schedule computed once per call of the program, outside every loop; a schedule
computed inside a ``lax.scan`` over layers shows up once per scan body, at depth >= 1.

A computation is recognised by the schedule's output table ``cta [num_ctas, 8]`` int32, the one value of that
type among the operations named under :data:`tokenspeed_jax.decode_schedule.SCOPE` (``decode_schedule`` runs
under that name scope), less the ``stablehlo.case`` of its ``jax.lax.platform_dependent`` (the jnp ops or the CUDA
kernel's call inside it are the computation).
"""

from __future__ import annotations

from tokenspeed_jax.decode_schedule import SCOPE


def _functions(module) -> dict:
    return {str(f.attributes["sym_name"]).strip('"'): f for f in module.body.operations}


def schedule_sites(lowered, num_ctas: int) -> list[int]:
    """Per schedule computation of ``lowered`` (a ``jax.stages.Lowered``), the number of enclosing while loops."""
    module = lowered.compiler_ir("stablehlo")
    marker = f"tensor<{num_ctas}x8xi32>"
    info = {}
    for name, fn in _functions(module).items():
        marks, calls = [], []

        def walk(op, depth):
            for region in op.regions:
                for block in region.blocks:
                    for o in block.operations:
                        kind = o.operation.name
                        if kind == "func.call":
                            calls.append((str(o.attributes["callee"]).lstrip("@"), depth))
                        elif (kind != "stablehlo.case" and SCOPE in str(o.location)
                              and any(str(r.type) == marker for r in o.results)):
                            marks.append(depth)
                        walk(o.operation, depth + (kind == "stablehlo.while"))

        walk(fn, 0)
        info[name] = (marks, calls)

    def sites(name, base):
        marks, calls = info[name]
        out = [base + d for d in marks]
        for callee, d in calls:
            out += sites(callee, base + d)
        return out

    return sorted(sites("main", 0))
