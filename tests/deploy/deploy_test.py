"""Checks the deployment files (deploy/docker, deploy/compose, deploy/k8s, docs/DEPLOY.md).

No container engine or cluster exists on the build machines, so this validates what can be
validated statically: every YAML passes yamllint and parses; the Compose files carry the GPU
reservation, NCCL settings, shared memory, locked-memory limit and checkpoint volume; every
image reference is pinned; every Kubernetes workload names gRPC probes (readiness "",
liveness "liveness"), resource requests and limits, /dev/shm and checkpoint volumes; every
Compose worker's health check asks its own port with moectl; the Dockerfile builds with the
project's setup script and nothing else; and every command-line flag written in these files
exists in the binary it is passed to (asked from the built binaries with --helpfull), so the
docs stay true to the code.

Run by Bazel (tests/deploy:deploy_test) from the runfiles root; also runnable by hand from the
repository root: /usr/bin/python3 tests/deploy/deploy_test.py (flag checks need --bin_dir).
"""

import argparse
import glob
import os
import re
import shlex
import subprocess
import sys
import unittest

import yaml

ARGS = None  # parsed in main()

COMPOSE_FILES = ["deploy/compose/compose.gpu.yaml", "deploy/compose/compose.cpu.yaml"]
K8S_LAYOUTS = ["deploy/k8s/single-node", "deploy/k8s/multi-node"]
DOCKERFILE = "deploy/docker/Dockerfile"
DEPLOY_DOC = "docs/DEPLOY.md"
NETNS_TEST = "tests/deploy/netns_test.sh"
# A pinned image: an exact x.y.z version in the tag, or a sha256 digest.
PINNED = re.compile(r"^[\w./-]+(:[\w.-]*\d+\.\d+\.\d+[\w.-]*)?(@sha256:[0-9a-f]{64})?$")


def yaml_files():
    files = sorted(glob.glob("deploy/compose/*.yaml") + glob.glob("deploy/k8s/**/*.yaml",
                                                                  recursive=True))
    assert files, "no YAML found under deploy/ (wrong working directory?)"
    return files


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def flag_names(args):
    """Flag names in a list of arguments: '--port=1' -> 'port'."""
    out = []
    for a in args:
        m = re.match(r"^--([A-Za-z0-9_]+)(=|$)", str(a))
        if m:
            out.append(m.group(1))
    return out


def as_list(cmd):
    if cmd is None:
        return []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def flag_value(args, name):
    for a in args:
        if str(a).startswith("--%s=" % name):
            return str(a).split("=", 1)[1]
    return None


def is_pinned(image):
    if "${" in image:
        return False  # an interpolated reference can be anything
    has_tag = ":" in image.split("/")[-1]
    has_digest = "@sha256:" in image
    return bool(PINNED.match(image)) and (has_tag or has_digest)


class YamlTest(unittest.TestCase):

    def test_yamllint(self):
        files = yaml_files()
        proc = subprocess.run(["yamllint", "-s", "-f", "parsable", "-c",
                               "tests/deploy/yamllint.yaml"] + files,
                              capture_output=True, text=True)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)

    def test_every_file_parses(self):
        for path in yaml_files():
            docs = load_all(path)
            self.assertTrue(docs, path + " is empty")
            for d in docs:
                self.assertIsInstance(d, dict, path)


