"""Shipped device profiles, each number with its source.

Vendor numbers are peaks from the datasheets. The A100 efficiencies (``FITTED``) are fitted by
``python -m overlap.plan.fit`` to the ten runs of Narayanan et al. 2021 Table 1 and to nothing
else; the Hopper terms (``HOPPER_FITTED``) by ``python -m overlap.plan.fit_hopper`` to public
H100 kernel measurements and published runs (docs/planner.md, "Hopper"). The host links
(activation offloading) are PCIe x16 at the fraction of it that published pinned-copy
measurements reach, not fitted. ``tests/test_plan_pinning.py`` holds every table's predictions.
"""

from __future__ import annotations

import os

from overlap.plan.hardware import DeviceProfile, GemmCurve, LinkSpec

__all__ = ["FITTED", "HOPPER_FITTED", "MOE_FITTED", "DEEPEP_EFFICIENCY", "PROFILES", "get_profile",
           "build_profiles", "NCCL_LATENCY",
           "PCIE_GEN4_X16", "PCIE_GEN5_X16", "PCIE_EFFICIENCY"]

# Written by `python -m overlap.plan.fit` (see its docstring for the objective).
FITTED = {
    "gemm_e_max": 0.6622,
    "gemm_d_half": 0.0,
    "nvlink_efficiency": 1.0,
    "ib_efficiency": 1.0,
}

# Written by `python -m overlap.plan.fit_hopper` from public Hopper measurements (None: the
# Hopper profiles reuse the A100 fit). Each term from its own kernel rows; step_gemm_factor
# (the share of a kernel's GEMM rate a training step keeps), zero3_layer_s and the level of
# the runs' own attention kernel fitted on the "fit" runs.
HOPPER_FITTED: dict[str, float] | None = {
    "gemm_e_max": 0.8237, "gemm_d_half": 0.0, "gemm_overhead_s": 8.76e-06,
    "attn_e_max": 0.6552, "attn_s_half": 233.8, "attn_bwd": 0.8438,
    "nvlink_efficiency": 0.7889, "ib_efficiency": 0.96,
    "step_gemm_factor": 0.7332, "zero3_layer_s": 0.0010625,
    # the level of the attention kernel the LLM Foundry runs used (fit_hopper.ATTENTION_KERNELS);
    # only their replay uses it, the profiles keep FlashAttention-3's
    "attn_triton_e_max": 0.19,
}
_HOPPER_KERNEL_SRC = "fitted to the public H100 measurements in overlap/plan/data/hopper_kernels.csv"
_HOPPER_RUN_SRC = ("the factor fitted to the fit runs of overlap/plan/data/hopper_runs.csv "
                   "(python -m overlap.plan.fit_hopper)")

# Written by `python -m overlap.plan.fit_moe`: the MoE all-to-all's achieved fraction of link
# bandwidth on NCCL collectives (Megatron's "alltoall" dispatcher: its permutations and host
# syncs included) and the expert grouped GEMMs' throughput relative to a dense GEMM, fitted to
# published Megatron-Core MoE runs (overlap/plan/data/moe_runs.csv, moe_balance.csv).
MOE_FITTED = {"a2a_efficiency": 0.2675, "grouped_gemm_efficiency": 0.5117}
_A2A_SRC = ("fitted to published Megatron-Core Qwen3-235B-A22B BF16 runs on H100 "
            "(python -m overlap.plan.fit_moe; overlap/plan/data/moe_runs.csv, moe_balance.csv)")
# A once-per-node dispatcher (DeepEP) is not fitted: its own kernel table puts it at the links.
DEEPEP_EFFICIENCY = 1.0
_DEEPEP_SRC = ("DeepEP's normal-kernel table (github.com/deepseek-ai/DeepEP, docs/legacy.md; "
               "H800, CX7 400 Gb/s): 153-158 GB/s of about 160 over NVLink, 43-58 GB/s "
               "(logical) per 50 GB/s NIC; taken as the links' rate (1.0)")
# The SMs DeepEP's kernels hold: Megatron-Core's default (TransformerConfig.moe_deepep_num_sms).
DEEPEP_SMS = 20
_DEEPEP_SM_SRC = "Megatron-Core's default moe_deepep_num_sms = 20, over the GPU's SMs"

# NCCL's own latency model (src/graph/tuning.cc, ncclTopoTuneModel; Simple protocol, ring):
# 8.4 us per collective, plus per algorithm step 3.4 us over NVLink and 9.6 us over the network.
NCCL_LATENCY = {"base": 8.4e-6, "nvlink_step": 3.4e-6, "net_step": 9.6e-6}

