"""The sandbox's first stage (:mod:`.sandbox` starts it as ``python -I -S sandbox_child.py CONFIG``).

It runs before any user code, with only the standard library (``-I -S``: no site-packages, no project
imports, no ``PYTHON*`` variables), and turns itself into the sandbox:

1. new namespaces: network (only a loopback that is down), mount, PID, IPC and UTS; a user namespace
   too, except as root, where the mounts need the real root and the user namespace comes later;
2. fork: the child is PID 1 of the new PID namespace, so when it dies the kernel kills every process
   the grader started, however it forked or detached; this stage waits and reports how it ended;
3. the child builds a root of its own (a read-only tmpfs holding read-only binds of the system's
   library folders, the interpreter and the allowed packages, a private writable ``/tmp``, no
   ``/proc``, no ``/home``, no ``/etc`` but the loader's cache), enters it (chroot), drops to
   ``nobody`` when root (then a user namespace of its own: per-sandbox process counting), sets the
   rlimits and ``no_new_privs``, and execs the interpreter on :mod:`.sandbox_runner` with an
   environment of a few fixed variables. The exec leaves it no capabilities.

If the namespaces cannot be made, it reports ``sandbox_unavailable`` (fail closed) unless the config
allows running unisolated (rlimits, a private directory and an empty environment only).

Protocol: CONFIG is JSON (see :func:`trainer.graders.sandbox._config`); stdin is the request for the
runner, stdout the file the runner writes its result to. A failure here writes
``{"error": "server", "details": ...}`` to stdout and exits :data:`EXIT_SERVER`; a grader killed by its
CPU limit makes this stage exit :data:`EXIT_CPU`, one killed by another signal ``128 + signal``.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import signal
import sys
from typing import Any

EXIT_SERVER = 120
EXIT_CPU = 124

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
ST_RELATIME = 4096

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38

NOBODY = 65534
#: The environment of the grader's interpreter: nothing of the server's.
CHILD_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The sandbox could not be made (reported as a server error, never the user's fault)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    rc = _libc.mount(_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags), _bytes(data))
    _check(rc, f"mount {target}")


def prctl(option: int, value: int) -> None:
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(value), 0, 0, 0), "prctl")


def write_id_maps(uid: int, gid: int, proc_dir: int) -> None:
    """Map ``uid``/``gid`` to themselves in the process's new user namespace (an unprivileged map)."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        fd = os.open(name, os.O_WRONLY, dir_fd=proc_dir)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


def enter_namespaces(as_root: bool) -> None:
    """New namespaces for this process's next child (PID) and itself (the others)."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if as_root:
        unshare(flags)
        return
    uid, gid = os.getuid(), os.getgid()
    unshare(flags | CLONE_NEWUSER)
    proc_dir = os.open("/proc/self", os.O_RDONLY | os.O_DIRECTORY)
    try:
        write_id_maps(uid, gid, proc_dir)
    finally:
        os.close(proc_dir)


def _inside(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def bind_readonly(source: str, target: str) -> None:
    """Bind ``source`` at ``target`` read-only, keeping the flags a user namespace may not clear."""
    mount(source, target, None, MS_BIND | MS_REC)
    st = os.statvfs(source).f_flag
    kept = st & (MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    kept |= MS_RELATIME if st & ST_RELATIME else 0
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)


def _make_dir(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)


def _make_file(path: str) -> None:
    _make_dir(os.path.dirname(path))
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))


def populate_root(root: str, view: dict[str, Any]) -> None:
    """The read-only binds, files, devices, symlinks and masks of ``view`` under ``root``."""
    for source, target in view["dirs"]:
        _make_dir(_inside(root, target))
        bind_readonly(source, _inside(root, target))
    for source, target in view["files"]:
        _make_file(_inside(root, target))
        bind_readonly(source, _inside(root, target))
    for device in view["devices"]:
        _make_file(_inside(root, device))
        try:
            mount(device, _inside(root, device), None, MS_BIND)
        except OSError:
            os.unlink(_inside(root, device))  # a grader without /dev/null still runs
    for target, link in view["symlinks"]:
        os.symlink(target, _inside(root, link))
    for target in view["masks"]:
        if os.path.isdir(_inside(root, target)):
            mount("tmpfs", _inside(root, target), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")


def build_root(root: str, view: dict[str, Any], limits: dict[str, Any], owner: int) -> None:
    """A tmpfs root at ``root``: the view read-only, ``/tmp`` a private writable tmpfs of ``owner``."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    populate_root(root, view)
    tmp = _inside(root, "/tmp")
    _make_dir(tmp)
    size = int(limits["file_bytes"])
    mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes=1024,mode=0700")
    os.chown(tmp, owner, owner)
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_to_nobody(proc_dir: int) -> None:
    """As root: become ``nobody`` (losing every capability), then enter a user namespace of its own,
    so that RLIMIT_NPROC counts this sandbox's processes only (not every ``nobody`` process)."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    prctl(PR_SET_DUMPABLE, 1)  # else /proc/self/uid_map stays root's
    unshare(CLONE_NEWUSER)
    write_id_maps(NOBODY, NOBODY, proc_dir)


def enter_root(root: str, as_root: bool) -> None:
    """chroot into ``root`` (by descriptor: ``nobody`` may not walk the path to it) and cd to /tmp."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    proc_dir = os.open("/proc/self", os.O_RDONLY | os.O_DIRECTORY)
    try:
        if as_root:
            drop_to_nobody(proc_dir)
        os.fchdir(root_fd)
        os.chroot(".")
        os.chdir("/tmp")
    finally:
        os.close(root_fd)
        os.close(proc_dir)


