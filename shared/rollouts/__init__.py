"""The rollout record and what makes it: the record, its codec and validation (`record.py`), an
engine's samples as rollouts (`samples.py`), sampling parameters and their bounds (`sampling.py`),
and the interfaces rollouts travel through (`interfaces.py`)."""