_NCCL_SRC = "NCCL src/graph/tuning.cc latency model (ring, Simple protocol)"
_FIT_SRC = "fitted to Narayanan et al. 2021 Table 1 (python -m overlap.plan.fit)"
# Host links, per direction: PCIe x16 at 16 GT/s (Gen4) or 32 GT/s (Gen5) per lane with 128b/130b
# encoding is 31.5 or 63.0 GB/s; pinned copies reach about 80% of it (the measurements below).
PCIE_GEN4_X16 = 16e9 * 16 * 128 / 130 / 8
PCIE_GEN5_X16 = 32e9 * 16 * 128 / 130 / 8
PCIE_EFFICIENCY = 0.8
_PCIE_EFF_SRC = ("measured pinned copies: 25.1 GB/s host-to-device on an A100-SXM4 (PCIe Gen4 "
                 "x16; NVIDIA/nvbandwidth issue #42) = 0.80 of 31.5 GB/s, and 52.8 GB/s "
                 "device-to-host on H100 nodes (Gen5 x16; nvbandwidth issue #24, where "
                 "host-to-device read 35.2) = 0.84 of 63.0 GB/s; 0.8 assumed for both, one GPU "
                 "copying alone (the other GPUs of the node sharing a PCIe switch or the host "
                 "memory are not modelled)")
_MEM_EFF_SRC = ("about 88-90% of datasheet HBM bandwidth is the best any kernel reaches on A100 "
                "(NVIDIA developer forum, 'Trouble to reach peak bandwidth of A100', 2024)")


def _gemm(fit: dict[str, float]) -> GemmCurve:
    return GemmCurve(e_max=fit["gemm_e_max"], d_half=fit["gemm_d_half"])


def _moe_terms(*, sms: int, gpu: str, assumed: str = "") -> tuple[dict, dict[str, str]]:
    """The MoE exchange and expert-GEMM fields of a profile, and their sources: fitted on H100
    runs (``assumed`` says where they are carried over), DeepEP's from its kernels and SMs."""
    return ({"a2a_efficiency": MOE_FITTED["a2a_efficiency"],
             "grouped_gemm_efficiency": MOE_FITTED["grouped_gemm_efficiency"],
             "dedup_a2a_efficiency": DEEPEP_EFFICIENCY, "dedup_a2a_sm_share": DEEPEP_SMS / sms},
            {"a2a_efficiency": _A2A_SRC + assumed, "grouped_gemm_efficiency": _A2A_SRC + assumed,
             "dedup_a2a_efficiency": _DEEPEP_SRC + assumed,
             "dedup_a2a_sm_share": f"{_DEEPEP_SM_SRC} ({sms} on {gpu})"})


def _a100(name: str, hbm_bytes: float, hbm_bw: float, hbm_src: str, bw_src: str,
          fit: dict[str, float], host_node: float, host_src: str) -> DeviceProfile:
    moe, moe_src = _moe_terms(sms=108, gpu="A100", assumed="; assumed on A100")
    return DeviceProfile(
        name=name, peak_flops=312e12, hbm_bytes=hbm_bytes, hbm_bandwidth=hbm_bw,
        mem_efficiency=0.88, gemm=_gemm(fit),
        intra=LinkSpec(bandwidth=300e9, latency_s=NCCL_LATENCY["nvlink_step"],
                       efficiency=fit["nvlink_efficiency"]),
        inter=LinkSpec(bandwidth=25e9, latency_s=NCCL_LATENCY["net_step"],
                       efficiency=fit["ib_efficiency"]),
        base_latency_s=NCCL_LATENCY["base"], **moe,
        host_link=LinkSpec(bandwidth=PCIE_GEN4_X16, latency_s=0.0, efficiency=PCIE_EFFICIENCY),
        host_bytes_per_gpu=host_node / 8,
        sources={
            "host_link.bandwidth": "A100 SXM4 on a PCIe Gen4 x16 link to the host (A100 "
                                   "datasheet: PCIe Gen4 64 GB/s, i.e. 32 per direction; "
                                   "31.5 GB/s after 128b/130b encoding)",
            "host_link.efficiency": _PCIE_EFF_SRC,
            "host_bytes_per_gpu": host_src,
            **moe_src,
            "peak_flops": "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16/FP16 Tensor Core",
            "hbm_bytes": hbm_src,
            "hbm_bandwidth": bw_src,
            "mem_efficiency": _MEM_EFF_SRC,
            "gemm": _FIT_SRC,
            "intra.bandwidth": "NVIDIA A100 datasheet: third-generation NVLink 600 GB/s "
                               "bidirectional per GPU = 300 GB/s per direction (NVSwitch)",
            "inter.bandwidth": "DGX A100: 8 x 200 Gb/s HDR InfiniBand per node, one per GPU = "
                               "25 GB/s per GPU per direction (as in Narayanan et al. 2021)",
            "intra.latency_s": _NCCL_SRC, "inter.latency_s": _NCCL_SRC,
            "base_latency_s": _NCCL_SRC,
            "intra.efficiency": _FIT_SRC, "inter.efficiency": _FIT_SRC,
        })


