"""llama.cpp for the peer benchmark: `llama-server` and `llama-quantize` built here from the
llama.cpp tree that the llama-cpp-python source distribution vendors, once, into a cache.

Steps (each skipped when its output is already in the cache):
1. `pip download --no-deps --no-binary :all: llama-cpp-python==<pinned>` (a PyPI package, so
   the ordinary package client fetches it);
2. unpack it; the llama.cpp commit is read from the package's CHANGELOG ("update llama.cpp to
   ggml-org/llama.cpp@<commit>"), since the vendored tree has no git history;
3. cmake configure (Release, CPU only with -march=native, static, no UI, no TLS, no tests or
   examples; AMX left out where this CPU lists it but it traps: `amx_runs`) and build the
   two targets with -j<jobs>; copy the binaries to <cache>/bin and write version.json (the
   version and the build's options: a cached build made with other options is redone).

Never part of `make test` or CI: only `tiergate bench peer --compare-llamacpp` calls it.
The model types the benchmark compares are written by the built llama-quantize beside the
binaries (`quantized_model`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from bench.serve.errors import BenchServeError

__all__ = [
    "LLAMA_CPP_PYTHON_VERSION",
    "LlamaCppBuild",
    "LlamaCppBuildError",
    "LlamaCppVersion",
    "amx_runs",
    "changelog_commit",
    "cmake_configure_args",
    "default_cache_dir",
    "ensure_built",
    "quantized_model",
]

# The llama-cpp-python release whose vendored llama.cpp is built (its CHANGELOG names the
# llama.cpp commit).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_TARGETS = ("llama-server", "llama-quantize")
# Bumped when the build's options change, so that a cached build made otherwise is redone.
_RECIPE = 2
# Model types llama-quantize writes from the default model's GGUF (--allow-requantize).
MODEL_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M")
# Types llama-quantize writes as its mixtures (some matrices in other types, as the files people
# download are); the others are written --pure, every matrix in the type.
MIXTURES = ("Q4_K_M",)


class LlamaCppBuildError(BenchServeError):
    """Fetching, building or quantizing failed; the message ends with the log's tail."""


@dataclass(frozen=True)
class LlamaCppVersion:
    package_version: str  # llama-cpp-python's
    llama_cpp_commit: str | None  # from its CHANGELOG; None when not found
    ggml_version: str | None  # ggml/CMakeLists.txt's GGML_VERSION_{MAJOR,MINOR,PATCH}
    server_version: str | None = None  # `llama-server --version`'s first lines
    build_note: str | None = None  # what the build left out on this machine, and why

    @property
    def label(self) -> str:
        parts = [f"llama.cpp {self.llama_cpp_commit or 'commit unknown'}"]
        if self.ggml_version:
            parts.append(f"ggml {self.ggml_version}")
        label = f"{', '.join(parts)} (vendored by llama-cpp-python {self.package_version})"
        return f"{label}; {self.build_note}" if self.build_note else label


@dataclass(frozen=True)
class LlamaCppBuild:
    root: Path  # the cache directory of this version
    server: Path
    quantize: Path
    version: LlamaCppVersion


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "tiergate" / "llama.cpp"


def changelog_commit(changelog: str, package_version: str) -> str | None:
    """The llama.cpp commit the CHANGELOG's section for package_version updates to (the
    first one named there), None if it names none."""
    section = re.search(
        rf"^## \[{re.escape(package_version)}\]\s*$(.*?)(?=^## \[|\Z)",
        changelog,
        flags=re.MULTILINE | re.DOTALL,
    )
    if section is None:
        return None
    commit = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1))
    return commit.group(1) if commit else None


def ggml_version(cmake_lists: str) -> str | None:
    parts = [
        re.search(rf"set\(GGML_VERSION_{name}\s+(\d+)\)", cmake_lists)
        for name in ("MAJOR", "MINOR", "PATCH")
    ]
    if any(p is None for p in parts):
        return None
    return ".".join(p.group(1) for p in parts if p is not None)


