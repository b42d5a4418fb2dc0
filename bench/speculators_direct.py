"""`python -m bench.speculators_direct ARGV.json`: speculators' own training entry point (`speculators.train.cli.main`
on its `TrainConfig`) in a fresh process, nothing of eaglet around it except, on CPU, the three accelerator calls
it cannot run without (`eaglet.train.cpu_patches`). Prints {"seconds": ...} for main() alone."""

import contextlib
import json
import sys
import time

from speculators.train.cli import main
from speculators.train.config import TrainConfig

from eaglet.train import cpu_patches, on_accelerator

if __name__ == "__main__":
    cfg = TrainConfig.resolve(json.loads(open(sys.argv[1]).read()))
    t0 = time.perf_counter()
    with contextlib.nullcontext() if on_accelerator() else cpu_patches():
        main(cfg)
    print(json.dumps({"seconds": time.perf_counter() - t0}))
