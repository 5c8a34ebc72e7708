"""overlap.plan: predict memory, pipeline bubble, communication and step time of a layout
(tp x cp x pp x dp, ep for MoE), and search for the best one (``overlap-plan``).

Entry points: ``estimate(model, cluster, layout) -> Estimate`` and ``search(model, cluster,
global_batch).ranked``, with ``get_model``, ``get_profile``, ``ClusterSpec`` and ``Layout``.

Modules: ``models`` (shapes, parameters, FLOPs), ``hardware`` + ``profiles`` (device data and
sources), ``layout``, ``activations``, ``memory``, ``compute``, ``comm``, ``bubble`` (the
project's pipeline schedules replayed with per-stage costs), ``stages``, ``estimate``,
``search``, ``explain``, ``report`` (text), ``config`` + ``cli`` (``overlap-plan``), ``fit``
(calibration to Narayanan et al. 2021), ``fit_moe`` (the MoE terms, to published Megatron-Core
runs), ``calibrate`` + ``calibrate_bench`` (this machine), ``selfpredict`` (the CPU
self-prediction of ``python -m overlap.train``), ``cp`` (context parallelism), ``offload``
(activation offloading).
The narrative (and an example): docs/design/planner.md.
"""

from overlap.plan.estimate import Estimate, estimate
from overlap.plan.hardware import ClusterSpec, DeviceProfile, GemmCurve, LinkSpec
from overlap.plan.layout import Layout, Overlap
from overlap.plan.models import MODELS, ModelSpec, get_model
from overlap.plan.profiles import PROFILES, get_profile
from overlap.plan.search import Constraints, SearchResult, search

__all__ = ["estimate", "Estimate", "search", "Constraints", "SearchResult", "Layout", "Overlap",
           "ModelSpec", "MODELS", "get_model", "ClusterSpec", "DeviceProfile", "GemmCurve",
           "LinkSpec", "PROFILES", "get_profile"]
