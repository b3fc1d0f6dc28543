"""Regenerate deploy/seccomp/agents.json, the seccomp profile of the inference replicas in compose and
Kubernetes: the container runtime's default profile (deploy/seccomp/runtime-default.json, moby/profiles'
seccomp/default.json at cd3bed8061c7) resolved for a container without capabilities on x86_64 and
aarch64, plus exactly what bubblewrap needs (`ADDITIONS`). Flat (no `includes`, no `archMap`), so every
loader reads it alike. tests/deploy keeps the file equal to this output: run after editing either,
`.venv/bin/python scripts/gen_seccomp.py`. Why each addition: docs/guides/deploy-compose.md."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "deploy" / "seccomp" / "runtime-default.json"
PROFILE = ROOT / "deploy" / "seccomp" / "agents.json"

# the runtime's names of the architectures a rule may be limited to, for the two the images are built for
ARCHES = ("amd64", "arm64")
ARCHITECTURES = ("SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32", "SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM")
CLONE_NEWUSER = 0x10000000
# new namespaces only together with a new user namespace: an unprivileged process's only way to
# them (bubblewrap's clone of its sandbox, and the second user namespace --disable-userns makes)
WITH_NEW_USER_NAMESPACE = [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}]
ADDITIONS = [
    {
        "names": ["clone"],
        "action": "SCMP_ACT_ALLOW",
        "args": WITH_NEW_USER_NAMESPACE,
        "comment": "bubblewrap: the sandbox's namespaces, made with its user namespace in one clone",
    },
    {
        "names": ["unshare"],
        "action": "SCMP_ACT_ALLOW",
        "args": WITH_NEW_USER_NAMESPACE,
        "comment": "bubblewrap --disable-userns: the second user namespace, under the first",
    },
    {
        "names": ["mount", "umount2", "pivot_root"],
        "action": "SCMP_ACT_ALLOW",
        "comment": "bubblewrap: the sandbox's view (binds, tmpfs, proc), in its own mount namespace",
    },
]


def applies(rule: dict) -> bool:
    """Whether the runtime applies `rule` to a container without capabilities on at least one of
    ARCHES (the kernel version condition, a kernel older than 4.8, is taken as met)."""
    includes, excludes = rule.get("includes", {}), rule.get("excludes", {})
    if includes.get("caps"):  # granted only with a capability the container does not have
        return False
    if includes.get("arches") and not set(includes["arches"]) & set(ARCHES):
        return False
    return not (excludes.get("arches") and set(ARCHES) <= set(excludes["arches"]))


def resolved(default: dict) -> list[dict]:
    """The default's rules a container without capabilities gets, flat: names, action, args, errno."""
    keep = ("names", "action", "args", "errnoRet")
    return [
        {k: rule[k] for k in keep if rule.get(k) not in (None, [])} for rule in default["syscalls"] if applies(rule)
    ]


def profile(default: dict) -> dict:
    return {
        "defaultAction": default["defaultAction"],
        "defaultErrnoRet": default["defaultErrnoRet"],
        "architectures": list(ARCHITECTURES),
        "syscalls": resolved(default) + ADDITIONS,
    }


def render() -> str:
    return json.dumps(profile(json.loads(DEFAULT.read_text())), indent=2) + "\n"


if __name__ == "__main__":
    PROFILE.write_text(render())
    print(f"wrote {PROFILE.relative_to(ROOT)}")
