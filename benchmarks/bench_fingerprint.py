"""What the fingerprint of the loaded weights costs beside the model load (a script, not a test).

Loads SmolLM2-135M-Instruct (the ``smollm2-135m-instruct`` alias, float32 on the CPU, from its
safetensors conversion in the user cache) as ``layerdiv extract`` does, ``--repeat`` times in
this process, and prints for each load the CPU and wall seconds of the load, of hashing the
loaded tensors (:func:`layerdiv.extract.facts.weights_hash`: what a first load of these files
costs) and of the fingerprint as ``extract`` takes it
(:func:`layerdiv.extract.facts.cached_weights_hash`: reused from the user cache once the files
were hashed, their names, sizes, times and first and last MiB checked), with their shares of the
load's CPU time (the fairest figure on a shared machine). The verdict is against the target: at
most 5% of a model load, on a reload.

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
        args.repeat = 2
    import torch

    from layerdiv.extract.facts import cached_weights_hash, weights_hash
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
        cpu, wall = time.process_time(), time.perf_counter()
        taken, entry = cached_weights_hash(loaded)
        take_cpu, take_wall = time.process_time() - cpu, time.perf_counter() - wall
        assert taken == digest, "the cached fingerprint differs from the tensors' hash"
        n_bytes = sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values())
        how = "computed and stored" if entry is None else "reused"
        print(f"load {i + 1}: model {load_cpu:.2f} s CPU ({load_wall:.2f} s wall); hashing the "
              f"{n_bytes / 1e6:.0f} MB of tensors ({digest[:12]}): {hash_cpu:.3f} s CPU "
              f"({hash_wall:.3f} s wall), {100 * hash_cpu / load_cpu:.1f}% of the load; "
              f"fingerprint as extract takes it ({how}): {take_cpu:.4f} s CPU "
              f"({take_wall:.4f} s wall), {100 * take_cpu / load_cpu:.2f}% of it")  # fmt: skip
        if entry is not None:
            ratios.append(take_cpu / load_cpu)
        del loaded
    with open("/proc/loadavg") as f:
        print(f"load average while measured: {f.read().split()[0]}")
    if not ratios:
        print("no reload reused the fingerprint: run with --repeat 2 or more")
        return
    worst = max(ratios)
    verdict = "met" if worst <= TARGET else "missed"
    print(f"target: the fingerprint at most {100 * TARGET:.0f}% of a model load on a reload: "
          f"{verdict} (worst {100 * worst:.2f}%)")  # fmt: skip


if __name__ == "__main__":
    main()