def set_limits(limits: dict[str, Any]) -> None:
    """The rlimits of the grader's processes (each process its own CPU and memory; the count shared)."""
    cpu = max(1, math.ceil(float(limits["cpu_seconds"])))
    for name, value in (
        ("RLIMIT_CPU", cpu),
        ("RLIMIT_AS", int(limits["memory_bytes"])),
        ("RLIMIT_FSIZE", int(limits["file_bytes"])),
        ("RLIMIT_NOFILE", int(limits["open_files"])),
        ("RLIMIT_NPROC", int(limits["max_processes"])),
        ("RLIMIT_CORE", 0),
        ("RLIMIT_MEMLOCK", 0),
        ("RLIMIT_MSGQUEUE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))


def exec_runner(config: dict[str, Any], runner: str) -> None:
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
    set_limits(config["limits"])
    python = config["python"]
    os.execve(python, [python, "-I", "-S", "-c", runner], CHILD_ENV)


def sandbox_child(config: dict[str, Any], runner: str, as_root: bool) -> None:
    """PID 1 of the new namespaces: the root, the identity, the limits, then the runner."""
    try:
        build_root(config["root"], config["view"], config["limits"], NOBODY if as_root else os.getuid())
        enter_root(config["root"], as_root)
        exec_runner(config, runner)
    except Exception as exc:
        report_server("sandbox_setup_failed", str(exc))
    os._exit(EXIT_SERVER)


def report_server(kind: str, message: str) -> None:
    os.write(1, json.dumps({"error": "server", "kind": kind, "details": message}).encode())


def exit_status(status: int, rusage: resource.struct_rusage, cpu_limit: float) -> int:
    """This stage's exit code for the way its child ended. The CPU limit kills with SIGKILL (soft and
    hard limit are equal; PID 1 ignores SIGXCPU anyway); the usage rusage reports is sampled, so it
    may fall short of the limit: half of it marks a CPU timeout."""
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    signo = os.WTERMSIG(status)
    cpu = rusage.ru_utime + rusage.ru_stime
    if signo in (signal.SIGKILL, signal.SIGXCPU) and cpu >= max(1, math.ceil(cpu_limit)) / 2:
        return EXIT_CPU
    return 128 + signo


def unisolated_child(config: dict[str, Any], runner: str) -> None:
    """The weaker fallback (only when the config allows it): no namespaces; a private directory, an
    empty environment and the rlimits only."""
    try:
        work = os.path.join(config["root"], "tmp")
        os.mkdir(work, 0o700)
        os.chdir(work)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        set_limits(config["limits"])
        python = config["python"]
        os.execve(python, [python, "-I", "-S", "-c", runner], dict(CHILD_ENV, HOME=work, TMPDIR=work))
    except Exception as exc:
        report_server("sandbox_setup_failed", str(exc))
    os._exit(EXIT_SERVER)


def isolate(config: dict[str, Any], as_root: bool) -> bool:
    """Whether the namespaces were made; exits with ``sandbox_unavailable`` when they could not be and
    the config does not allow the fallback (fail closed)."""
    try:
        enter_namespaces(as_root)
    except OSError as exc:
        if not config["allow_unisolated"]:
            report_server("sandbox_unavailable", f"no namespaces for the sandbox ({exc})")
            sys.exit(EXIT_SERVER)
        return False
    return True


def main() -> None:
    config = json.loads(sys.argv[1])
    with open(config["runner"], encoding="utf-8") as f:
        runner = f.read()
    as_root = os.geteuid() == 0
    isolated = isolate(config, as_root)
    pid = os.fork()
    if pid == 0:
        if isolated:
            sandbox_child(config, runner, as_root)
        unisolated_child(config, runner)
    _, status, rusage = os.wait4(pid, 0)
    sys.exit(exit_status(status, rusage, float(config["limits"]["cpu_seconds"])))


if __name__ == "__main__":
    main()