class ComposeTest(unittest.TestCase):

    def services(self, path):
        (doc,) = load_all(path)
        return doc, doc["services"]

    def workers(self, services):
        return {n: s for n, s in services.items() if as_list(s.get("entrypoint")) == ["moe-worker"]}

    def test_front_end_and_workers_agree(self):
        for path in COMPOSE_FILES:
            doc, services = self.services(path)
            self.assertIn("moed", services, path)
            moed_args = as_list(services["moed"]["command"])
            port = flag_value(moed_args, "port")
            self.assertTrue(port, path + ": moed has no --port")
            self.assertIn(port + ":" + port, [str(p) for p in services["moed"]["ports"]], path)
            workers = self.workers(services)
            self.assertGreaterEqual(len(workers), 2, path)
            expect = flag_value(moed_args, "expect_workers")
            m = re.match(r"^\$\{[A-Z_]+:-(\d+)\}$", expect or "")
            self.assertEqual(int(m.group(1) if m else expect), len(workers),
                             path + ": --expect_workers must equal the number of workers")
            for name, svc in workers.items():
                args = as_list(svc["command"])
                internal = flag_value(moed_args, "internal_listen").rsplit(":", 1)[1]
                self.assertEqual(flag_value(args, "frontend"), "moed:" + internal,
                                 path + " " + name)
                self.assertEqual(flag_value(args, "advertise_host"), name, path + " " + name)
                self.assertIn("moed", svc.get("depends_on", []), path + " " + name)
            for name, svc in services.items():
                self.assertIn("checkpoints:/checkpoints", svc.get("volumes", []),
                              path + " " + name + " lacks the checkpoint volume")
                # The internal plane's secret: a Compose secret (a host file), never the image.
                self.assertIn("cluster_secret", as_list(svc.get("secrets")), path + " " + name)
                self.assertEqual(flag_value(as_list(svc["command"]), "cluster_secret_file"),
                                 "/run/secrets/cluster_secret", path + " " + name)
            self.assertIn("checkpoints", doc.get("volumes", {}), path)
            self.assertIn("file", doc["secrets"]["cluster_secret"], path)

    def test_worker_healthchecks_ask_the_worker(self):
        # A worker's own grpc.health.v1 ("" = joined and set up), on the port it listens on.
        for path in COMPOSE_FILES:
            _, services = self.services(path)
            for name, svc in self.workers(services).items():
                check = svc.get("healthcheck", {})
                self.assertFalse(check.get("disable"), path + " " + name)
                test = as_list(check.get("test"))
                self.assertEqual(test[:2], ["CMD", "moectl"], path + " " + name)
                self.assertIn("health", test, path + " " + name)
                port = flag_value(as_list(svc["command"]), "listen").rsplit(":", 1)[1]
                self.assertEqual(flag_value(test, "server"), "127.0.0.1:" + port,
                                 path + " " + name)

    def test_gpu_file_reserves_one_gpu_per_worker_with_nccl_settings(self):
        _, services = self.services("deploy/compose/compose.gpu.yaml")
        device_ids = []
        for name, svc in self.workers(services).items():
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            self.assertEqual(len(devices), 1, name)
            self.assertIn("gpu", devices[0]["capabilities"], name)
            self.assertEqual(len(devices[0]["device_ids"]), 1, name)
            device_ids += devices[0]["device_ids"]
            self.assertEqual(flag_value(as_list(svc["command"]), "device"), "cuda:0", name)
            self.assertTrue(re.match(r"^\d+[gm]b$", str(svc["shm_size"])), name)
            self.assertEqual(svc["ulimits"]["memlock"], {"soft": -1, "hard": -1}, name)
            env = svc["environment"]
            self.assertEqual(env["NCCL_DEBUG"], "WARN", name)
            # The interface once, as a flag: the worker sets NCCL_SOCKET_IFNAME from it.
            self.assertTrue(flag_value(as_list(svc["command"]), "socket_ifname"), name)
            self.assertNotIn("NCCL_SOCKET_IFNAME", env, name)
        self.assertEqual(len(set(device_ids)), len(device_ids), "two workers share a GPU")

    def test_cpu_file_has_no_gpu(self):
        _, services = self.services("deploy/compose/compose.cpu.yaml")
        for name, svc in services.items():
            self.assertNotIn("deploy", svc, name + ": the CPU variant reserves no devices")
        for name, svc in self.workers(services).items():
            self.assertEqual(flag_value(as_list(svc["command"]), "device"), "cpu", name)


