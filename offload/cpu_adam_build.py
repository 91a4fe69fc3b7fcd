"""Where the C++ CPU Adam extension comes from: built at install time, loaded by its path.

A job process never compiles.  ``pip install --no-build-isolation`` (setup.py's ``build_ext``), the
bootstrap and the Docker image run :func:`build_installed`, which compiles ``csrc/`` in a private
temporary directory and puts ``zenflow_cpu_adam.so`` plus a manifest of its inputs into the package
(``offload/_ext/``; an editable install: the source tree).  :func:`load` imports that file by path
after checking the manifest against what this process would build (sources' content, flags, torch
version and C++ ABI, Python ABI, CPU features for ``-march=native``) and this CPU against the
instructions the build needs (recorded at build time); no compiler is run for it.
Missing or stale, it fails fast with the command that builds it, unless ``ZENFLOW_CPU_ADAM_JIT=1``
(development) allows the JIT fallback: ``torch.utils.cpp_extension.load`` into
``<torch extensions dir>/zenflow_cpu_adam_<tag>``, the tag a hash of every input (include paths and
compiler version too), so two venvs or checkouts never rebuild each other's copy.  Builders of one
directory serialise on a ``flock`` held for the build: the kernel drops it when its owner dies (so a
killed build never blocks the next), a live builder is waited for at most
``ZENFLOW_CPU_ADAM_LOCK_TIMEOUT`` seconds, and torch's own ``lock`` file, which it never cleans up
after a crash, is removed by whoever holds ours (every builder of that directory holds ours first).

Run ``python -m offload.cpu_adam_build`` to build (a no-op when up to date); ``--check`` only tells.
This module imports nothing from ``offload`` so setup.py can load it by file path.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

EXT_NAME = "zenflow_cpu_adam"
PACKAGE_DIR = Path(__file__).resolve().parent
CSRC = PACKAGE_DIR / "csrc"
SOURCES = (CSRC / "cpu_adam.cpp",)
INSTALL_DIR = PACKAGE_DIR / "_ext"
LDFLAGS = ("-fopenmp",)
#: Target ISA flags; e.g. "-march=x86-64-v3" for a binary that runs on a mixed fleet (the Dockerfile's
#: default), or to test the AVX2 / scalar paths. An input of the build: the installed build is stale
#: when it differs. Default -march=native: this CPU's (a source install builds for the box it runs on).
#: Either way a build is refused on a CPU lacking the instructions it was compiled for.
ARCH_ENV = "ZENFLOW_CPU_ADAM_ARCH"
#: "1": a missing or stale installed build is compiled at first use (development only).
JIT_ENV = "ZENFLOW_CPU_ADAM_JIT"
#: Seconds a builder waits for another live builder of the same directory (default 600).
LOCK_TIMEOUT_ENV = "ZENFLOW_CPU_ADAM_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 600.0
LOCK_FILE = "zenflow-build.lock"
_HEADER_SUFFIXES = (".h", ".hpp")
_BUILD_HINT = "python -m offload.cpu_adam_build"


class CpuAdamBuildError(RuntimeError):
    """The C++ CPU Adam extension could not be built or loaded."""


class CpuAdamToolchainMissing(CpuAdamBuildError):
    """No C++ compiler or no ninja: nothing was tried (setup.py may skip the build then)."""


def arch_flags() -> list[str]:
    return os.environ.get(ARCH_ENV, "-march=native").split()


def cflags() -> list[str]:
    return ["-O3", *arch_flags(), "-fopenmp", "-ffp-contract=off"]


def jit_allowed() -> bool:
    return os.environ.get(JIT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def lock_timeout() -> float:
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "")
    return float(raw) if raw.strip() else DEFAULT_LOCK_TIMEOUT


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[-1].strip()
    except OSError:
        pass
    return ""


#: /proc/cpuinfo flags that decide which instructions a -march=native build may use (x86, then ARM);
#: the others (mitigations, virtualisation, new kernel features) change with a kernel update and must
#: not make an installed build stale.
_ISA_PREFIXES = (
    *("sse", "ssse", "avx", "fma", "f16c", "bmi", "popcnt", "movbe", "abm", "lzcnt", "adx", "aes"),
    *("pclmul", "vpclmul", "vaes", "gfni", "sha", "amx", "cx16", "xsave"),
    *("fp", "asimd", "sve", "bf16", "i8mm"),
)


#: The compiler's instruction-set macros and the /proc/cpuinfo flag each stands for (x86): what a build
#: for a named target (-march=x86-64-v3) needs of the CPU, recorded with it and checked on load.
_ISA_MACROS = {
    "__SSE3__": "pni",
    "__SSSE3__": "ssse3",
    "__SSE4_1__": "sse4_1",
    "__SSE4_2__": "sse4_2",
    "__POPCNT__": "popcnt",
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__F16C__": "f16c",
    "__BMI__": "bmi1",
    "__BMI2__": "bmi2",
    "__LZCNT__": "abm",
    "__MOVBE__": "movbe",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512CD__": "avx512cd",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl",
}


def required_cpu_flags(cxx: Sequence[str], flags: Sequence[str]) -> list[str]:
    """The /proc/cpuinfo flags a build with ``flags`` needs: the instruction sets the compiler enables
    for them (its predefined macros), at build time; [] where it cannot tell (another architecture)."""
    done = subprocess.run(
        [*cxx, *flags, "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise CpuAdamBuildError(f"{' '.join([*cxx, *flags])} refuses the target: {done.stderr.strip()}")
    defined = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}
    return sorted(flag for macro, flag in _ISA_MACROS.items() if macro in defined)


def missing_cpu_flags(required: Sequence[str]) -> list[str]:
    """Those of ``required`` this CPU lacks ([] when /proc/cpuinfo cannot be read: nothing to compare)."""
    have = set(_cpu_flags().split())
    return sorted(set(required) - have) if have else []


def _isa_flags() -> str:
    return " ".join(sorted({f for f in _cpu_flags().split() if f.startswith(_ISA_PREFIXES)}))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _sources_digest(sources: Sequence[Path], include_dirs: Sequence[Path]) -> str:
    files = list(sources)
    for d in include_dirs:
        files += sorted(p for p in Path(d).iterdir() if p.suffix in _HEADER_SUFFIXES)
    h = hashlib.sha256()
    for f in files:
        data = Path(f).read_bytes()
        h.update(f"{Path(f).name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def runtime_inputs(
    sources: Sequence[Path] = SOURCES, include_dirs: Sequence[Path] = (CSRC,)
) -> dict[str, str]:
    """What decides whether a built ``.so`` fits this process, computed without running anything."""
    import torch

    flags = cflags()
    native = any("native" in f for f in flags)
    return {
        "sources": _sources_digest(sources, include_dirs),
        "cflags": " ".join(flags),
        "ldflags": " ".join(LDFLAGS),
        "torch": str(torch.__version__),
        "cxx11_abi": str(bool(torch._C._GLIBCXX_USE_CXX11_ABI)),
        "python": str(sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag),
        "machine": platform.machine(),
        # a -march=native binary must not run on another CPU (illegal instruction)
        "cpu": _digest(_isa_flags())[:16] if native else "",
    }


def compiler() -> list[str]:
    from torch.utils import cpp_extension

    return shlex.split(str(cpp_extension.get_cxx_compiler()))


def check_toolchain() -> list[str]:
    """The compiler command; raises :class:`CpuAdamToolchainMissing` without a compiler or ninja."""
    cxx = compiler()
    if not cxx or shutil.which(cxx[0]) is None:
        raise CpuAdamToolchainMissing(
            f"no C++ compiler found: {' '.join(cxx)!r} is not on PATH (set CXX or install g++, "
            "e.g. `apt-get install g++`) - needed to build the zenflow CPU Adam extension"
        )
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise CpuAdamToolchainMissing(
            "ninja not found: `pip install ninja` (needed to build the CPU Adam extension)"
        )
    return cxx


def toolchain_inputs(cxx: Sequence[str], include_dirs: Sequence[Path] = (CSRC,)) -> dict[str, str]:
    """The compiler (resolved path and version line) and every include path: recorded with a build and
    part of the JIT tag, but not checked on load (a compiler upgrade does not invalidate a built .so)."""
    from torch.utils import cpp_extension

    exe = shutil.which(cxx[0]) or cxx[0]
    try:
        done = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60)
        version = (done.stdout.strip().splitlines() or [""])[0]
    except (OSError, subprocess.SubprocessError):
        version = "unknown"
    includes = [str(Path(d).resolve()) for d in include_dirs] + list(cpp_extension.include_paths())
    return {
        "compiler": " ".join([os.path.realpath(exe), *cxx[1:]]),
        "compiler_version": version,
        "include_paths": os.pathsep.join(includes),
    }


def jit_tag(runtime: dict[str, str], toolchain: dict[str, str]) -> str:
    """Build directory suffix: a hash of every input of the build."""
    return _digest(json.dumps({**runtime, **toolchain}, sort_keys=True))[:16]


# ---------------------------------------------------------------------------------------------------
# the build lock


def _lock_owner(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    pid, _, host = text.partition(" ")
    return f"pid {pid} on {host}" if pid else "an unknown process (no pid recorded)"


@contextlib.contextmanager
def build_lock(directory: Path, timeout: float, poll: float = 0.1) -> Iterator[Path]:
    """Hold ``directory/zenflow-build.lock`` (an exclusive ``flock``, with our pid written into it).

    A flock dies with its owner, so a lock file left by a dead process is simply taken; a live owner
    is waited for up to ``timeout`` seconds, then :class:`CpuAdamBuildError` names the file and its
    owner.  The descriptor is close-on-exec: a compiler outliving a killed builder holds nothing.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise CpuAdamBuildError(
                    f"another build of the zenflow CPU Adam extension holds {path} ({_lock_owner(fd)}) "
                    f"and did not finish within {timeout:g} s ({LOCK_TIMEOUT_ENV}); if that process "
                    "is hung, end it - a dead owner releases the lock by itself"
                )
            time.sleep(min(poll, left))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the flock


