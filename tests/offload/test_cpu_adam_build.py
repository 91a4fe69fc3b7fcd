"""Where the C++ CPU Adam extension comes from (offload/cpu_adam_build.py, issue 22 item 8): the JIT
tag covers every input, a dead builder's lock is taken over, a live one is waited for only up to the
deadline, and loading the installed build runs no compiler (and a stale one is refused, not rebuilt)."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from offload import cpu_adam_build as cb
from offload.cpu_adam_build import CpuAdamBuildError
from tests.support import unavailable

ROOT = Path(__file__).resolve().parents[2]


def _write_fake_cxx(path: Path, version: str) -> Path:
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(0o755)
    return path


def test_the_jit_tag_changes_with_every_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, inc, inc2 = tmp_path / "k.cpp", tmp_path / "inc", tmp_path / "inc2"
    inc.mkdir()
    inc2.mkdir()
    src.write_text("int f() { return 1; }\n")
    (inc / "k.h").write_text("#pragma once\n")
    cxx = [str(_write_fake_cxx(tmp_path / "g++", "g++ (Fake) 12.2.0"))]
    monkeypatch.delenv(cb.ARCH_ENV, raising=False)

    def tag(includes: list[Path] | None = None) -> str:
        dirs = includes or [inc]
        return cb.jit_tag(cb.runtime_inputs([src], dirs), cb.toolchain_inputs(cxx, dirs))

    seen = {tag()}

    def changed(what: str) -> None:
        t = tag()
        assert t not in seen, f"the tag ignores {what}"
        seen.add(t)

    assert tag() in seen  # deterministic
    src.write_text("int f() { return 2; }\n")
    changed("the source's content")
    (inc / "k.h").write_text("#pragma once\n#define X 1\n")
    changed("a header's content")
    assert tag([inc, inc2]) not in seen  # another include path
    monkeypatch.setenv(cb.ARCH_ENV, "-march=x86-64-v3")
    changed("the ISA flags")
    monkeypatch.delenv(cb.ARCH_ENV)  # back to -march=native, a tag seen before
    monkeypatch.setattr(cb, "_cpu_flags", lambda: "fpu sse2 avx2")
    changed("the CPU's feature flags under -march=native")
    monkeypatch.setattr(torch, "__version__", "9.9.9+test")
    changed("the torch version")
    monkeypatch.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", not torch._C._GLIBCXX_USE_CXX11_ABI)
    changed("torch's C++ ABI flag")
    real = sysconfig.get_config_var
    monkeypatch.setattr(
        sysconfig, "get_config_var", lambda k: "cpython-399-test" if k == "SOABI" else real(k)
    )
    changed("the Python ABI")
    _write_fake_cxx(Path(cxx[0]), "g++ (Fake) 13.1.0")
    changed("the compiler's version")
    cxx[0] = str(_write_fake_cxx(tmp_path / "clang++", "g++ (Fake) 13.1.0"))
    changed("the compiler's path")
    monkeypatch.setattr(cb, "LDFLAGS", ("-fopenmp", "-lm"))
    changed("the linker flags")


def test_cpu_features_enter_only_a_native_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cb.ARCH_ENV, "-march=x86-64-v3")
    portable = cb.runtime_inputs()
    monkeypatch.setattr(cb, "_cpu_flags", lambda: "another cpu")
    assert cb.runtime_inputs() == portable  # a portable build runs on any CPU of its ISA


def test_only_isa_flags_decide_a_native_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel update that shows one more non-ISA flag must not make the installed build stale."""
    monkeypatch.delenv(cb.ARCH_ENV, raising=False)
    flags = "fpu sse2 avx2 fma f16c avx512f pti md_clear"
    monkeypatch.setattr(cb, "_cpu_flags", lambda: flags)
    before = cb.runtime_inputs()["cpu"]
    monkeypatch.setattr(cb, "_cpu_flags", lambda: flags + " user_shstk ibpb")
    assert cb.runtime_inputs()["cpu"] == before
    monkeypatch.setattr(cb, "_cpu_flags", lambda: flags.replace(" avx512f", ""))
    assert cb.runtime_inputs()["cpu"] != before  # a CPU without AVX-512