def k8s_docs(layout):
    """Every document a kustomization (and the ones it includes) lists, plus generated maps."""
    (kust,) = load_all(os.path.join(layout, "kustomization.yaml"))
    docs = []
    for res in kust.get("resources", []):
        path = os.path.normpath(os.path.join(layout, res))
        if os.path.isdir(path):
            docs += k8s_docs(path)
        else:
            docs += load_all(path)
    for gen in kust.get("configMapGenerator", []):
        data = dict(l.split("=", 1) for l in gen.get("literals", []))
        docs.append({"kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    return docs


def containers_of(doc):
    return doc["spec"]["template"]["spec"]["containers"]


class KubernetesTest(unittest.TestCase):

    def workloads(self, docs):
        return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]

    def test_kustomizations_resolve(self):
        for layout in K8S_LAYOUTS:
            kinds = sorted(d["kind"] for d in k8s_docs(layout))
            self.assertEqual(kinds, ["ConfigMap", "Deployment", "PersistentVolumeClaim",
                                     "Service", "Service", "Service", "StatefulSet"], layout)

    def test_probes_resources_and_volumes(self):
        for layout in K8S_LAYOUTS:
            docs = k8s_docs(layout)
            claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
            for w in self.workloads(docs):
                where = layout + " " + w["metadata"]["name"]
                volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
                for c in containers_of(w):
                    ports = {p["containerPort"] for p in c["ports"]}
                    listen = flag_value(c["args"], "listen")  # worker: host:port; moed: host
                    port = int(listen.rsplit(":", 1)[1] if listen and ":" in listen
                               else flag_value(c["args"], "port"))
                    self.assertIn(port, ports, where)
                    # Readiness is grpc.health.v1 "" (front end: SERVING = all workers in;
                    # worker: joined and set up); liveness must not follow it (a lost worker
                    # would restart the front end and drop every layer): the "liveness" name.
                    # A port that speaks mutual TLS (the workers': --internal_tls_*) cannot be
                    # asked by the kubelet's gRPC probe: moectl health with the members' files.
                    tls = flag_value(c["args"], "internal_tls_cert_file") is not None
                    for probe, service in (("readinessProbe", ""), ("livenessProbe", "liveness")):
                        what = where + " " + probe
                        if w["kind"] == "StatefulSet" and tls:
                            self.assertNotIn("grpc", c[probe], what + ": TLS port, gRPC probe")
                            cmd = [str(a) for a in c[probe]["exec"]["command"]]
                            self.assertEqual(cmd[0], "moectl", what)
                            self.assertIn("health", cmd, what)
                            self.assertEqual(flag_value(cmd, "server"), "127.0.0.1:%d" % port, what)
                            self.assertEqual(flag_value(cmd, "service") or "", service, what)
                            for mine, theirs in (("internal_tls_ca_file", "tls_ca_file"),
                                                 ("internal_tls_cert_file", "tls_cert_file"),
                                                 ("internal_tls_key_file", "tls_key_file"),
                                                 ("internal_tls_server_name", "tls_server_name")):
                                self.assertEqual(flag_value(cmd, theirs),
                                                 flag_value(c["args"], mine), what + " " + theirs)
                            # Above moectl's start and the TLS handshake (1 s by default).
                            self.assertGreater(c[probe].get("timeoutSeconds", 1) * 1000,
                                               int(flag_value(cmd, "deadline_ms")), what)
                        else:
                            self.assertIn("grpc", c[probe], what)
                            self.assertEqual(c[probe]["grpc"]["port"], port, what)
                            self.assertEqual(c[probe]["grpc"].get("service", ""), service, what)
                    self.assertIn("cpu", c["resources"]["requests"], where)
                    self.assertIn("memory", c["resources"]["requests"], where)
                    self.assertIn("memory", c["resources"]["limits"], where)
                    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                    self.assertIn("/checkpoints", mounts, where)
                    pvc = volumes[mounts["/checkpoints"]]["persistentVolumeClaim"]["claimName"]
                    self.assertIn(pvc, claims, where)
                    # The internal plane's secret: a Kubernetes Secret mounted as a file.
                    secret_file = flag_value(c["args"], "cluster_secret_file")
                    self.assertTrue(secret_file, where + ": no --cluster_secret_file")
                    secret_volume = volumes[mounts[secret_file.rsplit("/", 1)[0]]]
                    self.assertEqual(secret_volume["secret"]["secretName"], "moed-cluster-secret",
                                     where)
                    if w["kind"] == "StatefulSet":  # workers
                        self.assertEqual(c["resources"]["limits"]["nvidia.com/gpu"], 1, where)
                        self.assertEqual(flag_value(c["args"], "device"), "cuda:0", where)
                        shm = volumes[mounts["/dev/shm"]]
                        self.assertEqual(shm["emptyDir"]["medium"], "Memory", where)
                        env = {e["name"]: e.get("value") for e in c["env"]}
                        self.assertEqual(env["NCCL_DEBUG"], "WARN", where)
                        # The interface, once: moe-worker --socket_ifname sets
                        # NCCL_SOCKET_IFNAME (and refuses an environment that differs).
                        self.assertTrue(flag_value(c["args"], "socket_ifname"), where)
                        self.assertNotIn("NCCL_SOCKET_IFNAME", env, where)

    def test_internal_plane_is_mutual_tls(self):
        """moed and every worker carry the same --internal_tls_* files, each mounted read-only
        from the Secret moed-internal-tls, and check peers against one name."""
        for layout in K8S_LAYOUTS:
            names = set()
            for w in self.workloads(k8s_docs(layout)):
                where = layout + " " + w["metadata"]["name"]
                volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
                (c,) = containers_of(w)
                mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
                for flag in ("internal_tls_cert_file", "internal_tls_key_file",
                             "internal_tls_ca_file"):
                    path = flag_value(c["args"], flag)
                    self.assertTrue(path, "%s: no --%s" % (where, flag))
                    mount = mounts[path.rsplit("/", 1)[0]]
                    self.assertTrue(mount.get("readOnly"), where + " " + flag)
                    secret = volumes[mount["name"]]["secret"]
                    self.assertEqual(secret["secretName"], "moed-internal-tls", where + " " + flag)
                    self.assertEqual(secret.get("defaultMode"), 0o440, where + " " + flag)
                names.add(flag_value(c["args"], "internal_tls_server_name"))
            self.assertEqual(names, {"moe-internal"}, layout)

    def test_workers_join_the_front_end_service(self):
        for layout in K8S_LAYOUTS:
            docs = k8s_docs(layout)
            services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
            (front,) = [d for d in docs if d["kind"] == "Deployment"]
            (workers,) = [d for d in docs if d["kind"] == "StatefulSet"]
            (layout_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
            self.assertEqual(int(layout_map["data"]["workers"]), workers["spec"]["replicas"],
                             layout + ": front end must expect every worker replica")
            front_labels = front["spec"]["template"]["metadata"]["labels"]
            front_port = int(flag_value(containers_of(front)[0]["args"],
                                        "internal_listen").rsplit(":", 1)[1])
            host, port = flag_value(containers_of(workers)[0]["args"], "frontend").split(":")
            svc = services[host]
            self.assertEqual(svc["spec"]["selector"], front_labels, layout)
            self.assertIn(int(port), [p["port"] for p in svc["spec"]["ports"]], layout)
            self.assertEqual(int(port), front_port, layout)
            # The front end is not ready until the workers joined: the join Service must
            # publish it before it is ready, or nobody could ever join.
            self.assertTrue(svc["spec"].get("publishNotReadyAddresses"), layout)
            self.assertEqual(workers["spec"]["serviceName"], "moe-worker", layout)
            self.assertIn("moe-worker", services, layout)

    def test_multi_node_runs_what_the_netns_test_runs(self):
        """tests/deploy/netns_test.sh runs the several-hosts mode for real (network namespaces):
        every flag it gives moed and the workers, but the ones that only tune the test, is in
        the multi-node manifests, with the same value where the value is the mode's."""
        with open(NETNS_TEST) as f:
            script = f.read()

        def test_flags(function):
            body = re.search(r"^%s\(\) \{\n(.*?)^\}" % function, script, re.S | re.M).group(1)
            return dict(re.findall(r"--([a-z_]+)=(\S+)", body))

        # Test-only: shorter timeouts, no metrics port, a durable checkpoint every step, the
        # shared-memory refusals it checks, its own folders and CPU workers.
        test_only = {"metrics_listen", "allow_client_shm", "step_timeout_ms", "ping_timeout_ms",
                     "durable_every_steps", "rejoin_after_s", "device"}
        # The mode's values (the rest are paths and addresses of the test's own hosts): moed's
        # public port, the name every member's certificate is for, the interface.
        same_value = {"moed": {"listen": "0.0.0.0", "port": "50051",
                               "internal_tls_server_name": "moe-internal"},
                      "moe-worker": {"internal_tls_server_name": "moe-internal",
                                     "socket_ifname": "eth0"}}
        docs = k8s_docs("deploy/k8s/multi-node")
        (front,) = [d for d in docs if d["kind"] == "Deployment"]
        (workers,) = [d for d in docs if d["kind"] == "StatefulSet"]
        for what, function, doc, path in (
                ("moed", "start_moed", front, "deploy/k8s/common/frontend.yaml"),
                ("moe-worker", "start_worker", workers, "deploy/k8s/multi-node/workers.yaml")):
            args = containers_of(doc)[0]["args"]
            flags = test_flags(function)
            self.assertTrue(flags, "no flags found in %s()" % function)
            for name in same_value[what]:
                self.assertIn(name, flags, "%s(): no --%s (the test checks it)" % (function, name))
            for name, value in sorted(flags.items()):
                if name in test_only:
                    continue
                self.assertIn(name, flag_names(args), "%s: the netns test passes --%s, %s does "
                              "not" % (what, name, path))
                if name in same_value[what]:
                    self.assertEqual(value, same_value[what][name], "netns test --" + name)
                    self.assertEqual(flag_value(args, name), value, "%s --%s" % (path, name))
        # Durable state: the workers write moed's --state_dir, so it is mounted in every pod at
        # the same path from the same claim.
        state_dir = flag_value(containers_of(front)[0]["args"], "state_dir")
        for doc in (front, workers):
            mounts = {m["mountPath"]: m for m in containers_of(doc)[0]["volumeMounts"]}
            self.assertIn(state_dir, mounts, doc["kind"])
            self.assertEqual(mounts[state_dir]["name"], "checkpoints", doc["kind"])
            self.assertNotEqual(mounts[state_dir].get("subPath"),
                                mounts["/checkpoints"].get("subPath"), doc["kind"])


def dockerfile_instructions():
    """(instruction, argument) pairs, with continuation lines joined and comments dropped. A FROM
    naming a global build argument (ARG before the first FROM) shows the argument's default."""
    out, cur = [], ""
    with open(DOCKERFILE) as f:
        for line in f:
            s = line.rstrip("\n")
            if not cur and (not s.strip() or s.lstrip().startswith("#")):
                continue
            if s.endswith("\\"):
                cur += s[:-1] + " "
                continue
            cur += s
            word, _, rest = cur.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            cur = ""
    defaults = {}
    for word, rest in out:
        if word == "FROM":
            break
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name.strip()] = value.strip()
    return [(w, re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m.group(1), m.group(0)), r))
            if w == "FROM" else (w, r) for w, r in out]


