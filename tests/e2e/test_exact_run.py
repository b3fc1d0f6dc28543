"""configs/tiny-arith-exact.toml run for real (`steadyrl run`, every service, Redis, async with
max_staleness 1): every token of every step equals the trainer's recompute under the version that
sampled it, bit for bit; at staleness 0 the mismatch KL is exactly 0 and every IS weight exactly 1;
the step line and the trainer's log say when the correction is the identity."""

import json

from tests.helpers import steadyrl_run


def test_the_exact_recipe_checks_every_token_bit_for_bit(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    settings = [
        "run.steps=8",
        "orchestrator.evals.every=4",
        "orchestrator.evals.size=20",
        "trainer.checkpoint.every=4",
    ]
    done = steadyrl_run("tiny-arith-exact.toml", out, settings, progress="none")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["steps"] == 8, summary
    resolved = (out / "config.resolved.toml").read_text()
    assert 'dtype = "float32"' in resolved and "exact = true" in resolved
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 9))
    for x in lines:
        assert x["exact_tokens"] == x["tokens"] > 0 and x["exact_unchecked_tokens"] == 0, x
        assert x["recipe"] in ("minirl+tis+clip+exact", "minirl+tis+clip+r2+exact"), x["recipe"]
        assert x.get("mismatch_kl_k3_s0", 0.0) == 0.0 and x.get("is_weight_mean_s0", 1.0) == 1.0, x
        if x["staleness_peak"] == 0:  # the whole step on-policy: the correction is the identity
            assert x["is_identity"] == 1.0 and x["is_weight_max"] == 1.0 and x["mismatch_kl_k3"] == 0.0, x
            assert x["routing_agreement"] == 1.0, x
        else:
            assert x["is_identity"] == 0.0
    assert lines[0]["staleness_peak"] == 0 and lines[0]["is_identity"] == 1.0  # version 0's rollouts
    log = (out / "logs" / "trainer.log").read_text()
    assert "the correction is the identity" in log
