"""Every command line the Jetson targets run, built by pure functions (STYLE.md 8).

Nothing here runs anything: :mod:`edge.jetson.steps` runs (or, in a dry run, prints) these lists
through :func:`edge.core.device.run_command`, and the tests compare them as lists.

Remote commands run in the project's checkout on the device (``remote_dir``, relative to the remote
user's home or absolute): ``ssh DEVICE 'cd <remote_dir> && <argv>'``, each word quoted for the remote
shell.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from edge.core.errors import ConfigError
from exporters.tensorrt import JETPACK_TRTEXEC_DIR, EngineBuildConfig, Shape, trtexec_argv

TRTEXEC = f"{JETPACK_TRTEXEC_DIR}/trtexec"  # JetPack installs it here, off PATH (libnvinfer-bin)
SYSTEMD_DIR = "/etc/systemd/system"
# precision flags trtexec must never get on Orin: sm_87 (Ampere) has no FP8 (NOTES.md)
FORBIDDEN_FLAGS = ("--fp8",)


# --- the device's identity -------------------------------------------------------------------------

def dpkg_versions_argv(patterns: Iterable[str], admindir: str | Path | None = None) -> list[str]:
    """Status, name and version of the installed packages matching ``patterns`` (dpkg-query(1));
    ``admindir`` reads another root's dpkg database (a mounted image)."""
    argv = ["dpkg-query"]
    if admindir is not None:
        argv.append(f"--admindir={admindir}")
    return [*argv, "-W", "-f", "${db:Status-Abbrev} ${Package} ${Version}\\n", *patterns]


TORCH_PROBE = "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"


def torch_probe_argv(python: str) -> list[str]:
    """Whether this venv's torch sees CUDA (the torch_static backend, what serves before TensorRT engines)."""
    return [python, "-c", TORCH_PROBE]


def nvpmodel_query_argv() -> list[str]:
    """The current power mode: 'NV Power Mode: MODE_30W' and its id (nvpmodel, L4T)."""
    return ["nvpmodel", "-q"]


def jetson_clocks_show_argv() -> list[str]:
    """The CPU / GPU / EMC clocks; jetson_clocks needs root, ``-n`` makes sudo fail instead of prompting."""
    return ["sudo", "-n", "jetson_clocks", "--show"]


# --- ssh / rsync -------------------------------------------------------------------------------------

def check_remote_dir(remote_dir: str) -> str:
    """``remote_dir`` as it will be quoted for the remote shell.

    Raises:
        ConfigError: it starts with '~' (quoted, the remote shell would not expand it) or is empty.
    """
    if not remote_dir or remote_dir.startswith("~"):
        raise ConfigError(f"remote_dir={remote_dir!r}: give a path relative to the remote home (smartexit) or "
                          f"an absolute one (/home/me/smartexit); '~' is not expanded once quoted")
    return remote_dir.rstrip("/") or "/"


def remote_shell(remote_dir: str, argv: Sequence[str]) -> str:
    """'cd <remote_dir> && <argv>' with every word quoted for the remote shell."""
    return f"cd {shlex.quote(check_remote_dir(remote_dir))} && {shlex.join(argv)}"


def ssh_argv(device: str, remote_command: str, ssh_options: Sequence[str] = ()) -> list[str]:
    """Run ``remote_command`` (one shell string) on ``device`` (user@host)."""
    return ["ssh", *ssh_options, device, remote_command]


def _rsync_ssh(ssh_options: Sequence[str]) -> list[str]:
    return ["-e", shlex.join(["ssh", *ssh_options])] if ssh_options else []


def rsync_push_argv(run_dir: str | Path, rel_paths: Sequence[str], device: str, remote_run: str,
                    ssh_options: Sequence[str] = ()) -> list[str]:
    """Copy ``rel_paths`` (relative to ``run_dir``) to ``device:remote_run`` keeping their relative paths.

    ``/./`` marks where the kept part starts (rsync ``--relative``); ``--delete`` makes each copied
    folder an exact copy (a stale file left on the device would change the folder's hash);
    ``--exclude=.*`` leaves out hidden derived caches such as ``.ort_cache`` (not part of an artifact's
    hash, edge.core.artifacts.sha256_path); ``--hard-links`` keeps the Triton bundle's links to the export.
    """
    return ["rsync", "-a", "--hard-links", "--relative", "--delete", "--exclude=.*", *_rsync_ssh(ssh_options),
            *(f"{run_dir}/./{p}" for p in rel_paths), f"{device}:{remote_run}/"]


