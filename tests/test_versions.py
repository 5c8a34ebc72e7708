"""Which torch and Triton overlap runs with, and what it says otherwise: a communicator refuses
an unsupported torch, and a Triton backend or kernel that cannot run here (Triton missing or
older than the kernels compile with), in one line naming the version found, the supported
range and what still works here; and "auto" never picks what cannot run here (TP: symmetric or
chunked; the quantized collectives: the CUDA kernels; MoE: the torch send). The versions are
monkeypatched: this machine has the newest of each."""

import importlib.util
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

OLD_TRITON, OLD_TORCH = "3.3.1", "2.7.1"


def _set_triton(monkeypatch, state: str) -> None:
    """``state``: a version string for triton.__version__, or "missing" (not installed)."""
    if state == "missing":
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "triton" else real(name, *a))
    else:
        import triton

        monkeypatch.setattr(triton, "__version__", state)


def _one_line(msg: str, *parts: str) -> None:
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)


# ---- TPComm ---------------------------------------------------------------------------------

def _build_tp(backend, triton_version=None, torch_version=None):
    import triton

    from overlap.tp import TPComm

    if triton_version:
        triton.__version__ = triton_version
    if torch_version:
        torch.__version__ = torch_version
    try:
        comm = TPComm(dist.group.WORLD, backend=backend)
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    comm.close()
    return f"built {comm.backend}"


def test_tpcomm_refuses_a_triton_older_than_the_kernels_need():
    (msg,) = run_ranks(_build_tp, 1, "triton", OLD_TRITON)
    assert msg.startswith("ValueError: TPComm: backend='triton'"), msg
    _one_line(msg, f"Triton {OLD_TRITON}", ">= 3.4", "'auto'", "'symmetric'", "'chunked'",
              "'unfused'", "rank 0")


def test_tpcomm_builds_on_the_oldest_supported_triton():
    assert run_ranks(_build_tp, 1, "triton", "3.4.0") == ["built triton"]


def test_tpcomm_refuses_a_torch_older_than_supported():
    (msg,) = run_ranks(_build_tp, 1, "chunked", None, OLD_TORCH)
    assert msg.startswith("RuntimeError: TPComm:"), msg
    _one_line(msg, f"torch {OLD_TORCH}", ">= 2.8", "rank 0")


def _resolve(monkeypatch, backend, *, device, hosts):
    """TPComm._resolve on a communicator of len(hosts) ranks, the rank exchange faked."""
    from overlap.tp import comm as tpc

    comm = object.__new__(tpc.TPComm)
    comm.world, comm.rank, comm.chunks, comm.group = len(hosts), 0, len(hosts), None
    comm.device = torch.device(device)

    def all_gather_object(out, obj, group=None):
        for r, host in enumerate(hosts):
            out[r] = (obj[0], obj[1], host)

    monkeypatch.setattr(tpc.dist, "all_gather_object", all_gather_object)
    return comm._resolve(backend, " (rank 0 of group g)")


@pytest.mark.parametrize("triton_state, hosts, want", [
    ("3.9.0", ("a", "a"), "triton"), ("3.4.0", ("a", "b"), "triton"),
    (OLD_TRITON, ("a", "a"), "symmetric"), (OLD_TRITON, ("a", "b"), "chunked"),
    ("missing", ("a", "a"), "symmetric"), ("missing", ("a", "b"), "chunked")])
def test_auto_never_picks_a_triton_that_cannot_run(monkeypatch, triton_state, hosts, want):
    _set_triton(monkeypatch, triton_state)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _resolve(monkeypatch, "auto", device="cuda", hosts=hosts) == want
    said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    if want == "triton":
        assert said == []
    else:  # on CUDA, saying why the fused kernels are not used
        assert len(said) == 1, said
        _one_line(said[0], "backend='auto'", f"'{want}'", ">= 3.4",
                  "not installed" if triton_state == "missing" else f"Triton {triton_state}")


def test_auto_on_cpu_never_looks_at_triton(monkeypatch):
    _set_triton(monkeypatch, OLD_TRITON)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _resolve(monkeypatch, "auto", device="cpu", hosts=("a", "a")) == "symmetric"


@pytest.mark.parametrize("triton_state", [OLD_TRITON, "missing"])
def test_explicit_triton_refused_before_the_rank_exchange(monkeypatch, triton_state):
    _set_triton(monkeypatch, triton_state)
    with pytest.raises(ValueError, match=r"backend='triton' cannot run here") as err:
        _resolve(monkeypatch, "triton", device="cuda", hosts=("a", "a"))
    _one_line(str(err.value), ">= 3.4", "'symmetric'", "'chunked'", "rank 0 of group g")


