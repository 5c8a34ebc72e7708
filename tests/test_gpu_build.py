"""GPU build details that a CPU machine can check: the NVRTC options cupy gets, torch symmetric
memory set-up (registering the group, saying which memory path was taken), the CUDA quantization
kernels' launch arguments against their signatures (and, through a CPU twin of the launch, against
overlap._C), the Triton quantization kernels compiling for sm_80/sm_90, and the triton pin."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from overlap import _C  # noqa: E402
from overlap.comm.quant import kernels as qk  # noqa: E402
from overlap.kernels import cuda as kc  # noqa: E402
from overlap.symm import cuda as sc  # noqa: E402

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

ROOT = Path(__file__).resolve().parent.parent


# ---- 1. NVRTC options: cupy adds the one -arch ---------------------------------------------

def _arch_options(options):
    return [o for o in options if o.split("=")[0] in kc.ARCH_OPTIONS]


def test_nvrtc_options_leave_the_arch_to_cupy():
    assert _arch_options(kc.nvrtc_options(Path("/src"))) == []
    assert "-I/src" in kc.nvrtc_options(Path("/src"))


def test_load_module_passes_cupy_no_second_arch(monkeypatch):
    """A fake cupy that adds its own -arch, as cupy's compile step does: exactly one results."""
    seen = []

    class RawModule:
        def __init__(self, code, options):
            seen.append(tuple(options) + ("-arch=sm_90", "-ftz=true"))  # cupy's own additions

    class Device:
        def __init__(self, index):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake = types.SimpleNamespace(RawModule=RawModule, cuda=types.SimpleNamespace(Device=Device))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setenv("OVERLAP_CSRC", str(ROOT / "csrc"))
    kc.load_module.cache_clear()
    try:
        kc.load_module("quant.cu", 0)
    finally:
        kc.load_module.cache_clear()
    assert len(seen) == 1 and len(_arch_options(seen[0])) == 1, seen


# ---- 2. torch symmetric memory set-up -----------------------------------------------------

class _Handle:
    buffer_ptrs = (4096, 8192)


def _fake_symm_mem(*, with_enable=True, rendezvous_error=None):
    calls = {"enable": [], "rendezvous": []}
    mod = types.ModuleType("torch.distributed._symmetric_memory")
    mod.empty = lambda n, dtype, device: torch.empty(n, dtype=dtype)

    def rendezvous(tensor, group):
        calls["rendezvous"].append(group)
        if rendezvous_error:
            raise RuntimeError(rendezvous_error)
        return _Handle()

    mod.rendezvous = rendezvous
    if with_enable:
        def enable(group_name):
            warnings.warn("`enable_symm_mem_for_group` is deprecated.", FutureWarning)
            calls["enable"].append(group_name)

        mod.enable_symm_mem_for_group = enable
        mod.is_symm_mem_enabled_for_group = lambda name: name in calls["enable"]
    return mod, calls


