"""SM clock and power while our decode and FlashMLA each run back to back (one device call, carry [".device"]):

    source .device/bootstrap.sh && python scripts/clock_probe.py --cases 64,81920,64,16,1 --dtype bfloat16
    python scripts/clock_probe.py --ours - seesaw      # two builds of ours beside FlashMLA

``--ours`` takes kernel configs, names of ``tokenspeed_jax.backends.sm90_decode.CONFIGS`` (``-``: the one
``select_config`` picks); each is one contender ``ours[NAME]``.
Times every contender with :func:`benchmarks.harness.sustained`: back to back for ``--secs`` seconds each, twice
(A B C A B C, the order rotated), the µs per call over the second half of each window, while ``nvidia-smi`` is polled
(SM clock, power, clock-throttle reasons; read only, nothing is changed).  Prints and writes (``--out``) one row per
case and contender.
"""
import argparse
import json
import os


def probe_case(spec: str, secs: float, res: list, ours_sets=("-",)) -> None:
    """The contenders (ours per config of ``ours_sets``, FlashMLA) on one case (module docstring); rows appended to
    ``res``."""
    import flash_mla as fm
    import jax
    import torch

    from benchmarks.decode import bench_case, bench_inputs, decode_fn
    from benchmarks.harness import sustained

    c = bench_case(*(int(x) for x in spec.split(",")))
    q, kv, bt, sl, scale = bench_inputs(c)
    fns = {}
    for sw in ours_sets:
        f = decode_fn(c, "sm90", None if sw == "-" else sw)
        jax.block_until_ready(f(q, kv, bt, sl, scale))
        fns["ours" if sw == "-" else f"ours[{sw}]"] = lambda f=f: f(q, kv, bt, sl, scale)
    tq, tk = torch.from_dlpack(q), torch.from_dlpack(kv).view(c.num_pages, c.page, 1, 576)
    tbt, tsl = torch.from_dlpack(bt), torch.from_dlpack(sl)
    sched, _ = fm.get_mla_metadata()
    fns["FlashMLA"] = lambda: fm.flash_mla_with_kvcache(tq, tk, tbt, tsl, 512, sched, None,
                                                        softmax_scale=576 ** -0.5, causal=True)
    for name, r in sustained(fns, secs).items():
        row = {"case": c.name, "contender": name, **r}
        print(json.dumps(row), flush=True)
        res.append(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["64,81920,64,16,1"])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16",))
    ap.add_argument("--secs", type=float, default=3.0)
    ap.add_argument("--ours", nargs="+", default=["-"], help="kernel configs, one contender each (module docstring)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "clock_probe.json"))
    a = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from benchmarks.harness import provenance

    res = []
    for spec in a.cases:
        probe_case(spec, a.secs, res, a.ours)
    with open(a.out, "w") as fh:
        json.dump({**provenance(), "rows": res}, fh, indent=1)


if __name__ == "__main__":
    main()
