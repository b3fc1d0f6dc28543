"""The Redis keys of a run are declared once (shared/runstore/keys.py) and printed by
docs/reference/redis-keys.md, which docs/ARCHITECTURE.md links; every hash field the services write
is a declared one."""

import re
from pathlib import Path

from shared.runstore.keys import KEYS, RunField, RunKeys, TrainerField, markdown_table

ROOT = Path(__file__).resolve().parents[2]


def test_the_reference_page_prints_the_declaration_and_the_architecture_links_it():
    table = markdown_table()
    assert "| `rollouts` | STREAM |" in table and "`published_version`" in table
    assert table in (ROOT / "docs" / "reference" / "redis-keys.md").read_text()
    assert "(reference/redis-keys.md)" in (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def test_keys_and_fields():
    keys = RunKeys("demo")
    assert keys.rollouts == "steadyrl:demo:rollouts" and keys.pending_policy == "steadyrl:demo:pending:policy"
    assert set(keys.all()) == set(KEYS) and len({k.suffix for k in KEYS.values()}) == len(KEYS)
    assert RunField.STATE == "state" and f"{TrainerField.PUBLISHED_VERSION}" == "published_version"


def test_no_hash_field_is_written_as_a_bare_string():
    """hset/hget/hmget/hsetnx/hincrby on the run or trainer hash name their field by the enums."""
    call = re.compile(r"\.(?:hset|hget|hmget|hsetnx|hincrby)\(self\.keys\.(?:run|trainer),\s*(\"|\[\"|mapping=\{\")")
    assert call.search('await self.redis.hget(self.keys.run, "state")')  # what it catches
    bare = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in sorted((ROOT / "services").rglob("*.py"))
        for m in call.finditer(p.read_text())
    ]
    assert not bare, bare