def _hopper(name: str, hbm_bytes: float, hbm_bw: float, hbm_src: str, bw_src: str,
            product: str, fit: dict[str, float], host_src: str,
            hopper: dict[str, float] | None) -> DeviceProfile:
    terms = _hopper_terms(fit, hopper)
    moe, moe_src = _moe_terms(sms=132, gpu=product)
    return DeviceProfile(
        name=name, peak_flops=989e12, hbm_bytes=hbm_bytes, hbm_bandwidth=hbm_bw,
        mem_efficiency=0.88, gemm=terms["gemm"], attention=terms["attention"],
        attention_bwd=terms["attention_bwd"],
        intra=LinkSpec(bandwidth=450e9, latency_s=NCCL_LATENCY["nvlink_step"],
                       efficiency=terms["nvlink_efficiency"]),
        inter=LinkSpec(bandwidth=50e9, latency_s=NCCL_LATENCY["net_step"],
                       efficiency=terms["ib_efficiency"]),
        base_latency_s=NCCL_LATENCY["base"], **moe,
        host_link=LinkSpec(bandwidth=PCIE_GEN5_X16, latency_s=0.0, efficiency=PCIE_EFFICIENCY),
        host_bytes_per_gpu=2e12 / 8, zero3_layer_s=terms["zero3_layer_s"],
        sources={
            "host_link.bandwidth": f"{product} on a PCIe Gen5 x16 link to the host ({product} "
                                   "datasheet: PCIe Gen5 128 GB/s, i.e. 64 per direction; "
                                   "63.0 GB/s after 128b/130b encoding)",
            "host_link.efficiency": _PCIE_EFF_SRC,
            "host_bytes_per_gpu": host_src,
            **moe_src,
            "peak_flops": f"NVIDIA {product} datasheet: 1,979 TFLOP/s BF16 Tensor Core with "
                          "sparsity, i.e. 989 TFLOP/s dense",
            "hbm_bytes": hbm_src,
            "hbm_bandwidth": bw_src,
            "mem_efficiency": _MEM_EFF_SRC + "; assumed the same on Hopper",
            **terms["sources"],
            "intra.bandwidth": f"NVIDIA {product} datasheet: fourth-generation NVLink 900 GB/s "
                               "bidirectional per GPU = 450 GB/s per direction",
            "inter.bandwidth": "DGX H100/H200: 8 x ConnectX-7 400 Gb/s NDR InfiniBand, one per "
                               "GPU = 50 GB/s per GPU per direction (DGX H100 user guide)",
            "intra.latency_s": _NCCL_SRC, "inter.latency_s": _NCCL_SRC,
            "base_latency_s": _NCCL_SRC,
        })


