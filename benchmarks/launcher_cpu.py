"""How much of a run's CPU the launcher takes, and the main job's wall time.

Runs the README's main job (`oneshot-fl run`, plus any `-c` overrides) as a child process and
samples with psutil, every `--interval` seconds, its process tree and the tree of the SuperLink it
starts (`flwr run` starts a local SuperLink that leaves the launcher's tree; it is found by the
launcher's private FLWR_HOME in its command line), keeping each process's last CPU time (user +
system). Processes are split into
  launcher  the `oneshot-fl` process and the Flower CLI processes it starts (`flwr run` to submit,
            `flwr ls` status checks, `flwr log` streaming and fetching),
  run       everything else (SuperLink, simulation engine, Ray workers: the clients and the server).
A process that lives shorter than one interval can be missed, and each process's CPU after its
last sample is lost; both bias the launcher's share down by at most one interval's CPU per
status check, which the record states beside the count of checks it saw.

  python -m benchmarks.launcher_cpu                        # the main job as the README runs it
  python -m benchmarks.launcher_cpu -c "preset='smoke'"    # a minute-long smoke of the command

Records: benchmarks/results/launcher_cpu.json (a list, one entry per run, appended) and the table
launcher_cpu.md. Cost: the run itself, about 5 min for the main job and 1 min for the smoke preset on the 2-core
development machine with nothing else running (the wall times it measures need an otherwise idle machine).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks.records import RESULTS_DIR, append_to_json_list, code_version, machine
from launcher.launch import find_superlinks

FLWR_COMMANDS = ("run", "ls", "log", "stop")


def flwr_subcommand(cmdline: list[str]) -> str | None:
    """'ls' for `flwr ls ...` (run directly or by its interpreter), else None."""
    exe = Path(cmdline[0]).name if cmdline else ""
    args = cmdline[1:]
    if exe.startswith("python") and args and Path(args[0]).name == "flwr":  # a script run by its interpreter
        exe, args = "flwr", args[1:]
    return args[0] if exe == "flwr" and args and args[0] in FLWR_COMMANDS else None


def classify(proc_cmdline: list[str], pid: int, launcher_pid: int, parent_pid: int | None) -> str:
    """'launcher' for the launcher and the Flower CLI commands it starts, else 'run'."""
    if pid == launcher_pid:
        return "launcher"
    if parent_pid == launcher_pid and flwr_subcommand(proc_cmdline):
        return "launcher"
    return "run"


class TreeSampler(threading.Thread):
    """Samples, until stopped, the CPU time of every process under `root` (the launcher) and under the
    SuperLink it starts (found once the launcher's Flower CLI children show its FLWR_HOME)."""

    def __init__(self, root: int, interval: float):
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.cpu: dict[int, float] = {}
        self.kind: dict[int, str] = {}
        self.command: dict[int, str] = {}
        self.stop_event = threading.Event()
        self.own_cpu = 0.0
        self.flwr_home: str | None = None
        self.superlinks: list[int] = []

    def _tree(self, pid: int) -> list[psutil.Process]:
        try:
            return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return []

    def sample(self) -> None:
        procs = self._tree(self.root)
        if self.flwr_home is None:  # the launcher's private Flower home, from the CLI commands it runs
            for proc in procs[1:]:
                try:
                    self.flwr_home = proc.environ().get("FLWR_HOME") or None
                except psutil.Error:
                    continue
                if self.flwr_home:
                    break
        if self.flwr_home and not self.superlinks:
            self.superlinks = find_superlinks(Path(self.flwr_home))
        for pid in self.superlinks:
            procs += self._tree(pid)
        for proc in procs:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    if proc.pid not in self.kind:
                        cmdline = proc.cmdline()
                        self.kind[proc.pid] = classify(cmdline, proc.pid, self.root, proc.ppid())
                        sub = flwr_subcommand(cmdline)
                        self.command[proc.pid] = "oneshot-fl" if proc.pid == self.root else \
                            f"flwr {sub}" if sub else " ".join(cmdline[:2])
                    self.cpu[proc.pid] = times.user + times.system
            except psutil.Error:
                continue

    def run(self) -> None:
        start = time.thread_time()
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.interval)
        self.own_cpu = time.thread_time() - start

    def totals(self) -> dict:
        out = {"launcher": 0.0, "run": 0.0}
        for pid, cpu in self.cpu.items():
            out[self.kind[pid]] += cpu
        return out

    def launcher_parts(self) -> dict:
        """The launcher's CPU by command: itself, and each Flower CLI subcommand summed."""
        out: dict[str, float] = {}
        for pid, cpu in self.cpu.items():
            if self.kind[pid] != "launcher":
                continue
            out[self.command[pid]] = out.get(self.command[pid], 0.0) + cpu
        return out


