"""Builds overlap._C, the C++ CPU extension (pybind11, g++ only; no CUDA toolkit needed).

CUDA kernels in csrc/*.cu are *not* built here: on a GPU machine they are compiled at first
use by overlap.kernels.cuda (NVRTC through cupy). CI compile-checks them with nvcc.
"""
import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext = Pybind11Extension(
    "overlap._C",
    sorted(glob.glob("csrc/*.cpp")),
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-Werror", "-fopenmp"],
    extra_link_args=["-fopenmp", "-lrt"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
