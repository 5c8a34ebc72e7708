"""Builds overlap._C, the C++ CPU extension (pybind11, g++ only; no CUDA toolkit needed).

CUDA kernels in csrc/*.cu are *not* built here: on a GPU machine they are compiled at first
use by overlap.kernels.cuda (NVRTC through cupy). A wheel carries their sources in
overlap/_csrc so that works outside a source checkout too. CI compile-checks them with nvcc.
"""
import glob
import os
import shutil

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup
from setuptools.command.build_py import build_py


class build_py_with_csrc(build_py):
    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "overlap", "_csrc")
        os.makedirs(dest, exist_ok=True)
        for src in glob.glob("csrc/*.cu") + glob.glob("csrc/*.cuh"):
            shutil.copy(src, dest)


ext = Pybind11Extension(
    "overlap._C",
    sorted(glob.glob("csrc/*.cpp")),
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-Werror", "-fopenmp"],
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext, "build_py": build_py_with_csrc})