def rsync_files_argv(files_from: str | Path, src_root: str | Path, device: str, remote_dir: str,
                     ssh_options: Sequence[str] = ()) -> list[str]:
    """Copy the files listed in ``files_from`` (paths relative to ``src_root``) to ``device:remote_dir``."""
    return ["rsync", "-a", f"--files-from={files_from}", *_rsync_ssh(ssh_options), f"{src_root}/",
            f"{device}:{check_remote_dir(remote_dir)}/"]


def rsync_pull_argv(device: str, remote_path: str, local_path: str | Path,
                    ssh_options: Sequence[str] = ()) -> list[str]:
    """Copy ``device:remote_path`` here (a folder: end ``remote_path`` with '/' to copy its contents)."""
    return ["rsync", "-a", *_rsync_ssh(ssh_options), f"{device}:{remote_path}", str(local_path)]


def git_ls_files_argv(repo_root: str | Path) -> list[str]:
    """The files git tracks in the checkout (what the device gets as code; never artifacts or data)."""
    return ["git", "-C", str(repo_root), "ls-files"]


# --- TensorRT ---------------------------------------------------------------------------------------

def refuse_forbidden_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` unchanged, or ConfigError if it asks for a precision Orin does not have (FP8)."""
    bad = [a for a in argv if a.split("=", 1)[0] in FORBIDDEN_FLAGS]
    if bad:
        raise ConfigError(f"{bad}: Jetson AGX Orin is sm_87 (Ampere) and has no FP8; FP16 and INT8 (explicit "
                          f"Q/DQ) are its precisions")
    return list(argv)


def trtexec_build_argv(trtexec: str, onnx_path: str | Path, plan_path: str | Path,
                       shapes: Mapping[str, tuple[Shape, Shape, Shape]], cfg: EngineBuildConfig) -> list[str]:
    """One engine: exporters.tensorrt's trtexec line (profile, workspace, precision flags, timing cache)
    run by ``trtexec`` (the device's own, an absolute path)."""
    return refuse_forbidden_flags([trtexec, *trtexec_argv(onnx_path, plan_path, dict(shapes), cfg)[1:]])


def _dims(shape: Sequence[int]) -> str:
    return "x".join(str(int(s)) for s in shape)


def trtexec_infer_argv(trtexec: str, plan: str | Path, shapes: Mapping[str, Sequence[int]],
                       inputs: Mapping[str, str | Path], export_json: str | Path) -> list[str]:
    """Run ``plan`` once on recorded inputs (raw binary files, trtexec ``--loadInputs``) and write its
    outputs as JSON (``--exportOutput``: [{"name", "dimensions": "AxB", "values": [...]}])."""
    return [trtexec, f"--loadEngine={plan}",
            "--shapes=" + ",".join(f"{n}:{_dims(s)}" for n, s in shapes.items()),
            "--loadInputs=" + ",".join(f"{n}:{p}" for n, p in inputs.items()),
            f"--exportOutput={export_json}", "--iterations=1", "--warmUp=0", "--duration=0"]


# --- systemd ----------------------------------------------------------------------------------------

def install_unit_argv(unit_file: str | Path, unit_dir: str = SYSTEMD_DIR) -> list[str]:
    """Copy a generated unit into systemd's folder, root-owned, mode 0644."""
    return ["sudo", "install", "-m", "0644", str(unit_file), f"{unit_dir}/{Path(unit_file).name}"]


def remove_units_argv(units: Sequence[str], unit_dir: str = SYSTEMD_DIR) -> list[str]:
    return ["sudo", "rm", "-f", *(f"{unit_dir}/{u}" for u in units)]


def systemctl_argv(action: str, *args: str, sudo: bool = True) -> list[str]:
    """``[sudo] systemctl <action> <args...>`` (daemon-reload, enable --now, stop, disable, ...)."""
    return [*(["sudo"] if sudo else []), "systemctl", action, *args]


def systemctl_status_argv(units: Sequence[str], lines: int = 10) -> list[str]:
    return ["systemctl", "status", "--no-pager", f"--lines={lines}", *units]


def systemctl_is_active_argv(unit: str) -> list[str]:
    return ["systemctl", "is-active", unit]


def systemd_verify_argv(unit_files: Sequence[str | Path]) -> list[str]:
    """systemd-analyze's check of unit files (used by the tests where it is installed)."""
    return ["systemd-analyze", "verify", *map(str, unit_files)]
