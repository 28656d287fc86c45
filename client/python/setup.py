"""setup.py of moe_client: the package sources plus the gRPC stubs of proto/moe.proto, made at
build time by gen_stubs.sh (Debian's protoc and grpc_python_plugin) into the build folder, so
that the installed package holds them (moe_client.proto.moe_pb2).

    /usr/bin/python3 -m pip install --break-system-packages --no-build-isolation --no-deps ./client/python

The proto is found at ../../proto/moe.proto (this folder inside a checkout) or $MOE_PROTO.
Dependencies are Debian's python3-grpcio, python3-protobuf, python3-numpy (and python3-torch
for RemoteMoE), not declared here: pip must not fetch them from PyPI.
"""

import os
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def version():
    path = os.path.join(HERE, "..", "..", "VERSION")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    return "0.0.0"


class BuildWithStubs(build_py):
    """build_py, then moe_client/proto/moe_pb2{,_grpc}.py into the build folder."""

    def run(self):
        super().run()
        proto = os.environ.get("MOE_PROTO") or os.path.join(HERE, "..", "..", "proto", "moe.proto")
        if not os.path.exists(proto):
            raise SystemExit("moe_client: %s not found (install from a checkout, or set "
                             "MOE_PROTO=/path/to/proto/moe.proto)" % proto)
        subprocess.check_call(["bash", os.path.join(HERE, "gen_stubs.sh"), self.build_lib,
                               proto])


setup(
    name="moe_client",
    version=version(),
    description="Python client of moed (moe.v1.MoeService): Client, RemoteMoE",
    packages=["moe_client", "moe_client.proto"],
    python_requires=">=3.9",
    cmdclass={"build_py": BuildWithStubs},
)
