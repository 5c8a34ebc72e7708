"""The GPU kernels compile as the runtime compiles them, on this machine without a GPU
(docs/cpu-twins.md): every csrc/*.cu through cupy's NVRTC call with the loader's options, and
every registered Triton kernel through Triton's compiler with the specialisation of its GPU
launches, each for sm_80 and sm_90; Triton both as installed here (the newest supported) and
at the oldest supported release, provisioned beside the venv. Each runs
``python -m overlap.kernels.compile_check`` in a fresh process, as CI does."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from overlap.kernels import compile_check, registry

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

ROOT = Path(__file__).resolve().parent.parent
OLDEST_TRITON = "3.4.0"  # the oldest Triton pyproject admits
ARCHS = ("sm_80", "sm_90")


def _compile_check(*args: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "overlap.kernels.compile_check", *args],
                          env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT)


def _assert_every_line_ok(run, kernels, tool_prefix):
    out, rc = run.stdout, run.returncode
    assert rc == 0, f"compile check failed:\n{out[-6000:]}\n{run.stderr[-3000:]}"
    for kernel in kernels:
        for arch in ARCHS:
            pat = rf"^{tool_prefix}\b.*\s{arch}\s+{re.escape(kernel)}\b.* ok \("
            assert re.search(pat, out, re.M), f"no passing {arch} line for {kernel}:\n{out}"


def test_nvrtc_compiles_every_cu_for_sm80_and_sm90():
    cus = [f"csrc/{p.name}" for p in sorted((ROOT / "csrc").glob("*.cu"))]
    assert len(cus) >= 2
    _assert_every_line_ok(_compile_check("--nvrtc"), cus, "nvrtc")


def test_the_nvrtc_options_are_the_loaders_with_cupys_additions():
    """The loader's options reach NVRTC unchanged, with what cupy's RawModule path adds."""
    from overlap.kernels.cuda import nvrtc_options

    src = ROOT / "csrc"
    options = compile_check.cupy_nvrtc_options(src)
    mine = nvrtc_options(src)
    at = options.index(mine[0])
    assert options[at:at + len(mine)] == mine
    assert options[-1] == "-ftz=true"
    assert not [o for o in options if o.startswith(("-arch", "--gpu-architecture"))]


def test_every_registered_triton_kernel_has_a_compile_spec():
    specs, missing = compile_check.triton_specs()
    assert missing == [], f"registered Triton kernels without a compile spec: {missing}"
    triton_kernels = {k.name for k in registry.KERNELS.values()
                      if k.source.startswith("overlap/kernels/triton/")}
    assert {s.name for s in specs} == triton_kernels
    for spec in specs:
        spec.signature()  # every argument typed or constexpr, nothing extra


def _triton_kernels():
    return sorted(k.name for k in registry.KERNELS.values()
                  if k.source.startswith("overlap/kernels/triton/"))


def test_triton_kernels_compile_on_the_installed_triton():
    import triton

    run = _compile_check("--triton")
    _assert_every_line_ok(run, _triton_kernels(), f"triton {re.escape(triton.__version__)}")


def _oldest_triton() -> Path:
    """Triton OLDEST_TRITON in its own folder (under $OVERLAP_CACHE_DIR, default
    ~/.cache/overlap), installed once with pip beside the venv's own Triton."""
    base = Path(os.environ.get("OVERLAP_CACHE_DIR") or Path.home() / ".cache" / "overlap")
    target = base / f"triton-{OLDEST_TRITON}"
    if (target / "triton" / "__init__.py").is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=target.name + ".", dir=base)
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                          "--target", staging, f"triton=={OLDEST_TRITON}"],
                         capture_output=True, text=True, timeout=1200)
    if run.returncode != 0:
        pytest.fail(f"could not install triton=={OLDEST_TRITON} into {staging} to compile the "
                    f"kernels with the oldest supported Triton (pip exit {run.returncode}):\n"
                    f"{run.stderr[-2000:]}")
    try:
        os.rename(staging, target)  # atomic: a concurrent run that got there first wins
    except OSError:
        subprocess.run(["rm", "-rf", staging], check=False)
    return target


def test_triton_kernels_compile_on_the_oldest_supported_triton():
    run = _compile_check("--triton", pythonpath=str(_oldest_triton()))
    _assert_every_line_ok(run, _triton_kernels(), f"triton {re.escape(OLDEST_TRITON)}")


def test_ci_runs_the_compile_check_on_both_tritons():
    """.ci/run runs .ci/gpu_compile.sh, which compiles NVRTC and both Triton releases for
    sm_80 and sm_90 (the test above reuses its oldest Triton through OVERLAP_CACHE_DIR)."""
    run = (ROOT / ".ci" / "run").read_text()
    script = (ROOT / ".ci" / "gpu_compile.sh").read_text()
    assert "bash .ci/gpu_compile.sh" in run and "export OVERLAP_CACHE_DIR=" in run
    assert "bash .ci/nvcc_check.sh" in run  # warnings as errors, which NVRTC does not check
    assert script.count("--arch 80,90") == 3 and "--nvrtc" in script
    assert 'PYTHONPATH="$old_triton' in script and "OLDEST_TRITON" in script
