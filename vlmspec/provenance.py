"""Where a measurement came from: the command, the commit, the date, the CPU and the thread count.

Every results file (a benchmark's JSON and markdown table, ``vlmspec demo --out``) carries
these fields, so a number quoted anywhere can be traced to the machine and code that
produced it. Timings from different machines or commits are not comparable; ratios
measured in one run are.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# The instruction-set flags that decide which CPU kernels run and how fast (/proc/cpuinfo names).
RELEVANT_CPU_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
REQUIRED_FIELDS = ("command", "commit", "date", "cpu", "threads")
NOT_RECORDED = "not recorded"


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """The provenance of a run in this process: command line, git commit, UTC date, CPU, torch threads.

    ``argv``: the command as run; by default this process's, written as a person would type it
    again (``python -m benchmarks.vs_peers ...`` or ``vlmspec demo ...``).
    """
    commit, dirty = git_commit()
    return {
        "command": shlex.join(argv) if argv is not None else command_line(),
        "commit": commit,
        "uncommitted_changes": dirty,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_info(),
        "threads": torch_threads(),
    }


def command_line() -> str:
    """This process's command line to type again: ``python -m MODULE ...`` for a module run with ``-m``."""
    module = getattr(sys.modules.get("__main__"), "__spec__", None)
    if module is not None:
        program = f"python -m {module.name.removesuffix('.__main__')}"
    elif sys.argv[0].endswith(".py"):  # a script: its path as typed from here
        program = f"python {shlex.quote(os.path.relpath(sys.argv[0]))}"
    else:  # a console script such as `vlmspec`
        program = Path(sys.argv[0]).name
    return " ".join([program, *(shlex.quote(arg) for arg in sys.argv[1:])])


def git_commit() -> tuple[str, bool | None]:
    """HEAD's full hash of the checkout this file is in, and whether tracked files differ from it."""
    here = Path(__file__).resolve().parent
    head = _git(["rev-parse", "HEAD"], here)
    if head is None:
        return f"{NOT_RECORDED} (not run from a git checkout)", None
    status = _git(["status", "--porcelain", "--untracked-files=no"], here)
    return head, (bool(status) if status is not None else None)


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def cpu_info() -> dict[str, Any]:
    """The CPU model, its kernel-relevant instruction-set flags, and the logical cores this process sees."""
    model, flags = NOT_RECORDED, []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the model from platform, flags unknown
        model = platform.processor() or platform.machine() or NOT_RECORDED
    else:
        fields = dict(_cpuinfo_field(line) for line in text.splitlines() if ":" in line)
        model = fields.get("model name", platform.machine() or NOT_RECORDED)
        if "cpu family" in fields and "model" in fields:  # a VM's name ("AMD EPYC") hides the generation
            model = f"{model} (family {fields['cpu family']}, model {fields['model']})"
        present = set(fields.get("flags", "").split())
        flags = [flag for flag in RELEVANT_CPU_FLAGS if flag in present]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "flags": flags, "cores": cores}


def cpu_signature() -> str:
    """This machine's CPU in one line (model, logical cores, kernel-relevant flags): what a measured cost is tied to.

    Two machines with the same signature run the same kernels, so a cost curve measured on one is
    worth a spot check on the other (:func:`vlmspec.reference.machine_sps_table`), not a new profile.
    The x86 family and model numbers are part of it: two VMs both named "AMD EPYC" with the same
    flags verified 8 bfloat16 tokens for 1.31 and 1.63-1.96 one-token steps, and read memory at about 52
    and 33 GB/s (the second is family 25, model 17: Zen 4; the first did not record its numbers).
    """
    info = cpu_info()
    return f"{info['model']}; {info['cores']} cores; {' '.join(info['flags']) or 'no relevant flags'}"


def _cpuinfo_field(line: str) -> tuple[str, str]:
    key, _, value = line.partition(":")
    return key.strip(), value.strip()


def torch_threads() -> int | None:
    """torch's intra-op thread count (what a CPU timing depends on), or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    return torch.get_num_threads()


def missing_fields(record: dict[str, Any]) -> list[str]:
    """The required provenance fields ``record`` lacks (empty values count as missing)."""
    return [name for name in REQUIRED_FIELDS if record.get(name) in (None, "", [], {})]


def provenance_markdown(record: dict[str, Any]) -> str:
    """A "Provenance" section for a markdown results table: one line per field, with where it came from."""
    cpu = record["cpu"]
    if isinstance(cpu, dict):
        flags = cpu.get("flags")
        flag_text = " ".join(flags) if isinstance(flags, list) else str(flags)
        cpu = f"{cpu.get('model', NOT_RECORDED)}; {cpu.get('cores', NOT_RECORDED)} cores; flags: {flag_text or 'none'}"
    values = {**record, "command": f"`{record['command']}`", "cpu": cpu}
    dirty = record.get("uncommitted_changes")
    if dirty is True:
        values["commit"] = f"{record['commit']} (with uncommitted changes)"
    elif isinstance(dirty, str):
        values["commit"] = f"{record['commit']} (uncommitted changes: {dirty})"
    lines = ["## Provenance", ""]
    for name in REQUIRED_FIELDS:
        source = record.get(f"{name}_source")
        lines.append(f"- {name}: {values[name]}" + (f" — {source}" if source else ""))
    if record.get("note"):
        lines.append(f"- note: {record['note']}")
    return "\n".join(lines) + "\n"
