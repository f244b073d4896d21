"""SM clock and power while our decode and FlashMLA each run back to back (one device call, carry [".device"]):

    source .device/bootstrap.sh && python scripts/clock_probe.py --cases 64,81920,64,16,1 --dtype bfloat16

For each case and contender (ours, FlashMLA), launches calls back to back for ``--secs`` seconds while a thread
polls ``nvidia-smi`` (SM clock, memory clock, power, temperature, clock-throttle reasons) every 100 ms; prints and
writes (``--out``) the median µs per call and the median / min polled values per contender.  Contenders alternate
twice (A B A B) so a drift of the machine shows.  Never changes a clock or setting: it only reads them.
"""
import argparse
import json
import os
import statistics
import subprocess
import threading
import time


def poll(stop, rows):
    q = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    while not stop.is_set():
        p = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"], capture_output=True,
                           text=True, check=False)
        if p.returncode == 0:
            rows.append([x.strip() for x in p.stdout.strip().split(",")])
        time.sleep(0.1)


def probe_case(spec: str, secs: float, res: list) -> None:
    """Both contenders on one case, two rounds (module docstring); rows appended to ``res``."""
    import flash_mla as fm
    import jax
    import torch

    from benchmarks.decode import bench_case, bench_inputs, decode_fn

    c = bench_case(*(int(x) for x in spec.split(",")))
    q, kv, bt, sl, scale = bench_inputs(c)
    ours = decode_fn(c, "sm90")
    jax.block_until_ready(ours(q, kv, bt, sl, scale))
    tq, tk = torch.from_dlpack(q), torch.from_dlpack(kv).view(c.num_pages, c.page, 1, 576)
    tbt, tsl = torch.from_dlpack(bt), torch.from_dlpack(sl)
    sched, _ = fm.get_mla_metadata()

    def flash():
        return fm.flash_mla_with_kvcache(tq, tk, tbt, tsl, 512, sched, None, softmax_scale=576 ** -0.5,
                                         causal=True)

    def sync_ours(o):
        jax.block_until_ready(o)

    def sync_flash(o):
        torch.cuda.synchronize()

    flash()
    torch.cuda.synchronize()
    for rnd in range(2):
        for name, fn, sync in (("ours", lambda: ours(q, kv, bt, sl, scale), sync_ours),
                               ("FlashMLA", flash, sync_flash)):
            rows, stop = [], threading.Event()
            th = threading.Thread(target=poll, args=(stop, rows))
            th.start()
            t0, n, out = time.perf_counter(), 0, None
            while time.perf_counter() - t0 < secs:
                for _ in range(20):
                    out = fn()
                n += 20
                sync(out)
            dt = (time.perf_counter() - t0) / n * 1e6
            stop.set()
            th.join()
            sm = [float(r[0]) for r in rows[3:] if r[0].replace(".", "").isdigit()]  # (the first polls: ramp-up)
            pw = [float(r[2]) for r in rows[3:] if r[2].replace(".", "").isdigit()]
            r = {"case": c.name, "round": rnd, "contender": name, "us_per_call": round(dt, 1),
                 "sm_mhz_median": statistics.median(sm) if sm else None, "sm_mhz_min": min(sm) if sm else None,
                 "power_w_median": statistics.median(pw) if pw else None,
                 "throttle_reasons": sorted({r[4] for r in rows[3:] if len(r) > 4}), "polls": len(rows)}
            print(json.dumps(r), flush=True)
            res.append(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["64,81920,64,16,1"])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16",))
    ap.add_argument("--secs", type=float, default=3.0)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "clock_probe.json"))
    a = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from benchmarks.harness import provenance

    res = []
    for spec in a.cases:
        probe_case(spec, a.secs, res)
    with open(a.out, "w") as fh:
        json.dump({**provenance(), "rows": res}, fh, indent=1)


if __name__ == "__main__":
    main()
