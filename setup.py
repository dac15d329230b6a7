"""Build attnkit's C++ (and, where possible, CUDA) extension `attnkit._C`.

Install with `pip install --no-build-isolation -e .` after torch is installed. Environment:
  ATTNKIT_BUILD_EXT=0    build no extension (attnkit then runs on its PyTorch reference backend)
  ATTNKIT_BUILD_CUDA=1   force the CUDA sources on; =0 forces them off; unset: on when torch is a
                         CUDA build and nvcc is found (CUDA_HOME)
  TORCH_CUDA_ARCH_LIST   CUDA architectures (default: the visible GPU's)
  MAX_JOBS               parallel compile jobs (ninja)
  CUTLASS_INCLUDE        CUTLASS/CuTe headers for the CUDA kernels (default: the `nvidia-cutlass` wheel's)
"""
import glob
import os
import platform

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


# The CPU kernel's tasks are built once per instruction set (csrc/cpu/capability/, written by
# tools/generate_kernels.py) with these flags, as ATen builds its kernels; the kernel picks one at run time
# (csrc/cpu/fused_attention.cpp). ATTNKIT_SIMD=0 builds only the portable one.
CPU_CAPABILITY_FLAGS = {
    "default": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}


def _capability_units():
    """(source, flags) of each CPU capability unit this build compiles."""
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    names = ["default"] + (["avx2", "avx512"] if x86 and os.environ.get("ATTNKIT_SIMD", "1") != "0" else [])
    return [(f"csrc/cpu/capability/fused_attention_{name}.cpp", CPU_CAPABILITY_FLAGS[name]) for name in names]


def _simd_flags():
    """AVX2/FMA for the other CPU units' vector code when the build machine has them (like -march=native:
    the extension is built where it runs). ATTNKIT_SIMD=0 builds portable scalar code."""
    if os.environ.get("ATTNKIT_SIMD", "1") == "0":
        return []
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return []
    return ["-mavx2", "-mfma", "-mf16c"] if all(f" {x}" in flags for x in ("avx2", "fma", "f16c")) else []


def cutlass_include() -> str:
    """The CUTLASS/CuTe headers: $CUTLASS_INCLUDE, or those of the `nvidia-cutlass` wheel (pip extra `cuda`)."""
    env = os.environ.get("CUTLASS_INCLUDE")
    if env:
        return env
    try:
        import cutlass_library
    except ImportError:
        raise SystemExit("attnkit's CUDA kernels need the CUTLASS/CuTe headers: pip install nvidia-cutlass==4.2.0.0 "
                         "(or set CUTLASS_INCLUDE, or ATTNKIT_BUILD_CUDA=0 for a CPU-only build)") from None
    return os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")


def _extensions():
    if os.environ.get("ATTNKIT_BUILD_EXT", "1") == "0":
        return [], {}
    import torch
    from torch.utils import cpp_extension

    cpu_sources = ["csrc/ops.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    # csrc/cuda/*.cpp: the CUDA host API (C++ compiler); *.cu: kernels (nvcc)
    cuda_sources = (sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu"))
                    + sorted(glob.glob("csrc/cuda/instantiations/*.cu")))
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
            include_dirs=include_dirs + [cutlass_include()],
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
    ext.capability_units = _capability_units()
    return [ext], {"build_ext": _build_ext_class(cpp_extension.BuildExtension, set(_simd_flags()))}


def _build_ext_class(base, simd_flags):
    class BuildExt(base):
        """torch's BuildExtension, plus the CPU capability units: each compiled with its own instruction-set
        flags (the extension's C++ flags without the global SIMD ones) and linked into the extension."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, use_ninja=True, **kwargs)

        def build_extension(self, ext):
            units = getattr(ext, "capability_units", [])
            if units:
                args = ext.extra_compile_args
                cxx = [f for f in (args["cxx"] if isinstance(args, dict) else args) if f not in simd_flags]
                objects = []
                for source, flags in units:
                    extra = dict(args) if isinstance(args, dict) else {}
                    extra["cxx"] = cxx + flags
                    objects += self.compiler.compile([source], output_dir=self.build_temp, macros=ext.define_macros,
                                                     include_dirs=ext.include_dirs, extra_postargs=extra,
                                                     depends=ext.depends)
                ext.extra_objects = list(ext.extra_objects or []) + objects
            super().build_extension(ext)

    return BuildExt


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
