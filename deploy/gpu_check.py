"""One short check on a machine with a CUDA GPU (run by deploy/gpu_check.sh; under 10 minutes).

The product path on a GPU without TensorRT engines (a Jetson before ``make jetson-engines``, a discrete
GPU) is the engine over the static-cache torch backend (edge/runtime/static_backend.py), its decode
calls captured as CUDA graphs. This script measures it and what its numbers are made of, on the
bundled model (edge/assets/tiny-ee, float32); each section's code is in edge/pipeline/gpu_check/:

1. the decode step of the torch decoder on CUDA, at full depth and stopping at each exit (layers after
   the exit get their K/V by state propagation, as the engine does: CALM, Schuster et al. 2022), at
   batch 1 and 16: milliseconds per step and tokens/s (torch_decode.py);
2. that the CUDA run decodes the same greedy tokens as the CPU (full depth, batch 1; torch_decode.py);
3. one energy window of the full-depth decode on NVML (edge.energy: the GPU's energy counter), with
   the idle draw before it (torch_decode.py's ``nvml_window``; the meter opened in harness.py);
4. the static-cache decode step (edge/runtime/static_decode.py) eager and captured as CUDA graphs (one
   per segment and K/V fill, per batch bucket): ms per step at full depth and after each exit, the
   captured tokens against the eager ones, on the bundled model (exits after 3, 6, 9, float32) and on
   a random-weight model of Llama-3.1-8B's shape (bf16, exits after 8, 16, 24), with peak memory
   (static_cache.py; the random models in random_models.py);
5. the engine itself over ``torch_static`` on CUDA, graphs vs eager: decode tokens/s at full depth and
   with every token exiting at the first decision exit (the exit-depth ceiling), tokens of the captured
   run against the eager one, graphs captured, peak memory; on both models (engine_runs.py);
6. what exits cost and save there (exit_costs.py's ``engine_exit_costs``): decision cost in
   layer-equivalents at each batch, tokens/s and NVML joules per token of full depth, of every check paid
   and none leaving, of an uncalibrated confidence rule and of every token leaving first, rotated windows
   (windows.py); on both models;
7. exits as they are used (realistic_exits.py's ``realistic_exits``): the bundled model with the demo's
   check points and shortlist on real text, a quarter of the tokens leaving, pipelined or not (the bundled
   model only).
8. ``bench projection`` on this path (projection.py's ``projection_on_gpu``): Qwen2.5-0.5B and
   Llama-3.2-1B shapes, the replayed exit distribution forced, projected (d)/(c) at batch 1 and the
   check's cost in layers.

Writes ``<out>/gpu_check.json``. Exit codes: 0 done, 2 no CUDA GPU (the JSON says why).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing it

from edge.pipeline.gpu_check.engine_runs import engine_runs  # noqa: E402  (after the path above)
from edge.pipeline.gpu_check.exit_costs import engine_exit_costs  # noqa: E402
from edge.pipeline.gpu_check.harness import guarded, open_nvml  # noqa: E402
from edge.pipeline.gpu_check.projection import projection_on_gpu  # noqa: E402
from edge.pipeline.gpu_check.random_models import llama8b_shape  # noqa: E402
from edge.pipeline.gpu_check.realistic_exits import realistic_exits  # noqa: E402
from edge.pipeline.gpu_check.static_cache import static_graphs  # noqa: E402
from edge.pipeline.gpu_check.torch_decode import (  # noqa: E402
    decode_by_exit,
    greedy_cuda_vs_cpu,
    nvml_window,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="artifacts/gpu_check")
    ap.add_argument("--exits", default="3,6,9", help="exit layers to time besides full depth")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--skip-8b", action="store_true", help="skip the Llama-3.1-8B-shaped random model")
    ap.add_argument("--window", type=float, default=1.5, help="seconds of one rule's energy window (section 6)")
    ap.add_argument("--only-exit-costs", action="store_true", help="sections 6-8 alone")
    ap.add_argument("--projection", default="qwen2_0_5b,llama3_1b",
                    help="section 8's shapes (edge/pipeline/bench/projection_shapes.py's SHAPES; '' skips it)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    result: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                              "cuda_available": torch.cuda.is_available(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ")}
    if not torch.cuda.is_available():
        result["skipped"] = "no CUDA GPU visible to torch (torch.cuda.is_available() is False)"
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
        print(result["skipped"])
        return 2
    from edge.model.bundled import BUNDLED_EE_DIR
    from edge.model.checkpoint import load_decoder

    dev = torch.device("cuda")
    result["device"] = {"name": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
    cpu_model = load_decoder(BUNDLED_EE_DIR).eval()
    bb = load_decoder(BUNDLED_EE_DIR).eval().to(dev)
    depth = bb.cfg.num_layers
    g = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize
    batches = [int(b) for b in args.batches.split(",")]

    def save() -> None:  # after every section: what ran is kept if a later one fails or the run is cut
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")

    every = not args.only_exit_costs
    if every:
        result["decode_ms_by_batch_and_exit"] = guarded(decode_by_exit, bb, batches, args.prompt, args.steps,
                                                        args.exits, g, dev, sync)
        result["greedy_tokens_cuda_vs_cpu"] = guarded(greedy_cuda_vs_cpu, cpu_model, bb, args.prompt, g, dev, sync)
        big = torch.randint(0, bb.cfg.vocab_size, (16, args.prompt), generator=g).to(dev)
        result["nvml_energy_full_depth_b16"] = guarded(nvml_window, bb, big, args.steps, depth, sync)
        save()
    from edge.model.exits import ExitConfig, MultiExitModel

    exits = sorted({*(int(e) for e in args.exits.split(",") if int(e) < depth), depth})
    tiny = MultiExitModel(bb, ExitConfig(layers=exits, adapter_rank=0)).to(dev).eval()
    if every:
        result["static_cache_graphs_bundled"] = guarded(static_graphs, tiny, batches, args.prompt, args.steps, sync)
        save()
        result["engine_torch_static_bundled"] = guarded(engine_runs, tiny, batches, args.prompt, args.steps,
                                                        "float32")
        save()
    meter, reason = open_nvml()
    if meter is None:
        print(f"no NVML meter for the energy windows: {reason}", flush=True)
    result["exit_costs_bundled"] = guarded(engine_exit_costs, tiny, batches, args.prompt, args.steps, "float32",
                                           args.window, 3, "cuda", meter)
    save()
    result["realistic_exits_bundled"] = guarded(realistic_exits, bb, batches, args.steps, "float32", args.window,
                                                3, "cuda", meter)
    save()
    if args.projection:
        result["projection"] = guarded(projection_on_gpu, args.projection.split(","), 32, min(args.window, 0.5), 2,
                                       args.prompt, "cuda", meter)
        save()
    if not args.skip_8b:
        del tiny
        big8 = llama8b_shape(dev)
        if every:
            result["static_cache_graphs_llama8b_shape"] = guarded(static_graphs, big8, batches, args.prompt, 32, sync)
            save()
            result["engine_torch_static_llama8b_shape"] = guarded(engine_runs, big8, batches, args.prompt, 32,
                                                                  "bfloat16")
            save()
        result["exit_costs_llama8b_shape"] = guarded(engine_exit_costs, big8, batches, args.prompt, 32, "bfloat16",
                                                     args.window, 3, "cuda", meter)
        save()
    print(f"wrote {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
