"""``smartexit jetson push`` (``make jetson-push DEVICE=user@host``, on the development machine).

What the device gets, into ``<remote_dir>/artifacts/<run>/`` (the same layout as here):

- the ONNX export (``onnx/``: the portable graphs TensorRT builds from, the fused ONNX Runtime ones),
  the threshold table, the Triton repository (its bundle carries the tokenizer), and ``manifest.json``;
- with ``bench=true`` (default) also what the on-device benchmarks load: the served checkpoint(s), which
  the ``torch_static`` backend also serves before TensorRT engines exist, and the full-depth export
  (``onnx_full/``);
- ONNX Runtime's outputs on recorded inputs (``jetson/parity/``), the reference of the engines'
  parity check on the device (:mod:`edge.jetson.record`);
- with ``code=true`` (default) the project's tracked files (``git ls-files``) into ``<remote_dir>``;
  the scheduler policy recorded by ``train-scheduler`` travels with them and is hash-checked too.

Never training data: only the stage outputs above are copied, each verified against the sha256 the
manifest recorded when its stage wrote it (a changed file stops the push), and the repository holds
no training corpus (the bundled data are the held-out calibration / test prompts).

Integrity on arrival: ``jetson/push/SHA256SUMS`` lists every copied file's sha256 (the manifest's
folder hashes are functions of exactly these, edge.core.artifacts.sha256_path), and
``jetson/push/verify.sh`` runs ``sha256sum --check`` on the device over ssh; the push fails unless it
passes.
"""
from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import edge
from edge.core.artifacts import Manifest, atomic_write_json, sha256_file
from edge.core.errors import ArtifactError, ConfigError
from edge.jetson import commands
from edge.jetson.record import PARITY_DIR, record_parity
from edge.jetson.steps import Runner, Step

PUSH_DIR = Path("jetson") / "push"
SUMS = "SHA256SUMS"
VERIFY = "verify.sh"
CODE_LIST = "code_files.txt"
REPO_ROOT = Path(edge.__file__).resolve().parents[1]
# (stage, output, why the device needs it); "bench" rows only with bench=true
ALWAYS = (("export", "graphs", "ONNX segments: TensorRT engines, the served engine"),
          ("calibrate", "thresholds", "the threshold table"),
          ("repo", "repository", "the Triton model repository (bundle: graphs, tokenizer, thresholds)"))
FOR_BENCH = (("export", "graphs_full", "the full-depth baseline of the benchmarks"),
             ("distill", "checkpoint", "the checkpoint the benchmarks load (torch_static serves it uncompressed)"),
             ("compress", "checkpoint", "the compressed checkpoint the benchmarks load (torch_static serves it)"))


@dataclass
class PushConfig:
    """``smartexit jetson push``: the run's deployable artifacts to ``device`` (user@host)."""

    run_dir: str = "artifacts/demo"
    device: str = ""  # user@host
    remote_dir: str = "smartexit"  # the project's checkout on the device (relative to the remote home, or absolute)
    ssh_options: list[str] = field(default_factory=list)  # e.g. ["-p", "2222"]
    code: bool = True  # also copy the tracked files of this checkout
    bench: bool = True  # also the checkpoints and full-depth export the on-device benchmarks load
    record: bool = True  # record ONNX Runtime's reference outputs (jetson/parity) before copying
    dry_run: bool = False

    def __post_init__(self) -> None:
        commands.check_remote_dir(self.remote_dir)


@dataclass(frozen=True)
class Item:
    """One manifest output to copy: where it is here, its path in the run folder."""

    stage: str
    key: str
    path: Path
    rel: str
    why: str


def remote_run(remote_dir: str, run_dir: str | Path) -> str:
    """The run folder on the device: ``<remote_dir>/artifacts/<run name>``."""
    return f"{commands.check_remote_dir(remote_dir)}/artifacts/{Path(run_dir).name}"


def plan_items(manifest: Manifest, bench: bool) -> list[Item]:
    """The outputs to copy, each checked against the hash the manifest recorded.

    Raises:
        ArtifactError: a needed stage has not run, an output changed since recorded, or lies outside
            the run folder.
    """
    rows = [*ALWAYS, *(r for r in FOR_BENCH if bench and (r[0] != "compress" or "compress" in manifest.data["stages"]))]
    items = []
    for stage, key, why in rows:
        if stage not in manifest.data["stages"]:
            raise ArtifactError(f"{manifest.path}: stage {stage!r} has not run; `make {stage}` first "
                                f"(the device needs {why})")
        path = manifest.verified_output(stage, key)
        rel = manifest.rel(path)
        if Path(rel).is_absolute():
            raise ArtifactError(f"{path} (output {key!r} of {stage!r}) is outside {manifest.run_dir}: push copies "
                                f"the run folder; write it inside the run")
        if all(i.rel != rel for i in items):
            items.append(Item(stage, key, path, rel, why))
    return items


def policy_files(manifest: Manifest, repo_root: Path = REPO_ROOT) -> list[tuple[Path, str]]:
    """(file, path relative to the run folder on the device) of the scheduler policy ``train-scheduler``
    recorded, where it lies inside this checkout (it travels with the code); [] otherwise."""
    if "train_scheduler" not in manifest.data["stages"]:
        return []
    path = manifest.verified_output("train_scheduler", "policy").resolve()
    if not path.is_relative_to(repo_root):
        return []
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()
                                                  and not any(s.startswith(".") for s in p.relative_to(path).parts))
    return [(f, f"../../{f.relative_to(repo_root).as_posix()}") for f in files]