def _bare_workspace(monkeypatch, symm_mem):
    """A CudaWorkspace with only the fields the memory set-up reads (no GPU, no process group)."""
    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", symm_mem)
    monkeypatch.setattr(torch.distributed, "_symmetric_memory", symm_mem, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    ws = object.__new__(sc.CudaWorkspace)
    ws.group = types.SimpleNamespace(group_name="17")
    ws.group_name, ws.rank, ws.world, ws.nbytes, ws.num_signals = "[0, 1]", 0, 2, 1024, 4
    ws.device, ws._total, ws._handle = torch.device("cpu"), 2048, None
    ws._sharing = []  # what _check_agreement finds: no two ranks on one device
    return ws


def test_symmetric_memory_registers_the_group_first(monkeypatch):
    mod, calls = _fake_symm_mem()
    ws = _bare_workspace(monkeypatch, mod)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecation warning of newer torch stays inside
        ws._setup_memory()
    assert calls == {"enable": ["17"], "rendezvous": ["17"]}
    assert ws.memory == sc.SYMMETRIC_MEMORY and ws.memory_fallback == ""
    assert ws._bases == [4096, 8192]
    assert "memory=symmetric memory" in repr(ws)
    assert sc.enable_symm_mem(mod, "17") is False  # already enabled: no second call


def test_symmetric_memory_without_enable_function(monkeypatch):
    mod, calls = _fake_symm_mem(with_enable=False)  # a torch that dropped the deprecated call
    ws = _bare_workspace(monkeypatch, mod)
    ws._setup_memory()
    assert calls["rendezvous"] == ["17"] and ws.memory == sc.SYMMETRIC_MEMORY


def test_fallback_to_ipc_is_visible(monkeypatch):
    mod, _ = _fake_symm_mem(rendezvous_error="SymmetricMemory: group 17 is not registered")
    ws = _bare_workspace(monkeypatch, mod)
    monkeypatch.setattr(sc.CudaWorkspace, "_setup_ipc", lambda self: setattr(self, "_bases", [1]))
    ws._setup_memory()
    assert ws.memory == sc.CUDA_IPC and "not registered" in ws.memory_fallback
    assert ws._handle is None and "memory=CUDA IPC" in repr(ws)


def test_ranks_sharing_a_gpu_take_ipc_and_say_why(monkeypatch):
    """torch's symmetric memory takes one rank per device: ranks sharing one (ranks per GPU > 1)
    map each other by CUDA IPC without asking it, and the workspace says why, once."""
    mod, calls = _fake_symm_mem()
    ws = _bare_workspace(monkeypatch, mod)
    ws._sharing = [[0, 1]]
    monkeypatch.setattr(sc.CudaWorkspace, "_setup_ipc", lambda self: setattr(self, "_bases", [1]))
    monkeypatch.setattr(sc, "_warned", set())
    with pytest.warns(RuntimeWarning, match=r"ranks \[\[0, 1\]\] share a GPU"):
        ws._setup_memory()
    assert calls == {"enable": [], "rendezvous": []}
    assert ws.memory == sc.CUDA_IPC and "share a GPU" in ws.memory_fallback
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second workspace: no second warning
        ws._setup_memory()


# ---- 4. csrc/quant.cu: launch arguments ---------------------------------------------------

_NP = {"int64_t": np.int64, "int": np.int32, "uint32_t": np.uint32, "float": np.float32}


def _kernel_params(name):
    src = (ROOT / "csrc" / "quant.cu").read_text()
    m = re.search(r'extern "C" __global__ void ' + name + r"\((.*?)\)\s*\{", src, re.S)
    assert m, name
    params = []
    for p in m.group(1).split(","):
        ctype, pname = p.strip().rsplit(" ", 1)
        ctype = ctype.replace("const ", "")
        params.append((pname.lstrip("*"), np.uint64 if "*" in p else _NP[ctype]))
    return params


KERNELS = ["overlap_quantize_blocks", "overlap_dequantize_blocks",
           "overlap_dequant_reduce_blocks"]


class _CudaTwin:
    """Stands in for launch_kernel: reads the arguments by the kernel's parameter names and runs
    the same blocks with overlap._C, so a wrong order, pointer or stride shows up as wrong bytes."""

    def __init__(self):
        self.launches = []

    def __call__(self, filename, name, grid, block, args, device):
        assert filename == "quant.cu"
        params = _kernel_params(name)
        assert [type(a) for a in args] == [t for _, t in params], name
        a = {p: int(v) if not isinstance(v, np.float32) else float(v)
             for (p, _), v in zip(params, args)}
        assert block[0] <= 1024 and block[0] & (block[0] - 1) == 0
        self.launches.append(name)
        if name == "overlap_quantize_blocks":
            assert block[0] <= a["block"]
            rows = grid[0] // (a["row_len"] // a["block"])
            _C.quantize_blocks(a["x"], a["dtype"], a["numel"], a["flat_row"], rows, a["row_len"],
                               a["block"], a["q"], a["q_stride"], a["s"], a["s_stride"],
                               bool(a["stochastic"]), a["key"], a["index_base"], 1)
        elif name == "overlap_dequantize_blocks":
            rows = -(-a["numel"] // a["flat_row"])
            row_len = -(-a["flat_row"] // a["block"]) * a["block"]
            _C.dequantize_blocks(a["q"], a["q_stride"], a["s"], a["s_stride"], rows, row_len,
                                 a["block"], a["out"], a["numel"], a["flat_row"], 1)
        else:
            assert a["block"] <= 4096  # the kernel's shared accumulator
            _C.dequant_reduce_blocks(a["q"], a["q_stride"], a["s"], a["s_stride"], a["num_src"],
                                     grid[0] * a["block"], a["block"], a["divisor"], a["out"],
                                     a["q_out"], a["s_out"], bool(a["stochastic"]), a["key"],
                                     a["index_base"], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stochastic", [False, True])
def test_cuda_impl_launches_match_cpp(monkeypatch, dtype, stochastic):
    twin = _CudaTwin()
    monkeypatch.setattr(kc, "launch_kernel", twin)
    monkeypatch.setattr(qk, "resolve_impl", lambda impl, device: impl)  # CPU tensors, "cuda"
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(1000, generator=g) * torch.logspace(-5, 5, 1000)).to(dtype)
    rows, flat_row, block = 4, 250, 32
    row_len = -(-flat_row // block) * block
    res = {}
    for impl in ("cpp", "cuda"):
        wire = torch.zeros(rows, row_len + 4 * (row_len // block), dtype=torch.uint8)
        q, s = wire[:, :row_len].view(torch.int8), wire[:, row_len:].view(torch.float32)
        qk.quantize_into(x, q, s, block=block, flat_row=flat_row, stochastic=stochastic, key=7,
                         index_base=3, impl=impl)
        d = torch.empty(x.numel())
        qk.dequantize_into(q, s, d, block=block, flat_row=flat_row, impl=impl)
        q_out, s_out = torch.empty(row_len, dtype=torch.int8), torch.empty(row_len // block)
        out = torch.empty(row_len)
        qk.dequant_reduce_into(q, s, block=block, divisor=4.0, q_out=q_out, s_out=s_out,
                               stochastic=stochastic, key=7, impl=impl)
        qk.dequant_reduce_into(q, s, block=block, divisor=1.0, out=out, impl=impl)
        res[impl] = (wire, d.view(torch.int32), q_out, s_out.view(torch.int32),
                     out.view(torch.int32))
    assert twin.launches == KERNELS + ["overlap_dequant_reduce_blocks"]
    for a, b in zip(res["cpp"], res["cuda"]):
        assert torch.equal(a, b)


def test_launch_helpers_mirror_the_cpp_signatures():
    """kc.<name>(*args) takes what overlap._C.<name> takes, less num_threads."""
    for launch, cfn in ((kc.quantize_launch, _C.quantize_blocks),
                        (kc.dequantize_launch, _C.dequantize_blocks),
                        (kc.dequant_reduce_launch, _C.dequant_reduce_blocks)):
        cpp = re.search(r"\((.*?)\) ->", cfn.__doc__).group(1)
        cpp_names = [p.split(":")[0].strip() for p in cpp.split(",")]
        names = list(launch.__code__.co_varnames[:launch.__code__.co_argcount])
        assert cpp_names == names + ["num_threads"], cfn.__name__


def test_impl_selection(monkeypatch):
    import importlib.util

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert qk.resolve_impl("auto", cpu) == "cpp"
    with pytest.raises(ValueError, match="impl 'cuda' needs CUDA tensors"):
        qk.resolve_impl("cuda", cpu)
    qk.triton_available.cache_clear()
    try:
        assert qk.resolve_impl("auto", cuda) == "triton"
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda n, *a: None if n == "triton" else real(n, *a))
        qk.triton_available.cache_clear()
        assert qk.resolve_impl("auto", cuda) == "cuda"  # the CUDA kernels where Triton is absent
    finally:
        monkeypatch.undo()
        qk.triton_available.cache_clear()


def test_nvcc_check_compiles_quant_cu():
    script = (ROOT / ".ci" / "nvcc_check.sh").read_text()
    assert "csrc/*.cu" in script  # quant.cu stays in the compile check


# ---- Triton quantization kernels compile (the interpreter accepts what ptxas would not) ------

_COMPILE = textwrap.dedent("""
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from overlap.kernels.triton import quant as tq

    ptr = {"x_ptr": "*fp32", "q_ptr": "*i8", "s_ptr": "*fp32", "out_ptr": "*fp32",
           "q_out_ptr": "*i8", "s_out_ptr": "*fp32"}
    flt = {"divisor": "fp32"}
    small = {"key", "num_src", "num_blocks"}
    jobs = [(tq._quantize_kernel, dict(BLOCK=128, GROUP=32, STOCHASTIC=True, BF16_BITS=False,
                                       DENSE=True, Q_ALIGN=16)),
            (tq._dequantize_kernel, dict(BLOCK=128, GROUP=32, DENSE=True, Q_ALIGN=16)),
            (tq._dequant_reduce_kernel, dict(BLOCK=128, GROUP=32, HAS_DIV=True, REQUANT=True,
                                              STOCHASTIC=True, Q_ALIGN=16))]
    out = {}
    for cc in (80, 90):
        for fn, consts in jobs:
            sig = {a: "constexpr" if a in consts else ptr.get(a, flt.get(
                   a, "i32" if a in small else "i64")) for a in fn.arg_names}
            k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                               target=GPUTarget("cuda", cc, 32),
                               options={"enable_fp_fusion": False})
            out[f"sm_{cc} {fn.__name__}"] = k.asm["ptx"]
    json.dump(out, sys.stdout)
""")


def test_triton_quant_kernels_compile_for_sm80_and_sm90():
    pytest.importorskip("triton.backends.nvidia.compiler")
    import json

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="0")
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    ptx = json.loads(run.stdout)
    assert len(ptx) == 6
    for name, code in ptx.items():
        assert "div.rn" in code or "dequantize" in name, name  # IEEE division, never approximate
        assert "fma.rn.f32" not in code, name  # enable_fp_fusion=False holds


# ---- 3. the triton pin --------------------------------------------------------------------

def test_triton_pin_is_the_oldest_compile_checked_release():
    """pyproject's Triton floor is the release tests/test_gpu_compile.py compiles every kernel
    with, and the kernels use no tl API newer than it: tl.atomic_load/atomic_store exist only
    from 3.9 (the first GPU run, on 3.6, failed on them); tp_sync's load_acquire/store_release
    stand in for them."""
    import triton

    text = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"triton>=(\d+)\.(\d+)', text)
    oldest = re.search(r'OLDEST_TRITON = "(\d+)\.(\d+)',
                       (ROOT / "tests" / "test_gpu_compile.py").read_text())
    assert pin and oldest and pin.groups() == oldest.groups() == ("3", "4")
    have = tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", triton.__version__).groups())
    assert have >= (3, 4)
    for f in (ROOT / "overlap" / "kernels" / "triton").glob("*.py"):
        used = re.findall(r"tl\.atomic_(?:load|store)\(", f.read_text())
        assert not used, f"{f.name} calls {used} (Triton 3.9+ only)"