def cmake_configure_args(
    source_dir: Path, build_dir: Path, commit: str | None, *, amx: bool = True
) -> list[str]:
    """cmake's configure command: Release, CPU only (native instructions), static binaries,
    no embedded web UI (it would be downloaded), no TLS, no tests or examples. The commit is
    given to cmake, as the tree has no git history to read it from (`llama-server --version`
    then names it). amx=False keeps AMX instructions out of the native build (`-mno-amx-*`:
    explicit ISA flags win over -march=native's)."""
    args = [
        "cmake", "-S", str(source_dir), "-B", str(build_dir),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DGGML_NATIVE=ON",
        "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DGGML_RPC=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",  # (this version has no CURL option any more: only a warning)
    ]  # fmt: skip
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    if commit:
        args.append(f"-DLLAMA_BUILD_COMMIT={commit}")
    if not amx:
        flags = " ".join(_NO_AMX_FLAGS)
        args += [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]
    return args


_NO_AMX_FLAGS = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
# C source that asks Linux for the AMX tile state and runs two AMX instructions: on some
# virtual machines the CPU flags and the kernel both say yes and the instructions still trap
# (SIGILL), and a native build's llama-server then dies loading a Q8_0 model (its AMX path).
_AMX_PROBE = r"""
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char config[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
    memset(config, 0, sizeof config);
    config[0] = 1;       /* palette 1 */
    config[16] = 64;     /* tile 0: 64 bytes a row */
    config[48] = 16;     /* tile 0: 16 rows */
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""


def amx_runs(work_dir: Path) -> bool:
    """Whether AMX instructions run here: False where the compiler cannot emit them (then a
    native build has none anyway), where the CPU lacks them, or where they trap."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    source, binary = work_dir / "amx_probe.c", work_dir / "amx_probe"
    source.write_text(_AMX_PROBE)
    try:
        compiled = subprocess.run(["cc", "-O1", "-mamx-tile", str(source), "-o", str(binary)],
                                  capture_output=True, check=False, timeout=120)
        if compiled.returncode != 0:
            return False
        return subprocess.run([str(binary)], capture_output=True, check=False,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        source.unlink(missing_ok=True)
        binary.unlink(missing_ok=True)


def _cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def ensure_built(
    cache_dir: Path | None = None,
    *,
    package_version: str = LLAMA_CPP_PYTHON_VERSION,
    jobs: int = 2,
    progress: TextIO | None = sys.stderr,
) -> LlamaCppBuild:
    """The binaries of this version, built into cache_dir/<version>/ on first use (minutes)."""
    root = (cache_dir or default_cache_dir()) / package_version
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".lock"):
        # AMX is left out where the CPU claims it but it traps; a build made with other
        # options than these is made again.
        amx = not _cpu_has_amx() or amx_runs(root)
        options: dict[str, object] = {"recipe": _RECIPE, "amx": amx}
        cached = _cached_build(root, options)
        if cached is not None:
            return cached
        _say(progress, f"building llama.cpp (llama-cpp-python {package_version}) into {root}; "
             f"log: {root / 'build.log'}")
        source = _fetch_source(root, package_version, progress)
        llama_dir = source / "vendor" / "llama.cpp"
        commit = changelog_commit(_read(source / "CHANGELOG.md"), package_version)
        note = None if amx else "built without AMX: this CPU lists it but its instructions trap"
        build_dir = root / "build"
        log_path = root / "build.log"
        with log_path.open("w") as log:
            _run(cmake_configure_args(llama_dir, build_dir, commit, amx=amx), log, log_path,
                 progress, "configuring")
            _run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
                  "--target", *_TARGETS], log, log_path, progress, "compiling")
        bin_dir = root / "bin"
        bin_dir.mkdir(exist_ok=True)
        for target in _TARGETS:
            built = build_dir / "bin" / target
            if not built.is_file():
                raise LlamaCppBuildError(f"the build made no {built}")
            shutil.copy2(built, bin_dir / target)
        version = LlamaCppVersion(
            package_version, commit, ggml_version(_read(llama_dir / "ggml" / "CMakeLists.txt")),
            _server_version(bin_dir / "llama-server"), note,
        )
        _write_atomic(root / "version.json",
                      json.dumps({**asdict(version), "build_options": options}, indent=2))
        _say(progress, f"built {version.label}")
        cached = _cached_build(root, options)
        assert cached is not None
        return cached


