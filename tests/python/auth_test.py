"""Bearer tokens and mutual TLS from the Python client: a moed with --tokens_file and TLS
certificates made by openssl for this test; the right token and certificate work, a wrong or
missing token, a wrong role and plaintext to the TLS port each fail with a clear error."""

import hashlib
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

from local_cluster import LocalCluster, binaries_from_argv
from moe_client import Client, PermissionDenied, Unauthenticated, Unavailable

MOED, WORKER, ARGV = binaries_from_argv(sys.argv)


def make_certificates(d):
    ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
    script = f"""set -e; cd {d}
openssl req -x509 {ec} -keyout ca.key -out ca.pem -days 1 -subj /CN=moed-test-ca
openssl req {ec} -keyout server.key -out server.csr -subj /CN=localhost
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' > san.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \
  -extfile san.ext -out server.pem
openssl req {ec} -keyout client.key -out client.csr -subj /CN=trainer
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -out client.pem
"""
    subprocess.run(["bash", "-c", script], check=True, capture_output=True)


class AuthTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="moed-auth-")
        make_certificates(cls.dir)
        tokens = os.path.join(cls.dir, "tokens")
        with open(tokens, "w") as f:
            for role in ("infer", "admin"):
                f.write("%s %s\n" % (hashlib.sha256((role + "-token").encode()).hexdigest(), role))
        cls.tls = {"tls_ca_file": os.path.join(cls.dir, "ca.pem"),
                   "tls_cert_file": os.path.join(cls.dir, "client.pem"),
                   "tls_key_file": os.path.join(cls.dir, "client.key")}
        cls.cluster = LocalCluster(
            MOED, WORKER, workers=2,
            extra_flags=["--tokens_file=" + tokens,
                         "--tls_cert_file=" + os.path.join(cls.dir, "server.pem"),
                         "--tls_key_file=" + os.path.join(cls.dir, "server.key"),
                         "--tls_client_ca_file=" + os.path.join(cls.dir, "ca.pem")],
            client_kwargs=cls.tls).start()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    def client(self, token, **tls):
        return Client(self.cluster.address, timeout=20, token=token, **tls)

    def test_roles_over_mutual_tls(self):
        with self.client("admin-token", **self.tls) as admin:
            admin.create_layer("py-tls", hidden=8, ffn=16, num_experts=4, top_k=2)
        x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
        with self.client("infer-token", **self.tls) as infer:
            out = infer.forward("py-tls", x)
            self.assertEqual(out.out.shape, (4, 8))
            with self.assertRaises(PermissionDenied) as cm:
                infer.forward("py-tls", x, keep_for_backward=True)
            self.assertIn("needs train", cm.exception.message)
        with self.client("wrong-token", **self.tls) as wrong:
            with self.assertRaises(Unauthenticated):
                wrong.list_layers()
        os.environ.pop("MOED_TOKEN", None)
        with self.client(None, **self.tls) as anonymous:
            with self.assertRaises(Unauthenticated):
                anonymous.list_layers()

    def test_plaintext_to_tls_port_fails(self):
        with self.client("admin-token") as plaintext:
            with self.assertRaises(Unavailable):
                plaintext.list_layers()


if __name__ == "__main__":
    unittest.main(argv=ARGV)
