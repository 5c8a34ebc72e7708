"""What `parallelize`'s verification costs: seconds per call at tp=2 for verify=False, True and
"model", HF Llama at three sizes (the median of 3 calls each, every rank timed from a barrier).

    python -m bench.bench_parallelize_cost [--sizes 32x2,256x4,512x8]

CPU-only timing of a one-off setup cost (nothing here is a per-step number).
"""

import argparse
import copy
import statistics
import time

import overlap  # noqa: F401  (before transformers: sets TRITON_INTERPRET on CPU)
from bench.runner import apply_sharing_flag, sharing_flag
from overlap.dist.launch import launch


def _body(hidden: int, layers: int) -> dict:
    import torch
    import torch.distributed as dist
    import transformers as T

    from overlap.nn import parallelize
    from overlap.tp import TPComm

    torch.manual_seed(0)
    ref = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=64))
    params = sum(p.numel() for p in ref.parameters())
    out = {"params": params}
    comm = TPComm(dist.group.WORLD, backend="chunked")
    for mode in (False, True, "model"):
        times = []
        for _ in range(3):
            model = copy.deepcopy(ref)
            dist.barrier()
            t0 = time.perf_counter()
            parallelize(model, comm=comm, verify=mode)
            times.append(time.perf_counter() - t0)
        out[f"verify={mode}"] = statistics.median(times)
    comm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="32x2,256x4,512x8",
                    help="hidden x layers, comma-separated (default: %(default)s)")
    sharing_flag(ap)
    args = ap.parse_args()
    apply_sharing_flag(ap, vars(args))
    print("| hidden | layers | params | verify=False s | verify=True s | verify='model' s |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        hidden, layers = (int(v) for v in size.split("x"))
        r = launch(_body, 2, args=(hidden, layers), timeout=900)[0]
        print(f"| {hidden} | {layers} | {r['params']:,} | {r['verify=False']:.3f} | "
              f"{r['verify=True']:.3f} | {r['verify=model']:.3f} |")


if __name__ == "__main__":
    main()
