"""The naming scheme and the kernel registry: every name the runtime writes and every kernel it
launches is classified as declared, and the registry stays in step with the kernel sources."""

import re
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from overlap.kernels import registry
from overlap.profile import names, nvtx, timers
from overlap.profile.names import COMM, COMPUTE, FUSED, STEP, Kind
from overlap.profile.trace import classify

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

ROOT = Path(__file__).resolve().parents[1]


def _source_kernels() -> set[str]:
    """Launchable kernels in the source: Triton ``*_kernel`` functions and CUDA __global__s."""
    found = set()
    for f in (ROOT / "overlap/kernels/triton").glob("*.py"):
        found |= set(re.findall(r"@triton\.jit[^\n]*\ndef (\w+_kernel)\(", f.read_text()))
    for f in (ROOT / "csrc").glob("*.cu"):
        found |= set(re.findall(r"__global__\s+void\s+(\w+)\s*\(", f.read_text()))
    return found


def test_registry_covers_every_kernel_in_the_source():
    in_source = _source_kernels()
    assert "_all_gather_matmul_kernel" in in_source and "overlap_signal_wait" in in_source
    assert in_source - set(registry.KERNELS) == set(), "kernels without a registry entry"
    assert set(registry.KERNELS) - in_source == set(), "registry entries naming no kernel"
    for info in registry.KERNELS.values():
        assert info.name in (ROOT / info.source).read_text(), (info.name, info.source)


@pytest.mark.parametrize("name", sorted(registry.KERNELS))
def test_every_registry_kernel_classifies_as_declared(name):
    info = registry.KERNELS[name]
    want = Kind(info.kind, wait=info.waits)
    assert names.classify_kernel(name) == want
    # As profilers print them: a C signature, or an old Triton's specialization suffix.
    assert names.classify_kernel(f"void {name}(long const*, long)") == want
    assert names.classify_kernel(f"{name}_0d1d2de") == want
    assert classify(name) == (COMPUTE if info.kind == FUSED else info.kind)


def test_the_cases_the_issue_reports():
    # Before the registry these were "neither", "compute" and "compute".
    assert classify("all_gather_matmul.chunked.comm[3]") == COMM
    assert classify("overlap_signal_wait") == COMM
    assert names.classify_kernel("overlap_signal_wait") == Kind(COMM, wait=True)
    assert names.classify_kernel("_all_gather_matmul_kernel") == Kind(FUSED)
    assert classify("_all_gather_matmul_kernel") == COMPUTE  # counts as compute, its comm hidden


@pytest.mark.parametrize("name, want", [
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", Kind(COMM)),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t", Kind(COMM)),
    ("ncclAllReduceRingLLKernel_sum_f32", Kind(COMM)),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", Kind(COMPUTE)),
    ("triton_poi_fused_add_0", Kind(COMPUTE)),
    ("overlap_unknown_kernel", Kind(COMPUTE)),
])
def test_kernels_outside_the_registry(name, want):
    assert names.classify_kernel(name) == want


@pytest.mark.parametrize("name, want", [
    ("step:3", Kind(STEP)),
    ("ProfilerStep#2", Kind(STEP)),
    ("comm_wait:pp.p2p", Kind(COMM, wait=True)),
    ("comm:copy_chunk", Kind(COMM)),
    ("compute:gemm", Kind(COMPUTE)),
    ("aten::mm", Kind(COMPUTE)),
    ("gloo:all_reduce", Kind(COMM)),
    ("nccl:all_reduce", Kind(COMM)),
    ("c10d::allreduce_", Kind(COMM)),
    ("record_param_comms", Kind(COMM)),
    ("all_gather_matmul.chunked.comm[3]", Kind(COMM)),
    ("all_gather_matmul.chunked.comm[3].wait", Kind(COMM, wait=True)),
    ("matmul_all_reduce.chunked.comm.wait", Kind(COMM, wait=True)),
    ("all_gather_matmul.symmetric.comm[publish]", Kind(COMM)),
    ("matmul_reduce_scatter.symmetric.comm[1].reduce", Kind(COMM)),
    ("matmul_reduce_scatter.symmetric.gemm[2.0]", Kind(COMPUTE)),
    ("pp.stage1.F[3]", Kind(COMPUTE)),
    ("pp.stage0.W[1]", Kind(COMPUTE)),
    ("dp.grads.comm[0]", Kind(COMM)),
    ("dp.params.comm[2].wait", Kind(COMM, wait=True)),
    ("quant.all_reduce.quantize[1]", Kind(COMPUTE)),
    ("all_gather_matmul.triton.fused[0]", Kind(FUSED)),
])
def test_range_names(name, want):
    assert names.classify_range(name) == want


