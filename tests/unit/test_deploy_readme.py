"""The README's Deploy commands are the compose guide's own "Start it" steps (what a fresh clone needs: the key
pair and `.env` before `docker compose up`), and `scripts/containers` makes its keys and `.env` by those steps."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def deploy_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Deploy\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)[1]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_the_readme_deploys_a_fresh_clone_as_the_compose_guide_does():
    guide = (ROOT / "docs" / "guides" / "deploy-compose.md").read_text()
    start = guide.split("## Start it\n", 1)[1].split("\n## ", 1)[0]
    commands = deploy_commands()
    assert commands[-1] == "docker compose up --build --scale inference=2", commands
    assert {".venv/bin/steadyrl keys keys/", "cp deploy/env.example .env"} <= set(commands)
    assert [c for c in commands if c not in start] == [], "commands the guide's Start it does not give"
    section = (ROOT / "README.md").read_text().split("\n## Deploy\n", 1)[1].split("\n## ", 1)[0]
    assert not re.search(r"\d+-step", section)  # the container check's length is STEADYRL_CONTAINERS_STEPS'


def test_the_container_check_makes_its_keys_and_env_as_the_guide_does():
    script = (ROOT / "scripts" / "containers").read_text()
    env_file = script.split("\nenv_file() {\n", 1)[1].split("\n}\n", 1)[0]
    assert "steadyrl_cli keys" in env_file and "cp deploy/env.example" in env_file
    assert env_file.count("steadyrl_cli secret") == 3  # the token and the two passwords
