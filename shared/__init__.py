"""steadyrl shared library: math, rollout records, models, queues, rpc."""
