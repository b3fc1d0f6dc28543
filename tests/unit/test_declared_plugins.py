"""A replica imports or runs only the plug-ins its run names (inference.plugins, from the recipe's
[orchestrator]): a task in Redis naming another is dead-lettered `undeclared` before anything loads."""

from types import SimpleNamespace

from services.inference.leased_work import undeclared_plugin
from steadyrl.recipe import declared_plugins


def test_every_plugin_the_orchestrator_table_names_is_declared_and_nothing_else():
    table = {
        "reward": "mine:score",
        "evals": {"reward": "mine:strict", "sets": [{"name": "x", "reward": "exact_match"}]},
        "trajectory": {"environment": "agent:python3 agent.py"},
        "data": {"mixture": [{"name": "a", "reward": "other.mod:fn"}, {"name": "b", "reward": "judge:verdict"}]},
        "sampling": {"temperature": 1.0},
        "note": "not:a reward",
    }
    assert declared_plugins(table) == {"mine:score", "mine:strict", "agent:python3 agent.py", "other.mod:fn"}


def test_a_task_naming_an_undeclared_plugin_is_named_and_built_ins_pass():
    def task(task_name="exact_match", environment=""):
        return SimpleNamespace(task_name=task_name, environment=environment)

    declared = {"mine:score", "agent:python3 agent.py"}
    assert undeclared_plugin(task(), declared) is None
    assert undeclared_plugin(task("mine:score"), declared) is None
    assert undeclared_plugin(task("judge:verdict"), declared) is None  # the judge pool's: no import
    assert undeclared_plugin(task("exact_match", "calc"), declared) is None
    assert undeclared_plugin(task("exact_match", "agent:python3 agent.py"), declared) is None
    assert undeclared_plugin(task("pydoc:pipepager"), declared) == "pydoc:pipepager"
    assert undeclared_plugin(task("exact_match", "agent:rm -rf ~"), declared) == "agent:rm -rf ~"
    assert undeclared_plugin(task("exact_match", "evil:make"), set()) == "evil:make"
