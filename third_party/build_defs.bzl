"""Project macros: protoc/grpc genrules and nvcc-compiled CUDA libraries (offline)."""

load("@local_cuda//:defs.bzl", "CUDA_AVAILABLE", "NVCC")

def cc_grpc_proto(name, srcs, deps = [], grpc = True, visibility = None):
    """Generates C++ (and gRPC) code for `srcs` with the system protoc and grpc_cpp_plugin.

    Produces a cc_library `name` exposing the generated headers under their proto path
    (`#include "proto/moe.grpc.pb.h"`). Native proto_library is not used: it would need
    the protobuf repository, which Bazel would download.
    """
    outs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs += [base + ".pb.h", base + ".pb.cc"]
        if grpc:
            outs += [base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    grpc_flags = "--grpc_out=$(GENDIR) --plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin)" if grpc else ""
    native.genrule(
        name = name + "_gen",
        srcs = srcs + [d + "_srcs" for d in deps],
        outs = outs,
        cmd = "protoc --proto_path=. --cpp_out=$(GENDIR) {grpc} {files}".format(
            grpc = grpc_flags,
            files = " ".join(["$(location %s)" % s for s in srcs]),
        ),
    )
    native.filegroup(name = name + "_srcs", srcs = srcs, visibility = visibility)
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + ["@system//:protobuf"] + (["@system//:grpc"] if grpc else []),
        visibility = visibility,
    )

def cuda_library(name, srcs, hdrs = [], deps = [], copts = [], visibility = None):
    """Compiles .cu files with nvcc (sm_90a machine code + compute_90 PTX) into a cc_library.

    Where CUDA is absent the target is incompatible and `bazel build //...` skips it.
    """
    if not CUDA_AVAILABLE:
        native.cc_library(
            name = name,
            hdrs = hdrs,
            target_compatible_with = ["@//third_party:incompatible"],
            visibility = visibility,
        )
        return
    objs = []
    for src in srcs:
        obj = name + "_" + src.replace("/", "_")[:-len(".cu")] + ".pic.o"
        native.genrule(
            name = obj + "_nvcc",
            # Every header of the package may be included; a set avoids duplicated labels.
            srcs = [src] + [h for h in native.glob(["**/*.cuh", "**/*.h"]) if h not in hdrs] + hdrs,
            outs = [obj],
            cmd = ("{nvcc} -std=c++17 -O3 -Xcompiler -fPIC -I. -I$(GENDIR) " +
                   "-gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=compute_90 " +
                   "--expt-relaxed-constexpr {copts} -c $(location {src}) -o $@").format(
                nvcc = NVCC,
                copts = " ".join(copts),
                src = src,
            ),
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cuda"],
        visibility = visibility,
    )
