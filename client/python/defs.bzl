"""py3_test: a Python test run by Debian's /usr/bin/python3 with moe_client importable.

Bazel 4.2.3's native py_test would pick the first python3 on PATH, which on the project's
machines lacks grpcio/torch; an sh_test around client/python/run_python.sh pins the
interpreter and sets PYTHONPATH to the runfiles copies of the package and its stubs.

    py3_test(
        name = "codec_test",
        src = "codec_test.py",
        data = ["//server:moed"],
        args = ["--moed=$(rootpath //server:moed)"],
    )
"""

def py3_test(name, src, data = [], args = [], **kwargs):
    native.sh_test(
        name = name,
        srcs = ["//client/python:run_python.sh"],
        args = ["$(rootpath %s)" % src] + args,
        data = [src, "//client/python:moe_client"] + data,
        **kwargs
    )