def artifact_files(run_dir: Path, rels: list[str]) -> list[tuple[Path, str]]:
    """Every non-hidden file under the run-relative paths ``rels`` (what rsync copies), sorted."""
    out = []
    for rel in rels:
        p = run_dir / rel
        if p.is_file():
            out.append((p, rel))
            continue
        for f in sorted(p.rglob("*")):
            if f.is_file() and not any(s.startswith(".") for s in f.relative_to(run_dir).parts):
                out.append((f, f.relative_to(run_dir).as_posix()))
    return out


def sha256sums(files: list[tuple[Path, str]]) -> str:
    """``sha256sum`` check-file text: '<hex>  <path>' per file (paths relative to the run folder)."""
    lines = []
    for f, rel in files:
        if "\n" in rel or "\\" in rel:
            raise ArtifactError(f"{rel!r}: a file name sha256sum cannot list unescaped")
        lines.append(f"{sha256_file(f)}  {rel}")
    return "\n".join(lines) + "\n"


def verify_script(run_name: str, n_files: int) -> str:
    """The check run on the device after the copy (bash; shellcheck-clean)."""
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Generated by `smartexit jetson push` for run {shlex.quote(run_name)}: checks on the Jetson that every",
        "# pushed file arrived intact. SHA256SUMS holds the sha256 of each file; before the push they were",
        "# checked to reproduce the folder hashes in manifest.json (edge.core.artifacts.sha256_path).",
        "set -euo pipefail",
        'cd "$(dirname "$0")/../.."',
        f"if sha256sum --check --strict --quiet {PUSH_DIR.as_posix()}/{SUMS}; then",
        f'  echo "push verified: {n_files} files match the manifest\'s sha256 in $(pwd)"',
        "else",
        '  echo "push NOT verified: the files listed above differ from the manifest; push again" >&2',
        "  exit 1",
        "fi",
        "",
    ])


def main(cfg: PushConfig) -> int:
    if not cfg.device:
        raise ConfigError("device is required: make jetson-push DEVICE=user@host (smartexit jetson push device=...)")
    runner = Runner(cfg.dry_run)
    run_dir = Path(cfg.run_dir)
    manifest = Manifest(run_dir)
    if not manifest.path.is_file():
        raise ArtifactError(f"{manifest.path} is missing: {run_dir} is not a run folder (make demo / make repo)")
    items = plan_items(manifest, cfg.bench)
    policy = policy_files(manifest)
    dest = remote_run(cfg.remote_dir, run_dir)
    push_dir, parity_dir = run_dir / PUSH_DIR, run_dir / PARITY_DIR
    runner.note(f"push {run_dir} -> {cfg.device}:{dest}: " + "; ".join(f"{i.rel} ({i.why})" for i in items))
    graphs = next(i.path for i in items if i.key == "graphs")
    if cfg.record and cfg.dry_run:
        runner.note(f"would record ONNX Runtime's outputs of every graph in {graphs} on recorded inputs into "
                    f"{parity_dir} (the engines' parity reference)")
    elif cfg.record:
        info = record_parity(graphs, parity_dir)
        runner.note(f"recorded ONNX Runtime's outputs of {len(info['graphs'])} graphs into {parity_dir}")
    code_list = push_dir / CODE_LIST
    ls = Step("the tracked files of this checkout: the code the device gets (not a git checkout: code=false, and "
              "copy the code yourself)", commands.git_ls_files_argv(REPO_ROOT))
    if cfg.code:
        res = runner.run(ls)
        if res is not None:  # a tracked file deleted in the working tree is not sent (rsync would stop on it)
            tracked = [f for f in res.stdout.splitlines() if (REPO_ROOT / f).is_file()]
            runner.write(code_list, "".join(f"{f}\n" for f in tracked), f"{len(tracked)} tracked files")
    sent = [i.rel for i in items] + ["manifest.json"] + ([PARITY_DIR.as_posix()] if parity_dir.is_dir() or
                                                         (cfg.record and cfg.dry_run) else [])
    if cfg.dry_run:
        runner.note(f"would write {push_dir / SUMS} (sha256 of every file sent) and {push_dir / VERIFY}")
    else:
        files = artifact_files(run_dir, sent) + policy
        runner.write(push_dir / SUMS, sha256sums(files), f"sha256 of {len(files)} files")
        runner.write(push_dir / VERIFY, verify_script(run_dir.name, len(files)), "the check run on the device", 0o755)
    sent.append(PUSH_DIR.as_posix())
    ssh = cfg.ssh_options
    runner.run(Step("make the run folder on the device",
                    commands.ssh_argv(cfg.device, shlex.join(["mkdir", "-p", dest]), ssh)))
    if cfg.code:
        runner.run(Step("copy the code (tracked files)", commands.rsync_files_argv(
            code_list, REPO_ROOT, cfg.device, cfg.remote_dir, ssh), timeout=3600))
    runner.run(Step("copy the run's deployable artifacts (exact copies of each folder; hidden caches stay here)",
                    commands.rsync_push_argv(run_dir, sent, cfg.device, dest, ssh), timeout=3600))
    runner.run(Step("check every file's sha256 on the device", commands.ssh_argv(
        cfg.device, shlex.join(["bash", f"{dest}/{PUSH_DIR.as_posix()}/{VERIFY}"]), ssh), show=True))
    if not cfg.dry_run:
        atomic_write_json(push_dir / "push.json", {
            "device": cfg.device, "remote_run": dest, "items": [{"stage": i.stage, "output": i.key, "path": i.rel}
                                                                for i in items],
            "code": cfg.code, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        print(f"pushed {run_dir} to {cfg.device}:{dest}; on the device: make jetson-engines RUN={run_dir.name}")
    return 0