class StopGraceTest(unittest.TestCase):
    """SIGTERM starts moed's graceful stop, bounded by --shutdown_grace_s (default 25 s): the
    container runtime must wait longer than that before it SIGKILLs the front end."""

    MOED_DEFAULT_GRACE_S = 25

    def grace_of(self, args):
        value = flag_value(args, "shutdown_grace_s")
        return int(value) if value else self.MOED_DEFAULT_GRACE_S

    def test_compose_waits_for_the_graceful_stop(self):
        for path in COMPOSE_FILES:
            (doc,) = load_all(path)
            moed = doc["services"]["moed"]
            m = re.match(r"^(\d+)s$", str(moed.get("stop_grace_period", "")))
            self.assertTrue(m, path + ": moed needs stop_grace_period (Compose's default is 10s)")
            self.assertGreater(int(m.group(1)), self.grace_of(as_list(moed["command"])), path)

    def test_kubernetes_waits_for_the_graceful_stop(self):
        for layout in K8S_LAYOUTS:
            for d in k8s_docs(layout):
                if d["kind"] != "Deployment":  # the front end
                    continue
                spec = d["spec"]["template"]["spec"]
                (c,) = containers_of(d)
                self.assertGreater(spec.get("terminationGracePeriodSeconds", 30),
                                   self.grace_of(c["args"]), layout)
                self.assertIn("terminationGracePeriodSeconds", spec, layout)