def _hopper_terms(fit: dict[str, float], hopper: dict[str, float] | None) -> dict:
    """The Hopper GEMM and attention curves and link efficiencies with their sources: the
    Hopper fit (``HOPPER_FITTED``, or ``hopper``) where there is one, else the A100 fit."""
    hopper = HOPPER_FITTED if hopper is None else hopper
    if not hopper:
        return {"gemm": _gemm(fit), "attention": None, "attention_bwd": 1.0,
                "zero3_layer_s": 0.0,
                "nvlink_efficiency": fit["nvlink_efficiency"],
                "ib_efficiency": fit["ib_efficiency"],
                "sources": {"gemm": _FIT_SRC + " on A100; not validated on Hopper",
                            "intra.efficiency": _FIT_SRC + " on A100 NVLink; assumed on Hopper",
                            "inter.efficiency": _FIT_SRC + " on HDR; assumed on NDR"}}
    factor = hopper.get("step_gemm_factor", 1.0)
    return {
        "zero3_layer_s": hopper.get("zero3_layer_s", 0.0),
        "gemm": GemmCurve(e_max=hopper["gemm_e_max"] * factor, d_half=hopper["gemm_d_half"],
                          overhead_s=hopper.get("gemm_overhead_s", 0.0)),
        "attention": GemmCurve(e_max=hopper["attn_e_max"], d_half=hopper["attn_s_half"]),
        "attention_bwd": hopper.get("attn_bwd", 1.0),
        "nvlink_efficiency": hopper["nvlink_efficiency"],
        "ib_efficiency": hopper["ib_efficiency"],
        "sources": {
            "gemm": f"{_HOPPER_KERNEL_SRC} GEMM rows (e_max {hopper['gemm_e_max']}, d_half "
                    f"{hopper['gemm_d_half']}) x step_gemm_factor {factor}, {_HOPPER_RUN_SRC}",
            "gemm.overhead_s": f"{_HOPPER_KERNEL_SRC} launch rows",
            "attention": f"{_HOPPER_KERNEL_SRC} attention rows (FlashAttention-3: the shape in "
                         "s from its sequence sweep, the level from its causal forward at 8192)",
            "attention_bwd": f"{_HOPPER_KERNEL_SRC} attention rows (FlashAttention-3's causal "
                             "backward over its forward at 8192)",
            "intra.efficiency": f"{_HOPPER_KERNEL_SRC} NVLink collective rows (bus bandwidth "
                                "at the largest messages / 450 GB/s)",
            "inter.efficiency": f"{_HOPPER_KERNEL_SRC} InfiniBand collective rows (bus "
                                "bandwidth at the largest messages / 50 GB/s)"}}


def build_profiles(fit: dict[str, float] | None = None,
                   hopper: dict[str, float] | None = None) -> dict[str, DeviceProfile]:
    """The shipped profiles with efficiencies ``fit`` (default: the A100 fit ``FITTED``) and
    Hopper terms ``hopper`` (default: ``HOPPER_FITTED``)."""
    fit = dict(FITTED if fit is None else fit)
    return {
        "a100-40g": _a100(
            "a100-40g", 42_405_855_232, 1555e9,
            "A100-SXM4-40GB usable memory reported by deviceQuery: 42,405,855,232 bytes "
            "(39.5 GiB)", "NVIDIA A100 datasheet: 1,555 GB/s HBM2 (40GB)", fit, 1e12,
            "DGX A100 (320GB) datasheet: 1 TB of system memory for 8 GPUs = 125 GB per GPU"),
        "a100-80g": _a100(
            "a100-80g", 85_056_798_720, 2039e9,
            "A100-SXM4-80GB total memory reported by torch.cuda: 85,056,798,720 bytes "
            "(79.2 GiB)", "NVIDIA A100 datasheet: 2,039 GB/s HBM2e (80GB SXM)", fit, 2e12,
            "DGX A100 (640GB) datasheet: 2 TB of system memory for 8 GPUs = 250 GB per GPU"),
        "h100-sxm": _hopper(
            "h100-sxm", 81559 * 2**20, 3.35e12,
            "H100 80GB HBM3 total memory reported by nvidia-smi: 81,559 MiB (79.6 GiB)",
            "NVIDIA H100 datasheet: 3.35 TB/s HBM3 (SXM)", "H100 SXM", fit,
            "DGX H100 datasheet: 2 TB of system memory for 8 GPUs = 250 GB per GPU", hopper),
        "h200": _hopper(
            "h200", 143771 * 2**20, 4.8e12,
            "H200 total memory reported by nvidia-smi: 143,771 MiB (140.4 GiB; datasheet "
            "141 GB)", "NVIDIA H200 datasheet: 4.8 TB/s HBM3e", "H200 SXM", fit,
            "DGX H200 datasheet: 2 TB of system memory for 8 GPUs = 250 GB per GPU", hopper),
    }


PROFILES: dict[str, DeviceProfile] = build_profiles()


def get_profile(name: str) -> DeviceProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"--gpu {name!r} is unknown; expected one of {sorted(PROFILES)}") \
            from None


def load_profile(name_or_path: str) -> DeviceProfile:
    """A GPU name of ``overlap-plan`` or the path of a profile JSON (``--calibrate``)."""
    if name_or_path.endswith(".json") or os.path.sep in name_or_path:
        return DeviceProfile.load(name_or_path)
    return get_profile(name_or_path)
