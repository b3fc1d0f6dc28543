"""An agent program that looks for what an agent must not reach, leaves
a detached process behind, and reports what it found on stderr before failing, so the report
rides the task's dead-letter reason (an isolated agent can write nowhere the test reads).

    python -m tests.agent_probe TOKEN_FILE MARKER
"""

import contextlib
import os
import subprocess
import sys


def main() -> None:
    token = sys.argv[1]
    marker = sys.argv[2]
    mine = os.getpid()
    others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != mine]
    seen_urls = 0  # another trajectory's session URL in a process it can see (its own sandbox's share its own)
    own = f"OPENAI_BASE_URL={os.environ.get('OPENAI_BASE_URL', '')}".encode()
    for pid in others:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as environ:
            seen_urls += any(v.startswith(b"OPENAI_BASE_URL=") and v != own for v in environ.read().split(b"\0"))
    leaked = sorted(
        k
        for k in os.environ
        if k
        not in (
            "OPENAI_BASE_URL",
            "OPENAI_API_KEY",
            "STEADYRL_PROMPT",
            "PATH",
            "LANG",
            "HOME",
            "TMPDIR",
            "PWD",
            "STEADYRL_TEST_PASSED",
        )
    )
    # a grandchild in a session of its own that would outlive this program
    subprocess.Popen(["sleep", marker], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    report = {
        "token": int(os.path.exists(token)),
        "token_dir": len(os.listdir(os.path.dirname(token))) if os.path.isdir(os.path.dirname(token)) else -1,
        "processes": len(others),
        "urls": seen_urls,
        "passed": os.environ.get("STEADYRL_TEST_PASSED", "-"),
        "leaked": ",".join(leaked) or "-",
        "key": int(len(os.environ.get("OPENAI_API_KEY", "")) >= 32),
    }
    sys.exit("REPORT " + " ".join(f"{k}={v}" for k, v in report.items()))


if __name__ == "__main__":
    main()
