"""Wraps the Debian-installed C++ libraries as cc_library targets of @system.

The repository rule runs `pkg-config --cflags --libs` for each library on the machine it
runs on and writes one cc_library per group with those flags. `-lgrpc++ -lprotobuf` alone
does not link (Abseil, re2, c-ares come along), which is why pkg-config is the source of
truth. Gloo ships no .pc file, so its flags are spelled out here.
"""

# target name -> pkg-config modules
_PKG_CONFIG_GROUPS = {
    "absl": [
        "absl_status",
        "absl_statusor",
        "absl_strings",
        "absl_str_format",
        "absl_synchronization",
        "absl_time",
        "absl_flags",
        "absl_flags_parse",
        "absl_flags_usage",
        "absl_span",
        "absl_cord",
        "absl_random_random",
        "absl_hash",
        "absl_raw_hash_set",
        "absl_crc32c",
    ],
    "protobuf": ["protobuf"],
    "grpc": ["grpc++", "grpc"],
    "gtest": ["gtest", "gmock"],
    "gtest_main": ["gtest_main"],
    "openblas": ["openblas"],
    "crypto": ["libcrypto"],
    "nlohmann_json": ["nlohmann_json"],
    "prometheus": ["prometheus-cpp-pull", "prometheus-cpp-core"],
}

# Libraries without a .pc file: target name -> (linkopts, required header).
_MANUAL = {
    "gloo": (["-lgloo", "-lpthread"], "/usr/include/gloo/config.h"),
    "civetweb": (["-lcivetweb-cpp", "-lcivetweb"], "/usr/include/CivetServer.h"),
    "grpc_reflection": (["-lgrpc++_reflection"], "/usr/include/grpcpp/ext/proto_server_reflection_plugin.h"),
}

def _pkg_config(ctx, modules):
    # absl_crc32c and friends do not exist in every Abseil; keep those that resolve.
    present = [m for m in modules if ctx.execute(["pkg-config", "--exists", m]).return_code == 0]
    if not present:
        fail("pkg-config knows none of %s: run ./setup.sh" % modules)
    cflags = ctx.execute(["pkg-config", "--cflags"] + present)
    libs = ctx.execute(["pkg-config", "--libs"] + present)
    if cflags.return_code != 0 or libs.return_code != 0:
        fail("pkg-config failed for %s: %s %s" % (present, cflags.stderr, libs.stderr))

    # Header paths in /usr/include are default ones; passing them as -I breaks #include_next.
    copts = [f for f in cflags.stdout.strip().split(" ") if f and f != "-I/usr/include"]
    linkopts = [f for f in libs.stdout.strip().split(" ") if f]
    return copts, linkopts

def _system_libs_impl(ctx):
    lines = ['package(default_visibility = ["//visibility:public"])', ""]
    for name, modules in _PKG_CONFIG_GROUPS.items():
        copts, linkopts = _pkg_config(ctx, modules)
        lines.append("cc_library(name = %r, copts = %r, linkopts = %r)" % (name, copts, linkopts))
    for name, (linkopts, header) in _MANUAL.items():
        if not ctx.path(header).exists:
            fail("%s not found (%s): run ./setup.sh" % (name, header))
        lines.append("cc_library(name = %r, linkopts = %r)" % (name, linkopts))
    lines.append('cc_library(name = "gtest_with_main", deps = [":gtest", ":gtest_main"])')
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.file("BUILD", "\n".join(lines) + "\n")

system_libs = repository_rule(
    implementation = _system_libs_impl,
    local = True,
)
