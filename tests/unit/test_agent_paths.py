"""What of the host an agent program's command makes its own (`isolation.program_paths`): its virtual environment
and interpreter, the files it names with their directory, a `-m` package; never the home directory, a directory
above it, ~/.local or the temporary directory, where a named file is taken alone."""

import os
import sys
from pathlib import Path

from shared.envs.isolation import program_paths

SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def test_a_virtual_environment_its_interpreter_and_the_named_script_directory(tmp_path):
    venv = tmp_path / "opt" / "agents" / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    script = tmp_path / "opt" / "agents" / "myagent.py"
    script.write_text("print(1)")
    found = program_paths([str(venv / "bin" / "python"), str(script), "--turns", "3"], str(tmp_path), SYSTEM_PATH)
    real = Path(os.path.realpath(sys.executable))
    prefix = [] if str(real).startswith("/usr/") else [real.parent.parent]  # the interpreter's own prefix
    assert found == [venv, *prefix, script.parent]


def test_a_module_in_the_working_directory_and_relative_paths(tmp_path):
    (tmp_path / "agentpkg").mkdir()
    (tmp_path / "agentpkg" / "run.py").write_text("")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "calc.py").write_text("")
    found = program_paths(["python3", "-m", "agentpkg.run", "tools/calc.py", "missing.txt"], str(tmp_path), SYSTEM_PATH)
    assert found == [tmp_path / "agentpkg", tmp_path / "tools"]


def test_the_home_directory_and_broad_directories_are_never_taken_whole(tmp_path, monkeypatch):
    home = tmp_path / "home" / "user"
    (home / ".local" / "bin").mkdir(parents=True)
    (home / ".ssh").mkdir()
    tool = home / ".local" / "bin" / "agent-tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    (home / "agent.py").write_text("")
    monkeypatch.setenv("HOME", str(home))
    command = [str(tool), str(home / "agent.py"), str(home), str(home.parent), "/", "/tmp", "/etc"]
    found = program_paths(command, "/", SYSTEM_PATH)
    assert found == [home / ".local" / "bin", home / "agent.py"]


def test_an_argument_that_cannot_be_a_path_names_nothing(tmp_path):
    """A long `-c` program (past the file-name limit) or a NUL in an argument is not a path: no crash."""
    (tmp_path / "agent.py").write_text("print(1)")
    words = ["sh", "-c", "x" * 5000, "a\x00b", "agent.py"]
    assert program_paths(words, str(tmp_path), "/usr/bin:/bin") == [tmp_path]


def test_a_file_named_in_a_hidden_directory_of_home_is_bound_alone(tmp_path, monkeypatch):
    """A recipe naming one file in ~/.ssh (or ~/.aws, ~/.config/...) shows that file, never the key
    beside it; a hidden directory named whole is not bound at all (read_only_paths binds one on purpose)."""
    home = tmp_path / "home"
    secrets = home / ".ssh_like"
    secrets.mkdir(parents=True)
    (secrets / "known_hosts").write_text("host")
    (secrets / "id_ed25519").write_text("KEY")
    monkeypatch.setenv("HOME", str(home))
    found = program_paths(["sh", str(secrets / "known_hosts"), str(secrets)], str(tmp_path), SYSTEM_PATH)
    assert found == [secrets / "known_hosts"]
    work = tmp_path / "work" / "agents"
    work.mkdir(parents=True)
    (work / "agent.py").write_text("")
    assert program_paths(["sh", str(work / "agent.py")], str(tmp_path), SYSTEM_PATH) == [work]