# ---------------------------------------------------------------------------------------------------
# building and loading


def _torch_build(
    name: str, directory: Path, sources: Sequence[Path], include_dirs: Sequence[Path], verbose: bool
) -> ModuleType:
    """torch's JIT build into ``directory``; the caller holds :func:`build_lock` on it."""
    from torch.utils import cpp_extension

    # torch's own baton: a leftover of a builder that died (every live builder holds our lock first)
    with contextlib.suppress(FileNotFoundError):
        (directory / "lock").unlink()
    try:
        mod: ModuleType = cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_include_paths=[str(d) for d in include_dirs],
            extra_cflags=cflags(),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(directory),
            verbose=verbose,
        )
    except Exception as exc:  # build or import failure
        tail = "\n".join(str(exc).strip().splitlines()[-40:])
        raise CpuAdamBuildError(
            f"building the zenflow CPU Adam extension failed; build log tail:\n{tail}"
        ) from exc
    return mod


def installed_paths(dest: Path) -> tuple[Path, Path]:
    """The installed shared object and its manifest under ``dest``."""
    return dest / f"{EXT_NAME}.so", dest / f"{EXT_NAME}.json"


def stale_reason(
    dest: Path, sources: Sequence[Path] = SOURCES, include_dirs: Sequence[Path] = (CSRC,)
) -> str | None:
    """Why the build under ``dest`` cannot be loaded here, or None when it can."""
    so, manifest = installed_paths(dest)
    if not so.is_file() or not manifest.is_file():
        return f"is not built ({so} missing)"
    try:
        recorded = json.loads(manifest.read_text())["runtime"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"has an unreadable manifest {manifest} ({exc})"
    now = runtime_inputs(sources, include_dirs)
    changed = sorted(k for k in set(now) | set(recorded) if now.get(k) != recorded.get(k))
    if changed:
        return f"at {so} is stale: its {', '.join(changed)} differ from this process's"
    try:
        missing = missing_cpu_flags(json.loads(manifest.read_text()).get("requires_cpu_flags", []))
    except (OSError, ValueError, AttributeError) as exc:
        return f"has an unreadable manifest {manifest} ({exc})"
    if missing:
        return (
            f"at {so} was built for {now['cflags']} and needs CPU instructions this CPU lacks "
            f"({', '.join(missing)}): rebuild it for this CPU's generation ({ARCH_ENV}, e.g. "
            "-march=x86-64-v2; the Dockerfile's CPU_ADAM_ARCH)"
        )
    return None


def load_installed(dest: Path) -> ModuleType:
    """Import the built ``.so`` under ``dest`` by path (no compiler, no lock)."""
    import torch  # noqa: F401 - the extension links against the already loaded libtorch

    so, _ = installed_paths(dest)
    spec = importlib.util.spec_from_file_location(EXT_NAME, so)
    if spec is None or spec.loader is None:
        raise CpuAdamBuildError(f"cannot import {so}")
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except ImportError as exc:
        raise CpuAdamBuildError(f"importing {so} failed: {exc}") from exc
    return mod


def build_installed(
    dest: Path = INSTALL_DIR,
    sources: Sequence[Path] = SOURCES,
    include_dirs: Sequence[Path] = (CSRC,),
    *,
    force: bool = False,
    verbose: bool = False,
) -> bool:
    """Build into ``dest`` unless an up-to-date build is there; True when it compiled.

    Compiles in a private temporary directory, then moves the ``.so`` and (last) the manifest into
    place atomically, under :func:`build_lock` on ``dest`` so two installs do not interleave.
    """
    if not force and stale_reason(dest, sources, include_dirs) is None:
        return False
    cxx = check_toolchain()
    with build_lock(dest, lock_timeout()):
        if not force and stale_reason(dest, sources, include_dirs) is None:
            return False  # another builder did it while we waited
        inputs = {
            "runtime": runtime_inputs(sources, include_dirs),
            "toolchain": toolchain_inputs(cxx, include_dirs),
            # checked on load: a portable build's target (x86-64-v3) says nothing about this CPU
            "requires_cpu_flags": required_cpu_flags(cxx, arch_flags()),
        }
        so, manifest = installed_paths(dest)
        with tempfile.TemporaryDirectory(prefix="zenflow-cpu-adam-") as tmp:
            _torch_build(EXT_NAME, Path(tmp), sources, include_dirs, verbose)
            shutil.copyfile(Path(tmp) / f"{EXT_NAME}.so", so.with_suffix(".so.tmp"))
        os.replace(so.with_suffix(".so.tmp"), so)
        manifest.with_suffix(".json.tmp").write_text(json.dumps(inputs, indent=1, sort_keys=True) + "\n")
        os.replace(manifest.with_suffix(".json.tmp"), manifest)
        return True


def load_jit(
    sources: Sequence[Path] = SOURCES, include_dirs: Sequence[Path] = (CSRC,), verbose: bool = False
) -> ModuleType:
    """Development fallback: build (or reuse) ``<extensions dir>/zenflow_cpu_adam_<tag>``."""
    from torch.utils import cpp_extension

    cxx = check_toolchain()
    tag = jit_tag(runtime_inputs(sources, include_dirs), toolchain_inputs(cxx, include_dirs))
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    directory = Path(root) / f"{EXT_NAME}_{tag}"
    with build_lock(directory, lock_timeout()):
        return _torch_build(f"{EXT_NAME}_{tag}", directory, sources, include_dirs, verbose)


def load(
    dest: Path = INSTALL_DIR,
    sources: Sequence[Path] = SOURCES,
    include_dirs: Sequence[Path] = (CSRC,),
    verbose: bool = False,
) -> ModuleType:
    """The installed build if it fits; else the JIT build when allowed; else a fast, clear error."""
    reason = stale_reason(dest, sources, include_dirs)
    if reason is None:
        try:
            return load_installed(dest)
        except CpuAdamBuildError as exc:
            reason = f"could not be loaded ({exc})"
    if jit_allowed():
        return load_jit(sources, include_dirs, verbose)
    raise CpuAdamBuildError(
        f"the zenflow CPU Adam extension {reason}. Build it with `{_BUILD_HINT}` (`make bootstrap`, "
        f"`pip install --no-build-isolation` and the Docker image do), or set {JIT_ENV}=1 to compile "
        "it at first use (development only)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=_BUILD_HINT, description=__doc__.split("\n")[0] if __doc__ else None
    )
    parser.add_argument("--dest", type=Path, default=INSTALL_DIR, help="where to put the build")
    parser.add_argument("--check", action="store_true", help="only say whether it is up to date")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args(argv)
    so, _ = installed_paths(args.dest)
    if args.check:
        reason = stale_reason(args.dest)
        print(f"zenflow CPU Adam: {reason or f'up to date ({so})'}")
        return 0 if reason is None else 1
    t = time.monotonic()
    try:
        built = build_installed(args.dest, force=args.force, verbose=args.verbose)
    except CpuAdamBuildError as exc:
        print(f"zenflow CPU Adam: {exc}", file=sys.stderr)
        return 1
    simd = load_installed(args.dest).simd_width()
    what = f"built in {time.monotonic() - t:.1f} s" if built else "up to date"
    print(f"zenflow CPU Adam: {what} ({so}, {simd})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