def measure(overrides: list[str], interval: float) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix="oneshot-fl-launcher-bench-"))
    user_args = [arg for o in overrides for arg in ("-c", o)]
    cmd = [str(Path(sys.executable).parent / "oneshot-fl"), "run",  # streams the log, as the README runs it
           "-c", f"output-dir='{out_dir}' run-name='main'", *user_args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = TreeSampler(proc.pid, interval)
    sampler.start()
    output, _ = proc.communicate()
    wall = time.perf_counter() - start
    sampler.stop_event.set()
    sampler.join()
    if not sampler.superlinks:
        raise SystemExit("the run's SuperLink was never found: its CPU would be missing from the record")
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}):\n{output[-3000:]}")
    result = json.loads((out_dir / "main" / "result.json").read_text())
    shutil.rmtree(out_dir, ignore_errors=True)
    totals = sampler.totals()
    checks = sum(1 for pid, c in sampler.command.items() if sampler.kind[pid] == "launcher" and c == "flwr ls")
    return {"command": " ".join(["oneshot-fl", "run", *user_args]),
            "wall_s": wall, "cpu_s": totals, "launcher_share": totals["launcher"] / max(sum(totals.values()), 1e-9),
            "status_checks_seen": checks, "launcher_cpu_by_command": sampler.launcher_parts(),
            "sample_interval_s": interval, "sampler_cpu_s": sampler.own_cpu,
            "accuracy": result["global"]["accuracy"], "method": result["config"]["method"],
            "dataset": result["config"]["dataset"], "seed": result["config"]["seed"],
            "code_version": code_version(), "machine": machine(),
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def render(records: list[dict]) -> str:
    lines = ["# Launcher CPU share and main-job wall time", "",
             "`python -m benchmarks.launcher_cpu [-c ...]`: the run's process tree sampled with psutil; launcher = the",
             "`oneshot-fl` process + the Flower CLI commands it starts (`flwr run` to submit; before the in-process",
             "Control API client also `flwr ls` status checks and `flwr log`).", "",
             "| command | wall s | run CPU s | launcher CPU s | launcher share | `flwr ls` processes | accuracy "
             "| machine | code |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        m = r["machine"]
        cpu = r["cpu_s"]
        lines.append(f"| `{r['command']}` | {r['wall_s']:.0f} | {cpu['run']:.0f} | {cpu['launcher']:.1f} | "
                     f"{100 * r['launcher_share']:.2f} % | {r['status_checks_seen']} | {100 * r['accuracy']:.2f} % | "
                     f"{m.get('cpus')} CPUs, GPU {m.get('gpu') or 'none'} | {r['code_version']} |")
    lines += ["", "Launcher CPU by command (s): " + "; ".join(
        f"row {i + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.get("launcher_cpu_by_command", {}).items())
        for i, r in enumerate(records))]
    lines += [f"Row {i + 1}: {r['note']}." for i, r in enumerate(records) if r.get("note")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--run-config", action="append", default=[], help="overrides, as oneshot-fl run -c")
    parser.add_argument("--interval", type=float, default=0.2, help="sampling interval, seconds")
    args = parser.parse_args(argv)
    record = measure(args.run_config, args.interval)
    records = append_to_json_list(RESULTS_DIR / "launcher_cpu.json", record, indent=2)
    (RESULTS_DIR / "launcher_cpu.md").write_text(render(records))
    print(render([record]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
