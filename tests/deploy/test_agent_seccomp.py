"""The inference replicas' seccomp profile (deploy/seccomp/agents.json), which lets bubblewrap isolate
agent programs and sandboxed code inside a container: the runtime's default profile for a container
without capabilities plus exactly clone and unshare with a new user namespace, mount, umount2 and
pivot_root, every other decision of the default kept; and the deployments giving it to the replicas
(compose, and Kubernetes through components/agent-isolation). The profile itself is exercised in real
containers by `scripts/containers agents`."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from tests.deploy.test_deploy import DEPLOY, ROOT, compose, copy_deploy, render, service_of, workloads

PROFILE = DEPLOY / "seccomp" / "agents.json"
DEFAULT = DEPLOY / "seccomp" / "runtime-default.json"
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x20000000, 0x40000000, 17
BWRAP_CLONE = SIGCHLD | CLONE_NEWNS | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
FLAGS = [0, SIGCHLD, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET | CLONE_NEWNS, BWRAP_CLONE]
FLAGS += [CLONE_NEWCGROUP, CLONE_NEWUSER | CLONE_NEWNET]
# what a sandbox escape reaches for: each stays denied
DANGEROUS = ["keyctl", "add_key", "request_key", "bpf", "userfaultfd", "io_uring_setup", "io_uring_enter"]
DANGEROUS += ["io_uring_register", "perf_event_open", "setns", "chroot", "open_by_handle_at", "init_module"]
DANGEROUS += ["finit_module", "kexec_load", "reboot", "swapon", "fsopen", "fsmount", "move_mount", "open_tree"]
DANGEROUS += ["mount_setattr", "sethostname", "setdomainname", "syslog", "quotactl", "acct", "iopl", "ioperm"]


def gen_seccomp():
    spec = importlib.util.spec_from_file_location("gen_seccomp", ROOT / "scripts" / "gen_seccomp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def matches(rule: dict, args: tuple[int, ...]) -> bool:
    """libseccomp's comparisons of a rule's args (every one must hold)."""
    ops = {
        "SCMP_CMP_EQ": lambda a, c: a == c["value"],
        "SCMP_CMP_NE": lambda a, c: a != c["value"],
        "SCMP_CMP_LT": lambda a, c: a < c["value"],
        "SCMP_CMP_LE": lambda a, c: a <= c["value"],
        "SCMP_CMP_GT": lambda a, c: a > c["value"],
        "SCMP_CMP_GE": lambda a, c: a >= c["value"],
        "SCMP_CMP_MASKED_EQ": lambda a, c: a & c["value"] == c.get("valueTwo", 0),
    }
    return all(ops[c["op"]](args[c["index"]] if c["index"] < len(args) else 0, c) for c in rule.get("args") or [])


def decision(profile: dict, name: str, args: tuple[int, ...], arch: str = "amd64") -> tuple[str, int]:
    """(action, errno) the profile gives `name(args)`: a rule that allows wins over one that refuses
    (libseccomp's precedence), else the matching rule, else the default. A Docker-format rule is
    evaluated for a container without capabilities on `arch` (its `includes`/`excludes`)."""
    found = []
    for rule in profile["syscalls"]:
        includes, excludes = rule.get("includes", {}), rule.get("excludes", {})
        if includes.get("caps") or (includes.get("arches") and arch not in includes["arches"]):
            continue
        if arch in excludes.get("arches", []):
            continue
        if name in rule["names"] and matches(rule, args):
            found.append((rule["action"], rule.get("errnoRet", profile["defaultErrnoRet"])))
    if any(action == "SCMP_ACT_ALLOW" for action, _ in found):
        return ("SCMP_ACT_ALLOW", 0)
    return found[0] if found else (profile["defaultAction"], profile["defaultErrnoRet"])


def elsewhere(default: dict, arch: str) -> set[str]:
    """The names the default grants only on other architectures: no syscalls of `arch` (libseccomp resolves
    no number for them there, so a flat profile naming them grants nothing on it)."""
    limited = {n for r in default["syscalls"] if r.get("includes", {}).get("arches") for n in r["names"]}
    here = {n for r in default["syscalls"] if arch in r.get("includes", {}).get("arches", [arch]) for n in r["names"]}
    return limited - here


def probes(*profiles: dict, skip: set[str] = frozenset()) -> list[tuple[str, tuple[int, ...]]]:
    """Every syscall either profile names, and each of DANGEROUS, with the arguments that tell rules apart."""
    names = sorted(({n for p in profiles for r in p["syscalls"] for n in r["names"]} | set(DANGEROUS)) - skip)
    out = []
    for name in names:
        if name in ("clone", "unshare"):
            out += [(name, (flags,)) for flags in FLAGS]
        elif name == "socket":
            out += [(name, (family,)) for family in range(46)]
        elif name == "personality":
            out += [(name, (value,)) for value in (0, 8, 0x20000, 0x20008, 0xFFFFFFFF, 0x40000, 1)]
        else:
            out.append((name, (0,)))
    return out


def test_the_profile_is_the_runtime_default_plus_exactly_what_bubblewrap_needs():
    profile = json.loads(PROFILE.read_text())  # valid JSON
    assert PROFILE.read_text() == gen_seccomp().render()  # as scripts/gen_seccomp.py makes it from the default
    default = json.loads(DEFAULT.read_text())
    assert (profile["defaultAction"], profile["defaultErrnoRet"]) == ("SCMP_ACT_ERRNO", 1)
    assert {"SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"} <= set(profile["architectures"])
    assert not any("includes" in r or "excludes" in r for r in profile["syscalls"])  # flat: OCI loaders read it alike
    widened, narrowed = [], []
    assert elsewhere(default, "amd64") >= {"set_tls", "breakpoint"} and "arch_prctl" in elsewhere(default, "arm64")
    for arch in ("amd64", "arm64"):
        for name, args in probes(profile, default, skip=elsewhere(default, arch)):
            ours, theirs = decision(profile, name, args), decision(default, name, args, arch)
            if ours != theirs:
                (widened if ours[0] == "SCMP_ACT_ALLOW" else narrowed).append((name, args))
    assert narrowed == []  # everything the default allows, and its errno for everything it refuses
    additions = {(n, a) for n, a in widened}
    assert {n for n, _ in additions} == {"clone", "unshare", "mount", "umount2", "pivot_root"}
    # clone and unshare: only together with a new user namespace (bubblewrap's clone, --disable-userns's unshare)
    assert all(a[0] & CLONE_NEWUSER for n, a in additions if n in ("clone", "unshare"))
    assert decision(profile, "clone", (BWRAP_CLONE,))[0] == "SCMP_ACT_ALLOW"
    assert decision(default, "clone", (BWRAP_CLONE,), "amd64")[0] == "SCMP_ACT_ERRNO"  # why the default forbids it
    for flags in (CLONE_NEWNET, CLONE_NEWNS | CLONE_NEWPID):
        assert decision(profile, "clone", (flags,)) == decision(profile, "unshare", (flags,)) == ("SCMP_ACT_ERRNO", 1)
    for name in DANGEROUS:
        assert decision(profile, name, (0,)) == ("SCMP_ACT_ERRNO", 1), name
    assert decision(profile, "clone3", (0,)) == ("SCMP_ACT_ERRNO", 38)  # ENOSYS: glibc falls back to clone


def test_the_decision_tells_a_missing_addition_and_a_widened_rule():
    """The comparison above is not blind: a profile without pivot_root, or with unshare for every flag, differs."""
    profile = json.loads(PROFILE.read_text())
    without = {**profile, "syscalls": [r for r in profile["syscalls"] if "pivot_root" not in r["names"]]}
    assert decision(without, "pivot_root", (0,)) == ("SCMP_ACT_ERRNO", 1)
    loose = {**profile, "syscalls": [*profile["syscalls"], {"names": ["unshare"], "action": "SCMP_ACT_ALLOW"}]}
    assert decision(loose, "unshare", (CLONE_NEWNET,))[0] == "SCMP_ACT_ALLOW"


def test_compose_gives_the_replicas_the_profile_and_an_unmasked_proc():
    services = compose()["services"]
    for name, service in services.items():
        options = service.get("security_opt", [])
        rollout_replica = service_of(service.get("command") or []) == "inference" and name in (
            "inference",
            "inference-policy",
        )
        if rollout_replica:
            seccomp = [o.split("=", 1)[1] for o in options if o.startswith("seccomp=")]
            assert seccomp == ["./deploy/seccomp/agents.json"] and (ROOT / seccomp[0]).resolve() == PROFILE, name
            assert "systempaths=unconfined" in options and "no-new-privileges:true" in options, name
            assert service["cap_drop"] == ["ALL"] and service["read_only"] is True, name
        else:  # every other service keeps the runtime's default and its masked /proc
            assert not any(o.startswith(("seccomp=", "systempaths=")) for o in options), name


def render_with(overlay: str, tmp_path: Path, components: list[str]) -> list[dict]:
    deploy = copy_deploy(tmp_path)
    with open(deploy / "k8s" / "overlays" / overlay / "kustomization.yaml", "a") as f:
        f.write("components:\n" + "".join(f"  - ../../components/{c}\n" for c in components))
    return render(overlay, deploy)


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_agent_isolation_component_gives_the_replicas_the_localhost_profile(overlay, tmp_path):
    import kubernetes_validate

    assert shutil.which("kubectl"), "kubectl is needed to render the kustomizations"
    docs = render_with(overlay, tmp_path, ["policy-eval", "agent-isolation"])
    version = kubernetes_validate.latest_version()
    pods = {name: w["spec"]["template"]["spec"] for name, w in workloads(docs).items()}
    assert {"inference", "inference-policy"} <= set(pods)
    for name, pod in pods.items():
        kubernetes_validate.validate(workloads(docs)[name], version, strict=True)
        container = pod["containers"][0]["securityContext"]
        if name in ("inference", "inference-policy"):
            assert pod["securityContext"]["seccompProfile"] == {
                "type": "Localhost",
                "localhostProfile": "steadyrl/agents.json",
            }
            assert Path(pod["securityContext"]["seccompProfile"]["localhostProfile"]).name == PROFILE.name
            assert pod["hostUsers"] is False and container["procMount"] == "Unmasked", name  # Unmasked needs hostUsers
            assert container["capabilities"] == {"drop": ["ALL"]} and container["allowPrivilegeEscalation"] is False
        else:
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert "hostUsers" not in pod and "procMount" not in container, name
    plain = {name: w["spec"]["template"]["spec"] for name, w in workloads(render(overlay)).items()}
    assert all(p["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"} for p in plain.values())
    comment = (DEPLOY / "k8s" / "components" / "agent-isolation" / "kustomization.yaml").read_text()
    assert "seccomp/steadyrl/agents.json" in comment  # where the profile must be on each node


def test_the_profile_is_valid_for_the_runtime_s_loader():
    """What runc would refuse outright: an unknown action or comparison, an argument index past 5."""
    profile = json.loads(PROFILE.read_text())
    actions = {"SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO", "SCMP_ACT_KILL", "SCMP_ACT_TRAP", "SCMP_ACT_TRACE", "SCMP_ACT_LOG"}
    for rule in profile["syscalls"]:
        assert rule["action"] in actions and rule["names"] and all(isinstance(n, str) for n in rule["names"])
        for arg in rule.get("args", []):
            assert 0 <= arg["index"] <= 5 and arg["op"].startswith("SCMP_CMP_")
