"""Channels-last against the default (NCHW) memory format, per architecture, on this machine (its GPU if any).

For each architecture at the input size and batch the CPU tables use, two copies with the same weights (one
converted with `model.to(memory_format=torch.channels_last)`, inputs left NCHW as the data loaders give them)
are timed alternately in one process, so a load change hits both: a training step (forward, CE backward, SGD
step), an inference forward (no grad, eval mode) and a synthesis step (eval mode, CE backward to the input
only: what a generator step asks of a teacher). Each figure is the median of `--reps` repetitions after one
warm-up; the ratio NCHW / channels-last is the speed-up. The two formats' logits are compared too: they
must agree to float rounding.

  OMP_NUM_THREADS=1 python -m experiments.memory_format                 # every architecture below
  OMP_NUM_THREADS=1 python -m experiments.memory_format --archs googlenet resnet18 --reps 5
  python -m experiments.memory_format --batch 256                       # on a GPU (cuda when there is one)

Records: benchmarks/results/memory_format.json (a list, one entry per run, appended) and the table
memory_format.md (every run). `oneshot_fl.devices.compute_memory_format` picks the layout models are built in
from these runs; its docstring cites them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.records import RESULTS_DIR, append_to_json_list, code_version, machine

# (architecture, input shape, batch): the grey fleets' models at the cpu preset's local batch, the CIFAR-10
# fleet's at its config's synthetic batch (benchmarks/conf/cifar10-hetero-cpu.toml)
CASES = [("lenet", (1, 28, 28), 128), ("cnn2", (1, 28, 28), 128), ("cnn3-bn", (1, 28, 28), 128),
         ("resnet8", (1, 28, 28), 128), ("vgg9-small", (1, 28, 28), 128),
         ("lenet", (3, 32, 32), 32), ("cnn2", (3, 32, 32), 32), ("cnn3-bn", (3, 32, 32), 32),
         ("resnet18", (3, 32, 32), 32), ("googlenet", (3, 32, 32), 32)]
RECORDS = RESULTS_DIR / "memory_format.json"


def _train_step(model, optimizer, x, y) -> None:
    model.train()
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def _inference(model, x, y) -> None:
    model.eval()
    with torch.no_grad():
        model(x)


def _synthesis_step(model, x, y) -> None:
    model.eval()
    image = x.clone().requires_grad_(True)
    F.cross_entropy(model(image), y).backward(inputs=[image])


def measure(arch: str, shape: tuple[int, int, int], batch: int, reps: int, device: str = "cpu") -> dict:
    from oneshot_fl.models.registry import build

    nchw = build(arch, shape, 10, seed=0).to(device=device, memory_format=torch.contiguous_format)
    last = build(arch, shape, 10, seed=0).to(device=device, memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch, *shape, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)  # a GPU step ends when its kernels do
    nchw.eval()
    last.eval()
    with torch.no_grad():
        logits_diff = float((nchw(x) - last(x)).abs().max())
    optimizers = {id(m): torch.optim.SGD(m.parameters(), lr=1e-3) for m in (nchw, last)}
    steps = {"train": lambda m: _train_step(m, optimizers[id(m)], x, y),
             "inference": lambda m: _inference(m, x, y),
             "synthesis": lambda m: _synthesis_step(m, x, y)}
    out = {"arch": arch, "input": list(shape), "batch": batch, "reps": reps, "max_abs_logit_diff": logits_diff}
    for name, step in steps.items():
        times = {"nchw": [], "channels_last": []}
        for rep in range(reps + 1):
            for label, model in (("nchw", nchw), ("channels_last", last)):
                sync()
                start = time.perf_counter()
                step(model)
                sync()
                if rep:  # the first repetition warms up (allocations, oneDNN primitive caches)
                    times[label].append(time.perf_counter() - start)
        nchw_s, last_s = statistics.median(times["nchw"]), statistics.median(times["channels_last"])
        out[name] = {"nchw_ms": round(1e3 * nchw_s, 2), "channels_last_ms": round(1e3 * last_s, 2),
                     "speedup": round(nchw_s / last_s, 3)}
    return out


def render(records: list[dict]) -> str:
    lines = ["# memory_format", "",
             "Channels-last against NCHW per architecture (`python -m experiments.memory_format`): median ms of a "
             "step in each format, measured alternately in one process; speed-up = NCHW / channels-last "
             "(> 1: channels-last is faster). `synthesis` = eval-mode CE backward to the input (a teacher in a "
             "generator step).", ""]
    for record in records:
        lines += [f"## {record['code_version']}, {record['date']}", "",
                  f"Machine: {json.dumps(record['machine'])}; device {record.get('device', 'cpu')}; torch "
                  f"{record['torch']}; arguments: `{' '.join(record.get('argv', [])) or '(none)'}`.", "",
                  "| architecture | input | batch | train ms NCHW / CL | speed-up | inference ms NCHW / CL | speed-up "
                  "| synthesis ms NCHW / CL | speed-up | max abs logit diff |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in record["rows"]:
            cells = [row["arch"], "x".join(map(str, row["input"])), str(row["batch"])]
            for step in ("train", "inference", "synthesis"):
                s = row[step]
                cells += [f"{s['nchw_ms']:.1f} / {s['channels_last_ms']:.1f}", f"{s['speedup']:.2f}x"]
            cells.append(f"{row['max_abs_logit_diff']:.1e}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", nargs="+", help="only these architectures (default: every case)")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per step and format")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the tables run one per process)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda when there is one, else cpu")
    parser.add_argument("--batch", type=int, help="every case at this batch instead of its table's")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    torch.set_num_threads(args.threads)
    cases = [(arch, shape, args.batch or batch) for arch, shape, batch in CASES if not args.archs or arch in args.archs]
    if not cases:
        parser.error(f"no case for {args.archs}; architectures measured: {sorted({c[0] for c in CASES})}")
    rows = []
    for arch, shape, batch in cases:
        row = measure(arch, shape, batch, args.reps, args.device)
        print(f"{arch} {shape} b{batch}: train {row['train']['speedup']:.2f}x, inference "
              f"{row['inference']['speedup']:.2f}x, synthesis {row['synthesis']['speedup']:.2f}x", flush=True)
        rows.append(row)
    records = append_to_json_list(RECORDS, {
        "code_version": code_version(), "date": time.strftime("%Y-%m-%d"), "machine": machine(), "device": args.device,
        "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv, "rows": rows})
    (RESULTS_DIR / "memory_format.md").write_text(render(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
