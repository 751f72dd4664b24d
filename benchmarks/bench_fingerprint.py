"""What the fingerprint of the loaded weights costs beside the model load (a script, not a test).

Loads SmolLM2-135M-Instruct (the ``smollm2-135m-instruct`` alias, float32 on the CPU) as
``layerdiv extract`` does, ``--repeat`` times in this process, and prints for each load the CPU
and wall seconds of the load and of :func:`layerdiv.extract.facts.weights_hash` over the loaded
tensors, and the ratio of their CPU times (the fairest figure on a shared machine); the verdict
is against the target: at most 5% of a model load.

    python benchmarks/bench_fingerprint.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

from common import add_quick

TARGET = 0.05


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        args.repeat = 1
    import torch

    from layerdiv.extract.facts import weights_hash
    from layerdiv.extract.models import load_model, load_tokenizer, resolve_source

    source = resolve_source("smollm2-135m-instruct", None, None, False)
    tokenizer = load_tokenizer(source)
    ratios = []
    for i in range(args.repeat):
        cpu, wall = time.process_time(), time.perf_counter()
        loaded = load_model(source, tokenizer, torch.device("cpu"), torch.float32)
        load_cpu, load_wall = time.process_time() - cpu, time.perf_counter() - wall
        cpu, wall = time.process_time(), time.perf_counter()
        digest = weights_hash(loaded.model)
        hash_cpu, hash_wall = time.process_time() - cpu, time.perf_counter() - wall
        ratios.append(hash_cpu / load_cpu)
        n_bytes = sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values())
        share = 100 * ratios[-1]
        print(f"load {i + 1}: model {load_cpu:.2f} s CPU ({load_wall:.2f} s wall); "
              f"fingerprint {digest[:12]} of {n_bytes / 1e6:.0f} MB: {hash_cpu:.3f} s CPU "
              f"({hash_wall:.3f} s wall), {share:.1f}% of the load's CPU time")  # fmt: skip
        del loaded
    worst = max(ratios)
    verdict = "met" if worst <= TARGET else "missed"
    print(f"target: the fingerprint at most {100 * TARGET:.0f}% of a model load: {verdict} "
          f"(worst {100 * worst:.1f}%)")  # fmt: skip


if __name__ == "__main__":
    main()
