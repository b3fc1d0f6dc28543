"""The two small steps of `shared.envs.sandbox` that must run in the sandboxed process itself
(standard library only; `python -I sandbox_runner.py STEP CONFIG_JSON`):

- `outside`: join the call's cgroup(s) (`shared.envs.cgroups`), then exec bubblewrap, so
  everything the call starts is counted against the call's memory and process limits (an agent
  program's start, `services.inference.agent_programs`, takes this step too);
- `inside` (in the sandbox, as bubblewrap's command): set the per-process limits (CPU seconds,
  address space, processes counted in the call's own user namespace, file size, open files, no
  core dumps), then exec the model's code with `python -I -S code.py`.
"""

import json
import os
import resource
import sys


def outside(config: dict) -> None:
    for procs in config["procs"]:
        with open(procs, "w") as f:
            f.write("0")
    os.execv(config["argv"][0], config["argv"])


def inside(config: dict) -> None:
    cpu = int(config["cpu_seconds"])
    limits = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),
        resource.RLIMIT_AS: config["memory_bytes"],
        resource.RLIMIT_NPROC: config["processes"],
        resource.RLIMIT_FSIZE: config["file_bytes"],
        resource.RLIMIT_NOFILE: config["open_files"],
        resource.RLIMIT_CORE: 0,
    }
    for name, value in limits.items():
        resource.setrlimit(name, value if isinstance(value, tuple) else (value, value))
    os.execv(sys.executable, [sys.executable, "-I", "-S", "code.py"])


if __name__ == "__main__":
    {"outside": outside, "inside": inside}[sys.argv[1]](json.loads(sys.argv[2]))
