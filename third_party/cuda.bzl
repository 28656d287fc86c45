"""Finds CUDA 13 on the build machine and exposes it as @local_cuda.

@local_cuda//:defs.bzl defines CUDA_AVAILABLE. When nvcc is missing (or MOED_CUDA_PATH
points at a folder without it) the CUDA targets are marked incompatible, so that
`bazel build //...` skips them with a clear reason and everything else still builds.
"""

def _cuda_configure_impl(ctx):
    root = ctx.os.environ.get("MOED_CUDA_PATH", "/usr/local/cuda")
    nvcc = ctx.path(root + "/bin/nvcc")
    available = nvcc.exists and ctx.path(root + "/include/cuda_runtime.h").exists
    ctx.file("WORKSPACE", 'workspace(name = "local_cuda")\n')
    if not available:
        print("CUDA not found at %s (set MOED_CUDA_PATH): CUDA targets are left out of this build." % root)
        ctx.file("defs.bzl", "CUDA_AVAILABLE = False\nNVCC = None\n")
        ctx.file("BUILD", 'package(default_visibility = ["//visibility:public"])\n' +
                          'cc_library(name = "cuda", target_compatible_with = ["@//third_party:incompatible"])\n')
        return
    ctx.symlink(root + "/include", "include")
    ctx.file("defs.bzl", "CUDA_AVAILABLE = True\nNVCC = %r\n" % str(nvcc))
    ctx.file("BUILD", """package(default_visibility = ["//visibility:public"])

# CUDA runtime, cuBLASLt and NCCL (NCCL's header ships in CUDA's include folder here; the
# library is libnccl.so in lib64 here and on the system path of the GPU machine).
cc_library(
    name = "cuda",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp"]),
    includes = ["include"],
    linkopts = [
        "-L{root}/lib64",
        "-Wl,-rpath,{root}/lib64",
        "-lcublasLt",
        "-lcudart",
        "-lnccl",
        "-ldl",
        "-lrt",
        "-lpthread",
    ],
)
""".format(root = root))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["MOED_CUDA_PATH"],
    local = True,
)
