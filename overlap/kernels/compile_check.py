"""Compile every GPU kernel for given architectures on a machine without a GPU, the way the
runtime compiles it; one line per kernel x arch, exit status 1 naming what failed.

    python -m overlap.kernels.compile_check [--nvrtc] [--triton] [--arch 80,90]

NVRTC: each csrc/*.cu through cupy's own NVRTC call with the options ``cupy.RawModule``
(overlap.kernels.cuda.load_module) hands it. Triton: each registered Triton kernel (registry.py)
through ``triton.compile`` with the constexprs, argument types and options of its GPU launches
(the ``compile_specs()`` next to each launcher), in a process with TRITON_INTERPRET=0.
The narrative: docs/design/kernels.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import os
import subprocess
import sys
import time

__all__ = ["Result", "check_nvrtc", "check_triton", "triton_specs", "cupy_nvrtc_options",
           "SHARED_PER_BLOCK", "main"]


@dataclasses.dataclass(slots=True)
class Result:
    tool: str  # "nvrtc 12.9" or "triton 3.9.0"
    arch: str  # "sm_90"
    kernel: str  # a source file (NVRTC) or a kernel and its launch variant (Triton)
    error: str = ""  # empty: compiled
    seconds: float = 0.0

    def line(self) -> str:
        verdict = f"FAILED: {self.error}" if self.error else "ok"
        return f"{self.tool:<13} {self.arch:<6} {self.kernel:<58} {verdict} ({self.seconds:.1f}s)"


def _echo(r: Result, echo: bool) -> Result:
    if echo:
        print(r.line(), flush=True)
    return r


def _last_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


# ---- NVRTC: csrc/*.cu ----------------------------------------------------------------------

def cupy_nvrtc_options(src_dir) -> tuple[str, ...]:
    """What NVRTC gets from ``cupy.RawModule(code=..., options=nvrtc_options(src_dir))``, less
    the two options cupy adds last at the NVRTC call itself (``-arch`` and
    ``--device-as-default-execution-space``, plus ``--pch`` from NVRTC 12.8), which
    ``compiler.compile_using_nvrtc`` adds here too. RawModule's path (cupy 14):
    ``_core.core.compile_with_cache`` -> ``assemble_cupy_compiler_options`` (cupy's CCCL,
    its include dir and the CUDA headers' dir around ours) -> ``cuda.compiler.
    _compile_with_cache_cuda`` (appends ``-ftz=true``) -> ``_compile_using_nvrtc_no_warning``."""
    from cupy._core import core

    from overlap.kernels.cuda import nvrtc_options

    return core.assemble_cupy_compiler_options(nvrtc_options(src_dir)) + ("-ftz=true",)


@contextlib.contextmanager
def _explicit_arch(compiler):
    """cupy's ``_get_arch_for_options_for_nvrtc`` asks the current device (runtime.getDevice,
    which needs a driver) even when given an arch; put in its rule for a given arch: a cubin
    for an arch NVRTC knows, else PTX."""
    real = compiler._get_arch_for_options_for_nvrtc

    def rule(arch=None):
        if not compiler._use_ptx and int(arch) <= int(compiler._get_max_compute_capability()):
            return f"-arch=sm_{arch}", "cubin"
        return f"-arch=compute_{arch}", "ptx"

    compiler._get_arch_for_options_for_nvrtc = rule
    try:
        yield
    finally:
        compiler._get_arch_for_options_for_nvrtc = real


def check_nvrtc(archs: list[int], *, echo: bool = False) -> list[Result]:
    """Compile each csrc/*.cu for each arch; a result fails on a compile error or when a
    registered kernel of the file is missing from the binary (a name cupy would not find)."""
    from overlap.kernels import registry
    from overlap.kernels.cuda import csrc_dir

    try:
        from cupy.cuda import compiler
    except ImportError as exc:
        return [_echo(Result("nvrtc", "-", "csrc/*.cu", f"cupy is not installed ({exc}); "
                             "pip install -e '.[test]' brings cupy-cuda12x and NVRTC"), echo)]
    src = csrc_dir()
    try:
        tool = "nvrtc %d.%d" % compiler._get_nvrtc_version()
        options = cupy_nvrtc_options(src)
    except Exception as exc:  # noqa: BLE001 - NVRTC or the CUDA headers missing: reported
        return [_echo(Result("nvrtc", "-", "csrc/*.cu", _last_line(exc)), echo)]
    results = []
    with _explicit_arch(compiler):
        for cu in sorted(src.glob("*.cu")):
            code = cu.read_text()
            names = [k.name for k in registry.KERNELS.values() if k.source == f"csrc/{cu.name}"]
            for arch in archs:
                r = Result(tool, f"sm_{arch}", f"csrc/{cu.name}")
                t0 = time.perf_counter()
                try:
                    binary, _ = compiler.compile_using_nvrtc(code, options=options,
                                                             arch=str(arch), filename=cu.name)
                    binary = binary if isinstance(binary, bytes) else binary.encode()
                    missing = [n for n in names if n.encode() not in binary]
                    if missing:
                        r.error = f"kernels missing from the binary: {missing}"
                except compiler.CompileException as exc:
                    first = [ln for ln in str(exc).splitlines() if "error" in ln]
                    r.error = (first or [_last_line(exc)])[0].strip()
                r.seconds = time.perf_counter() - t0
                results.append(_echo(r, echo))
    return results


# ---- Triton: the registered kernels --------------------------------------------------------

def triton_specs(arch: int | None = None) -> tuple[list, list[str]]:
    """(every CompileSpec of the registered Triton kernels, the registered Triton kernels
    without one), from the ``compile_specs()`` of each kernel's source module; one that takes
    ``arch`` (launch variants that depend on the GPU, such as GEMM tiles) gets it."""
    from overlap.kernels import registry

    specs, names = [], set()
    modules = {}
    for info in registry.KERNELS.values():
        if info.source.startswith("overlap/kernels/triton/"):
            names.add(info.name)
            modules.setdefault(info.source, importlib.import_module(
                info.source[:-3].replace("/", ".")))
    for mod in modules.values():
        make = getattr(mod, "compile_specs", list)
        takes_arch = "arch" in inspect.signature(make).parameters
        specs += make(arch=arch) if takes_arch else make()
    have = {s.name for s in specs}
    return [s for s in specs if s.name in names], sorted(names - have)


# Shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin): A100, H100/H200,
# and the 99 KB of sm_86/sm_89; a compiled kernel needing more would not launch.
SHARED_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def check_triton(archs: list[int], *, echo: bool = False) -> list[Result]:
    """Compile every launch variant of every registered Triton kernel for each arch, and check
    its shared memory against the arch's per-block limit. Needs a process whose Triton was
    imported with TRITON_INTERPRET=0 (``main`` starts one)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    from overlap.kernels.triton import INTERPRET

    if INTERPRET:
        raise RuntimeError("check_triton: this process runs Triton's interpreter; run "
                           "`python -m overlap.kernels.compile_check --triton` instead")
    tool = f"triton {triton.__version__}"
    results = []
    for arch in archs:
        specs, missing = triton_specs(arch)
        results += [_echo(Result(tool, f"sm_{arch}", name, "no compile spec: add it to its "
                                 "module's compile_specs()"), echo) for name in missing]
        target = GPUTarget("cuda", arch, 32)
        # Torch's allocations are 16-byte aligned, so the runtime specialises pointers so.
        aligned = make_backend(target).parse_attr("D")
        for spec in specs:
            signature = spec.signature()
            attrs = {(i,): aligned for i, ty in enumerate(signature.values())
                     if ty.startswith("*")}
            label = f"{spec.name} [{spec.variant}]" if spec.variant else spec.name
            r = Result(tool, f"sm_{arch}", label)
            t0 = time.perf_counter()
            try:
                kernel = triton.compile(ASTSource(spec.kernel, signature,
                                                  constexprs=spec.constexprs(), attrs=attrs),
                                        target=target, options=spec.options())
                shared, limit = kernel.metadata.shared, SHARED_PER_BLOCK.get(arch)
                if limit is not None and shared > limit:
                    r.error = f"needs {shared} bytes of shared memory, sm_{arch} has {limit}"
            except Exception as exc:  # noqa: BLE001 - every failure is reported, none hidden
                r.error = _last_line(exc)
            r.seconds = time.perf_counter() - t0
            results.append(_echo(r, echo))
    return results


def _triton_in_child(archs: list[int]) -> int:
    """Triton picks interpreter or compiler at import, and ``import overlap`` chose the
    interpreter here (no GPU): compile in a fresh process with TRITON_INTERPRET=0."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    cmd = [sys.executable, "-m", "overlap.kernels.compile_check", "--triton",
           "--arch", ",".join(map(str, archs))]
    return subprocess.run(cmd, env=env).returncode


def _verdict(results: list[Result]) -> int:
    """Print one summary line for ``results``; 1 if any failed."""
    failed = [r for r in results if r.error]
    if failed:
        names = sorted({f"{r.tool} {r.kernel.split(' [')[0]}" for r in failed})
        print(f"compile-check: {len(failed)} of {len(results)} compilations FAILED, in: "
              + ", ".join(names), flush=True)
        return 1
    print(f"compile-check: {len(results)} compilations passed "
          f"({sum(r.seconds for r in results):.0f}s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m overlap.kernels.compile_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvrtc", action="store_true", help="csrc/*.cu with NVRTC (cupy)")
    ap.add_argument("--triton", action="store_true", help="the registered Triton kernels")
    ap.add_argument("--arch", default="80,90", help="compute capabilities (default 80,90)")
    args = ap.parse_args(argv)
    archs = [int(a) for a in args.arch.split(",")]
    both = not (args.nvrtc or args.triton)
    rc = 0
    if args.nvrtc or both:
        rc |= _verdict(check_nvrtc(archs, echo=True))
    if args.triton or both:
        if os.environ.get("TRITON_INTERPRET") == "0":
            rc |= _verdict(check_triton(archs, echo=True))
        else:
            rc |= int(_triton_in_child(archs) != 0)  # it prints its own lines and verdict
    return rc


if __name__ == "__main__":
    sys.exit(main())