class DockerfileTest(unittest.TestCase):

    def stages(self):
        stages = []
        for word, rest in dockerfile_instructions():
            if word == "FROM":
                image, _, name = rest.partition(" AS ")
                stages.append({"image": image.strip(), "name": name.strip(), "steps": []})
            elif stages:  # global ARGs (the base images) come before the first FROM
                stages[-1]["steps"].append((word, rest))
        return stages

    def test_build_on_cuda_devel_ship_on_matching_runtime(self):
        build, runtime = self.stages()
        m = re.match(r"^nvidia/cuda:(13\.\d+\.\d+)-devel-(ubuntu\d+\.\d+)$", build["image"])
        self.assertTrue(m, build["image"])
        self.assertEqual(runtime["image"], "nvidia/cuda:%s-runtime-%s" % m.groups())

    def test_build_stage_uses_the_project_setup_script_only(self):
        build, runtime = self.stages()
        runs = [rest for word, rest in build["steps"] if word == "RUN"]
        self.assertIn(("COPY", "setup.sh /src/setup.sh"), build["steps"])
        self.assertRegex(runs[0], r"^/src/setup\.sh( --build-only)?$",
                         "the first RUN must be the setup script")
        for word, rest in build["steps"] + runtime["steps"]:
            self.assertNotRegex(rest, r"\b(apt-get|apt|dpkg|pip3?|curl|wget)\b",
                                "packages come from setup.sh only: " + rest)
        # The script exists and is the one CI runs.
        with open("setup.sh") as f:
            self.assertIn("PACKAGES=(", f.read())
        self.assertRegex(runs[1], r"^bazel build //server:moed //server:moe-worker //client:moectl")

    def test_runtime_stage(self):
        _, runtime = self.stages()
        steps = dict((w, r) for w, r in runtime["steps"])
        self.assertNotIn(steps["USER"].split(":")[0], ("root", "0"))
        self.assertEqual(steps["ENTRYPOINT"], '["moed"]')
        health = steps["HEALTHCHECK"]
        self.assertRegex(health, r'CMD \["moectl", .*"health"\]')
        copies = [r for w, r in runtime["steps"] if w == "COPY"]
        self.assertEqual(copies, ["--from=build /opt/moed /opt/moed"],
                         "the runtime stage carries only the collected binaries and libraries")

    def test_collected_binaries_are_built(self):
        build, _ = self.stages()
        built = re.findall(r"//([\w/]+):([\w-]+)", build["steps"][-1][1])
        collected = re.findall(r"bazel-bin/([\w/-]+)", build["steps"][-1][1])
        self.assertEqual(["%s/%s" % t for t in built], collected)


