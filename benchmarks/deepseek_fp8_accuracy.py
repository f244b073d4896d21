"""Accuracy of FP8-resident weights (e4m3 + 128x128 block scales, dequantised inside the step) against the
same checkpoint dequantised to bf16 on load, and both against the unquantised model (CPU, xla backend).

    python -m benchmarks.deepseek_fp8_accuracy --preset small --json /tmp/fp8_acc.json

Writes a random model of the preset (std --std), saves it as DeepSeek's FP8 release
format, loads it (a) FP8-resident and (b) dequantised to bf16, and compares logits over random prompts:
relative L2 error, max abs error over the logit range, top-1 agreement, and greedy generations."""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--len", type=int, default=64)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="std of the random weights")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from tokenspeed_jax.models.deepseek import DeepseekV3, DeepseekV3Config, Engine, load_checkpoint, save_checkpoint

    cfg = DeepseekV3Config.preset(args.preset)
    orig = DeepseekV3.random(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, std=args.std, seed=args.seed)
    rng = np.random.default_rng(args.seed + 1)
    prompts = [rng.integers(0, cfg.vocab_size, args.len).tolist() for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(orig, d, fp8=True)
        fp8 = load_checkpoint(d, dtype=jnp.bfloat16, progress=False)
        deq = load_checkpoint(d, dtype=jnp.bfloat16, progress=False, fp8_weights=False)
    res = {"preset": args.preset, "std": args.std, "prompts": args.prompts, "prompt_len": args.len, "pairs": {}}
    logits = {}
    for name, m in (("fp8_resident", fp8), ("dequantised_bf16", deq), ("unquantised", orig)):
        logits[name] = np.stack([np.asarray(m.logits(p)) for p in prompts])
    for a, b in (("fp8_resident", "dequantised_bf16"), ("fp8_resident", "unquantised"),
                 ("dequantised_bf16", "unquantised")):
        x, y = logits[a], logits[b]
        res["pairs"][f"{a} vs {b}"] = {
            "rel_l2": float(np.linalg.norm(x - y) / np.linalg.norm(y)),
            "max_abs_over_range": float(np.abs(x - y).max() / (y.max() - y.min())),
            "top1_agreement": float((x.argmax(-1) == y.argmax(-1)).mean()),
            "bitwise_equal": bool(np.array_equal(x, y)),
        }
    gens = {n: Engine(m, backend="xla").generate(prompts, args.new).tokens for n, m in
            (("fp8_resident", fp8), ("dequantised_bf16", deq))}
    res["greedy_equal_fp8_vs_dequantised"] = gens["fp8_resident"] == gens["dequantised_bf16"]
    res["weights_bytes"] = {
        n: int(sum(v.get_value().nbytes for _, v in __import__("flax").nnx.to_flat_state(
            __import__("flax").nnx.state(m, __import__("flax").nnx.Param))))
        for n, m in (("fp8_resident", fp8), ("dequantised_bf16", deq))
    }
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    res.update(commit=commit, command=" ".join(sys.argv), date=datetime.datetime.now(datetime.UTC).isoformat(),
               device=str(jax.devices()[0]))
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