# ---- the quantized collectives' kernels and the MoE send ------------------------------------

@pytest.mark.parametrize("triton_state", [OLD_TRITON, "missing"])
def test_quant_auto_takes_the_cuda_kernels_when_triton_cannot_run(monkeypatch, triton_state):
    from overlap.comm.quant import kernels as qk

    _set_triton(monkeypatch, triton_state)
    qk.triton_available.cache_clear()
    try:
        assert qk.resolve_impl("auto", torch.device("cuda", 0)) == "cuda"
        with pytest.raises(ValueError, match="impl 'triton'") as err:
            qk.resolve_impl("triton", torch.device("cuda", 0))
        _one_line(str(err.value), ">= 3.4", "'cuda'")
    finally:
        monkeypatch.undo()
        qk.triton_available.cache_clear()
    assert qk.resolve_impl("auto", torch.device("cuda", 0)) == "triton"


def _build_ep(kernel, triton_version):
    import triton

    from overlap.moe import EPComm

    triton.__version__ = triton_version
    try:
        comm = EPComm(dist.group.WORLD, backend="symmetric", max_tokens=8, kernel=kernel)
    except ValueError as exc:
        return f"ValueError: {exc}"
    comm.close()
    return f"built {comm.kernel}"


def test_epcomm_refuses_an_old_triton_kernel_and_auto_takes_torch():
    refused, auto = run_ranks(_build_ep, 1, "triton", OLD_TRITON)[0], run_ranks(
        _build_ep, 1, "auto", OLD_TRITON)[0]
    assert refused.startswith("ValueError: EPComm: kernel='triton'"), refused
    _one_line(refused, f"Triton {OLD_TRITON}", ">= 3.4", "'torch'")
    assert auto == "built torch"


_NO_OPAQUE = r"""
import builtins
import torch, torch.distributed as dist
real_import = builtins.__import__

def no_opaque(name, globals=None, locals=None, fromlist=(), level=0):
    # torch < 2.11 as overlap sees it: no opaque objects (torch itself keeps its modules)
    if name.startswith(("torch._opaque_base", "torch._library.opaque_object")) and \
            (globals or {}).get("__name__") == "overlap.versions":
        raise ImportError(f"No module named {name!r}")
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = no_opaque
from overlap.cp import CPComm, ring_attention
from overlap.tp import TPComm, all_gather_matmul
from overlap.versions import HAVE_OPAQUE
builtins.__import__ = real_import
torch.__version__ = "2.10.0"
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
out = {"opaque": HAVE_OPAQUE}
x, w = torch.randn(4, 8), torch.randn(8, 6)
with TPComm(dist.group.WORLD, backend="chunked") as comm:
    out["tp_eager"] = (all_gather_matmul(x, w, comm=comm) - x @ w).abs().max().item()
    try:
        torch.compile(lambda a: all_gather_matmul(a, w, comm=comm), backend="eager",
                      fullgraph=True)(x)
        out["tp_compiled"] = "ran"
    except Exception as exc:
        out["tp_compiled"] = str(exc)
cp = CPComm(dist.group.WORLD, timeout=10)
q = torch.randn(1, 2, 4, 8)
ref = torch.nn.functional.scaled_dot_product_attention(q, q, q)
out["cp_eager"] = (ring_attention(q, q, q, comm=cp, causal=False) - ref).abs().max().item()
try:
    torch.compile(lambda a: ring_attention(a, a, a, comm=cp, causal=False), backend="eager",
                  fullgraph=True)(q)
    out["cp_compiled"] = "ran"
except Exception as exc:
    out["cp_compiled"] = str(exc)
cp.close()
print(repr(out))
"""


def test_without_opaque_objects_eager_runs_and_compile_is_refused():
    """torch 2.8 to 2.10 have no torch._opaque_base: the communicators are plain objects, the
    fused ops and CP attention run eagerly with the right numbers, and torch.compile of them
    is refused in a sentence naming the floor (simulated here: the modules made unimportable)."""
    run = subprocess.run([sys.executable, "-c", _NO_OPAQUE], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = eval(run.stdout.strip().splitlines()[-1])  # noqa: S307 - our own repr of a dict
    assert out["opaque"] is False and out["tp_eager"] <= 1e-5 and out["cp_eager"] <= 1e-5, out
    for key in ("tp_compiled", "cp_compiled"):
        assert "needs torch >= 2.11" in out[key] and "torch 2.10.0" in out[key], out[key]