def test_a_portable_target_records_the_instructions_it_needs() -> None:
    """What the compiler enables for a named target (the Dockerfile's -march=x86-64-v3) is what a CPU
    must have: AVX2 and FMA for v3, not for v2, AVX-512 only for v4."""
    if platform.machine() not in ("x86_64", "AMD64"):
        unavailable("x86 targets")
    try:
        cxx = cb.check_toolchain()
    except CpuAdamBuildError as exc:  # pragma: no cover - only without a toolchain
        unavailable(f"no toolchain: {exc}")
    v3 = cb.required_cpu_flags(cxx, ["-march=x86-64-v3"])
    assert {"avx2", "fma", "bmi2", "avx", "sse4_2"} <= set(v3) and "avx512f" not in v3
    v2 = cb.required_cpu_flags(cxx, ["-march=x86-64-v2"])
    assert "sse4_2" in v2 and "avx2" not in v2 and "avx" not in v2
    assert "avx512f" in cb.required_cpu_flags(cxx, ["-march=x86-64-v4"])
    with pytest.raises(CpuAdamBuildError, match="refuses the target"):
        cb.required_cpu_flags(cxx, ["-march=no-such-cpu"])


def test_a_cpu_lacking_the_builds_instructions_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A portable build (its manifest's runtime inputs all match: no CPU digest) on a CPU without the
    instructions its target needs: refused by name, with the setting that builds for it, rather than an
    illegal instruction in a job; with them, loadable."""
    monkeypatch.setenv(cb.ARCH_ENV, "-march=x86-64-v3")
    monkeypatch.delenv(cb.JIT_ENV, raising=False)
    so, manifest = cb.installed_paths(tmp_path)
    so.write_bytes(b"")
    manifest.write_text(
        json.dumps({"runtime": cb.runtime_inputs(), "toolchain": {}, "requires_cpu_flags": ["avx2", "fma"]})
    )
    monkeypatch.setattr(cb, "_cpu_flags", lambda: "fpu sse4_2 avx fma")  # an Ivy Bridge-like CPU
    reason = cb.stale_reason(tmp_path)
    assert reason and "needs CPU instructions this CPU lacks (avx2)" in reason
    assert cb.ARCH_ENV in reason and "-march=x86-64-v3" in reason
    with pytest.raises(CpuAdamBuildError, match=r"lacks \(avx2\)"):
        cb.load(tmp_path)
    assert cb.main(["--dest", str(tmp_path), "--check"]) == 1
    monkeypatch.setattr(cb, "_cpu_flags", lambda: "fpu sse4_2 avx avx2 fma")
    assert cb.stale_reason(tmp_path) is None
    monkeypatch.setattr(cb, "_cpu_flags", lambda: "")  # no /proc/cpuinfo: nothing to compare
    assert cb.stale_reason(tmp_path) is None


def test_the_docker_image_builds_for_a_portable_target() -> None:
    """The Dockerfile's default is a named generation, not the building CPU (-march=native only when
    asked), and the image's environment carries it (an input the load checks)."""
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG CPU_ADAM_ARCH=-march=x86-64-v[234]$", text, re.M)
    assert "ENV ZENFLOW_CPU_ADAM_ARCH=${CPU_ADAM_ARCH}" in text
    assert cb.ARCH_ENV == "ZENFLOW_CPU_ADAM_ARCH"


def _hold_lock(directory: Path, ready: Path) -> subprocess.Popen[str]:
    """A process that holds the build lock of ``directory`` until killed (a live or hung builder)."""
    code = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from offload.cpu_adam_build import build_lock
        with build_lock(Path({str(directory)!r}), timeout=5):
            Path({str(ready)!r}).touch()
            time.sleep(3600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True)
    deadline = time.monotonic() + 60  # a Python start with torch importable, on a loaded machine
    while not ready.exists():
        assert proc.poll() is None, "the lock holder died"
        assert time.monotonic() < deadline, "the lock holder never took the lock"
        time.sleep(0.05)
    return proc


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def test_a_dead_builders_lock_is_taken_over(tmp_path: Path, holder: list[subprocess.Popen[str]]) -> None:
    directory = tmp_path / "ext"
    proc = _hold_lock(directory, tmp_path / "ready")
    holder.append(proc)
    lock = directory / cb.LOCK_FILE
    assert lock.read_text().split()[0] == str(proc.pid)
    proc.send_signal(signal.SIGKILL)  # a build killed mid-way: its lock file stays, with its pid
    proc.wait(timeout=30)
    assert lock.exists() and lock.read_text().split()[0] == str(proc.pid)
    # no waiting: were the dead owner's lock still held, this would raise after the (long) timeout
    with cb.build_lock(directory, timeout=600):
        assert lock.read_text().split()[0] == str(os.getpid())


