"""Build attnkit's C++ (and, where possible, CUDA) extension `attnkit._C`.

Install with `pip install --no-build-isolation -e .` after torch is installed. Environment:
  ATTNKIT_BUILD_EXT=0    build no extension (attnkit then runs on its PyTorch reference backend)
  ATTNKIT_BUILD_CUDA=1   force the CUDA sources on; =0 forces them off; unset: on when torch is a
                         CUDA build and nvcc is found (CUDA_HOME)
  TORCH_CUDA_ARCH_LIST   CUDA architectures (default: the visible GPU's)
  MAX_JOBS               parallel compile jobs (ninja)
"""
import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _simd_flags():
    """AVX2/FMA for the CPU kernels' vector code when the build machine has them (like -march=native:
    the extension is built where it runs). ATTNKIT_SIMD=0 builds portable scalar code."""
    if os.environ.get("ATTNKIT_SIMD", "1") == "0":
        return []
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return []
    return ["-mavx2", "-mfma", "-mf16c"] if all(f" {x}" in flags for x in ("avx2", "fma", "f16c")) else []


def _extensions():
    if os.environ.get("ATTNKIT_BUILD_EXT", "1") == "0":
        return [], {}
    import torch
    from torch.utils import cpp_extension

    cpu_sources = ["csrc/ops.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    want_cuda = os.environ.get("ATTNKIT_BUILD_CUDA")
    if want_cuda is None:
        build_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    else:
        build_cuda = want_cuda == "1"
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-DAT_PARALLEL_OPENMP=1"] + _simd_flags()
    extra = {"cxx": cxx}
    include_dirs = [os.path.join(ROOT, "csrc")]
    if build_cuda and cuda_sources:
        extra["cxx"] = cxx + ["-DATTNKIT_WITH_CUDA"]
        extra["nvcc"] = [
            "-O3",
            "-std=c++20",
            "--use_fast_math",
            "--expt-relaxed-constexpr",
            "-lineinfo",
            "-DATTNKIT_WITH_CUDA",
        ]
        ext = cpp_extension.CUDAExtension(
            "attnkit._C",
            cpu_sources + cuda_sources,
            include_dirs=include_dirs,
            extra_compile_args=extra,
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = cpp_extension.CppExtension(
            "attnkit._C",
            cpu_sources,
            include_dirs=include_dirs,
            extra_compile_args=extra,
            extra_link_args=["-fopenmp"],
        )
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
