"""FP8 block-quantised matmul forms under XLA on one GPU: which one reads the e4m3 weight once?

    source .device/bootstrap.sh && python -m benchmarks.fp8_matmul_forms $OUT/fp8_matmul_forms.json

``y = x @ (w * scale_inv per 128 x 128 block)`` for ``x [M, in]`` bf16 and ``w [in, out]`` e4m3 on R1's shapes
(q_b_proj, o_proj, the dense MLP's gate+up and down), ``M`` = 1 / 16 / 64, each form jitted alone and timed
(median of 5 x 50 back-to-back calls; µs, the weight's bytes / time, the error relative to the float32 product
with the dequantised weight, and the fusion kinds of the compiled HLO):

* ``current``: ``models.deepseek.layers.dequantize`` (repeat the scales, multiply in float32, cast) then the dot;
* ``bcast_bf16`` / ``bcast_f32``: the scale broadcast over a ``[in/128, 128, out/128, 128]`` view, in bf16 / f32;
* ``convert_only``: the e4m3 weight cast to bf16 without its scales (what a fused cast costs; wrong numbers);
* ``kblock``: float32 partial products per 128-row input block, scaled and summed (``layers.fp8_block_matmul``);
* ``bf16_weights``: the dot with a bf16 weight (the reference speed).

Results of the run this module was written for: ``benchmarks/results/fp8_matmul_forms_h200.json``
(``docs/model.md``, "FP8 weights in the decode step")."""
import json, re, subprocess, sys, time
import jax, jax.numpy as jnp, numpy as np
from tokenspeed_jax.models.deepseek.layers import dequantize, fp8_block_matmul

SHAPES = {"q_b_proj": (1536, 24576), "o_proj": (16384, 7168), "gate_up": (7168, 36864), "down": (18432, 7168)}


def f_cur(x, w, s):
    return x @ dequantize(w, s, jnp.bfloat16)


def f_bcast(x, w, s):
    K, N = w.shape
    wd = (w.reshape(K // 128, 128, N // 128, 128).astype(jnp.bfloat16)
          * s.astype(jnp.bfloat16)[:, None, :, None]).reshape(K, N)
    return x @ wd


def f_bcast32(x, w, s):
    K, N = w.shape
    wd = (w.reshape(K // 128, 128, N // 128, 128).astype(jnp.float32) * s[:, None, :, None]).reshape(K, N)
    return x @ wd.astype(jnp.bfloat16)


def f_conv(x, w, s):
    return x @ w.astype(jnp.bfloat16)


def f_kblock(x, w, s):  # per k-block float32 partial products, scaled, summed: the model's decode form
    return fp8_block_matmul(x, w, s, jnp.bfloat16)


def f_bf16(x, wb, s):
    return x @ wb


FORMS = {"current": f_cur, "bcast_bf16": f_bcast, "bcast_f32": f_bcast32, "convert_only": f_conv,
         "kblock": f_kblock, "bf16_weights": f_bf16}


def timeit(f, *a, n=50):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            o = f(*a)
        jax.block_until_ready(o)
        ts.append((time.perf_counter() - t) / n * 1e6)
    return float(np.median(ts))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/fp8_matmul_forms.json"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"jax": jax.__version__, "device": str(jax.devices()[0]),
           "command": " ".join(["python -m benchmarks.fp8_matmul_forms"] + sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit, "rows": []}
    key = jax.random.PRNGKey(0)
    for name, (K, N) in SHAPES.items():
        w32 = jax.random.normal(key, (K, N), jnp.float32) * 0.05
        w8 = w32.astype(jnp.float8_e4m3fn)
        s = jnp.exp(jax.random.normal(key, (K // 128, N // 128), jnp.float32) * 0.1)
        wb = dequantize(w8, s, jnp.bfloat16)
        for M in (1, 16, 64):
            x = jax.random.normal(key, (M, K), jnp.bfloat16)
            ref = np.asarray((x.astype(jnp.float32) @ wb.astype(jnp.float32)))
            for fname, f in FORMS.items():
                jf = jax.jit(f)
                args = (x, wb if fname == "bf16_weights" else w8, s)
                try:
                    comp = jf.lower(*args).compile()
                    txt = comp.as_text()
                    kinds = sorted(set(re.findall(r"kind=(k\w+)", txt)))
                    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', txt)))
                    fus = re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*? fusion\(", txt, re.M)
                    us = timeit(jf, *args)
                    err = float(np.max(np.abs(np.asarray(jf(*args), np.float32) - ref)) / (np.max(np.abs(ref)) + 1e-9))
                    wbytes = K * N * (2 if fname == "bf16_weights" else 1)
                    row = {"shape": name, "M": M, "form": fname, "us": round(us, 1),
                           "weight_TBps": round(wbytes / us / 1e6, 3), "rel_err": err, "fusion_kinds": kinds,
                           "custom_calls": calls, "fusions": fus[:12]}
                except Exception as e:  # noqa: BLE001
                    row = {"shape": name, "M": M, "form": fname, "error": repr(e)[:400]}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                if name == "gate_up" and M == 64:
                    open(out.replace(".json", f"_{fname}.hlo.txt"), "w").write(txt)
            json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