def test_a_live_builder_is_waited_for_until_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holder: list[subprocess.Popen[str]]
) -> None:
    """Through the JIT path itself: the tag's directory is held by a live (here: hung) builder."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    try:
        cxx = cb.check_toolchain()
    except CpuAdamBuildError as exc:  # pragma: no cover - only without a toolchain
        unavailable(f"no toolchain: {exc}")
    tag = cb.jit_tag(cb.runtime_inputs(), cb.toolchain_inputs(cxx))
    directory = tmp_path / "cache" / f"{cb.EXT_NAME}_{tag}"
    proc = _hold_lock(directory, tmp_path / "ready")
    holder.append(proc)
    timeout, poll = 1.0, 0.1
    monkeypatch.setenv(cb.LOCK_TIMEOUT_ENV, str(timeout))
    t = time.monotonic()
    with pytest.raises(CpuAdamBuildError) as err:
        cb.load_jit()
    waited = time.monotonic() - t
    msg = str(err.value)
    assert str(directory / cb.LOCK_FILE) in msg and f"pid {proc.pid} " in msg, msg
    assert cb.LOCK_TIMEOUT_ENV in msg
    # it waited the whole deadline, and then not much more than a poll: the slack is for a loaded
    # machine (what runs between polls is one non-blocking flock call), not for any work
    assert timeout <= waited < timeout + 20 * poll + 1.0, waited
    assert proc.poll() is None  # the builder was left alone


@pytest.mark.slow
def test_a_jit_build_after_a_killed_one(tmp_path: Path) -> None:
    """A build killed mid-way leaves torch's own ``lock`` (and ours, with a dead pid) behind: the next
    JIT load builds anyway instead of waiting on it forever.  In a subprocess, bounded."""
    cache = tmp_path / "cache"
    code = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from offload import cpu_adam_build as cb
        tag = cb.jit_tag(cb.runtime_inputs(), cb.toolchain_inputs(cb.check_toolchain()))
        d = Path({str(cache)!r}) / f"{{cb.EXT_NAME}}_{{tag}}"
        d.mkdir(parents=True)
        (d / "lock").touch()  # torch's baton, never removed by a builder that died
        (d / cb.LOCK_FILE).write_text("999999999 elsewhere\\n")
        m = cb.load_jit()
        print("simd", m.simd_width(), "torch lock gone", not (d / "lock").exists())
        """
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), cb.LOCK_TIMEOUT_ENV: "600"}
    env.pop(cb.ARCH_ENV, None)
    try:
        cb.check_toolchain()
    except CpuAdamBuildError as exc:  # pragma: no cover - only without a toolchain
        unavailable(f"no toolchain: {exc}")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch lock gone True" in done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An installed build in a scratch directory: the package's own when it is up to date (no compile),
    else a fresh one."""
    dest = tmp_path_factory.mktemp("installed") / "_ext"
    env_arch = os.environ.pop(cb.ARCH_ENV, None)
    try:
        if cb.stale_reason(cb.INSTALL_DIR) is None:
            dest.mkdir()
            for f in cb.installed_paths(cb.INSTALL_DIR):
                shutil.copy2(f, dest / f.name)
        else:
            try:
                assert cb.build_installed(dest)
            except cb.CpuAdamToolchainMissing as exc:  # pragma: no cover
                unavailable(f"no toolchain: {exc}")
    finally:
        if env_arch is not None:
            os.environ[cb.ARCH_ENV] = env_arch
    return dest


def test_loading_the_installed_build_runs_no_compiler(installed: Path, tmp_path: Path) -> None:
    """Every compiler and ninja on PATH is a trap that records its call; CXX points at one too."""
    traps = tmp_path / "bin"
    traps.mkdir()
    calls = tmp_path / "calls"
    for name in ("c++", "g++", "gcc", "cc", "clang++", "ninja", "x86_64-linux-gnu-g++"):
        (traps / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit 1\n')
        (traps / name).chmod(0o755)
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        import torch
        from offload import cpu_adam
        cpu_adam._INSTALL_DIR = Path({str(installed)!r})
        m = cpu_adam.load_extension()
        assert Path(m.__file__) == cpu_adam._INSTALL_DIR / "zenflow_cpu_adam.so", m.__file__
        acc = torch.zeros(33)
        cpu_adam.accumulate(acc, torch.ones(33), alpha=0.5, first=True, num_threads=1)
        print("sum", float(acc.sum()))
        """
    )
    env = {**os.environ, "PATH": f"{traps}:{os.environ['PATH']}", "CXX": str(traps / "c++")}
    for k in (cb.JIT_ENV, cb.ARCH_ENV):
        env.pop(k, None)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sum 16.5" in done.stdout
    assert not calls.exists(), calls.read_text()