def quantized_model(build: LlamaCppBuild, source: Path, model_type: str,
                    progress: TextIO | None = sys.stderr) -> Path:
    """source converted to model_type by llama-quantize (--allow-requantize: from any type;
    every tensor to model_type with --pure but for MIXTURES), cached under build.root/models/;
    the name holds the source's identity, so a changed source is converted again."""
    if model_type not in MODEL_TYPES:
        raise LlamaCppBuildError(f"model type {model_type!r}: one of {', '.join(MODEL_TYPES)}")
    stat = source.stat()
    identity = hashlib.sha256(
        f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:12]
    target = build.root / "models" / f"{source.stem}-{identity}-{model_type}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / ".lock"):
        if target.is_file():
            return target
        _say(progress, f"writing {target.name} with llama-quantize")
        partial = target.with_suffix(".partial")
        log_path = target.with_suffix(".log")
        with log_path.open("w") as log:
            pure = [] if model_type in MIXTURES else ["--pure"]
            _run([str(build.quantize), "--allow-requantize", *pure, str(source),
                  str(partial), model_type], log, log_path, None, "quantizing")
        os.replace(partial, target)
    return target


# -- steps -------------------------------------------------------------------------------------


def _cached_build(root: Path, options: dict[str, object]) -> LlamaCppBuild | None:
    """The build in root if it is complete and was made with these options."""
    server, quantize = root / "bin" / "llama-server", root / "bin" / "llama-quantize"
    version_file = root / "version.json"
    if not (server.is_file() and quantize.is_file() and version_file.is_file()):
        return None
    try:
        recorded = json.loads(version_file.read_text())
        if recorded.pop("build_options", None) != options:
            return None
        version = LlamaCppVersion(**recorded)
    except (ValueError, TypeError):
        return None
    return LlamaCppBuild(root, server, quantize, version)


def _fetch_source(root: Path, package_version: str, progress: TextIO | None) -> Path:
    """The unpacked sdist, root/src/llama_cpp_python-<version>/."""
    unpacked = root / "src" / f"llama_cpp_python-{package_version}"
    if (unpacked / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return unpacked
    sdist_dir = root / "sdist"
    sdists = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        _say(progress, f"pip download llama-cpp-python=={package_version} (source)")
        sdist_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--quiet", "--dest", str(sdist_dir), f"llama-cpp-python=={package_version}",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        sdists = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not sdists:
            raise LlamaCppBuildError(
                f"pip download llama-cpp-python=={package_version} failed: "
                f"{(done.stderr or done.stdout).strip()[-2000:] or 'no source distribution'}"
            )
    _say(progress, f"unpacking {sdists[0].name}")
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=root))
    try:
        with tarfile.open(sdists[0]) as archive:
            archive.extractall(staging, filter="data")
        (root / "src").mkdir(exist_ok=True)
        shutil.rmtree(unpacked, ignore_errors=True)
        os.replace(staging / unpacked.name, unpacked)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return unpacked


def _run(command: list[str], log: TextIO, log_path: Path, progress: TextIO | None,
         doing: str) -> None:
    _say(progress, f"{doing}: {' '.join(command)}")
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        log.flush()
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise LlamaCppBuildError(
            f"{doing} failed (exit {done.returncode}); end of {log_path}:\n{tail}"
        )


def _server_version(server: Path) -> str | None:
    try:
        done = subprocess.run([str(server), "--version"], capture_output=True, text=True,
                              timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines()]
    wanted = [line for line in lines if line.startswith(("version:", "built with"))]
    return "; ".join(wanted) or None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder at a time per cache directory (two benchmarks started together)."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _say(progress: TextIO | None, message: str) -> None:
    if progress is not None:
        print(f"[llama.cpp] {message}", file=progress, flush=True)