@pytest.mark.parametrize("name", ["PyTorch Profiler (0)", "my_function", "cudaLaunchKernel",
                                  "all_gather_matmul.chunked.comms[1]", "comm_waiting"])
def test_names_outside_the_scheme_are_not_counted(name):
    assert names.classify_range(name) is None


def test_builders_write_what_the_reader_parses():
    assert names.step(4) == "step:4" and names.step_number("step:4") == 4
    assert names.step_number("ProfilerStep#7") == 7 and names.step_number("stepper") is None
    assert names.comm_wait("dp.grads") == "comm_wait:dp.grads"
    n = names.chunk("all_gather_matmul", "chunked", "comm", 3, "wait")
    assert n == "all_gather_matmul.chunked.comm[3].wait"
    assert names.parse(n) == names.Piece("all_gather_matmul.chunked", "comm", "3", "wait")
    assert names.pp_action("B", stage=2, micro_batch=5) == "pp.stage2.B[5]"
    assert names.dp_bucket("grads", 4) == "dp.grads.comm[4]"
    assert names.dp_bucket("params", 4, wait=True) == "dp.params.comm[4].wait"
    assert names.quant("dequantize", "all_gather", 0) == "quant.all_gather.dequantize[0]"
    assert names.classify_range(names.pp_action("F", stage=0, micro_batch=0)) == Kind(COMPUTE)


@pytest.mark.parametrize("call, match", [
    (lambda: names.chunk("all gather", "chunked", "comm", 0), "does not follow"),
    (lambda: names.chunk("op", "chunked", "comm", "a]b"), "does not follow"),
    (lambda: names.chunk("op", "chunked", "send", 0), "role must be one of"),
    (lambda: names.pp_action("X", stage=0, micro_batch=0), "action must be one of"),
    (lambda: names.quant("round", "all_reduce"), "kind must be"),
])
def test_builders_refuse_names_the_reader_cannot_parse(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("copy, peer, comm_stream, want", [
    ("PtoP", False, False, Kind(COMM)),
    ("DtoD", True, False, Kind(COMM)),      # devices differ: a peer copy whatever its label
    ("DtoD", False, True, Kind(COMM)),      # the copy engine's side stream
    ("DtoD", False, False, Kind(COMPUTE)),  # a copy on the compute stream
    ("HtoD", False, True, None),
    ("DtoH", False, False, None),
])
def test_classify_memcpy(copy, peer, comm_stream, want):
    assert names.classify_memcpy(copy, peer=peer, comm_stream=comm_stream) == want


def test_names_in_the_runtime_follow_the_scheme():
    """Every literal range name under overlap/ (f-string fields filled in) is one the reader
    classifies: a name it cannot read would silently drop out of the metrics."""
    pattern = re.compile(r"(?:nvtx\.range|record_function)\(\s*f?\"([^\"]+)\"")
    seen = []
    for f in (ROOT / "overlap").rglob("*.py"):
        if "profile" in f.parts:
            continue
        for raw in pattern.findall(f.read_text()):
            name = re.sub(r"\{[^}]*\}", "x0", raw)
            seen.append(name)
            assert names.classify_range(name) is not None, f"{f.relative_to(ROOT)}: {raw!r}"
    assert any(".chunked.comm[" in n for n in seen)  # the scan found today's ranges


def _recorded(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


def test_writer_side_uses_the_scheme_and_required_ranges_survive_opt_out(monkeypatch):
    def body():
        with nvtx.step(7):
            with nvtx.range(names.chunk("op", "chunked", "gemm", 0)):
                torch.ones(2) + 1
            with timers.comm_wait("pp.p2p"):
                pass

    got = _recorded(body)
    assert {"step:7", "op.chunked.gemm[0]", "comm_wait:pp.p2p"} <= set(got)
    monkeypatch.setattr(nvtx, "_ENABLED", False)  # OVERLAP_NVTX=0
    got = _recorded(body)
    assert {"step:7", "comm_wait:pp.p2p"} <= set(got) and "op.chunked.gemm[0]" not in got
