"""Same U on a GPU as on a CPU: FedHydra's Model Stratification of one uploads archive, run by the vmapped
implementation (what a GPU run uses) and by the per-pair loop (what a CPU run uses), on each device.

  python -m experiments.gpu_stratify prepare ARCHIVE... --out DIR   # here: the models and the MS settings
  python -m experiments.gpu_stratify run DIR [--json OUT.json]       # anywhere with torch (no Flower needed)

`prepare` resolves what a default `fedhydra` replay of each archive would run (the robust recipe's score,
early stop and MS batch; the preset's generator; the run's MS seed), runs the CPU loop, and writes the client
models, the settings and the CPU result to DIR. `run` loads DIR and runs every implementation on every device
it finds (cpu; cuda when present), and reports the largest |U - U_cpu_loop|, |U_r - U_r_cpu_loop| and whether
every pair stopped at the same step. Results: benchmarks/results/gpu_stratify.json / .md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def prepare(archives: list[Path], out: Path) -> None:
    from oneshot_fl.archive import load_uploads
    from oneshot_fl.config import from_run_config
    from oneshot_fl.engine.stratify import stratify_sequential
    from launcher.replay import replay_config
    from oneshot_fl.seeding import derive_seed
    from strategies.fedhydra import PEER_SAMPLES, RECIPES
    from strategies.datafree import client_models
    from oneshot_fl.data.datasets import DATASETS
    from oneshot_fl.models.generator import GeneratorSpec

    out.mkdir(parents=True, exist_ok=True)
    recipe = RECIPES["robust"]
    for archive in archives:
        cfg = from_run_config(replay_config(archive, {"method": "fedhydra"}))
        info = DATASETS[cfg.dataset]
        ctx = type("Ctx", (), {"input_shape": info.input_shape, "num_classes": info.num_classes,
                               "device": torch.device("cpu")})()
        ups = load_uploads(archive, info.num_classes, info.input_shape, ("classifier",), skip_other_roles=True)
        models = client_models(ups, ctx)
        channels, size, _ = info.input_shape
        settings = {"archive": archive.parent.name, "archs": [up.arch for up in ups],
                    "input_shape": list(info.input_shape), "num_classes": info.num_classes,
                    "nz": cfg.distill.nz, "ngf": cfg.distill.ngf, "image_size": size, "channels": channels,
                    "steps": cfg.flat["fedhydra.ms-steps"], "batch": recipe.ms_batch or cfg.distill.synth_batch,
                    "lr": cfg.distill.lr_generator, "seed": derive_seed(cfg.seed, "stratification"),
                    "score": recipe.score, "stop_loss": recipe.stop_loss, "keep": PEER_SAMPLES}
        spec = GeneratorSpec(settings["nz"], settings["ngf"], size, channels)
        result = stratify_sequential(models, info.num_classes, spec, settings["steps"], settings["batch"],
                                     settings["lr"], settings["seed"], torch.device("cpu"), score=recipe.score,
                                     stop_loss=recipe.stop_loss, keep_samples=PEER_SAMPLES)
        folder = out / archive.parent.name
        folder.mkdir(exist_ok=True)
        torch.save({"states": [m.state_dict() for m in models], "settings": settings,
                    "here": {"u": result.u, "u_r": result.u_r, "steps_run": result.steps_run,
                             "device": "cpu (prepare machine)"}}, folder / "fleet.pt")
        print(f"{folder}: prepared ({len(models)} clients)")


def run(folder: Path) -> list[dict]:
    from oneshot_fl.engine.stratify import stratify, stratify_sequential
    from oneshot_fl.models.generator import GeneratorSpec
    from oneshot_fl.models.registry import build

    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows = []
    for path in sorted(folder.glob("*/fleet.pt")):
        saved = torch.load(path, map_location="cpu", weights_only=False)
        s = saved["settings"]
        spec = GeneratorSpec(s["nz"], s["ngf"], s["image_size"], s["channels"])
        runs = {}
        for device in devices:
            models = []
            for arch, state in zip(s["archs"], saved["states"]):
                model = build(arch, tuple(s["input_shape"]), s["num_classes"])
                model.load_state_dict(state)
                models.append(model.to(device).eval())
            for name, fn in (("loop", stratify_sequential), ("vmapped", stratify)):
                start = time.perf_counter()
                result = fn(models, s["num_classes"], spec, s["steps"], s["batch"], s["lr"], s["seed"], device,
                            score=s["score"], stop_loss=s["stop_loss"], keep_samples=s["keep"])
                runs[f"{device.type} {name}"] = (result, time.perf_counter() - start)
        base = saved["here"]
        for key, (result, seconds) in runs.items():
            rows.append({"archive": s["archive"], "run": key, "seconds": seconds,
                         "device_name": torch.cuda.get_device_name(0) if key.startswith("cuda") else "cpu",
                         "max_abs_du": float((result.u - base["u"]).abs().max()),
                         "max_abs_du_r": float((result.u_r - base["u_r"]).abs().max()),
                         "same_stops": bool(torch.equal(result.steps_run, base["steps_run"])),
                         "pairs_stopped_differently": int((result.steps_run != base["steps_run"]).sum()),
                         "torch": torch.__version__})
    return rows


def render(rows: list[dict]) -> str:
    lines = ["# Model Stratification: the same U on GPU and CPU", "",
             "`python -m experiments.gpu_stratify`: each archive's MS (the robust recipe) by the per-pair loop and "
             "by the vmapped implementation on each device, against the loop on the CPU of the machine that "
             "prepared it.", "",
             "| archive | run | device | max abs dU | max abs dU_r | pairs stopped at another step | seconds |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['archive']} | {r['run']} | {r['device_name']} | {r['max_abs_du']:.2e} | "
                     f"{r['max_abs_du_r']:.2e} | {r['pairs_stopped_differently']} | {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("archives", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("folder", type=Path)
    r.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.archives, args.out)
        return 0
    rows = run(args.folder)
    text = render(rows)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
        args.json.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