class ImagesPinnedTest(unittest.TestCase):

    def test_every_image_is_pinned(self):
        images = []
        for word, rest in dockerfile_instructions():
            if word == "FROM":
                images.append((DOCKERFILE, rest.split()[0]))
        for path in COMPOSE_FILES:
            for name, svc in load_all(path)[0]["services"].items():
                images.append((path + " " + name, svc["image"]))
            images.append((path + " x-worker", load_all(path)[0]["x-worker"]["image"]))
        for layout in K8S_LAYOUTS:
            for d in k8s_docs(layout):
                if d["kind"] in ("Deployment", "StatefulSet"):
                    for c in containers_of(d):
                        images.append((layout + " " + d["metadata"]["name"], c["image"]))
        self.assertGreaterEqual(len(images), 8)
        for where, image in images:
            self.assertTrue(is_pinned(image), "%s: image %r is not pinned" % (where, image))
            self.assertNotIn(":latest", image, where)
        self.assertFalse(is_pinned("nvidia/cuda:13.0-devel-ubuntu24.04"))  # the check can fail
        self.assertFalse(is_pinned("moed"))


class SizingTableTest(unittest.TestCase):
    """The sizing table of docs/DEPLOY.md recomputed from the shapes in its first column."""

    def test_numbers(self):
        rows = []
        with open(DEPLOY_DOC) as f:
            for line in f:
                m = re.match(r"^\| (\w+) \(([\d, ]+)\) \|(.*)\|$", line)
                if m:
                    rows.append((m.group(1), [int(v) for v in m.group(2).split(",")],
                                 [c.strip() for c in m.group(3).split("|")]))
        self.assertEqual([r[0] for r in rows], ["te_seed", "mixtral", "dsv3", "qwen3"])
        gib = float(1 << 30)
        for name, (tokens, hidden, ffn, experts, k), cells in rows:
            params = 3 * hidden * ffn                      # wi [H, 2F] + wo [F, H]
            self.assertAlmostEqual(float(cells[0].split()[0]), params / 1e6, delta=0.051, msg=name)
            self.assertAlmostEqual(float(cells[1]), 18 * params / gib, delta=0.0051, msg=name)
            for ranks, cell in zip((1, 2, 8), cells[2:5]):
                local, state, step = [float(v) for v in cell.split("/")]
                rows_local, t = tokens * k / ranks, tokens / ranks
                want_state = (experts // ranks) * 18 * params + 16 * hidden * experts
                want_step = (t * hidden * 4 + t * experts * 8 + t * 4 + t * k * 12 +
                             rows_local * (hidden + 3 * ffn) * 2 + t * k * hidden * 2)
                self.assertEqual(local, experts // ranks, name)
                self.assertAlmostEqual(state, want_state / gib, delta=max(0.006, 0.005 * state),
                                       msg="%s R=%d state" % (name, ranks))
                self.assertAlmostEqual(step, want_step / gib, delta=0.006,
                                       msg="%s R=%d kept step" % (name, ranks))


def helpfull(binary):
    """Flag names a binary accepts, from its --helpfull output ("    --name (help...")."""
    proc = subprocess.run([binary, "--helpfull"], capture_output=True, text=True, timeout=30)
    text = proc.stdout + proc.stderr
    names = set(re.findall(r"^    --([A-Za-z0-9_]+) \(", text, re.M))  # absl: 4 spaces
    assert "flagfile" in names, "no flags parsed from %s:\n%s" % (binary, text)
    return names | {"help", "helpfull", "helpshort", "version"}  # absl's built-in flags


class FlagsExistTest(unittest.TestCase):
    """Every flag written in the deployment files and docs/DEPLOY.md exists in its binary."""

    def setUp(self):
        if not ARGS.bin_dir:
            self.skipTest("--bin_dir not given (run through Bazel)")
        self.flags = {b: helpfull(os.path.join(ARGS.bin_dir, p))
                      for b, p in (("moed", "server/moed"), ("moe-worker", "server/moe-worker"),
                                   ("moectl", "client/moectl"))}

    def uses(self):
        """(where, binary, [args]) for every command line in the deployment files."""
        out = []
        for path in COMPOSE_FILES:
            doc = load_all(path)[0]
            for name, svc in doc["services"].items():
                binary = (as_list(svc.get("entrypoint")) or ["moed"])[0]
                out.append((path + " " + name, binary, as_list(svc.get("command"))))
                test = as_list(svc.get("healthcheck", {}).get("test"))
                if test[:1] == ["CMD"]:
                    out.append((path + " " + name + " healthcheck", test[1], test[2:]))
        for layout in K8S_LAYOUTS:
            for d in k8s_docs(layout):
                if d["kind"] in ("Deployment", "StatefulSet"):
                    for c in containers_of(d):
                        out.append((layout, (c.get("command") or ["moed"])[0], c["args"]))
                        for probe in ("readinessProbe", "livenessProbe"):
                            cmd = [str(a) for a in c[probe].get("exec", {}).get("command", [])]
                            if cmd:
                                out.append((layout + " " + probe, cmd[0], cmd[1:]))
        for word, rest in dockerfile_instructions():
            if word == "CMD":
                out.append((DOCKERFILE, "moed", yaml.safe_load(rest)))
            if word == "HEALTHCHECK":
                out.append((DOCKERFILE, "moectl", yaml.safe_load(rest.split("CMD", 1)[1])[1:]))
        # Command lines in the guide: any line invoking one of the binaries.
        with open(DEPLOY_DOC) as f:
            for line in f:
                # A binary, then flags and lower-case words (subcommands such as "health").
                for m in re.finditer(r"\b(moed|moe-worker|moectl)((?:\s+(?:--\w+(?:=[^\s`]*)?"
                                     r"|(?!moed\b|moe-worker\b|moectl\b)[a-z][\w-]*))+)", line):
                    out.append((DEPLOY_DOC, m.group(1), m.group(2).split()))
        return out

    def test_flags_exist(self):
        uses = self.uses()
        self.assertGreater(len(uses), 10)
        self.assertGreater(sum(len(flag_names(args)) for _, _, args in uses), 40)
        for where, binary, args in uses:
            for name in flag_names(args):
                self.assertIn(name, self.flags[binary],
                              "%s: %s has no flag --%s" % (where, binary, name))


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin_dir", default="", help="folder holding server/ and client/ "
                        "binaries (the runfiles root under Bazel)")
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