def _no_toolchain(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a compiler was asked for")

    monkeypatch.setattr(cb, "check_toolchain", refuse)
    monkeypatch.setattr(cb, "_torch_build", refuse)


def test_an_up_to_date_build_is_not_rebuilt(installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cb.ARCH_ENV, raising=False)
    _no_toolchain(monkeypatch)
    assert cb.build_installed(installed) is False
    assert cb.main(["--dest", str(installed)]) == 0
    assert cb.main(["--dest", str(installed), "--check"]) == 0


def test_a_stale_or_missing_build_fails_fast_with_how_to_build(
    installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cb.ARCH_ENV, raising=False)
    monkeypatch.delenv(cb.JIT_ENV, raising=False)
    _no_toolchain(monkeypatch)
    stale = tmp_path / "stale"
    shutil.copytree(installed, stale)
    _, manifest = cb.installed_paths(stale)
    data = json.loads(manifest.read_text())
    data["runtime"]["torch"] = "2.0.0+elsewhere"
    manifest.write_text(json.dumps(data))
    with pytest.raises(
        CpuAdamBuildError, match=r"(?s)stale: its torch differ.*python -m offload\.cpu_adam_build"
    ):
        cb.load(stale)
    assert cb.main(["--dest", str(stale), "--check"]) == 1
    with pytest.raises(CpuAdamBuildError, match=r"(?s)is not built.*ZENFLOW_CPU_ADAM_JIT=1"):
        cb.load(tmp_path / "nothing")
    # another ISA asked for than the installed one was built with: stale too (not silently ignored)
    monkeypatch.setenv(cb.ARCH_ENV, "-march=x86-64")
    with pytest.raises(CpuAdamBuildError, match="cflags"):
        cb.load(installed)
    # with the development setting, the JIT build takes over
    sentinel = object()
    monkeypatch.setattr(cb, "load_jit", lambda *a, **k: sentinel)
    monkeypatch.setenv(cb.JIT_ENV, "1")
    assert cb.load(stale) is sentinel


@pytest.mark.slow
def test_installing_the_package_builds_it(tmp_path: Path) -> None:
    """``pip wheel --no-build-isolation`` (what an install runs): setup.py's build_ext puts the build and
    its manifest into the wheel, for this torch, without the lock file, in a platform wheel."""
    import zipfile

    try:
        cb.check_toolchain()
    except CpuAdamBuildError as exc:  # pragma: no cover - only without a toolchain
        unavailable(f"no toolchain: {exc}")
    src = tmp_path / "src"
    src.mkdir()
    for f in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / f, src / f)
    skip = shutil.ignore_patterns("__pycache__", "_ext", "*.egg-info")
    for pkg in ("api", "worker", "trainer", "offload", "store", "migrations", "bench"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=skip)
    env = {**os.environ, "ZENFLOW_CPU_ADAM_BUILD": "require", "PIP_NO_INDEX": "1"}
    env.pop(cb.ARCH_ENV, None)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps"]
    done = subprocess.run(
        [*cmd, "-w", str(tmp_path / "out"), str(src)], env=env, capture_output=True, text=True, timeout=800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "out").glob("zenflow-*.whl")
    assert "-none-any" not in wheel.name, wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        manifest = json.loads(z.read("offload/_ext/zenflow_cpu_adam.json"))
    assert "offload/_ext/zenflow_cpu_adam.so" in names
    assert f"offload/_ext/{cb.LOCK_FILE}" not in names
    assert manifest["runtime"] == cb.runtime_inputs()
